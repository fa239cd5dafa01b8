//! The gate every rank meets before a batch's layers move (see `batch`'s module docs, "Ranks
//! never drift"): the ranks in step at the same batch (or catching up, or lost and aborted),
//! the plans compared, the mode agreed; and a batch this rank refused meeting the group all
//! the same. The gate word also carries this rank's previous batch time, so that `Auto`
//! records the group's time (see `group_time`).

use dedup_broadcast::{
    check_batch, plan_digest_in, AloneLoads, BatchGate, Collective, GateStep, GateVerdict,
    GateWord, GroupStatus, LayerStatus, RanksAhead,
};
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, ShareMode};
use tracing::{debug, warn};

use super::batch::{collective_failure, BatchJob};
use super::group_time::{BatchSample, PendingSample};
use super::Inner;
use crate::log_every::LogEvery;

/// Gates a rank ahead of others holds again for the same batch before it gives up.
const MAX_CATCH_UP: u32 = 8;

/// Set in a gate word's proposal when the proposing rank's `Auto` has kept that mode for good:
/// a rank that has not decided (one restarted, whose measures start again while rank 0 keeps
/// proposing one mode) follows rank 0's decision. Ranks of one group run one kvlink version
/// (the rendezvous checks it), so no peer reads the bit as a mode.
const PROPOSAL_KEPT: u64 = 1 << 63;

/// The gates held on the current data handle: the gate word's sequence number, equal on every
/// rank while the ranks are in step, and 0 again on a freshly formed handle (a new epoch).
#[derive(Debug, Default)]
pub(crate) struct GateCount {
    epoch: u64,
    gates: u64,
}

impl GateCount {
    /// The number of the next gate on the data handle of formation `epoch` (then counted).
    pub(crate) fn next(&mut self, epoch: u64) -> u64 {
        let n = self.peek(epoch);
        self.epoch = epoch;
        self.gates = n + 1;
        n
    }

    /// The number [`next`](Self::next) would give for `epoch`, without counting it.
    pub(crate) fn peek(&self, epoch: u64) -> u64 {
        if epoch == self.epoch {
            self.gates
        } else {
            0
        }
    }
}

/// What the load thread keeps from one gate to the next: the gates held on the data handle,
/// its last batch's time waiting to travel in the next gate word, which of its last batches
/// it loaded alone (the word's `alone`, kept across re-formations: a group that re-forms
/// after this rank loaded alone learns it at its next gate), and what the ranks ahead said at
/// the last gate judged (a rank behind settles the batches it is behind on as they did, even
/// once the group broke before it caught up).
#[derive(Debug, Default)]
pub(crate) struct Gates {
    pub(crate) count: GateCount,
    pub(crate) pending: PendingSample,
    pub(crate) alone: AloneLoads,
    pub(crate) ahead: RanksAhead,
    /// The batch this rank gated when `ahead` was judged: the record speaks of later batches
    /// only (a batch id started again, or lower, finds none).
    pub(crate) ahead_at: u64,
    /// The "plans differ" lines logged at `warn` lately, by the ranks that differ: ranks
    /// configured apart differ at every batch, which must not flood the log.
    pub(crate) differ_log: LogEvery,
}

/// Logs that the plans (or key spaces) of ranks `differing` differ from rank 0's at `batch`:
/// at `warn` once a minute for the same ranks (saying how many batches went to `debug`
/// since), at `debug` in between.
fn log_plans_differ(log: &LogEvery, batch: BatchId, differing: &[u32]) {
    match log.due_after(&format!("{differing:?}")) {
        Some(since) => warn!(
            %batch,
            ?differing,
            batches_at_debug_since = since,
            "plans or key spaces (namespace, cp/pp ranks) differ across ranks: this batch reads \
             AllRanks (logged again every minute while the same ranks differ)"
        ),
        None => debug!(%batch, ?differing, "plans differ across ranks: this batch reads AllRanks"),
    }
}

impl Gates {
    /// `batch` is settled on this rank, loaded alone or not (loaded with the group, failed,
    /// refused, cancelled).
    pub(crate) fn settled(&mut self, batch: BatchId, alone: bool) {
        self.alone.settled(batch.0, alone);
    }
}

/// Why a batch did not pass its gate.
#[derive(Debug)]
pub(crate) enum GateMiss {
    /// The group is at a later batch: its ranks went on without this one, and this rank
    /// settles it to catch up (`settled_alone`: every rank ahead loaded it alone). The
    /// handle stays whole.
    Behind {
        error: KvLoadError,
        settled_alone: bool,
    },
    /// The gate's collective failed, or the ranks are lost (the handle is then aborted).
    Failed(KvLoadError),
}

/// What the gate decided for a batch in step.
pub(crate) struct Gated {
    pub(crate) mode: ShareMode,
    /// The gate's number on the data handle.
    pub(crate) count: u64,
    /// Ranks whose plan differs from rank 0's (the batch then reads `AllRanks`).
    pub(crate) plans_differ: Vec<u32>,
}

impl Gated {
    /// The batch's status-word tag: the gate's number, truncated.
    pub(crate) fn tag(&self) -> u8 {
        self.count as u8
    }
}

impl Inner {
    /// The group's collectives no longer line up (or one failed): abort the handle so that
    /// every rank re-forms the group at its next batch; the batch's error.
    pub(crate) fn group_failed(
        &self,
        coll: &dyn Collective,
        batch: BatchId,
        why: impl Into<kv_loader::Cause>,
    ) -> KvLoadError {
        let why: kv_loader::Cause = why.into();
        let words = why.to_string();
        coll.abort(&words);
        warn!(%batch, why = words, "data group aborted: every rank re-forms it at its next batch");
        collective_failure(batch, why)
    }

    /// Replicated bytes per layer of the plan (what `Auto` decides from).
    fn replicated_per_layer(&self, plan: &BatchPlan) -> u64 {
        let pages = plan.logical.num_pages() as u64;
        plan.logical
            .components
            .iter()
            .filter_map(|id| self.geometry.component(*id).ok())
            .filter(|c| c.replicated)
            .map(|c| c.object_bytes() * pages)
            .sum::<u64>()
            / u64::from(self.geometry.num_layers().max(1))
    }

    /// What names the objects this rank reads for a plan's page hashes beside the hashes
    /// themselves (the resolved namespace, the context- and pipeline-parallel ranks), for the
    /// gate's digest: ranks configured apart read different objects, and a receiver must not
    /// land a peer's (their plans differ, and the batch runs `AllRanks`).
    fn key_space(&self) -> Vec<u8> {
        let k = &self.keys;
        let mut space = Vec::with_capacity(k.namespace.len() + 9);
        space.extend_from_slice(k.namespace.as_bytes());
        space.push(0);
        space.extend_from_slice(&k.cp_rank.to_le_bytes());
        space.extend_from_slice(&k.pp_rank.to_le_bytes());
        space
    }

    /// Every rank: the batch gate (see the module docs), until the ranks are in step at this
    /// batch; then rank 0's mode (`AllRanks` when the plans differ). The first gate word
    /// carries the previous batch's time, when it is due here; once in step, `Auto` records
    /// the group's time of that batch.
    pub(crate) fn gate(
        &self,
        gates: &mut Gates,
        epoch: u64,
        coll: &dyn Collective,
        job: &BatchJob,
    ) -> Result<Gated, GateMiss> {
        let batch = job.plan.logical.batch;
        let digest = plan_digest_in(&job.plan.logical, &self.key_space());
        let mut sample = gates.pending.take_for(epoch, gates.count.peek(epoch));
        // The proposal goes in the same word as the previous batch's time, so that batch is
        // still in flight for `Auto` (it counts it, without its time).
        let (proposal, why) = self.auto.propose(
            coll.size(),
            self.replicated_per_layer(&job.plan),
            sample.map(|s| s.mode),
        );
        for _ in 0..=MAX_CATCH_UP {
            let count = gates.count.next(epoch);
            // Only the first word carries it: a gate held again (catching up) sends none.
            let mine = sample.take();
            let word = GateWord {
                digest,
                batch: batch.0,
                count,
                proposal: proposal.wire_code()
                    | if self.auto.kept() == Some(proposal) {
                        PROPOSAL_KEPT
                    } else {
                        0
                    },
                last_batch_us: mine.map_or(0, |s| s.word_us()),
                alone: gates.alone,
            };
            let gate = check_batch(coll, &word, self.collective_deadline()).map_err(|e| {
                let why = kv_loader::Cause::with_source(format!("gate: {e}"), e);
                GateMiss::Failed(self.group_failed(coll, batch, why))
            })?;
            if let Some(mine) = mine {
                self.observe_group_time(batch, mine, &gate);
            }
            gates.ahead = gate.ahead.clone();
            gates.ahead_at = batch.0;
            match gate.step {
                GateStep::InStep => {
                    let code = gate.proposals.first().copied().unwrap_or(0);
                    let mode = ShareMode::from_wire_code(code & !PROPOSAL_KEPT)
                        .unwrap_or(ShareMode::AllRanks);
                    let (mode, plans_differ) = match gate.verdict {
                        GateVerdict::Agreed => {
                            if coll.rank() == 0 {
                                debug!(%batch, ?mode, why, "share mode");
                            } else {
                                self.auto.follow(mode, code & PROPOSAL_KEPT != 0);
                            }
                            (mode, Vec::new())
                        }
                        GateVerdict::Mismatch { differing } => {
                            log_plans_differ(&gates.differ_log, batch, &differing);
                            (ShareMode::AllRanks, differing)
                        }
                    };
                    return Ok(Gated {
                        mode,
                        count,
                        plans_differ,
                    });
                }
                GateStep::Ahead { earliest } => {
                    warn!(%batch, earliest, "a rank is behind (at an earlier batch): gating this batch again");
                }
                GateStep::Behind {
                    latest,
                    settled_alone,
                } => {
                    warn!(%batch, latest, settled_alone, "this rank is behind the group: settling this batch without it");
                    return Err(GateMiss::Behind {
                        error: collective_failure(
                            batch,
                            format!("ranks out of step: the group is at batch {latest}; this batch is skipped to catch up"),
                        ),
                        settled_alone,
                    });
                }
                GateStep::Lost { detail } => {
                    return Err(GateMiss::Failed(self.group_failed(
                        coll,
                        batch,
                        format!("ranks out of step: {detail}"),
                    )));
                }
            }
        }
        Err(GateMiss::Failed(self.group_failed(
            coll,
            batch,
            format!(
                "ranks still out of step after {} gates (the first and {MAX_CATCH_UP} held again)",
                MAX_CATCH_UP + 1
            ),
        )))
    }

    /// After a gate whose word carried this rank's previous batch (`mine`): `Auto` records
    /// the group's time of it (the slowest rank's) when the ranks are in step and every rank
    /// sent a time; otherwise the sample is dropped (every rank sees the same words, so every
    /// rank records alike).
    fn observe_group_time(&self, batch: BatchId, mine: BatchSample, gate: &BatchGate) {
        let group = match gate.step {
            GateStep::InStep => super::group_time::group_time(&gate.last_batch_us),
            _ => None,
        };
        let mode = mine.mode;
        match group {
            Some(took) => {
                debug!(%batch, ?mode, own = ?mine.took, group = ?took,
                    "Auto: the previous batch's time on the slowest rank");
                self.auto.observe_batch(mode, mine.landed, took);
            }
            None => debug!(%batch, ?mode, times = ?gate.last_batch_us, step = ?gate.step,
                "Auto: the previous batch's time is dropped (a rank sent none, or the ranks \
                 are out of step)"),
        }
    }

    /// A batch this rank refused (or that was cancelled before it ran): after the gate, one
    /// failed status word for layer 0, as every other rank exchanges it, so every rank fails
    /// the batch alike.
    pub(crate) fn refuse(
        &self,
        coll: &dyn Collective,
        batch: BatchId,
        tag: u8,
        why: KvLoadError,
    ) -> Result<LoadStats, KvLoadError> {
        if matches!(
            why,
            KvLoadError::Cancelled { .. } | KvLoadError::Busy { .. }
        ) {
            // The engine's own doing (a reset, back-pressure): every queued batch of a reset
            // comes here, and the batch's failure is logged once a minute per kind anyway.
            debug!(%batch, error = %why, "batch refused on this rank: the group fails it");
        } else {
            warn!(%batch, error = %why, "batch refused on this rank: the group fails it");
        }
        let mut status = GroupStatus::default();
        status
            .exchange_tagged(
                coll,
                0,
                LayerStatus::from_error(&why),
                tag,
                self.collective_deadline(),
            )
            .map_err(|e| {
                let why = kv_loader::Cause::with_source(format!("status: {e}"), e);
                self.group_failed(coll, batch, why)
            })?;
        if status.out_of_step {
            return Err(self.group_failed(coll, batch, "status words out of step"));
        }
        Err(status.to_error(batch).unwrap_or(why))
    }
}

#[cfg(test)]
mod tests {
    use super::{log_plans_differ, BatchId, GateCount, LogEvery};

    #[test]
    fn gates_count_per_handle_and_peek_does_not_count() {
        let mut g = GateCount::default();
        assert_eq!(g.peek(1), 0);
        assert_eq!(g.next(1), 0);
        assert_eq!(g.peek(1), 1);
        assert_eq!(g.peek(1), 1, "peeking counts nothing");
        assert_eq!(g.next(1), 1);
        // A freshly formed handle counts from 0 again.
        assert_eq!(g.peek(2), 0);
        assert_eq!(g.next(2), 0);
        assert_eq!(g.next(2), 1);
    }

    /// Ranks configured apart (another namespace) differ at every batch: one `warn` line a
    /// minute for the same ranks, not one a batch on every rank; other ranks get their own.
    #[test]
    fn plans_that_differ_at_every_batch_warn_once_a_minute() {
        let log = LogEvery::default();
        let ((), lines) = crate::test_logs::logged(|| {
            for b in 0..50 {
                log_plans_differ(&log, BatchId(b), &[2]);
            }
            log_plans_differ(&log, BatchId(50), &[1, 2]);
        });
        let warns: Vec<_> = lines
            .iter()
            .filter(|l| l.level == tracing::Level::WARN)
            .collect();
        assert_eq!(warns.len(), 2, "{lines:?}");
        assert!(warns[0].fields.contains("differing=[2]"), "{:?}", warns[0]);
        assert!(
            warns[1].fields.contains("differing=[1, 2]"),
            "{:?}",
            warns[1]
        );
        let debugs = lines.iter().filter(|l| l.level == tracing::Level::DEBUG);
        assert_eq!(debugs.count(), 49);
    }
}
