//! Progress bars on stderr (indicatif), drawn only when stderr is a terminal (nothing at all
//! otherwise, so logs and pipes stay clean).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// One bar; `inc` may be called from any thread.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar of `total` `unit`s, shown only when stderr is a terminal.
    pub fn new(label: &str, total: u64, unit: &'static str) -> Self {
        Self::with_target(label, total, unit, ProgressDrawTarget::stderr())
    }

    /// A bar that draws when `enabled` (and stderr is a terminal).
    pub fn with_enabled(label: &str, total: u64, unit: &'static str, enabled: bool) -> Self {
        let target = if enabled {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        Self::with_target(label, total, unit, target)
    }

    fn with_target(label: &str, total: u64, unit: &str, target: ProgressDrawTarget) -> Self {
        let template = format!(
            "{{prefix:<24}} [{{bar:30}}] {{percent:>3}}%  {{pos}}/{{len}} {unit}  {{elapsed_precise}}"
        );
        let style = ProgressStyle::with_template(&template)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("#>-");
        let bar = ProgressBar::with_draw_target(Some(total.max(1)), target)
            .with_style(style)
            .with_prefix(label.to_string());
        Progress { bar }
    }

    /// `n` more units done.
    pub fn inc(&self, n: u64) {
        self.bar.inc(n);
    }

    /// Draws the final state and ends the line.
    pub fn finish(&self) {
        self.bar.finish();
    }
}
