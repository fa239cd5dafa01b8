//! One GPU: its (primary) context, the load stream, and the copy kernels; the availability
//! check that runs before the first CUDA call.

use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaStream, DriverError};
use parking_lot::Mutex;

use super::kernels::{KernelSource, Kernels};
use crate::DeviceError;

/// A driver error as a [`DeviceError::Driver`] naming the call that failed.
pub(crate) fn drv(what: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |e| DeviceError::Driver(format!("{what}: {}", driver_error_text(e)))
}

/// `CUDA_ERROR_NAME (description)` for a driver error.
pub(crate) fn driver_error_text(e: DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

/// Checks, without any call that could panic, that this machine can run CUDA: the driver
/// library loads, `cuInit` succeeds and at least one device is visible. Returns the number of
/// devices.
///
/// cudarc loads `libcuda` lazily and **panics** when it is missing (e.g. `CudaContext::new`
/// on a machine without a driver); every constructor of this backend calls this first, so
/// such a machine gets [`DeviceError::Unavailable`] instead.
pub fn cuda_device_count() -> Result<u32, DeviceError> {
    // SAFETY: `is_culib_present` only tries to dlopen the candidate library names (and drops
    // the handles); it calls no CUDA function.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "CUDA unavailable: the driver library (libcuda.so.1) is not on this machine".into(),
        ));
    }
    result::init().map_err(|e| {
        DeviceError::Unavailable(format!(
            "CUDA unavailable: cuInit failed: {}",
            driver_error_text(e)
        ))
    })?;
    let n = result::device::get_count().map_err(|e| {
        DeviceError::Unavailable(format!(
            "CUDA unavailable: cuDeviceGetCount failed: {}",
            driver_error_text(e)
        ))
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
/// Cheap to share (`Arc`); every method binds the context to the calling thread first.
#[derive(Debug)]
pub struct CudaDevice {
    ordinal: u32,
    ctx: Arc<CudaContext>,
    load_stream: Arc<CudaStream>,
    kernels: Mutex<Option<Arc<Kernels>>>,
}

impl CudaDevice {
    /// Opens GPU `ordinal` (its primary context) and creates the load stream.
    /// [`DeviceError::Unavailable`] without a driver or device; never panics for that.
    pub fn new(ordinal: u32) -> Result<Arc<Self>, DeviceError> {
        let count = cuda_device_count()?;
        if ordinal >= count {
            return Err(DeviceError::Unavailable(format!(
                "CUDA device {ordinal} does not exist ({count} visible)"
            )));
        }
        let ctx = CudaContext::new(ordinal as usize).map_err(drv("cuDevicePrimaryCtxRetain"))?;
        let load_stream = ctx
            .new_stream()
            .map_err(drv("cuStreamCreate (load stream)"))?;
        Ok(Arc::new(CudaDevice {
            ordinal,
            ctx,
            load_stream,
            kernels: Mutex::new(None),
        }))
    }

    /// CUDA device ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// The device's primary context (cudarc), e.g. to create engine streams in it.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream host→device copies and scatters of loads are enqueued on.
    pub fn load_stream(&self) -> &Arc<CudaStream> {
        &self.load_stream
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> Result<String, DeviceError> {
        self.ctx.name().map_err(drv("cuDeviceGetName"))
    }

    /// Makes the context current on the calling thread (raw driver calls need it).
    pub fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(drv("cuCtxSetCurrent"))
    }

    /// Blocks until the load stream is idle.
    pub fn synchronize_load_stream(&self) -> Result<(), DeviceError> {
        self.load_stream
            .synchronize()
            .map_err(drv("cuStreamSynchronize (load stream)"))
    }

    /// The copy kernels, compiled on first use: NVRTC at run time when `libnvrtc` is present,
    /// otherwise the PTX shipped in the binary (the same source, compiled ahead). The
    /// environment variable `KVLINK_KERNELS=nvrtc|ptx` forces one.
    pub fn kernels(&self) -> Result<Arc<Kernels>, DeviceError> {
        let mut k = self.kernels.lock();
        if let Some(k) = k.as_ref() {
            return Ok(k.clone());
        }
        self.bind()?;
        let loaded = Arc::new(Kernels::load(&self.ctx, None)?);
        *k = Some(loaded.clone());
        Ok(loaded)
    }

    /// Loads the copy kernels from a given source (tests and benchmarks compare them); does not
    /// replace the cached ones.
    pub fn load_kernels(&self, source: KernelSource) -> Result<Kernels, DeviceError> {
        self.bind()?;
        Kernels::load(&self.ctx, Some(source))
    }
}
