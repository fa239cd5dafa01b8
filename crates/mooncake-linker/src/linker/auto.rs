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
//! measured. Failing again after that, it is suspected; it fails on its own account (never
//! proposed again) when the next event is another mode's measured batch, and is cleared when
//! it is another mode's failure: a store or group outage, however short, fails every mode
//! alike (two modes failing one after the other suspect neither). Should every mode still
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
//! Only rank 0's proposal is used (the ranks exchange proposals at the gate), so rank 0's
//! state decides for the group; every rank keeps its own, fed the same group times (each
//! divided by the bytes that rank landed).

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
/// `Auto` stops measuring after this many times (modes × batches per mode) proposals without a
/// decision, and keeps the mode leading so far: with the default 3 batches per mode, after 36.
pub(crate) const AUTO_GIVE_UP: u32 = 4;

/// Batches of the kept mode failed in a row after which one batch tries another mode (see the
/// module docs: a kept mode that goes bad).
pub(crate) const AUTO_KEPT_STRIKES: u32 = 3;

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
    /// The smallest and largest batch (bytes landed) measured, per mode: a mode is dropped
    /// after one round only against a best measured on batches of a like size.
    sizes: [Option<(u64, u64)>; ShareMode::COUNT],
    /// Modes no longer measured (clearly slower after the first round). Brought back should
    /// every other mode fail on its own account (see [`Measured::record_batch`]).
    dropped: [bool; ShareMode::COUNT],
    /// Modes that fail on their own account: never proposed again.
    failed_out: [bool; ShareMode::COUNT],
    /// A mode that failed again after another mode's batch was measured: not proposed; it
    /// fails on its own account (`failed_out`) once the next event is another mode's
    /// measured batch, and is cleared when the next event is another mode's failure (the
    /// store or the group failing every mode: an outage).
    suspect: Option<ShareMode>,
    /// The mode of the last event when it was a failure (`None` after a measured batch).
    last_failed: Option<ShareMode>,
    /// The mode kept for good.
    kept: Option<ShareMode>,
    /// Proposals made while measuring (see [`AUTO_GIVE_UP`]).
    proposals: u32,
    /// Per mode, its batches that failed since its last measured one: such a mode waits
    /// until another mode's batch is measured (see [`Measured::waits_after_failing`]), and
    /// comes last among equals.
    failing: [u32; ShareMode::COUNT],
    /// Per mode, the number (in `batches`) of its last failed batch.
    last_failure: [Option<u64>; ShareMode::COUNT],
    /// The number of the last measured batch, of any mode.
    last_measured: Option<u64>,
    /// Batches measured or failed so far (numbers them).
    batches: u64,
    /// Batches of the kept mode failed in a row (only failures a mode may cause).
    kept_failing: u32,
    /// A probe (another mode's batch, tried while the kept mode was failing) loaded since the
    /// kept mode's last batch: the kept mode failing again fails on its own account.
    probe_loaded: bool,
    /// Modes whose probe failed since the kept mode last loaded: the next probe tries another
    /// (a fault may fail some modes only: the kept one and the probe's).
    probe_failed: [bool; ShareMode::COUNT],
}

impl Measured {
    fn live(&self) -> impl Iterator<Item = ShareMode> + '_ {
        AUTO_MODES
            .iter()
            .copied()
            .filter(|m| !self.dropped[slot(*m)] && !self.failed_out[slot(*m)])
    }

    /// A live mode that may be kept: not suspected of failing on its own account.
    fn pickable(&self, m: ShareMode) -> bool {
        !self.dropped[slot(m)] && !self.failed_out[slot(m)] && self.suspect != Some(m)
    }

    fn median(&self, m: ShareMode) -> Option<f64> {
        median(&self.samples[slot(m)])
    }

    /// [`record_batch`](Self::record_batch) of a batch of 1 GiB (tests: every batch alike).
    #[cfg(test)]
    pub(crate) fn record(&mut self, mode: ShareMode, seconds_per_byte: f64, per_mode: u32) {
        self.record_batch(mode, seconds_per_byte, 1 << 30, per_mode);
    }

    /// Records a batch that landed `bytes`: drops clearly slower modes once every mode has run
    /// once, and keeps a mode for good once every remaining one has `per_mode` batches.
    ///
    /// A mode is dropped only when its largest batch was at least half the size of the
    /// smallest batch of the best mode: a batch's fixed costs (gate, pins, the first layer's
    /// read) weigh more per byte in a small batch, so a mode that happened to get a small
    /// batch is measured again rather than dropped on it.
    pub(crate) fn record_batch(
        &mut self,
        mode: ShareMode,
        seconds_per_byte: f64,
        bytes: u64,
        per_mode: u32,
    ) {
        if self.kept.is_some() {
            return;
        }
        self.batches += 1;
        self.last_measured = Some(self.batches);
        self.last_failed = None;
        self.failing[slot(mode)] = 0;
        // Another mode loaded right after the suspect failed: it fails on its own account.
        match self.suspect.take() {
            Some(s) if s != mode => self.fail_out(s),
            _ => {}
        }
        self.samples[slot(mode)].push(seconds_per_byte);
        let size = &mut self.sizes[slot(mode)];
        *size = Some(size.map_or((bytes, bytes), |(lo, hi)| (lo.min(bytes), hi.max(bytes))));
        // Once every mode still measured has a time (a mode dropped for failing has none).
        if self.live().all(|m| !self.samples[slot(m)].is_empty()) {
            let best = self.best();
            let best_smallest = self
                .live()
                .filter(|m| self.median(*m) == Some(best))
                .filter_map(|m| self.sizes[slot(m)].map(|(lo, _)| lo))
                .min()
                .unwrap_or(0);
            for m in AUTO_MODES {
                let like_sized = self.sizes[slot(m)].is_some_and(|(_, hi)| hi >= best_smallest / 2);
                if like_sized && self.median(m).is_some_and(|t| t > best * AUTO_DROP) {
                    self.dropped[slot(m)] = true;
                }
            }
        }
        self.keep_when_measured(per_mode);
    }

    /// Keeps the leading mode for good once every remaining mode has enough batches.
    fn keep_when_measured(&mut self, per_mode: u32) {
        let enough = self.enough(per_mode);
        if self.live().all(|m| self.samples[slot(m)].len() >= enough) {
            self.kept = Some(self.leader());
        }
    }

    /// Records a failed batch of `mode` (while measuring). The mode then waits until another
    /// mode's batch is measured; failing again after that (and not right after another
    /// mode's failure), it is suspected, and fails on its own account (never proposed again)
    /// when the next event is another mode's measured batch. Another mode's failure next
    /// clears the suspicion: the store or the group fails every mode alike (an outage, however
    /// short). Before, a failed batch left no trace, so a
    /// mode that always failed kept the fewest batches and was proposed for ever. True when
    /// the mode is now suspected.
    pub(crate) fn record_failure(&mut self, mode: ShareMode) -> bool {
        if let Some(k) = self.kept {
            self.kept_failure(k, mode);
            return false;
        }
        self.batches += 1;
        let m = slot(mode);
        let others_measured_since = self.failing[m] > 0
            && self.last_failure[m].is_some_and(|f| self.last_measured.is_some_and(|ok| ok > f));
        self.failing[m] = self.failing[m].saturating_add(1);
        self.last_failure[m] = Some(self.batches);
        // Two modes failing one after the other: an outage, not a mode.
        let after_another = self.last_failed.is_some_and(|x| x != mode);
        self.last_failed = Some(mode);
        match self.suspect {
            Some(s) if s != mode => {
                self.suspect = None;
                false
            }
            Some(_) => false,
            None if others_measured_since && !after_another && !self.failed_out[m] => {
                self.suspect = Some(mode);
                true
            }
            None => false,
        }
    }

    /// A batch of `mode` loaded (as it ends, whether or not its time is measured): while a
    /// mode is kept, the kept mode's batch clears its failures, and a probe's says the kept
    /// mode's failures are its own (see [`kept_failure`](Self::kept_failure)).
    pub(crate) fn record_loaded(&mut self, mode: ShareMode) {
        let Some(k) = self.kept else {
            return;
        };
        if mode == k {
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.probe_failed = [false; ShareMode::COUNT];
        } else if self.kept_failing > 0 {
            self.probe_loaded = true;
        }
    }

    /// A batch of `mode` failed while `k` is kept: the kept mode's count goes up, and it fails
    /// on its own account when a probe loaded since its last batch; a probe that fails clears
    /// the count (the store or the group fails every mode).
    fn kept_failure(&mut self, k: ShareMode, mode: ShareMode) {
        if mode != k {
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.probe_failed[slot(mode)] = true;
            return;
        }
        self.kept_failing = self.kept_failing.saturating_add(1);
        if self.probe_loaded {
            self.fail_out(k);
            self.kept = None;
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.suspect = None;
            self.last_failed = None;
            // A fresh patience for the measuring that resumes.
            self.proposals = 0;
        }
    }

    /// The mode a probe runs in while the kept mode `k` fails: of the other modes not failed
    /// out, those whose probe has not failed since `k` last loaded (all of them again once
    /// every one's has), the fastest measured, else the first (`None`: no other mode).
    fn probe_for(&self, k: ShareMode) -> Option<ShareMode> {
        let others = |untried: bool| {
            AUTO_MODES.into_iter().filter(move |m| {
                *m != k && !self.failed_out[slot(*m)] && !(untried && self.probe_failed[slot(*m)])
            })
        };
        let fastest = |untried: bool| {
            others(untried)
                .filter_map(|m| self.median(m).map(|t| (m, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(m, _)| m)
                .or_else(|| others(untried).next())
        };
        fastest(true).or_else(|| fastest(false))
    }

    /// `m` fails on its own account: never proposed again. Should no mode be left live, the
    /// modes dropped as slower come back (they may be the only ones that load).
    fn fail_out(&mut self, m: ShareMode) {
        self.failed_out[slot(m)] = true;
        if self.live().next().is_none() {
            for x in AUTO_MODES {
                self.dropped[slot(x)] = false;
            }
        }
    }

    /// Batches each remaining mode needs before one is kept: `per_mode`, or
    /// [`AUTO_DOUBT_ROUNDS`] times that while the pick is a close call.
    fn enough(&self, per_mode: u32) -> usize {
        let base = per_mode.max(1) as usize;
        if self.close_call() {
            base * AUTO_DOUBT_ROUNDS
        } else {
            base
        }
    }

    /// Whether the pick is a close call: a remaining mode's median so near the tie margin
    /// that noise decides on which side it falls (see [`AUTO_DOUBT`]), and the side decides
    /// the pick (the mode kept with a margin of `AUTO_TIE - AUTO_DOUBT` is not the one kept
    /// with `AUTO_TIE + AUTO_DOUBT`). A mode near the margin that loses the tie either way
    /// (the best already reads fewer store bytes) costs no batches.
    fn close_call(&self) -> bool {
        self.leader_within(AUTO_TIE - AUTO_DOUBT) != self.leader_within(AUTO_TIE + AUTO_DOUBT)
    }

    /// The mode to keep from the medians so far: the first in tie order among the modes
    /// still measured whose median is within [`AUTO_TIE`] of the best.
    fn leader(&self) -> ShareMode {
        self.leader_within(AUTO_TIE)
    }

    /// The first in tie order among the modes still measured whose median is within `margin`
    /// (a fraction) of the best.
    fn leader_within(&self, margin: f64) -> ShareMode {
        let best = self.best();
        preference()
            .into_iter()
            .filter(|m| self.pickable(*m))
            .find(|m| self.median(*m).is_some_and(|t| t <= best * (1.0 + margin)))
            .or_else(|| AUTO_MODES.into_iter().find(|m| self.pickable(*m)))
            .or_else(|| self.live().next())
            .unwrap_or(ShareMode::AllRanks)
    }

    /// The lowest median of the modes that may be kept (live, not suspected).
    fn best(&self) -> f64 {
        self.live()
            .filter(|m| self.pickable(*m))
            .filter_map(|m| self.median(m))
            .fold(f64::INFINITY, f64::min)
    }

    /// Batches of `m`: those measured, and the one `in_flight` (ran, its time not known yet).
    fn count(&self, m: ShareMode, in_flight: Option<ShareMode>) -> usize {
        self.samples[slot(m)].len() + usize::from(in_flight == Some(m))
    }

    /// Whether `m` failed and no batch of another mode was measured since: it is not proposed
    /// while another mode may be, so that its next failure (if any) comes after another
    /// mode's measured batch, which tells a mode failing on its own account from an outage.
    fn waits_after_failing(&self, m: ShareMode) -> bool {
        self.failing[slot(m)] > 0
            && self.last_failure[slot(m)]
                .is_some_and(|f| self.last_measured.is_none_or(|ok| ok < f))
    }

    /// The next mode to propose while the batch of mode `in_flight` (if any) awaits its time:
    /// the kept one; else, among the live modes (those waiting after a failure left out while
    /// another remains: [`waits_after_failing`](Self::waits_after_failing)) with the fewest
    /// batches (that one counted), one with no time known yet, else the fastest so far, a mode
    /// failing since its last time last (round order among equals); once every such mode has
    /// enough batches counting that one (`per_mode`, more in a close call:
    /// [`Measured::enough`]), the mode leading so far.
    pub(crate) fn next(&self, in_flight: Option<ShareMode>, per_mode: u32) -> ShareMode {
        if let Some(k) = self.kept {
            if self.kept_failing >= AUTO_KEPT_STRIKES && !self.probe_loaded {
                return self.probe_for(k).unwrap_or(k);
            }
            return k;
        }
        let enough = self.enough(per_mode);
        let ready: Vec<ShareMode> = self
            .live()
            .filter(|m| self.pickable(*m) && !self.waits_after_failing(*m))
            .collect();
        // Every live mode waits after failing (or is suspected): a mode dropped as slower is
        // tried (its load tells the live ones' failures from an outage); else the live ones.
        let probes: Vec<ShareMode> = AUTO_MODES
            .into_iter()
            .filter(|m| self.dropped[slot(*m)] && !self.failed_out[slot(*m)])
            .filter(|m| self.suspect != Some(*m) && !self.waits_after_failing(*m))
            .collect();
        let probing = ready.is_empty() && !probes.is_empty();
        let candidates: Vec<ShareMode> = if !ready.is_empty() {
            ready
        } else if probing {
            probes
        } else {
            // Every mode waits after failing: the one whose failure is oldest, in turn (the
            // fewest batches would pick a broken mode with none for ever).
            return self
                .live()
                .filter(|m| self.pickable(*m))
                .min_by_key(|m| self.last_failure[slot(*m)])
                .or_else(|| self.live().next())
                .unwrap_or(ShareMode::AllRanks);
        };
        let Some(fewest) = candidates.iter().map(|m| self.count(*m, in_flight)).min() else {
            return self.live().next().unwrap_or(ShareMode::AllRanks);
        };
        if fewest >= enough && !probing {
            // The leader, unless it waits after failing: then another mode runs, after which
            // the leader is tried again.
            let leader = self.leader();
            if candidates.contains(&leader) {
                return leader;
            }
        }
        // `min_by` keeps the first of equal keys: round order.
        candidates
            .into_iter()
            .filter(|m| self.count(*m, in_flight) == fewest)
            .min_by(|a, b| {
                // No time yet: first; failing since its last time: last.
                let known = |m: &ShareMode| match self.failing[slot(*m)] {
                    0 => self.median(*m).unwrap_or(f64::NEG_INFINITY),
                    _ => f64::INFINITY,
                };
                known(a).total_cmp(&known(b))
            })
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
                let drop = if self.failed_out[slot(*m)] {
                    " (failed)"
                } else if self.dropped[slot(*m)] {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_fixed_mode_keeps_no_samples_and_a_huge_patience_does_not_overflow() {
        let fixed = AutoMode::new(
            ModeChoice::Fixed(ShareMode::AllRanks),
            Bandwidths::UNKNOWN,
            3,
        );
        for _ in 0..10_000 {
            fixed.observe_batch(ShareMode::AllRanks, 64 << 20, Duration::from_millis(100));
        }
        assert!(fixed.seen.lock().samples.iter().all(Vec::is_empty));
        // `auto_batches_per_mode` is not bounded by the config: the give-up limit saturates.
        let patient = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, u32::MAX);
        for _ in 0..20 {
            let _ = patient.propose(2, 1 << 20, Some(ShareMode::AllRanks));
        }
        assert!(
            patient.seen.lock().kept.is_none(),
            "not given up after 20 proposals"
        );
        // At the counter's end it gives up rather than wrap (or panic in a debug build).
        patient.seen.lock().proposals = u32::MAX - 1;
        for _ in 0..2 {
            let _ = patient.propose(2, 1 << 20, Some(ShareMode::AllRanks));
        }
        let s = patient.seen.lock();
        assert_eq!(s.proposals, u32::MAX);
        assert!(s.kept.is_some(), "given up at the counter's end");
    }

    /// Runs the measuring phase with group batch times `time(mode, i)` (`i`: the mode's
    /// batches before) as the linker does: each batch's proposal is made while the previous
    /// batch's time is on the way, and that time is recorded just after (at the same gate).
    /// Returns the modes proposed before the first one proposed as kept, and the mode kept.
    fn run(per_mode: u32, time: impl Fn(ShareMode, usize) -> f64) -> (Vec<ShareMode>, ShareMode) {
        let mut m = Measured::default();
        let mut ran = [0usize; ShareMode::COUNT];
        let mut in_flight: Option<(ShareMode, f64)> = None;
        let mut proposed = Vec::new();
        for _ in 1..100 {
            let mode = m.next(in_flight.map(|(f, _)| f), per_mode);
            if m.kept.is_some() {
                return (proposed, mode);
            }
            proposed.push(mode);
            if let Some((f, t)) = in_flight.take() {
                m.record(f, t, per_mode);
            }
            in_flight = Some((mode, time(mode, ran[slot(mode)])));
            ran[slot(mode)] += 1;
        }
        panic!("Auto never decided");
    }

    /// [`run`] where batch `n` (counting every batch) of mode `m` fails when `fails(m, n)`:
    /// its failure is recorded as the batch ends (it sends no time). The modes proposed
    /// before the kept one, the mode kept, and the modes dropped.
    fn run_failing(per_mode: u32, fails: impl Fn(ShareMode, usize) -> bool) -> Failing {
        run_failing_at(per_mode, base, fails)
    }

    /// What [`run_failing_at`] saw: the modes proposed before the kept one, the mode kept, the
    /// modes dropped as slower, and those that failed on their own account.
    struct Failing {
        proposed: Vec<ShareMode>,
        kept: ShareMode,
        slower: Vec<ShareMode>,
        failed_out: Vec<ShareMode>,
    }

    /// [`run_failing`] with group batch times `time(mode)`.
    fn run_failing_at(
        per_mode: u32,
        time: impl Fn(ShareMode) -> f64,
        fails: impl Fn(ShareMode, usize) -> bool,
    ) -> Failing {
        let mut m = Measured::default();
        let mut in_flight: Option<(ShareMode, f64)> = None;
        let mut proposed = Vec::new();
        for n in 0..200 {
            let mode = m.next(in_flight.map(|(f, _)| f), per_mode);
            if m.kept.is_some() {
                let with = |flags: &[bool; ShareMode::COUNT]| {
                    AUTO_MODES.into_iter().filter(|x| flags[slot(*x)]).collect()
                };
                return Failing {
                    proposed,
                    kept: mode,
                    slower: with(&m.dropped),
                    failed_out: with(&m.failed_out),
                };
            }
            proposed.push(mode);
            if let Some((f, t)) = in_flight.take() {
                m.record(f, t, per_mode);
            }
            if fails(mode, n) {
                m.record_failure(mode);
            } else {
                in_flight = Some((mode, time(mode)));
            }
        }
        panic!("Auto never decided: proposed {proposed:?}");
    }

    /// `n` batches as the linker runs them (each proposal made while the previous batch's
    /// time is on the way), from `m`'s state; batch `i` of mode `x` fails when `fails(x, i)`.
    /// The modes proposed.
    fn drive(
        m: &mut Measured,
        n: usize,
        per_mode: u32,
        fails: impl Fn(ShareMode, usize) -> bool,
    ) -> Vec<ShareMode> {
        let mut in_flight: Option<ShareMode> = None;
        let mut proposed = Vec::new();
        for i in 0..n {
            let mode = m.next(in_flight, per_mode);
            proposed.push(mode);
            if let Some(f) = in_flight.take() {
                m.record(f, base(f), per_mode);
            }
            if fails(mode, i) {
                m.record_failure(mode);
            } else {
                m.record_loaded(mode);
                in_flight = Some(mode);
            }
        }
        proposed
    }

    /// The kept mode's state moves on batches that load whether or not their time comes
    /// (batches under 1 MiB, a peer that sends no time). Before, only a recorded time did:
    /// a probe whose time never came was proposed for ever, and after an outage the kept
    /// mode's later loads cleared nothing, so one failure, however much later, failed it out.
    #[test]
    fn the_kept_modes_state_moves_on_loads_without_times() {
        let (mut m, kept) = kept_state(3);
        for _ in 0..AUTO_KEPT_STRIKES {
            assert_eq!(m.next(None, 3), kept);
            m.record_failure(kept);
        }
        let probe = m.next(None, 3);
        assert_ne!(probe, kept);
        m.record_loaded(probe);
        assert_eq!(
            m.next(None, 3),
            kept,
            "the kept mode runs again after the probe"
        );
        m.record_loaded(kept);
        for _ in 0..50 {
            assert_eq!(m.next(None, 3), kept);
            m.record_loaded(kept);
        }
        m.record_failure(kept);
        assert_eq!(
            m.kept,
            Some(kept),
            "one failure after loads fails nothing out"
        );
        assert!(!m.failed_out[slot(kept)]);
    }

    /// Auto, measured until it keeps a mode with every mode loading (the `base` times).
    fn kept_state(per_mode: u32) -> (Measured, ShareMode) {
        let mut m = Measured::default();
        drive(&mut m, 40, per_mode, |_, _| false);
        let kept = m.kept.expect("kept");
        (m, kept)
    }

    /// A kept mode that then fails every batch is given up: after three failures in a row one
    /// batch runs another mode, which loads, and the kept mode's next failure fails it out;
    /// Auto keeps another mode, which loads from then on. Before, a kept mode was never
    /// revisited: every later batch failed.
    #[test]
    fn a_kept_mode_that_goes_bad_is_given_up() {
        let (mut m, kept) = kept_state(3);
        let proposed = drive(&mut m, 30, 3, |x, _| x == kept);
        let first_other = proposed.iter().position(|x| *x != kept).expect("a probe");
        assert_eq!(first_other, AUTO_KEPT_STRIKES as usize, "{proposed:?}");
        let now = m.kept.expect("another mode kept");
        assert_ne!(now, kept);
        assert!(m.failed_out[slot(kept)]);
        let last = &proposed[proposed.len() - 10..];
        assert!(last.iter().all(|x| *x == now), "{proposed:?}");
        let failures = proposed.iter().filter(|x| **x == kept).count();
        assert!(failures <= 6, "{failures} failed batches: {proposed:?}");
    }

    /// An outage after the pick fails every mode: the probe fails too, so the kept mode stays
    /// (one batch in four tries another mode while it lasts), and it is kept after.
    #[test]
    fn an_outage_after_the_pick_keeps_the_kept_mode() {
        let (mut m, kept) = kept_state(3);
        let proposed = drive(&mut m, 24, 3, |_, _| true);
        assert_eq!(m.kept, Some(kept));
        assert!(!m.failed_out.iter().any(|x| *x));
        let probes = proposed.iter().filter(|x| **x != kept).count();
        assert_eq!(
            probes,
            24 / (AUTO_KEPT_STRIKES as usize + 1),
            "{proposed:?}"
        );
        let after = drive(&mut m, 10, 3, |_, _| false);
        assert!(after[1..].iter().all(|x| *x == kept), "{after:?}");
    }

    /// A fault that fails the kept mode and the first probe's mode, but not the third mode:
    /// the next probe tries that one, and the kept mode is given up for it.
    #[test]
    fn a_probe_that_fails_is_followed_by_a_probe_of_another_mode() {
        let (mut m, kept) = kept_state(3);
        let first = m.probe_for(kept).expect("another mode");
        let proposed = drive(&mut m, 30, 3, |x, _| x == kept || x == first);
        let now = m.kept.expect("kept");
        assert!(now != kept && now != first, "{proposed:?}");
        assert!(m.failed_out[slot(kept)] && m.failed_out[slot(first)]);
        assert!(proposed[20..].iter().all(|x| *x == now), "{proposed:?}");
    }

    /// Three failures of the kept mode and then the outage ends: the probe loads, the kept
    /// mode loads again and stays kept.
    #[test]
    fn a_short_outage_of_the_kept_mode_does_not_give_it_up() {
        let (mut m, kept) = kept_state(3);
        let proposed = drive(&mut m, 20, 3, |x, i| x == kept && i < 3);
        assert_eq!(m.kept, Some(kept), "{proposed:?}");
        assert!(!m.failed_out[slot(kept)]);
        assert!(proposed[6..].iter().all(|x| *x == kept), "{proposed:?}");
    }

    /// A mode whose every batch fails is proposed twice, not for ever: it fails again after
    /// another mode's batch loaded, and is not measured again. Before, a failed batch left no
    /// trace, so the failing mode kept the fewest batches and every later batch ran it.
    #[test]
    fn a_mode_that_always_fails_is_dropped_after_failing_twice() {
        use ShareMode::*;
        for bad in [AllRanks, Rank0Broadcast, SplitAllGather] {
            let Failing {
                proposed,
                kept,
                failed_out,
                ..
            } = run_failing(3, |m, _| m == bad);
            let tries = proposed.iter().filter(|m| **m == bad).count();
            assert_eq!(tries, 2, "{bad:?}: {proposed:?}");
            assert_eq!(failed_out, [bad], "{bad:?}: {proposed:?}");
            assert_ne!(kept, bad);
            // The fastest of the others.
            let want = if bad == SplitAllGather {
                Rank0Broadcast
            } else {
                SplitAllGather
            };
            assert_eq!(kept, want, "{bad:?}: {proposed:?}");
        }
    }

    /// One failure in the last round (a transient one) delays the decision by at most three
    /// batches: the failed mode is measured again once another mode's batch was (its time
    /// arrives one batch late). Before (a
    /// failure counted as one of the mode's batches), the mode leading ran from then on, the
    /// failed one never again, and nothing was kept until the give-up limit.
    #[test]
    fn one_failure_in_the_last_round_still_decides() {
        use ShareMode::*;
        let time = |m: ShareMode| match m {
            AllRanks => 1.3,
            Rank0Broadcast => 1.0,
            SplitAllGather => 1.2,
        };
        let clean = run_failing_at(3, time, |_, _| false);
        for bad in [AllRanks, SplitAllGather] {
            // The mode's third batch fails: the first batch of it at or after index 6.
            let first_late = clean
                .proposed
                .iter()
                .enumerate()
                .position(|(n, m)| n >= 6 && *m == bad);
            let at = first_late.expect("a third batch of the mode");
            let got = run_failing_at(3, time, |m, n| m == bad && n == at);
            let proposed = &got.proposed;
            assert_eq!(got.kept, clean.kept, "{bad:?}: {proposed:?}");
            assert!(
                got.slower.is_empty() && got.failed_out.is_empty(),
                "{bad:?}"
            );
            assert!(
                proposed.len() <= clean.proposed.len() + 3,
                "{bad:?}: {} batches, {} without the failure: {proposed:?}",
                proposed.len(),
                clean.proposed.len()
            );
        }
    }

    /// Batches that fail whatever their mode (the store down for a while) drop no mode: no
    /// mode failed while another loaded. Once they load again, every mode is measured and the
    /// pick is the one made without the outage.
    #[test]
    fn an_outage_that_fails_every_mode_drops_none() {
        let Failing {
            proposed,
            kept,
            slower,
            failed_out,
        } = run_failing(3, |_, n| n < 12);
        assert_eq!(kept, ShareMode::SplitAllGather, "{proposed:?}");
        // Only speed drops modes here (after the first round measured them all).
        assert_eq!(
            slower,
            [ShareMode::AllRanks, ShareMode::Rank0Broadcast],
            "{proposed:?}"
        );
        assert!(failed_out.is_empty(), "{proposed:?}");
        let after: Vec<_> = proposed[12..].to_vec();
        for m in AUTO_MODES {
            assert!(
                after.contains(&m),
                "{m:?} measured after the outage: {after:?}"
            );
        }
    }

    /// Two short outages a batch apart (a store that flaps) fail a mode again after another
    /// mode's batch loaded, and then another mode fails too: an outage, no mode's own
    /// failure. Nothing fails out, and the pick is the one made without them.
    #[test]
    fn a_flapping_store_fails_no_mode_out() {
        for (first, second) in [(0..3, 4..6), (1..4, 5..7), (0..2, 3..5)] {
            let got = run_failing(3, |_, n| first.contains(&n) || second.contains(&n));
            assert!(got.failed_out.is_empty(), "{:?}", got.proposed);
            assert_eq!(got.kept, ShareMode::SplitAllGather, "{:?}", got.proposed);
        }
    }

    /// The last mode measured (the others dropped as slower) failing on its own account:
    /// the modes dropped as slower are tried again, the failing one fails out, and the
    /// fastest of the others is kept. Before, the failing mode was proposed for ever.
    #[test]
    fn when_the_last_live_mode_fails_the_slower_ones_come_back() {
        use ShareMode::*;
        // TP 8 shape: AllRanks and Rank0Broadcast drop after the first round.
        let got = run_failing(3, |m, n| m == SplitAllGather && n >= 3);
        assert_eq!(got.failed_out, [SplitAllGather], "{:?}", got.proposed);
        assert_eq!(got.kept, Rank0Broadcast, "{:?}", got.proposed);
        assert!(got.proposed.len() < 20, "{:?}", got.proposed);
    }

    /// Patterns of the third review: a mode that goes bad once the others have enough
    /// batches, a mode with the best median that then always fails, a broken mode plus a
    /// short outage. Each was proposed for ever (the waiting leader, a suspect taken for the
    /// best, the fewest batches); each now decides, keeping a mode that did not fail out.
    #[test]
    fn a_mode_going_bad_late_or_beside_an_outage_still_decides() {
        use ShareMode::*;
        let same = |_: ShareMode| 1.0;
        let ar_best = |m: ShareMode| match m {
            AllRanks => 1.0,
            Rank0Broadcast => 2.5,
            SplitAllGather => 1.2,
        };
        type Times<'a> = &'a dyn Fn(ShareMode) -> f64;
        type Fails<'a> = &'a dyn Fn(ShareMode, usize) -> bool;
        let cases: [(Times, Fails); 3] = [
            (&same, &|m, n| m == SplitAllGather && n >= 4),
            (&ar_best, &|m, n| m == AllRanks && n >= 2),
            (&base, &|m, n| m == AllRanks || (1..3).contains(&n)),
        ];
        for (i, (time, fails)) in cases.into_iter().enumerate() {
            let got = run_failing_at(3, time, fails);
            assert!(
                !got.failed_out.contains(&got.kept),
                "case {i}: {:?}",
                got.proposed
            );
            assert!(got.proposed.len() < 40, "case {i}: {:?}", got.proposed);
        }
    }

    proptest! {
        /// Whatever batches fail, for however long, Auto decides once they stop failing, and
        /// keeps a mode that did not fail out.
        #[test]
        fn any_failures_then_none_still_decide(pattern in proptest::collection::vec(any::<bool>(), 0..40)) {
            let got = run_failing(3, |_, n| pattern.get(n).copied().unwrap_or(false));
            prop_assert!(!got.failed_out.contains(&got.kept), "{:?}", got.proposed);
        }
    }

    /// [`run`]: the number of batches before the kept mode runs, and the mode kept.
    fn decide(per_mode: u32, time: impl Fn(ShareMode, usize) -> f64) -> (usize, ShareMode) {
        let (proposed, kept) = run(per_mode, time);
        (proposed.len(), kept)
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
        // One round, then SplitAllGather twice more, and one batch while its third time is on
        // the way (the leader: SplitAllGather again).
        use ShareMode::*;
        let (proposed, kept) = run(3, |m, _| base(m));
        assert_eq!(kept, SplitAllGather);
        assert_eq!(
            proposed,
            [
                AllRanks,
                Rank0Broadcast,
                SplitAllGather,
                SplitAllGather,
                SplitAllGather,
                SplitAllGather
            ]
        );
        // Close modes are all measured 3 times, then one batch while the last time travels.
        let (batches, kept) = decide(3, |m, _| match m {
            AllRanks => 1.2,
            Rank0Broadcast => 1.3,
            SplitAllGather => 1.0,
        });
        assert_eq!((batches, kept), (10, SplitAllGather));
    }

    #[test]
    fn the_batch_proposed_before_the_first_round_is_known_goes_to_the_unknown_mode() {
        use ShareMode::*;
        // When SplitAllGather's first time arrives it is the slow one: its second batch (run
        // meanwhile) is spent for nothing, and AllRanks and Rank0Broadcast get three each.
        let (proposed, kept) = run(3, |m, _| match m {
            AllRanks => 1.0,
            Rank0Broadcast => 1.3,
            SplitAllGather => 6.0,
        });
        assert_eq!(kept, AllRanks);
        assert_eq!(
            &proposed[..4],
            &[AllRanks, Rank0Broadcast, SplitAllGather, SplitAllGather]
        );
        assert_eq!(proposed.len(), 9);
        assert_eq!(proposed.iter().filter(|m| **m == SplitAllGather).count(), 2);
        // Among modes with as many batches, the fastest so far is measured first.
        assert_eq!(proposed[4], AllRanks);
    }

    /// A mode slower per byte only because its first batch was much smaller (a small batch's
    /// fixed costs weigh more per byte) is measured again, not dropped; one slower on a batch
    /// of a like size is dropped.
    #[test]
    fn a_mode_is_dropped_only_against_batches_of_a_like_size() {
        use ShareMode::*;
        let (mib, gib) = (1u64 << 20, 1u64 << 30);
        let mut m = Measured::default();
        m.record_batch(AllRanks, 1.0, gib, 3);
        m.record_batch(Rank0Broadcast, 3.0, 2 * mib, 3);
        m.record_batch(SplitAllGather, 1.1, gib, 3);
        assert!(!m.dropped[slot(Rank0Broadcast)], "dropped on a 2 MiB batch");
        // Its next batch, like sized and still slow: dropped now.
        m.record_batch(Rank0Broadcast, 2.0, gib, 3);
        assert!(m.dropped[slot(Rank0Broadcast)]);
        // Like sized from the start: dropped after the first round.
        let mut m = Measured::default();
        m.record_batch(AllRanks, 1.0, gib, 3);
        m.record_batch(Rank0Broadcast, 3.0, gib / 2, 3);
        m.record_batch(SplitAllGather, 1.1, gib, 3);
        assert!(m.dropped[slot(Rank0Broadcast)]);
    }

    #[test]
    fn the_last_batch_before_the_decision_runs_the_leader() {
        use ShareMode::*;
        // One batch per mode: the fourth is proposed while SplitAllGather's time is on the way,
        // from the two times known (Rank0Broadcast leads); then SplitAllGather's time arrives
        // and decides.
        let (proposed, kept) = run(1, |m, _| match m {
            AllRanks => 3.0,
            Rank0Broadcast => 2.0,
            SplitAllGather => 1.0,
        });
        assert_eq!(
            proposed,
            [AllRanks, Rank0Broadcast, SplitAllGather, Rank0Broadcast]
        );
        assert_eq!(kept, SplitAllGather);
    }

    #[test]
    fn a_batch_whose_time_never_came_is_measured_again() {
        use ShareMode::*;
        // Rank0Broadcast's batch failed on some rank: no time. It counted while in flight,
        // and is proposed again once the gate dropped its sample.
        let mut m = Measured::default();
        assert_eq!(m.next(None, 3), AllRanks);
        assert_eq!(m.next(Some(AllRanks), 3), Rank0Broadcast);
        m.record(AllRanks, 1.0, 3);
        assert_eq!(m.next(Some(Rank0Broadcast), 3), SplitAllGather);
        // Rank0Broadcast's sample was dropped at that gate.
        assert_eq!(m.next(Some(SplitAllGather), 3), Rank0Broadcast);
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
    fn auto_stops_measuring_when_no_group_time_comes_in() {
        let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 3);
        // One time in (SplitAllGather fastest), then none: a rank never sends its time.
        auto.observe_batch(
            ShareMode::SplitAllGather,
            64 << 20,
            Duration::from_millis(100),
        );
        // Each proposal is made with this rank's last batch in flight (its own time sent, the
        // group's never back).
        let due = Some(ShareMode::AllRanks);
        let limit = AUTO_GIVE_UP * ShareMode::COUNT as u32 * 3;
        for _ in 0..limit {
            auto.propose(3, 1 << 20, due);
            assert_eq!(auto.kept(), None, "still measuring within the limit");
        }
        let (mode, _) = auto.propose(3, 1 << 20, due);
        assert_eq!(auto.kept(), Some(ShareMode::SplitAllGather));
        assert_eq!(mode, ShareMode::SplitAllGather);
        // Nothing measured at all: AllRanks.
        let none = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 1);
        for _ in 0..=AUTO_GIVE_UP * ShareMode::COUNT as u32 {
            none.propose(2, 1 << 20, due);
        }
        assert_eq!(none.kept(), Some(ShareMode::AllRanks));
    }

    #[test]
    fn batches_too_small_to_measure_do_not_use_up_the_patience() {
        // No batch in flight at any gate (each landed under 1 MiB, so none sent a time):
        // however many, Auto keeps measuring instead of settling on AllRanks unmeasured.
        let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 3);
        for _ in 0..10 * AUTO_GIVE_UP * ShareMode::COUNT as u32 * 3 {
            auto.propose(3, 1 << 20, None);
        }
        assert_eq!(auto.kept(), None);
    }

    #[test]
    fn batches_under_a_mebibyte_are_not_measured() {
        assert!(!AutoMode::measures((1 << 20) - 1));
        assert!(AutoMode::measures(1 << 20));
        let auto = AutoMode::new(ModeChoice::Auto, Bandwidths::UNKNOWN, 1);
        auto.observe_batch(ShareMode::AllRanks, 1000, Duration::from_millis(5));
        assert_eq!(auto.seen.lock().samples[slot(ShareMode::AllRanks)].len(), 0);
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

    #[test]
    fn a_close_call_is_measured_longer_until_it_is_clear() {
        use ShareMode::*;
        // SplitAllGather's first three batches happen to land just inside the tie margin
        // (1.09× Rank0Broadcast); its true time is 1.25×. Three batches each would keep it;
        // the close call measures more of each until the medians show Rank0Broadcast clearly
        // (a true ratio near the margin itself is still decided by noise, only over more
        // batches: `a_close_call_stops_at_its_cap`).
        let time = |m: ShareMode, i: usize| match (m, i) {
            (AllRanks, _) => 6.0,
            (Rank0Broadcast, _) => 1.0,
            (SplitAllGather, 0..=2) => 1.09,
            (SplitAllGather, _) => 1.25,
        };
        let (proposed, kept) = run(3, time);
        assert_eq!(kept, Rank0Broadcast);
        let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
        // AllRanks drops out after one round; the other two are measured until
        // SplitAllGather's median leaves the band, and one batch runs while the last time
        // travels.
        assert_eq!(
            (of(AllRanks), of(Rank0Broadcast), of(SplitAllGather)),
            (1, 6, 7),
            "{proposed:?}"
        );
        // A clear call is not measured longer: 1.2× is outside the doubt band.
        let (batches, kept) = decide(3, |m, _| match m {
            AllRanks => 6.0,
            Rank0Broadcast => 1.0,
            SplitAllGather => 1.2,
        });
        assert_eq!((batches, kept), (8, Rank0Broadcast));
    }

    #[test]
    fn a_mode_near_the_margin_that_loses_the_tie_anyway_costs_no_batches() {
        use ShareMode::*;
        // Rank0Broadcast at 1.1× SplitAllGather: on either side of the margin SplitAllGather
        // is kept (it reads fewer store bytes), so no batch more than a clear call.
        let (batches, kept) = decide(3, |m, _| match m {
            AllRanks => 6.0,
            Rank0Broadcast => 1.1,
            SplitAllGather => 1.0,
        });
        assert_eq!((batches, kept), (8, SplitAllGather));
        // One batch per mode: a close call measures two of each.
        let (proposed, kept) = run(1, |m, _| match m {
            AllRanks => 6.0,
            Rank0Broadcast => 1.0,
            SplitAllGather => 1.1,
        });
        assert_eq!(kept, SplitAllGather);
        let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
        assert_eq!(
            (of(Rank0Broadcast), of(SplitAllGather)),
            (2, 3),
            "{proposed:?}"
        );
    }

    #[test]
    fn a_close_call_that_shows_with_the_last_time_keeps_measuring() {
        use ShareMode::*;
        let mut m = Measured::default();
        // A first round (AllRanks drops out), then Rank0Broadcast twice more and
        // SplitAllGather once more: SplitAllGather's median 1.22× is a clear call.
        for (mode, t) in [
            (AllRanks, 6.0),
            (Rank0Broadcast, 1.0),
            (SplitAllGather, 1.3),
            (Rank0Broadcast, 1.0),
            (SplitAllGather, 1.14),
            (Rank0Broadcast, 1.0),
        ] {
            m.record(mode, t, 3);
        }
        // SplitAllGather's third batch is in flight: every count is complete, so the leader
        // is proposed.
        assert_eq!(m.next(Some(SplitAllGather), 3), Rank0Broadcast);
        // Its time makes the median 1.14×: a close call now, so nothing is kept, and the
        // batch after the leader's measures SplitAllGather again.
        m.record(SplitAllGather, 1.0, 3);
        assert_eq!(m.kept, None);
        assert_eq!(m.next(Some(Rank0Broadcast), 3), SplitAllGather);
    }

    #[test]
    fn a_close_call_stops_at_its_cap() {
        use ShareMode::*;
        // Exactly on the tie margin for ever: every mode measured twice as long, then the tie
        // rule (SplitAllGather reads least); never more than 19 batches.
        let (proposed, kept) = run(3, |m, _| match m {
            AllRanks => 1.2,
            Rank0Broadcast => 1.0,
            SplitAllGather => 1.1,
        });
        assert_eq!(kept, SplitAllGather);
        let of = |m: ShareMode| proposed.iter().filter(|p| **p == m).count();
        assert_eq!(of(Rank0Broadcast), 6, "{proposed:?}");
        assert!(of(SplitAllGather) >= 6 && of(AllRanks) >= 6, "{proposed:?}");
        assert!(proposed.len() <= 19, "{}", proposed.len());
    }

    proptest! {
        /// Two runs whose batch times differ by noise keep the same mode whenever the true
        /// best leads the next by more than the noise and the tie margin together, and never
        /// run more than 19 batches before the kept mode (3 per mode, 6 in a close call, and
        /// one while the last time travels).
        #[test]
        fn two_noisy_runs_agree(
            times in prop::array::uniform3(1.0f64..4.0),
            noise_a in prop::collection::vec(-0.02f64..0.02, 24),
            noise_b in prop::collection::vec(-0.02f64..0.02, 24),
        ) {
            let t = |m: ShareMode| times[slot(m)];
            // Up to 7 batches per mode (6 measured in a close call, one run while the last
            // time travels); one spare.
            let noisy = |noise: &[f64], m: ShareMode, i: usize| {
                t(m) * (1.0 + noise.get(slot(m) * 8 + i).copied().unwrap_or(0.0))
            };
            let run = |noise: &[f64]| decide(3, |m, i| noisy(noise, m, i));
            let (na, a) = run(&noise_a);
            let (nb, b) = run(&noise_b);
            prop_assert!(na <= 19 && nb <= 19, "{} {}", na, nb);
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
