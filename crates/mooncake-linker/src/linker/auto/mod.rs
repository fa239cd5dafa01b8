//! `Auto`'s state in one place: the bandwidths it decides from when all are configured, else
//! each mode's measured time per landed byte, and the mode it keeps.
//!
//! **How `Auto` measures** (when any bandwidth is unknown, the usual case): it runs batches in
//! each mode in rounds (`ShareMode::ALL` order first), timing each batch on the **slowest
//! rank** and dividing by the bytes landed. A rank's time runs from the batch's gate (the
//! ranks in step: the time a batch waited in the queue or at the gate for a peer's later
//! `start_load` depends on the engine, not on the mode) until its load thread is done with the
//! batch: the last layer published, the batch's last status exchange, its read session ended
//! (what the group's next batch waits for at its gate, so a rank slow to finish a batch slows
//! the group); the slowest rank's is what the group's batches take. Batches landing under 1 MiB are not measured (their time is latency, not the mode).
//! After the first round, a mode whose time is more than [`AUTO_DROP`] times the best is not
//! measured again (noise of a shared host is ±20 %, not 50 %), unless its batches were all
//! less than half the size of the best's (a small batch's fixed costs weigh more per byte:
//! such a mode is measured again, not dropped on that batch). When every remaining mode has
//! `auto_batches_per_mode` batches, it keeps for good the mode with the lowest **median**; a
//! mode within [`AUTO_TIE`] of that median is taken as equally fast, and then the one reading
//! fewer store bytes per rank wins (each mode's `tie_rank`: `SplitAllGather`, then
//! `Rank0Broadcast`, then `AllRanks`),
//! so two runs whose medians differ by noise still keep the same mode.
//!
//! **A close call is measured longer.** The tie margin is a line, and a mode whose median lies
//! near it (within [`AUTO_DOUBT`] of `1 + AUTO_TIE` times the best) falls on one side or the
//! other by noise, and where the side decides the pick (the mode kept with a margin of
//! `AUTO_TIE - AUTO_DOUBT` is not the one kept with `AUTO_TIE + AUTO_DOUBT`) the pick is a
//! close call: on the GPU host, at 128K tokens with ranks as processes, one run measured
//! `SplitAllGather` about 1.1× `Rank0Broadcast` and kept it (within the margin), another 1.25×
//! and kept `Rank0Broadcast`, while the fixed modes took 1.28×. During a close call every
//! remaining mode is measured up to [`AUTO_DOUBT_ROUNDS`] times `auto_batches_per_mode`
//! batches (medians over more batches), and the pick is made as soon as the call is no longer
//! close, or at that cap. (The batch proposed while the last time travels then runs the mode
//! being measured, not necessarily the one kept.) A mode near the margin that loses the tie
//! either way costs no batches.
//!
//! **The group's time arrives one batch late.** A rank knows only its own time when a batch
//! ends; the others' come in the next gate's words (each rank's word carries its previous
//! batch's time, and every rank records the maximum: see `group_time`). The proposal for that
//! next batch travels in the same word, so it is made before the previous batch's time is
//! known: that batch counts as measured for choosing the next mode (without its time), a mode
//! with no time known yet is measured before the others of its count, and when the batches in
//! flight complete every count, the proposal is the mode leading so far. So every decision
//! comes one batch later than with a rank's own time: dropping the slow modes waits for the
//! first round's last time (one batch proposed meanwhile, in the mode still unknown), and
//! keeping a mode for good waits for the last measured batch's time (one batch proposed
//! meanwhile, in the mode leading). Cost, with the default of 3 batches per mode: at most 10
//! batches before the kept mode runs (9 measured, and one proposed while the last one's time
//! was on the way); when modes drop out after the first round, 8 or 9 (one drops) and 6 or 7
//! (two drop), the larger when the batch proposed while the first round's last time was on
//! the way went to a mode that then dropped out. That is one or two batches more than
//! deciding from a rank's own time (9, 7, 5), the price of deciding from the group's. A close
//! call adds up to `auto_batches_per_mode` batches per remaining mode (at most 19 batches with
//! the default, when no mode drops out).
//!
//! If no group time comes in (a peer never sends one, e.g. one built before the gate word
//! carried times), `Auto` does not measure for ever: after [`AUTO_GIVE_UP`] × modes ×
//! `auto_batches_per_mode` proposals (36 with the defaults) made while this rank's measured
//! batch awaited the group's time, without a decision, it keeps the
//! mode leading so far (`AllRanks` when nothing was measured) and says so in a warning.
//! Batches too small to measure (and failed ones) send no time and do not count towards
//! that limit.
//!
//! **A mode that fails is not proposed for ever.** A failed batch sends no time. Its mode
//! then waits (is not proposed while another mode may be) until another mode's batch is
//! measured. Failing again after that, it is suspected; it fails on its own account (not
//! proposed again until paroled, below) when the next event is another mode's measured
//! batch, and is cleared when
//! it is another mode's failure: a store or group outage, however short, fails every mode
//! alike (two modes failing one after the other suspect neither). Two modes that do so
//! twice, each time with a third mode's batch measured right after, fail out together: a
//! fault of those two alone, such as their share step's, not an outage. Should every mode still
//! measured wait after failing, a mode dropped as slower is tried; should none be left, the
//! modes dropped as slower come back. Only failures a mode may cause count (a collective's, a device's, a
//! layer wait's timeout, a transfer, a lease, an RPC timeout, a short read, ranks out of
//! step: in a group, the first failing rank's kind); a reset or a refusal on any rank, an
//! object missing or bad, and a batch whose plans differed across ranks (it read
//! `AllRanks`) do not. A transient failure costs at most three batches more before the
//! pick.
//!
//! **A kept mode that goes bad is given up.** After [`AUTO_KEPT_STRIKES`] batches of the kept
//! mode failed in a row (failures a mode may cause, as above), one batch runs another mode (a
//! probe: the fastest other mode measured). If the probe fails too, the store or the group is
//! failing every mode: the kept mode stays. If it loads, the kept mode runs again, and failing
//! once more it fails on its own account: `Auto` measures again without it (the other modes
//! keep their samples, so the next pick comes within a batch or two when they were measured
//! enough). A kept mode that loads again clears its count.
//!
//! **A mode failed out is tried again later.** After [`AUTO_PAROLE`] loaded batches (256;
//! doubled for each earlier time the mode failed out, up to 2^10 times), it is paroled:
//! `Auto` measures again with it (its earlier samples kept; not when it was also dropped as
//! slower, which it could not pick), so a fault that flapped after
//! the pick does not keep the fastest mode out for good, and a mode that is truly broken
//! costs a few failed batches at ever longer intervals.
//!
//! Only rank 0's proposal is used (the ranks exchange proposals at the gate), so rank 0's
//! state decides for the group; every rank keeps its own, fed the same group times (each
//! divided by the bytes that rank landed). A proposal says whether its mode is kept: a rank
//! that has not decided (one restarted, measuring again from nothing) follows rank 0's kept
//! mode rather than wait to give up.

use std::time::Duration;

use dedup_broadcast::choose_mode;
use kv_loader::{Bandwidths, ModeChoice, ShareMode};
use parking_lot::Mutex;

mod kept;
mod measured;
#[cfg(test)]
mod tests;

use measured::Measured;

/// Proposals in a row that rank 0 no longer flags as kept before a rank following its kept mode
/// lets it go (see [`AutoMode::follow`]).
const FOLLOW_LOST: u8 = 3;

/// Weight of a new observation in the running bandwidth averages.
const EWMA: f64 = 0.2;
/// Reads or exchanges smaller than this say more about latency than bandwidth: ignored.
const MIN_BYTES: u64 = 1 << 20;

/// After the first round, modes slower than this many times the best are not measured again.
pub(crate) const AUTO_DROP: f64 = 1.5;
/// `Auto` stops measuring after this many times (modes × batches per mode) proposals without a
/// decision, and keeps the mode leading so far: with the default 3 batches per mode, after 36.
pub(crate) const AUTO_GIVE_UP: u32 = 4;

/// Batches of the kept mode failed in a row after which one batch tries another mode (see the
/// module docs: a kept mode that goes bad).
pub(crate) const AUTO_KEPT_STRIKES: u32 = 3;

/// Batches loaded after which a mode that failed on its own account is tried again (doubled
/// for each time it failed out before): see [`Measured::parole`](measured::Measured::parole).
pub(crate) const AUTO_PAROLE: u32 = 256;

/// Modes whose median is within this fraction of the best median count as equally fast.
pub(crate) const AUTO_TIE: f64 = 0.10;
/// A mode whose median is within this fraction of the tie margin (slower than the best by
/// between `AUTO_TIE - AUTO_DOUBT` and `AUTO_TIE + AUTO_DOUBT`) makes the pick a close call:
/// a batch's noise could move it across the margin, so every remaining mode is measured
/// longer (up to [`AUTO_DOUBT_ROUNDS`] times `auto_batches_per_mode` batches).
pub(crate) const AUTO_DOUBT: f64 = 0.05;
/// How many times `auto_batches_per_mode` batches a close call measures each mode at most.
pub(crate) const AUTO_DOUBT_ROUNDS: usize = 2;

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
    /// This rank's proposal for the next batch, and why, while its previous batch, of mode
    /// `in_flight`, awaits the group's time (`None`: no batch does). Fixed modes are proposed
    /// as they are. `Auto`: from the time model when every bandwidth is configured; otherwise
    /// as the module docs say.
    pub(crate) fn propose(
        &self,
        tp_size: u32,
        bytes_per_layer: u64,
        in_flight: Option<ShareMode>,
    ) -> (ShareMode, String) {
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return choose_mode(self.choice, &self.configured, tp_size, bytes_per_layer);
        }
        if tp_size <= 1 {
            return (ShareMode::AllRanks, "one rank: nothing to share".into());
        }
        let mut s = self.seen.lock();
        // Counted only while a measured batch's time is due: batches too small to measure
        // send none, and must not use up the patience meant for times that never come.
        if s.kept.is_none() && in_flight.is_some() {
            s.proposals = s.proposals.saturating_add(1);
            let limit = AUTO_GIVE_UP
                .saturating_mul(ShareMode::COUNT as u32)
                .saturating_mul(self.per_mode);
            if s.proposals > limit || s.proposals == u32::MAX {
                let leader = s.leader();
                tracing::warn!(
                    ?leader,
                    proposals = s.proposals,
                    measured = %s.describe(),
                    "Auto: no decision after {limit} proposals (the group's batch times did not \
                     come in); keeping the mode leading so far"
                );
                s.kept = Some(leader);
            }
        }
        let mode = s.next(in_flight, self.per_mode);
        let why = match s.kept {
            Some(k) if k != mode => format!(
                "Auto: keeps {k:?}, which failed {} batches in a row: one batch in {mode:?} \
                 tells its failures from the store's ({})",
                s.kept_failing,
                s.describe()
            ),
            Some(_) => format!(
                "Auto: keeps {mode:?} ({}; this rank's reads ≈ {:.2} GB/s per call)",
                s.describe(),
                self.bandwidths().store_per_rank_gbps
            ),
            None => format!("Auto: measuring {mode:?} ({})", s.describe()),
        };
        (mode, why)
    }

    /// Whether a batch that landed `bytes` is measured: a smaller one says more about latency
    /// than about its mode, and must not count as a batch in flight either.
    pub(crate) fn measures(bytes: u64) -> bool {
        bytes >= MIN_BYTES
    }

    /// A batch of `mode` landed `bytes` in `took` (on the slowest rank of the group: see the
    /// module docs).
    pub(crate) fn observe_batch(&self, mode: ShareMode, bytes: u64, took: Duration) {
        // Only a measuring Auto uses the samples (a fixed mode, or Auto from configured
        // bandwidths, would only pile them up).
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return;
        }
        if !Self::measures(bytes) || took.is_zero() {
            return;
        }
        self.seen.lock().record_batch(
            mode,
            took.as_secs_f64() / bytes as f64,
            bytes,
            self.per_mode,
        );
    }

    /// A batch of `mode` loaded on every rank (measured or not): see
    /// [`Measured::record_loaded`].
    pub(crate) fn observe_loaded(&self, mode: ShareMode) {
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return;
        }
        self.seen.lock().record_loaded(mode);
    }

    /// A batch of `mode` failed (its own failure, or its group's; not one the engine
    /// cancelled): see [`Measured::record_failure`].
    pub(crate) fn observe_failure(&self, mode: ShareMode) {
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return;
        }
        let mut s = self.seen.lock();
        let kept = s.kept;
        let suspected = s.record_failure(mode);
        if kept.is_some() && s.kept.is_none() {
            tracing::warn!(
                ?mode,
                measured = %s.describe(),
                "Auto: the kept mode failed again after another mode's batch loaded; measuring \
                 again without it"
            );
        }
        if suspected {
            tracing::warn!(
                ?mode,
                measured = %s.describe(),
                "Auto: this mode failed again after another mode's batch loaded; it is not \
                 measured again if the next batch, of another mode, loads"
            );
        }
    }

    /// The mode kept, once decided.
    pub(crate) fn kept(&self) -> Option<ShareMode> {
        self.seen.lock().kept
    }

    /// A rank other than 0: rank 0's proposal for this batch was `mode`, kept for good by
    /// rank 0 when `kept`. Only rank 0's decision counts for the group; this rank's own `Auto`
    /// (its read-ahead and pins at lookup, [`kept`](Self::kept)) follows it: a rank that
    /// restarted measures again from nothing, and would otherwise only decide by giving up,
    /// having seen just the one mode rank 0 keeps. A mode followed is let go once rank 0
    /// proposes [`FOLLOW_LOST`] batches in a row not kept (it measures again; a single one is
    /// a probe while its kept mode fails).
    pub(crate) fn follow(&self, mode: ShareMode, kept: bool) {
        if self.choice != ModeChoice::Auto || self.configured.all_known() {
            return;
        }
        let mut s = self.seen.lock();
        if kept {
            s.follow_misses = 0;
            if s.kept != Some(mode) {
                tracing::info!(?mode, "Auto: following rank 0, which keeps this mode");
                s.kept = Some(mode);
                s.followed = true;
            }
        } else if s.followed {
            s.follow_misses = s.follow_misses.saturating_add(1);
            if s.follow_misses >= FOLLOW_LOST {
                tracing::info!("Auto: rank 0 measures again; no longer following it");
                s.kept = None;
                s.followed = false;
                s.follow_misses = 0;
            }
        }
    }
}
