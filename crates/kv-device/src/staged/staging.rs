//! A reusable pool of staging buffers: pinned host memory (what the store writes into) paired
//! with device memory of the same size (where rows wait for the collective and the scatter).
//! Allocated once (pinned allocation is slow and synchronizing on CUDA), leased per batch.
//! Each buffer is a ring of equal **stages**, one layer each: two let the read of layer *l+1*
//! overlap the copies of *l*; more let the store read a group of layers in one call.
//!
//! A lease whose device work may still be running when its batch ends (a wait for it timed
//! out) is **quarantined**, not returned: it is handed out again only once every event that
//! fences it has completed, and never freed before.

use crate::log_every::LogEvery;
use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_geometry::KvGeometry;
use parking_lot::{Condvar, Mutex};

use crate::{Device, DeviceError, DeviceMemory, PinnedMemory, SharedEvent, StoreRegion};

/// One staging buffer pair (pinned and device), each split into the pool's stages, and the
/// device slot table its batches use, kept with it: reused batch after batch, so that a
/// batch allocates and frees no device memory (on CUDA, `cuMemAlloc` and `cuMemFree` may
/// synchronize the whole device, stalling the engine's compute).
pub(crate) struct StagingPair {
    host: PinnedMemory,
    dev: DeviceMemory,
    /// Grown on demand ([`StagingLease::slot_table`]); only the pair's lease holder uses it,
    /// and it is freed only when the pair is idle (leased, or dropped with its pool).
    table: Option<DeviceMemory>,
}

/// A pair that device work or a store read may still use: the events that say when the
/// device work is done (`None`: unknown, it is never handed out again), the flags of stages
/// still lent to a store read (each clears when its loan drops, i.e. when the read returned),
/// and anything else that work may touch.
struct Quarantined {
    pair: StagingPair,
    /// What work holds it ("save gather of pool slots [3, 7]"), for the logs.
    work: String,
    fences: Option<Vec<SharedEvent>>,
    lent: Vec<Arc<AtomicBool>>,
    _extra: Vec<DeviceMemory>,
    /// Owners of memory the same work may touch (a device pool a save gather reads).
    _owners: Vec<Arc<dyn Any + Send + Sync>>,
}

/// Smallest slot table a staging buffer keeps (1024 pages): small batches never regrow it.
pub(crate) const SLOT_TABLE_MIN: usize = 4096;

/// Names work on pool slots for the logs: `"<what> of pool slots [3, 7]"`, the first 16 and a
/// count past that (a batch may hold thousands).
pub(crate) fn slots_work(what: &str, slots: &[u32]) -> String {
    format!("{what} of pool slots {}", crate::claims::slot_list(slots))
}

/// Of `quarantine`, the buffers held for good: no fence tells when their work ends.
fn held_for_good_in(quarantine: &[Quarantined]) -> usize {
    quarantine.iter().filter(|q| q.fences.is_none()).count()
}

/// What a quarantined pair's fences say.
enum Fenced {
    /// Every fence has completed.
    Done,
    /// Some fence has not completed yet.
    Running,
    /// Unknown for good: no fences were given, or one failed to answer.
    Unknown,
}

impl Quarantined {
    /// True when no stage is lent any more and every fence has completed. A fence whose query
    /// fails says nothing about the work before it (a broken context may still hold it), so
    /// its pair is never handed out again: the failure is logged once and the fences dropped.
    fn settled(&mut self) -> bool {
        if self.lent.iter().any(|l| l.load(Ordering::Acquire)) {
            return false;
        }
        match self.fenced() {
            Fenced::Done => true,
            Fenced::Running => false,
            Fenced::Unknown => {
                self.fences = None;
                false
            }
        }
    }

    fn fenced(&self) -> Fenced {
        let Some(fences) = &self.fences else {
            return Fenced::Unknown;
        };
        for fence in fences {
            match fence.is_complete() {
                Ok(true) => {}
                Ok(false) => return Fenced::Running,
                Err(error) => {
                    tracing::error!(
                        %error,
                        work = %self.work,
                        "a quarantined staging buffer's fence failed to answer: whether its \
                         device work has ended is unknown, so the buffer (and what that work \
                         holds) is never released again"
                    );
                    return Fenced::Unknown;
                }
            }
        }
        Fenced::Done
    }
}

/// Staging buffers of one device, allocated once and reused.
///
/// Each buffer holds [`stages`](StagingPool::stages) stages of
/// [`stage_bytes`](StagingPool::stage_bytes) each, a batch's ring of layer stages: with two,
/// the read of layer *l+1* fills one while the copies of *l* drain the other; with `k + 1`,
/// the store can read a group of `k` layers in one call while the previous layer lands.
///
/// ```
/// use kv_device::{CpuDevice, StagingPool};
/// let pool = StagingPool::new(CpuDevice::new(0).unwrap(), 1 << 16, 2).unwrap();
/// assert_eq!(pool.stages(), 2);
/// let lease = pool.lease().unwrap();
/// assert_eq!(pool.available(), 1);
/// drop(lease);
/// assert_eq!(pool.available(), 2);
/// // A ring of 9 stages: groups of up to 8 layers per store call.
/// let ring = StagingPool::with_stages(CpuDevice::new(0).unwrap(), 1 << 16, 9, 1).unwrap();
/// assert_eq!(ring.lease().unwrap().stages(), 9);
/// ```
pub struct StagingPool {
    device: Arc<dyn Device>,
    stage_bytes: usize,
    stages: usize,
    free: Mutex<Vec<StagingPair>>,
    /// Notified when a buffer goes back to `free` or into quarantine (a
    /// [`lease_within`](StagingPool::lease_within) then looks again).
    returned: Condvar,
    quarantine: Mutex<Vec<Quarantined>>,
    host_regions: Vec<(usize, usize)>,
    count: usize,
    /// "No buffer came back" at `warn` once a minute, at `debug` in between (once every
    /// buffer is held for good, every landing and save meets one).
    shortage_log: LogEvery,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("stage_bytes", &self.stage_bytes)
            .field("stages", &self.stages)
            .field("count", &self.count)
            .finish()
    }
}

impl StagingPool {
    /// `count` staging buffers of two stages ("halves") of `half_bytes` each (at least one
    /// layer of the largest batch, share area included: [`StagingPool::half_bytes_for`]).
    pub fn new(
        device: Arc<dyn Device>,
        half_bytes: usize,
        count: usize,
    ) -> Result<Arc<Self>, DeviceError> {
        Self::with_stages(device, half_bytes, 2, count)
    }

    /// `count` staging buffers (at least one) of `stages` stages (at least 2) of
    /// `stage_bytes` each: a batch can then read up to `stages - 1` layers per store call.
    pub fn with_stages(
        device: Arc<dyn Device>,
        stage_bytes: usize,
        stages: usize,
        count: usize,
    ) -> Result<Arc<Self>, DeviceError> {
        if count == 0 {
            // Every batch would fail as if each buffer were leased or quarantined.
            return Err(DeviceError::Unsupported(
                "a staging pool of no buffers (count 0): no batch could stage",
            ));
        }
        let stages = stages.max(2);
        let total = stage_bytes.checked_mul(stages).ok_or(DeviceError::Alloc {
            bytes: u64::MAX,
            what: "staging buffer",
        })?;
        // Not reserved up front: `count` is caller input, and a capacity past the address
        // space would abort; the first allocation that does not fit ends the loop instead.
        let mut free = Vec::new();
        let mut host_regions = Vec::new();
        for _ in 0..count {
            let host = device.alloc_pinned(total, "pinned staging")?;
            let dev = device.alloc(total, "device staging")?;
            host_regions.push((host.addr(), host.len()));
            free.push(StagingPair {
                host,
                dev,
                table: None,
            });
        }
        Ok(Arc::new(StagingPool {
            device,
            stage_bytes,
            stages,
            free: Mutex::new(free),
            returned: Condvar::new(),
            quarantine: Mutex::new(Vec::new()),
            host_regions,
            count,
            shortage_log: LogEvery::new(),
        }))
    }

    /// Bytes a stage needs for batches of up to `pages` pages at TP `tp_size`: the widest
    /// layer, with the share area's padding (a `SplitAllGather` share area holds `tp_size`
    /// chunks of the largest share).
    pub fn half_bytes_for(geometry: &KvGeometry, pages: usize, tp_size: u32) -> usize {
        let padded = pages
            .div_ceil(tp_size.max(1) as usize)
            .saturating_mul(tp_size.max(1) as usize);
        (geometry.max_layer_bytes_per_page() as usize).saturating_mul(padded.max(pages))
    }

    /// Bytes per stage.
    pub fn stage_bytes(&self) -> usize {
        self.stage_bytes
    }

    /// The most pages of a batch a stage holds for `geometry` (every component, its widest
    /// layer), a multiple of its TP size (`SplitAllGather` pads the shared rows to one): an
    /// engine caps a batch's pages at this, since a larger batch fails as its landing begins
    /// ([`DeviceError::StageTooSmall`]).
    ///
    /// ```
    /// use kv_device::{CpuDevice, StagingPool};
    /// use kv_geometry::{KvGeometry, ModelKvSpec};
    /// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    /// let half = StagingPool::half_bytes_for(&g, 512, 1);
    /// let staging = StagingPool::new(CpuDevice::new(0).unwrap(), half, 2).unwrap();
    /// assert_eq!(staging.max_batch_pages(&g), 512);
    /// ```
    pub fn max_batch_pages(&self, geometry: &KvGeometry) -> usize {
        let tp = geometry.tp_size().max(1) as usize;
        self.stage_bytes / (geometry.max_layer_bytes_per_page() as usize).max(1) / tp * tp
    }

    /// Stages per buffer (a batch's ring).
    pub fn stages(&self) -> usize {
        self.stages
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Every pinned host region (address, length), leased or not: register them with the
    /// store once, at start.
    pub fn host_regions(&self) -> Vec<(usize, usize)> {
        self.host_regions.clone()
    }

    /// Every pinned host region, leased or not, each keeping this pool (and so its buffers)
    /// alive: what a store registers.
    pub fn store_regions(self: &Arc<Self>) -> Vec<StoreRegion> {
        let owner: Arc<dyn Any + Send + Sync> = self.clone();
        self.host_regions
            .iter()
            // SAFETY: the pinned buffers belong to this pool from `new` until it drops (a
            // lease returns its buffer here; a buffer device work may still use is leaked,
            // never freed), and `owner` keeps the pool alive.
            .map(|&(addr, len)| unsafe { StoreRegion::new(addr, len, owner.clone()) })
            .collect()
    }

    /// Buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.count
    }

    /// Buffers that can be leased now (quarantined ones whose work has finished count).
    pub fn available(&self) -> usize {
        self.reclaim();
        self.free.lock().len()
    }

    /// Buffers held back because device work may still use them.
    pub fn quarantined(&self) -> usize {
        self.reclaim();
        self.quarantine.lock().len()
    }

    /// Of the [`quarantined`](Self::quarantined) buffers, those held for good (no event
    /// tells when their work ends): once they are all of [`capacity`](Self::capacity), every lease
    /// fails at once, and the pool must be rebuilt.
    pub fn held_for_good(&self) -> usize {
        self.reclaim();
        held_for_good_in(&self.quarantine.lock())
    }

    /// What holds each quarantined buffer, e.g. `"save gather of pool slots [3, 7]"`: for a
    /// health report, or to see which pool slots the work may still use. A save gather's
    /// slots stay claimed for reading meanwhile (a landing into them is refused
    /// [`DeviceError::SlotBusy`]); a landing's stay claimed only when its batch failed with
    /// copies into them unfinished ([`SlotClaims::held_slots`](crate::SlotClaims::held_slots)).
    ///
    /// ```
    /// use kv_device::{CpuDevice, StagingPool};
    /// let pool = StagingPool::new(CpuDevice::new(0).unwrap(), 1 << 12, 1).unwrap();
    /// assert!(pool.quarantined_work().is_empty());
    /// // No fence: the work's end is unknown, so the buffer is held for good.
    /// pool.lease().unwrap().quarantine(Vec::new(), Vec::new());
    /// assert_eq!(pool.quarantined_work(), vec!["a staging lease's device work".to_string()]);
    /// ```
    pub fn quarantined_work(&self) -> Vec<String> {
        self.reclaim();
        self.quarantine
            .lock()
            .iter()
            .map(|q| q.work.clone())
            .collect()
    }

    /// Moves quarantined pairs whose work has finished back to the free list.
    fn reclaim(&self) {
        // What a settled entry kept alive (memory its work touched, a device pool whose drop
        // drains its stream) is dropped after the locks are let go.
        let mut settled = Vec::new();
        {
            let mut q = self.quarantine.lock();
            let mut free = self.free.lock();
            let mut i = 0;
            while i < q.len() {
                if q[i].settled() {
                    let Quarantined {
                        pair,
                        work,
                        _extra,
                        _owners,
                        ..
                    } = q.swap_remove(i);
                    tracing::info!(work = %work, "a quarantined staging buffer is free again");
                    free.push(pair);
                    settled.push((_extra, _owners));
                } else {
                    i += 1;
                }
            }
        }
        if !settled.is_empty() {
            self.returned.notify_all();
        }
        drop(settled);
    }

    /// Leases a buffer; [`DeviceError::Alloc`] when every buffer is leased or quarantined (the
    /// caller limits batches in flight to the pool's capacity).
    pub fn lease(self: &Arc<Self>) -> Result<StagingLease, DeviceError> {
        self.lease_within(Duration::ZERO)
    }

    /// [`lease`](Self::lease), waiting up to `wait` for a buffer to come back (a save's
    /// gather or another batch ending, a quarantined buffer's work ending: looked at every 2 ms
    /// while one is quarantined) before it fails [`DeviceError::Alloc`]; at once where every
    /// buffer is quarantined for good (no event tells when its work ends).
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_device::{CpuDevice, StagingPool};
    /// let pool = StagingPool::new(CpuDevice::new(0).unwrap(), 1 << 12, 1).unwrap();
    /// let held = pool.lease().unwrap();
    /// let waiter = std::thread::spawn({
    ///     let pool = pool.clone();
    ///     move || pool.lease_within(Duration::from_secs(30))
    /// });
    /// drop(held); // the waiter gets the buffer now, not after 30 s
    /// let got = waiter.join().unwrap().unwrap();
    /// assert!(pool.lease_within(Duration::from_millis(1)).is_err()); // `got` holds it
    /// drop(got);
    /// ```
    pub fn lease_within(self: &Arc<Self>, wait: Duration) -> Result<StagingLease, DeviceError> {
        let start = Instant::now();
        let mut waited = false;
        loop {
            self.reclaim();
            // Looked at before `free` is locked: `reclaim` locks quarantine, then free.
            let (polling, held_for_good) = {
                let q = self.quarantine.lock();
                (!q.is_empty(), held_for_good_in(&q))
            };
            let mut free = self.free.lock();
            if let Some(pair) = free.pop() {
                if waited {
                    tracing::debug!(waited = ?start.elapsed(), "a staging buffer came back");
                }
                return Ok(StagingLease {
                    pool: self.clone(),
                    pair: Some(pair),
                });
            }
            // Every buffer held for good (no event will say its work ended): none comes back.
            let left = if held_for_good >= self.count {
                Duration::ZERO
            } else {
                wait.saturating_sub(start.elapsed())
            };
            if left.is_zero() {
                drop(free);
                if wait > Duration::ZERO {
                    let quarantined = self.quarantine.lock().len();
                    match self.shortage_log.due_after("shortage") {
                        Some(since) => tracing::warn!(
                            ?wait,
                            capacity = self.count,
                            quarantined,
                            held_for_good,
                            shortages_at_debug_since = since,
                            "no staging buffer came back within the wait (none can where every \
                             buffer is held for good; logged once a minute)"
                        ),
                        None => tracing::debug!(quarantined, held_for_good, "no staging buffer"),
                    }
                }
                return Err(DeviceError::Alloc {
                    bytes: (self.stage_bytes * self.stages) as u64,
                    what: "staging buffer (every buffer of the pool was leased or quarantined, \
                           through the wait if any)",
                });
            }
            // Capped even with nothing quarantined: a buffer quarantined between the look above
            // and this wait notifies before the wait began.
            let nap = left.min(if polling {
                QUARANTINE_POLL
            } else {
                UNPOLLED_NAP
            });
            self.returned.wait_for(&mut free, nap);
            waited = true;
        }
    }
}

/// How often a [`StagingPool::lease_within`] looks at quarantined buffers' work (their
/// events cannot wake it).
pub(crate) const QUARANTINE_POLL: Duration = Duration::from_millis(2);

/// The longest a [`StagingPool::lease_within`] sleeps between looks with nothing quarantined
/// (a return wakes it at once).
const UNPOLLED_NAP: Duration = Duration::from_millis(50);

impl Drop for StagingPool {
    fn drop(&mut self) {
        for mut q in self.quarantine.get_mut().drain(..) {
            if q.settled() {
                continue;
            }
            tracing::error!(
                work = %q.work,
                "staging pool dropped while device work may still use a quarantined buffer; \
                 leaking it"
            );
            std::mem::forget(q);
        }
    }
}

/// A leased staging buffer; returns to its pool on drop. The holder waits for the device work
/// that uses it before dropping it, or [quarantines](StagingLease::quarantine) it.
#[must_use = "a lease dropped at once returns its buffer unused"]
pub struct StagingLease {
    pool: Arc<StagingPool>,
    pair: Option<StagingPair>,
}

impl fmt::Debug for StagingLease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingLease")
            .field("stage_bytes", &self.pool.stage_bytes)
            .field("stages", &self.pool.stages)
            .finish()
    }
}

impl StagingLease {
    fn pair(&self) -> Result<&StagingPair, DeviceError> {
        self.pair
            .as_ref()
            .ok_or(DeviceError::InvalidStage("the lease was given up"))
    }

    /// Bytes per stage.
    pub fn stage_bytes(&self) -> usize {
        self.pool.stage_bytes
    }

    /// Stages of the buffer.
    pub fn stages(&self) -> usize {
        self.pool.stages
    }

    fn stage_offset(&self, stage: usize) -> Result<usize, DeviceError> {
        if stage >= self.pool.stages {
            return Err(DeviceError::InvalidStage("a stage past the staging buffer"));
        }
        Ok(stage * self.pool.stage_bytes)
    }

    /// Host address of stage `stage` (`0..stages`).
    pub fn host_stage(&self, stage: usize) -> Result<usize, DeviceError> {
        Ok(self.pair()?.host.addr() + self.stage_offset(stage)?)
    }

    /// Device address of stage `stage` (`0..stages`).
    pub fn device_stage(&self, stage: usize) -> Result<u64, DeviceError> {
        Ok(self.pair()?.dev.addr() + self.stage_offset(stage)? as u64)
    }

    /// The device.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.pool.device
    }

    /// Device address of the buffer's slot table, at least `bytes` long: the one kept with
    /// this staging buffer, reused by every batch that leases it; allocated (or replaced by a
    /// larger one, [`SLOT_TABLE_MIN`] bytes at least and doubled past that) only when no
    /// earlier batch on this buffer needed as many bytes. Replacing frees the old table: no
    /// device work uses it, as a buffer is leased only once the work of its last batch ended
    /// (or from quarantine, once that work is known to have ended). What the holder writes
    /// into the table is guarded like its stages: once work that reads it is queued, the
    /// lease is released only after that work, or quarantined with the table.
    pub(crate) fn slot_table(&mut self, bytes: usize) -> Result<u64, DeviceError> {
        let device = self.pool.device.clone();
        let pair = self
            .pair
            .as_mut()
            .ok_or(DeviceError::InvalidStage("the lease was given up"))?;
        if let Some(table) = pair.table.as_ref().filter(|t| t.len() >= bytes) {
            return Ok(table.addr());
        }
        let len = bytes
            .checked_next_power_of_two()
            .unwrap_or(bytes)
            .max(SLOT_TABLE_MIN);
        let table = device.alloc(len, "slot table")?;
        tracing::debug!(bytes = len, "a staging buffer's slot table (re)allocated");
        Ok(pair.table.insert(table).addr())
    }

    /// Leaks the buffer's slot table, never to be freed or reused (a failed copy may still
    /// write it); the next batch on this buffer allocates a fresh one. `why` is logged.
    pub(crate) fn leak_slot_table(&mut self, why: &str) {
        if let Some(table) = self.pair.as_mut().and_then(|p| p.table.take()) {
            tracing::error!(
                why,
                bytes = table.len(),
                "a staging buffer's slot table is leaked: device work may still write it"
            );
            std::mem::forget(table);
        }
    }

    /// What keeps the leased buffer allocated whoever drops the lease: its pool (which frees
    /// a buffer only once it is back on the free list or settled in quarantine, and leaks an
    /// unsettled quarantined one).
    pub(crate) fn owner(&self) -> Arc<dyn Any + Send + Sync> {
        self.pool.clone()
    }

    /// Gives the buffer back to the pool's quarantine instead of its free list: it is leased
    /// again only once every event of `fences` has completed (never, when `fences` is empty),
    /// and `extra` (memory the same work may touch) lives as long.
    pub fn quarantine(self, fences: Vec<SharedEvent>, extra: Vec<DeviceMemory>) {
        self.quarantine_owned(
            "a staging lease's device work".into(),
            fences,
            extra,
            Vec::new(),
        );
    }

    /// [`quarantine`](Self::quarantine) that also keeps `owners` alive as long (what owns
    /// other memory the same work may touch, e.g. the device pool a gather reads).
    /// `work` says what holds it, for the logs and
    /// [`quarantined_work`](StagingPool::quarantined_work).
    pub(crate) fn quarantine_owned(
        self,
        work: String,
        fences: Vec<SharedEvent>,
        extra: Vec<DeviceMemory>,
        owners: Vec<Arc<dyn Any + Send + Sync>>,
    ) {
        let fences = (!fences.is_empty()).then_some(fences);
        self.quarantine_with(work, fences, Vec::new(), extra, owners);
    }

    /// [`quarantine`](Self::quarantine) of a buffer whose stages may also still be lent to
    /// store reads: leased again once every `lent` flag has cleared (each loan dropped) and
    /// every event of `fences` has completed (never, when `fences` is `None`).
    pub(crate) fn quarantine_lent(
        self,
        work: String,
        fences: Option<Vec<SharedEvent>>,
        lent: Vec<Arc<AtomicBool>>,
        extra: Vec<DeviceMemory>,
    ) {
        self.quarantine_with(work, fences, lent, extra, Vec::new());
    }

    fn quarantine_with(
        mut self,
        work: String,
        fences: Option<Vec<SharedEvent>>,
        lent: Vec<Arc<AtomicBool>>,
        extra: Vec<DeviceMemory>,
        owners: Vec<Arc<dyn Any + Send + Sync>>,
    ) {
        if let Some(pair) = self.pair.take() {
            tracing::error!(
                work = %work,
                fences = fences.as_ref().map(Vec::len),
                lent = lent.len(),
                "staging buffer quarantined: device work or a store read may still use it \
                 (fences None: held for good)"
            );
            self.pool.quarantine.lock().push(Quarantined {
                pair,
                work,
                fences,
                lent,
                _extra: extra,
                _owners: owners,
            });
            // A waiter that saw no quarantine sleeps unpolled: it looks again now.
            self.pool.returned.notify_all();
        }
    }
}

impl Drop for StagingLease {
    fn drop(&mut self) {
        if let Some(pair) = self.pair.take() {
            self.pool.free.lock().push(pair);
            self.pool.returned.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::StagingPool;
    use crate::scripted_event::ScriptedEvent as Scripted;
    use crate::{CpuDevice, DeviceError, SharedEvent};

    fn pool_of_one() -> Arc<StagingPool> {
        StagingPool::with_stages(CpuDevice::new(0).unwrap(), 4096, 2, 1).unwrap()
    }

    /// A pool of no buffers is refused at once: every batch failed later as if each buffer
    /// were leased or quarantined.
    #[test]
    fn a_pool_of_no_buffers_is_refused() {
        match StagingPool::with_stages(CpuDevice::new(0).unwrap(), 4096, 2, 0) {
            Err(e @ DeviceError::Unsupported(_)) => assert!(e.to_string().contains("count 0")),
            other => panic!("{:?}", other.map(|p| p.available())),
        }
    }

    #[test]
    fn a_quarantined_buffer_comes_back_once_its_fence_completes() {
        let pool = pool_of_one();
        let fence = Arc::new(Scripted::new(Ok(false)));
        pool.lease()
            .unwrap()
            .quarantine(vec![fence.clone() as SharedEvent], Vec::new());
        assert_eq!((pool.available(), pool.quarantined()), (0, 1));
        fence.answer(Ok(true));
        assert_eq!((pool.available(), pool.quarantined()), (1, 0));
    }

    #[test]
    fn work_on_slots_is_named_by_its_slots_the_first_sixteen_of_a_large_batch() {
        assert_eq!(
            super::slots_work("save gather", &[3, 7]),
            "save gather of pool slots [3, 7]"
        );
        let many: Vec<u32> = (0..40).collect();
        let named = super::slots_work("landing 5", &many);
        assert!(
            named.starts_with("landing 5 of pool slots [0, 1, 2,"),
            "{named}"
        );
        assert!(named.ends_with("14, 15].. (40 slots)"), "{named}");
    }

    #[test]
    fn quarantined_work_lists_what_holds_each_buffer_until_it_settles() {
        let pool = pool_of_one();
        let fence = Arc::new(Scripted::new(Ok(false)));
        let lease = pool.lease().unwrap();
        lease.quarantine_owned(
            super::slots_work("save gather", &[2, 9]),
            vec![fence.clone() as SharedEvent],
            Vec::new(),
            Vec::new(),
        );
        assert_eq!(
            pool.quarantined_work(),
            vec!["save gather of pool slots [2, 9]"]
        );
        fence.answer(Ok(true));
        assert!(pool.quarantined_work().is_empty());
        assert_eq!(pool.available(), 1);
    }

    /// A lease that waits sees a quarantined buffer come back when its fence completes,
    /// though no event wakes it.
    #[test]
    fn a_waiting_lease_takes_a_quarantined_buffer_once_its_fence_completes() {
        let pool = pool_of_one();
        let fence = Arc::new(Scripted::new(Ok(false)));
        pool.lease()
            .unwrap()
            .quarantine(vec![fence.clone() as SharedEvent], Vec::new());
        let t0 = std::time::Instant::now();
        let answer = std::thread::spawn({
            let fence = fence.clone();
            move || {
                std::thread::sleep(std::time::Duration::from_millis(100));
                fence.answer(Ok(true));
            }
        });
        let lease = pool.lease_within(std::time::Duration::from_secs(20));
        answer.join().unwrap();
        assert!(lease.is_ok(), "{:?}", lease.err());
        assert!(t0.elapsed() < std::time::Duration::from_secs(10));
        assert_eq!(pool.quarantined(), 0);
    }

    /// A pool whose every buffer is held for good fails a waiting lease at once: none will
    /// come back, and each batch would otherwise wait the whole lease wait.
    #[test]
    fn a_waiting_lease_fails_at_once_when_every_buffer_is_held_for_good() {
        let pool = pool_of_one();
        pool.lease().unwrap().quarantine(Vec::new(), Vec::new());
        let t0 = std::time::Instant::now();
        assert_eq!((pool.held_for_good(), pool.capacity()), (1, 1));
        let got = pool.lease_within(std::time::Duration::from_secs(20));
        assert!(matches!(got, Err(DeviceError::Alloc { .. })));
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t0.elapsed()
        );
    }

    /// Before, a fence whose query failed counted as completed, and its buffer was leased
    /// again while the device work before the fence might still be writing it.
    #[test]
    fn a_fence_that_fails_to_answer_keeps_its_buffer_quarantined_for_good() {
        let pool = pool_of_one();
        let fence = Arc::new(Scripted::new(Err("context broken".into())));
        pool.lease()
            .unwrap()
            .quarantine(vec![fence.clone() as SharedEvent], Vec::new());
        assert_eq!((pool.available(), pool.quarantined()), (0, 1));
        assert!(matches!(pool.lease(), Err(DeviceError::Alloc { .. })));
        // Unknown stays unknown, whatever the event answers later.
        fence.answer(Ok(true));
        assert_eq!((pool.available(), pool.quarantined()), (0, 1));
    }
}
