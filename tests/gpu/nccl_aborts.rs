//! NCCL failures end by their deadlines: an initialisation with a rank that never joins times
//! out, and on two GPUs a rank that never issues makes its peer time out, abort, and the late
//! rank fail instead of hang. An abort from another thread ends an operation already in
//! flight at once (one GPU: the comm stream held behind a stream that waits on a device word;
//! two GPUs: a peer that never issues), not at that operation's deadline.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{nccl_unique_id, NcclCollective, NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::{Collective, CollectiveError};
use kvlink::kv_device::cuda::cudarc::driver::sys as cu;
use kvlink::kv_device::cuda::{CudaDevice, CudaLayerEvent, DeviceBuffer};
use kvlink::kv_device::{DeviceRegion, SharedEvent};
use kvlink_rig::report::{de, Report, Status};

const SEC: &str = "nccl";

fn ce(e: CollectiveError) -> String {
    e.to_string()
}

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

/// The checks that abort communicators: a test of their own (the gpu target runs its tests
/// one at a time, `--test-threads=1`), so an abort cannot disturb another test's
/// communicators.
pub fn run_aborts(gpus: u32, report: &mut Report) {
    report.check(
        SEC,
        "init with a rank that never joins: Timeout, no hang",
        init_timeout,
    );
    report.check(
        SEC,
        "abort from another thread ends the operation in flight (comm stream held)",
        abort_in_flight_one_gpu,
    );
    if gpus >= 2 {
        report.check(
            SEC,
            "2 ranks: rank 1 never issues: Timeout then Aborted",
            two_ranks_timeout,
        );
        report.check(
            SEC,
            "2 ranks: rank 1 never issues, rank 0 aborted from another thread: Aborted at once",
            two_ranks_abort_in_flight,
        );
    } else {
        report.push(
            SEC,
            "2 ranks: a rank that never issues",
            Status::Skip,
            format!("{gpus} GPU visible; needs 2"),
        );
    }
}

fn init_timeout() -> Result<String, String> {
    let id = nccl_unique_id().map_err(ce)?;
    let cfg = NcclConfig {
        init_timeout: Duration::from_secs(3),
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let t0 = Instant::now();
    let r = NcclCollective::join(id, 0, 2, 0, cfg);
    let took = t0.elapsed();
    match r {
        Err(CollectiveError::Timeout { .. }) if took < Duration::from_secs(20) => Ok(format!(
            "Timeout after {:.1} s (limit 3 s + abort)",
            took.as_secs_f64()
        )),
        Err(e) => Err(format!("expected Timeout, got {e} after {took:?}")),
        Ok(_) => Err("a group of 2 with one rank formed".into()),
    }
}

fn two_ranks_timeout() -> Result<String, String> {
    let cfg = NcclConfig {
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let ranks = NcclGroup::new_in_process_with(&[0, 1], cfg).map_err(ce)?;
    // Both ranks once (so connections exist), then rank 0 alone.
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for coll in &ranks {
            let b = &barrier;
            s.spawn(move || {
                let _ = coll.all_gather_u64(1, soon());
                b.wait();
            });
        }
    });
    let t0 = Instant::now();
    let r = ranks[0].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    let took = t0.elapsed();
    let first = match r {
        Err(e @ CollectiveError::Timeout { .. }) => e.to_string(),
        other => return Err(format!("expected Timeout, got {other:?}")),
    };
    let next = match ranks[0].all_gather_u64(3, soon()) {
        Err(e @ CollectiveError::Aborted { .. }) => e.to_string(),
        other => return Err(format!("expected Aborted after the abort, got {other:?}")),
    };
    // Rank 1 issues late: its peer aborted, so it must fail by its own deadline, not hang.
    let t1 = Instant::now();
    let late =
        ranks[1].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    if late.is_ok() {
        return Err("rank 1 completed against an aborted peer".into());
    }
    Ok(format!(
        "rank 0: {first} after {:.1} s; then {next}; rank 1 late: failed after {:.1} s",
        took.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    ))
}

/// How long an operation in flight may take to end after an abort from another thread: the
/// comm thread's drain wait after `ncclCommAbort` (`abort_grace`, 2 s here) and slack. The
/// operation's own deadline is 20 s, so an abort that waited for it shows.
const ABORTED_WITHIN: Duration = Duration::from_secs(6);
const IN_FLIGHT_DEADLINE: Duration = Duration::from_secs(20);

fn short_grace() -> NcclConfig {
    NcclConfig {
        abort_grace: Duration::from_secs(2),
        ..NcclConfig::default()
    }
}

/// Runs `op` on this thread and `coll.abort` on another after `after`; the op's result and how
/// long it took.
fn abort_during<T>(
    coll: &NcclCollective,
    after: Duration,
    op: impl FnOnce() -> T,
) -> (T, Duration) {
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(after);
            coll.abort("test: abort from another thread");
        });
        let t0 = Instant::now();
        let r = op();
        (r, t0.elapsed())
    })
}

fn aborted_in_time<T: std::fmt::Debug>(
    r: Result<T, CollectiveError>,
    took: Duration,
) -> Result<String, String> {
    match r {
        Err(e @ CollectiveError::Aborted { .. }) if took < ABORTED_WITHIN => Ok(format!(
            "{e} after {:.2} s (abort at 0.5 s, deadline {} s)",
            took.as_secs_f64(),
            IN_FLIGHT_DEADLINE.as_secs()
        )),
        other => Err(format!(
            "expected Aborted within {ABORTED_WITHIN:?}, got {other:?} after {:.2} s",
            took.as_secs_f64()
        )),
    }
}

/// One rank on one GPU: a device broadcast ordered after an event of a stream that waits for
/// a device word (`cuStreamWaitValue32`) holds the comm stream, so the next host operation
/// waits in the comm thread (it drains the broadcast first) until its deadline, unless the
/// abort from another thread ends it.
fn abort_in_flight_one_gpu() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process_with(&[0], short_grace()).map_err(ce)?;
    let coll = &ranks[0];
    let dev = CudaDevice::new(0).map_err(de)?;
    let gate = DeviceBuffer::zeroed(dev.context(), 4, "test gate").map_err(de)?;
    let data = DeviceBuffer::zeroed(dev.context(), 1 << 16, "test data").map_err(de)?;
    let held = dev.context().new_stream().map_err(|e| e.to_string())?;
    dev.bind().map_err(de)?;
    // SAFETY: `gate` is our live 4-byte device buffer (0); the stream waits until it holds 1,
    // which the release below writes.
    unsafe {
        cu::cuStreamWaitValue32_v2(
            held.cu_stream(),
            gate.ptr(),
            1,
            cu::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_EQ as u32,
        )
    }
    .result()
    .map_err(|e| format!("cuStreamWaitValue32: {e}"))?;
    let before: SharedEvent = CudaLayerEvent::record_on(&held, 0).map_err(de)?;
    let region = DeviceRegion {
        ordinal: 0,
        addr: data.ptr(),
        len: data.len(),
    };
    // SAFETY: `data` is our device buffer on GPU 0, untouched by other work until the returned
    // event completes (waited for below, after the release, before `data` drops).
    let bcast = unsafe { coll.broadcast_device(region, Some(before), 0, soon()) };
    let (r, took) = abort_during(coll, Duration::from_millis(500), || {
        coll.all_gather_u64(1, kvlink::kv_loader::deadline_after(IN_FLIGHT_DEADLINE))
    });
    // Release the held stream, whatever happened, so nothing of the GPU stays waiting.
    let release = dev.context().new_stream().map_err(|e| e.to_string())?;
    // SAFETY: `gate` is our live 4-byte device buffer; one 32-bit word is set.
    unsafe { cu::cuMemsetD32Async(gate.ptr(), 1, 1, release.cu_stream()) }
        .result()
        .map_err(|e| format!("cuMemsetD32Async: {e}"))?;
    release.synchronize().map_err(|e| e.to_string())?;
    held.synchronize().map_err(|e| e.to_string())?;
    if let Ok(ev) = &bcast {
        if !ev.wait_until(soon()).map_err(de)? {
            return Err("the held broadcast did not end after the release".into());
        }
    }
    bcast.map_err(ce)?;
    let verdict = aborted_in_time(r, took)?;
    match coll.broken() {
        Some(_) => Ok(verdict),
        None => Err(format!("{verdict}; but the handle is not broken")),
    }
}

/// Two GPUs: rank 1 never issues, so rank 0's all-gather waits in NCCL until its deadline,
/// unless the abort from another thread ends it.
fn two_ranks_abort_in_flight() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process_with(&[0, 1], short_grace()).map_err(ce)?;
    // Both ranks once (so connections exist), then rank 0 alone.
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for coll in &ranks {
            let b = &barrier;
            s.spawn(move || {
                let _ = coll.all_gather_u64(1, soon());
                b.wait();
            });
        }
    });
    let (r, took) = abort_during(&ranks[0], Duration::from_millis(500), || {
        ranks[0].all_gather_u64(2, kvlink::kv_loader::deadline_after(IN_FLIGHT_DEADLINE))
    });
    let verdict = aborted_in_time(r, took)?;
    // Rank 1 issues late against its aborted peer: it fails by its own deadline.
    let late =
        ranks[1].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    if late.is_ok() {
        return Err("rank 1 completed against an aborted peer".into());
    }
    Ok(format!("{verdict}; rank 1 late: failed"))
}
