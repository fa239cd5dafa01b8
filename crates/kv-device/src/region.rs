//! Memory regions and completion events as they pass between crates: what a collective moves
//! and what orders device work.
//!
//! Raw regions ([`HostRow`], [`DeviceRegion`]) are plain data: an address and a length. They
//! are what `unsafe` backend calls take. Code above the backends passes the typed handles a
//! landing hands out instead (which vouch that the memory is live and this batch's alone);
//! see the landing module.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use kv_loader::StreamWaitable;

use crate::DeviceError;

/// One row of host memory: `len` bytes at `addr` (a pool slot's slice of one layer, or a
/// piece of host staging). Plain data; whoever dereferences it vouches for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HostRow {
    /// First byte.
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

impl HostRow {
    /// One past the last byte (saturating).
    pub fn end(&self) -> usize {
        self.addr.saturating_add(self.len)
    }

    /// True when the two rows share at least one byte.
    pub fn overlaps(&self, other: &HostRow) -> bool {
        self.len > 0 && other.len > 0 && self.addr < other.end() && other.addr < self.end()
    }
}

/// Of `items`, the first two (in address order) whose rows (`row` of each) share a byte, if
/// any; rows of no bytes share nothing. Sorts by address: `n log n` over the items, nothing
/// per byte.
///
/// ```
/// use kv_device::{first_overlap_by, HostRow};
/// let rows = [HostRow { addr: 200, len: 8 }, HostRow { addr: 100, len: 10 }, HostRow { addr: 109, len: 4 }];
/// assert_eq!(first_overlap_by(&rows, |r| *r), Some((rows[1], rows[2])));
/// assert_eq!(first_overlap_by(&rows[..2], |r| *r), None);
/// ```
pub fn first_overlap_by<T: Copy>(items: &[T], row: impl Fn(&T) -> HostRow) -> Option<(T, T)> {
    let mut sorted: Vec<T> = items.iter().copied().filter(|t| row(t).len > 0).collect();
    sorted.sort_unstable_by_key(|t| {
        let r = row(t);
        (r.addr, r.len)
    });
    sorted
        .windows(2)
        .find(|w| row(&w[0]).overlaps(&row(&w[1])))
        .map(|w| (w[0], w[1]))
}

/// A byte range of the memory of one device: `len` bytes at device address `addr` of GPU
/// `ordinal` (for the CPU device backend, `addr` is a host address). Plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceRegion {
    /// The device.
    pub ordinal: u32,
    /// First byte (device address).
    pub addr: u64,
    /// Bytes.
    pub len: usize,
}

/// Host memory a store may keep using between calls (registered with it: pinned for RDMA),
/// bound to the owner that keeps it allocated, the way cudarc's `CudaSlice` keeps its
/// context: while any clone of the region lives, its bytes stay allocated. So a store that
/// keeps the region it was given for as long as it uses the memory (until it let go of it)
/// never sees it freed underneath, whatever the caller does.
///
/// It vouches for allocation only: a region says nothing about who reads or writes the
/// bytes (each read or write call has its own contract for that).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::StoreRegion;
/// let buf: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
/// // SAFETY: the 64 bytes of `buf` stay allocated while `buf` (the owner) lives.
/// let r = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
/// assert_eq!((r.len(), r.addr()), (64, buf.as_ptr() as usize));
/// ```
#[derive(Clone)]
pub struct StoreRegion {
    addr: usize,
    len: usize,
    owner: Arc<dyn Any + Send + Sync>,
}

impl StoreRegion {
    /// The `len` bytes at `addr`, kept allocated by `owner`.
    ///
    /// # Safety
    /// The `len` bytes at `addr` stay allocated (not freed, not unmapped, not reused for
    /// anything but what the owner lends them for) for as long as `owner` lives.
    pub unsafe fn new(addr: usize, len: usize, owner: Arc<dyn Any + Send + Sync>) -> Self {
        StoreRegion { addr, len, owner }
    }

    /// First byte.
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a region of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `other` is the same range (whoever owns it).
    pub fn same_range(&self, other: &StoreRegion) -> bool {
        (self.addr, self.len) == (other.addr, other.len)
    }

    /// The owner, for a holder that must keep the memory past the region (e.g. leak it).
    pub fn owner(&self) -> &Arc<dyn Any + Send + Sync> {
        &self.owner
    }
}

impl std::fmt::Debug for StoreRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreRegion")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

/// A completion marker recorded on a device stream after some work (a copy, a scatter, a
/// collective): it completes once that work has finished.
///
/// Every wait on it is bounded: [`wait_until`](DeviceEvent::wait_until) returns at the
/// deadline whatever the device does. Events of one backend can be waited on by that
/// backend's streams (device-side, no CPU thread blocks); [`as_any`](DeviceEvent::as_any)
/// lets a backend recognise its own events. As a [`StreamWaitable`] it is what a layer wait
/// hands the engine.
pub trait DeviceEvent: StreamWaitable + Any {
    /// True once the work before the event has finished; a device error surfaces here.
    fn is_complete(&self) -> Result<bool, DeviceError>;

    /// Waits until the event completes (`Ok(true)`) or `deadline` passes (`Ok(false)`); never
    /// blocks past the deadline by more than one short sleep.
    fn wait_until(&self, deadline: Instant) -> Result<bool, DeviceError>;

    /// The concrete event, for a backend to downcast.
    fn as_any(&self) -> &dyn Any;
}

/// A shared device event.
pub type SharedEvent = Arc<dyn DeviceEvent>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_overlap_only_when_they_share_a_byte() {
        let a = HostRow { addr: 100, len: 10 };
        assert!(a.overlaps(&HostRow { addr: 109, len: 1 }));
        assert!(!a.overlaps(&HostRow { addr: 110, len: 5 }));
        assert!(!a.overlaps(&HostRow { addr: 100, len: 0 }));
        assert_eq!(
            HostRow {
                addr: usize::MAX,
                len: 2
            }
            .end(),
            usize::MAX
        );
    }
}
