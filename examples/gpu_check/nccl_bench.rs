//! kvlink's NCCL broadcast of one 128K layer against raw NCCL (cudarc) for the same bytes.
//!
//! Each side is measured two ways, both in the same run:
//! - **back to back** (the target): `STREAM_CALLS` broadcasts issued one after another and
//!   waited for once, GPU time per broadcast. This is how the linker uses the collective: it
//!   issues each layer's broadcast and goes on, so the host's hand-off to the comm thread
//!   overlaps the transfers.
//! - **one call alone** (shown, no target): issue one broadcast, then wait for it on the host.
//!   kvlink's call crosses to its comm thread and back and polls the event; raw NCCL is called
//!   on the waiting thread and waited with `cuStreamSynchronize`.
//!
//! The two ranks step together through a barrier bounded by [`STEP`]: a rank that fails to
//! start leaves the other an error after that, not a wait that would hold the whole result
//! table back. Raw NCCL's own set-up is bounded by its script's limit
//! (`KVLINK_GPU_CHECK_LIMIT` in scripts/gpu-run.sh).

use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{nccl_result_name, NcclCollective, NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::Collective;
use kvlink::kv_device::cuda::cudarc::driver::CudaContext;
use kvlink::kv_device::cuda::cudarc::nccl as cnccl;
use kvlink::kv_device::cuda::{CudaDevice, CudaLayerEvent, DeviceBuffer};
use kvlink::kv_device::{DeviceRegion, SharedEvent};
use kvlink::kv_loader::deadline_after;
use kvlink_rig::measure::{gbps, median, timing_event};
use kvlink_rig::ranks::TimedBarrier;
use kvlink_rig::report::{de, Report, Status};

use super::Args;

const SEC: &str = "bench";

/// How long a rank waits at a step for the other (its set-up, a round of calls).
const STEP: Duration = Duration::from_secs(60);

/// One GLM-5.2 layer of `k` for a 128K prefix: 131072 tokens × 656 B.
const LAYER_BYTES: usize = 131_072 * 656;

/// Broadcasts per back-to-back round.
const STREAM_CALLS: usize = 20;

/// Back-to-back rounds; the median round counts.
const STREAM_ROUNDS: usize = 5;

/// The back-to-back throughput kvlink must reach, as a share of raw NCCL's.
const TARGET: f64 = 0.8;

/// What one broadcast costs, measured both ways (ms, rank 0's median).
#[derive(Debug, Clone, Copy)]
struct BroadcastCost {
    /// GPU time per broadcast, issued back to back.
    stream_ms: f64,
    /// One broadcast alone: from issue to the host seeing it complete.
    call_ms: f64,
}

/// The NCCL rows of the benchmark table: one rank alone on one GPU, or two GPUs against raw.
pub fn run(args: &Args, gpus: u32, report: &mut Report) {
    let (warm, iters) = if args.quick { (2, 5) } else { (5, 20) };
    if gpus < 2 {
        report.check(
            SEC,
            "NCCL broadcast 86 MB, 1 rank (local; no fabric)",
            || one_rank(warm, iters),
        );
        report.push(
            SEC,
            "NCCL broadcast 86 MB vs raw NCCL, 2 ranks",
            Status::Skip,
            format!("{gpus} GPU visible; needs 2"),
        );
        return;
    }
    report.check(SEC, "NCCL broadcast 86 MB (one 128K layer) vs raw NCCL, 2 ranks", || {
        let raw = raw_cost(warm, iters)?;
        let ours = kvlink_cost(&[0, 1], warm, iters)?;
        let ratio = raw.stream_ms / ours.stream_ms;
        let v = format!(
            "back to back ({STREAM_CALLS} per round): kvlink {:.3} ms ({:.0} GB/s), raw NCCL {:.3} ms ({:.0} GB/s), {:.0} % of raw (target ≥ {:.0} %); one call alone, issue to host-seen completion: kvlink {:.3} ms, raw {:.3} ms",
            ours.stream_ms,
            gbps(LAYER_BYTES as u64, ours.stream_ms),
            raw.stream_ms,
            gbps(LAYER_BYTES as u64, raw.stream_ms),
            ratio * 100.0,
            TARGET * 100.0,
            ours.call_ms,
            raw.call_ms,
        );
        if ratio >= TARGET {
            Ok(v)
        } else {
            Err(v)
        }
    });
}

/// One rank alone: the collective's path end to end, nothing crosses a fabric.
fn one_rank(warm: usize, iters: usize) -> Result<String, String> {
    let cost = kvlink_cost(&[0], warm, iters)?;
    Ok(format!(
        "back to back {:.3} ms per call, one call alone {:.3} ms (one rank: no transfer; 2-GPU numbers need nvidia-h200-x2)",
        cost.stream_ms, cost.call_ms
    ))
}

/// kvlink's collective on the GPUs `ordinals`, one thread per rank: rank 0's cost.
fn kvlink_cost(ordinals: &[u32], warm: usize, iters: usize) -> Result<BroadcastCost, String> {
    let ranks = NcclGroup::new_in_process_with(ordinals, NcclConfig::default())
        .map_err(|e| e.to_string())?;
    rank0_of(ranks.len(), |r, barrier| {
        kvlink_rank(&ranks[r], barrier, warm, iters)
    })
}

/// One rank's side of [`kvlink_cost`]: calls alone, then back-to-back rounds.
fn kvlink_rank(
    coll: &NcclCollective,
    barrier: &TimedBarrier,
    warm: usize,
    iters: usize,
) -> Result<BroadcastCost, String> {
    let dev = CudaDevice::new(coll.rank()).map_err(de)?;
    let d = DeviceBuffer::zeroed(dev.context(), LAYER_BYTES, "bench").map_err(de)?;
    let region = DeviceRegion {
        ordinal: coll.ordinal(),
        addr: d.ptr(),
        len: d.len(),
    };
    let mut alone = Vec::new();
    for i in 0..warm + iters {
        barrier.wait(STEP)?;
        let t0 = Instant::now();
        broadcasts(coll, &dev, region, 1)?;
        if i >= warm {
            alone.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut per_call = Vec::new();
    for _ in 0..STREAM_ROUNDS {
        barrier.wait(STEP)?;
        per_call.push(broadcasts(coll, &dev, region, STREAM_CALLS)? / STREAM_CALLS as f64);
    }
    Ok(BroadcastCost {
        stream_ms: median(&mut per_call),
        call_ms: median(&mut alone),
    })
}

/// Issues `n` broadcasts of `region` back to back, after an event on the device's load
/// stream, and waits for the last on the host. Returns the GPU time from that event to the
/// last broadcast's end, in ms.
fn broadcasts(
    coll: &NcclCollective,
    dev: &CudaDevice,
    region: DeviceRegion,
    n: usize,
) -> Result<f64, String> {
    // SAFETY: events and raw copies of this crate's memory on the load stream: no
    // `CudaSlice` is made through it.
    let stream = unsafe { dev.cuda_load_stream() };
    let start = timing_event(stream)?;
    let mut after: Option<SharedEvent> = Some(CudaLayerEvent::record_on(stream, 0).map_err(de)?);
    let deadline = deadline_after(Duration::from_secs(30));
    let mut last = None;
    for _ in 0..n {
        // SAFETY: `region` is this rank's device buffer (`d` in `kvlink_rank`, alive for
        // the whole call); nothing but these broadcasts touches it, and the last one's event
        // (the comm stream runs them in order) is waited for below before it is used again.
        let ev = unsafe { coll.broadcast_device(region, after.take(), 0, deadline) }
            .map_err(|e| e.to_string())?;
        last = Some(ev);
    }
    let last = last.ok_or("no broadcast issued")?;
    if let Some(cuda) = last.as_any().downcast_ref::<CudaLayerEvent>() {
        cuda.wait_on(stream).map_err(de)?;
    }
    let end = timing_event(stream)?;
    if !last.wait_until(deadline).map_err(de)? {
        return Err(format!("{n} broadcast(s) did not complete in 30 s"));
    }
    end.synchronize().map_err(|e| e.to_string())?;
    let ms = start.elapsed_ms(&end).map_err(|e| e.to_string())?;
    Ok(f64::from(ms))
}

/// Raw NCCL (cudarc's safe API, one thread per rank), measured the same two ways: rank 0's
/// cost.
fn raw_cost(warm: usize, iters: usize) -> Result<BroadcastCost, String> {
    let id = cnccl::Id::new().map_err(|e| format!("ncclGetUniqueId: {}", nccl_result_name(e.0)))?;
    rank0_of(2, |r, barrier| raw_rank(r, id, barrier, warm, iters))
}

/// Runs `rank(r, barrier)` for ranks `0..n`, one thread each, stepping together through
/// `barrier`; rank 0's result, or the first rank's error (a rank that failed in the last
/// round, after the last barrier, would otherwise go unseen behind rank 0's numbers).
fn rank0_of<F>(n: usize, rank: F) -> Result<BroadcastCost, String>
where
    F: Fn(usize, &TimedBarrier) -> Result<BroadcastCost, String> + Sync,
{
    let barrier = TimedBarrier::new(n);
    let costs: Vec<Result<BroadcastCost, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let (barrier, rank) = (&barrier, &rank);
                s.spawn(move || rank(r, barrier))
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank's thread panicked".into()))
            })
            .collect()
    });
    first_error_or_rank0(costs)
}

/// Rank 0's result when every rank succeeded, else the first failed rank's error.
fn first_error_or_rank0<T>(results: Vec<Result<T, String>>) -> Result<T, String> {
    let mut rank0 = None;
    for (r, result) in results.into_iter().enumerate() {
        match result {
            Err(e) => return Err(format!("rank {r}: {e}")),
            Ok(v) if r == 0 => rank0 = Some(v),
            Ok(_) => {}
        }
    }
    rank0.ok_or_else(|| "no rank 0".into())
}

/// One rank's side of [`raw_cost`].
fn raw_rank(
    r: usize,
    id: cnccl::Id,
    barrier: &TimedBarrier,
    warm: usize,
    iters: usize,
) -> Result<BroadcastCost, String> {
    let ctx = CudaContext::new(r).map_err(|e| e.to_string())?;
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let mut buf = stream
        .alloc_zeros::<u8>(LAYER_BYTES)
        .map_err(|e| e.to_string())?;
    // Nobody enters the (blocking) communicator init unless every rank got this far: a rank
    // that failed above would leave the other in `ncclCommInitRank` for good.
    barrier.wait(STEP)?;
    let comm = cnccl::Comm::from_rank(stream.clone(), r, 2, id)
        .map_err(|e| format!("ncclCommInitRank: {}", nccl_result_name(e.0)))?;
    let mut broadcast = |n: usize| -> Result<f64, String> {
        let start = timing_event(&stream)?;
        for _ in 0..n {
            comm.broadcast_in_place(&mut buf, 0)
                .map_err(|e| format!("ncclBroadcast: {}", nccl_result_name(e.0)))?;
        }
        let end = timing_event(&stream)?;
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok(f64::from(
            start.elapsed_ms(&end).map_err(|e| e.to_string())?,
        ))
    };
    let mut alone = Vec::new();
    for i in 0..warm + iters {
        barrier.wait(STEP)?;
        let t0 = Instant::now();
        broadcast(1)?;
        if i >= warm {
            alone.push(t0.elapsed().as_secs_f64() * 1e3);
        }
    }
    let mut per_call = Vec::new();
    for _ in 0..STREAM_ROUNDS {
        barrier.wait(STEP)?;
        per_call.push(broadcast(STREAM_CALLS)? / STREAM_CALLS as f64);
    }
    Ok(BroadcastCost {
        stream_ms: median(&mut per_call),
        call_ms: median(&mut alone),
    })
}

#[cfg(test)]
mod tests {
    use super::first_error_or_rank0;

    /// Before, rank 0's result was taken and the others dropped: a rank that failed in the
    /// last round went unseen.
    #[test]
    fn a_failed_rank_fails_the_run_not_only_rank_0() {
        assert_eq!(first_error_or_rank0(vec![Ok(1), Ok(2)]), Ok(1));
        assert_eq!(
            first_error_or_rank0(vec![Ok(1), Err::<i32, _>("lost".into())]),
            Err("rank 1: lost".into())
        );
        assert!(first_error_or_rank0::<i32>(Vec::new()).is_err());
    }
}
