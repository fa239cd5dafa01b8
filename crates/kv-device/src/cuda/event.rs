//! The per-layer event a device wait hands the engine.

use std::any::Any;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys, CudaContext, CudaStream, DriverError};
use kv_loader::{KvLoadError, RawStream, StreamWaitable};

use super::current::{ContextRestore, Current};
use super::error::{driver_error_text, drv};
use crate::staged::sync::SYNC_LIMIT;
use crate::{DeviceError, DeviceEvent};

/// A CUDA event recorded on a stream after some device work (a layer's copies, a broadcast):
/// the engine's compute stream waits on it ([`StreamWaitable::wait_on_stream`], i.e.
/// `cuStreamWaitEvent`, which returns at once and blocks no CPU thread), or a host thread
/// waits for it, always bounded: [`CudaLayerEvent::wait_until`] polls until a deadline, and
/// [`StreamWaitable::synchronize`] gives up after a minute. It is the CUDA backend's
/// [`DeviceEvent`].
///
/// Created with `CU_EVENT_DISABLE_TIMING | CU_EVENT_BLOCKING_SYNC`: the cheapest kind to
/// record and wait on, and a host synchronize sleeps instead of spinning.
pub struct CudaLayerEvent {
    ctx: Arc<CudaContext>,
    event: sys::CUevent,
    layer: u32,
    /// Last: the thread's own context current again after `ctx` (maybe the last handle on
    /// kvlink's context) dropped.
    restore: ContextRestore,
}

// SAFETY: a CUevent handle may be used from any thread (the driver API is thread-safe); every
// use binds the owning context first. The handle is destroyed once, in Drop.
unsafe impl Send for CudaLayerEvent {}
// SAFETY: as for Send; recording happens only in `record_on` before the event is shared.
unsafe impl Sync for CudaLayerEvent {}

impl fmt::Debug for CudaLayerEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaLayerEvent")
            .field("layer", &self.layer)
            .field("device", &self.ctx.ordinal())
            .finish()
    }
}

impl CudaLayerEvent {
    /// Records a new event for `layer` on `stream` (after the work enqueued on it so far).
    pub fn record_on(stream: &CudaStream, layer: u32) -> Result<Arc<Self>, DeviceError> {
        // SAFETY: a cudarc stream's own handle is live while `stream` is borrowed.
        unsafe { Self::record_raw(stream.context(), stream.cu_stream(), layer) }
    }

    /// Records a new event on a raw stream of context `ctx`.
    ///
    /// # Safety
    /// `stream` is a live stream handle for the call (or the legacy / per-thread default
    /// stream handle): one of this backend's own, or a `RawStream` whose `unsafe`
    /// constructor's caller vouched for it.
    pub(crate) unsafe fn record_raw(
        ctx: &Arc<CudaContext>,
        stream: sys::CUstream,
        layer: u32,
    ) -> Result<Arc<Self>, DeviceError> {
        let _current = Current::of(ctx)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
            | sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC as u32;
        // SAFETY: the context is current; `event` is a valid out-pointer.
        unsafe { sys::cuEventCreate(&mut event, flags) }
            .result()
            .map_err(drv("cuEventCreate"))?;
        let ev = CudaLayerEvent {
            ctx: ctx.clone(),
            event,
            layer,
            restore: ContextRestore::default(),
        };
        // SAFETY: `event` was just created in this context; `stream` is a live stream handle
        // (this function's contract); a stream of another context makes the driver return an
        // error.
        unsafe { sys::cuEventRecord(ev.event, stream) }
            .result()
            .map_err(drv("cuEventRecord"))?;
        Ok(Arc::new(ev))
    }

    /// The layer (or operation number) it marks.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// The raw event handle (do not destroy it).
    pub fn cu_event(&self) -> sys::CUevent {
        self.event
    }

    /// The context it belongs to: kvlink's handle of it, cudarc's event tracking off.
    ///
    /// # Safety
    /// As for [`CudaDevice::untracked_context`](super::CudaDevice::untracked_context).
    pub unsafe fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Makes the cudarc `stream` wait for this event (device-side; returns at once).
    pub fn wait_on(&self, stream: &CudaStream) -> Result<(), DeviceError> {
        // SAFETY: a cudarc stream's own handle is live while `stream` is borrowed.
        unsafe { self.wait_raw(stream.cu_stream()) }.map_err(drv("cuStreamWaitEvent"))
    }

    /// Makes `stream` wait for this event (device-side).
    ///
    /// # Safety
    /// `stream` is a live stream handle for the call (or a default stream handle): a cudarc
    /// stream's own, or a `RawStream` whose `unsafe` constructor's caller vouched for it.
    unsafe fn wait_raw(&self, stream: sys::CUstream) -> Result<(), DriverError> {
        // The engine's thread keeps its own current context (a stream handle names its
        // context); ours is made current only where none is, and only for the call.
        let _current = if cudarc::driver::result::ctx::get_current()?.is_none() {
            Some(Current::make(&self.ctx)?)
        } else {
            None
        };
        // SAFETY: the event is live (we own it); `stream` is a live stream handle (this
        // function's contract; any context may wait on an event of another context).
        unsafe { sys::cuStreamWaitEvent(stream, self.event, 0) }.result()
    }

    /// True when the work before the event has finished; a device error surfaces here.
    pub fn is_complete(&self) -> Result<bool, DeviceError> {
        let _current = Current::of(&self.ctx)?;
        // SAFETY: the event is live.
        match unsafe { sys::cuEventQuery(self.event) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(drv("cuEventQuery")(DriverError(e))),
        }
    }

    /// Waits, polling, until the event completes (`Ok(true)`) or `deadline` passes
    /// (`Ok(false)`); never blocks past the deadline (by more than one short sleep).
    pub fn wait_until(&self, deadline: Instant) -> Result<bool, DeviceError> {
        let mut spins = 0u32;
        loop {
            if self.is_complete()? {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50).min(deadline - now));
            }
        }
    }
}

/// Whether `stream` is one of the default stream handles (0, 1, 2), which name a stream of the
/// calling thread's current context, while that context is another than `ctx`.
pub(super) fn default_stream_of_another_context(
    stream: RawStream,
    ctx: &CudaContext,
) -> Result<bool, DeviceError> {
    if stream.as_raw() > 2 {
        return Ok(false);
    }
    let current = cudarc::driver::result::ctx::get_current().map_err(drv("cuCtxGetCurrent"))?;
    Ok(current.is_some_and(|c| c != ctx.cu_ctx()))
}

impl StreamWaitable for CudaLayerEvent {
    /// `stream` is a `CUstream` (the engine's compute stream) cast to `usize`; its maker
    /// vouched that it is live ([`RawStream::from_raw`]).
    ///
    /// The special handles 0 (the default stream), 1 (legacy) and 2 (per-thread) name a
    /// stream of whichever context is current: on a thread whose current context is not
    /// kvlink's they are refused ([`DeviceError::Unsupported`]), since the wait would land on
    /// that context's stream and order none of the engine's work on this device (a pooled
    /// thread may still hold another GPU's context): `Config` (`FixInput`), as a save after
    /// such a stream is. On a thread with no current context they name kvlink's context's
    /// streams.
    fn wait_on_stream(&self, stream: RawStream) -> Result<(), KvLoadError> {
        if default_stream_of_another_context(stream, &self.ctx)? {
            return Err(KvLoadError::config(
                "waiting on the default stream (handle 0, 1 or 2) of a thread whose current \
                 context is not kvlink's: name the engine's stream itself",
            ));
        }
        // SAFETY: `RawStream::from_raw`'s caller vouched that the handle is a live stream.
        unsafe { self.wait_raw(stream.as_raw() as sys::CUstream) }.map_err(|e| {
            // The driver's error stays the source (an engine can tell a sticky fault).
            KvLoadError::Device(kv_loader::Cause::with_source(
                format!(
                    "cuStreamWaitEvent (layer {}): {}",
                    self.layer,
                    driver_error_text(e)
                ),
                e,
            ))
        })
    }

    /// Polls until the event completes, at most a minute (never an unbounded
    /// `cuEventSynchronize`).
    fn synchronize(&self) -> Result<(), KvLoadError> {
        match self.wait_until(kv_loader::deadline_after(SYNC_LIMIT)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(DeviceError::Timeout {
                what: "layer event",
                waited: SYNC_LIMIT,
            }
            .into()),
            Err(e) => Err(e.into()),
        }
    }
}

impl DeviceEvent for CudaLayerEvent {
    fn is_complete(&self) -> Result<bool, DeviceError> {
        CudaLayerEvent::is_complete(self)
    }

    fn wait_until(&self, deadline: Instant) -> Result<bool, DeviceError> {
        CudaLayerEvent::wait_until(self, deadline)
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for CudaLayerEvent {
    fn drop(&mut self) {
        self.restore.save();
        let _current = Current::make(&self.ctx);
        // SAFETY: we own the event and destroy it once; destroying an event whose work is
        // still pending is allowed (the driver releases it when the work completes).
        let _ = unsafe { sys::cuEventDestroy_v2(self.event) };
    }
}
