//! One batch's load on one rank, layer by layer: a reader thread reads layer *l+1* while
//! this (the load) thread exchanges layer *l* with the other ranks and lands it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use dedup_broadcast::{
    check_plan, Buffer, Collective, GateVerdict, GroupStatus, LayerStatus, StagingLayout,
};
use kv_device::LayerLanding;
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, LoadTicket, ShareMode};
use parking_lot::Mutex;
use tracing::{info, info_span, warn};

use super::reader::{store_failure, ComponentKeys, LayerReader};
use super::session::PinnedKeys;
use super::staging::{scatter_rows, SharedLanding, StagingLanding};
use super::Shared;

/// A batch handed to the load thread.
pub(crate) struct BatchJob {
    pub(crate) plan: BatchPlan,
    pub(crate) ticket: LoadTicket,
    pub(crate) epoch: u64,
    pub(crate) started: Instant,
}

/// What the reader hands over for one layer.
struct ReadLayer {
    layer: u32,
    staging: Vec<u8>,
    status: LayerStatus,
}

/// What the reader did in all.
struct ReadSummary {
    bytes_read: u64,
    /// Bytes read straight into this rank's slots (not shared).
    own_bytes: u64,
    failure: Option<KvLoadError>,
    /// The staging buffers, back for reuse.
    staging: Vec<Vec<u8>>,
}

fn collective_failure(batch: BatchId, e: impl std::fmt::Display) -> KvLoadError {
    KvLoadError::Collective {
        batch: Some(batch),
        detail: e.to_string(),
    }
}

impl Shared {
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

    fn cancelled(&self, job: &BatchJob) -> bool {
        self.epoch.load(Ordering::Acquire) != job.epoch
    }

    fn collective_deadline(&self) -> Instant {
        kv_loader::deadline_after(self.config.collective_timeout)
    }

    /// The data collective, when this linker shares with other ranks.
    fn data_group(&self) -> Option<&dyn Collective> {
        self.group
            .as_ref()
            .map(|g| g.data.as_ref())
            .filter(|c| c.size() > 1)
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
        let (proposal, why) = self.propose_mode(coll.size(), replicated_bytes_per_layer);
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

    /// Loads every layer of `job` into the pool, marking each ready as it lands.
    pub(crate) fn run_batch(&self, job: &BatchJob) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let pages = job.plan.logical.num_pages();
        let span = info_span!("load_batch", %batch, pages);
        let _enter = span.enter();
        let num_layers = self.geometry.num_layers();
        let components = self.component_keys(&job.plan)?;
        let coll = self.data_group();
        let rank = coll.map_or(0, |c| c.rank());
        let replicated_per_layer: u64 = components
            .iter()
            .filter(|c| c.layout.replicated)
            .map(|c| c.layout.object_bytes() * pages as u64)
            .sum::<u64>()
            / u64::from(num_layers.max(1));
        let mode = match coll {
            Some(c) => self.agree_mode(c, job, replicated_per_layer)?,
            None => ShareMode::AllRanks,
        };
        let (shared, own): (Vec<ComponentKeys>, Vec<ComponentKeys>) = components
            .into_iter()
            .partition(|c| c.layout.replicated && mode != ShareMode::AllRanks);
        // After the gate every rank must issue the batch's per-layer exchanges, so a staging
        // error becomes this rank's status (below), not an early return.
        let layouts: Result<Vec<Option<StagingLayout>>, KvLoadError> = (0..num_layers)
            .map(|l| {
                if shared.is_empty() {
                    return Ok(None);
                }
                let tp = coll.map_or(1, |c| c.size());
                StagingLayout::new(mode, l, shared.iter().map(|c| &c.layout), pages, tp)
                    .map(Some)
                    .map_err(|e| KvLoadError::Config(format!("{batch}: staging: {e}")))
            })
            .collect();
        let (layouts, layout_error) = match layouts {
            Ok(l) => (l, None),
            Err(e) => (vec![None; num_layers as usize], Some(e)),
        };
        let staging_len = layouts.iter().flatten().map(StagingLayout::len).max();

        // Local preparation; a failure here is this rank's status from layer 0 on.
        let slots: std::sync::Arc<[u32]> = job.plan.slots.clone().into();
        let (landing, landing_error) = match self.landings.begin(slots) {
            Ok(l) => (Some(Mutex::new(l)), String::new()),
            Err(e) => (None, format!("{batch}: landing: {e}")),
        };
        let own_reader = LayerReader {
            store: self.store.as_ref(),
            batch,
            components: &own,
            parallelism: self.config.read_parallelism,
        };
        let shared_reader = LayerReader {
            components: &shared,
            ..own_reader
        };
        let my_pages = layouts
            .iter()
            .flatten()
            .next()
            .map_or(0..0, |l| l.share(rank));
        let read_keys: Vec<&str> = own
            .iter()
            .flat_map(|c| c.keys.iter().map(String::as_str))
            .chain(
                shared
                    .iter()
                    .flat_map(|c| c.keys[my_pages.clone()].iter().map(String::as_str)),
            )
            .collect();
        let prep = PinnedKeys::start(self.store.as_ref(), &read_keys, self.config.lease_renewal)
            .map_err(|e| store_failure(batch, None, Vec::new(), &e))
            .and_then(|pins| {
                if let Some(e) = &layout_error {
                    return Err(e.clone());
                }
                if landing.is_none() {
                    return Err(KvLoadError::Device(landing_error.clone()));
                }
                if self.config.verify_object_sizes {
                    own_reader.verify_sizes(0..pages)?;
                    shared_reader.verify_sizes(my_pages.clone())?;
                }
                Ok(pins)
            });

        let group_failed = AtomicBool::new(false);
        let staging_bufs = self.take_staging(staging_len.unwrap_or(0));
        let mut first_layer = Duration::ZERO;
        let mut landed = 0u64;
        let mut group_status = GroupStatus::default();
        let mut broken: Option<KvLoadError> = None;

        let summary = std::thread::scope(|s| {
            let (to_exchange, from_reader) = mpsc::sync_channel::<ReadLayer>(1);
            let (to_reader, free_staging) = mpsc::channel::<Vec<u8>>();
            for b in staging_bufs {
                let _ = to_reader.send(b);
            }
            let (layouts, group_failed, landing) = (&layouts, &group_failed, &landing);
            let (own_reader, shared_reader) = (&own_reader, &shared_reader);
            let reader = std::thread::Builder::new()
                .name(format!("kvlink-read-r{}", self.geometry.tp_rank))
                .spawn_scoped(s, move || {
                    let mut pins = prep;
                    let mut summary = ReadSummary {
                        bytes_read: 0,
                        own_bytes: 0,
                        failure: pins.as_ref().err().cloned(),
                        staging: Vec::new(),
                    };
                    for layer in 0..num_layers {
                        let Ok(mut staging) = free_staging.recv() else {
                            break;
                        };
                        if summary.failure.is_none() && self.cancelled(job) {
                            summary.failure = Some(KvLoadError::Cancelled { batch });
                        }
                        if summary.failure.is_none() && group_failed.load(Ordering::Acquire) {
                            summary.failure = Some(KvLoadError::Cancelled { batch });
                        }
                        if let (None, Some(landing)) = (&summary.failure, landing) {
                            let layout = layouts[layer as usize].as_ref();
                            let read = self.read_one_layer(
                                &mut pins,
                                own_reader,
                                shared_reader,
                                &mut SharedLanding(landing),
                                &mut staging,
                                layout,
                                layer,
                                rank,
                                pages,
                            );
                            match read {
                                Ok((own, shared)) => {
                                    summary.own_bytes += own;
                                    summary.bytes_read += own + shared;
                                }
                                Err(e) => {
                                    warn!(%batch, layer, rank, error = %e, "read failed");
                                    summary.failure = Some(e);
                                }
                            }
                        }
                        let status = summary
                            .failure
                            .as_ref()
                            .map_or(LayerStatus::Ok, LayerStatus::from_error);
                        let msg = ReadLayer {
                            layer,
                            staging,
                            status,
                        };
                        if to_exchange.send(msg).is_err() {
                            break;
                        }
                    }
                    drop(to_exchange);
                    // Every buffer comes back once the load thread is done with it.
                    summary.staging.extend(free_staging.iter());
                    summary
                });
            let reader = match reader {
                Ok(r) => r,
                Err(e) => {
                    broken = Some(KvLoadError::Config(format!("spawning a reader: {e}")));
                    return None;
                }
            };
            for layer in 0..num_layers {
                let Ok(mut msg) = from_reader.recv() else {
                    broken.get_or_insert(KvLoadError::Config(format!(
                        "{batch}: the reader stopped before layer {layer}"
                    )));
                    break;
                };
                if msg.layer != layer {
                    broken = Some(KvLoadError::Config(format!(
                        "{batch}: the reader sent layer {} for layer {layer}",
                        msg.layer
                    )));
                    break;
                }
                let was_ok = group_status.is_ok();
                match coll {
                    Some(c) => {
                        if let Err(e) =
                            group_status.exchange(c, layer, msg.status, self.collective_deadline())
                        {
                            broken = Some(collective_failure(batch, e));
                            break;
                        }
                    }
                    None => {
                        group_status.record(layer, &[msg.status]);
                    }
                }
                if was_ok && !group_status.is_ok() {
                    group_failed.store(true, Ordering::Release);
                }
                if let (true, Some(landing)) = (group_status.is_ok(), &landing) {
                    match self.share_and_land(
                        coll,
                        layouts[layer as usize].as_ref(),
                        &mut msg.staging,
                        &mut SharedLanding(landing),
                        job,
                        layer,
                    ) {
                        Ok(n) => landed += n,
                        Err(e) => {
                            broken = Some(e);
                            break;
                        }
                    }
                    if layer == 0 {
                        first_layer = job.started.elapsed();
                    }
                }
                let _ = to_reader.send(msg.staging);
            }
            drop(to_reader);
            drop(from_reader);
            reader.join().ok()
        });

        let Some(summary) = summary else {
            return Err(broken.unwrap_or(KvLoadError::Config(format!(
                "{batch}: the reader thread panicked"
            ))));
        };
        self.metrics.read(summary.bytes_read);
        self.return_staging(summary.staging);
        landed += summary.own_bytes;
        if let Some(e) = broken {
            return Err(e);
        }
        if !group_status.is_ok() {
            // One rank alone: its own error says most. A group: every rank reports the same.
            return Err(match (coll, summary.failure) {
                (None, Some(e)) => e,
                _ => group_status
                    .to_error(batch)
                    .unwrap_or(KvLoadError::Cancelled { batch }),
            });
        }
        let last_layer = job.started.elapsed();
        if coll.is_some() {
            self.observe_batch(mode, landed, last_layer);
        }
        Ok(LoadStats {
            pages: pages as u32,
            layers: num_layers,
            bytes_read: summary.bytes_read,
            bytes_landed: landed,
            mode,
            first_layer,
            last_layer,
        })
    }

    /// Reads one layer on this rank: its own components straight into its slots, its share of
    /// the shared ones into staging.
    #[allow(clippy::too_many_arguments)]
    fn read_one_layer(
        &self,
        pins: &mut Result<PinnedKeys<'_>, KvLoadError>,
        own: &LayerReader<'_>,
        shared: &LayerReader<'_>,
        landing: &mut dyn LayerLanding,
        staging: &mut [u8],
        layout: Option<&StagingLayout>,
        layer: u32,
        rank: u32,
        pages: usize,
    ) -> Result<(u64, u64), KvLoadError> {
        let batch = own.batch;
        if let Ok(p) = pins {
            p.renew_if_due()
                .map_err(|e| store_failure(batch, Some(layer), Vec::new(), &e))?;
        }
        let t0 = Instant::now();
        let own_bytes = own.read_layer(landing, layer, 0..pages)?;
        let mut shared_bytes = 0;
        if let Some(layout) = layout {
            let mut target = StagingLanding {
                base: staging.as_mut_ptr() as usize,
                layout,
            };
            shared_bytes = shared.read_layer(&mut target, layer, layout.share(rank))?;
        }
        let n = own_bytes + shared_bytes;
        let took = t0.elapsed();
        self.metrics.layer_read(took);
        self.observe_store_read(n, took);
        if took > self.config.layer_read_timeout {
            return Err(KvLoadError::Store {
                batch: Some(batch),
                layer: Some(layer),
                pages: (0..pages as u32).collect::<Vec<_>>().into(),
                kind: kv_loader::StoreFailure::RpcTimeout,
                detail: format!(
                    "layer read took {took:?}, over the limit of {:?}",
                    self.config.layer_read_timeout
                ),
            });
        }
        Ok((own_bytes, shared_bytes))
    }

    /// Every rank agreed the layer is good: move the staged rows between ranks, scatter them
    /// into this rank's slots, land and publish the layer. Returns the bytes landed.
    fn share_and_land(
        &self,
        coll: Option<&dyn Collective>,
        layout: Option<&StagingLayout>,
        staging: &mut [u8],
        landing: &mut dyn LayerLanding,
        job: &BatchJob,
        layer: u32,
    ) -> Result<u64, KvLoadError> {
        let batch = job.plan.logical.batch;
        let mut landed = 0;
        if let (Some(layout), Some(c)) = (layout, coll) {
            if !layout.is_empty() {
                // Derived from `&mut`: receivers' bytes are written through it.
                let whole = Buffer::host(staging.as_mut_ptr() as usize, layout.len());
                let t0 = Instant::now();
                // SAFETY: `staging` is this rank's own buffer of at least `layout.len()`
                // bytes, owned by this thread for the call (the reader has handed it over and
                // gets it back only after); the chunk is inside it, as all_gather allows.
                let r = unsafe {
                    match layout.mode() {
                        ShareMode::SplitAllGather => {
                            let chunk = layout.chunk(c.rank());
                            let send = Buffer::host(whole.addr + chunk.start, chunk.len());
                            c.all_gather(send, whole, self.collective_deadline())
                        }
                        _ => c.broadcast(whole, 0, self.collective_deadline()),
                    }
                };
                r.map_err(|e| collective_failure(batch, e))?;
                self.observe_fabric(layout.mode(), layout.len() as u64, t0.elapsed());
                landed += scatter_rows(&staging[..layout.len()], layout, landing)
                    .map_err(KvLoadError::from)?;
            }
        }
        let ready = landing.land(layer).map_err(KvLoadError::from)?;
        self.publish(job, layer, ready);
        Ok(landed)
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
