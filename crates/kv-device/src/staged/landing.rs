//! The staged landing: one batch's landing into a [`DeviceKvPool`] through a leased staging
//! buffer.

use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::{LayerReady, TransferBytes};
use parking_lot::{Mutex, RwLock};

use super::copy::{self, Moved, RowSpan, ScatterStrategy, Staged};
use super::pool::DeviceKvPool;
use super::staging::{slots_work, StagingLease};
use super::sync;
use crate::landing::{next_landing_id, Fences, StageLent, TransferLog};
use crate::{
    BatchShape, Device, DeviceError, DeviceRegion, DeviceShare, DeviceStage, KvPool, LayerLanding,
    LayerStage, ReadTarget, RowBlock, ShareSide, SharedEvent, SlotClaims, StageLoan, Stream,
    Transfer, WriteClaim,
};

/// Counters of one landing (what it enqueued).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LandingStats {
    /// Layers landed.
    pub layers: u64,
    /// Copy calls enqueued.
    pub copies: u64,
    /// Row-copy launches enqueued.
    pub kernel_launches: u64,
    /// Times `open` found a stage's previous work still running and waited for it.
    pub reuse_waits: u64,
}

/// What work a landing queues on the load stream writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Writes {
    /// The batch's pool slots (a land's or a scatter's copies).
    Slots,
    /// Device staging only (an upload).
    Staging,
}

/// One stage's state.
#[derive(Debug, Default)]
struct StageState {
    fences: Fences,
    /// The event after the share area's upload (what the collective starts after).
    upload: Mutex<Option<SharedEvent>>,
    /// A device stage was handed out since the last upload: a second one would start its
    /// collective after the upload alone, not after the first one's collective and scatter
    /// (their fences came after the upload's event).
    shared: std::sync::atomic::AtomicBool,
    /// Whether the pinned stage is lent to a store read.
    lent: StageLent,
}

/// One batch's landing into a [`DeviceKvPool`] through a leased staging buffer.
///
/// Each of the batch's [`LayerStage`]s is one stage of the lease (a ring of two or more, one
/// layer each: the reader can hold several for a group of layers read in one store call),
/// laid out for the layer open in it as `[share area | own area]`: the share area
/// (`shape.share_len(layer)` bytes) holds the replicated rows as the share layout places them;
/// the own area holds the components this rank reads for itself (`shape.own`), in geometry
/// order, each as one row per plan page in plan order. The pinned stage is what the store
/// writes; the device stage is where the share area travels between ranks and where the own
/// rows wait for the scatter kernel.
///
/// Per layer: [`open`](LayerLanding::open) (waits for the stage's fences), the store writes
/// the [`target`](LayerLanding::target)s and [`share_target`](DeviceShare::share_target)s of
/// the stage's [`lend`](LayerLanding::lend) (nothing below touches a lent stage),
/// [`upload`](DeviceShare::upload) (this rank's part of the share area, one host→device copy),
/// the collective on the [`DeviceStage`], [`scatter`](DeviceShare::scatter) of the shared rows
/// after the collective's event (one launch per [`RowBlock`], or slot runs), and
/// [`land`](LayerLanding::land) (own rows: contiguous slot runs as one copy each, or one copy
/// into device staging and one scatter launch per component), which records the layer's event
/// after everything and returns it. Every event that may still read or write the stage is a
/// fence: the stage is reused (or the lease released) only once all completed. A fence that
/// does not complete in time poisons the stage; the lease is then quarantined, never freed
/// while that work may run; so is the lease of a landing dropped while a stage is lent.
pub struct StagedLanding {
    id: u64,
    pool: Arc<DeviceKvPool>,
    stream: Arc<dyn Stream>,
    lease: Option<StagingLease>,
    slots: Arc<[u32]>,
    /// Device address of the batch's slot table (0: no slots), kept with the lease's staging
    /// buffer ([`StagingLease::slot_table`]), so it lives as long as the lease.
    slot_table: u64,
    strategy: ScatterStrategy,
    shape: BatchShape,
    stages_state: Vec<StageState>,
    stages: Vec<LayerStage>,
    log: TransferLog,
    stats: Mutex<LandingStats>,
    drain: Duration,
    /// Per stage of the ring, the layer open or last landed in it (until the stage is opened
    /// again, which waits for that layer's copies): no two stages hold one layer, so a layer's
    /// ready event covers every copy into its slots.
    open: Mutex<Vec<Option<u32>>>,
    /// The batch's slots, claimed for writing while this landing may queue copies into them:
    /// `None` once it has [finished](LayerLanding::finish), or once a failed
    /// [settle](LayerLanding::settle) moved the claim to the pool's held claims. `land` and `scatter` hold it read
    /// while they queue copies. Copies already queued need no claim: they are on the load
    /// stream, and every later landing's copies and every save's gather
    /// ([`StagedLandingFactory`](super::StagedLandingFactory)) are ordered after them there.
    slot_writes: RwLock<Option<WriteClaim>>,
    /// The events recorded after the copies queued into the slots, poisoned where one could
    /// not be recorded (their end unknown): what [`LayerLanding::settle`] waits for.
    slot_copies: Fences,
    /// Set once a failed settle kept the slots claimed until those copies finish.
    slots_held: AtomicBool,
}

impl std::fmt::Debug for StagedLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagedLanding").finish_non_exhaustive()
    }
}

fn stage_err(reason: &'static str) -> DeviceError {
    DeviceError::InvalidStage(reason)
}

/// The staging's device (`staging`) is the pool's (`pool`): the same ordinal of the same
/// backend (a CPU device's stream cannot copy into a CUDA device's memory, nor one GPU's
/// stream into another's). Two handles of one device pass.
pub(crate) fn same_device(staging: &dyn Device, pool: &dyn Device) -> Result<(), DeviceError> {
    if std::ptr::addr_eq(staging, pool)
        || (staging.ordinal() == pool.ordinal() && staging.name() == pool.name())
    {
        return Ok(());
    }
    tracing::error!(
        staging = %staging.name(),
        staging_ordinal = staging.ordinal(),
        pool = %pool.name(),
        pool_ordinal = pool.ordinal(),
        "staging of another device than the pool's"
    );
    Err(stage_err("staging of another device than the pool's"))
}

impl StagedLanding {
    /// A landing of a batch whose plan page `i` goes to slot `slots[i]` of `pool`, staged in
    /// `lease`, split as `shape`. Checks that every slot is inside the pool and that a
    /// stage holds every layer's share and own areas; uploads the slots for the scatter kernel.
    /// It claims the slots for writing until it [finishes](LayerLanding::finish) or is
    /// dropped (its copies already queued are ordered before any later work on the slots):
    /// refused ([`DeviceError::SlotBusy`]) while a save's gather reads one of them, another
    /// landing writes one, or a slot is named twice.
    pub fn new(
        pool: Arc<DeviceKvPool>,
        lease: StagingLease,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Self, DeviceError> {
        let device = pool.device().clone();
        same_device(&**lease.device(), &*device)?;
        if let Some(&s) = slots.iter().find(|&&s| s >= pool.pages()) {
            return Err(DeviceError::OutOfPool {
                component: u16::MAX,
                layer: u32::MAX,
                slot: s,
                reason: "slot past the pool",
            });
        }
        if let Some(s) = first_repeated(&slots) {
            // The row-copy kernel writes every destination row from its own thread block:
            // a slot named twice would be written by two at once.
            return Err(DeviceError::SlotBusy {
                slot: s,
                reason: "named twice in the batch's slots",
            });
        }
        check_shape(&pool, &shape, slots.len(), lease.stage_bytes())?;
        let claimed: Arc<dyn KvPool> = pool.clone();
        let claim = SlotClaims::write(&claimed, &slots)?;
        let stages_state: Vec<StageState> =
            (0..lease.stages()).map(|_| StageState::default()).collect();
        let (lease, slot_table) = if slots.is_empty() {
            (lease, 0)
        } else {
            upload_slots(&*device, pool.bounce(), lease, &slots, &stages_state[0])?
        };
        let ring = lease.stages();
        let id = next_landing_id();
        let layers = pool.geometry().num_layers();
        Ok(StagedLanding {
            id,
            stream: device.load_stream(),
            pool,
            lease: Some(lease),
            slots,
            slot_table,
            strategy: ScatterStrategy::Auto,
            shape,
            stages_state,
            stages: LayerStage::ring(id, ring),
            log: TransferLog::new(layers),
            stats: Mutex::new(LandingStats::default()),
            drain: Duration::from_secs(30),
            open: Mutex::new(vec![None; ring]),
            slot_writes: RwLock::new(Some(claim)),
            slot_copies: Fences::default(),
            slots_held: AtomicBool::new(false),
        })
    }

    /// Chooses how scattered slots are copied (benchmarks compare them).
    pub fn with_strategy(mut self, strategy: ScatterStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// Longest the landing's release waits for device work still running (then the lease is
    /// quarantined).
    pub fn with_drain_limit(mut self, limit: Duration) -> Self {
        self.drain = limit;
        self
    }

    /// What was enqueued so far.
    pub fn stats(&self) -> LandingStats {
        *self.stats.lock()
    }

    /// The staging lease (host regions, stages).
    pub fn lease(&self) -> Option<&StagingLease> {
        self.lease.as_ref()
    }

    fn lease_ref(&self) -> Result<&StagingLease, DeviceError> {
        self.lease
            .as_ref()
            .ok_or(stage_err("the lease was given up"))
    }

    fn layout(&self, c: ComponentId) -> Result<&ComponentLayout, DeviceError> {
        self.pool
            .geometry()
            .component(c)
            .map_err(|_| stage_err("unknown component"))
    }

    /// Byte offset of own component `component` inside the own area of `layer`.
    fn own_offset(&self, component: ComponentId, layer: u32) -> Result<u64, DeviceError> {
        let mut off = 0u64;
        for c in self.pool.geometry().components() {
            if !self.shape.own.contains(&c.id) || c.position(layer).is_none() {
                continue;
            }
            if c.id == component {
                return Ok(off);
            }
            off += c.page_layer_bytes * self.slots.len() as u64;
        }
        Err(DeviceError::OutOfPool {
            component: component.0,
            layer,
            slot: u32::MAX,
            reason: "not an own component carried on this layer",
        })
    }

    fn span(
        &self,
        component: ComponentId,
        layer: u32,
        first: usize,
        pages: usize,
    ) -> Result<RowSpan, DeviceError> {
        let (pool, _) = self.pool.buffer(component, layer)?;
        Ok(RowSpan {
            first_page: first,
            pages,
            row: self.layout(component)?.page_layer_bytes,
            pool,
            slot_table: self.slot_table,
        })
    }

    fn count(&self, layer: u32, m: Moved) {
        let mut s = self.stats.lock();
        s.copies += m.copies;
        s.kernel_launches += m.launches;
        self.log.add(layer, |t| {
            t.host_to_device += m.host_to_device;
            t.device_to_device += m.device_to_device;
            t.device_to_host += m.device_to_host;
        });
    }

    /// Host address of plan page `plan_page`'s row of own component `component` in stage
    /// `h` (laid out for `layer`), checked to lie in the stage's own area.
    fn own_row(
        &self,
        h: usize,
        layer: u32,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        if plan_page >= self.slots.len() {
            return Err(DeviceError::OutOfPool {
                component: component.0,
                layer,
                slot: u32::MAX,
                reason: "plan page without a slot",
            });
        }
        let row = self.layout(component)?.page_layer_bytes;
        let off = self.shape.share_len(layer) as u64 + self.own_offset(component, layer)?;
        Ok(self.lease_ref()?.host_stage(h)? + (off + plan_page as u64 * row) as usize)
    }

    /// Host address of byte `offset` of stage `h`'s share area (laid out for `layer`), checked
    /// to hold `len` bytes there.
    fn share_row(
        &self,
        h: usize,
        layer: u32,
        offset: usize,
        len: usize,
    ) -> Result<usize, DeviceError> {
        if offset
            .checked_add(len)
            .is_none_or(|e| e > self.shape.share_len(layer))
        {
            return Err(stage_err("a row outside the share area"));
        }
        Ok(self.lease_ref()?.host_stage(h)? + offset)
    }

    /// Stage `h` may take new device work: it is not lent (`lent_what` names the call), and
    /// its earlier work did not fail (`poisoned_what`): nothing lands in the slots behind
    /// device work, such as a collective, whose end is unknown.
    fn workable(
        &self,
        h: usize,
        lent_what: &'static str,
        poisoned_what: &'static str,
    ) -> Result<(), DeviceError> {
        let state = self.state(h)?;
        state.lent.check(lent_what)?;
        if state.fences.is_poisoned() {
            return Err(DeviceError::Poisoned(poisoned_what));
        }
        Ok(())
    }

    /// The state of stage `h` (checked by `LayerStage::index` against this landing).
    fn state(&self, h: usize) -> Result<&StageState, DeviceError> {
        self.stages_state
            .get(h)
            .ok_or(stage_err("a stage past the staging ring"))
    }

    /// Records an event on the load stream as a fence of stage `h`.
    fn fence(&self, h: usize) -> Result<SharedEvent, DeviceError> {
        let state = self.state(h)?;
        let ev = self.stream.record()?;
        state.fences.push(ev.clone());
        Ok(ev)
    }

    /// Runs `enqueue` (work on the load stream that uses stage `h`), then fences the stage
    /// after whatever of it was enqueued, failed or not; a stage whose fence cannot be recorded
    /// is poisoned for good. The fence is returned with `enqueue`'s result. Copies into the
    /// slots ([`Writes::Slots`]) also keep the fence as their end (`slot_copies`), or say
    /// that none tells it.
    fn fenced<T>(
        &self,
        h: usize,
        writes: Writes,
        enqueue: impl FnOnce() -> Result<T, DeviceError>,
    ) -> Result<(T, SharedEvent), DeviceError> {
        // A panic part-way (a backend's copy) leaves what it queued fenced too, then goes on:
        // the stage and the slots' settle wait for it as for a failure's.
        let r = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(enqueue)) {
            Ok(r) => r,
            Err(payload) => {
                let _ = self.fence_after(h, writes);
                std::panic::resume_unwind(payload);
            }
        };
        match self.fence_after(h, writes) {
            Ok(ev) => r.map(|t| (t, ev)),
            Err(e) => Err(r.err().unwrap_or(e)),
        }
    }

    /// [`LayerLanding::settle`] (`idle`: `None`) or [`LayerLanding::settle_unless_stalled`]:
    /// waits up to the drain limit (and, with `idle`, while a copy finished within the last
    /// `idle`) for the copies into the slots; when they have not all finished, keeps the
    /// slots claimed until they do.
    fn settle_idle(&self, idle: Option<Duration>) -> Result<(), DeviceError> {
        self.settle_until(kv_loader::deadline_after(self.drain), idle)
    }

    /// [`settle_idle`](Self::settle_idle) waiting until `deadline` at most. A landing whose
    /// earlier settle timed out answers at once: its copies are known unfinished and its slots
    /// held until they end (a second wait of the whole limit would only delay the outcome).
    fn settle_until(&self, deadline: Instant, idle: Option<Duration>) -> Result<(), DeviceError> {
        if self.slots_held.load(Ordering::Acquire) {
            return Err(DeviceError::Poisoned(crate::EARLIER_SETTLE_TIMED_OUT));
        }
        let (settled, until) = self.wait_slot_copies(deadline, idle);
        if settled.is_err() {
            // The device has not run them within the drain limit: the drop quarantines the
            // lease with its fences at once, rather than wait the limit out again.
            for state in &self.stages_state {
                state.fences.poison();
            }
            // The batch fails and the engine recomputes into the slots: they stay claimed
            // (no later landing or save takes them, `SlotClaims::wait_free` waits) until the
            // copies have finished. The landing's own claim moves there (the linker settles
            // before it finishes); one that went at `finish` already is claimed again, which
            // a save that took the slots meanwhile refuses (logged).
            if !self.slots_held.swap(true, Ordering::AcqRel) {
                let pool: Arc<dyn KvPool> = self.pool.clone();
                let taken = self.slot_writes.write().take();
                let claim = match taken {
                    Some(claim) => Ok(claim),
                    None => SlotClaims::write(&pool, &self.slots),
                };
                match claim {
                    Ok(claim) => claim.hold_until(until),
                    Err(e) => tracing::error!(landing = self.id, error = %e,
                        "the slots of copies that did not finish could not be kept claimed"),
                }
            }
        }
        settled
    }

    /// Waits until `deadline` (and, with `idle`, while one finished within the last `idle`)
    /// for the copies this landing queued into the slots (only
    /// those: a collective still running writes device staging alone, and a scatter is
    /// queued only once its collective is known complete). The wait's result, and the events
    /// that tell when the copies end (`None` when nothing can). A copy whose fence could not
    /// be recorded is told by a fresh event on the load stream, which runs in order: it
    /// completes once every copy queued before it has (before, such slots were held for
    /// good, until the engine's `unsafe` release).
    fn wait_slot_copies(
        &self,
        deadline: Instant,
        idle: Option<Duration>,
    ) -> (Result<(), DeviceError>, Option<Vec<SharedEvent>>) {
        const WHAT: &str = "the batch's copies into its slots";
        if !self.slot_copies.is_unfenced() {
            return (
                self.slot_copies.drain_while(deadline, idle, WHAT),
                self.slot_copies.known(),
            );
        }
        let ev = match self.stream.record() {
            Ok(ev) => ev,
            Err(e) => return (Err(e), None),
        };
        // The fences that were recorded show progress (with `idle`); the fresh one last.
        let mut events = self.slot_copies.recorded();
        events.push(ev.clone());
        match crate::landing::wait_in_order(&events, deadline, idle, WHAT) {
            Ok(()) => (Ok(()), Some(Vec::new())),
            Err(e @ DeviceError::Timeout { .. }) => (Err(e), Some(vec![ev])),
            Err(e) => (Err(e), None),
        }
    }

    /// Fences stage `h` after the work just queued (and the slots' copies, for
    /// [`Writes::Slots`]), or poisons them where no fence can be recorded.
    fn fence_after(&self, h: usize, writes: Writes) -> Result<SharedEvent, DeviceError> {
        match self.fence(h) {
            Ok(ev) => {
                if writes == Writes::Slots {
                    self.slot_copies.push(ev.clone());
                }
                Ok(ev)
            }
            Err(e) => {
                if let Ok(state) = self.state(h) {
                    state.fences.poison_unfenced();
                }
                if writes == Writes::Slots {
                    self.slot_copies.poison_unfenced();
                }
                Err(e)
            }
        }
    }
}

/// The batch's slot table in device memory (one `u32` per plan page, for the row-copy
/// kernel), written into the table kept with the lease's staging buffer (no allocation once
/// a batch as large ran on it) and uploaded without blocking: the bytes go through the pinned
/// stage 0 (free: a fresh lease has no work in flight), and the upload fences that stage, so
/// the reader's first use of it waits for the copy. A table larger than a stage is written
/// synchronously instead (its table is leaked when that write fails: the copy may still write
/// it). When the copy is queued but cannot be fenced, the lease is quarantined for good with
/// its table (the copy may still read stage 0 and write the table): neither is freed or
/// reused.
fn upload_slots(
    device: &dyn crate::Device,
    bounce: &super::sync::Bounce,
    mut lease: StagingLease,
    slots: &[u32],
    stage0: &StageState,
) -> Result<(StagingLease, u64), DeviceError> {
    let bytes: Vec<u8> = slots.iter().flat_map(|s| s.to_le_bytes()).collect();
    if bytes.len() > lease.stage_bytes() {
        // While a copy of the pool is stuck this fails at once, before any table is had.
        bounce.settle()?;
        let table = lease.slot_table(bytes.len())?;
        // SAFETY: `table` is the lease's slot table, at least `bytes.len()` bytes, used by no
        // device work (a fresh lease); where a failed copy may still run it is leaked.
        return match unsafe { sync::write(device, bounce, table, &bytes) } {
            Ok(()) => Ok((lease, table)),
            Err(e) => {
                if bounce.may_still_run() {
                    lease.leak_slot_table("a slot table's synchronous upload did not finish");
                }
                Err(e)
            }
        };
    }
    let table = lease.slot_table(bytes.len())?;
    let host = lease.host_stage(0)?;
    // SAFETY: stage 0 of a fresh lease is ours and idle (no fence pending), and holds at least
    // `bytes.len()` bytes (checked above).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), host as *mut u8, bytes.len()) };
    let stream = device.load_stream();
    let t = Transfer::ToDevice {
        dst: table,
        src: host,
        len: bytes.len(),
    };
    // SAFETY: source in the pinned stage 0, destination the lease's table; once queued, stage
    // 0 is fenced by the event recorded below (nothing writes it before that completes) and
    // the table, kept with the staging buffer, is reused or freed only once the landing's
    // fences drained; where no event can be recorded, both are quarantined for good (below).
    // Not queued (an error here): nothing runs.
    unsafe { stream.transfer(t)? };
    match stream.record() {
        Ok(ev) => {
            stage0.fences.push(ev);
            Ok((lease, table))
        }
        Err(e) => {
            tracing::error!(error = %e, "slot table copy queued but not fenced: its staging and table are kept for good");
            let work = slots_work("slot table upload", slots);
            lease.quarantine_owned(work, Vec::new(), Vec::new(), Vec::new());
            Err(e)
        }
    }
}

/// Checks a batch's shape against the pool and the stage size.
pub(crate) fn check_shape(
    pool: &DeviceKvPool,
    shape: &BatchShape,
    pages: usize,
    stage_bytes: usize,
) -> Result<(), DeviceError> {
    let g = pool.geometry();
    for &c in shape.own.iter().chain(&shape.shared) {
        let layout = g
            .component(c)
            .map_err(|_| stage_err("unknown component in the shape"))?;
        if shape.shared.contains(&c) && (shape.own.contains(&c) || !layout.replicated) {
            return Err(stage_err(
                "a shared component must be replicated and not own",
            ));
        }
    }
    if !shape.share_bytes.is_empty() && shape.share_bytes.len() != g.num_layers() as usize {
        return Err(stage_err("share_bytes must name every layer"));
    }
    // Checked arithmetic throughout: the shape's fields are the caller's, and a sum that
    // wrapped would pass this check and let rows be placed past the stage.
    let too_large = || stage_err("the batch's layer bytes overflow");
    for l in 0..g.num_layers() {
        let mut need = 0u64;
        for c in g
            .components()
            .iter()
            .filter(|c| shape.own.contains(&c.id) && c.position(l).is_some())
        {
            let bytes = c
                .page_layer_bytes
                .checked_mul(pages as u64)
                .ok_or_else(too_large)?;
            need = need.checked_add(bytes).ok_or_else(too_large)?;
        }
        need = need
            .checked_add(shape.share_len(l) as u64)
            .ok_or_else(too_large)?;
        if need > stage_bytes as u64 {
            return Err(DeviceError::StageTooSmall {
                layer: l,
                need,
                stage: stage_bytes as u64,
            });
        }
    }
    Ok(())
}

impl LayerLanding for StagedLanding {
    fn take_stages(&mut self) -> Vec<LayerStage> {
        std::mem::take(&mut self.stages)
    }

    fn open(
        &self,
        stage: &mut LayerStage,
        layer: u32,
        deadline: Instant,
    ) -> Result<(), DeviceError> {
        let h = stage.index(self.id)?;
        if layer >= self.pool.geometry().num_layers() {
            return Err(stage_err("layer past the model"));
        }
        let state = self.state(h)?;
        state.lent.check("reopening a stage")?;
        // A fence that cannot be asked is the drain's to report (it poisons the stage).
        if state.fences.busy().unwrap_or(true) {
            self.stats.lock().reuse_waits += 1;
        }
        state.fences.drain(deadline, "staging stage reuse")?;
        let mut open = self.open.lock();
        if open
            .iter()
            .enumerate()
            .any(|(other, l)| other != h && *l == Some(layer))
        {
            return Err(stage_err("the layer is open in another stage"));
        }
        if let Some(entry) = open.get_mut(h) {
            *entry = Some(layer);
        }
        drop(open);
        *state.upload.lock() = None;
        state
            .shared
            .store(false, std::sync::atomic::Ordering::Release);
        stage.set_layer(Some(layer));
        Ok(())
    }

    fn lend(&self, stage: &mut LayerStage) -> Result<StageLoan, DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        let owner = self.lease_ref()?.owner();
        let state = self.state(h)?;
        // Device work queued since the stage was opened (an upload, a land) may still read the
        // pinned stage: a store must not write it until `open` has waited for that work.
        if state.fences.is_poisoned() {
            return Err(DeviceError::Poisoned(
                "lending a stage whose device work failed",
            ));
        }
        if state.fences.busy()? {
            return Err(stage_err(
                "lending a stage with device work queued since it was opened (open it again)",
            ));
        }
        let lent = state.lent.lend()?;
        // The loan may write the share area anew: an earlier upload no longer holds what the
        // pinned stage will, so sharing or scattering the device area waits for the next one.
        *state.upload.lock() = None;
        state
            .shared
            .store(false, std::sync::atomic::Ordering::Release);
        // SAFETY: the loan's targets lie in stage `h` of the pinned buffer (`target` and
        // `share_target` check them), which the staging pool (`owner`) keeps allocated; while
        // `lent` is set this landing touches none of it (`open`, `target_bytes`,
        // `share_bytes`, `upload` and `land` check it), lends it to no one else, and its drop
        // quarantines the lease until the loan has dropped rather than hand it to another
        // batch.
        Ok(unsafe { StageLoan::new(self.id, h, layer, lent, owner) })
    }

    fn target(
        &self,
        loan: &StageLoan,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError> {
        let (h, layer) = loan.stage_of(self.id)?;
        let addr = self.own_row(h, layer, component, plan_page)?;
        let len = self.layout(component)?.page_layer_bytes as usize;
        // SAFETY: a row of the lent stage's own area (checked by `own_row`).
        Ok(unsafe { loan.target(addr, len) })
    }

    fn target_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<&'s [u8], DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.state(h)?.lent.check("reading a stage's bytes")?;
        let addr = self.own_row(h, layer, component, plan_page)?;
        let len = self.layout(component)?.page_layer_bytes as usize;
        // SAFETY: `own_row` checked that the row lies in this stage's own area of the pinned
        // half (sizes checked in `new`), which the lease `self` holds keeps allocated for 's;
        // the stage is not lent (checked above: no store call may still write it, and what the
        // last one wrote is visible) and is borrowed for 's, so it cannot be lent meanwhile
        // (lending needs it exclusively); only the store writes pinned staging.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    fn land(&self, stage: &mut LayerStage) -> Result<LayerReady, DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.workable(
            h,
            "landing a stage",
            "landing a stage whose device work failed",
        )?;
        if self.slots.is_empty() {
            stage.set_layer(None);
            return Ok(LayerReady::Resident);
        }
        // Checked before the stage lets go of its layer: a refused land leaves the stage as it
        // was, so a second try gives the same reason.
        let lease = self.lease_ref()?;
        let base = self.shape.share_len(layer) as u64;
        let writes = self.slot_writes.read();
        if writes.is_none() {
            return Err(stage_err("landing a layer after the landing finished"));
        }
        // The layer stays this stage's until the stage is opened again, which first waits for
        // the copies queued here: only then may another stage take the layer.
        stage.set_layer(None);
        let ((), ev) = self.fenced(h, Writes::Slots, || {
            for c in self.pool.geometry().components() {
                if !self.shape.own.contains(&c.id) || c.position(layer).is_none() {
                    continue;
                }
                let off = base + self.own_offset(c.id, layer)?;
                let span = self.span(c.id, layer, 0, self.slots.len())?;
                let from = Staged::Host {
                    host: lease.host_stage(h)? + off as usize,
                    dev: lease.device_stage(h)? + off,
                };
                // SAFETY: the rows lie in this stage's own area (sizes checked in `new`), the
                // slots in the pool (checked in `new`); the stage is reused and the lease
                // released only after the fence recorded after this (`fenced`), and the pool
                // outlives the landing (its drop drains the load stream).
                let m =
                    unsafe { copy::scatter(&self.stream, self.strategy, &self.slots, span, from) }?;
                self.count(layer, m);
            }
            Ok(())
        })?;
        self.stats.lock().layers += 1;
        Ok(LayerReady::Event(ev))
    }

    /// Queues no more copies into the slots (`land` and `scatter` are refused from now on)
    /// and lets the slots' claim go: the loans of a store read past its deadline may keep
    /// this landing (and its staging) alive, but they write only the staging, and what was
    /// queued is ordered before any later landing's copies or save's gather.
    fn finish(&self) {
        drop(self.slot_writes.write().take());
    }

    fn settle(&self) -> Result<(), DeviceError> {
        self.settle_idle(None)
    }

    fn settle_unless_stalled(&self, idle: Duration) -> Result<(), DeviceError> {
        self.settle_idle(Some(idle))
    }

    fn settle_by(&self, deadline: Instant) -> Result<(), DeviceError> {
        self.settle_until(deadline.min(kv_loader::deadline_after(self.drain)), None)
    }

    fn poison(&self, stage: &mut LayerStage) {
        if let Some(state) = stage.index(self.id).ok().and_then(|h| self.state(h).ok()) {
            state.fences.poison();
        }
    }

    fn transfers(&self) -> Vec<TransferBytes> {
        self.log.all()
    }

    fn share(&self) -> ShareSide<'_> {
        ShareSide::Device(self)
    }
}

impl DeviceShare for StagedLanding {
    fn share_target(
        &self,
        loan: &StageLoan,
        offset: usize,
        len: usize,
    ) -> Result<ReadTarget, DeviceError> {
        let (h, layer) = loan.stage_of(self.id)?;
        let addr = self.share_row(h, layer, offset, len)?;
        // SAFETY: a range of the lent stage's share area (checked by `share_row`).
        Ok(unsafe { loan.target(addr, len) })
    }

    fn share_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        offset: usize,
        len: usize,
    ) -> Result<&'s [u8], DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.state(h)?.lent.check("reading a stage's bytes")?;
        let addr = self.share_row(h, layer, offset, len)?;
        // SAFETY: `share_row` checked that the range lies in this stage's share area of the
        // pinned half, kept allocated by the lease for 's; the stage is not lent (checked
        // above) and is borrowed for 's, so it cannot be lent meanwhile; the collectives move
        // device staging, not the pinned half.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    fn upload(&self, stage: &mut LayerStage, range: Range<usize>) -> Result<(), DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.workable(
            h,
            "uploading a stage",
            "uploading a stage whose device work failed",
        )?;
        if range.start > range.end || range.end > self.shape.share_len(layer) {
            return Err(stage_err("an upload outside the share area"));
        }
        // A failed upload leaves none: the stage is not shared on an earlier upload's event.
        *self.state(h)?.upload.lock() = None;
        let lease = self.lease_ref()?;
        let ((), ev) = self.fenced(h, Writes::Staging, || {
            // After every earlier use of the stage's device area: a collective a caller ran
            // on it since the layer's last upload (its fences) must not meet this copy, nor
            // (an empty upload's event included) a collective that starts after it.
            self.state(h)?.fences.order_after(self.stream.as_ref())?;
            if range.is_empty() {
                return Ok(());
            }
            let t = Transfer::ToDevice {
                dst: lease.device_stage(h)? + range.start as u64,
                src: lease.host_stage(h)? + range.start,
                len: range.len(),
            };
            // SAFETY: both ranges lie in this stage (share area checked above, stages sized in
            // `new`); the reader finished writing it; the stage is reused only after the fence
            // recorded after this (`fenced`).
            unsafe { self.stream.transfer(t)? };
            self.count(
                layer,
                Moved {
                    copies: 1,
                    host_to_device: range.len() as u64,
                    ..Moved::default()
                },
            );
            Ok(())
        })?;
        let state = self.state(h)?;
        *state.upload.lock() = Some(ev);
        state
            .shared
            .store(false, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    fn device_stage<'s>(
        &'s self,
        stage: &'s mut LayerStage,
    ) -> Result<DeviceStage<'s>, DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.workable(
            h,
            "sharing a stage's device area",
            "sharing a stage whose device work failed",
        )?;
        let region = DeviceRegion {
            ordinal: self.pool.device().ordinal(),
            addr: self.lease_ref()?.device_stage(h)?,
            len: self.shape.share_len(layer),
        };
        let state = self.state(h)?;
        // Device staging holds this layer's share area only after its upload: without one
        // (never made, or failed), a collective would share what an earlier layer left.
        let Some(after) = state.upload.lock().clone() else {
            return Err(stage_err(
                "sharing a stage's device area with no upload of its layer (none made, or it failed)",
            ));
        };
        // One device stage per upload: its collective and scatter are fenced after the
        // upload's event, which a second one would start after alone.
        if state.shared.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Err(stage_err(
                "sharing a stage's device area twice after one upload (upload again first)",
            ));
        }
        let after = Some(after);
        // SAFETY: the region is the share area of this stage's device memory (sized in `new`),
        // owned by the lease, which is released only after every fence of the stage completed
        // (Drop drains them, or quarantines the lease with them); `stage` is borrowed
        // exclusively, so no other operation of this batch uses the stage meanwhile.
        Ok(unsafe { DeviceStage::new(region, after, layer, &state.fences, &self.log, stage) })
    }

    fn scatter(
        &self,
        stage: &mut LayerStage,
        blocks: &[RowBlock],
        after: &SharedEvent,
    ) -> Result<(), DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.workable(
            h,
            "scattering a stage",
            "scattering a stage whose device work failed (its collective may not have ended)",
        )?;
        let dev = self.lease_ref()?.device_stage(h)?;
        let share = self.shape.share_len(layer) as u64;
        // Every block is checked before anything is queued: a wait for `after` (which may
        // never end) or half of the copies must not stay on the load stream for a call that
        // fails.
        let mut copies = Vec::with_capacity(blocks.len());
        for b in blocks {
            let c = self.layout(b.component)?;
            if !self.shape.shared.contains(&b.component) || c.position(layer).is_none() {
                return Err(stage_err(
                    "a row block of a component not shared on this layer",
                ));
            }
            if b.first_page
                .checked_add(b.pages)
                .is_none_or(|e| e > self.slots.len())
            {
                return Err(stage_err("a row block past the plan"));
            }
            // Checked: a block's fields are caller input, and a sum that wrapped would pass
            // the bound and point the copy before the staging buffer.
            let end = u64::try_from(b.offset).ok().and_then(|o| {
                (b.pages as u64)
                    .checked_mul(c.page_layer_bytes)
                    .and_then(|n| o.checked_add(n))
            });
            if end.is_none_or(|e| e > share) {
                return Err(stage_err("a row block outside the share area"));
            }
            let span = self.span(b.component, layer, b.first_page, b.pages)?;
            copies.push((span, Staged::Device(dev + b.offset as u64)));
        }
        let writes = self.slot_writes.read();
        if writes.is_none() {
            return Err(stage_err("scattering a layer after the landing finished"));
        }
        // As for `device_stage`: without an upload of this layer (none made, or it failed),
        // the share area holds what an earlier layer or batch left there, and a scatter
        // would land those bytes in this layer's slots.
        if self.state(h)?.upload.lock().is_none() {
            return Err(stage_err(
                "scattering a stage with no upload of its layer (none made, or it failed)",
            ));
        }
        self.fenced(h, Writes::Slots, || {
            // The caller's event, and every fence of the stage (its collective's, whatever
            // event the caller named).
            self.stream.wait(after)?;
            self.state(h)?.fences.order_after(self.stream.as_ref())?;
            for (span, from) in copies {
                // SAFETY: the block's rows lie in the device share area (checked above), its
                // slots in the pool; the load stream waits for the collective first; the stage
                // is reused only after the fence recorded after this (`fenced`).
                let m =
                    unsafe { copy::scatter(&self.stream, self.strategy, &self.slots, span, from) }?;
                self.count(layer, m);
            }
            Ok(())
        })
        .map(|_| ())
    }
}

/// The first slot of `slots` that is named more than once (in sorted order), if any.
fn first_repeated(slots: &[u32]) -> Option<u32> {
    let mut sorted = slots.to_vec();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}

impl Drop for StagedLanding {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else {
            return;
        };
        let deadline = kv_loader::deadline_after(self.drain);
        let lent = self.stages_state.iter().any(|h| h.lent.is_lent());
        if !lent {
            let poisoned = self.stages_state.iter().any(|h| h.fences.is_poisoned());
            let drained = !poisoned
                && self
                    .stages_state
                    .iter()
                    .all(|h| h.fences.drain(deadline, "staging release").is_ok());
            if drained {
                return;
            }
        }
        // A store read may still write the pinned buffer (its loan keeps the staging pool
        // alive), or device work has not finished: the buffer goes to another batch only once
        // every loan has dropped (the read returned) and the work its fences tell the end of
        // has finished; never, where some work has no fence here (`None`).
        let flags = self.stages_state.iter().map(|h| h.lent.flag()).collect();
        let mut fences = self.released_fences();
        if !lent {
            // A drain failed with no fence left to wait for: nothing will say it is done.
            fences = fences.filter(|f| !f.is_empty());
        }
        let work = slots_work(&format!("landing {}", self.id), &self.slots);
        lease.quarantine_lent(work, fences, flags, Vec::new());
    }
}

impl StagedLanding {
    /// Every stage's fences, taken; `None` when some stage's work has no fence here (its end
    /// is unknown). A stage poisoned by a fence that did not complete in time keeps that
    /// fence: the buffer waits for it, lent or not.
    fn released_fences(&self) -> Option<Vec<SharedEvent>> {
        let unfenced = self.stages_state.iter().any(|h| h.fences.is_unfenced());
        let fences: Vec<SharedEvent> = self
            .stages_state
            .iter()
            .flat_map(|h| h.fences.take())
            .collect();
        (!unfenced).then_some(fences)
    }
}
