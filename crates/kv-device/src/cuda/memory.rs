//! Raw device and pinned host allocations, owned and freed by us (no cudarc `CudaSlice`: the
//! loader addresses pool memory by raw address across streams, and orders access with its own
//! events, so cudarc's per-slice event tracking would only add events).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::current::{ContextRestore, Current};
use super::error::drv;
use super::event::CudaLayerEvent;
use crate::staged::sync::SYNC_LIMIT;
use crate::DeviceError;

/// Device memory of one GPU: `len` bytes at a raw device address.
#[derive(Debug)]
pub struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    len: usize,
    /// Last: the thread's own context current again after `ctx` (maybe the last handle on
    /// kvlink's context) dropped.
    restore: ContextRestore,
}

/// A failed allocation: [`DeviceError::Alloc`] when the memory ran out, else the driver's
/// error itself (a context that a fault broke is not a busy pool), keeping it as the source.
fn alloc_error(
    call: &'static str,
    e: cudarc::driver::DriverError,
    len: usize,
    what: &'static str,
) -> DeviceError {
    tracing::warn!(bytes = len, what, error = %super::error::driver_error_text(e), "{call} failed");
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        DeviceError::Alloc {
            bytes: len as u64,
            what,
        }
    } else {
        DeviceError::Cuda { call, source: e }
    }
}

impl DeviceBuffer {
    /// Allocates `len` bytes (`cuMemAlloc`, at least 256-byte aligned), contents unspecified.
    pub fn alloc(
        ctx: &Arc<CudaContext>,
        len: usize,
        what: &'static str,
    ) -> Result<Self, DeviceError> {
        let _current = Current::of(ctx)?;
        // SAFETY: the context is current; cuMemAlloc returns fresh memory we own and free once
        // in Drop. Its contents are never read as a Rust value.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }
            .map_err(|e| alloc_error("cuMemAlloc", e, len, what))?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
            restore: ContextRestore::default(),
        })
    }

    /// Allocates `len` zeroed bytes, zeroed on a stream of its own (see
    /// [`zeroed_on`](Self::zeroed_on)) and waited for, at most a minute. The stream is made
    /// raw: cudarc's `new_stream` on a context with event tracking on (the engine's handle,
    /// `CudaDevice::context`) would first synchronize the whole context, with no bound.
    pub fn zeroed(
        ctx: &Arc<CudaContext>,
        len: usize,
        what: &'static str,
    ) -> Result<Self, DeviceError> {
        let b = Self::alloc(ctx, len, what)?;
        let _current = Current::of(ctx)?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(drv("cuStreamCreate"))?;
        // SAFETY: `b.ptr` is our allocation of at least `len` bytes that nothing else uses yet;
        // the context is current (the guard above) and `stream` was just made in it. The
        // memset is waited for (`waited_for`), and `b` is leaked instead of freed where it
        // was queued and cannot be.
        let memset = unsafe { result::memset_d8_async(b.ptr, 0, len, stream) };
        // Queued: only its event tells when it is done.
        let event = memset
            // SAFETY: `stream` was just made here and is destroyed only below.
            .map(|()| unsafe { CudaLayerEvent::record_raw(ctx, stream, u32::MAX) })
            .map_err(drv("cuMemsetD8Async"));
        // SAFETY: the stream is ours and used by nothing else; the driver destroys it once
        // its queued work (the memset) has run, which the event above still tells.
        if let Err(e) = unsafe { result::stream::destroy(stream) } {
            tracing::warn!(error = %super::error::driver_error_text(e), "destroying a zeroing stream failed");
        }
        match event {
            Ok(Ok(ev)) => b.waited_for(&ev, what, SYNC_LIMIT),
            // Queued, but nothing tells its end: kept for good.
            Ok(Err(e)) => {
                tracing::error!(bytes = len, what, error = %e, "zeroing new device memory could not be waited for; leaking it");
                std::mem::forget(b);
                Err(e)
            }
            // Not queued: nothing touches `b`, freed as it drops here.
            Err(e) => Err(e),
        }
    }

    /// Allocates `len` zeroed bytes in `stream`'s context. The zeroing runs on `stream`
    /// (`cuMemsetD8Async`: the plain `cuMemsetD8` runs on the legacy default stream, which
    /// non-blocking streams are not ordered after, and may return before it has run), and is
    /// waited for, at most `limit`. When it has not run by then the allocation is leaked (the
    /// memset may still write it) and [`DeviceError::Timeout`] returned.
    pub fn zeroed_on(
        stream: &Arc<CudaStream>,
        len: usize,
        what: &'static str,
        limit: Duration,
    ) -> Result<Self, DeviceError> {
        let b = Self::alloc(stream.context(), len, what)?;
        let _current = Current::make(stream.context()).map_err(drv("cuCtxPushCurrent"))?;
        // SAFETY: `b.ptr` is our allocation of at least `len` bytes and nothing else uses it
        // yet; the stream's context is current (the guard above). The memset is waited for
        // below, and `b` is leaked instead of freed when the wait does not end.
        unsafe { result::memset_d8_async(b.ptr, 0, len, stream.cu_stream()) }
            .map_err(drv("cuMemsetD8Async"))?;
        match CudaLayerEvent::record_on(stream, u32::MAX) {
            Ok(ev) => b.waited_for(&ev, what, limit),
            Err(e) => {
                tracing::error!(bytes = len, what, error = %e, "zeroing new device memory could not be waited for; leaking it");
                std::mem::forget(b);
                Err(e)
            }
        }
    }

    /// `self` once `ev` (after its zeroing) completed, waiting at most `limit`; leaked (the
    /// memset may still write it) when it did not or could not be waited for.
    fn waited_for(
        self,
        ev: &CudaLayerEvent,
        what: &'static str,
        limit: Duration,
    ) -> Result<Self, DeviceError> {
        let b = self;
        let len = b.len;
        match ev.wait_until(kv_loader::deadline_after(limit)) {
            Ok(true) => Ok(b),
            Ok(false) => {
                tracing::error!(
                    bytes = len,
                    what,
                    "zeroing new device memory did not finish in time; leaking it"
                );
                std::mem::forget(b);
                Err(DeviceError::Timeout {
                    what: "zeroing new device memory",
                    waited: limit,
                })
            }
            Err(e) => {
                tracing::error!(bytes = len, what, error = %e, "zeroing new device memory could not be waited for; leaking it");
                std::mem::forget(b);
                Err(e)
            }
        }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The context it belongs to.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // Owners order frees after the device work that uses the memory (they synchronize
        // their streams or events before dropping, or leak the buffer when a wait failed);
        // nothing here relies on cuMemFree waiting for work in flight.
        self.restore.save();
        let _current = Current::make(&self.ctx);
        // SAFETY: `ptr` came from cuMemAlloc in this context and is freed exactly once.
        if let Err(e) = unsafe { result::free_sync(self.ptr) } {
            tracing::warn!(error = %super::error::driver_error_text(e), "cuMemFree failed");
        }
    }
}

/// Plain pinned host memory (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_PORTABLE` only: not
/// write-combined, so CPU reads stay fast; portable so every context sees it as pinned, as
/// when ranks of one process drive different GPUs). The store writes it through addresses.
#[derive(Debug)]
pub struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
    /// Last: the thread's own context current again after `ctx` (maybe the last handle on
    /// kvlink's context) dropped.
    restore: ContextRestore,
}

// SAFETY: PinnedBuffer owns its allocation and hands out addresses only; every access to the
// bytes goes through raw pointers whose users (stores, copies ordered by events) are
// responsible for ordering, as for the host pool's buffers.
unsafe impl Send for PinnedBuffer {}
// SAFETY: as for Send: shared references expose only the address and length.
unsafe impl Sync for PinnedBuffer {}

impl PinnedBuffer {
    /// Allocates `len` bytes of pinned host memory, zeroed.
    pub fn zeroed(
        ctx: &Arc<CudaContext>,
        len: usize,
        what: &'static str,
    ) -> Result<Self, DeviceError> {
        let _current = Current::of(ctx)?;
        let flags = sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; cuMemHostAlloc returns fresh page-locked memory of
        // at least `len.max(1)` bytes that we own and free once in Drop.
        let raw = unsafe { result::malloc_host(len.max(1), flags) }
            .map_err(|e| alloc_error("cuMemHostAlloc", e, len, what))?;
        let ptr = raw as *mut u8;
        // SAFETY: `ptr` is valid for writes of `len` bytes (just allocated, not shared yet).
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(PinnedBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
            restore: ContextRestore::default(),
        })
    }

    /// The host address.
    pub fn addr(&self) -> usize {
        self.ptr as usize
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Copies `data` into the buffer at `offset` (a CPU write, e.g. in tests).
    ///
    /// # Safety
    /// No device copy and no store read may be in flight on that range.
    pub unsafe fn write(&self, offset: usize, data: &[u8]) -> Result<(), DeviceError> {
        check_range(offset, data.len(), self.len)?;
        // SAFETY: the range lies inside our allocation (checked); the caller guarantees
        // nothing else accesses it; `data` is a distinct Rust slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.ptr.add(offset), data.len()) };
        Ok(())
    }

    /// Copies bytes out of the buffer at `offset`.
    ///
    /// # Safety
    /// No device copy may be writing that range.
    pub unsafe fn read(&self, offset: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        check_range(offset, out.len(), self.len)?;
        // SAFETY: as in `write`, reversed.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), out.as_mut_ptr(), out.len()) };
        Ok(())
    }
}

fn check_range(offset: usize, len: usize, cap: usize) -> Result<(), DeviceError> {
    if offset.checked_add(len).is_none_or(|end| end > cap) {
        return Err(DeviceError::OutOfPool {
            component: u16::MAX,
            layer: u32::MAX,
            slot: u32::MAX,
            reason: "range outside the pinned buffer",
        });
    }
    Ok(())
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.restore.save();
        let _current = Current::make(&self.ctx);
        // SAFETY: `ptr` came from cuMemHostAlloc and is freed exactly once; owners drop it only
        // after the copies that read or write it completed (they synchronize first).
        if let Err(e) = unsafe { result::free_host(self.ptr as *mut c_void) } {
            tracing::warn!(error = %super::error::driver_error_text(e), "cuMemFreeHost failed");
        }
    }
}
