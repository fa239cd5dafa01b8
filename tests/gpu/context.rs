//! kvlink's driver calls on an engine's thread leave the engine's own context current: a
//! thread with a non-primary context of the GPU current (an engine's) opens kvlink's device,
//! records, polls, waits on and drops kvlink's events, and allocates and frees its buffers,
//! and still finds its own context current after each. (Dropping the last handle of kvlink's
//! device, whose streams cudarc destroys with its context made current, is the documented
//! exception.)

use std::ptr::null_mut;

use kvlink::kv_device::cuda::cudarc::driver::sys as cu;
use kvlink::kv_device::cuda::{CudaDevice, CudaLayerEvent, DeviceBuffer, PinnedBuffer};
use kvlink::kv_device::Device;
use kvlink::kv_loader::StreamWaitable;
use kvlink_rig::report::{de, Report};

const SEC: &str = "context";

pub fn run(report: &mut Report) {
    report.check(
        SEC,
        "an engine thread's own context stays current after kvlink's event and buffer calls",
        engine_context_kept,
    );
}

fn current() -> Result<cu::CUcontext, String> {
    let mut c: cu::CUcontext = null_mut();
    // SAFETY: `c` is a valid out-pointer.
    unsafe { cu::cuCtxGetCurrent(&mut c) }
        .result()
        .map_err(|e| format!("cuCtxGetCurrent: {e}"))?;
    Ok(c)
}

/// The engine's context: a new (non-primary) context of GPU 0, current on this thread until
/// it drops (then destroyed).
struct EngineContext(cu::CUcontext);

impl EngineContext {
    fn new() -> Result<Self, String> {
        let mut dev: cu::CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer.
        unsafe { cu::cuDeviceGet(&mut dev, 0) }
            .result()
            .map_err(|e| format!("cuDeviceGet: {e}"))?;
        let mut ctx: cu::CUcontext = null_mut();
        // SAFETY: `ctx` is a valid out-pointer, no creation parameters (NULL is allowed);
        // the new context becomes current here.
        unsafe { cu::cuCtxCreate_v4(&mut ctx, null_mut(), 0, dev) }
            .result()
            .map_err(|e| format!("cuCtxCreate: {e}"))?;
        Ok(EngineContext(ctx))
    }
}

impl Drop for EngineContext {
    fn drop(&mut self) {
        // SAFETY: the context this value created, destroyed once.
        let _ = unsafe { cu::cuCtxDestroy_v2(self.0) };
    }
}

fn engine_context_kept() -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    let engine = EngineContext::new()?;
    let mut steps = Vec::new();
    let mut kept = |what: &'static str| -> Result<(), String> {
        let now = current()?;
        if now != engine.0 {
            return Err(format!(
                "after {what}, kvlink's context was left current ({now:?} instead of the \
                 engine's {:?}); kept through: {steps:?}",
                engine.0
            ));
        }
        steps.push(what);
        Ok(())
    };
    kept("creating the engine context")?;
    let opened = CudaDevice::new(0).map_err(de)?;
    kept("opening kvlink's device (CudaDevice::new)")?;
    let mem = opened.alloc(1 << 20, "test").map_err(de)?;
    kept("allocating through Device::alloc (zeroed on its stream)")?;
    drop(mem);
    kept("freeing it")?;
    let ev = CudaLayerEvent::record_on(dev.cuda_load_stream(), 0).map_err(de)?;
    kept("recording an event")?;
    ev.is_complete().map_err(de)?;
    kept("polling it")?;
    ev.synchronize().map_err(|e| e.to_string())?;
    kept("waiting for it")?;
    drop(ev);
    kept("dropping it")?;
    let buf = DeviceBuffer::zeroed(dev.context(), 1 << 20, "test").map_err(de)?;
    kept("allocating a zeroed device buffer")?;
    drop(buf);
    kept("freeing it")?;
    let pinned = PinnedBuffer::zeroed(dev.context(), 1 << 16, "test").map_err(de)?;
    kept("allocating pinned memory")?;
    drop(pinned);
    kept("freeing it")?;
    Ok(format!(
        "{} steps, the engine's context current after each",
        steps.len()
    ))
}
