//! The gate every rank meets before a batch's layers move (see `batch`'s module docs, "Ranks
//! never drift"): the ranks in step at the same batch (or catching up, or lost and aborted),
//! the plans compared, the mode agreed; and a batch this rank refused meeting the group all
//! the same.

use dedup_broadcast::{
    check_batch, plan_digest, Collective, GateStep, GateVerdict, GateWord, GroupStatus, LayerStatus,
};
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, ShareMode};
use tracing::{info, warn};

use super::batch::{collective_failure, BatchJob};
use super::Inner;

/// Gates a rank ahead of others holds again for the same batch before it gives up.
const MAX_CATCH_UP: u32 = 8;

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
        if epoch != self.epoch {
            self.epoch = epoch;
            self.gates = 0;
        }
        let n = self.gates;
        self.gates += 1;
        n
    }
}

/// What the gate decided for a batch in step.
pub(crate) struct Gated {
    pub(crate) mode: ShareMode,
    /// The batch's status-word tag (the gate's number).
    pub(crate) tag: u8,
    /// Ranks whose plan differs from rank 0's (the batch then reads `AllRanks`).
    pub(crate) plans_differ: Vec<u32>,
}

impl Inner {
    /// The group's collectives no longer line up (or one failed): abort the handle so that
    /// every rank re-forms the group at its next batch; the batch's error.
    pub(crate) fn group_failed(
        &self,
        coll: &dyn Collective,
        batch: BatchId,
        why: String,
    ) -> KvLoadError {
        coll.abort(&why);
        warn!(%batch, why, "data group aborted: every rank re-forms it at its next batch");
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

    /// Every rank: the batch gate (see the module docs), until the ranks are in step at this
    /// batch; then rank 0's mode (`AllRanks` when the plans differ).
    pub(crate) fn gate(
        &self,
        gates: &mut GateCount,
        epoch: u64,
        coll: &dyn Collective,
        job: &BatchJob,
    ) -> Result<Gated, KvLoadError> {
        let batch = job.plan.logical.batch;
        let digest = plan_digest(&job.plan.logical);
        let (proposal, why) = self
            .auto
            .propose(coll.size(), self.replicated_per_layer(&job.plan));
        for _ in 0..=MAX_CATCH_UP {
            let count = gates.next(epoch);
            let word = GateWord {
                digest,
                batch: batch.0,
                count,
                proposal: proposal.wire_code(),
                last_batch_us: 0,
            };
            let gate = check_batch(coll, &word, self.collective_deadline())
                .map_err(|e| self.group_failed(coll, batch, format!("gate: {e}")))?;
            match gate.step {
                GateStep::InStep => {
                    let mode = gate
                        .proposals
                        .first()
                        .and_then(|&c| ShareMode::from_wire_code(c))
                        .unwrap_or(ShareMode::AllRanks);
                    let (mode, plans_differ) = match gate.verdict {
                        GateVerdict::Agreed => {
                            if coll.rank() == 0 {
                                info!(%batch, ?mode, why, "share mode");
                            }
                            (mode, Vec::new())
                        }
                        GateVerdict::Mismatch { differing } => {
                            warn!(%batch, ?differing, "plans differ across ranks: this batch reads AllRanks");
                            (ShareMode::AllRanks, differing)
                        }
                    };
                    return Ok(Gated {
                        mode,
                        tag: count as u8,
                        plans_differ,
                    });
                }
                GateStep::Ahead { earliest } => {
                    warn!(%batch, earliest, "a rank is behind (at an earlier batch): gating this batch again");
                }
                GateStep::Behind { latest } => {
                    warn!(%batch, latest, "this rank is behind the group: skipping this batch");
                    return Err(collective_failure(
                        batch,
                        format!("ranks out of step: the group is at batch {latest}; this batch is skipped to catch up"),
                    ));
                }
                GateStep::Lost { detail } => {
                    return Err(self.group_failed(
                        coll,
                        batch,
                        format!("ranks out of step: {detail}"),
                    ));
                }
            }
        }
        Err(self.group_failed(
            coll,
            batch,
            format!("ranks still out of step after {MAX_CATCH_UP} gates"),
        ))
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
        warn!(%batch, error = %why, "batch refused on this rank: the group fails it");
        let mut status = GroupStatus::default();
        status
            .exchange_tagged(
                coll,
                0,
                LayerStatus::from_error(&why),
                tag,
                self.collective_deadline(),
            )
            .map_err(|e| self.group_failed(coll, batch, format!("status: {e}")))?;
        if status.out_of_step {
            return Err(self.group_failed(coll, batch, "status words out of step".into()));
        }
        Err(status.to_error(batch).unwrap_or(why))
    }
}
