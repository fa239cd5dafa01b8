//! A CUDA stream as a [`Stream`]: async copies, the row-copy kernel, events.

use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::sync::Arc;

use cudarc::driver::{sys, CudaStream};

use super::current::{ContextRestore, Current};
use super::error::drv;
use super::event::CudaLayerEvent;
use super::kernels::KernelCache;
use crate::{DeviceError, RowCopy, SharedEvent, Stream, Transfer};

/// One cudarc stream and the kernels of its context.
#[derive(Debug)]
pub(crate) struct CuStream {
    /// Dropped in `Drop`, with the stream's context pushed current (see there).
    stream: ManuallyDrop<Arc<CudaStream>>,
    kernels: Arc<KernelCache>,
    /// Last: the thread's own context current again after `kernels` (maybe the last handle on
    /// the module and the context) dropped.
    restore: ContextRestore,
}

impl CuStream {
    pub(crate) fn new(stream: Arc<CudaStream>, kernels: Arc<KernelCache>) -> Self {
        CuStream {
            stream: ManuallyDrop::new(stream),
            kernels,
            restore: ContextRestore::default(),
        }
    }

    pub(crate) fn cuda(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The stream's context current for the caller's driver calls (the thread's own back
    /// after).
    fn bind(&self) -> Result<Current<'_>, DeviceError> {
        Current::make(self.stream.context()).map_err(drv("cuCtxPushCurrent"))
    }
}

impl Drop for CuStream {
    /// cudarc destroys a stream with its context made current by `cuCtxSetCurrent`, which
    /// replaces the calling thread's own (an engine thread's, another GPU's): the context is
    /// pushed first, so that the replaced one is ours and the pop brings the thread's back.
    fn drop(&mut self) {
        self.restore.save();
        let ctx = self.stream.context().clone();
        let current = Current::make(&ctx);
        if let Err(e) = &current {
            tracing::warn!(
                error = %super::error::driver_error_text(*e),
                "cuCtxPushCurrent before destroying a stream failed: the thread's own context \
                 may not be current after"
            );
        }
        // SAFETY: dropped once, here; the field is not used after.
        unsafe { ManuallyDrop::drop(&mut self.stream) };
        drop(current);
    }
}

// SAFETY: a CUDA stream runs its work in order; an event recorded on it completes after every
// piece of work enqueued before; cuStreamWaitEvent holds back later work until the event.
unsafe impl Stream for CuStream {
    unsafe fn transfer(&self, t: Transfer) -> Result<(), DeviceError> {
        if t.is_empty() {
            return Ok(());
        }
        let _current = self.bind()?;
        let s = self.stream.cu_stream();
        // SAFETY: the caller promised both ranges are valid and untouched by others until an
        // event recorded after this copy completes; the context is current.
        let r = unsafe {
            match t {
                Transfer::ToDevice { dst, src, len } => {
                    sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len, s)
                }
                Transfer::ToHost { dst, src, len } => {
                    sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, s)
                }
                Transfer::OnDevice { dst, src, len } => sys::cuMemcpyDtoDAsync_v2(dst, src, len, s),
            }
        };
        r.result().map_err(drv("cuMemcpyAsync"))
    }

    unsafe fn copy_rows(&self, c: RowCopy) -> Result<(), DeviceError> {
        let kernels = self.kernels.get()?;
        let _current = self.bind()?;
        // SAFETY: the caller's promise (Stream::copy_rows) is the kernel's contract.
        unsafe { kernels.copy_rows(self.stream.cu_stream(), c) }
    }

    fn record(&self) -> Result<SharedEvent, DeviceError> {
        Ok(CudaLayerEvent::record_on(&self.stream, u32::MAX)?)
    }

    fn wait(&self, event: &SharedEvent) -> Result<(), DeviceError> {
        match event.as_any().downcast_ref::<CudaLayerEvent>() {
            Some(ev) => ev.wait_on(&self.stream),
            None => Err(DeviceError::ForeignEvent(format!(
                "a CUDA stream cannot wait on {event:?}"
            ))),
        }
    }
}
