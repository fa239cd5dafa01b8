//! A small progress bar on stderr, redrawn in place with `\r` at most 20 times a second, only
//! when stderr is a terminal (nothing at all otherwise, so logs and pipes stay clean).

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const WIDTH: usize = 30;
const EVERY: Duration = Duration::from_millis(50);

/// One bar; `inc` may be called from any thread.
pub struct Progress {
    label: String,
    unit: &'static str,
    total: u64,
    done: AtomicU64,
    enabled: bool,
    started: Instant,
    last: Mutex<Option<Instant>>,
}

impl Progress {
    /// A bar of `total` `unit`s, shown only when stderr is a terminal.
    pub fn new(label: &str, total: u64, unit: &'static str) -> Self {
        Self::with_enabled(label, total, unit, std::io::stderr().is_terminal())
    }

    /// A bar that draws when `enabled`.
    pub fn with_enabled(label: &str, total: u64, unit: &'static str, enabled: bool) -> Self {
        let p = Progress {
            label: label.to_string(),
            unit,
            total: total.max(1),
            done: AtomicU64::new(0),
            enabled,
            started: Instant::now(),
            last: Mutex::new(None),
        };
        p.draw(0);
        p
    }

    /// `n` more units done.
    pub fn inc(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if !self.enabled {
            return;
        }
        // Whoever holds the lock draws; others skip (the next call catches up).
        if let Ok(mut last) = self.last.try_lock() {
            let now = Instant::now();
            if done >= self.total || last.is_none_or(|t| now - t >= EVERY) {
                *last = Some(now);
                self.draw(done);
            }
        }
    }

    fn draw(&self, done: u64) {
        if !self.enabled {
            return;
        }
        let done = done.min(self.total);
        let filled = (done as usize * WIDTH) / self.total as usize;
        let bar: String = "#".repeat(filled) + &"-".repeat(WIDTH - filled);
        let line = format!(
            "\r{:<24} [{bar}] {:>3}%  {done}/{} {}  {:.1} s ",
            self.label,
            done * 100 / self.total,
            self.total,
            self.unit,
            self.started.elapsed().as_secs_f64()
        );
        let mut err = std::io::stderr().lock();
        let _ = err.write_all(line.as_bytes());
        let _ = err.flush();
    }

    /// Draws the final state and ends the line.
    pub fn finish(&self) {
        if self.enabled {
            self.draw(self.done.load(Ordering::Relaxed));
            let _ = std::io::stderr().write_all(b"\n");
        }
    }
}
