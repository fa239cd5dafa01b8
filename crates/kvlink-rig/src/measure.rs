//! Measuring and printing numbers: medians, GB/s, sizes and token counts as the docs write
//! them, markdown tables, and (with `cuda`) a timing event.

use std::fmt::Write as _;
#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use kv_device::cuda::cudarc::driver::{sys, CudaEvent, CudaStream};

/// Records a timing event on `stream`.
#[cfg(feature = "cuda")]
pub fn timing_event(stream: &Arc<CudaStream>) -> Result<CudaEvent, String> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| format!("cuEventRecord: {e}"))
}

/// Median of `v` (sorted in place): the middle value, or the mean of the two middle values
/// for an even count; NaN when empty.
///
/// ```
/// use kvlink_rig::measure::median;
/// assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
/// assert_eq!(median(&mut [10.0, 20.0]), 15.0);
/// assert!(median(&mut []).is_nan());
/// ```
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2.0
    } else {
        v[mid]
    }
}

/// GB/s for `bytes` moved in `ms` milliseconds.
pub fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms * 1e-3) / 1e9
}

/// Bytes in decimal units (7.07 GB, as the docs write sizes).
pub fn fmt_bytes(n: u64) -> String {
    let x = n as f64;
    if x >= 1e9 {
        format!("{:.2} GB", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} MB", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1} kB", x / 1e3)
    } else {
        format!("{x:.0} B")
    }
}

/// `131072` tokens → `128K`.
pub fn fmt_tokens(tokens: u64) -> String {
    if tokens.is_multiple_of(1024) {
        format!("{}K", tokens / 1024)
    } else {
        tokens.to_string()
    }
}

/// A markdown table (`|` separated, header rule).
pub struct Markdown {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Markdown {
    /// A table with these column heads.
    pub fn new(head: &[&str]) -> Self {
        Markdown {
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    /// Adds a row of cells.
    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    /// The table as markdown text.
    pub fn render(&self) -> String {
        let n = self.head.len();
        let cell = |r: &[String], i: usize| r.get(i).cloned().unwrap_or_default();
        let mut w: Vec<usize> = self.head.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, wi) in w.iter_mut().enumerate() {
                *wi = (*wi).max(cell(r, i).chars().count());
            }
        }
        let line = |cells: &[String]| {
            let mut s = String::from("|");
            for (i, wi) in w.iter().enumerate() {
                let c = cell(cells, i);
                let pad = wi.saturating_sub(c.chars().count());
                let _ = write!(s, " {c}{} |", " ".repeat(pad));
            }
            s
        };
        let mut out = line(&self.head);
        out.push('\n');
        out.push('|');
        for wi in w.iter().take(n) {
            let _ = write!(out, "{}|", "-".repeat(wi + 2));
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }
}
