//! The result table, byte patterns, timing helpers.

use std::fmt::Write as _;
use std::sync::Arc;

use kvlink::kv_device::cuda::cudarc::driver::{sys, CudaStream};
use kvlink::kv_device::DeviceError;

/// Outcome of one row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Checked and right.
    Pass,
    /// Checked and wrong (or it errored).
    Fail,
    /// Not run here (e.g. needs two GPUs).
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

/// Rows in the order they were produced.
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

    /// `Ok(detail)` → PASS, `Err` → FAIL with the error; a panic inside `f` is caught → FAIL.
    pub fn check<F>(&mut self, section: &'static str, name: &str, f: F)
    where
        F: FnOnce() -> Result<String, String>,
    {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
        match r {
            Ok(Ok(v)) => self.push(section, name, Status::Pass, v),
            Ok(Err(e)) => self.push(section, name, Status::Fail, e),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "panic".into());
                self.push(section, name, Status::Fail, format!("PANIC: {msg}"));
            }
        }
    }

    pub fn table(&self) -> String {
        let w_sec = self
            .rows
            .iter()
            .map(|r| r.section.len())
            .max()
            .unwrap_or(7)
            .max(7);
        let w_name = self
            .rows
            .iter()
            .map(|r| r.name.len())
            .max()
            .unwrap_or(5)
            .max(5);
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
        let pass = self
            .rows
            .iter()
            .filter(|r| r.status == Status::Pass)
            .count();
        let fail = self
            .rows
            .iter()
            .filter(|r| r.status == Status::Fail)
            .count();
        let skip = self
            .rows
            .iter()
            .filter(|r| r.status == Status::Skip)
            .count();
        let _ = writeln!(s, "{pass} passed, {fail} failed, {skip} skipped");
        s
    }
}

/// Error text of a device error.
pub fn de(e: DeviceError) -> String {
    e.to_string()
}

/// A deterministic row of `len` bytes for (tag, layer, page): 64-bit words mixing the three
/// with the word index; any misplaced row or byte shows.
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
pub fn timing_event(
    stream: &Arc<CudaStream>,
) -> Result<kvlink::kv_device::cuda::cudarc::driver::CudaEvent, String> {
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

/// A small deterministic PRNG (xorshift) for slot permutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0;
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
