//! An NCCL operation on host memory is not held by work on the legacy default stream. Engines
//! (candle, torch) compute on their context's default stream; a host all-gather (the lookup's
//! and the gate's control words) must end by its own deadline whatever that stream is doing.
//! Until 2026-12-04 the comm thread copied the result back with a synchronous `cuMemcpyDtoH`,
//! which runs on the legacy default stream and so waited behind every blocking stream's work,
//! with no deadline. The check holds the legacy default stream behind a device word
//! (`cuStreamWaitValue32`) and runs a one-rank host all-gather. A thread of its own opens the
//! gate after [`GATE_OPENS_AFTER`] whatever happens, so nothing here waits unbounded.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::NcclGroup;
use kvlink::dedup_broadcast::{Collective, CollectiveError};
use kvlink::kv_device::cuda::cudarc::driver::sys as cu;
use kvlink::kv_device::cuda::{CudaDevice, DeviceBuffer};
use kvlink_rig::report::Report;

const SEC: &str = "nccl";
/// The all-gather's own deadline, while the default stream is held.
const DEADLINE: Duration = Duration::from_secs(4);
/// The gate opens by then at the latest (after the all-gather's deadline and grace).
const GATE_OPENS_AFTER: Duration = Duration::from_secs(8);
/// What "at once" means for a one-rank all-gather of 8 bytes.
const AT_ONCE: Duration = Duration::from_secs(1);

fn ce(e: CollectiveError) -> String {
    e.to_string()
}

/// A driver or device error as text (the gate's own calls).
fn de(e: impl std::fmt::Display) -> String {
    e.to_string()
}

pub fn run(report: &mut Report) {
    report.check(
        SEC,
        "1 rank: host all-gather while the legacy default stream is held: done at once",
        held_default_stream,
    );
}

fn held_default_stream() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process(&[0]).map_err(ce)?;
    let coll = &ranks[0];
    // The first operation allocates the comm thread's device scratch and pinned stage.
    let warm = kvlink::kv_loader::deadline_after(Duration::from_secs(30));
    coll.all_gather_u64(1, warm).map_err(ce)?;
    let dev = CudaDevice::new(0).map_err(de)?;
    let gate = DeviceBuffer::zeroed(dev.context(), 4, "gate").map_err(de)?;
    // Made before the gate closes: a context's first stream may synchronize the context.
    let opener = dev.context().new_stream().map_err(de)?;
    dev.bind().map_err(de)?;
    // SAFETY: `gate` is our live 4-byte device buffer, dropped only after the legacy default
    // stream has passed the wait (synchronized below) or leaked; the null stream is the
    // legacy default stream of the current context (bound above).
    unsafe {
        cu::cuStreamWaitValue32_v2(
            std::ptr::null_mut(),
            gate.ptr(),
            1,
            cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
        )
    }
    .result()
    .map_err(de)?;
    let gate_ptr = gate.ptr();
    let (open_now, asked) = mpsc::channel::<()>();
    let (r, took, opened) = std::thread::scope(|s| {
        let opening = s.spawn(move || {
            let _ = asked.recv_timeout(GATE_OPENS_AFTER);
            // SAFETY: `gate` is a live 4-byte device buffer (dropped only after this scope);
            // `opener` is a non-blocking stream, not ordered after the held default stream.
            unsafe { cu::cuMemsetD32Async(gate_ptr, 1, 1, opener.cu_stream()) }.result()
        });
        let t0 = Instant::now();
        let r = coll.all_gather_u64(2, kvlink::kv_loader::deadline_after(DEADLINE));
        let took = t0.elapsed();
        let _ = open_now.send(());
        let opened = opening
            .join()
            .map_err(|_| "the gate's thread panicked".to_string());
        (r, took, opened)
    });
    let passed = opened.and_then(|o| o.map_err(de)).and_then(|()| {
        // SAFETY: a plain synchronize of the legacy default stream, which the open gate
        // releases (the memset above was enqueued on a stream it does not wait for).
        unsafe { cu::cuStreamSynchronize(std::ptr::null_mut()) }
            .result()
            .map_err(de)
    });
    if let Err(e) = passed {
        // The default stream may still wait on the gate: its memory must not be freed.
        std::mem::forget(gate);
        return Err(format!("the gate did not open: {e}"));
    }
    match r {
        Ok(v) if v == [2] && took < AT_ONCE => Ok(format!(
            "all-gather done in {:.1} ms with the default stream held",
            took.as_secs_f64() * 1e3
        )),
        other => Err(format!(
            "expected [2] within {AT_ONCE:?}, got {other:?} after {:.2} s (held behind the \
             default stream)",
            took.as_secs_f64()
        )),
    }
}
