//! The labelled table.

use std::io::Write;

/// One variant's timings (seconds, one per round).
pub struct Row {
    /// What ran.
    pub label: String,
    /// Bytes one run of it reads.
    pub bytes: u64,
    /// Store calls one run of it makes (per client; 0 when not meaningful).
    pub calls: u64,
    /// Seconds per round.
    pub times: Vec<f64>,
    /// Seconds per round until layer 0 was ready (its group's call returned; the read
    /// session's start included): ranged reads only.
    pub firsts: Vec<f64>,
    /// Seconds per round of layer 0's call alone (`firsts` without the read session's start).
    pub first_calls: Vec<f64>,
}

/// The median (the mean of the two middle values of an even count); NaN when empty.
fn middle(v: &[f64]) -> f64 {
    kvlink_rig::measure::median(&mut v.to_vec())
}

impl Row {
    /// Median seconds.
    pub fn median(&self) -> f64 {
        middle(&self.times)
    }

    /// Median seconds until layer 0 was ready (NaN when not a ranged read).
    pub fn first_median(&self) -> f64 {
        middle(&self.firsts)
    }

    /// Median seconds of layer 0's call alone (NaN when not a ranged read).
    pub fn first_call_median(&self) -> f64 {
        middle(&self.first_calls)
    }

    fn min_max(&self) -> (f64, f64) {
        let min = self.times.iter().copied().fold(f64::INFINITY, f64::min);
        let max = self.times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (min, max)
    }
}

/// Prints the table; ratios are against the row labelled `baseline` (if present).
pub fn table(out: &mut impl Write, rows: &[Row], baseline: Option<&str>) -> std::io::Result<()> {
    let base = baseline
        .and_then(|b| rows.iter().find(|r| r.label == b))
        .map(Row::median);
    writeln!(
        out,
        "| one client reads every layer of every object | calls | median ms | min–max ms | GB/s (median) | GB/s (best) | median / baseline median |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|")?;
    for r in rows {
        let m = r.median();
        let (lo, hi) = r.min_max();
        let ratio = base.map_or("—".into(), |b| format!("{:.2}", m / b));
        let calls = if r.calls == 0 {
            "—".into()
        } else {
            r.calls.to_string()
        };
        writeln!(
            out,
            "| {} | {calls} | {:.0} | {:.0}–{:.0} | {:.2} | {:.2} | {ratio} |",
            r.label,
            m * 1e3,
            lo * 1e3,
            hi * 1e3,
            r.bytes as f64 / m / 1e9,
            r.bytes as f64 / lo / 1e9,
        )?;
    }
    Ok(())
}
