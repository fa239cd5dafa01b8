//! `Auto`'s state in one place: the bandwidths it decides from when all are configured, else
//! each mode's measured time per landed byte, and the mode it keeps.
//!
//! **How `Auto` measures** (when any bandwidth is unknown, the usual case): it runs batches in
//! each mode in rounds (`ShareMode::ALL` order, then again), timing
//! each batch from `start_load` to its last layer and dividing by the bytes landed. After the
//! first round, a mode whose time is more than [`AUTO_DROP`] times the best is not measured
//! again (noise of a shared host is ±20 %, not 50 %). When every remaining mode has
//! `auto_batches_per_mode` batches, it keeps for good the mode with the lowest **median**; a
//! mode within [`AUTO_TIE`] of that median is taken as equally fast, and then the one reading
//! fewer store bytes per rank wins (each mode's `tie_rank`: `SplitAllGather`, then
//! `Rank0Broadcast`, then `AllRanks`),
//! so two runs whose medians differ by noise still keep the same mode. Cost: with the default
//! of 3 batches per mode, at most 9 batches, 7 when one mode drops out, 5 when two do.
//!
//! Only rank 0's proposal is used (the ranks exchange proposals at the gate), so rank 0's
//! measurements decide for the group; every rank still keeps its own state.

use std::time::Duration;

use dedup_broadcast::choose_mode;
use kv_loader::{Bandwidths, ModeChoice, ShareMode};
use parking_lot::Mutex;

/// Weight of a new observation in the running bandwidth averages.
const EWMA: f64 = 0.2;
/// Reads or exchanges smaller than this say more about latency than bandwidth: ignored.
const MIN_BYTES: u64 = 1 << 20;

/// After the first round, modes slower than this many times the best are not measured again.
pub(crate) const AUTO_DROP: f64 = 1.5;
/// Modes whose median is within this fraction of the best median count as equally fast.
pub(crate) const AUTO_TIE: f64 = 0.10;

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

/// Modes `Auto` measures, in the order of each round.
const AUTO_MODES: [ShareMode; ShareMode::COUNT] = ShareMode::ALL;

/// Among equally fast modes, the first of these wins: fewest store bytes on any one rank
/// (each mode's `tie_rank`).
fn preference() -> [ShareMode; ShareMode::COUNT] {
    let mut p = ShareMode::ALL;
    p.sort_by_key(|m| m.spec().tie_rank);
    p
}

fn slot(mode: ShareMode) -> usize {
    mode.index()
}

fn median(v: &[f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    Some(if s.len() % 2 == 1 {
        s[m]
    } else {
        0.5 * (s[m - 1] + s[m])
    })
}

/// What `Auto` has measured, and what it decided.
#[derive(Debug, Default, Clone)]
pub(crate) struct Measured {
    /// Seconds per landed byte of each batch, per mode (by [`ShareMode::index`]).
    samples: [Vec<f64>; ShareMode::COUNT],
    /// Modes no longer measured (clearly slower after the first round).
    dropped: [bool; ShareMode::COUNT],
    /// The mode kept for good.
    kept: Option<ShareMode>,
}

impl Measured {
    fn live(&self) -> impl Iterator<Item = ShareMode> + '_ {
        AUTO_MODES
            .iter()
            .copied()
            .filter(|m| !self.dropped[slot(*m)])
    }

    fn median(&self, m: ShareMode) -> Option<f64> {
        median(&self.samples[slot(m)])
    }

    /// Records a batch: drops clearly slower modes once every mode has run once, and keeps a
    /// mode for good once every remaining one has `per_mode` batches.
    pub(crate) fn record(&mut self, mode: ShareMode, seconds_per_byte: f64, per_mode: u32) {
        if self.kept.is_some() {
            return;
        }
        self.samples[slot(mode)].push(seconds_per_byte);
        if AUTO_MODES
            .iter()
            .all(|m| !self.samples[slot(*m)].is_empty())
        {
            let best = self.best();
            for m in AUTO_MODES {
                if self.median(m).is_some_and(|t| t > best * AUTO_DROP) {
                    self.dropped[slot(m)] = true;
                }
            }
        }
        let enough = per_mode.max(1) as usize;
        if self.live().all(|m| self.samples[slot(m)].len() >= enough) {
            let best = self.best();
            let kept = preference()
                .into_iter()
                .filter(|m| !self.dropped[slot(*m)])
                .find(|m| {
                    self.median(*m)
                        .is_some_and(|t| t <= best * (1.0 + AUTO_TIE))
                })
                .unwrap_or(ShareMode::AllRanks);
            self.kept = Some(kept);
        }
    }

    /// The lowest median of the modes still measured.
    fn best(&self) -> f64 {
        self.live()
            .filter_map(|m| self.median(m))
            .fold(f64::INFINITY, f64::min)
    }

    /// The next mode to propose: the kept one, else the live mode with the fewest batches
    /// (round order).
    pub(crate) fn next(&self) -> ShareMode {
        if let Some(k) = self.kept {
            return k;
        }
        self.live()
            .min_by_key(|m| self.samples[slot(*m)].len())
            .unwrap_or(ShareMode::AllRanks)
    }

    /// Medians in ns per landed byte, for logs.
    fn describe(&self) -> String {
        AUTO_MODES
            .iter()
            .map(|m| {
                let s = &self.samples[slot(*m)];
                let med = self
                    .median(*m)
                    .map_or("—".to_string(), |t| format!("{:.3}", t * 1e9));
                let drop = if self.dropped[slot(*m)] {
                    " (dropped)"
                } else {
                    ""
                };
                format!("{m:?} {med} ns/B over {} batches{drop}", s.len())
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// How a linker picks each batch's share mode, and what it measured to do so.
#[derive(Debug)]
pub(crate) struct AutoMode {
    choice: ModeChoice,
    configured: Bandwidths,
    per_mode: u32,
    measured_bw: Mutex<Bandwidths>,
    seen: Mutex<Measured>,
}

impl AutoMode {
    pub(crate) fn new(choice: ModeChoice, configured: Bandwidths, per_mode: u32) -> Self {
        AutoMode {
            choice,
            configured,
            per_mode: per_mode.max(1),
            measured_bw: Mutex::new(configured),
            seen: Mutex::new(Measured::default()),
        }
    }

    /// The bandwidths now: configured, with the store's per-rank figure and the fabric's
    /// refined from this rank's own reads and exchanges (for logs).
    pub(crate) fn bandwidths(&self) -> Bandwidths {
        *self.measured_bw.lock()
    }

    /// A store call of `bytes` took `took` on this rank.
    pub(crate) fn observe_store_read(&self, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            let mut m = self.measured_bw.lock();
            m.store_per_rank_gbps = blend(m.store_per_rank_gbps, g);
        }
    }

    /// A collective moved a `bytes` region in `took`.
    pub(crate) fn observe_fabric(&self, mode: ShareMode, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            if let Some(op) = mode.spec().fabric {
                let mut m = self.measured_bw.lock();
                let v = m.fabric_mut(op);
                *v = blend(*v, g);
            }
        }
    }
}

impl AutoMode {
    /// This rank's proposal for the next batch, and why. Fixed modes are proposed as they
    /// are. `Auto`: from the time model when every bandwidth is configured; otherwise as the
    /// module docs say.
    pub(crate) fn propose(&self, tp_size: u32, bytes_per_layer: u64) -> (ShareMode, String) {
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return choose_mode(self.choice, &self.configured, tp_size, bytes_per_layer);
        }
        if tp_size <= 1 {
            return (ShareMode::AllRanks, "one rank: nothing to share".into());
        }
        let s = self.seen.lock();
        let mode = s.next();
        let why = match s.kept {
            Some(_) => format!(
                "Auto: keeps {mode:?} ({}; this rank's reads ≈ {:.2} GB/s per call)",
                s.describe(),
                self.bandwidths().store_per_rank_gbps
            ),
            None => format!("Auto: measuring {mode:?} ({})", s.describe()),
        };
        (mode, why)
    }

    /// A batch of `mode` landed `bytes` in `took` (start to last layer) on this rank.
    pub(crate) fn observe_batch(&self, mode: ShareMode, bytes: u64, took: Duration) {
        if bytes < MIN_BYTES || took.is_zero() {
            return;
        }
        self.seen
            .lock()
            .record(mode, took.as_secs_f64() / bytes as f64, self.per_mode);
    }

    /// The mode kept, once decided.
    pub(crate) fn kept(&self) -> Option<ShareMode> {
        self.seen.lock().kept
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs the measuring phase with batch times `time(mode, i)`; returns the batches spent
    /// and the mode kept.
    fn decide(per_mode: u32, time: impl Fn(ShareMode, usize) -> f64) -> (usize, ShareMode) {
        let mut m = Measured::default();
        for batch in 1..100 {
            let mode = m.next();
            let i = m.samples[slot(mode)].len();
            m.record(mode, time(mode, i), per_mode);
            if let Some(k) = m.kept {
                return (batch, k);
            }
        }
        panic!("Auto never decided");
    }

    fn base(mode: ShareMode) -> f64 {
        match mode {
            ShareMode::AllRanks => 6.0,
            ShareMode::Rank0Broadcast => 2.5,
            ShareMode::SplitAllGather => 1.0,
        }
    }

    #[test]
    fn clearly_slower_modes_drop_out_after_one_round() {
        // TP 8 shape: AllRanks 6×, Rank0Broadcast 2.5× SplitAllGather: both drop.
        let (batches, kept) = decide(3, |m, _| base(m));
        assert_eq!(kept, ShareMode::SplitAllGather);
        assert_eq!(batches, 3 + 2);
        // Close modes are all measured 3 times.
        let (batches, kept) = decide(3, |m, _| match m {
            ShareMode::AllRanks => 1.2,
            ShareMode::Rank0Broadcast => 1.3,
            ShareMode::SplitAllGather => 1.0,
        });
        assert_eq!((batches, kept), (9, ShareMode::SplitAllGather));
    }

    #[test]
    fn one_outlier_batch_does_not_decide() {
        // AllRanks' second batch is a lucky outlier; its median stays slower.
        let (_, kept) = decide(3, |m, i| match (m, i) {
            (ShareMode::AllRanks, 1) => 0.5,
            (ShareMode::AllRanks, _) => 1.3,
            (ShareMode::Rank0Broadcast, _) => 1.2,
            (ShareMode::SplitAllGather, _) => 1.0,
        });
        assert_eq!(kept, ShareMode::SplitAllGather);
    }

    #[test]
    fn equally_fast_modes_go_to_the_one_reading_least() {
        let (_, kept) = decide(3, |m, _| match m {
            ShareMode::AllRanks => 1.0,
            ShareMode::Rank0Broadcast => 1.03,
            ShareMode::SplitAllGather => 1.2,
        });
        assert_eq!(kept, ShareMode::Rank0Broadcast);
    }

    proptest! {
        /// Two runs whose batch times differ by noise keep the same mode whenever the true
        /// best leads the next by more than the noise and the tie margin together, and never
        /// measure more than 3 batches per mode.
        #[test]
        fn two_noisy_runs_agree(
            times in prop::array::uniform3(1.0f64..4.0),
            noise_a in prop::collection::vec(-0.02f64..0.02, 9),
            noise_b in prop::collection::vec(-0.02f64..0.02, 9),
        ) {
            let t = |m: ShareMode| times[slot(m)];
            let run = |noise: &[f64]| decide(3, |m, i| t(m) * (1.0 + noise[slot(m) * 3 + i]));
            let (na, a) = run(&noise_a);
            let (nb, b) = run(&noise_b);
            prop_assert!(na <= 9 && nb <= 9);
            let mut sorted = times;
            sorted.sort_by(f64::total_cmp);
            // Separated: every pair of modes apart by more than the tie margin and the noise.
            let apart = |x: f64, y: f64| x.max(y) / x.min(y) > (1.0 + AUTO_TIE) * 1.05;
            let separated = apart(times[0], times[1]) && apart(times[1], times[2]) && apart(times[0], times[2]);
            if separated {
                prop_assert_eq!(a, b);
                // And the kept mode is within the tie margin (plus noise) of the fastest.
                prop_assert!(t(a) <= sorted[0] * (1.0 + AUTO_TIE) * 1.05);
            }
        }
    }
}
