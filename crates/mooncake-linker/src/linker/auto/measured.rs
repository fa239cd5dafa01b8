//! What `Auto` has measured while it chooses: each mode's samples, the modes dropped as
//! slower or failed out, and the proposal for the next batch (the module docs of `auto` say
//! how). The kept mode's later life is in `kept`.

use kv_loader::ShareMode;

use super::{AUTO_DOUBT, AUTO_DOUBT_ROUNDS, AUTO_DROP, AUTO_KEPT_STRIKES, AUTO_PAROLE, AUTO_TIE};

/// Modes `Auto` measures, in the order of each round.
pub(super) const AUTO_MODES: [ShareMode; ShareMode::COUNT] = ShareMode::ALL;

/// Among equally fast modes, the first of these wins: fewest store bytes on any one rank
/// (each mode's `tie_rank`).
pub(super) fn preference() -> [ShareMode; ShareMode::COUNT] {
    let mut p = ShareMode::ALL;
    p.sort_by_key(|m| m.spec().tie_rank);
    p
}

pub(super) fn slot(mode: ShareMode) -> usize {
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
    pub(super) samples: [Vec<f64>; ShareMode::COUNT],
    /// The smallest and largest batch (bytes landed) measured, per mode: a mode is dropped
    /// after one round only against a best measured on batches of a like size.
    pub(super) sizes: [Option<(u64, u64)>; ShareMode::COUNT],
    /// Modes no longer measured (clearly slower after the first round). Brought back should
    /// every other mode fail on its own account (see [`Measured::record_batch`]).
    pub(super) dropped: [bool; ShareMode::COUNT],
    /// Modes that fail on their own account: not proposed again until paroled (see
    /// [`Measured::parole`]).
    pub(super) failed_out: [bool; ShareMode::COUNT],
    /// Per mode, the batches loaded (in any mode) since it last failed out.
    pub(super) out_for: [u32; ShareMode::COUNT],
    /// Per mode, the times it failed out (each doubles its time out).
    pub(super) fail_outs: [u32; ShareMode::COUNT],
    /// A mode that failed again after another mode's batch was measured: not proposed; it
    /// fails on its own account (`failed_out`) once the next event is another mode's
    /// measured batch, and is cleared when the next event is another mode's failure (the
    /// store or the group failing every mode: an outage).
    pub(super) suspect: Option<ShareMode>,
    /// The mode of the last event when it was a failure (`None` after a measured batch).
    pub(super) last_failed: Option<ShareMode>,
    /// Two modes that failed back to back (the second's failure cleared the first's
    /// suspicion, as an outage would): see [`FailingPair`].
    pub(super) pair: Option<FailingPair>,
    /// The mode kept (until a parole measures again, or it fails out).
    pub(super) kept: Option<ShareMode>,
    /// `kept` is rank 0's decision this rank follows (see `AutoMode::follow`), not its own.
    pub(super) followed: bool,
    /// Proposals in a row rank 0 did not flag as kept while this rank follows it.
    pub(super) follow_misses: u8,
    /// Proposals made while measuring (see [`AUTO_GIVE_UP`](super::AUTO_GIVE_UP)).
    pub(super) proposals: u32,
    /// Per mode, its batches that failed since its last measured one: such a mode waits
    /// until another mode's batch is measured (see [`Measured::waits_after_failing`]), and
    /// comes last among equals.
    pub(super) failing: [u32; ShareMode::COUNT],
    /// Per mode, the number (in `batches`) of its last failed batch.
    pub(super) last_failure: [Option<u64>; ShareMode::COUNT],
    /// The number of the last measured batch, of any mode.
    pub(super) last_measured: Option<u64>,
    /// Batches measured or failed so far (numbers them).
    pub(super) batches: u64,
    /// Batches of the kept mode failed in a row (only failures a mode may cause).
    pub(super) kept_failing: u32,
    /// A probe (another mode's batch, tried while the kept mode was failing) loaded since the
    /// kept mode's last batch: the kept mode failing again fails on its own account.
    pub(super) probe_loaded: bool,
    /// Modes whose probe failed since the kept mode last loaded: the next probe tries another
    /// (a fault may fail some modes only: the kept one and the probe's).
    pub(super) probe_failed: [bool; ShareMode::COUNT],
}

/// Two modes failing back to back, one's failure clearing the other's suspicion as an outage
/// would. A third mode's measured batch right after shows it was no outage of the whole
/// group or store (a fault of those two only, such as their share step's); seen twice, both
/// fail on their own account. Before, the pair cleared each other's suspicion for ever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FailingPair {
    modes: [ShareMode; 2],
    /// Times a third mode's batch was measured right after the pair failed back to back.
    seen: u8,
    /// The pair just failed back to back: the next measured batch counts if a third mode's.
    armed: bool,
}

impl FailingPair {
    fn has(&self, m: ShareMode) -> bool {
        self.modes.contains(&m)
    }
}

impl Measured {
    pub(super) fn live(&self) -> impl Iterator<Item = ShareMode> + '_ {
        AUTO_MODES
            .iter()
            .copied()
            .filter(|m| !self.dropped[slot(*m)] && !self.failed_out[slot(*m)])
    }

    /// A live mode that may be kept: not suspected of failing on its own account.
    pub(super) fn pickable(&self, m: ShareMode) -> bool {
        !self.dropped[slot(m)] && !self.failed_out[slot(m)] && self.suspect != Some(m)
    }

    pub(super) fn median(&self, m: ShareMode) -> Option<f64> {
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
        self.pair = match self.pair.take() {
            Some(p) if p.has(mode) => None,
            Some(mut p) if p.armed => {
                p.seen += 1;
                p.armed = false;
                if p.seen >= 2 {
                    p.modes.into_iter().for_each(|m| self.fail_out(m));
                    None
                } else {
                    Some(p)
                }
            }
            other => other,
        };
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
    pub(super) fn keep_when_measured(&mut self, per_mode: u32) {
        let enough = self.enough(per_mode);
        if self.live().all(|m| self.samples[slot(m)].len() >= enough) {
            let kept = self.leader();
            if self.kept != Some(kept) {
                tracing::info!(mode = ?kept, batches = self.batches, "Auto keeps a share mode");
            }
            self.kept = Some(kept);
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
        // A third mode failing: an outage after all.
        if self.pair.is_some_and(|p| !p.has(mode)) {
            self.pair = None;
        }
        match self.suspect {
            Some(s) if s != mode => {
                self.suspect = None;
                self.pair = Some(match self.pair {
                    Some(p) if p.has(s) && p.has(mode) => FailingPair { armed: true, ..p },
                    _ => FailingPair {
                        modes: [s, mode],
                        seen: 0,
                        armed: true,
                    },
                });
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

    /// `m` fails on its own account: not proposed again until paroled. Should no mode be left
    /// live, the modes dropped as slower come back (they may be the only ones that load).
    pub(super) fn fail_out(&mut self, m: ShareMode) {
        self.failed_out[slot(m)] = true;
        self.out_for[slot(m)] = 0;
        self.fail_outs[slot(m)] = self.fail_outs[slot(m)].saturating_add(1);
        if self.live().next().is_none() {
            for x in AUTO_MODES {
                self.dropped[slot(x)] = false;
            }
        }
    }

    /// A batch loaded: each mode failed out for [`AUTO_PAROLE`] loaded batches (doubled each
    /// time it failed out before, at most 2^10 times) is paroled, and `Auto` measures again
    /// with it unless it follows rank 0 (rank 0's own parole leads the group) or the mode was
    /// also dropped as slower (it could not be picked: the kept mode stays kept). Before, a
    /// mode failed out stayed out for the process's life: a store or fabric that flapped
    /// after the pick (three failures, the probe loading, one more failure) made the fastest
    /// mode the kept one's loser for good.
    pub(super) fn parole(&mut self) {
        let mut paroled = Vec::new();
        for m in AUTO_MODES {
            let i = slot(m);
            if !self.failed_out[i] {
                continue;
            }
            self.out_for[i] = self.out_for[i].saturating_add(1);
            let shift = self.fail_outs[i].saturating_sub(1).min(10);
            if self.out_for[i] >= AUTO_PAROLE << shift {
                self.failed_out[i] = false;
                self.out_for[i] = 0;
                self.failing[i] = 0;
                self.last_failure[i] = None;
                paroled.push(m);
            }
        }
        if paroled.is_empty() {
            return;
        }
        tracing::info!(
            modes = ?paroled,
            kept = ?self.kept,
            "Auto: modes that failed out are tried again"
        );
        // Measured again only for a mode it may pick (one dropped as slower stays dropped).
        let pickable = paroled.iter().any(|m| !self.dropped[slot(*m)]);
        if pickable && self.kept.is_some() && !self.followed {
            self.kept = None;
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.probe_failed = [false; ShareMode::COUNT];
            self.suspect = None;
            self.last_failed = None;
            self.pair = None;
            self.proposals = 0;
        }
    }

    /// Batches each remaining mode needs before one is kept: `per_mode`, or
    /// [`AUTO_DOUBT_ROUNDS`] times that while the pick is a close call.
    pub(super) fn enough(&self, per_mode: u32) -> usize {
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
    pub(super) fn close_call(&self) -> bool {
        self.leader_within(AUTO_TIE - AUTO_DOUBT) != self.leader_within(AUTO_TIE + AUTO_DOUBT)
    }

    /// The mode to keep from the medians so far: the first in tie order among the modes
    /// still measured whose median is within [`AUTO_TIE`] of the best.
    pub(super) fn leader(&self) -> ShareMode {
        self.leader_within(AUTO_TIE)
    }

    /// The first in tie order among the modes still measured whose median is within `margin`
    /// (a fraction) of the best.
    pub(super) fn leader_within(&self, margin: f64) -> ShareMode {
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
    pub(super) fn best(&self) -> f64 {
        self.live()
            .filter(|m| self.pickable(*m))
            .filter_map(|m| self.median(m))
            .fold(f64::INFINITY, f64::min)
    }

    /// Batches of `m`: those measured, and the one `in_flight` (ran, its time not known yet).
    pub(super) fn count(&self, m: ShareMode, in_flight: Option<ShareMode>) -> usize {
        self.samples[slot(m)].len() + usize::from(in_flight == Some(m))
    }

    /// Whether `m` failed and no batch of another mode was measured since: it is not proposed
    /// while another mode may be, so that its next failure (if any) comes after another
    /// mode's measured batch, which tells a mode failing on its own account from an outage.
    pub(super) fn waits_after_failing(&self, m: ShareMode) -> bool {
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
    pub(super) fn describe(&self) -> String {
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
