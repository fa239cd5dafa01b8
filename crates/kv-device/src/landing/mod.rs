//! Landing: where a batch's layer reads go, how shared rows move between ranks' memory, and
//! how a layer becomes resident.
//!
//! A [`LandingFactory`] makes one [`LayerLanding`] per batch. The linker drives it through
//! a ring of [`LayerStage`] tokens (two or more, one layer each) that circulate between its
//! reader thread and its exchange loop: the reader [`open`](LayerLanding::open)s a stage for
//! each layer of the group it reads next (which waits, bounded, until the work that last used
//! the stage has finished), [`lend`](LayerLanding::lend)s each stage to the store call as a
//! typed [`StageLoan`] whose [`ReadTarget`]s the store writes, a group of layers in one store
//! call (the stage is the landing's again once the call has returned and dropped the loan);
//! the exchange loop then shares each layer's replicated rows with the other ranks,
//! [`land`](LayerLanding::land)s it, and hands the stage back for a later layer.
//!
//! Two ways of sharing, one per backend ([`ShareSide`]):
//! - **host** ([`DirectLanding`] over a host pool): every row is read straight into a pool
//!   slot; the collective moves [`HostRows`] (pool slots) between ranks.
//! - **device** (the staged landing over a device pool): rows are read into pinned staging, one
//!   stage of the ring per layer, laid out as `[share area | own area]`; this rank's part of the share area
//!   is uploaded to device staging, the collective moves the [`DeviceStage`] (device staging)
//!   between ranks on a comm stream, and the rows are scattered from there into this rank's
//!   slots on the load stream, ordered by events.

mod direct;
mod handles;
mod loan;

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_geometry::ComponentId;
use kv_loader::{LayerReady, TransferBytes};

use crate::{DeviceError, SharedEvent};

pub use direct::{DirectLanding, DirectLandingFactory};
pub(crate) use handles::{wait_in_order, Fences, TransferLog};
pub use handles::{DeviceStage, HostRows};
pub(crate) use loan::StageLent;
pub use loan::{first_overlap, ReadTarget, StageLoan};

/// Which memory a landing's shared rows move through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SharePath {
    /// Host memory: pool slots of a host pool.
    Host,
    /// Device memory: device staging of a device pool.
    Device,
}

/// How one batch's components split on this rank: those it reads for itself, and the
/// replicated ones the ranks share, with the size of each layer's share area.
///
/// ```
/// use kv_device::BatchShape;
/// use kv_geometry::ComponentId;
/// let s = BatchShape::own_only(vec![ComponentId(0)]);
/// assert_eq!(s.share_len(3), 0);
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchShape {
    /// Components this rank reads for itself (sharded ones; every one when nothing is shared).
    pub own: Vec<ComponentId>,
    /// Replicated components shared among the ranks in this batch.
    pub shared: Vec<ComponentId>,
    /// Per model layer, bytes of the share area: where the layer's shared rows sit while they
    /// travel between ranks (the share layout's length; 0 where nothing is shared).
    pub share_bytes: Vec<usize>,
}

impl BatchShape {
    /// Nothing shared: `own` is every planned component.
    pub fn own_only(own: Vec<ComponentId>) -> Self {
        BatchShape {
            own,
            shared: Vec::new(),
            share_bytes: Vec::new(),
        }
    }

    /// Bytes of layer `layer`'s share area.
    pub fn share_len(&self, layer: u32) -> usize {
        self.share_bytes.get(layer as usize).copied().unwrap_or(0)
    }

    /// True when `c` is planned in this batch (own or shared).
    pub fn plans(&self, c: ComponentId) -> bool {
        self.own.contains(&c) || self.shared.contains(&c)
    }
}

/// Rows of one component, staged contiguously, that go to consecutive plan pages:
/// row `i` of the block (at `offset + i * page_layer_bytes` of the share area) is plan page
/// `first_page + i`. One block is one scatter (one kernel launch on a GPU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RowBlock {
    /// The component.
    pub component: ComponentId,
    /// Its first plan page.
    pub first_page: usize,
    /// Rows (plan pages).
    pub pages: usize,
    /// Byte offset of its first row in the share area.
    pub offset: usize,
}

/// One stage of a batch's staging ring (one layer at a time), held by whoever works on its
/// layer now: the reader while it fills it, the exchange loop while it shares and lands it.
/// Only landings make them ([`LayerLanding::take_stages`]); it cannot be copied, so holding
/// `&mut` to it means no one else works on that stage.
#[derive(Debug)]
pub struct LayerStage {
    landing: u64,
    index: usize,
    layer: Option<u32>,
}

impl LayerStage {
    /// The layer open in it, if any.
    pub fn layer(&self) -> Option<u32> {
        self.layer
    }

    /// A ring of `n` stages of one landing.
    pub(crate) fn ring(landing: u64, n: usize) -> Vec<LayerStage> {
        (0..n)
            .map(|index| LayerStage {
                landing,
                index,
                layer: None,
            })
            .collect()
    }

    /// The stage of the ring it names, checked against the landing it is used with.
    pub(crate) fn index(&self, landing: u64) -> Result<usize, DeviceError> {
        if self.landing != landing {
            return Err(DeviceError::InvalidStage(
                "a stage of another batch's landing",
            ));
        }
        Ok(self.index)
    }

    /// The open layer, checked against the landing.
    pub(crate) fn open_layer(&self, landing: u64) -> Result<(usize, u32), DeviceError> {
        let index = self.index(landing)?;
        let layer = self
            .layer
            .ok_or(DeviceError::InvalidStage("no layer is open in this stage"))?;
        Ok((index, layer))
    }

    pub(crate) fn set_layer(&mut self, layer: Option<u32>) {
        self.layer = layer;
    }
}

/// A fresh landing id (what ties stages to their landing).
pub(crate) fn next_landing_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// What a landing's settle answers, as [`DeviceError::Poisoned`], once an earlier settle of
/// it timed out: its copies into the slots are known unfinished (the slots stay claimed until
/// they end), so it answers at once rather than wait its limit again. A caller that already
/// reported that timeout can tell this answer from a new failure.
pub const EARLIER_SETTLE_TIMED_OUT: &str = "an earlier settle of this landing timed out: its \
     copies into the slots may still run (the slots stay claimed until they end)";

/// One batch's landing on one rank: it lends the batch's ring of [`LayerStage`]s, hands out
/// targets for the store, shares rows ([`ShareSide`]) and lands layers.
pub trait LayerLanding: Send + Sync {
    /// The batch's stages (two or more: a reader holding `k` of them at once reads a group of
    /// `k` layers in one store call while the exchange loop lands the layer before); empty
    /// after the first call.
    fn take_stages(&mut self) -> Vec<LayerStage>;

    /// Makes `stage` hold `layer`: waits until the device work that used the stage before
    /// has finished, at most until `deadline` ([`DeviceError::Timeout`], and the stage is
    /// poisoned: never reused).
    fn open(
        &self,
        stage: &mut LayerStage,
        layer: u32,
        deadline: Instant,
    ) -> Result<(), DeviceError>;

    /// Lends the stage's memory (the layer open in it) to one store read: a typed loan that
    /// keeps the memory allocated and the stage the call's alone until it drops (see
    /// [`StageLoan`]). A stage already lent, or with no layer open, is refused. A loan may
    /// write the share area anew, so a landing that shares device staging forgets the stage's
    /// earlier upload: its device area is shared or scattered only after the next
    /// [`upload`](DeviceShare::upload).
    fn lend(&self, stage: &mut LayerStage) -> Result<StageLoan, DeviceError>;

    /// Where the store writes plan page `plan_page`'s slice of `component` at the loan's
    /// layer: a pool slot (host pools; also for shared components, whose rows the host
    /// collective then moves slot to slot), or the stage's own area (device pools; own
    /// components only). A typed target of `loan`, `page_layer_bytes` long.
    fn target(
        &self,
        loan: &StageLoan,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError>;

    /// The bytes of [`target`](Self::target)`(loan, component, plan_page)` for the layer open
    /// in `stage`, as the store left them: what a load verifies before it shares or lands
    /// them. Refused while the stage is lent ([`DeviceError::Lent`]: a store call may still
    /// write them). The stage stays borrowed while they are, so nothing of this batch writes
    /// them meanwhile (lending needs the stage exclusively, a collective too, and the engine
    /// leaves the slots of a batch in flight alone).
    fn target_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<&'s [u8], DeviceError>;

    /// Every read of the stage's layer has returned and its shared rows are in: make the layer
    /// resident (or enqueue that) and say how the engine waits for it.
    fn land(&self, stage: &mut LayerStage) -> Result<LayerReady, DeviceError>;

    /// Device work on the stage may never finish (a wait on it timed out): never reuse it, and
    /// never free its memory while that work may still touch it.
    fn poison(&self, stage: &mut LayerStage);

    /// The batch lands no more layers (its load ended, loaded or failed): later
    /// [`land`](Self::land) calls may be refused. A landing whose slots only its own device
    /// copies write (queued on one stream, before any later landing's or save's work on those
    /// slots) lets the slots' claim go now, though store reads past their deadline may keep
    /// it alive. The default does nothing: a landing the store writes through keeps its slots
    /// until it and every loan of it are dropped.
    fn finish(&self) {}

    /// Waits, bounded by the landing's own limit, until the device copies it queued into
    /// the slots (land and scatter) have finished: what a failed batch needs before its
    /// outcome tells the engine to recompute into those slots on a stream of its own, which
    /// nothing orders after this landing's copies. A read past its deadline may keep the
    /// landing (and so this work's end) from the drain its drop does. Called once no more
    /// `land` or `scatter` comes (copies queued later would not be waited for), best before
    /// [`finish`](Self::finish) lets the slots' claim go. `Err` when they did not finish in
    /// time: the slots may still be written, and a staged landing keeps them claimed until
    /// they have ([`WriteClaim::hold_until`](crate::WriteClaim::hold_until):
    /// no later landing or save takes them, [`SlotClaims::wait_free`](crate::SlotClaims::wait_free)
    /// waits for them). The default has nothing queued: a landing the store writes through is
    /// waited for by the batch's outcome instead.
    fn settle(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    /// [`settle`](Self::settle), but giving up once no copy has finished for `idle`: for a
    /// batch that failed on the device already, whose copies may have stalled with it. A
    /// device that keeps finishing them (busy, not stalled) is waited for as `settle` waits;
    /// one that stopped costs `idle`, not the drain limit, before the engine hears of the
    /// failure (the slots stay claimed as after any settle that timed out). The window
    /// starts at the call: work queued on the same stream before this landing's copies
    /// (another batch's, a save's) counts against it. The default is `settle` (a landing
    /// with nothing queued does not wait).
    fn settle_unless_stalled(&self, idle: Duration) -> Result<(), DeviceError> {
        let _ = idle;
        self.settle()
    }

    /// [`settle`](Self::settle), waiting until `deadline` at most (and never past the
    /// landing's own limit): for a rank whose peers wait for its next word within their own
    /// bound. The default is `settle` (for a landing with nothing queued); a wrapper should
    /// forward it.
    fn settle_by(&self, deadline: std::time::Instant) -> Result<(), DeviceError> {
        let _ = deadline;
        self.settle()
    }

    /// Bytes moved so far, per model layer, by direction.
    fn transfers(&self) -> Vec<TransferBytes>;

    /// How this landing shares rows with other ranks.
    fn share(&self) -> ShareSide<'_>;
}

/// The share operations of a landing, by the memory they move.
pub enum ShareSide<'a> {
    /// Rows of pool slots in host memory.
    Host(&'a dyn HostShare),
    /// Staging in device memory.
    Device(&'a dyn DeviceShare),
}

impl std::fmt::Debug for ShareSide<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShareSide").finish_non_exhaustive()
    }
}

/// Sharing through host memory.
pub trait HostShare: Send + Sync {
    /// The pool slots of `blocks` (in order, every page of each) at the stage's layer, for a
    /// host collective to move.
    fn rows<'s>(
        &'s self,
        stage: &'s mut LayerStage,
        blocks: &[RowBlock],
    ) -> Result<HostRows<'s>, DeviceError>;
}

/// Sharing through device memory: the stage's share area, `[0, share_len)` of its stage.
pub trait DeviceShare: Send + Sync {
    /// Byte `offset` of the share area (pinned staging) of the loan's stage, for `len` bytes:
    /// where the store writes a shared row this rank reads. A typed target of `loan`.
    fn share_target(
        &self,
        loan: &StageLoan,
        offset: usize,
        len: usize,
    ) -> Result<ReadTarget, DeviceError>;

    /// The bytes of [`share_target`](Self::share_target)`(loan, offset, len)` for the layer
    /// open in `stage` (pinned staging), as the store left them, for a load to verify before
    /// it uploads or shares them (refused while the stage is lent; borrowed with the stage, as
    /// [`LayerLanding::target_bytes`]).
    fn share_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        offset: usize,
        len: usize,
    ) -> Result<&'s [u8], DeviceError>;

    /// Enqueues on the load stream one host→device copy of `range` of the share area (this
    /// rank's part; may be empty), and records the event the collective starts after.
    ///
    /// The copy is ordered on the device after the stage's earlier work, an earlier
    /// collective's event included, with no bound: as for [`scatter`](Self::scatter), wait for
    /// a collective's event on the host first (with a deadline) before uploading again to its
    /// stage.
    fn upload(&self, stage: &mut LayerStage, range: Range<usize>) -> Result<(), DeviceError>;

    /// The share area in device memory, for a collective, ordered after this layer's
    /// [`upload`](Self::upload). Refused (`InvalidStage`) when the layer open in `stage` has
    /// no upload that succeeded: device staging would still hold an earlier layer's bytes;
    /// and when a device stage was already handed out since that upload: one per upload, as
    /// its collective starts after the upload's event only (upload again, even an empty
    /// range, for another: the new upload is ordered after the stage's earlier work).
    fn device_stage<'s>(
        &'s self,
        stage: &'s mut LayerStage,
    ) -> Result<DeviceStage<'s>, DeviceError>;

    /// Enqueues on the load stream, after `after` (the collective's event), the scatter of
    /// `blocks` from device staging into this rank's slots. Blocks outside this rank's
    /// uploaded range hold what the collective wrote there: scatter them only after one ran
    /// on this upload (otherwise device staging still holds an earlier layer's bytes).
    ///
    /// The load stream waits for `after` on the device, with no bound (a CUDA stream wait
    /// has none): an event that never completes (a collective whose peer died inside NCCL)
    /// holds everything queued on that stream behind it, other batches' copies and the pool's
    /// slot reads and writes, until each fails at its own host-side limit. Wait for `after`
    /// on the host first, with a deadline (as the linker does before every scatter), unless
    /// it is known to complete.
    fn scatter(
        &self,
        stage: &mut LayerStage,
        blocks: &[RowBlock],
        after: &SharedEvent,
    ) -> Result<(), DeviceError>;
}

/// Makes the landing of each batch: what a linker holds instead of knowing the backend.
pub trait LandingFactory: Send + Sync {
    /// A landing for one batch whose plan page `i` goes to slot `slots[i]`, split as `shape`.
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Box<dyn LayerLanding>, DeviceError>;

    /// The host memory a store writes into for this backend (pool buffers, or pinned
    /// staging): register it with the store once. Each region keeps its memory allocated
    /// while it lives ([`StoreRegion`](crate::StoreRegion)), so whoever registers it keeps
    /// the region (not the factory) until the store has let go.
    fn store_regions(&self) -> Vec<crate::StoreRegion>;

    /// Which memory this backend's landings share rows through.
    fn share_path(&self) -> SharePath;

    /// Staging buffers this backend holds back because device work or a store read may still
    /// use them (none for a backend without staging): each one fewer for loads and saves, and
    /// one held for good is a leak to alarm on.
    fn staging_quarantined(&self) -> usize {
        0
    }

    /// Of [`staging_quarantined`](Self::staging_quarantined), the buffers held for good (no
    /// event tells when their work ends), and the staging buffers there are in all: once the
    /// two are equal every batch fails at once for want of one (rebuild the pool). `(0, 0)`
    /// for a backend without staging.
    fn staging_held_for_good(&self) -> (usize, usize) {
        (0, 0)
    }

    /// The bytes of one staging stage, where landings and gathers go through staging (`None`,
    /// the default, where they do not): a save's gather of more pages than a stage holds a
    /// layer of fails, so the linker saves in chunks a stage holds.
    fn stage_bytes(&self) -> Option<usize> {
        None
    }

    /// Longest [`begin`](Self::begin) or a save's gather waits for a staging buffer before it
    /// fails (a linker in a TP group says at build when this is not well under its collective
    /// bound). Zero, the default, for a backend without staging; a wrapper forwards it.
    fn lease_wait(&self) -> std::time::Duration {
        std::time::Duration::ZERO
    }

    /// An event after the work queued so far on the engine's `stream` (its compute that wrote
    /// the pages a save reads), recorded on the pool's device ([`Device::record_on`]): what
    /// [`begin_save_after`](Self::begin_save_after) is then given. The default (a backend
    /// with no device) says it cannot ([`DeviceError::Unsupported`]).
    ///
    /// [`Device::record_on`]: crate::Device::record_on
    fn record_on_engine_stream(
        &self,
        stream: kv_loader::RawStream,
    ) -> Result<SharedEvent, DeviceError> {
        let _ = stream;
        Err(DeviceError::Unsupported(
            "this landing factory records no event on an engine stream (a wrapper must \
             forward `record_on_engine_stream`)",
        ))
    }

    /// For saving from a pool the store cannot read directly (device memory): a gatherer of
    /// the slices of plan page `i` (slot `slots[i]`) into host memory. Host pools are read in
    /// place and need none. The gatherer claims the slots for reading while it lives (and
    /// while a gather of it may still run): refused ([`DeviceError::SlotBusy`]) while a
    /// landing writes one of them. It must read nothing of the slots before its first
    /// [`SaveGather::gather`]: [`begin_save_after`](Self::begin_save_after)'s default takes
    /// it before waiting for the engine's event (its claims then hold the slots meanwhile).
    fn begin_save(&self, slots: Arc<[u32]>) -> Result<Box<dyn SaveGather>, DeviceError> {
        let _ = slots;
        Err(DeviceError::Unsupported(
            "this backend's pool is read in place; it has no save gatherer",
        ))
    }

    /// [`begin_save`](Self::begin_save), ordered after `after` (an event recorded after the
    /// engine's compute that wrote the pages): no gather reads the slots before it completed.
    /// Backends with device streams wait on it device-side; the default takes the gatherer
    /// (a backend without one says so at once), then waits for the event on the calling
    /// thread (at most a minute) before handing it out.
    fn begin_save_after(
        &self,
        slots: Arc<[u32]>,
        after: &SharedEvent,
    ) -> Result<Box<dyn SaveGather>, DeviceError> {
        // A gatherer reads nothing until its first `gather`, which comes after this returns.
        let gather = self.begin_save(slots)?;
        let limit = crate::staged::sync::SYNC_LIMIT;
        if !after.wait_until(kv_loader::deadline_after(limit))? {
            return Err(DeviceError::Timeout {
                what: "the engine's event before a save",
                waited: limit,
            });
        }
        Ok(gather)
    }
}

/// Brings a batch's slices to host memory for a save.
pub trait SaveGather: Send {
    /// Gathers (`component`, `layer`) of every plan page and waits for it: the rows, in plan
    /// order, `page_layer_bytes` each, borrowed until the next call.
    fn gather(&mut self, component: ComponentId, layer: u32) -> Result<&[u8], DeviceError>;
}
