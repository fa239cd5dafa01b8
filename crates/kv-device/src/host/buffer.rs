//! A page-aligned, zeroed host allocation addressed through raw pointers.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use crate::DeviceError;

const ALIGN: usize = 4096;

/// Raw host memory: written by stores and peers through addresses, never through `&mut`.
pub(crate) struct HostBuffer {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: HostBuffer owns its allocation outright and hands out addresses only; nothing in
// it is tied to a thread.
unsafe impl Send for HostBuffer {}
// SAFETY: a shared reference exposes only the address and the length, never the bytes. The
// bytes are reached either through an `unsafe` call (`HostKvPool::read_slot`/`write_slot`, a
// store's read or write) whose caller promises that no one else writes them meanwhile, or
// through safe calls that hold the slots' claims or a stage's loan (`SaveSource::bytes`,
// `DirectLanding::target_bytes`, `StageLoan::write`): a claim or loan excludes every writer
// of those bytes while the borrow lives.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    pub(crate) fn zeroed(len: usize, what: &'static str) -> Result<Self, DeviceError> {
        let alloc_err = || DeviceError::Alloc {
            bytes: len as u64,
            what,
        };
        let layout = Layout::from_size_align(len.max(1), ALIGN).map_err(|_| alloc_err())?;
        // SAFETY: the layout has a non-zero size (max(1)) and a valid power-of-two alignment.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(alloc_err)?;
        Ok(HostBuffer { ptr, layout })
    }

    pub(crate) fn addr(&self) -> usize {
        self.ptr.as_ptr() as usize
    }

    pub(crate) fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: `ptr` came from `alloc_zeroed` with exactly this layout and is freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}
