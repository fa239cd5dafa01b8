//! A diagnostic, not a check (`#[ignore]`d; run it by name with `--ignored`): what an abort
//! from another thread does to an NCCL operation whose comm stream is held behind a stream
//! that waits on a device word (`cuStreamWaitValue32`), so its NCCL kernel is queued, not
//! running. A device command that ran such a check among the others (2026-12-04) reached its
//! 600 s limit with nothing back; this one prints each step with its time as it happens, opens
//! the gate from its own thread after 8 s whatever happens, and waits for nothing unbounded.

use std::io::Write;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::Collective;
use kvlink::kv_device::cuda::cudarc::driver::sys as cu;
use kvlink::kv_device::cuda::{CudaDevice, CudaLayerEvent, DeviceBuffer};
use kvlink::kv_device::{DeviceRegion, SharedEvent};

#[allow(clippy::print_stderr)] // a diagnostic: its steps are its output
fn step(t0: Instant, what: &str) {
    eprintln!("[{:7.3} s] {what}", t0.elapsed().as_secs_f64());
    let _ = std::io::stderr().flush();
}

pub fn run() {
    let t0 = Instant::now();
    let cfg = NcclConfig {
        abort_grace: Duration::from_secs(2),
        ..NcclConfig::default()
    };
    let ranks = NcclGroup::new_in_process_with(&[0], cfg).expect("one NCCL rank");
    let coll = &ranks[0];
    let dev = CudaDevice::new(0).expect("GPU 0");
    let gate = DeviceBuffer::zeroed(dev.context(), 4, "gate").expect("gate");
    let data = DeviceBuffer::zeroed(dev.context(), 1 << 16, "data").expect("data");
    let held = dev.context().new_stream().expect("held stream");
    dev.bind().expect("bind");
    // SAFETY: `gate` is our live 4-byte device buffer; the stream waits until it holds 1.
    unsafe {
        cu::cuStreamWaitValue32_v2(
            held.cu_stream(),
            gate.ptr(),
            1,
            cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
        )
    }
    .result()
    .expect("cuStreamWaitValue32");
    let before: SharedEvent = CudaLayerEvent::record_on(&held, 0).expect("event");
    let region = DeviceRegion {
        ordinal: 0,
        addr: data.ptr(),
        len: data.len(),
    };
    step(t0, "gate closed; enqueueing a device broadcast after it");
    // SAFETY: `data` is our device buffer, untouched by other work; it is leaked below if the
    // broadcast's event never completes.
    let bcast = unsafe { coll.broadcast_device(region, Some(before), 0, far()) };
    step(
        t0,
        &format!("broadcast_device returned: ok = {}", bcast.is_ok()),
    );
    let gate_ptr = gate.ptr();
    let release_ctx = dev.context().clone();
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(Duration::from_secs(8));
            step(
                t0,
                "opening the gate (cuMemsetD32Async on a stream of its own)",
            );
            let r = release_ctx.new_stream().map(|st| {
                // SAFETY: `gate` is a live 4-byte device buffer (dropped only after this scope).
                unsafe { cu::cuMemsetD32Async(gate_ptr, 1, 1, st.cu_stream()) }.result()
            });
            step(t0, &format!("gate memset enqueued: {r:?}"));
        });
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(500));
            step(t0, "abort from another thread");
            coll.abort("diagnostic: abort while an operation waits behind the gate");
            step(t0, "abort returned");
        });
        step(
            t0,
            "all_gather_u64 (drains the held broadcast first), deadline 20 s",
        );
        let r = coll.all_gather_u64(
            1,
            kvlink::kv_loader::deadline_after(Duration::from_secs(20)),
        );
        step(t0, &format!("all_gather_u64 returned: {r:?}"));
    });
    let done = bcast
        .as_ref()
        .map(|ev| ev.wait_until(kvlink::kv_loader::deadline_after(Duration::from_secs(10))));
    step(
        t0,
        &format!("held broadcast's event after the gate opened: {done:?}"),
    );
    step(t0, &format!("handle broken: {:?}", coll.broken()));
    if !matches!(done, Ok(Ok(true))) {
        // The event may still complete later: its buffer must not be freed under it.
        std::mem::forget(data);
    }
    drop(ranks);
    step(t0, "handle dropped; done");
}

fn far() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}
