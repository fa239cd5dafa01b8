//! The linker: the [`KvLoader`] implementation over a [`KvStore`] and a [`KvPool`].

mod batch;
mod config;
mod group;
mod lookup;
mod measure;
mod metrics;
#[cfg(target_os = "linux")]
mod process_group;
mod reader;
mod regions;
mod replace;
mod save;
mod session;
mod staging;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use kv_device::{DirectLandingFactory, KvPool, LandingFactory, Residence};
use kv_geometry::{KeyScheme, KvGeometry};
use kv_loader::{
    BatchId, BatchOutcome, BatchPlan, KvLoadError, KvLoader, LayerReady, LoadTicket, LookupHit,
    LookupRequest, SaveReport,
};
use layerwise_counter::{CounterError, LayerCounter, WaitOutcome};
use parking_lot::{Condvar, Mutex};
use tracing::{info, warn};

use crate::store::KvStore;
use batch::BatchJob;
pub use config::LinkerConfig;
pub use group::TpGroup;
pub use metrics::{LinkerMetrics, MetricsSnapshot, LAYER_LATENCY_BUCKETS_US};
#[cfg(target_os = "linux")]
pub use process_group::{serve_group_store, FormedTpGroup};

/// State shared by the linker's API and its load thread.
pub(crate) struct Shared {
    pub(crate) geometry: KvGeometry,
    pub(crate) keys: KeyScheme,
    pub(crate) store: Arc<dyn KvStore>,
    pub(crate) pool: Arc<dyn KvPool>,
    /// Makes each batch's landing (host: straight into the pool; CUDA: pinned staging).
    pub(crate) landings: Arc<dyn LandingFactory>,
    pub(crate) config: LinkerConfig,
    /// The TP group, when this rank shares replicated components with others.
    pub(crate) group: Option<TpGroup>,
    /// Bandwidths `Auto` decides from (configured, refined by measurement).
    pub(crate) measured: Mutex<dedup_broadcast::Bandwidths>,
    /// `Auto`'s measurements: seconds per landed byte of each mode (AllRanks, Rank0Broadcast,
    /// SplitAllGather), a running average.
    pub(crate) mode_seconds_per_byte: Mutex<[Option<f64>; 3]>,
    /// The mode `Auto` settled on, once it has measured every mode.
    pub(crate) auto_kept: Mutex<Option<kv_loader::ShareMode>>,
    /// Staging buffers kept between batches.
    pub(crate) staging_cache: Mutex<Vec<Vec<u8>>>,
    pub(crate) counter: LayerCounter<KvLoadError>,
    pub(crate) metrics: LinkerMetrics,
    /// Bumped by `reset`: a batch whose epoch differs is cancelled.
    pub(crate) epoch: AtomicU64,
    closed: AtomicBool,
    /// Per batch, what each ready layer's wait hands back (device pools only).
    readies: Mutex<HashMap<BatchId, Vec<Option<LayerReady>>>>,
    /// Finished batches not yet taken, with their counter tickets (released when taken).
    outcomes: Mutex<HashMap<BatchId, (layerwise_counter::Ticket, BatchOutcome)>>,
    outcome_ready: Condvar,
    /// Batches submitted and not yet finished by the load thread.
    pending: Mutex<usize>,
    idle: Condvar,
}

impl Shared {
    /// Layer `layer` of the job has landed: keep its ready signal, mark it in the counter.
    pub(crate) fn publish(&self, job: &BatchJob, layer: u32, ready: LayerReady) {
        if let LayerReady::Event(_) = &ready {
            let mut r = self.readies.lock();
            let slots = r.entry(job.ticket.batch).or_default();
            slots.resize(self.geometry.num_layers() as usize, None);
            slots[layer as usize] = Some(ready);
        }
        // A stale ticket here means the batch was reset; the next layer sees the new epoch.
        let _ = self.counter.complete(job.ticket.counter, layer);
    }

    fn finish_job(&self, job: BatchJob, result: Result<kv_loader::LoadStats, KvLoadError>) {
        let batch = job.ticket.batch;
        match &result {
            Ok(stats) => {
                self.metrics.batch(true);
                info!(%batch, pages = stats.pages, bytes = stats.bytes_read,
                      last_layer = ?stats.last_layer, "batch loaded");
            }
            Err(e) => {
                self.metrics.batch(false);
                self.metrics.failure(e.kind_name());
                warn!(%batch, error = %e, "batch failed");
                let _ = self.counter.fail(job.ticket.counter, e.clone());
            }
        }
        self.outcomes
            .lock()
            .insert(batch, (job.ticket.counter, BatchOutcome { batch, result }));
        self.outcome_ready.notify_all();
    }

    fn load_loop(self: Arc<Self>, jobs: mpsc::Receiver<BatchJob>) {
        while let Ok(job) = jobs.recv() {
            let result = if self.epoch.load(Ordering::Acquire) != job.epoch {
                Err(KvLoadError::Cancelled {
                    batch: job.ticket.batch,
                })
            } else {
                self.run_batch(&job)
            };
            self.finish_job(job, result);
            let mut p = self.pending.lock();
            *p = p.saturating_sub(1);
            self.idle.notify_all();
        }
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
            other => KvLoadError::Config(format!("{}: {other}", ticket.batch)),
        }
    }

    /// Takes the outcome of `batch`, waiting until `deadline`.
    fn take_outcome(&self, batch: BatchId, deadline: Instant) -> Option<BatchOutcome> {
        let mut outcomes = self.outcomes.lock();
        loop {
            if let Some((_, o)) = outcomes.remove(&batch) {
                return Some(o);
            }
            if self
                .outcome_ready
                .wait_until(&mut outcomes, deadline)
                .timed_out()
            {
                return outcomes.remove(&batch).map(|(_, o)| o);
            }
        }
    }

    /// Waits until the load thread has nothing pending, up to `deadline`.
    fn wait_idle(&self, deadline: Instant) -> bool {
        let mut p = self.pending.lock();
        while *p > 0 {
            if self.idle.wait_until(&mut p, deadline).timed_out() {
                return *p == 0;
            }
        }
        true
    }
}

/// The [`KvLoader`] of one TP rank: validates plans, loads them layer by layer from a
/// [`KvStore`] into a [`KvPool`] on a dedicated load thread, marks layers ready in a
/// [`LayerCounter`], saves new pages, and never hangs: every wait has a deadline.
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
/// let linker = Linker::new(g, store, pool, LinkerConfig::default()).unwrap();
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
    shared: Arc<Shared>,
    jobs: Mutex<Option<mpsc::Sender<BatchJob>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Linker {
    /// A linker for one rank (`geometry.tp_rank`) over `store`, landing into `pool`. Starts
    /// the load thread.
    pub fn new(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        config: LinkerConfig,
    ) -> Result<Self, KvLoadError> {
        let landings = Self::host_landings(&pool)?;
        Self::with_landings(geometry, store, pool, landings, config, None)
    }

    /// A linker whose batches land through `landings` (the CUDA backend's
    /// `StagedLandingFactory` for a device pool), optionally sharing with a TP group.
    pub fn with_landings(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        landings: Arc<dyn LandingFactory>,
        config: LinkerConfig,
        group: Option<TpGroup>,
    ) -> Result<Self, KvLoadError> {
        if let Some(g) = &group {
            Self::check_group(&geometry, g)?;
        }
        Self::build(geometry, store, pool, landings, config, group)
    }

    fn host_landings(pool: &Arc<dyn KvPool>) -> Result<Arc<dyn LandingFactory>, KvLoadError> {
        if pool.residence() != Residence::Host {
            return Err(KvLoadError::Config(
                "a device pool lands through its backend's staging: use Linker::with_landings"
                    .into(),
            ));
        }
        Ok(Arc::new(DirectLandingFactory::new(pool.clone())))
    }

    fn check_group(geometry: &KvGeometry, group: &TpGroup) -> Result<(), KvLoadError> {
        if group.rank() != geometry.tp_rank
            || group.size() != geometry.tp_size
            || group.control.rank() != group.rank()
            || group.control.size() != group.size()
        {
            return Err(KvLoadError::Config(format!(
                "group rank {}/{} does not match geometry rank {}/{}",
                group.rank(),
                group.size(),
                geometry.tp_rank,
                geometry.tp_size
            )));
        }
        Ok(())
    }

    /// A linker for rank `group.rank()` of a TP group: replicated components are shared as
    /// `config.mode` says, lookups agree on the group's minimum, and every rank reaches the
    /// same outcome for every batch. Every rank must call `lookup` and `start_load` in the
    /// same order.
    pub fn with_group(
        geometry: KvGeometry,
        store: Arc<dyn KvStore>,
        pool: Arc<dyn KvPool>,
        config: LinkerConfig,
        group: TpGroup,
    ) -> Result<Self, KvLoadError> {
        let landings = Self::host_landings(&pool)?;
        Self::with_landings(geometry, store, pool, landings, config, Some(group))
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
            return Err(KvLoadError::Config(
                "the pool is laid out for another geometry".into(),
            ));
        }
        regions::register_regions(&store, &landings)?;
        let keys = KeyScheme::new(
            &config.namespace.resolve(&geometry),
            geometry.tp_rank,
            config.cp_rank,
            config.pp_rank,
        );
        let shared = Arc::new(Shared {
            counter: LayerCounter::with_capacity(config.max_in_flight.max(1)),
            geometry,
            keys,
            store,
            pool,
            landings,
            measured: Mutex::new(config.bandwidths),
            config,
            group,
            staging_cache: Mutex::new(Vec::new()),
            mode_seconds_per_byte: Mutex::new([None; 3]),
            auto_kept: Mutex::new(None),
            metrics: LinkerMetrics::default(),
            epoch: AtomicU64::new(0),
            closed: AtomicBool::new(false),
            readies: Mutex::new(HashMap::new()),
            outcomes: Mutex::new(HashMap::new()),
            outcome_ready: Condvar::new(),
            pending: Mutex::new(0),
            idle: Condvar::new(),
        });
        let (tx, rx) = mpsc::channel();
        let worker = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-load-r{}", worker.geometry.tp_rank))
            .spawn(move || worker.load_loop(rx))
            .map_err(|e| {
                regions::release_regions(&shared.store, &shared.landings);
                KvLoadError::Config(format!("spawning the load thread: {e}"))
            })?;
        Ok(Linker {
            shared,
            jobs: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// This rank's geometry.
    pub fn geometry(&self) -> &KvGeometry {
        &self.shared.geometry
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.shared.store
    }

    /// Counters for export.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.shared.metrics.snapshot()
    }

    /// The object keys of a plan's pages for component `index` of the plan, in plan order.
    pub fn object_keys(&self, plan: &BatchPlan) -> Result<Vec<Vec<String>>, KvLoadError> {
        Ok(self
            .shared
            .component_keys(plan)?
            .into_iter()
            .map(|c| c.keys)
            .collect())
    }

    fn cancel_all(&self) -> Result<(), KvLoadError> {
        let s = &self.shared;
        s.epoch.fetch_add(1, Ordering::AcqRel);
        s.counter.reset();
        let deadline = kv_loader::deadline_after(s.config.wait_deadline);
        if !s.wait_idle(deadline) {
            return Err(KvLoadError::Config(format!(
                "the load thread is still busy {:?} after reset (a store call hangs?)",
                s.config.wait_deadline
            )));
        }
        s.readies.lock().clear();
        Ok(())
    }
}

impl KvLoader for Linker {
    fn num_layers(&self) -> u32 {
        self.shared.geometry.num_layers()
    }

    fn lookup(&self, request: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        self.shared.check_open()?;
        self.shared.lookup(request)
    }

    fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError> {
        let s = &self.shared;
        s.check_open()?;
        plan.validate(&s.geometry, s.pool.pages())?;
        let batch = plan.logical.batch;
        let counter = s
            .counter
            .begin(s.geometry.num_layers())
            .map_err(|e| match e {
                CounterError::Full { capacity } => KvLoadError::Busy { capacity },
                other => KvLoadError::Config(format!("{batch}: {other}")),
            })?;
        let ticket = LoadTicket {
            batch,
            num_layers: s.geometry.num_layers(),
            counter,
        };
        let job = BatchJob {
            plan,
            ticket,
            epoch: s.epoch.load(Ordering::Acquire),
            started: Instant::now(),
        };
        *s.pending.lock() += 1;
        let sent = self
            .jobs
            .lock()
            .as_ref()
            .is_some_and(|tx| tx.send(job).is_ok());
        if !sent {
            let mut p = s.pending.lock();
            *p = p.saturating_sub(1);
            let _ = s.counter.finish(counter);
            return Err(KvLoadError::Closed);
        }
        Ok(ticket)
    }

    fn wait_layer(&self, ticket: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError> {
        let s = &self.shared;
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
        match s
            .counter
            .wait(ticket.counter, layer, deadline)
            .map_err(|e| Shared::counter_error(ticket, e))?
        {
            WaitOutcome::Ready => {
                if s.pool.residence() == Residence::Host {
                    return Ok(LayerReady::Resident);
                }
                let r = s.readies.lock();
                Ok(r.get(&ticket.batch)
                    .and_then(|v| v.get(layer as usize).cloned().flatten())
                    .unwrap_or(LayerReady::Resident))
            }
            WaitOutcome::Failed(e) => Err(e),
            WaitOutcome::TimedOut => Err(KvLoadError::Timeout {
                batch: ticket.batch,
                layer,
                waited: s.config.wait_deadline,
            }),
            WaitOutcome::Cancelled => Err(KvLoadError::Cancelled {
                batch: ticket.batch,
            }),
        }
    }

    fn wait_batch(&self, ticket: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
        let s = &self.shared;
        let deadline = kv_loader::deadline_after(s.config.wait_deadline);
        let outcome = s
            .take_outcome(ticket.batch, deadline)
            .ok_or(KvLoadError::Timeout {
                batch: ticket.batch,
                layer: ticket.num_layers.saturating_sub(1),
                waited: s.config.wait_deadline,
            })?;
        let _ = s.counter.finish(ticket.counter);
        s.readies.lock().remove(&ticket.batch);
        Ok(outcome)
    }

    fn completed(&self) -> Vec<BatchOutcome> {
        let s = &self.shared;
        let taken: Vec<(layerwise_counter::Ticket, BatchOutcome)> =
            s.outcomes.lock().drain().map(|(_, t)| t).collect();
        let mut out = Vec::with_capacity(taken.len());
        for (ticket, outcome) in taken {
            // Already stale after a reset; otherwise this frees the batch's counter slot.
            let _ = s.counter.finish(ticket);
            out.push(outcome);
        }
        out.sort_by_key(|o| o.batch);
        let mut readies = s.readies.lock();
        for o in &out {
            readies.remove(&o.batch);
        }
        out
    }

    fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        self.shared.check_open()?;
        self.shared.save(plan)
    }

    fn reset(&self) -> Result<(), KvLoadError> {
        self.shared.check_open()?;
        info!("linker reset");
        self.cancel_all()
    }

    fn close(&self) -> Result<(), KvLoadError> {
        if self.shared.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        info!("linker close");
        let cancelled = self.cancel_all();
        // Dropping the sender ends the load loop once it is idle.
        self.jobs.lock().take();
        if let Some(t) = self.thread.lock().take() {
            if cancelled.is_ok() {
                let _ = t.join();
            }
        }
        self.shared.drop_staging();
        regions::release_regions(&self.shared.store, &self.shared.landings);
        cancelled
    }
}

impl Drop for Linker {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            warn!(error = %e, "closing the linker on drop");
        }
    }
}
