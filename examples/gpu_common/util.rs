//! The result table, byte patterns, per-rank threads, timing helpers, markdown tables.
//!
//! Shared by the `gpu_check`, `tp_gpu` and `mooncake_modes` examples (each `#[path]`-includes
//! it and uses a subset, hence the `dead_code` allowance). Everything but the CUDA timing
//! event builds without the `cuda` feature.
#![allow(dead_code)]

use std::fmt::Write as _;
#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use kvlink::kv_device::cuda::cudarc::driver::{sys, CudaEvent, CudaStream};
use kvlink::kv_device::DeviceError;

/// Outcome of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Checked and right.
    Pass,
    /// Checked and wrong (or it errored).
    Fail,
    /// Not run here (too few GPUs, not enough memory, out of time).
    Skip,
    /// A measurement or a fact.
    Info,
}

/// One row of the table.
#[derive(Debug, Clone)]
pub struct Row {
    pub section: &'static str,
    pub name: String,
    pub status: Status,
    pub value: String,
}

/// Rows in the order they were produced (each also logged to stderr as it comes, so a run
/// cut short still leaves its rows in the log).
#[derive(Debug, Default)]
pub struct Report {
    pub rows: Vec<Row>,
}

impl Report {
    pub fn push(
        &mut self,
        section: &'static str,
        name: impl Into<String>,
        status: Status,
        value: impl Into<String>,
    ) {
        let row = Row {
            section,
            name: name.into(),
            status,
            value: value.into(),
        };
        eprintln!(
            "[{:?}] {} / {}: {}",
            row.status, row.section, row.name, row.value
        );
        self.rows.push(row);
    }

    pub fn info(
        &mut self,
        section: &'static str,
        name: impl Into<String>,
        value: impl Into<String>,
    ) {
        self.push(section, name, Status::Info, value);
    }

    /// `Ok(detail)` → PASS, `Err` → FAIL; a panic inside `f` is caught → FAIL. Returns
    /// whether it passed.
    pub fn check<F>(&mut self, section: &'static str, name: &str, f: F) -> bool
    where
        F: FnOnce() -> Result<String, String>,
    {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(Ok(v)) => {
                self.push(section, name, Status::Pass, v);
                true
            }
            Ok(Err(e)) => {
                self.push(section, name, Status::Fail, e);
                false
            }
            Err(p) => {
                self.push(
                    section,
                    name,
                    Status::Fail,
                    format!("PANIC: {}", panic_msg(&*p)),
                );
                false
            }
        }
    }

    pub fn failed(&self) -> bool {
        self.rows.iter().any(|r| r.status == Status::Fail)
    }

    pub fn table(&self) -> String {
        let w_sec = self.rows.iter().map(|r| r.section.len()).max().unwrap_or(7);
        let w_sec = w_sec.max(7);
        let w_name = self.rows.iter().map(|r| r.name.len()).max().unwrap_or(5);
        let w_name = w_name.max(5);
        let mut s = String::new();
        let _ = writeln!(
            s,
            "{:<w_sec$}  {:<w_name$}  {:<6}  value",
            "section", "check", "result"
        );
        let _ = writeln!(s, "{}", "-".repeat(w_sec + w_name + 20));
        for r in &self.rows {
            let st = match r.status {
                Status::Pass => "PASS",
                Status::Fail => "FAIL",
                Status::Skip => "SKIP",
                Status::Info => "info",
            };
            let _ = writeln!(
                s,
                "{:<w_sec$}  {:<w_name$}  {:<6}  {}",
                r.section, r.name, st, r.value
            );
        }
        let count = |st: Status| self.rows.iter().filter(|r| r.status == st).count();
        let _ = writeln!(s, "{} skipped", count(Status::Skip));
        let _ = writeln!(
            s,
            "{} passed, {} failed",
            count(Status::Pass),
            count(Status::Fail)
        );
        s
    }
}

/// The text of a panic payload.
pub fn panic_msg(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "panic".into())
}

/// Error text of a device error.
pub fn de(e: DeviceError) -> String {
    e.to_string()
}

/// Runs `f(rank)` on one thread per rank, all at once, and returns every rank's result in
/// rank order (a panicking rank gives an `Err`).
pub fn on_ranks<T, F>(n: usize, f: F) -> Vec<Result<T, String>>
where
    T: Send,
    F: Fn(usize) -> Result<T, String> + Sync,
{
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("tp_gpu-r{r}"))
                    .spawn_scoped(s, move || f(r))
            })
            .collect();
        hs.into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|p| Err(format!("rank thread panicked: {}", panic_msg(&*p)))),
                Err(e) => Err(format!("spawning a rank thread: {e}")),
            })
            .collect()
    })
}

/// Every rank's `Ok`, or the first error prefixed with its rank.
pub fn all_ok<T>(v: Vec<Result<T, String>>) -> Result<Vec<T>, String> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| x.map_err(|e| format!("rank {r}: {e}")))
        .collect()
}

/// A deterministic row of `len` bytes for (tag, layer, page): 64-bit words mixing the three
/// with the word index; any misplaced row or byte shows. (The same pattern as gpu_check.)
pub fn fill_row(out: &mut [u8], tag: u64, layer: u32, page: u64) {
    let seed = (tag << 56) ^ (u64::from(layer) << 40) ^ page.wrapping_mul(0x9E37_79B9);
    let mut chunks = out.chunks_exact_mut(8);
    let mut k = 0u64;
    for c in &mut chunks {
        let w = seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        c.copy_from_slice(&w.to_le_bytes());
        k += 1;
    }
    let rest = chunks.into_remainder();
    let w = (seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&w[..n]);
}

/// Records a timing event on `stream`.
#[cfg(feature = "cuda")]
pub fn timing_event(stream: &Arc<CudaStream>) -> Result<CudaEvent, String> {
    stream
        .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| format!("cuEventRecord: {e}"))
}

/// Median of `v` (sorted in place); NaN when empty.
pub fn median(v: &mut [f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
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

/// A small deterministic PRNG (xorshift) for slot permutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// `n` distinct slots out of `0..pages`, scattered.
    pub fn scattered_slots(&mut self, n: usize, pages: u32) -> Vec<u32> {
        let mut all: Vec<u32> = (0..pages).collect();
        for i in (1..all.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}

/// A markdown table (`|` separated, header rule).
pub struct Markdown {
    head: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Markdown {
    pub fn new(head: &[&str]) -> Self {
        Markdown {
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

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

/// A barrier whose wait gives up after a timeout, so that a rank that failed before reaching
/// it (and so never arrives) makes the others fail instead of hang.
pub struct TimedBarrier {
    n: usize,
    state: std::sync::Mutex<(usize, u64)>,
    cv: std::sync::Condvar,
}

impl TimedBarrier {
    pub fn new(n: usize) -> Self {
        TimedBarrier {
            n,
            state: std::sync::Mutex::new((0, 0)),
            cv: std::sync::Condvar::new(),
        }
    }

    /// Waits until all `n` ranks arrived, or `Err` after `timeout`.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<(), String> {
        let mut s = self.state.lock().map_err(|_| "barrier poisoned")?;
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let (s, r) = self
            .cv
            .wait_timeout_while(s, timeout, |s| s.1 == generation)
            .map_err(|_| "barrier poisoned")?;
        if r.timed_out() && s.1 == generation {
            return Err(format!(
                "a peer rank did not arrive within {timeout:?} (it failed earlier)"
            ));
        }
        Ok(())
    }
}
