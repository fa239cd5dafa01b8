//! The linker: the [`KvLoader`] implementation over a [`KvStore`] and a [`KvPool`].
//!
//! One job per file: `gate` meets the group before a batch (in step, the plans compared, the
//! mode agreed; a refused batch meets it too), `batch` prepares a batch (keys, the landing,
//! the read session), `pipeline` runs its layers (reader thread + exchange loop, through the
//! loom-checked `handoff`), `reader` builds a group's store call, `granularity` plans the
//! groups (with `compute`, the engine's measured compute), `verify` checks what a rank read
//! (checksums) before it says ok, `share/` holds one share step per mode (each mode's data
//! path, host and device, in one file), `auto` is `Auto`'s state, `outcomes` the outcome
//! bookkeeping (held outcomes of batches a late store call may still write), `group` the TP
//! group and its re-forming, `lookup` the group's agreed hit, `save` the save path.

mod auto;
mod batch;
mod builder;
mod checksum_cache;
mod companion;
mod compute;
mod config;
mod copies_held;
mod fresh_companion;
mod gate;
mod granularity;
mod group;
mod group_time;
mod handle_use;
mod handoff;
mod landed;
mod lookup;
mod metrics;
mod outcomes;
mod pins_ahead;
mod pipeline;
mod prefetch;
mod preflight;
mod probe;
#[cfg(target_os = "linux")]
mod process_group;
mod reader;
mod regions;
mod replace;
mod save;
mod save_read_back;
mod session;
mod share;
mod verify;
mod wrong_sized;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kv_device::{DirectLandingFactory, KvPool, LandingFactory, Residence, SharePath};
use kv_geometry::{KeyScheme, KvGeometry};
use kv_loader::{
    BatchOutcome, BatchPlan, KvLoadError, KvLoader, LayerReady, LoadTicket, LookupHit,
    LookupRequest, SaveReport,
};
use layerwise_counter::CounterError;
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use crate::log_every::LogEvery;
use crate::read_plan::ReadCost;
use crate::store::{KvStore, StoreCalls};
use auto::AutoMode;
use batch::BatchJob;
pub use builder::LinkerBuilder;
pub use config::{auto_verify_threads, GroupFallback, LinkerConfig, MAX_READ_PARALLELISM};
use gate::Gates;
pub use granularity::ReadGranularity;
use granularity::ReadGroups;
use group::GroupLink;
pub use group::TpGroup;
pub use metrics::{LinkerMetrics, MetricsSnapshot, LAYER_LATENCY_BUCKETS_US};
use outcomes::{HeldOutcome, Outcomes, WaitFailure};
pub use probe::PrefixProbe;
#[cfg(target_os = "linux")]
pub use process_group::{serve_group_store, FormedTpGroup};
use regions::Registered;

/// What a linker's API and its load thread both use.
pub(crate) struct Inner {
    pub(crate) geometry: KvGeometry,
    pub(crate) keys: KeyScheme,
    pub(crate) store: Arc<dyn KvStore>,
    /// The store's calls, each bounded by a deadline.
    pub(crate) calls: StoreCalls,
    pub(crate) pool: Arc<dyn KvPool>,
    /// Makes each batch's landing (host: straight into the pool; device: pinned staging).
    pub(crate) landings: Arc<dyn LandingFactory>,
    pub(crate) config: LinkerConfig,
    /// The live handles on the TP group (data for the load thread, control for lookups),
    /// re-formed when either broke; `None` for a rank alone.
    pub(crate) group: Option<Arc<GroupLink>>,
    pub(crate) auto: AutoMode,
    /// How many layers each store call reads: the cost estimate and the engine's compute.
    pub(crate) reads: ReadGroups,
    pub(crate) outcomes: Arc<Outcomes>,
    pub(crate) metrics: LinkerMetrics,
    /// Failed batches logged at `warn` lately, by kind of failure.
    pub(crate) failed_log: LogEvery,
    /// Checksum companions read by earlier loads (and ahead of loads, at lookup).
    pub(crate) checksums: checksum_cache::ChecksumCache,
    /// Objects a batch found at the wrong size and discarded (why a later check of the
    /// batch finds them gone).
    pub(crate) wrong_sized: wrong_sized::WrongSized,
    /// Companions of another length found to be a newer writer's, remembered a while so
    /// that each load does not ask their size and read them again.
    pub(crate) newer_companions: companion::NewerCompanions,
    /// Failed batches' outcomes held while device copies into their slots run.
    pub(crate) copies_watch: Arc<copies_held::CopiesWatch>,
    /// The companions of a looked-up prefix being read ahead of its load.
    pub(crate) prefetch: prefetch::CompanionPrefetch,
    /// The read session a lookup took for its load.
    pub(crate) pins_ahead: Arc<pins_ahead::PinsAhead>,
    /// Bumped by `reset`: a batch whose epoch differs is cancelled.
    pub(crate) epoch: AtomicU64,
    /// The landing memory registered with the store (let go by `close`, or by the last store
    /// call past its deadline that may still write it).
    pub(crate) registered: parking_lot::Mutex<Option<Arc<Registered>>>,
    closed: AtomicBool,
}

/// Kinds of a batch's failure that are the engine's doing, not a failure while loading: a
/// batch cancelled by a reset or close, or refused at `start_load`.
const ENGINE_SIDE_KINDS: [&str; 4] = ["cancelled", "busy", "duplicate_batch", "closed"];

/// The kind a failed batch counts under in `failures`: its error's kind, except that a group's
/// verdict on a batch a rank cancelled or refused (`PeerFailed`, the kind leading its detail)
/// counts as that kind, on every rank as on a rank alone. A failure while loading stays
/// `peer_failed` (its cause is in the failing rank's `own_failures`).
fn failure_kind(e: &KvLoadError) -> &'static str {
    let cause = e.cause_kind();
    ENGINE_SIDE_KINDS
        .iter()
        .find(|k| **k == cause)
        .copied()
        .unwrap_or_else(|| e.kind_name())
}

/// Logs a failed batch: at `warn` once a minute per kind of failure (a store or group down
/// fails every batch alike: one line each was as many lines as requests), saying how many of
/// its kind went to `debug` since; a cancelled one (the engine's own doing) at `debug`. The
/// metrics count every one. A peer's failure is keyed by its cause's kind too: in a group
/// every failure is `PeerFailed`, and a new cause must not wait out another's minute.
fn log_batch_failed(log: &LogEvery, batch: kv_loader::BatchId, e: &KvLoadError) {
    if failure_kind(e) == "cancelled" {
        debug!(%batch, error = %e, "batch cancelled");
        return;
    }
    match log.due_after(&format!("{}:{}", e.kind_name(), e.cause_kind())) {
        Some(skipped) => warn!(%batch, error = %e, kind = e.kind_name(), skipped,
            "batch failed (`skipped`: failures of this kind logged at debug since the last \
             such line; more within a minute go to debug)"),
        None => debug!(%batch, error = %e, "batch failed"),
    }
}

impl Inner {
    fn finish_job(
        &self,
        job: BatchJob,
        result: Result<kv_loader::LoadStats, KvLoadError>,
        held: Option<Arc<HeldOutcome>>,
    ) {
        let batch = job.plan.logical.batch;
        let Some(ticket) = job.ticket else {
            // Refused on this rank at `start_load` (the engine has its error): it only met the
            // group.
            tracing::debug!(%batch, "a refused batch met the group");
            return;
        };
        match &result {
            Ok(stats) => {
                self.metrics.batch(true);
                self.metrics.loaded_how(stats);
                // Debug: one per batch per rank (the metrics count them).
                debug!(%batch, pages = stats.pages, bytes = stats.bytes_read,
                      last_layer = ?stats.last_layer, "batch loaded");
            }
            Err(e) => {
                self.metrics.batch(false);
                self.metrics.failure(failure_kind(e));
                self.log_failed(batch, e);
            }
        }
        let outcome = BatchOutcome { batch, result };
        match held {
            Some(h) => self.outcomes.finish_held(h, ticket.counter, outcome),
            None => self.outcomes.finish(ticket.counter, outcome),
        }
    }

    /// Logs a failed batch ([`log_batch_failed`]).
    fn log_failed(&self, batch: kv_loader::BatchId, e: &KvLoadError) {
        log_batch_failed(&self.failed_log, batch, e);
    }

    fn load_loop(self: Arc<Self>, jobs: mpsc::Receiver<BatchJob>) {
        // The store writes host pools' slots itself: a read past its deadline keeps the
        // batch's outcome (and so the slots) until it returns. Device pools' slots are written
        // by the device from staging, which the landing keeps instead.
        let slots_written_by_store = self.pool.residence() == Residence::Host;
        let mut gates = Gates::default();
        let rank = self.geometry.tp_rank();
        while let Ok(job) = jobs.recv() {
            // Its outcome's lines too (logged after `run_batch`'s own span closed) name the
            // rank: with ranks as threads of one process nothing else tells them apart.
            let _job =
                tracing::info_span!("batch_job", rank, batch = %job.plan.logical.batch).entered();
            let held = (slots_written_by_store && job.ticket.is_some())
                .then(|| HeldOutcome::new(self.outcomes.clone()));
            // A refused job (no ticket) never reads: not named in a reset's `SlotsHeld`.
            let running = job.ticket.as_ref().map(|t| t.batch);
            self.outcomes.set_running(running);
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run_batch(&mut gates, &job, held.as_ref())
            }));
            let result = ran.unwrap_or_else(|payload| {
                // The gate count and the pending sample may be out of step with the peers'
                // now; what this rank settled (loaded alone or not) and heard of the ranks
                // ahead still holds, and a peer behind decides its batches from it.
                gates.count = Default::default();
                gates.pending = Default::default();
                Err(self.batch_panicked(job.plan.logical.batch, payload.as_ref()))
            });
            let alone = matches!(&result, Ok(stats) if stats.alone.is_some());
            gates.settled(job.plan.logical.batch, alone);
            // A device pool's failed batch whose copies into its slots did not finish: its
            // outcome waits for them too.
            let held = match held {
                Some(held) => Some(held),
                None if result.is_err() && job.ticket.is_some() => {
                    self.copies_watch
                        .hold(&self.pool, &job.plan.slots, &self.outcomes)
                }
                None => None,
            };
            self.finish_job(job, result, held);
            self.outcomes.set_running(None);
        }
    }

    /// A batch's run panicked (a defect here, or in a store, landing or collective the engine
    /// supplied): the batch fails with `Internal` (with `Device` when copies it queued into
    /// its slots did not finish within the drain limit), its outcome is delivered as any other, and
    /// the load thread goes on with the next batch. The data handle the batch used is aborted
    /// as its use unwinds (`HandleInUse`), since the run may have left the collectives out of
    /// step: every rank re-forms the group at its next batch, and peers still waiting in this
    /// batch's collectives fail at once. A newer formation (made by a lookup while the batch
    /// ran) is left alone.
    fn batch_panicked(
        &self,
        batch: kv_loader::BatchId,
        payload: &(dyn std::any::Any + Send),
    ) -> KvLoadError {
        let what = kv_loader::Cause::from_panic(payload);
        let why = format!("the load thread panicked: {what}");
        tracing::error!(%batch, why, "batch failed");
        match batch::take_unsettled() {
            // Copies it queued may still write the slots: not a plain recompute.
            Some(d) => KvLoadError::Device(kv_loader::Cause::with_source(
                format!("{batch}: {why}, and copies queued into its slots did not finish: {d}"),
                d,
            )),
            None => KvLoadError::internal(batch, why),
        }
    }

    /// When a store call other than a layer's reads must have returned.
    pub(crate) fn store_deadline(&self) -> Instant {
        kv_loader::deadline_after(self.config.store_call_timeout)
    }

    /// True when this rank shares with other ranks (a batch it refuses still meets them).
    fn grouped(&self) -> bool {
        self.group.is_some()
    }

    fn check_open(&self) -> Result<(), KvLoadError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(KvLoadError::Closed);
        }
        Ok(())
    }

    fn counter_error(ticket: &LoadTicket, e: CounterError) -> KvLoadError {
        match e {
            CounterError::StaleTicket { .. } => KvLoadError::StaleTicket {
                batch: ticket.batch,
            },
            // The engine asked for a layer past the model: its input, not our fault.
            CounterError::LayerOutOfRange {
                layer, num_layers, ..
            } => KvLoadError::InvalidPlan {
                batch: ticket.batch,
                reason: kv_loader::PlanError::LayerOutOfRange { layer, num_layers },
            },
            other => KvLoadError::internal(ticket.batch, kv_loader::Cause::from_error(other)),
        }
    }
}

/// The [`KvLoader`] of one TP rank: validates plans, loads them layer by layer from a
/// [`KvStore`] into a [`KvPool`] on a dedicated load thread, marks layers ready in a
/// `LayerCounter`, saves new pages, and never hangs: every wait has a deadline.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::HostKvPool;
/// use kv_geometry::{KvGeometry, ModelKvSpec, ElementType};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, LookupRequest, RequestPages};
/// use mooncake_linker::{store::EmbeddedStore, Linker, LinkerConfig};
///
/// let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3), 1, 0).unwrap();
/// let store = Arc::new(EmbeddedStore::new(1 << 30));
/// let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
/// let linker = Linker::builder(g, store, pool)
///     .config(LinkerConfig::default()) // a TP rank adds `.group(..)` and a sharing mode
///     .build()
///     .unwrap();
///
/// // Request 1 computed 2 pages into slots 0 and 1; save them.
/// let tokens: Vec<u32> = (0..128).collect();
/// let hit = linker.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
/// assert!(hit.pages.is_empty());
/// let pages = kv_geometry::page_hashes(&tokens, 64, None);
/// let req = vec![RequestPages { request: "r1".into(), pages }];
/// let save = BatchPlan::all_components(linker.geometry(), BatchId(1), req.clone(), vec![0, 1]);
/// assert_eq!(linker.save(&save).unwrap().objects_written, 2);
///
/// // Request 2 loads them into slots 5 and 6, layer by layer.
/// let hit = linker.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
/// assert_eq!(hit.pages.len(), 2);
/// let load = BatchPlan::all_components(linker.geometry(), BatchId(2), req, vec![5, 6]);
/// let ticket = linker.start_load(load).unwrap();
/// for layer in 0..linker.num_layers() {
///     linker.wait_layer(&ticket, layer).unwrap();
/// }
/// assert!(linker.wait_batch(&ticket).unwrap().result.is_ok());
/// linker.close().unwrap();
/// ```
pub struct Linker {
    inner: Arc<Inner>,
    jobs: Mutex<Option<mpsc::Sender<BatchJob>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Closed when the load thread ends.
    ended: Mutex<Option<mpsc::Receiver<()>>>,
    /// The first `close`'s answer, once it has one (later and concurrent calls return it).
    close_answer: Mutex<Option<Result<(), KvLoadError>>>,
    close_done: parking_lot::Condvar,
}

impl std::fmt::Debug for Linker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = &self.inner.geometry;
        f.debug_struct("Linker")
            .field("model", &g.spec().model)
            .field("tp_rank", &g.tp_rank())
            .field("tp_size", &g.tp_size())
            .field("grouped", &self.inner.group.is_some())
            .field("mode", &self.inner.config.mode)
            // `try_lock`: formatting never waits (nor deadlocks under the lock).
            .field("running", &self.jobs.try_lock().map(|j| j.is_some()))
            .finish_non_exhaustive()
    }
}

impl Linker {
    /// A linker for one rank (`geometry.tp_rank`) over `store`, landing into the host
    /// `pool`: `Linker::builder(geometry, store, pool).config(config).build()`.
    pub fn new(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        config: LinkerConfig,
    ) -> Result<Self, KvLoadError> {
        Self::builder(geometry, store, pool).config(config).build()
    }

    /// Kept for existing callers; prefer [`Linker::builder`] (`.landings(..)`,
    /// `.maybe_group(..)`) or [`Linker::builder_staged`], which takes the pool once.
    pub fn with_landings(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        landings: Arc<dyn LandingFactory>,
        config: LinkerConfig,
        group: Option<TpGroup>,
    ) -> Result<Self, KvLoadError> {
        Self::builder(geometry, store, pool)
            .landings(landings)
            .config(config)
            .maybe_group(group)
            .build()
    }

    fn host_landings(pool: &Arc<dyn KvPool>) -> Result<Arc<dyn LandingFactory>, KvLoadError> {
        if pool.residence() != Residence::Host {
            return Err(KvLoadError::config(
                "a device pool lands through its backend's staging: use Linker::builder_staged or LinkerBuilder::landings",
            ));
        }
        Ok(Arc::new(DirectLandingFactory::new(pool.clone())))
    }

    /// The group must match the geometry, move the memory the landings share through, and,
    /// bound to a GPU, be on the pool's.
    fn check_group(
        geometry: &KvGeometry,
        group: &TpGroup,
        landings: &dyn LandingFactory,
        pool: &dyn KvPool,
    ) -> Result<(), KvLoadError> {
        let memory = group.data.memory();
        let path = landings.share_path();
        let moves = match path {
            SharePath::Host => memory.host,
            SharePath::Device => memory.device,
        };
        if !moves {
            return Err(KvLoadError::config(format!(
                "the landings share rows through {path:?} memory, but the group's data \
                 collective moves {memory:?}"
            )));
        }
        if let (SharePath::Device, Residence::Device { ordinal }, Some(on)) =
            (path, pool.residence(), group.data.device_ordinal())
        {
            if on != ordinal {
                // Found at build: at the first share every batch would fail `InvalidArgument`
                // (the region on another GPU) and re-form the group.
                return Err(KvLoadError::config(format!(
                    "the group's data collective runs on GPU {on}, but the pool is on GPU \
                     {ordinal} (a rank given the global rank where the local one was meant, \
                     or the other way round, under CUDA_VISIBLE_DEVICES)"
                )));
            }
        }
        if std::ptr::addr_eq(Arc::as_ptr(&group.data), Arc::as_ptr(&group.control)) {
            // The load thread and lookups issue collectives apart: on one handle their
            // operations would pair across ranks in no agreed order.
            return Err(KvLoadError::config(
                "the group's data and control handles are one handle: a TP group needs two \
                 (TpGroup's constructors make them)",
            ));
        }
        if group.rank() != geometry.tp_rank()
            || group.size() != geometry.tp_size()
            || group.control.rank() != group.rank()
            || group.control.size() != group.size()
        {
            return Err(KvLoadError::config(format!(
                "group rank {}/{} does not match geometry rank {}/{}",
                group.rank(),
                group.size(),
                geometry.tp_rank(),
                geometry.tp_size()
            )));
        }
        Ok(())
    }

    /// A linker for rank `group.rank()` of a TP group over a host pool:
    /// `Linker::builder(geometry, store, pool).config(config).group(group).build()`.
    /// Replicated components are shared as `config.mode` says, lookups agree on the group's
    /// minimum, and every rank reaches the same outcome for every batch. Every rank must call
    /// `lookup` and `start_load` in the same order.
    pub fn with_group(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        config: LinkerConfig,
        group: TpGroup,
    ) -> Result<Self, KvLoadError> {
        Self::builder(geometry, store, pool)
            .config(config)
            .group(group)
            .build()
    }

    fn build(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        landings: Arc<dyn LandingFactory>,
        config: LinkerConfig,
        group: Option<TpGroup>,
    ) -> Result<Self, KvLoadError> {
        if pool.geometry() != &geometry {
            return Err(KvLoadError::config(
                "the pool is laid out for another geometry",
            ));
        }
        config.check()?;
        let calls = StoreCalls::new(store.clone());
        // Registrations on workers of their own; their overdue calls count with the rest.
        let registered =
            Registered::new(calls.beside(), landings.clone(), config.store_call_timeout)?;
        let keys = KeyScheme::new(
            &config.namespace.resolve(&geometry),
            geometry.tp_rank(),
            config.cp_rank,
            config.pp_rank,
        );
        if group.as_ref().is_some_and(|g| g.size() > 1) {
            warn_collective_bounds(&config, landings.lease_wait());
        }
        let link = GroupLink::of(group.as_ref());
        let checksums = checksum_cache::ChecksumCache::new(config.checksum_cache_entries);
        let inner = Arc::new(Inner {
            outcomes: Arc::new(Outcomes::new(config.max_in_flight)),
            auto: AutoMode::new(config.mode, config.bandwidths, config.auto_batches_per_mode),
            reads: ReadGroups::new(config.read_granularity),
            geometry,
            keys,
            calls,
            store,
            pool,
            landings,
            group: link,
            config,
            metrics: LinkerMetrics::default(),
            checksums,
            wrong_sized: wrong_sized::WrongSized::default(),
            failed_log: LogEvery::new(),
            newer_companions: companion::NewerCompanions::default(),
            copies_watch: Arc::default(),
            prefetch: prefetch::CompanionPrefetch::default(),
            pins_ahead: Arc::default(),
            epoch: AtomicU64::new(0),
            registered: parking_lot::Mutex::new(Some(registered)),
            closed: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel();
        let (ended_tx, ended_rx) = mpsc::sync_channel::<()>(1);
        let worker = inner.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-load-r{}", worker.geometry.tp_rank()))
            .spawn(move || {
                worker.load_loop(rx);
                drop(ended_tx);
            })
            .map_err(|e| {
                KvLoadError::config(kv_loader::Cause::with_source(
                    format!("spawning the load thread: {e}"),
                    e,
                ))
            })?;
        Ok(Linker {
            inner,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            ended: Mutex::new(Some(ended_rx)),
            close_answer: Mutex::new(None),
            close_done: parking_lot::Condvar::new(),
        })
    }

    /// This rank's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.inner.geometry
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.inner.store
    }

    /// Counters for export.
    pub fn metrics(&self) -> MetricsSnapshot {
        let mut m = self.inner.metrics.snapshot();
        m.overdue_calls = self.inner.calls.overdue_calls();
        m.group_reforms = self.inner.group.as_ref().map_or(0, |g| g.reforms());
        // Held for good first: those buffers never leave the quarantine, so the count of it
        // read after includes them (read the other way, one quarantined between the two
        // reads could make `held_for_good` exceed `quarantined`).
        let (held, capacity) = self.inner.landings.staging_held_for_good();
        m.staging_quarantined =
            u64::try_from(self.inner.landings.staging_quarantined()).unwrap_or(u64::MAX);
        m.staging_held_for_good = u64::try_from(held).unwrap_or(u64::MAX);
        m.staging_capacity = u64::try_from(capacity).unwrap_or(u64::MAX);
        m.kept_for_good = crate::store::kept_for_good();
        let collectives = dedup_broadcast::memory_kept();
        m.kept_for_good.calls = m.kept_for_good.calls.saturating_add(collectives.times);
        m.kept_for_good.bytes = m.kept_for_good.bytes.saturating_add(collectives.bytes);
        m
    }

    /// [`save`](KvLoader::save), ordered after `after`: an event the engine recorded on its
    /// compute stream after the work that wrote the plan's pages (CUDA:
    /// `CudaDevice::record_on(compute_stream)`; any backend: an event of its `Stream`). On a
    /// device pool the gather is queued behind it device-side, so the save sees those bytes;
    /// the calling thread then waits for the gather (queued after the compute), so it blocks
    /// until the compute and the gather have run, at most `kv_device`'s host-sync limit (60
    /// s) per gathered layer: call it off the forward thread (a save runs off the critical
    /// path). On a host pool (read in place) this thread waits for the event, at most
    /// `store_call_timeout`. Plain `save` on a device pool reads the slots as the device has
    /// them when its gather runs: use it only once the compute is known complete.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use kv_device::{CpuDevice, Device, DeviceKvPool, StagedLandingFactory, StagingPool};
    /// use kv_geometry::{KvGeometry, ModelKvSpec, ElementType};
    /// use kv_loader::{BatchId, BatchPlan, RequestPages};
    /// use mooncake_linker::{store::EmbeddedStore, Linker, LinkerConfig};
    /// let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3), 1, 0).unwrap();
    /// let dev = CpuDevice::new(0).unwrap();
    /// let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 4).unwrap());
    /// let half = StagingPool::half_bytes_for(&g, 2, 1);
    /// let staging = StagingPool::new(dev.clone(), half, 2).unwrap();
    /// let landings = Arc::new(StagedLandingFactory::new(pool.clone(), staging));
    /// let store = Arc::new(EmbeddedStore::new(1 << 30));
    /// let config = LinkerConfig::default();
    /// let linker = Linker::with_landings(g.clone(), store, pool, landings, config, None).unwrap();
    /// // The engine's compute stream wrote slots 0 and 1; the save waits for it.
    /// let compute = dev.new_stream().unwrap();
    /// let done = compute.record().unwrap();
    /// let tokens: Vec<u32> = (0..128).collect();
    /// let pages = kv_geometry::page_hashes(&tokens, 64, None);
    /// let plan = BatchPlan::all_components(&g, BatchId(1),
    ///     vec![RequestPages { request: "r".into(), pages }], vec![0, 1]);
    /// assert_eq!(linker.save_after(&plan, &done).unwrap().objects_written, 2);
    /// ```
    pub fn save_after(
        &self,
        plan: &BatchPlan,
        after: &kv_device::SharedEvent,
    ) -> Result<SaveReport, KvLoadError> {
        self.inner.check_open()?;
        self.inner.save(plan, Some(after))
    }

    /// What one store call of this linker's reads costs in share mode `mode`, as fitted from its
    /// group calls in that mode: what the adaptive read plan decides from for a batch in `mode`.
    /// Before any call in `mode` it is the prior as configured (the plan then takes its per-byte
    /// cost once per rank reading at once). The fit is kept per mode, since a call costs more when
    /// every rank reads at once (a rank alone reads as in `AllRanks`). A new linker over the same
    /// store can start from a fit of a rank reading alone (`ReadGranularity::Adaptive::prior`,
    /// which a mode where several ranks read at once scales to their share of the store):
    /// `Rank0Broadcast`'s, or `AllRanks`' without a group.
    pub fn read_cost(&self, mode: kv_loader::ShareMode) -> ReadCost {
        self.inner.reads.cost(mode)
    }

    /// Forgets every checksum companion this linker kept (`LinkerConfig::checksum_cache_entries`),
    /// e.g. after the store was emptied; the next load of any prefix reads its companions again
    /// (benchmarks use it to measure a prefix's first load more than once).
    pub fn forget_kept_checksums(&self) {
        self.inner.checksums.clear();
        self.inner.newer_companions.clear();
    }

    /// The mode `Auto` keeps, once it has measured enough (`None` while it measures, and for
    /// a fixed mode or one decided from configured bandwidths).
    pub fn auto_decision(&self) -> Option<kv_loader::ShareMode> {
        self.inner.auto.kept()
    }

    /// The engine's compute per layer the read plan uses: configured, or measured from the
    /// gaps between `wait_layer` calls (`None` before any was measured).
    pub fn compute_per_layer(&self) -> Option<std::time::Duration> {
        self.inner.reads.compute_per_layer()
    }

    /// The object keys of a plan's pages for component `index` of the plan, in plan order.
    pub fn object_keys(&self, plan: &BatchPlan) -> Result<Vec<Vec<String>>, KvLoadError> {
        Ok(self
            .inner
            .component_keys(plan)?
            .into_iter()
            .map(|c| c.keys)
            .collect())
    }

    /// Cancels every batch in flight and waits (until `deadline`) until the load thread is
    /// idle. `Err(SlotsHeld)` names the batches whose slots may still be written: a store call
    /// past its deadline (their outcomes come when it returns), or, when the load thread is
    /// still busy at the deadline, every batch whose outcome is not in yet. The flag says the
    /// load thread was still busy.
    fn cancel_all(&self, deadline: Instant) -> (Result<(), KvLoadError>, bool) {
        let s = &self.inner;
        s.epoch.fetch_add(1, Ordering::AcqRel);
        // The lookups' pins are taken out first, so a load waiting for one under way goes on
        // at once instead of holding the load thread up to its bound; their sessions are ended
        // after the cancel, so that no master call delays it.
        let taken = s.pins_ahead.take_all();
        // The epoch moves again once the counter is reset: a `start_load` that read the first
        // new epoch and made its ticket before the reset has a stale ticket, and its job is
        // cancelled too.
        let busy = !s.outcomes.cancel_all(deadline, || {
            s.epoch.fetch_add(1, Ordering::AcqRel);
        });
        // Nothing left in flight: a read ahead is waited for (same bound), and the pins a
        // lookup took meanwhile are ended.
        s.prefetch.wait_idle(deadline);
        s.end_pins(taken, deadline);
        s.end_pins_ahead(deadline);
        let held = if busy {
            warn!(
                waited = ?s.config.wait_deadline,
                "the load thread is still busy after reset: its batches' slots stay held"
            );
            // Not a batch whose outcome is in and not held: nothing writes its slots.
            s.outcomes.still_loading()
        } else {
            s.outcomes.held()
        };
        if !held.is_empty() {
            return (
                Err(KvLoadError::SlotsHeld {
                    batches: held.into(),
                }),
                busy,
            );
        }
        (Ok(()), busy)
    }

    /// Sends a job to the load thread; false once it is gone.
    fn send(&self, job: BatchJob) -> bool {
        self.jobs
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(job).is_ok())
    }

    /// A batch refused on this rank still meets the group (the gate and one failed status
    /// word), so that no rank's collectives shift.
    fn refuse(&self, plan: BatchPlan, why: &KvLoadError) {
        if !self.inner.grouped() {
            return;
        }
        let job = BatchJob {
            plan,
            ticket: None,
            refusal: Some(why.clone()),
            epoch: self.inner.epoch.load(Ordering::Acquire),
            started: Instant::now(),
        };
        if !self.send(job) {
            warn!(error = %why, "a refused batch could not reach the load thread");
        }
    }

    /// Waits, at most `wait`, for the load thread to end; joins it when it did.
    fn join_load_thread(&self, wait: Duration) -> bool {
        let ended = self.ended.lock().take().is_some_and(|rx| {
            matches!(
                rx.recv_timeout(wait),
                Err(mpsc::RecvTimeoutError::Disconnected)
            )
        });
        if let Some(t) = self.thread.lock().take() {
            if ended {
                let _ = t.join();
            } else {
                warn!(
                    ?wait,
                    "the load thread did not end in time; it is left to finish on its own"
                );
            }
        }
        ended
    }
}

impl KvLoader for Linker {
    fn num_layers(&self) -> u32 {
        self.inner.geometry.num_layers()
    }

    fn lookup(&self, request: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        let _lookup = tracing::info_span!("lookup", rank = self.inner.geometry.tp_rank()).entered();
        self.inner.check_open()?;
        let hit = self.inner.lookup(request)?;
        self.inner.read_ahead_at_lookup(&hit.pages);
        Ok(hit)
    }

    fn lookup_pages(
        &self,
        pages: &[kv_geometry::PageHash],
        skip_pages: usize,
    ) -> Result<LookupHit, KvLoadError> {
        let _lookup = tracing::info_span!("lookup", rank = self.inner.geometry.tp_rank()).entered();
        self.inner.check_open()?;
        let hit = self.inner.lookup_pages(pages, skip_pages)?;
        self.inner.read_ahead_at_lookup(&hit.pages);
        Ok(hit)
    }

    fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError> {
        let s = &self.inner;
        s.check_open()?;
        let batch = plan.logical.batch;
        let num_layers = s.geometry.num_layers();
        // The epoch is read before the ticket is made: a `reset` between the two then cancels
        // the job (its epoch is behind), instead of leaving a job of the new epoch writing
        // slots for a ticket that reset made stale.
        let epoch = s.epoch.load(Ordering::Acquire);
        // Open again after the epoch is read: a `close` that began after the check above
        // then moves the epoch after this read (it sets `closed` before its cancel), so the
        // job is cancelled rather than run after `close` returned. (Had this read seen the
        // cancel's new epoch, it would see `closed` here too: the epoch's release and acquire
        // order the two.)
        s.check_open()?;
        let begun = plan
            .validate(&s.geometry, s.pool.pages())
            .and_then(|()| s.outcomes.begin(batch, num_layers, &plan.slots));
        let counter = match begun {
            Ok(c) => c,
            Err(e) => {
                self.refuse(plan, &e);
                return Err(match e {
                    // The peers fail it too (`refuse`): it is recomputed, not started again.
                    KvLoadError::Busy { capacity, .. } if s.grouped() => KvLoadError::Busy {
                        capacity,
                        peers_fail: true,
                    },
                    e => e,
                });
            }
        };
        let ticket = LoadTicket {
            batch,
            num_layers,
            counter,
        };
        let job = BatchJob {
            plan,
            ticket: Some(ticket),
            refusal: None,
            epoch,
            started: Instant::now(),
        };
        if !self.send(job) {
            s.outcomes.never_started(batch, counter);
            return Err(KvLoadError::Closed);
        }
        Ok(ticket)
    }

    fn wait_layer(&self, ticket: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError> {
        let s = &self.inner;
        if layer >= ticket.num_layers {
            return Err(KvLoadError::InvalidPlan {
                batch: ticket.batch,
                reason: kv_loader::PlanError::LayerOutOfRange {
                    layer,
                    num_layers: ticket.num_layers,
                },
            });
        }
        let deadline = kv_loader::deadline_after(s.config.wait_deadline);
        s.reads.compute.entering(ticket.batch, layer);
        let events = matches!(s.pool.residence(), Residence::Device { .. });
        let waited = s.outcomes.wait_layer(ticket, layer, deadline, events);
        if waited.is_err() {
            s.reads.compute.left();
        }
        match waited {
            // Host pools are resident once the layer is marked; device pools hand back the
            // layer's event.
            Ok(ready) => Ok({
                s.reads.compute.returned(ticket.batch, layer);
                match s.pool.residence() {
                    Residence::Host => LayerReady::Resident,
                    Residence::Device { .. } => ready.unwrap_or(LayerReady::Resident),
                }
            }),
            Err(WaitFailure::Counter(e)) => Err(Inner::counter_error(ticket, e)),
            Err(WaitFailure::Load(e)) => Err(e),
            Err(WaitFailure::TimedOut) => Err(KvLoadError::Timeout {
                batch: ticket.batch,
                layer,
                waited: s.config.wait_deadline,
            }),
            Err(WaitFailure::Cancelled) => Err(KvLoadError::Cancelled {
                batch: ticket.batch,
            }),
        }
    }

    fn wait_batch(&self, ticket: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
        let s = &self.inner;
        let deadline = kv_loader::deadline_after(s.config.wait_deadline);
        match s.outcomes.take(ticket, deadline) {
            Ok(Some(outcome)) => Ok(outcome),
            Ok(None) => {
                // The engine resets and recomputes into the slots (`ResetThenRecompute`).
                s.outcomes.abandon(ticket.batch, ticket.counter);
                Err(KvLoadError::Timeout {
                    batch: ticket.batch,
                    layer: ticket.num_layers.saturating_sub(1),
                    waited: s.config.wait_deadline,
                })
            }
            Err(e) => Err(Inner::counter_error(ticket, e)),
        }
    }

    fn completed(&self) -> Vec<BatchOutcome> {
        self.inner.outcomes.drain()
    }

    fn abandon(&self, ticket: &LoadTicket) {
        self.inner.outcomes.abandon(ticket.batch, ticket.counter);
    }

    fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        self.inner.check_open()?;
        self.inner.save(plan, None)
    }

    /// On a device pool: an event recorded on `stream` (the pool's device,
    /// `Device::record_on`), which the gather waits for device-side, as
    /// [`save_after`](Linker::save_after)'s; a stream that cannot be recorded on (a
    /// default-stream handle under another context) is `Config`. On a host pool, `save`
    /// (the engine wrote the slots from its own thread; one that fills them with copies on
    /// `stream` synchronizes it first).
    fn save_after_stream(
        &self,
        plan: &BatchPlan,
        stream: kv_loader::RawStream,
    ) -> Result<SaveReport, KvLoadError> {
        self.inner.check_open()?;
        if self.inner.pool.residence() == Residence::Host {
            return self.inner.save(plan, None);
        }
        let e = match self.inner.landings.record_on_engine_stream(stream) {
            Ok(after) => return self.inner.save(plan, Some(&after)),
            Err(e) => e,
        };
        // Counted as a failed save, as one that failed inside.
        self.inner.metrics.saved(true);
        let words = format!(
            "{}: recording an event on the engine's stream before a save: {e}",
            plan.logical.batch
        );
        // A stream or backend that cannot be ordered after is the engine's to fix (a
        // default-stream handle under another context, a factory that does not forward the
        // call); anything else is the device's failure.
        let engines_to_fix = matches!(e, kv_device::DeviceError::Unsupported(_));
        let cause = kv_loader::Cause::with_source(words, e);
        Err(if engines_to_fix {
            KvLoadError::config(cause)
        } else {
            KvLoadError::Device(cause)
        })
    }

    fn reset(&self) -> Result<(), KvLoadError> {
        self.inner.check_open()?;
        info!("linker reset");
        self.cancel_all(kv_loader::deadline_after(self.inner.config.wait_deadline))
            .0
    }

    fn close(&self) -> Result<(), KvLoadError> {
        if self.inner.closed.swap(true, Ordering::AcqRel) {
            return self.first_close_answer();
        }
        // Later closes get an answer whatever happens here (a panic included).
        let mut first = FirstClose {
            linker: self,
            answer: None,
        };
        let answer = self.close_first();
        first.answer = Some(answer.clone());
        answer
    }
}

/// Hands the first `close`'s answer to the closes waiting for it when the first ends; one
/// that panicked answers `Internal` (its batches' slots are not known to be free).
struct FirstClose<'a> {
    linker: &'a Linker,
    answer: Option<Result<(), KvLoadError>>,
}

impl Drop for FirstClose<'_> {
    fn drop(&mut self) {
        let answer = self.answer.take().unwrap_or_else(|| {
            Err(KvLoadError::internal(
                None,
                "the first close of the linker panicked",
            ))
        });
        *self.linker.close_answer.lock() = Some(answer);
        self.linker.close_done.notify_all();
    }
}

impl Linker {
    /// What the first `close` answered, waiting for it (as long as a close may take) when it
    /// is still running: a second caller (another shutdown path) hears the same `SlotsHeld`,
    /// not an `Ok` while the first still cancels. Past that bound: the batches whose load
    /// may still write their slots (not one whose outcome waits to be taken), as `SlotsHeld`.
    fn first_close_answer(&self) -> Result<(), KvLoadError> {
        let c = &self.inner.config;
        let bound = c.wait_deadline.saturating_add(c.store_call_timeout);
        let deadline = kv_loader::deadline_after(bound);
        let mut answer = self.close_answer.lock();
        while answer.is_none() {
            if self
                .close_done
                .wait_until(&mut answer, deadline)
                .timed_out()
            {
                break;
            }
        }
        match answer.as_ref() {
            Some(a) => a.clone(),
            None => {
                let batches = self.inner.outcomes.still_loading();
                warn!(?bound, "a close waited for the first close past its bound");
                if batches.is_empty() {
                    Ok(())
                } else {
                    Err(KvLoadError::SlotsHeld {
                        batches: batches.into(),
                    })
                }
            }
        }
    }

    /// The first `close`: cancels, ends the read ahead, the load thread and the landing
    /// memory, all within one bound.
    fn close_first(&self) -> Result<(), KvLoadError> {
        info!("linker close");
        // One bound for all close waits for, as `reset`'s: the cancel, then a read of
        // companions ahead begun meanwhile, then the load thread (before, each step after the
        // cancel had a fresh `wait_deadline`: twice as long in all).
        let deadline = kv_loader::deadline_after(self.inner.config.wait_deadline);
        let (cancelled, busy) = self.cancel_all(deadline);
        // Dropping the sender ends the load loop once it has nothing queued.
        self.jobs.lock().take();
        // No read ahead from now on; one under way is waited for (bounded), and pins one took
        // since the cancel are ended (one still under way past the wait ends its own).
        self.inner.prefetch.shut(deadline);
        self.inner.end_pins_ahead(deadline);
        let wait = if busy {
            Duration::ZERO
        } else {
            // Idle: what is queued is refused batches, each bounded by the group's deadline.
            deadline.saturating_duration_since(std::time::Instant::now())
        };
        if self.join_load_thread(wait) {
            // The linker lets go of the landing memory; a store call past its deadline still
            // holds it (registered, allocated) until it returns.
            // Dropped outside the lock: letting go waits for the store (bounded).
            let registered = self.inner.registered.lock().take();
            drop(registered);
        }
        // This rank leaves the group: peers of a group whose formation counts linkers fail
        // their batches at once from now on, not each at its collective timeout.
        if let Some(link) = &self.inner.group {
            link.leave();
        }
        cancelled
    }
}

/// Closes the linker. Its answer can only be logged here: an engine that must hear a
/// `SlotsHeld` (slots a store call past its deadline may still write) calls
/// [`close`](KvLoader::close) itself first.
impl Drop for Linker {
    fn drop(&mut self) {
        // Closed already: that close's caller heard its answer.
        if self.inner.closed.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.close() {
            warn!(error = %e, "closing the linker on drop");
        }
    }
}

/// Says (not refused: a short collective bound is a valid choice for a fast local store) where
/// `collective_timeout` is not above a rank's own waits before or inside a batch (its store
/// calls' bounds, and `lease_wait`, how long a landing waits for a staging buffer): a rank
/// that waits to its own bound makes its peers time out in the collective instead of reading
/// its failure.
fn warn_collective_bounds(config: &LinkerConfig, lease_wait: Duration) {
    if config.collective_timeout <= config.layer_read_timeout
        || config.collective_timeout <= config.store_call_timeout
    {
        tracing::warn!(
            collective_timeout = ?config.collective_timeout,
            layer_read_timeout = ?config.layer_read_timeout,
            store_call_timeout = ?config.store_call_timeout,
            "collective_timeout is not above the store bounds: a slow read shows on the \
             peers as a collective timeout"
        );
    }
    // A landing begins after the batch's gate, its peers waiting meanwhile.
    if lease_wait.saturating_mul(2) >= config.collective_timeout {
        tracing::warn!(
            collective_timeout = ?config.collective_timeout,
            lease_wait = ?lease_wait,
            "the staging lease wait is not well under collective_timeout: a rank short of \
             staging shows on its peers as a collective timeout"
        );
    }
}

#[cfg(test)]
mod bounds_log_tests {
    use super::*;

    /// A staging lease wait of half the collective bound or more is said at build; the
    /// default (1 s against 25 s) and a backend without staging (zero) are not.
    #[test]
    fn a_lease_wait_near_the_collective_bound_is_said() {
        let config = LinkerConfig::default();
        let warns = |wait: Duration| {
            let ((), lines) = crate::test_logs::logged(|| warn_collective_bounds(&config, wait));
            lines
                .iter()
                .filter(|l| l.level == tracing::Level::WARN && l.message.contains("lease wait"))
                .count()
        };
        assert_eq!(warns(config.collective_timeout / 2), 1);
        assert_eq!(warns(config.collective_timeout * 3), 1);
        assert_eq!(warns(kv_device::DEFAULT_LEASE_WAIT), 0);
        assert_eq!(warns(Duration::ZERO), 0);
    }
}

#[cfg(test)]
mod failure_log_tests {
    use super::*;
    use kv_loader::BatchId;

    fn peer_failed(batch: u64, cause: &str) -> KvLoadError {
        KvLoadError::PeerFailed {
            batch: BatchId(batch),
            rank: 1,
            layer: 0,
            detail: format!("{cause}: batch {batch}: on rank 1"),
        }
    }

    /// In a group every failure is `PeerFailed`: a new cause gets its own `warn` line at once
    /// (it went to `debug` for the rest of the minute of the first one), while the same cause
    /// again within the minute goes to `debug`.
    #[test]
    fn a_peer_failure_of_a_new_cause_is_not_held_back_by_another_causes_minute() {
        let log = LogEvery::new();
        let ((), lines) = crate::test_logs::logged(|| {
            log_batch_failed(&log, BatchId(1), &peer_failed(1, "store_rpc_timeout"));
            log_batch_failed(&log, BatchId(2), &peer_failed(2, "store_rpc_timeout"));
            log_batch_failed(&log, BatchId(3), &peer_failed(3, "bad_object"));
            log_batch_failed(
                &log,
                BatchId(4),
                &KvLoadError::Cancelled { batch: BatchId(4) },
            );
        });
        let warned: Vec<&str> = lines
            .iter()
            .filter(|l| l.level == tracing::Level::WARN)
            .map(|l| l.fields.as_str())
            .collect();
        assert_eq!(warned.len(), 2, "{lines:?}");
        assert!(warned[0].contains("store_rpc_timeout"), "{warned:?}");
        assert!(warned[1].contains("bad_object"), "{warned:?}");
    }
}
