//! The device backend: memory, streams and events of one device, as the staged landing and the
//! in-process device collective drive them.
//!
//! Two backends implement it: CUDA (feature `cuda`) and [`CpuDevice`](crate::CpuDevice), whose
//! "device memory" is host memory and whose streams are worker threads. Work enqueued on one
//! stream runs in order; an event recorded on a stream completes once everything enqueued on
//! it before has finished; a stream can wait (device-side) on an event of another stream of
//! the same backend. Code above the backends (the staged landing, the collectives) is written
//! once against these traits and tested on the CPU backend in CI.

use std::any::Any;
use std::fmt;
use std::sync::Arc;

use crate::{DeviceError, DeviceRegion, SharedEvent};

/// One copy a stream runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transfer {
    /// Host memory (pinned, for an asynchronous copy) → device memory.
    ToDevice {
        /// Device address.
        dst: u64,
        /// Host address.
        src: usize,
        /// Bytes.
        len: usize,
    },
    /// Device memory → host memory.
    ToHost {
        /// Host address.
        dst: usize,
        /// Device address.
        src: u64,
        /// Bytes.
        len: usize,
    },
    /// Device memory → device memory (the same device, or one reachable by unified
    /// addressing).
    OnDevice {
        /// Device address.
        dst: u64,
        /// Device address.
        src: u64,
        /// Bytes.
        len: usize,
    },
}

impl Transfer {
    /// Bytes copied.
    pub fn len(&self) -> usize {
        match *self {
            Transfer::ToDevice { len, .. }
            | Transfer::ToHost { len, .. }
            | Transfer::OnDevice { len, .. } => len,
        }
    }

    /// True for a copy of nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One launch of the row copy (the scatter / gather kernel): for every row `r < n_rows`,
/// `row_bytes` bytes from `src + (src_rows ? src_rows[r] : r) * row_bytes` to
/// `dst + (dst_rows ? dst_rows[r] : r) * row_bytes`. All addresses are device addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowCopy {
    /// Source base.
    pub src: u64,
    /// Destination base.
    pub dst: u64,
    /// Device array of `n_rows` source row indices (`u32`), or 0 for `0..n_rows`.
    pub src_rows: u64,
    /// Device array of `n_rows` destination row indices (`u32`), or 0 for `0..n_rows`.
    pub dst_rows: u64,
    /// Rows.
    pub n_rows: u32,
    /// Bytes per row.
    pub row_bytes: u64,
}

/// A stream of one device: work enqueued on it runs in order, asynchronously to the caller.
///
/// # Safety
/// Implementors promise what code that frees or reuses memory relies on: work runs in the order it was
/// enqueued; an event from [`record`](Stream::record) completes only after every piece of work
/// enqueued before it has finished touching memory (or has been dropped without touching it);
/// after [`wait`](Stream::wait), no later work starts before that event completes.
pub unsafe trait Stream: Send + Sync + fmt::Debug {
    /// Enqueues a copy.
    ///
    /// # Safety
    /// Both ranges are valid for the copy (source readable, destination writable, `len`
    /// bytes, not overlapping), stay allocated, and nothing else writes the source or touches
    /// the destination, until an event recorded after this copy completes.
    unsafe fn transfer(&self, t: Transfer) -> Result<(), DeviceError>;

    /// Enqueues a row copy (one kernel launch on CUDA).
    ///
    /// # Safety
    /// As for [`transfer`](Stream::transfer), for every row named: each lies inside its
    /// buffer, the index arrays hold `n_rows` `u32` each, destination rows are distinct and do
    /// not overlap source rows.
    unsafe fn copy_rows(&self, c: RowCopy) -> Result<(), DeviceError>;

    /// Records an event after the work enqueued so far.
    fn record(&self) -> Result<SharedEvent, DeviceError>;

    /// Makes later work on this stream wait for `event` (device-side: returns at once).
    /// [`DeviceError::ForeignEvent`] for an event of another backend.
    fn wait(&self, event: &SharedEvent) -> Result<(), DeviceError>;
}

/// One device as the loader uses it: allocations, the load stream (host→device copies and
/// scatters of landings), and further streams (a collective's comm stream).
///
/// # Safety
/// The landings, staging buffers and pools of this crate write and free memory on the word of
/// these methods, so an implementation promises:
/// - [`alloc`](Device::alloc) and [`alloc_pinned`](Device::alloc_pinned) return memory of at
///   least the `len` bytes asked for (a shorter one would have copies run past it);
/// - [`load_stream`](Device::load_stream) is the same stream on every call: work enqueued
///   through one returned handle is ordered before work enqueued later through another, and
///   an event recorded on it covers all of it (a pool drains it before freeing its memory);
/// - two devices with the same [`ordinal`](Device::ordinal) and [`name`](Device::name)
///   address the same memory (a landing checks a pool's device that way).
///
/// ```
/// use kv_device::{CpuDevice, Device};
/// let dev = CpuDevice::new(0).unwrap();
/// let mem = dev.alloc(4096, "example").unwrap();
/// assert_eq!(mem.len(), 4096);
/// let ev = dev.load_stream().record().unwrap();
/// assert!(ev.wait_until(kv_loader::deadline_after(std::time::Duration::from_secs(5))).unwrap());
/// ```
pub unsafe trait Device: Send + Sync + fmt::Debug {
    /// The device's ordinal ([`DeviceRegion::ordinal`], `Residence::Device`).
    fn ordinal(&self) -> u32;

    /// A human-readable name (e.g. "NVIDIA H200", "CPU device 0").
    fn name(&self) -> String;

    /// `len` zeroed bytes of device memory.
    fn alloc(&self, len: usize, what: &'static str) -> Result<DeviceMemory, DeviceError>;

    /// `len` zeroed bytes of pinned host memory (what asynchronous copies read and write).
    fn alloc_pinned(&self, len: usize, what: &'static str) -> Result<PinnedMemory, DeviceError>;

    /// The stream that landings enqueue their copies and scatters on.
    fn load_stream(&self) -> Arc<dyn Stream>;

    /// A new stream (e.g. a rank's comm stream).
    fn new_stream(&self) -> Result<Arc<dyn Stream>, DeviceError>;

    /// An event that completes once the work queued so far on `stream`, a stream of the
    /// engine's on this device (the compute that wrote pages a save reads), has run: what a
    /// save is ordered after, device-side. The default says the backend cannot
    /// ([`DeviceError::Unsupported`]).
    fn record_on(&self, stream: kv_loader::RawStream) -> Result<SharedEvent, DeviceError> {
        let _ = stream;
        Err(DeviceError::Unsupported(
            "this device records no event on an engine's stream",
        ))
    }
}

/// Device memory, freed when dropped (by the backend's allocation it holds).
pub struct DeviceMemory {
    region: DeviceRegion,
    _owner: Box<dyn Any + Send + Sync>,
}

impl DeviceMemory {
    /// Wraps a backend's allocation.
    ///
    /// # Safety
    /// `region` is device memory that `owner` owns: valid for `region.len` bytes until `owner`
    /// is dropped, freed then, and reachable by nothing else.
    pub unsafe fn from_owner(region: DeviceRegion, owner: Box<dyn Any + Send + Sync>) -> Self {
        DeviceMemory {
            region,
            _owner: owner,
        }
    }

    /// The memory as a region.
    pub fn region(&self) -> DeviceRegion {
        self.region
    }

    /// The device address.
    pub fn addr(&self) -> u64 {
        self.region.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.region.len
    }

    /// True for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.region.len == 0
    }
}

impl fmt::Debug for DeviceMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceMemory")
            .field("region", &self.region)
            .finish()
    }
}

/// Pinned host memory, freed when dropped.
pub struct PinnedMemory {
    addr: usize,
    len: usize,
    _owner: Box<dyn Any + Send + Sync>,
}

impl PinnedMemory {
    /// Wraps a backend's allocation.
    ///
    /// # Safety
    /// `addr` is host memory that `owner` owns: valid for `len` bytes until `owner` is
    /// dropped, freed then, and reachable by nothing else.
    pub unsafe fn from_owner(addr: usize, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        PinnedMemory {
            addr,
            len,
            _owner: owner,
        }
    }

    /// The host address.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for zero bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl fmt::Debug for PinnedMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PinnedMemory")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish()
    }
}
