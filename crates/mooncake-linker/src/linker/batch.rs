//! One batch on one rank, before its layers move: the gate every rank meets (in step, the
//! plans compared, the mode agreed), the keys, how each layer splits into own and shared rows,
//! the landing, the read session and the checksums. Then the
//! [`LayerPipeline`](super::pipeline::LayerPipeline) runs it.
//!
//! **Ranks never drift.** Every batch this rank's engine started, loaded or refused, meets the
//! group at the gate: a batch refused at `start_load` (`Busy`, a duplicate id, an invalid plan)
//! or cancelled by `reset` before it ran still gates and exchanges a failed status word for
//! layer 0, so every rank issues the same collectives for it and every rank fails it. The gate
//! word carries the batch id and the number of gates held on the handle; ranks that meet at
//! different batches catch up (the rank behind skips its batch, the rank ahead gates its batch
//! again), and ranks whose collectives no longer line up at all abort the group, which every
//! rank re-forms at its next batch (sequence numbers from 0 again).

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::{
    check_batch, plan_digest, Collective, GateStep, GateVerdict, GateWord, GroupStatus,
    LayerStatus, StagingLayout,
};
use kv_device::{BatchShape, LayerLanding};
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, LoadTicket, ShareMode};
use tracing::{info, info_span, warn};

use super::group::DataGroup;
use super::outcomes::HeldOutcome;
use super::pipeline::LayerPipeline;
use super::reader::{store_failure, ComponentKeys, LayerReader};
use super::regions::Registered;
use super::session::PinnedKeys;
use super::verify::BatchChecksums;
use super::Inner;
use crate::store::Hold;

/// Gates a rank ahead of others holds again for the same batch before it gives up.
const MAX_CATCH_UP: u32 = 8;

/// A batch handed to the load thread.
pub(crate) struct BatchJob {
    pub(crate) plan: BatchPlan,
    /// `None` for a batch this rank refused at `start_load`: it still meets the group.
    pub(crate) ticket: Option<LoadTicket>,
    /// Why this rank refused the batch.
    pub(crate) refusal: Option<KvLoadError>,
    pub(crate) epoch: u64,
    pub(crate) started: Instant,
}

/// What the gate decided for a batch in step.
struct Gated {
    mode: ShareMode,
    /// The batch's status-word tag (the gate's number).
    tag: u8,
}

/// What a hung store call of a batch keeps alive until it returns: the landing (its staging
/// lease, its pool), the registered regions, and, when the store writes pool slots, the
/// batch's outcome (so the engine cannot reuse the slots before).
struct BatchMemory {
    _landing: Option<Arc<dyn LayerLanding>>,
    _registered: Option<Arc<Registered>>,
    _outcome: Option<Arc<HeldOutcome>>,
}

/// How a batch's components split on this rank once the ranks agreed on its mode.
pub(crate) struct BatchLayers {
    pub(crate) mode: ShareMode,
    pub(crate) rank: u32,
    pub(crate) pages: usize,
    /// Read by this rank for itself (sharded ones; all of them in `AllRanks`).
    pub(crate) own: Vec<ComponentKeys>,
    /// Replicated components the ranks share.
    pub(crate) shared: Vec<ComponentKeys>,
    /// Per layer, where the shared rows sit while they travel (none when nothing is shared).
    pub(crate) layouts: Vec<Option<StagingLayout>>,
}

impl BatchLayers {
    /// The plan pages of shared components this rank reads.
    pub(crate) fn my_pages(&self) -> Range<usize> {
        self.layouts
            .iter()
            .flatten()
            .next()
            .map_or(0..0, |l| l.share(self.rank))
    }

    /// The split, as the landing needs it.
    pub(crate) fn shape(&self) -> BatchShape {
        BatchShape {
            own: self.own.iter().map(|c| c.layout.id).collect(),
            shared: self.shared.iter().map(|c| c.layout.id).collect(),
            share_bytes: if self.shared.is_empty() {
                Vec::new()
            } else {
                self.layouts
                    .iter()
                    .map(|l| l.as_ref().map_or(0, StagingLayout::len))
                    .collect()
            },
        }
    }

    /// Bytes of layer `layer` in this rank's pool once it lands (every planned component).
    pub(crate) fn layer_bytes(&self, layer: u32) -> u64 {
        self.own
            .iter()
            .chain(&self.shared)
            .filter(|c| c.layout.position(layer).is_some())
            .map(|c| c.layout.page_layer_bytes * self.pages as u64)
            .sum()
    }
}

pub(crate) fn collective_failure(batch: BatchId, e: impl std::fmt::Display) -> KvLoadError {
    KvLoadError::Collective {
        batch: Some(batch),
        detail: e.to_string(),
    }
}

impl Inner {
    /// The keys of every planned component, in plan page order.
    pub(crate) fn component_keys(
        &self,
        plan: &BatchPlan,
    ) -> Result<Vec<ComponentKeys>, KvLoadError> {
        let mut out = Vec::with_capacity(plan.logical.components.len());
        for id in &plan.logical.components {
            let layout = self.geometry.component(*id)?.clone();
            let keys = plan
                .logical
                .pages()
                .map(|p| self.keys.object_key(p, &layout))
                .collect();
            out.push(ComponentKeys { layout, keys });
        }
        Ok(out)
    }

    fn collective_deadline(&self) -> Instant {
        kv_loader::deadline_after(self.config.collective_timeout)
    }

    /// Runs one batch on this rank: the gate (every rank, even for a batch refused or
    /// cancelled here), then its layers. `held` keeps the outcome back while a store call
    /// that may still write the slots runs.
    pub(crate) fn run_batch(
        &self,
        group: Option<&mut DataGroup>,
        job: &BatchJob,
        held: Option<&Arc<HeldOutcome>>,
    ) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let span = info_span!("load_batch", %batch, pages = job.plan.logical.num_pages());
        let _enter = span.enter();
        let cancelled = self.epoch.load(std::sync::atomic::Ordering::Acquire) != job.epoch;
        let refusal = job
            .refusal
            .clone()
            .or_else(|| cancelled.then_some(KvLoadError::Cancelled { batch }));
        let Some(group) = group else {
            // A rank alone has nobody to keep in step with.
            if let Some(e) = refusal {
                return Err(e);
            }
            return self.load_batch(None, job, ShareMode::AllRanks, 0, held);
        };
        let coll = group
            .ready(self.collective_deadline())
            .map_err(|e| collective_failure(batch, e))?;
        let gated = self.gate(group, coll.as_ref(), job)?;
        if let Some(e) = refusal {
            return self.refuse(coll.as_ref(), batch, gated.tag, e);
        }
        self.load_batch(Some(coll.as_ref()), job, gated.mode, gated.tag, held)
    }

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
    fn gate(
        &self,
        group: &mut DataGroup,
        coll: &dyn Collective,
        job: &BatchJob,
    ) -> Result<Gated, KvLoadError> {
        let batch = job.plan.logical.batch;
        let digest = plan_digest(&job.plan.logical);
        let (proposal, why) = self
            .auto
            .propose(coll.size(), self.replicated_per_layer(&job.plan));
        for _ in 0..=MAX_CATCH_UP {
            let count = group.next_gate();
            let word = GateWord {
                digest,
                batch: batch.0,
                count,
                proposal: mode_code(proposal),
            };
            let gate = check_batch(coll, &word, self.collective_deadline())
                .map_err(|e| self.group_failed(coll, batch, format!("gate: {e}")))?;
            match gate.step {
                GateStep::InStep => {
                    let mode = gate
                        .proposals
                        .first()
                        .and_then(|&c| mode_of(c))
                        .unwrap_or(ShareMode::AllRanks);
                    let mode = match gate.verdict {
                        GateVerdict::Agreed => {
                            if coll.rank() == 0 {
                                info!(%batch, ?mode, why, "share mode");
                            }
                            mode
                        }
                        GateVerdict::Mismatch { differing } => {
                            warn!(%batch, ?differing, "plans differ across ranks: this batch reads AllRanks");
                            ShareMode::AllRanks
                        }
                    };
                    return Ok(Gated {
                        mode,
                        tag: count as u8,
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
    fn refuse(
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

    /// How the batch's layers split, in `mode`. A layout that cannot be built becomes this
    /// rank's failure (every rank still exchanges every layer).
    fn layers(
        &self,
        components: Vec<ComponentKeys>,
        mode: ShareMode,
        rank: u32,
        size: u32,
        pages: usize,
    ) -> (BatchLayers, Option<KvLoadError>) {
        let (shared, own): (Vec<ComponentKeys>, Vec<ComponentKeys>) = components
            .into_iter()
            .partition(|c| c.layout.replicated && mode != ShareMode::AllRanks);
        let num_layers = self.geometry.num_layers();
        let layouts: Result<Vec<Option<StagingLayout>>, _> = (0..num_layers)
            .map(|l| {
                if shared.is_empty() {
                    return Ok(None);
                }
                StagingLayout::new(mode, l, shared.iter().map(|c| &c.layout), pages, size).map(Some)
            })
            .collect();
        let (layouts, error) = match layouts {
            Ok(l) => (l, None),
            Err(e) => (
                vec![None; num_layers as usize],
                Some(KvLoadError::Config(format!("staging: {e}"))),
            ),
        };
        let layers = BatchLayers {
            mode,
            rank,
            pages,
            own,
            shared,
            layouts,
        };
        (layers, error)
    }

    /// Loads every layer of `job` into the pool, marking each ready as it lands.
    fn load_batch(
        &self,
        coll: Option<&dyn Collective>,
        job: &BatchJob,
        mode: ShareMode,
        tag: u8,
        held: Option<&Arc<HeldOutcome>>,
    ) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let pages = job.plan.logical.num_pages();
        let (rank, size) = coll.map_or((0, 1), |c| (c.rank(), c.size()));
        // After the gate every rank must issue the batch's per-layer exchanges: from here on a
        // local failure is this rank's status, never an early return.
        let (components, keys_error) = match self.component_keys(&job.plan) {
            Ok(c) => (c, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let (layers, layout_error) = self.layers(components, mode, rank, size, pages);
        let slots: Arc<[u32]> = job.plan.slots.clone().into();
        let (landing, stages, landing_error) = match self.landings.begin(slots, layers.shape()) {
            Ok(mut l) => {
                let stages = l.take_stages();
                (Some(Arc::<dyn LayerLanding>::from(l)), stages, None)
            }
            Err(e) => (None, Vec::new(), Some(e)),
        };
        let memory: Hold = Arc::new(BatchMemory {
            _landing: landing.clone(),
            _registered: self.registered.lock().clone(),
            _outcome: held.cloned(),
        });
        let prep = match keys_error.or(layout_error) {
            Some(e) => Err(e),
            None => self.prepare(&layers, batch, landing_error.as_ref(), &memory),
        };
        let (prep, sums) = match prep {
            Ok((pins, sums)) => (Ok(pins), sums),
            Err(e) => (Err(e), BatchChecksums::default()),
        };
        let Some(counter) = job.ticket.map(|t| t.counter) else {
            return Err(KvLoadError::Config(format!(
                "{batch}: a refused batch has no ticket"
            )));
        };
        let pipeline = LayerPipeline {
            inner: self,
            job,
            counter,
            coll,
            layers: &layers,
            landing: landing.as_deref(),
            memory: &memory,
            sums: &sums,
            tag,
        };
        let run = pipeline.run(prep, stages)?;
        let last_layer = job.started.elapsed();
        if coll.is_some() {
            self.auto.observe_batch(mode, run.landed, last_layer);
        }
        let layer_transfers = landing.as_ref().map(|l| l.transfers()).unwrap_or_default();
        Ok(LoadStats {
            pages: pages as u32,
            layers: self.geometry.num_layers(),
            bytes_read: run.bytes_read,
            bytes_landed: run.landed,
            mode,
            first_layer: run.first_layer,
            last_layer,
            transfers: layer_transfers.iter().copied().sum(),
            layer_transfers,
        })
    }

    /// Local preparation: pins the keys this rank reads (and their checksum companions),
    /// checks their sizes and reads the companions. Any failure (here, or in building the
    /// layouts or the landing) is this rank's status from layer 0.
    fn prepare<'s>(
        &'s self,
        layers: &BatchLayers,
        batch: BatchId,
        landing_error: Option<&kv_device::DeviceError>,
        memory: &Hold,
    ) -> Result<(PinnedKeys<'s>, BatchChecksums), KvLoadError> {
        if let Some(e) = landing_error {
            return Err(KvLoadError::Device(format!("{batch}: landing: {e}")));
        }
        let my_pages = layers.my_pages();
        let (companions, plan) = self.present_companions(layers, batch)?;
        let read_keys: Vec<&str> = layers
            .own
            .iter()
            .flat_map(|c| c.keys.iter().map(String::as_str))
            .chain(
                layers
                    .shared
                    .iter()
                    .flat_map(|c| c.keys[my_pages.clone()].iter().map(String::as_str)),
            )
            .chain(companions.iter().map(String::as_str))
            .collect();
        let pins = PinnedKeys::start(
            &self.calls,
            &read_keys,
            self.config.lease_renewal,
            self.config.store_call_timeout,
        )
        .map_err(|e| store_failure(batch, None, Vec::new(), &e))?;
        if self.config.verify_object_sizes {
            let reader = |components| LayerReader {
                calls: &self.calls,
                batch,
                components,
                parallelism: self.config.read_parallelism,
                hold: memory,
                deadline: kv_loader::deadline_after(self.config.store_call_timeout),
            };
            reader(&layers.own).verify_sizes(0..layers.pages)?;
            reader(&layers.shared).verify_sizes(my_pages)?;
        }
        let sums = self.read_companions(layers, batch, plan)?;
        Ok((pins, sums))
    }
}

/// Wire code of a share mode in the proposal exchange.
fn mode_code(mode: ShareMode) -> u64 {
    match mode {
        ShareMode::AllRanks => 0,
        ShareMode::Rank0Broadcast => 1,
        ShareMode::SplitAllGather => 2,
    }
}

fn mode_of(code: u64) -> Option<ShareMode> {
    match code {
        0 => Some(ShareMode::AllRanks),
        1 => Some(ShareMode::Rank0Broadcast),
        2 => Some(ShareMode::SplitAllGather),
        _ => None,
    }
}
