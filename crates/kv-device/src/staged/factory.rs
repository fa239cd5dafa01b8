//! Staged landings per batch, and the save-direction gather.

use std::sync::Arc;
use std::time::Duration;

use kv_geometry::ComponentId;

use super::copy::{self, ScatterStrategy};
use super::landing::StagedLanding;
use super::pool::DeviceKvPool;
use super::staging::{StagingLease, StagingPool};
use super::sync::{self, SYNC_LIMIT};
use crate::{
    BatchShape, DeviceError, KvPool, LandingFactory, LayerLanding, ReadClaims, SaveGather,
    SharePath, SharedEvent, SlotClaims, StoreRegion, Stream,
};
use parking_lot::Mutex;

/// How long a landing or a gather waits for a staging buffer by default
/// ([`StagedLandingFactory::with_lease_wait`]).
pub const DEFAULT_LEASE_WAIT: Duration = Duration::from_secs(1);

/// Staged landings into a device pool, each batch leasing a staging buffer of `staging`.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{CpuDevice, DeviceKvPool, LandingFactory, SharePath, StagedLandingFactory, StagingPool};
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let dev = CpuDevice::new(0).unwrap();
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
/// let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&g, 8, 1), 2).unwrap();
/// let f = StagedLandingFactory::new(pool, staging.clone());
/// assert_eq!(f.share_path(), SharePath::Device);
/// let regions: Vec<(usize, usize)> =
///     f.store_regions().iter().map(|r| (r.addr(), r.len())).collect();
/// assert_eq!(regions, staging.host_regions());
/// ```
pub struct StagedLandingFactory {
    pool: Arc<DeviceKvPool>,
    staging: Arc<StagingPool>,
    strategy: ScatterStrategy,
    drain: Duration,
    /// Longest a batch or a save waits for a staging buffer to come back.
    lease_wait: Duration,
    /// The stream saves without an engine event gather on (made at the first such save, made
    /// again after a gather on it got stuck or failed): apart from the load stream, so a save
    /// never holds a load's copies back. A save that waits for an engine event gets a stream
    /// of its own: an event that never completes then holds back that save alone.
    save_stream: SaveStream,
}

impl std::fmt::Debug for StagedLandingFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedLandingFactory")
            .finish_non_exhaustive()
    }
}

/// The factory's shared save stream, cleared by a gather that found it stuck.
type SaveStream = Arc<Mutex<Option<Arc<dyn Stream>>>>;

impl StagedLandingFactory {
    /// Landings into `pool` through `staging` (the same device).
    pub fn new(pool: Arc<DeviceKvPool>, staging: Arc<StagingPool>) -> Self {
        StagedLandingFactory {
            pool,
            staging,
            strategy: ScatterStrategy::Auto,
            drain: Duration::from_secs(30),
            lease_wait: DEFAULT_LEASE_WAIT,
            save_stream: Arc::default(),
        }
    }

    /// Longest a batch's landing or a save's gather waits for a staging buffer when every
    /// buffer is leased (a save gathering, another batch releasing its buffer) or quarantined
    /// (device work still running), before it fails [`DeviceError::Alloc`] (default 1 s;
    /// zero fails at once). Loads and saves share the pool: without a wait, a load that
    /// starts while saves hold every buffer fails and its request recomputes. In a TP group a
    /// batch's landing begins after its gate, so its peers wait for this rank meanwhile: keep
    /// the wait well under the linker's `collective_timeout` (a linker in a group says at
    /// `warn` when it builds with a wait of half that or more).
    pub fn with_lease_wait(mut self, wait: Duration) -> Self {
        self.lease_wait = wait;
        self
    }

    /// How landings move rows into scattered slots.
    pub fn with_strategy(mut self, strategy: ScatterStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Longest a landing's release waits for device work still running before its lease is
    /// quarantined.
    pub fn with_drain_limit(mut self, limit: Duration) -> Self {
        self.drain = limit;
        self
    }

    /// The staging pool.
    pub fn staging(&self) -> &Arc<StagingPool> {
        &self.staging
    }

    fn save_stream(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        let mut s = self.save_stream.lock();
        if let Some(stream) = s.as_ref() {
            return Ok(stream.clone());
        }
        let stream = self.pool.device().new_stream()?;
        *s = Some(stream.clone());
        Ok(stream)
    }

    fn gather(
        &self,
        slots: Arc<[u32]>,
        after: Option<&SharedEvent>,
    ) -> Result<Box<dyn SaveGather>, DeviceError> {
        let (stream, shared) = match after {
            Some(_) => (self.pool.device().new_stream()?, None),
            None => (self.save_stream()?, Some(self.save_stream.clone())),
        };
        Ok(Box::new(StagedGather::new(
            self.pool.clone(),
            stream,
            shared,
            self.staging.lease_within(self.lease_wait)?,
            slots,
            self.strategy,
            after,
        )?))
    }
}

impl LandingFactory for StagedLandingFactory {
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Box<dyn LayerLanding>, DeviceError> {
        // Before the lease: a batch no stage holds fails as that at once, not after a wait for
        // a buffer (nor as the lease's `Alloc` when every buffer is busy).
        super::landing::check_shape(&self.pool, &shape, slots.len(), self.staging.stage_bytes())?;
        let lease = self.staging.lease_within(self.lease_wait)?;
        Ok(Box::new(
            StagedLanding::new(self.pool.clone(), lease, slots, shape)?
                .with_strategy(self.strategy)
                .with_drain_limit(self.drain),
        ))
    }

    fn store_regions(&self) -> Vec<StoreRegion> {
        self.staging.store_regions()
    }

    fn share_path(&self) -> SharePath {
        SharePath::Device
    }

    fn staging_quarantined(&self) -> usize {
        self.staging.quarantined()
    }

    fn staging_held_for_good(&self) -> (usize, usize) {
        (self.staging.held_for_good(), self.staging.capacity())
    }

    fn lease_wait(&self) -> Duration {
        self.lease_wait
    }

    fn stage_bytes(&self) -> Option<usize> {
        Some(self.staging.stage_bytes())
    }

    fn record_on_engine_stream(
        &self,
        stream: kv_loader::RawStream,
    ) -> Result<SharedEvent, DeviceError> {
        self.pool.device().record_on(stream)
    }

    fn begin_save(&self, slots: Arc<[u32]>) -> Result<Box<dyn SaveGather>, DeviceError> {
        self.gather(slots, None)
    }

    /// The gather's stream waits on `after` device-side before its first copy.
    fn begin_save_after(
        &self,
        slots: Arc<[u32]>,
        after: &SharedEvent,
    ) -> Result<Box<dyn SaveGather>, DeviceError> {
        self.gather(slots, Some(after))
    }
}

/// The save direction: device slots → pinned staging, one (component, layer) at a time,
/// synchronously (bounded), on the factory's save stream (a fresh stream when ordered after the
/// engine's event): after the load stream's work so far, and after that event when given.
pub(crate) struct StagedGather {
    pool: Arc<DeviceKvPool>,
    stream: Arc<dyn Stream>,
    /// The factory's shared save stream, when `stream` is it: cleared when this gather finds
    /// the stream stuck, so that later saves get a fresh one.
    shared: Option<SaveStream>,
    lease: Option<StagingLease>,
    slots: Arc<[u32]>,
    /// Device address of the slot table (0: no slots), kept with the lease's staging buffer.
    slot_table: u64,
    strategy: ScatterStrategy,
    /// A gather did not finish in time, or failed with part of it possibly queued: the lease
    /// (with the slot table and the pool) is quarantined on drop until these events complete
    /// (empty: no fence could be recorded, so for good).
    stuck: Option<Vec<SharedEvent>>,
    /// The saved slots, claimed for reading until every gather from them has finished (on
    /// drop, or with the quarantined lease).
    claim: Option<ReadClaims>,
}

impl StagedGather {
    fn new(
        pool: Arc<DeviceKvPool>,
        stream: Arc<dyn Stream>,
        shared: Option<SaveStream>,
        mut lease: StagingLease,
        slots: Arc<[u32]>,
        strategy: ScatterStrategy,
        after: Option<&SharedEvent>,
    ) -> Result<Self, DeviceError> {
        if let Some(&s) = slots.iter().find(|&&s| s >= pool.pages()) {
            return Err(DeviceError::OutOfPool {
                component: u16::MAX,
                layer: u32::MAX,
                slot: s,
                reason: "slot past the pool",
            });
        }
        super::landing::same_device(&**lease.device(), &**pool.device())?;
        let claimed: Arc<dyn KvPool> = pool.clone();
        let claim = SlotClaims::read_all(&claimed, &slots)?;
        let device = pool.device().clone();
        let slot_table = if slots.is_empty() {
            0
        } else {
            let bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
            // While a copy of the pool is stuck this fails at once, before any table is had.
            pool.bounce().settle()?;
            let table = lease.slot_table(bytes.len())?;
            // SAFETY: the lease's own table, at least `bytes.len()` bytes, used by no device
            // work (a fresh lease); where a failed copy may still run it is leaked.
            if let Err(e) = unsafe { sync::write(&*device, pool.bounce(), table, &bytes) } {
                if pool.bounce().may_still_run() {
                    lease.leak_slot_table("a save's slot table upload did not finish");
                }
                return Err(e);
            }
            table
        };
        // Every gather of this save runs after what the load stream did so far (loads into
        // these slots) and after the engine's compute that wrote the pages.
        stream.wait(&device.load_stream().record()?)?;
        if let Some(ev) = after {
            stream.wait(ev)?;
        }
        Ok(StagedGather {
            stream,
            shared,
            pool,
            lease: Some(lease),
            slots,
            slot_table,
            strategy,
            stuck: None,
            claim: Some(claim),
        })
    }
}

impl SaveGather for StagedGather {
    fn gather(&mut self, component: ComponentId, layer: u32) -> Result<&[u8], DeviceError> {
        if self.stuck.is_some() {
            return Err(DeviceError::Poisoned("an earlier gather did not finish"));
        }
        let lease = self
            .lease
            .as_ref()
            .ok_or(DeviceError::InvalidStage("no lease"))?;
        let c = self
            .pool
            .geometry()
            .component(component)
            .map_err(|_| DeviceError::InvalidStage("unknown component"))?;
        // Checked: the slots are the caller's (repeats allowed), a product that wrapped would
        // pass the bound below and the gather would write past the stage.
        let bytes = c.page_layer_bytes.saturating_mul(self.slots.len() as u64);
        if bytes > lease.stage_bytes() as u64 {
            return Err(DeviceError::StageTooSmall {
                layer,
                need: bytes,
                stage: lease.stage_bytes() as u64,
            });
        }
        let (pool_buf, _) = self.pool.buffer(component, layer)?;
        let host = lease.host_stage(0)?;
        let span = copy::RowSpan {
            first_page: 0,
            pages: self.slots.len(),
            row: c.page_layer_bytes,
            pool: pool_buf,
            slot_table: self.slot_table,
        };
        let dev_stage = lease.device_stage(0)?;
        // SAFETY: source slots lie in the pool buffer, destinations in stage 0 (size checked);
        // the previous gather finished (waited below) and nothing else uses this lease. What
        // of it is queued is fenced below, failed or not, before the lease can be reused.
        let queued = unsafe {
            copy::gather(
                &self.stream,
                self.strategy,
                &self.slots,
                span,
                host,
                dev_stage,
            )
        };
        let ev = match self.stream.record() {
            Ok(ev) => ev,
            Err(e) => {
                tracing::error!(
                    error = %e,
                    slots = %crate::claims::slot_list(&self.slots),
                    "save gather queued but not fenced: its staging, slot table and pool are \
                     kept for good, and its slots stay claimed for reading (landings into them \
                     are refused SlotBusy; the device is likely broken: rebuild the pool)"
                );
                self.stick(Vec::new());
                return Err(queued.err().unwrap_or(e));
            }
        };
        if let Err(e) = queued {
            // Part of the gather may be queued (an earlier copy of it): hold the lease until it
            // has run.
            self.stick(vec![ev]);
            return Err(e);
        }
        match ev.wait_until(kv_loader::deadline_after(SYNC_LIMIT)) {
            Ok(true) => {
                // SAFETY: the gather into these `bytes` of pinned stage 0 (checked to fit) has
                // finished (waited above); the lease `self` holds keeps them allocated, and
                // nothing writes them until the next gather, which needs `&mut self`.
                Ok(unsafe { std::slice::from_raw_parts(host as *const u8, bytes as usize) })
            }
            Ok(false) => {
                self.stick(vec![ev]);
                Err(DeviceError::Timeout {
                    what: "save gather",
                    waited: SYNC_LIMIT,
                })
            }
            // The wait itself failed (not the gather, maybe): the copy may still run, so the
            // lease is held until the event settles.
            Err(e) => {
                self.stick(vec![ev]);
                Err(e)
            }
        }
    }
}

impl StagedGather {
    /// This gather did not finish cleanly: its lease is quarantined on drop until `fences`
    /// complete (empty: for good), and the factory's shared save stream, when it ran on it,
    /// is let go so that later saves do not queue behind it.
    fn stick(&mut self, fences: Vec<SharedEvent>) {
        self.stuck = Some(fences);
        if let Some(shared) = &self.shared {
            let mut s = shared.lock();
            if s.as_ref().is_some_and(|cur| Arc::ptr_eq(cur, &self.stream)) {
                tracing::warn!(
                    "a save gather got stuck on the save stream: later saves get a new stream"
                );
                *s = None;
            }
        }
    }
}

impl Drop for StagedGather {
    fn drop(&mut self) {
        if let (Some(fences), Some(lease)) = (self.stuck.take(), self.lease.take()) {
            let mut owners: Vec<Arc<dyn std::any::Any + Send + Sync>> = vec![self.pool.clone()];
            // The slots stay claimed while a gather may still read them.
            if let Some(claim) = self.claim.take() {
                owners.push(Arc::new(claim));
            }
            let work = super::staging::slots_work("save gather", &self.slots);
            lease.quarantine_owned(work, fences, Vec::new(), owners);
        }
    }
}
