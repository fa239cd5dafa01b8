//! `Auto`'s state in one place: the bandwidths it decides from (configured, refined by what
//! this rank measures), each mode's measured time per landed byte, and the mode it keeps.

use std::time::Duration;

use dedup_broadcast::{choose_mode, layer_times, Bandwidths, ModeChoice};
use kv_loader::ShareMode;
use parking_lot::Mutex;

/// Weight of a new observation in the running averages.
const EWMA: f64 = 0.2;
/// Reads or exchanges smaller than this say more about latency than bandwidth: ignored.
const MIN_BYTES: u64 = 1 << 20;

fn blend(old: f64, new: f64) -> f64 {
    if old.is_finite() && old > 0.0 {
        old * (1.0 - EWMA) + new * EWMA
    } else {
        new
    }
}

fn gbps(bytes: u64, took: Duration) -> Option<f64> {
    let secs = took.as_secs_f64();
    (bytes >= MIN_BYTES && secs > 0.0).then(|| bytes as f64 / secs / 1e9)
}

/// What `Auto` has seen so far.
#[derive(Debug)]
struct Seen {
    /// Bandwidths now: configured, refined by measurement.
    measured: Bandwidths,
    /// Seconds per landed byte of each mode (AllRanks, Rank0Broadcast, SplitAllGather), a
    /// running average.
    seconds_per_byte: [Option<f64>; 3],
    /// The mode `Auto` settled on, once it has measured every mode.
    kept: Option<ShareMode>,
}

/// How a linker picks each batch's share mode, and what it measured to do so.
#[derive(Debug)]
pub(crate) struct AutoMode {
    choice: ModeChoice,
    configured: Bandwidths,
    seen: Mutex<Seen>,
}

impl AutoMode {
    pub(crate) fn new(choice: ModeChoice, configured: Bandwidths) -> Self {
        AutoMode {
            choice,
            configured,
            seen: Mutex::new(Seen {
                measured: configured,
                seconds_per_byte: [None; 3],
                kept: None,
            }),
        }
    }

    /// The bandwidths now: configured, with the store's per-rank figure and the fabric's
    /// refined from this rank's own layer reads and exchanges.
    pub(crate) fn bandwidths(&self) -> Bandwidths {
        self.seen.lock().measured
    }

    /// A layer read of `bytes` took `took` on this rank.
    pub(crate) fn observe_store_read(&self, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            let mut seen = self.seen.lock();
            let m = &mut seen.measured;
            m.store_per_rank_gbps = blend(m.store_per_rank_gbps, g);
        }
    }

    /// A collective moved a `bytes` region in `took`.
    pub(crate) fn observe_fabric(&self, mode: ShareMode, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            let mut seen = self.seen.lock();
            let m = &mut seen.measured;
            match mode {
                ShareMode::Rank0Broadcast => {
                    m.fabric_broadcast_gbps = blend(m.fabric_broadcast_gbps, g)
                }
                ShareMode::SplitAllGather => {
                    m.fabric_all_gather_gbps = blend(m.fabric_all_gather_gbps, g)
                }
                ShareMode::AllRanks => {}
            }
        }
    }
}

/// `Auto` leaves the mode it keeps only for one measured this much faster (hysteresis, so
/// noise does not flip it from batch to batch).
pub(crate) const AUTO_SWITCH_GAIN: f64 = 0.9;

/// The mode with the lowest measured seconds per byte, staying with `kept` unless the best
/// beats it by [`AUTO_SWITCH_GAIN`].
fn pick_measured(seen: &[Option<f64>; 3], kept: Option<ShareMode>) -> ShareMode {
    let time = |m: ShareMode| seen[slot(m)].unwrap_or(f64::MAX);
    let best = AUTO_MODES
        .iter()
        .copied()
        .min_by(|a, b| time(*a).total_cmp(&time(*b)))
        .unwrap_or(ShareMode::AllRanks);
    match kept {
        Some(k) if time(best) >= time(k) * AUTO_SWITCH_GAIN => k,
        _ => best,
    }
}

/// Modes `Auto` tries, in the order it explores them.
const AUTO_MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

fn slot(mode: ShareMode) -> usize {
    match mode {
        ShareMode::AllRanks => 0,
        ShareMode::Rank0Broadcast => 1,
        ShareMode::SplitAllGather => 2,
    }
}

fn all_known(bw: &Bandwidths) -> bool {
    [
        bw.store_per_rank_gbps,
        bw.store_aggregate_gbps,
        bw.fabric_broadcast_gbps,
        bw.fabric_all_gather_gbps,
    ]
    .iter()
    .all(|v| v.is_finite() && *v > 0.0)
}

impl AutoMode {
    /// This rank's proposal for the next batch, and why. Fixed modes are proposed as they
    /// are. `Auto`: from the time model when every bandwidth is configured; otherwise it
    /// measures: each mode runs once (explore), then the mode with the lowest measured
    /// time per landed byte wins (only rank 0's proposal is used, so rank 0's measurements
    /// decide for the group).
    pub(crate) fn propose(&self, tp_size: u32, bytes_per_layer: u64) -> (ShareMode, String) {
        let bw = self.bandwidths();
        if self.choice != ModeChoice::Auto || all_known(&self.configured) {
            return choose_mode(self.choice, &bw, tp_size, bytes_per_layer);
        }
        let mut s = self.seen.lock();
        let seen = s.seconds_per_byte;
        if let Some(m) = AUTO_MODES.iter().find(|m| seen[slot(**m)].is_none()) {
            return (
                *m,
                format!("Auto: measuring {m:?} (no batch ran in it yet)"),
            );
        }
        let best = pick_measured(&seen, s.kept);
        s.kept = Some(best);
        drop(s);
        let ns = |m: ShareMode| seen[slot(m)].map_or(f64::NAN, |v| v * 1e9);
        let model = layer_times(&bw, tp_size, bytes_per_layer);
        (
            best,
            format!(
                "Auto: measured ns per landed byte AllRanks {:.3}, Rank0Broadcast {:.3}, SplitAllGather {:.3} (model: {:?})",
                ns(ShareMode::AllRanks),
                ns(ShareMode::Rank0Broadcast),
                ns(ShareMode::SplitAllGather),
                model
            ),
        )
    }

    /// A batch of `mode` landed `bytes` in `took` (start to last layer) on this rank.
    pub(crate) fn observe_batch(&self, mode: ShareMode, bytes: u64, took: Duration) {
        if bytes < MIN_BYTES {
            return;
        }
        let v = took.as_secs_f64() / bytes as f64;
        let mut seen = self.seen.lock();
        let s = &mut seen.seconds_per_byte[slot(mode)];
        *s = Some(s.map_or(v, |old| blend(old, v)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_keeps_its_mode_unless_another_is_clearly_faster() {
        let seen = [Some(3.0), Some(2.0), Some(1.9)];
        assert_eq!(pick_measured(&seen, None), ShareMode::SplitAllGather);
        // 1.9 is within 10 % of 2.0: stay.
        assert_eq!(
            pick_measured(&seen, Some(ShareMode::Rank0Broadcast)),
            ShareMode::Rank0Broadcast
        );
        // 1.5 is clearly faster than 2.0: switch.
        let seen = [Some(3.0), Some(2.0), Some(1.5)];
        assert_eq!(
            pick_measured(&seen, Some(ShareMode::Rank0Broadcast)),
            ShareMode::SplitAllGather
        );
        assert_eq!(
            pick_measured(&seen, Some(ShareMode::AllRanks)),
            ShareMode::SplitAllGather
        );
    }
}
