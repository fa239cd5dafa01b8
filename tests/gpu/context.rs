//! kvlink's driver calls on an engine's thread leave the engine's own context current: a
//! thread with a non-primary context of the GPU current (an engine's) opens kvlink's device,
//! records, polls, waits on and drops kvlink's events, and allocates and frees its buffers,
//! and still finds its own context current after each, also when what it drops holds the last
//! handle on kvlink's device or context (cudarc's drops of a stream, a module or a context make
//! that context current with `cuCtxSetCurrent`).

use std::ptr::null_mut;
use std::time::{Duration, Instant};

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
    report.check(
        SEC,
        "an engine thread with no context has none after kvlink's event calls",
        no_context_stays_none,
    );
    report.check(
        SEC,
        "opening kvlink's device does not wait for the engine's queued work",
        opening_does_not_wait_for_engine_work,
    );
    report.check(
        SEC,
        "the context handed to the engine keeps cudarc's event tracking; kvlink's own does not",
        engine_context_is_tracked,
    );
    report.check(
        SEC,
        "an event on the default stream is refused where another context is current",
        default_stream_of_another_context_refused,
    );
    report.check(
        SEC,
        "a wait on the default stream is refused where another context is current",
        default_stream_wait_of_another_context_refused,
    );
}

/// Before, a layer event's wait on stream handle 0 on a thread running another context (a
/// pooled thread that served another GPU) was queued on that context's default stream:
/// `Ok`, and the engine's attention on this GPU ordered after nothing.
fn default_stream_wait_of_another_context_refused() -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    // SAFETY: events and raw copies of this crate's memory on the load stream: no
    // `CudaSlice` is made through it.
    let ev = std::sync::Arc::new(
        CudaLayerEvent::record_on(unsafe { dev.cuda_load_stream() }, 0).map_err(de)?,
    );
    let theirs = ev.clone();
    std::thread::spawn(move || -> Result<(), String> {
        let _engine = EngineContext::new()?;
        for handle in [0, 1, 2] {
            // SAFETY: 0, 1 and 2 are the default stream handles, live in every context.
            let default = unsafe { kvlink::kv_loader::RawStream::from_raw(handle) };
            match theirs.wait_on_stream(default) {
                Err(kvlink::kv_loader::KvLoadError::Config(_)) => {}
                other => return Err(format!("handle {handle} under another context: {other:?}")),
            }
        }
        Ok(())
    })
    .join()
    .map_err(|_| "the engine thread panicked".to_string())??;
    std::thread::spawn(move || -> Result<(), String> {
        // SAFETY: as above.
        let default = unsafe { kvlink::kv_loader::RawStream::from_raw(0) };
        ev.wait_on_stream(default).map_err(|e| e.to_string())
    })
    .join()
    .map_err(|_| "a thread panicked".to_string())??;
    Ok(
        "handles 0, 1, 2 refused under another context; handle 0 waited on a thread with none"
            .into(),
    )
}

/// Before, `record_on` with stream handle 0 on a thread running another context recorded on
/// kvlink's context's default stream: an event that completed at once, covering none of the
/// engine's work (a save would gather pages not yet written).
fn default_stream_of_another_context_refused() -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    // SAFETY: 0 is the default stream, live in every context.
    let default = unsafe { kvlink::kv_loader::RawStream::from_raw(0) };
    let theirs = std::thread::spawn(move || -> Result<String, String> {
        let _engine = EngineContext::new()?;
        match dev.record_on(default) {
            Err(kvlink::kv_device::DeviceError::Unsupported(_)) => Ok(()),
            other => Err(format!(
                "with another context current: {:?}",
                other.map(|_| "an event")
            )),
        }?;
        // SAFETY: 2 is the per-thread default stream handle, live in every context.
        let per_thread = unsafe { kvlink::kv_loader::RawStream::from_raw(2) };
        let plain = std::thread::spawn(move || -> Result<(), String> {
            dev.record_on(default).map(drop).map_err(de)?;
            // Through the trait (a save through `KvLoader::save_after_stream`).
            match kvlink::kv_device::Device::record_on(&*dev, per_thread) {
                Err(kvlink::kv_device::DeviceError::Unsupported(_)) => Ok(()),
                other => Err(format!("handle 2: {:?}", other.map(|_| "an event"))),
            }
        })
        .join()
        .map_err(|_| "a thread panicked".to_string())?;
        plain.map(|()| {
            "refused under another context; recorded on a thread with none; the per-thread \
             handle refused through the trait"
                .into()
        })
    });
    theirs
        .join()
        .map_err(|_| "the engine thread panicked".to_string())?
}

/// Before, `context()` handed out kvlink's handle, event tracking off: an engine's
/// `CudaSlice`s made through it were not ordered across streams by cudarc (a slice dropped
/// while another stream's copy into it ran could be reused under it), from safe code.
fn engine_context_is_tracked() -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    // SAFETY: only asked whether tracking is on: nothing is made through it.
    let own = unsafe { dev.untracked_context() }.is_event_tracking();
    let engine = dev.context().is_event_tracking();
    if !engine || own {
        return Err(format!(
            "event tracking: the engine's handle {engine}, kvlink's {own} (want true, false)"
        ));
    }
    Ok("the engine's handle tracks events; kvlink's does not".into())
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

/// A thread that never touched CUDA (an engine's scheduler) waits on, polls and drops a clone
/// of kvlink's layer event, opens kvlink's device, allocates and drops the last handles on
/// it: afterwards it still has no current context. Before, kvlink's
/// context was bound to it for good, so the engine's later runtime calls on that thread went
/// to kvlink's GPU instead of device 0.
fn no_context_stays_none() -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    // SAFETY: events and raw copies of this crate's memory on the load stream: no
    // `CudaSlice` is made through it.
    let ev = std::sync::Arc::new(
        CudaLayerEvent::record_on(unsafe { dev.cuda_load_stream() }, 0).map_err(de)?,
    );
    let theirs = ev.clone();
    std::thread::spawn(move || -> Result<(), String> {
        let none = |what: &str| -> Result<(), String> {
            let now = current()?;
            if now.is_null() {
                Ok(())
            } else {
                Err(format!(
                    "after {what}, a context ({now:?}) is current on a thread that had none"
                ))
            }
        };
        none("starting the thread")?;
        theirs.is_complete().map_err(de)?;
        none("polling kvlink's event")?;
        theirs.synchronize().map_err(|e| e.to_string())?;
        none("waiting for it")?;
        drop(theirs);
        none("dropping a clone of it")?;
        let own = CudaDevice::new(0).map_err(de)?;
        none("opening kvlink's device")?;
        let buf = DeviceBuffer::zeroed(own.context(), 1 << 16, "test").map_err(de)?;
        none("allocating a zeroed device buffer")?;
        drop(own);
        drop(buf);
        none("dropping them")
    })
    .join()
    .map_err(|_| "the engine thread panicked".to_string())??;
    drop(ev);
    Ok("no context current after polling, waiting, dropping, opening and freeing".into())
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
    // SAFETY: events and raw copies of this crate's memory on the load stream: no
    // `CudaSlice` is made through it.
    let ev = CudaLayerEvent::record_on(unsafe { dev.cuda_load_stream() }, 0).map_err(de)?;
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
    let stream = dev.new_stream().map_err(de)?;
    kept("creating a stream of kvlink's device")?;
    drop(stream);
    kept("destroying it")?;
    drop((dev, opened));
    kept("dropping kvlink's devices")?;
    // Handles that outlive their device, each kind dropped last in a round of its own: that
    // drop releases the last handle on kvlink's context (and kernels), which cudarc does with
    // the context made current.
    for last in [
        "event",
        "device buffer",
        "pinned buffer",
        "stream",
        "kernels",
    ] {
        let dev = CudaDevice::new(0).map_err(de)?;
        let mut held: Vec<(&str, Box<dyn std::any::Any>)> = vec![
            (
                "event",
                Box::new(
                    CudaLayerEvent::record_on(
                        // SAFETY: an event on the load stream: no `CudaSlice` is made through it.
                        unsafe { dev.cuda_load_stream() },
                        0,
                    )
                    .map_err(de)?,
                ),
            ),
            (
                "device buffer",
                Box::new(DeviceBuffer::zeroed(dev.context(), 1 << 20, "test").map_err(de)?),
            ),
            (
                "pinned buffer",
                Box::new(PinnedBuffer::zeroed(dev.context(), 1 << 16, "test").map_err(de)?),
            ),
            ("stream", Box::new(dev.new_stream().map_err(de)?)),
            ("kernels", Box::new(dev.kernels().map_err(de)?)),
        ];
        dev.load_stream()
            .record()
            .map_err(de)?
            .synchronize()
            .map_err(|e| e.to_string())?;
        drop(dev);
        // Every other handle first, then `last`, which holds the context alone.
        let at = held.iter().position(|(name, _)| *name == last).unwrap_or(0);
        let kept_last = held.remove(at);
        drop(held);
        kept("dropping the device and every other handle that outlived it")?;
        drop(kept_last);
        kept(match last {
            "event" => "dropping an event that held kvlink's context last",
            "device buffer" => "freeing a device buffer that held kvlink's context last",
            "pinned buffer" => "freeing pinned memory that held kvlink's context last",
            "stream" => "destroying a stream that held kvlink's context last",
            _ => "dropping the kernels, which held kvlink's context last",
        })?;
    }
    Ok(format!(
        "{} steps, the engine's context current after each",
        steps.len()
    ))
}

/// How long the engine's queued work takes (a host function that sleeps, on its stream).
const ENGINE_WORK: Duration = Duration::from_secs(3);

/// The engine's queued work: sleeps [`ENGINE_WORK`] on the stream's host-function thread.
unsafe extern "C" fn engine_work(_: *mut std::ffi::c_void) {
    std::thread::sleep(ENGINE_WORK);
}

/// A stream of the engine's in GPU 0's primary context (the one kvlink's device shares), with
/// [`ENGINE_WORK`] queued on it; synchronised, destroyed and the context released on drop.
struct EngineStream {
    dev: cu::CUdevice,
    stream: cu::CUstream,
}

impl EngineStream {
    fn busy() -> Result<Self, String> {
        let mut dev: cu::CUdevice = 0;
        // SAFETY: `dev` is a valid out-pointer.
        unsafe { cu::cuDeviceGet(&mut dev, 0) }
            .result()
            .map_err(|e| format!("cuDeviceGet: {e}"))?;
        let mut ctx: cu::CUcontext = null_mut();
        // SAFETY: `ctx` is a valid out-pointer; released in drop.
        unsafe { cu::cuDevicePrimaryCtxRetain(&mut ctx, dev) }
            .result()
            .map_err(|e| format!("cuDevicePrimaryCtxRetain: {e}"))?;
        let mut stream: cu::CUstream = null_mut();
        // SAFETY: the retained primary context is made current on this thread (a test
        // thread), then a stream created in it, `stream` a valid out-pointer.
        unsafe {
            cu::cuCtxSetCurrent(ctx)
                .result()
                .map_err(|e| format!("cuCtxSetCurrent: {e}"))?;
            cu::cuStreamCreate(
                &mut stream,
                cu::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
            )
            .result()
            .map_err(|e| format!("cuStreamCreate: {e}"))?;
        }
        let s = EngineStream { dev, stream };
        // SAFETY: a live stream; the function takes no argument and touches no memory.
        unsafe { cu::cuLaunchHostFunc(s.stream, Some(engine_work), null_mut()) }
            .result()
            .map_err(|e| format!("cuLaunchHostFunc: {e}"))?;
        Ok(s)
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        // SAFETY: the stream this value created, synchronised then destroyed once; the
        // primary context it retained released once.
        unsafe {
            let _ = cu::cuStreamSynchronize(self.stream);
            let _ = cu::cuStreamDestroy_v2(self.stream);
            let _ = cu::cuDevicePrimaryCtxRelease_v2(self.dev);
        }
    }
}

/// cudarc synchronised the whole primary context at a new context's first stream: opening
/// kvlink's device waited for every kernel an engine had queued (for ever behind one that
/// hangs).
fn opening_does_not_wait_for_engine_work() -> Result<String, String> {
    let engine = EngineStream::busy()?;
    let t0 = Instant::now();
    let dev = CudaDevice::new(0).map_err(de)?;
    let took = t0.elapsed();
    let stream = dev.new_stream().map_err(de)?;
    let all = t0.elapsed();
    drop((stream, dev, engine));
    if all >= ENGINE_WORK / 2 {
        return Err(format!(
            "opening the device took {took:?} and a stream {all:?}, beside {ENGINE_WORK:?} of \
             engine work: it waited for it"
        ));
    }
    Ok(format!(
        "opened in {took:?}, a stream by {all:?}, beside {ENGINE_WORK:?} of engine work"
    ))
}
