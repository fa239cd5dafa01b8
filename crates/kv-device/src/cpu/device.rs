//! The CPU device and its test controls.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::event::CpuEvent;
use super::stream::CpuStream;
use crate::host::HostBuffer;
use crate::{Device, DeviceError, DeviceMemory, DeviceRegion, PinnedMemory, SharedEvent, Stream};

/// Settings of a [`CpuDevice`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuDeviceConfig {
    /// Longest a stream waits on an event; a stream whose wait runs out fails: its later
    /// work is skipped and its later events report the failure. Also bounds
    /// `StreamWaitable::synchronize` on its events.
    pub wait_limit: Duration,
    /// Each operation first sleeps a pseudo-random time up to this (0: none), so that streams
    /// drift against each other and a missing wait shows.
    pub max_op_delay: Duration,
    /// Record a [`TraceOp`] for every operation run.
    pub trace: bool,
}

impl Default for CpuDeviceConfig {
    fn default() -> Self {
        CpuDeviceConfig {
            wait_limit: Duration::from_secs(10),
            max_op_delay: Duration::ZERO,
            trace: false,
        }
    }
}

/// Kinds of stream operations (for traces and injected faults).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CpuOp {
    /// [`Transfer::ToDevice`](crate::Transfer::ToDevice).
    ToDevice,
    /// [`Transfer::ToHost`](crate::Transfer::ToHost).
    ToHost,
    /// [`Transfer::OnDevice`](crate::Transfer::OnDevice).
    OnDevice,
    /// A [`RowCopy`](crate::RowCopy).
    Rows,
    /// An event recorded.
    Record,
    /// A wait on an event.
    Wait,
}

/// One operation a stream ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceOp {
    /// The stream (0 is the load stream, then streams in creation order).
    pub stream: u32,
    /// What it was.
    pub op: CpuOp,
    /// Bytes copied.
    pub bytes: u64,
    /// When it started (after any stall or delay).
    pub started: Instant,
    /// When it finished.
    pub finished: Instant,
}

/// State every stream of one device shares.
pub(crate) struct Control {
    pub(crate) ordinal: u32,
    pub(crate) config: CpuDeviceConfig,
    stalled_until: Mutex<Option<Instant>>,
    /// Injected enqueue failures: (kind, enqueues of that kind still to let through).
    faults: Mutex<Vec<(CpuOp, u32)>>,
    /// Injected stalls: (kind, operations of that kind still to start, stall length).
    stalls: Mutex<Vec<(CpuOp, u32, Duration)>>,
    trace: Mutex<Vec<TraceOp>>,
    /// Device allocations made so far, by what they are for.
    allocs: Mutex<HashMap<&'static str, usize>>,
}

impl Control {
    /// How long the device is still stalled.
    pub(crate) fn stalled_for(&self) -> Option<Duration> {
        let until = (*self.stalled_until.lock())?;
        until.checked_duration_since(Instant::now())
    }

    /// An operation of kind `op` is about to run: starts an injected stall when one says so.
    pub(crate) fn starting(&self, op: CpuOp) {
        let mut stalls = self.stalls.lock();
        let Some(i) = stalls.iter().position(|(k, _, _)| *k == op) else {
            return;
        };
        if stalls[i].1 > 0 {
            stalls[i].1 -= 1;
            return;
        }
        let (_, _, d) = stalls.remove(i);
        *self.stalled_until.lock() = Some(kv_loader::deadline_after(d));
    }

    /// Fails this enqueue when an injected fault says so.
    pub(crate) fn check_fault(&self, op: CpuOp) -> Result<(), DeviceError> {
        let mut faults = self.faults.lock();
        let Some(i) = faults.iter().position(|(k, _)| *k == op) else {
            return Ok(());
        };
        if faults[i].1 > 0 {
            faults[i].1 -= 1;
            return Ok(());
        }
        faults.remove(i);
        Err(DeviceError::Driver(format!(
            "injected failure of a {op:?} enqueue on CPU device {}",
            self.ordinal
        )))
    }

    pub(crate) fn traced(&self, stream: u32, op: CpuOp, bytes: u64, started: Instant) {
        if self.config.trace {
            self.trace.lock().push(TraceOp {
                stream,
                op,
                bytes,
                started,
                finished: Instant::now(),
            });
        }
    }
}

/// A device whose memory is host memory and whose streams are worker threads: the device
/// path (staging, streams, events, device collectives) running for real on a machine without
/// a GPU. See the [module docs](crate::cpu).
///
/// ```
/// use std::time::{Duration, Instant};
/// use kv_device::{CpuDevice, Device, Transfer};
/// let dev = CpuDevice::new(0).unwrap();
/// let src = dev.alloc_pinned(8, "example").unwrap();
/// let dst = dev.alloc(8, "example").unwrap();
/// // SAFETY: both allocations are ours, 8 bytes, and live until the event below completes.
/// unsafe {
///     std::ptr::write_bytes(src.addr() as *mut u8, 7, 8);
///     dev.load_stream()
///         .transfer(Transfer::ToDevice { dst: dst.addr(), src: src.addr(), len: 8 })
///         .unwrap();
/// }
/// let ev = dev.load_stream().record().unwrap();
/// assert!(ev.wait_until(kv_loader::deadline_after(Duration::from_secs(5))).unwrap());
/// // SAFETY: the copy has finished (its event completed).
/// assert_eq!(unsafe { *(dst.addr() as *const u8) }, 7);
/// ```
pub struct CpuDevice {
    control: Arc<Control>,
    load: Arc<CpuStream>,
    next_stream: AtomicU32,
}

impl fmt::Debug for CpuDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuDevice")
            .field("ordinal", &self.control.ordinal)
            .field("config", &self.control.config)
            .finish()
    }
}

impl CpuDevice {
    /// A CPU device numbered `ordinal`, default settings.
    pub fn new(ordinal: u32) -> Result<Arc<Self>, DeviceError> {
        Self::with_config(ordinal, CpuDeviceConfig::default())
    }

    /// A CPU device with explicit settings.
    pub fn with_config(ordinal: u32, config: CpuDeviceConfig) -> Result<Arc<Self>, DeviceError> {
        let control = Arc::new(Control {
            ordinal,
            config,
            stalled_until: Mutex::new(None),
            faults: Mutex::new(Vec::new()),
            stalls: Mutex::new(Vec::new()),
            trace: Mutex::new(Vec::new()),
            allocs: Mutex::new(HashMap::new()),
        });
        let load = CpuStream::spawn(0, control.clone())?;
        Ok(Arc::new(CpuDevice {
            control,
            load,
            next_stream: AtomicU32::new(1),
        }))
    }

    /// Its settings.
    pub fn config(&self) -> CpuDeviceConfig {
        self.control.config
    }

    /// No stream of this device starts an operation for `d` from now (operations in progress
    /// finish): a device that stops making progress for a while.
    pub fn stall_for(&self, d: Duration) {
        *self.control.stalled_until.lock() = Some(kv_loader::deadline_after(d));
    }

    /// When the operation of kind `op` after `skip` more such operations is about to run (on
    /// any stream of this device), the device stalls for `d`, that operation included: device
    /// work that stops at a given point (a collective's copy that never completes in time).
    pub fn stall_at(&self, op: CpuOp, skip: u32, d: Duration) {
        self.control.stalls.lock().push((op, skip, d));
    }

    /// Ends a stall early.
    pub fn resume(&self) {
        *self.control.stalled_until.lock() = None;
    }

    /// The enqueue of an operation of kind `op` after `skip` more such enqueues (on any stream
    /// of this device) fails with [`DeviceError::Driver`], as a driver call that returns an
    /// error would.
    pub fn fail_enqueue(&self, op: CpuOp, skip: u32) {
        self.control.faults.lock().push((op, skip));
    }

    /// Device allocations ([`Device::alloc`]) made so far whose `what` is `what`: a test sees
    /// with it that a path reuses device memory instead of allocating per batch (on CUDA
    /// each is a `cuMemAlloc`, and its later `cuMemFree`, which may synchronize the device).
    ///
    /// ```
    /// use kv_device::{CpuDevice, Device};
    /// let dev = CpuDevice::new(0).unwrap();
    /// let _a = dev.alloc(64, "slot table").unwrap();
    /// let _b = dev.alloc(64, "other").unwrap();
    /// assert_eq!(dev.allocations("slot table"), 1);
    /// ```
    pub fn allocations(&self, what: &str) -> usize {
        self.control.allocs.lock().get(what).copied().unwrap_or(0)
    }

    /// Operations run so far (with [`CpuDeviceConfig::trace`]), in the order they finished.
    pub fn trace(&self) -> Vec<TraceOp> {
        let mut t = self.control.trace.lock().clone();
        t.sort_by_key(|o| o.finished);
        t
    }
}

// SAFETY: `alloc` and `alloc_pinned` return host allocations of at least `len` bytes (below);
// `load_stream` clones the one load stream made with the device; every CPU device addresses
// the one host memory, whatever its ordinal.
unsafe impl Device for CpuDevice {
    fn ordinal(&self) -> u32 {
        self.control.ordinal
    }

    fn name(&self) -> String {
        format!("CPU device {}", self.control.ordinal)
    }

    fn alloc(&self, len: usize, what: &'static str) -> Result<DeviceMemory, DeviceError> {
        let buf = HostBuffer::zeroed(len, what)?;
        *self.control.allocs.lock().entry(what).or_default() += 1;
        let region = DeviceRegion {
            ordinal: self.control.ordinal,
            addr: buf.addr() as u64,
            len,
        };
        // SAFETY: `buf` owns this zeroed allocation of at least `len` bytes (HostBuffer allocates
        // `len.max(1)`), frees it when dropped, and nothing else holds its address.
        Ok(unsafe { DeviceMemory::from_owner(region, Box::new(buf)) })
    }

    fn alloc_pinned(&self, len: usize, what: &'static str) -> Result<PinnedMemory, DeviceError> {
        let buf = HostBuffer::zeroed(len, what)?;
        let addr = buf.addr();
        // SAFETY: as in `alloc`.
        Ok(unsafe { PinnedMemory::from_owner(addr, len, Box::new(buf)) })
    }

    fn load_stream(&self) -> Arc<dyn Stream> {
        self.load.clone()
    }

    fn new_stream(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        Ok(CpuStream::spawn(id, self.control.clone())?)
    }

    /// An event complete at once (`stream` is not used): a CPU engine computes on its own
    /// thread, done by the time it asks. Work it queued on a stream of this device (a
    /// `CpuStream`, as the tests do) is not covered: order a save after that with
    /// `Linker::save_after` and an event recorded on that stream.
    fn record_on(&self, stream: kv_loader::RawStream) -> Result<SharedEvent, DeviceError> {
        let _ = stream;
        let ev = CpuEvent::new(self.control.config.wait_limit);
        ev.complete();
        Ok(Arc::new(ev))
    }
}
