//! One batch on one rank, before its layers move: the keys, the mode every rank agrees on,
//! how each layer splits into own and shared rows, the landing, and the read session. Then
//! the [`LayerPipeline`](super::pipeline::LayerPipeline) runs it.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::{check_plan, Collective, GateVerdict, StagingLayout};
use kv_device::BatchShape;
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, LoadTicket, ShareMode};
use tracing::{info, info_span, warn};

use super::group::DataGroup;
use super::pipeline::LayerPipeline;
use super::reader::{store_failure, ComponentKeys, LayerReader};
use super::session::PinnedKeys;
use super::Inner;

/// A batch handed to the load thread.
pub(crate) struct BatchJob {
    pub(crate) plan: BatchPlan,
    pub(crate) ticket: LoadTicket,
    pub(crate) epoch: u64,
    pub(crate) started: Instant,
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

    /// Bytes this rank reads from the store for layer `layer`: its own components on every
    /// page, and its share of the replicated ones.
    pub(crate) fn read_bytes(&self, layer: u32) -> u64 {
        let on = |c: &&ComponentKeys| c.layout.position(layer).is_some();
        let own: u64 = self
            .own
            .iter()
            .filter(on)
            .map(|c| c.layout.page_layer_bytes * self.pages as u64)
            .sum();
        let mine = self.my_pages().len() as u64;
        let shared: u64 = self
            .shared
            .iter()
            .filter(on)
            .map(|c| c.layout.page_layer_bytes * mine)
            .sum();
        own + shared
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

    /// Every rank: the plan gate (even for an empty batch), then rank 0's mode proposal.
    /// A plan that differs across ranks runs `AllRanks`.
    fn agree_mode(
        &self,
        coll: &dyn Collective,
        job: &BatchJob,
        replicated_bytes_per_layer: u64,
    ) -> Result<ShareMode, KvLoadError> {
        let batch = job.plan.logical.batch;
        let verdict = check_plan(coll, &job.plan.logical, self.collective_deadline())
            .map_err(|e| collective_failure(batch, e))?;
        let (proposal, why) = self.auto.propose(coll.size(), replicated_bytes_per_layer);
        let proposals = coll
            .all_gather_u64(mode_code(proposal), self.collective_deadline())
            .map_err(|e| collective_failure(batch, e))?;
        let mode = proposals
            .first()
            .and_then(|&c| mode_of(c))
            .unwrap_or(ShareMode::AllRanks);
        match verdict {
            GateVerdict::Agreed => {
                if coll.rank() == 0 {
                    info!(%batch, ?mode, why, "share mode");
                }
                Ok(mode)
            }
            GateVerdict::Mismatch { differing } => {
                warn!(%batch, ?differing, "plans differ across ranks: this batch reads AllRanks");
                Ok(ShareMode::AllRanks)
            }
        }
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
    pub(crate) fn run_batch(
        &self,
        group: Option<&mut DataGroup>,
        job: &BatchJob,
    ) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let pages = job.plan.logical.num_pages();
        let span = info_span!("load_batch", %batch, pages);
        let _enter = span.enter();
        let components = self.component_keys(&job.plan)?;
        let coll = match group {
            Some(g) => Some(
                g.ready(self.collective_deadline())
                    .map_err(|e| collective_failure(batch, e))?,
            ),
            None => None,
        };
        let (rank, size) = coll.map_or((0, 1), |c| (c.rank(), c.size()));
        let replicated_per_layer: u64 = components
            .iter()
            .filter(|c| c.layout.replicated)
            .map(|c| c.layout.object_bytes() * pages as u64)
            .sum::<u64>()
            / u64::from(self.geometry.num_layers().max(1));
        let mode = match coll {
            Some(c) => self.agree_mode(c, job, replicated_per_layer)?,
            None => ShareMode::AllRanks,
        };
        // After the gate every rank must issue the batch's per-layer exchanges: from here on a
        // local failure is this rank's status, never an early return.
        let (layers, layout_error) = self.layers(components, mode, rank, size, pages);
        let slots: Arc<[u32]> = job.plan.slots.clone().into();
        let landing = self.landings.begin(slots, layers.shape());
        let prep = self.prepare(&layers, batch, layout_error, landing.as_ref().err());
        let mut landing = landing.ok();
        let stages = landing
            .as_mut()
            .map(|l| l.take_stages())
            .unwrap_or_default();
        let pipeline = LayerPipeline {
            inner: self,
            job,
            coll,
            layers: &layers,
            landing: landing.as_deref(),
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
            read_groups: run.read_groups,
            transfers: layer_transfers.iter().copied().sum(),
            layer_transfers,
        })
    }

    /// Local preparation: pins the keys this rank reads and checks their sizes. Any failure
    /// (here, or in building the layouts or the landing) is this rank's status from layer 0.
    fn prepare<'s>(
        &'s self,
        layers: &BatchLayers,
        batch: BatchId,
        layout_error: Option<KvLoadError>,
        landing_error: Option<&kv_device::DeviceError>,
    ) -> Result<PinnedKeys<'s>, KvLoadError> {
        if let Some(e) = layout_error {
            return Err(e);
        }
        if let Some(e) = landing_error {
            return Err(KvLoadError::Device(format!("{batch}: landing: {e}")));
        }
        let my_pages = layers.my_pages();
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
            .collect();
        // The object sizes are checked by the reader, beside its first group's read
        // (`BatchLayers::verify_sizes`).
        PinnedKeys::start(self.store.as_ref(), &read_keys, self.config.lease_renewal)
            .map_err(|e| store_failure(batch, None, Vec::new(), &e))
    }
}

impl BatchLayers {
    /// Checks that every object this rank reads holds exactly the bytes the geometry expects
    /// (a wrong one is discarded so the next save writes it again).
    pub(crate) fn verify_sizes(&self, reader: &LayerReader<'_>) -> Result<(), KvLoadError> {
        reader.verify_sizes(&self.own, 0..self.pages)?;
        reader.verify_sizes(&self.shared, self.my_pages())
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
