//! One GPU: its (primary) context, the load stream, and the copy kernels; the availability
//! check that runs before the first CUDA call. [`CudaDevice`] is the CUDA backend of the
//! [`Device`] trait.

use std::sync::Arc;

use cudarc::driver::{result, CudaContext, CudaStream};

use super::current::{ContextRestore, Current, ThreadContext};
use super::error::{driver_error_text, drv};
use super::kernels::{KernelCache, KernelSource, Kernels};
use super::memory::{DeviceBuffer, PinnedBuffer};
use super::stream::CuStream;
use crate::staged::sync::SYNC_LIMIT;
use crate::{Device, DeviceError, DeviceMemory, DeviceRegion, PinnedMemory, Stream};

/// Checks, without any call that could panic, that this machine can run CUDA: the driver
/// library loads, `cuInit` succeeds and at least one device is visible. Returns the number of
/// devices.
///
/// cudarc loads `libcuda` lazily and **panics** when it is missing (e.g. `CudaContext::new`
/// on a machine without a driver); every constructor of this backend calls this first, so
/// such a machine gets an error for which [`DeviceError::is_unavailable`] is true instead
/// ([`DeviceError::Unavailable`] without the library, [`DeviceError::CudaUnavailable`] when
/// `cuInit` or `cuDeviceGetCount` fails).
pub fn cuda_device_count() -> Result<u32, DeviceError> {
    if !super::CudaLibrary::Driver.loadable() {
        return Err(DeviceError::Unavailable(
            "CUDA unavailable: the driver library (libcuda.so.1) is not on this machine".into(),
        ));
    }
    result::init().map_err(|source| DeviceError::CudaUnavailable {
        call: "cuInit",
        source,
    })?;
    let n = result::device::get_count().map_err(|source| DeviceError::CudaUnavailable {
        call: "cuDeviceGetCount",
        source,
    })?;
    if n <= 0 {
        return Err(DeviceError::Unavailable(
            "CUDA unavailable: no CUDA device is visible".into(),
        ));
    }
    Ok(n as u32)
}

/// One GPU as the loader uses it: the device's primary context (the one engines such as
/// candle use, so pointers and events are shared), a dedicated non-blocking **load stream**
/// for host→device copies and scatters, and the copy kernels (loaded on first use).
///
/// Cheap to share (`Arc`); every method makes the context current on the calling thread for
/// its own driver calls and leaves the thread's own current context (or none) as it found it
/// ([`bind`](Self::bind) alone leaves it bound).
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: u32,
    /// The device's name, read once when opened (cudarc's `name()` would also consume an
    /// error one of its drops recorded, and answer with it: two devices of one GPU must
    /// name it alike, as landings compare them).
    name: String,
    /// kvlink's handle of the primary context: cudarc's event tracking off (below).
    ctx: Arc<CudaContext>,
    /// The engine's handle of the same primary context, tracking on (cudarc's default): what
    /// [`context`](Self::context) hands out, so that `CudaSlice`s made through it stay ordered.
    engine_ctx: Arc<CudaContext>,
    load_stream: Arc<CuStream>,
    /// Where new device memory is zeroed (waited for before `alloc` returns), apart from the
    /// load stream so an allocation never waits behind a landing's copies.
    zero_stream: Arc<CudaStream>,
    kernels: Arc<KernelCache>,
    /// Last: the thread's own context current again after the streams, the kernels and the
    /// context dropped (cudarc's drops make kvlink's context current for good).
    restore: ContextRestore,
}

impl Drop for CudaDevice {
    /// The fields drop after this, the `restore` field last: it makes the thread's own
    /// context current again after cudarc destroyed the streams (and released the context)
    /// with kvlink's made current.
    fn drop(&mut self) {
        self.restore.save();
    }
}

impl CudaDevice {
    /// Opens GPU `ordinal` (its primary context) and creates the load stream.
    /// An error with [`DeviceError::is_unavailable`] true without a driver or device;
    /// [`DeviceError::NoSuchDevice`] for an ordinal past the devices visible (a configuration
    /// error, not a machine without CUDA); never panics for either.
    pub fn new(ordinal: u32) -> Result<Arc<Self>, DeviceError> {
        let count = cuda_device_count()?;
        if count == 0 {
            return Err(DeviceError::Unavailable("no CUDA device is visible".into()));
        }
        if ordinal >= count {
            return Err(DeviceError::NoSuchDevice {
                ordinal,
                visible: count,
            });
        }
        // cudarc makes the new context current for good: the thread's own comes back after.
        let _thread = ThreadContext::save().map_err(drv("cuCtxGetCurrent"))?;
        let ctx = CudaContext::new(ordinal as usize).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        // cudarc's event tracking makes the context's first `new_stream` synchronise the whole
        // primary context (`cuCtxSynchronize`), which the engine shares: it would wait, with no
        // bound, for every kernel the engine has queued.
        // SAFETY: tracking only orders cudarc's `CudaSlice` uses across streams; this crate
        // makes none (its allocations are raw, `cuda::memory`, ordered by its own events), so
        // nothing relies on it. This handle leaves the crate only through the `unsafe`
        // accessors below, whose callers take on the same duty; the safe `context` hands out a
        // second handle of the same context with tracking on.
        unsafe { ctx.disable_event_tracking() };
        let engine_ctx =
            CudaContext::new(ordinal as usize).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let name = cudarc::driver::result::device::get_name(ctx.cu_device())
            .unwrap_or_else(|e| format!("CUDA device {ordinal} ({})", driver_error_text(e)));
        let kernels = Arc::new(KernelCache::new(ctx.clone()));
        let stream = ctx
            .new_stream()
            .map_err(drv("cuStreamCreate (load stream)"))?;
        let zero_stream = ctx
            .new_stream()
            .map_err(drv("cuStreamCreate (zeroing stream)"))?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            load_stream: Arc::new(CuStream::new(stream, kernels.clone())),
            zero_stream,
            name,
            ctx,
            engine_ctx,
            kernels,
            restore: ContextRestore::default(),
        }))
    }

    /// The device's primary context as a cudarc handle for the engine's own use (streams,
    /// `CudaSlice`s): cudarc's event tracking is on in it, as by default, so its slices stay
    /// ordered across streams (its first `new_stream` synchronizes the context once, as any
    /// tracked cudarc context's does). Raw memory of this crate (`DeviceBuffer`,
    /// `PinnedBuffer`) may be made through it too.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.engine_ctx
    }

    /// kvlink's own handle of the primary context, cudarc's event tracking off (so that
    /// making a stream in it never synchronizes the context the engine shares): for kvlink's
    /// crates and benchmarks that make streams, events and raw memory in it.
    ///
    /// # Safety
    /// cudarc does not order a `CudaSlice` of this handle (or of a stream made from it)
    /// across streams: the caller makes none, or orders every use of each on another stream
    /// itself (events) and drops none while such a use may still run.
    pub unsafe fn untracked_context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The load stream as a cudarc stream (for timing events and raw copies in benchmarks).
    ///
    /// # Safety
    /// As for [`untracked_context`](Self::untracked_context): the stream belongs to that
    /// handle.
    pub unsafe fn cuda_load_stream(&self) -> &Arc<CudaStream> {
        self.load_stream.cuda()
    }

    /// An event recorded on the engine's stream `stream` after the work enqueued on it so far
    /// (the compute that wrote the pages a save gathers): what
    /// `Linker::save_after` orders the gather after, device-side. Safe: `RawStream`'s
    /// constructor carries the promise that it is a live stream of this process (a stream of
    /// another context is refused by the driver: an error, not undefined behaviour).
    ///
    /// The special handles 0 (the default stream), 1 (legacy) and 2 (per-thread) name a
    /// stream of whichever context is current: on a thread whose current context is not
    /// this device's they are refused ([`DeviceError::Unsupported`]), since the event would
    /// land on this context's default stream and not cover the engine's work. (Through the
    /// `Device` trait, what `KvLoader::save_after_stream` calls, handle 2 is refused on every
    /// thread: it names the calling thread's own stream, and that save runs off the thread
    /// that computed. Here, on the engine's own thread, it is its stream.)
    pub fn record_on(
        &self,
        stream: kv_loader::RawStream,
    ) -> Result<crate::SharedEvent, DeviceError> {
        if super::event::default_stream_of_another_context(stream, &self.ctx)? {
            return Err(DeviceError::Unsupported(
                "recording on the default stream (handle 0, 1 or 2) of a thread whose \
                 current context is not kvlink's: name the engine's stream itself",
            ));
        }
        // SAFETY: `RawStream::from_raw`'s caller vouched that the handle is a live stream (or a
        // default stream handle, checked above to be on kvlink's context).
        let ev = unsafe {
            super::event::CudaLayerEvent::record_raw(
                &self.ctx,
                stream.as_raw() as cudarc::driver::sys::CUstream,
                u32::MAX,
            )
        }?;
        Ok(ev)
    }

    /// Makes the context current on the calling thread, and leaves it current (raw driver
    /// calls need it). kvlink's own calls on an engine's thread do not leave it current:
    /// they make it current for the call and give the thread its own context back.
    pub fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    /// Waits until the load stream's work so far is done, at most a minute (polling an event;
    /// never an unbounded `cuStreamSynchronize`).
    pub fn synchronize_load_stream(&self) -> Result<(), DeviceError> {
        let ev = self.load_stream.record()?;
        if ev.wait_until(kv_loader::deadline_after(SYNC_LIMIT))? {
            Ok(())
        } else {
            Err(DeviceError::Timeout {
                what: "load stream",
                waited: SYNC_LIMIT,
            })
        }
    }

    /// The copy kernels, compiled on first use: NVRTC at run time when `libnvrtc` is present,
    /// otherwise the PTX shipped in the binary (the same source, compiled ahead). The
    /// environment variable `KVLINK_KERNELS=nvrtc|ptx` forces one.
    pub fn kernels(&self) -> Result<Arc<Kernels>, DeviceError> {
        self.kernels.get()
    }

    /// Loads the copy kernels from a given source (tests and benchmarks compare them); does not
    /// replace the cached ones.
    pub fn load_kernels(&self, source: KernelSource) -> Result<Kernels, DeviceError> {
        let _current = Current::of(&self.ctx)?;
        Kernels::load(&self.ctx, Some(source))
    }
}

// SAFETY: `alloc` and `alloc_pinned` return the driver's allocations of `len` bytes (below);
// `load_stream` clones the one stream made with the device; the ordinal is the GPU's, and
// every `CudaDevice` of one ordinal is on that GPU (its primary context).
unsafe impl Device for CudaDevice {
    fn ordinal(&self) -> u32 {
        self.ordinal
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn alloc(&self, len: usize, what: &'static str) -> Result<DeviceMemory, DeviceError> {
        let buf = DeviceBuffer::zeroed_on(&self.zero_stream, len, what, SYNC_LIMIT)?;
        let region = DeviceRegion {
            ordinal: self.ordinal,
            addr: buf.ptr(),
            len,
        };
        // SAFETY: `buf` owns this cuMemAlloc allocation of at least `len` bytes of this GPU,
        // frees it once when dropped, and nothing else holds the address.
        Ok(unsafe { DeviceMemory::from_owner(region, Box::new(buf)) })
    }

    fn alloc_pinned(&self, len: usize, what: &'static str) -> Result<PinnedMemory, DeviceError> {
        let buf = PinnedBuffer::zeroed(&self.ctx, len, what)?;
        let addr = buf.addr();
        // SAFETY: `buf` owns this cuMemHostAlloc allocation of at least `len` bytes, frees it
        // once when dropped, and nothing else holds the address.
        Ok(unsafe { PinnedMemory::from_owner(addr, len, Box::new(buf)) })
    }

    fn load_stream(&self) -> Arc<dyn Stream> {
        self.load_stream.clone()
    }

    fn new_stream(&self) -> Result<Arc<dyn Stream>, DeviceError> {
        let _current = Current::of(&self.ctx)?;
        let stream = self.ctx.new_stream().map_err(drv("cuStreamCreate"))?;
        Ok(Arc::new(CuStream::new(stream, self.kernels.clone())))
    }

    /// [`CudaDevice::record_on`] (the inherent method: its rules for the default-stream
    /// handles hold), refusing the per-thread handle 2 on every thread: it names the calling
    /// thread's own stream, and a save through the trait runs off the thread that computed.
    fn record_on(&self, stream: kv_loader::RawStream) -> Result<crate::SharedEvent, DeviceError> {
        if stream.as_raw() == 2 {
            return Err(DeviceError::Unsupported(
                "recording on the per-thread default stream (handle 2), which names the \
                 calling thread's own: name the engine's stream itself",
            ));
        }
        CudaDevice::record_on(self, stream)
    }
}
