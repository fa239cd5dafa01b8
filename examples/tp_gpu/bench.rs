//! The TP benchmark: GLM-5.2 FP8 prefixes in one embedded store, every mode, time to the last
//! layer resident on every rank, PCIe bytes per rank against the ideal, store bytes read; the
//! raw ceilings measured in the same run.
//!
//! - N ranks on one GPU (the in-process device group): 128K tokens (8K with `--quick`).
//! - One rank per GPU over NCCL: 128K / 256K / 512K, in the shape of the seed's table.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::nccl_result_name;
use kvlink::kv_device::cuda::cudarc::driver::{sys, CudaContext};
use kvlink::kv_device::cuda::cudarc::nccl as cnccl;
use kvlink::kv_device::cuda::{CudaDevice, DeviceBuffer, PinnedBuffer};
use kvlink::kv_loader::ShareMode;
use kvlink::mooncake_linker::store::KvStore;

use super::Args;
use kvlink_rig::glm::{glm, half_bytes};
use kvlink_rig::measure::{fmt_bytes, fmt_tokens, gbps, median, timing_event, Markdown};
use kvlink_rig::pattern::Rng;
use kvlink_rig::ranks::{all_ok, on_ranks, TimedBarrier};
use kvlink_rig::report::{de, Report, Status};
use kvlink_rig::tp::{
    clear_pools, close_all, compare_all, config, effective, gpu_mem, host_available, linkers,
    open_device, plan, rank_devs, run_batch, save_prefix, Fabric, Groups, Prefix, RankDev, MODES,
};

#[path = "../common/timeline_svg.rs"]
mod chart;

const SEC: &str = "bench";
const STORE: &str = "embedded store (in-process)";
/// Longest a rank waits at a barrier for the others.
const BARRIER_WAIT: Duration = Duration::from_secs(120);

/// One mode at one size.
struct ModeResult {
    mode: ShareMode,
    /// Slowest rank's last layer resident, per measured repetition (ms).
    last_ms: Vec<f64>,
    /// Slowest rank's first layer resident, median (ms).
    first_ms: f64,
    /// Each rank's last layer resident in the median repetition (ms).
    rank_last_ms: Vec<f64>,
    /// Store bytes read per rank (last repetition).
    reads: Vec<u64>,
    /// Bytes over PCIe per rank (host→device + device→host; last repetition).
    pcie: Vec<u64>,
}

impl ModeResult {
    fn median(&self) -> f64 {
        median(&mut self.last_ms.clone())
    }

    fn best(&self) -> f64 {
        self.last_ms.iter().copied().fold(f64::INFINITY, f64::min)
    }
}

/// The ideal bytes over PCIe of rank `rank` for a prefix of `bytes` per copy: the rank that
/// reads moves it once, a broadcast receiver nothing, a split rank its 1/N.
fn ideal_pcie(mode: ShareMode, rank: u32, tp: u32, bytes: u64) -> u64 {
    match mode {
        ShareMode::AllRanks => bytes,
        ShareMode::Rank0Broadcast if rank == 0 => bytes,
        ShareMode::Rank0Broadcast => 0,
        ShareMode::SplitAllGather => bytes / u64::from(tp.max(1)),
    }
}

/// Ceilings at one size: one layer of `k` (tokens × 656 B).
#[derive(Default)]
struct Ceilings {
    layer_bytes: u64,
    /// Pinned host→device of one layer on every GPU at once: (slowest, fastest) GB/s.
    h2d: Option<(f64, f64)>,
    /// Raw NCCL (cudarc), device buffers: broadcast, all-gather (ms, slowest rank's median).
    nccl_bcast_ms: Option<f64>,
    nccl_ag_ms: Option<f64>,
}

/// One size's results.
struct SizeResult {
    tokens: u64,
    bytes: u64,
    fill_s: f64,
    modes: Vec<ModeResult>,
    ceilings: Ceilings,
}

fn sizes(args: &Args, fabric: Fabric) -> Vec<u64> {
    if args.quick {
        return vec![8192];
    }
    let all: &[u64] = match fabric {
        Fabric::OneGpu { .. } => &[131_072],
        Fabric::Nccl { .. } => &[131_072, 262_144, 524_288],
    };
    let mut v: Vec<u64> = all
        .iter()
        .copied()
        .filter(|&t| t <= args.max_tokens && t >= args.min_tokens)
        .collect();
    if v.is_empty() && args.max_tokens < 131_072 {
        v.push((args.max_tokens / 64).max(1) * 64);
    }
    v
}

/// Runs the benchmark on `fabric`; returns the markdown tables (also written to `$OUT`).
pub fn run(args: &Args, fabric: Fabric, started: Instant, report: &mut Report) -> String {
    let tp = fabric.tp();
    let gpu = open_device(args.cpu, 0)
        .map(|d| d.name())
        .unwrap_or_else(|e| e);
    let mut results: Vec<SizeResult> = Vec::new();
    let mut last_cost: Option<(u64, f64)> = None;
    let sizes = sizes(args, fabric);
    if sizes.is_empty() {
        report.push(
            SEC,
            format!("{} prefixes", fabric.label()),
            Status::Skip,
            format!(
                "no benchmark size lies in --min-tokens {} ..= --max-tokens {}",
                args.min_tokens, args.max_tokens
            ),
        );
    }
    for tokens in sizes {
        let label = format!("TP{tp} {} tokens", fmt_tokens(tokens));
        // Time: sizes double, and so (about) does their cost; keep the table's print inside
        // the command's limit.
        let spent = started.elapsed().as_secs_f64();
        if let Some((t0, s0)) = last_cost {
            let est = s0 * tokens as f64 / t0 as f64 * 1.2;
            if spent + est > args.budget_s {
                report.push(
                    SEC,
                    label,
                    Status::Skip,
                    format!(
                        "out of time: {spent:.0} s spent, about {est:.0} s more needed, budget {:.0} s (--budget-s)",
                        args.budget_s
                    ),
                );
                continue;
            }
        }
        if let Err(why) = memory_fits(args.cpu, fabric, tokens, args.threads, args.host_mem) {
            report.push(SEC, label, Status::Skip, why);
            continue;
        }
        let t_size = Instant::now();
        let r = one_size(args, fabric, tokens, &gpu, report);
        last_cost = Some((tokens, t_size.elapsed().as_secs_f64()));
        match r {
            Ok(s) => results.push(s),
            Err(e) => report.push(SEC, label, Status::Fail, e),
        }
        // Written after every size, so a run cut short keeps the sizes it finished.
        write_tables(fabric, &gpu, args, &results);
    }
    write_tables(fabric, &gpu, args, &results)
}

fn write_tables(fabric: Fabric, gpu: &str, args: &Args, results: &[SizeResult]) -> String {
    let text = tables(fabric, gpu, args, results);
    if let Some(dir) = &args.out {
        let _ = std::fs::write(
            dir.join(format!("tp_gpu_bench_tp{}.md", fabric.tp())),
            &text,
        );
    }
    text
}

/// Host and GPU memory for a size, or why it does not fit.
fn memory_fits(
    cpu: bool,
    fabric: Fabric,
    tokens: u64,
    threads: usize,
    host_mem: Option<u64>,
) -> Result<(), String> {
    let tp = fabric.tp();
    let g = glm(tp, 0)?;
    let n = (tokens / u64::from(g.page_size())) as usize;
    let bytes = g.bytes_per_page() * n as u64;
    let half = half_bytes(&g, n) as u64;
    // Store + per rank (pinned staging 2 × 2 halves, the ceiling's pinned layer) + the savers'
    // chunk pools + margin.
    let host_need = bytes
        + bytes / 20
        + u64::from(tp) * 5 * half
        + threads as u64 * 32 * g.bytes_per_page()
        + (4 << 30);
    // Per rank on its GPU: the pool, device staging 2 × 2 halves, the ceiling's layer.
    let per_rank = bytes + 5 * half;
    let ranks_per_gpu = u64::from(tp / fabric.gpus());
    let dev_need = per_rank * ranks_per_gpu + (2 << 30);
    if let Some(avail) = host_mem.or_else(host_available) {
        if avail < host_need {
            return Err(format!(
                "host memory: {} {}, about {} needed (the store alone holds {})",
                fmt_bytes(avail),
                if host_mem.is_some() {
                    "(--host-mem-gib)"
                } else {
                    "available (MemAvailable; --host-mem-gib G overrides)"
                },
                fmt_bytes(host_need),
                fmt_bytes(bytes)
            ));
        }
    }
    for gpu in (0..fabric.gpus()).filter(|_| !cpu) {
        let dev = CudaDevice::new(gpu).map_err(de)?;
        let (free, _) = gpu_mem(&dev)?;
        if free < dev_need {
            return Err(format!(
                "GPU {gpu}: {} free, about {} needed ({ranks_per_gpu} rank(s), pool {} each)",
                fmt_bytes(free),
                fmt_bytes(dev_need),
                fmt_bytes(bytes)
            ));
        }
    }
    Ok(())
}

fn one_size(
    args: &Args,
    fabric: Fabric,
    tokens: u64,
    gpu: &str,
    report: &mut Report,
) -> Result<SizeResult, String> {
    let tp = fabric.tp();
    let g = glm(tp, 0)?;
    let n = (tokens / u64::from(g.page_size())) as usize;
    let k = g.component_by_name("k").map_err(|e| e.to_string())?;
    let layer_bytes = k.page_layer_bytes * n as u64;
    let tag = fmt_tokens(tokens);

    let ceilings = if args.cpu {
        Ceilings {
            layer_bytes,
            ..Ceilings::default()
        }
    } else {
        ceilings(args, fabric, layer_bytes, report, &tag)
    };

    let prefix = save_prefix(tp, n, tokens as u32, args.threads)?;
    report.info(
        SEC,
        format!("TP{tp} {tag}: prefix in the {STORE}"),
        format!(
            "{n} pages, {} per copy, saved by rank 0 in {:.1} s",
            fmt_bytes(prefix.bytes),
            prefix.fill_s
        ),
    );
    let devs = rank_devs(args.cpu, fabric, n as u32, n)?;
    let mut groups = Groups::new(fabric, devs.iter().map(|d| d.dev.clone()).collect());
    // A different permutation of the pool's slots on every rank.
    let slots: Vec<Vec<u32>> = (0..tp)
        .map(|r| Rng(tokens ^ (0x9e37 * u64::from(r + 1))).scattered_slots(n, n as u32))
        .collect::<Result<_, _>>()?;
    let mut modes = Vec::new();
    for mode in MODES {
        let name = format!("{} {tag} {mode:?} ({STORE}, {gpu})", fabric.label());
        match one_mode(
            args,
            fabric,
            &mut groups,
            &devs,
            &slots,
            &prefix,
            mode,
            &tag,
        ) {
            Ok(m) => {
                let want = effective(mode, tp);
                // The point of sharing on the device path: a rank's PCIe bytes are its ideal
                // (a receiver moves nothing over PCIe). Within 1 % of the prefix, and at
                // least one page of every layer: a split rank's part is whole pages, and the
                // slot tables go over PCIe too.
                let slack = (prefix.bytes / 100).max(prefix.bytes / (n as u64).max(1));
                let off: Vec<u32> = (0..tp)
                    .filter(|&r| {
                        let ideal = ideal_pcie(want, r, tp, prefix.bytes);
                        m.pcie
                            .get(r as usize)
                            .is_none_or(|&b| b.abs_diff(ideal) > slack)
                    })
                    .collect();
                let status = if off.is_empty() {
                    Status::Pass
                } else {
                    Status::Fail
                };
                let verdict = if off.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; PCIe bytes off their ideal by more than {} on ranks {off:?}",
                        fmt_bytes(slack)
                    )
                };
                report.push(
                    SEC,
                    name,
                    status,
                    format!(
                        "last layer on every rank: median {:.0} ms, best {:.0} ms of {} (per rank {}); first layer {:.1} ms; PCIe per rank [{}] (ideal [{}]); store read per rank [{}]; sampled bytes equal on every rank",
                        m.median(),
                        m.best(),
                        m.last_ms.len(),
                        m.rank_last_ms.iter().map(|t| format!("{t:.0}")).collect::<Vec<_>>().join(" "),
                        m.first_ms,
                        m.pcie.iter().map(|&b| fmt_bytes(b)).collect::<Vec<_>>().join(", "),
                        (0..tp).map(|r| fmt_bytes(ideal_pcie(want, r, tp, prefix.bytes))).collect::<Vec<_>>().join(", "),
                        m.reads.iter().map(|&b| fmt_bytes(b)).collect::<Vec<_>>().join(", "),
                    ) + &verdict,
                );
                modes.push(m);
            }
            Err(ModeFailure::Failed(e)) => {
                report.push(SEC, name, Status::Fail, e);
                groups.reset();
            }
            Err(ModeFailure::PoolsInUse(e)) => {
                report.push(SEC, name, Status::Fail, e);
                report.push(
                    SEC,
                    format!("TP{tp} {tag}: the modes after {mode:?}"),
                    Status::Skip,
                    "not run: a batch may still write the pools they would use",
                );
                break;
            }
        }
    }
    groups.reset();
    Ok(SizeResult {
        tokens,
        bytes: prefix.bytes,
        fill_s: prefix.fill_s,
        modes,
        ceilings,
    })
}

/// Why a mode gave no result.
enum ModeFailure {
    /// It failed; its linkers closed, so the pools may be cleared for the next mode.
    Failed(String),
    /// Its linkers could not be closed: a batch may still write the pools, so no later mode
    /// may use them.
    PoolsInUse(String),
}

impl From<String> for ModeFailure {
    fn from(e: String) -> Self {
        ModeFailure::Failed(e)
    }
}

#[allow(clippy::too_many_arguments)]
fn one_mode(
    args: &Args,
    fabric: Fabric,
    groups: &mut Groups,
    devs: &[RankDev],
    slots: &[Vec<u32>],
    prefix: &Prefix,
    mode: ShareMode,
    tag: &str,
) -> Result<ModeResult, ModeFailure> {
    let tp = fabric.tp();
    let cfg = config(mode, Duration::from_secs(120), Duration::from_secs(600));
    let stores: Vec<Arc<dyn KvStore>> = (0..tp)
        .map(|_| prefix.store.clone() as Arc<dyn KvStore>)
        .collect();
    let ls = linkers(devs, &stores, groups.get()?, &cfg)?;
    let want = effective(mode, tp);
    let layers_per_batch = devs[0].g.num_layers() as usize;
    let mut last_ms = Vec::new();
    let mut first_ms = Vec::new();
    let mut timelines: Vec<Vec<Vec<f64>>> = Vec::new();
    let mut reads = Vec::new();
    let mut pcie = Vec::new();
    let mut failure = None;
    // One warm-up (staging, kernels, NCCL buffers), then the measured repetitions.
    for rep in 0..=args.reps {
        // SAFETY: before this repetition's batch; every earlier batch's outcome was taken
        // (a failed repetition ends the loop).
        if let Err(e) = unsafe { clear_pools(devs) } {
            failure = Some(e);
            break;
        }
        let batch = 1 + rep as u64;
        let plans = devs
            .iter()
            .enumerate()
            .map(|(r, d)| plan(&d.g, batch, "tp-gpu", &prefix.pages, slots[r].clone()))
            .collect();
        let runs = match all_ok(run_batch(&ls, plans)) {
            Ok(r) => r,
            Err(e) => {
                failure = Some(e);
                break;
            }
        };
        let mut rep_reads = Vec::new();
        let mut rep_pcie = Vec::new();
        for (r, run) in runs.iter().enumerate() {
            // A layer wait that failed leaves `ready_ms` short: its last entry is not the
            // last layer's time.
            if let Some((layer, e)) = &run.wait_error {
                failure = Some(format!("rank {r}: waiting for layer {layer}: {e}"));
                continue;
            }
            if run.ready_ms.len() != layers_per_batch {
                failure = Some(format!(
                    "rank {r}: {} of {layers_per_batch} layers seen ready",
                    run.ready_ms.len()
                ));
                continue;
            }
            match &run.outcome.result {
                Ok(s) if s.mode == want => {
                    rep_reads.push(s.bytes_read);
                    rep_pcie.push(s.transfers.pcie());
                }
                Ok(s) => {
                    failure = Some(format!("rank {r}: mode {:?}, expected {want:?}", s.mode));
                }
                Err(e) => failure = Some(format!("rank {r}: {e}")),
            }
        }
        if failure.is_some() {
            break;
        }
        if rep == 0 {
            continue;
        }
        let last = runs
            .iter()
            .map(|r| r.ready_ms.last().copied().unwrap_or(f64::NAN))
            .fold(0.0, f64::max);
        let first = runs
            .iter()
            .map(|r| r.ready_ms.first().copied().unwrap_or(f64::NAN))
            .fold(0.0, f64::max);
        last_ms.push(last);
        first_ms.push(first);
        timelines.push(runs.into_iter().map(|r| r.ready_ms).collect());
        reads = rep_reads;
        pcie = rep_pcie;
    }
    // A close that failed wins, and says the pools may still be written: no later mode may
    // clear or compare them.
    match (close_all(ls), failure) {
        (Err(c), failure) => {
            let after = failure.map_or_else(String::new, |e| format!(" (after: {e})"));
            return Err(ModeFailure::PoolsInUse(format!(
                "linkers not closed: {c}{after}"
            )));
        }
        (Ok(()), Some(e)) => return Err(e.into()),
        (Ok(()), None) => {}
    }
    // The last repetition's bytes, sampled: three layers, every page, every rank.
    let layers = devs[0].g.num_layers();
    let pick = move |l: u32| l == 0 || l == layers / 2 || l + 1 == layers;
    // SAFETY: every repetition's outcome was taken (a failure returned above) and the
    // linkers are closed: nothing writes the pools.
    unsafe { compare_all(devs, slots, layers, &pick) }?;
    // The median repetition: its timeline and each rank's last layer. Of an even count, the
    // faster of the two middle ones (the median column is their mean; the upper one was
    // taken before, the slower run, unlike every other median here).
    let mut order: Vec<usize> = (0..last_ms.len()).collect();
    order.sort_by(|&a, &b| last_ms[a].total_cmp(&last_ms[b]));
    let mid = order
        .len()
        .checked_sub(1)
        .and_then(|i| order.get(i / 2))
        .copied();
    let rank_last_ms = mid
        .map(|m| {
            timelines[m]
                .iter()
                .map(|t| t.last().copied().unwrap_or(f64::NAN))
                .collect()
        })
        .unwrap_or_default();
    if let (Some(out), Some(mid)) = (&args.out, mid) {
        // In a folder of their own: scripts/gpu-tp-run.sh packs it into one file (the device
        // tool brings back at most 8 files).
        let dir = out.join("timelines");
        let _ = std::fs::create_dir_all(&dir);
        let file = format!("timeline_tp{tp}_{}_{mode:?}", tag.to_lowercase());
        let title = format!(
            "GLM-5.2 FP8, {}, {tag} tokens, {mode:?}, {STORE}: each layer resident on each rank",
            fabric.label()
        );
        let _ = std::fs::write(
            dir.join(format!("{file}.svg")),
            timeline_svg(&title, &timelines[mid]),
        );
        let _ = std::fs::write(
            dir.join(format!("{file}.csv")),
            timeline_csv(&timelines[mid]),
        );
    }
    Ok(ModeResult {
        mode,
        last_ms,
        first_ms: median(&mut first_ms),
        rank_last_ms,
        reads,
        pcie,
    })
}

/// The raw ceilings of one layer's bytes, measured now: pinned H2D on every GPU of the fabric
/// at once; with NCCL across 2+ GPUs, NCCL broadcast and all-gather on device buffers (raw
/// cudarc).
fn ceilings(
    args: &Args,
    fabric: Fabric,
    layer_bytes: u64,
    report: &mut Report,
    tag: &str,
) -> Ceilings {
    let tp = fabric.tp();
    let gpus = fabric.gpus();
    let (warm, iters) = if args.quick { (1, 3) } else { (3, 10) };
    let bytes = layer_bytes as usize;
    let mut c = Ceilings {
        layer_bytes,
        ..Ceilings::default()
    };
    let mb = fmt_bytes(layer_bytes);
    let barrier = TimedBarrier::new(gpus as usize);
    let h2d = all_ok(on_ranks(gpus as usize, |r| {
        let dev = CudaDevice::new(r as u32).map_err(de)?;
        let pinned = PinnedBuffer::zeroed(dev.context(), bytes, "ceiling").map_err(de)?;
        let dbuf = DeviceBuffer::alloc(dev.context(), bytes, "ceiling").map_err(de)?;
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        let stream = unsafe { dev.cuda_load_stream() };
        let mut ms = Vec::new();
        for i in 0..warm + iters {
            // Every GPU copies at once (they share the host's memory and PCIe).
            barrier.wait(BARRIER_WAIT)?;
            let start = timing_event(stream)?;
            dev.bind().map_err(de)?;
            // SAFETY: our pinned buffer and device buffer of `bytes` each; the end event is
            // synchronized (elapsed_ms) before the next copy and before both are dropped.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(
                    dbuf.ptr(),
                    pinned.addr() as *const _,
                    bytes,
                    stream.cu_stream(),
                )
            }
            .result()
            .map_err(|e| e.to_string())?;
            let end = timing_event(stream)?;
            let t = f64::from(start.elapsed_ms(&end).map_err(|e| e.to_string())?);
            if i >= warm {
                ms.push(t);
            }
        }
        Ok(median(&mut ms))
    }));
    match h2d {
        Ok(ms) => {
            let slow = ms.iter().copied().fold(0.0, f64::max);
            let fast = ms.iter().copied().fold(f64::INFINITY, f64::min);
            c.h2d = Some((gbps(layer_bytes, slow), gbps(layer_bytes, fast)));
            report.info(
                SEC,
                format!(
                    "TP{tp} {tag} ceiling: pinned H2D of one layer ({mb}), {gpus} GPU(s) at once"
                ),
                format!(
                    "{:.1}–{:.1} GB/s per GPU ({slow:.2} ms slowest)",
                    gbps(layer_bytes, slow),
                    gbps(layer_bytes, fast)
                ),
            );
        }
        Err(e) => report.push(
            SEC,
            format!("TP{tp} {tag} ceiling: pinned H2D"),
            Status::Fail,
            e,
        ),
    }
    if gpus < 2 {
        return c;
    }
    match raw_nccl(tp, bytes, warm, iters) {
        Ok((b, a)) => {
            c.nccl_bcast_ms = Some(b);
            c.nccl_ag_ms = Some(a);
            report.info(
                SEC,
                format!("TP{tp} {tag} ceiling: raw NCCL on device buffers, one layer ({mb})"),
                format!(
                    "broadcast {b:.2} ms ({:.0} GB/s); all-gather {a:.2} ms ({:.0} GB/s) (slowest rank, median)",
                    gbps(layer_bytes, b),
                    gbps(layer_bytes, a)
                ),
            );
        }
        Err(e) => report.push(
            SEC,
            format!("TP{tp} {tag} ceiling: raw NCCL"),
            Status::Fail,
            e,
        ),
    }
    c
}

fn nccl_err(what: &str, e: cnccl::result::NcclError) -> String {
    format!("{what}: {}", nccl_result_name(e.0))
}

/// Raw NCCL (cudarc's safe API, one thread per rank): in-place broadcast of `bytes` from rank
/// 0, and all-gather of `bytes / tp` per rank. Slowest rank's median device ms of each.
fn raw_nccl(tp: u32, bytes: usize, warm: usize, iters: usize) -> Result<(f64, f64), String> {
    let id = cnccl::Id::new().map_err(|e| nccl_err("ncclGetUniqueId", e))?;
    let barrier = TimedBarrier::new(tp as usize);
    let chunk = bytes / tp as usize;
    let per = all_ok(on_ranks(tp as usize, |r| {
        let ctx = CudaContext::new(r).map_err(|e| e.to_string())?;
        let stream = ctx.new_stream().map_err(|e| e.to_string())?;
        let mut buf = stream.alloc_zeros::<u8>(bytes).map_err(|e| e.to_string())?;
        let send = stream.alloc_zeros::<u8>(chunk).map_err(|e| e.to_string())?;
        let mut recv = stream
            .alloc_zeros::<u8>(chunk * tp as usize)
            .map_err(|e| e.to_string())?;
        // Nobody enters the (blocking) communicator init unless every rank got this far.
        barrier.wait(BARRIER_WAIT)?;
        let comm = cnccl::Comm::from_rank(stream.clone(), r, tp as usize, id)
            .map_err(|e| nccl_err("ncclCommInitRank", e))?;
        let (mut b, mut a) = (Vec::new(), Vec::new());
        for i in 0..warm + iters {
            barrier.wait(BARRIER_WAIT)?;
            let start = timing_event(&stream)?;
            comm.broadcast_in_place(&mut buf, 0)
                .map_err(|e| nccl_err("ncclBroadcast", e))?;
            let end = timing_event(&stream)?;
            let tb = f64::from(start.elapsed_ms(&end).map_err(|e| e.to_string())?);
            barrier.wait(BARRIER_WAIT)?;
            let start = timing_event(&stream)?;
            comm.all_gather(&send, &mut recv)
                .map_err(|e| nccl_err("ncclAllGather", e))?;
            let end = timing_event(&stream)?;
            let ta = f64::from(start.elapsed_ms(&end).map_err(|e| e.to_string())?);
            if i >= warm {
                b.push(tb);
                a.push(ta);
            }
        }
        stream.synchronize().map_err(|e| e.to_string())?;
        Ok((median(&mut b), median(&mut a)))
    }))?;
    Ok((
        per.iter().map(|p| p.0).fold(0.0, f64::max),
        per.iter().map(|p| p.1).fold(0.0, f64::max),
    ))
}

/// Each rank's layer-ready times: per rank a row of layers, layer l from layer l-1 resident
/// to layer l resident (ms since the common start), drawn by the examples' timeline module.
fn timeline_svg(title: &str, ranks: &[Vec<f64>]) -> String {
    const SHADES: [&str; 2] = ["#2f6ea8", "#8fbce6"];
    let lanes = ranks
        .iter()
        .enumerate()
        .map(|(r, times)| chart::Lane {
            label: format!("rank {r}"),
            rows: vec![chart::Row {
                label: "layer resident".into(),
                spans: chart::chained(0.0, times, SHADES, |l, a, b| {
                    format!("rank {r} layer {l}: {a:.2} to {b:.2} ms")
                }),
                mark: times.last().map(|&t| chart::Mark {
                    at: t,
                    color: "#1b3d5c",
                    text: format!("rank {r}: {t:.0} ms"),
                }),
                tags: Vec::new(),
            }],
        })
        .collect();
    chart::render(&chart::Chart {
        title: title.to_string(),
        subtitle: "each bar: one layer, from the previous layer resident to this one".into(),
        axis_label: "time since the common start (ms)".into(),
        blocks: vec![chart::Block {
            lanes,
            ..chart::Block::default()
        }],
        legend: vec![(
            SHADES[0],
            SHADES[1],
            "layer resident on the rank (alternating shades = consecutive layers)".into(),
        )],
    })
}

fn timeline_csv(ranks: &[Vec<f64>]) -> String {
    let layers = ranks.iter().map(Vec::len).max().unwrap_or(0);
    let mut s = String::from("layer");
    for r in 0..ranks.len() {
        let _ = write!(s, ",rank{r}_ready_ms");
    }
    s.push('\n');
    for l in 0..layers {
        let _ = write!(s, "{l}");
        for r in ranks {
            match r.get(l) {
                Some(t) => {
                    let _ = write!(s, ",{t:.3}");
                }
                None => s.push(','),
            }
        }
        s.push('\n');
    }
    s
}

fn find(s: &SizeResult, m: ShareMode) -> Option<&ModeResult> {
    s.modes.iter().find(|x| x.mode == m)
}

fn secs(ms: f64) -> String {
    format!("{:.3} s", ms / 1e3)
}

fn reduction(base: Option<&ModeResult>, m: Option<&ModeResult>) -> String {
    match (base, m) {
        (Some(b), Some(m)) => format!("{:.1} %", (1.0 - m.median() / b.median()) * 100.0),
        _ => "—".into(),
    }
}

/// What one GPU shared by every rank does to the timings (printed with the one-GPU tables).
const ONE_GPU_NOTE: &str =
    "What one shared GPU does to these timings: every rank's copies cross the same PCIe link, \
run on the same copy engines and land in the same HBM; the \"collective\" is a device-to-device \
copy inside that HBM (no NVLink), and every rank's load and comm streams compete for one GPU. So \
AllRanks pays N times the PCIe bytes on one link (slower than N GPUs would be, each with its own \
link), while Rank0Broadcast and SplitAllGather move one copy over PCIe in total and are \
understated least. The column to trust here is PCIe bytes per rank against the ideal; the times \
show the pipeline working and are not those of N GPUs. The store is in-process (memory copies), \
not Mooncake.";

/// The tables: N ranks on one GPU (times, PCIe bytes against the ideal), or one rank per GPU in
/// the seed's shape; then store bytes and ceilings.
fn tables(fabric: Fabric, gpu: &str, args: &Args, results: &[SizeResult]) -> String {
    let tp = fabric.tp();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### GLM-5.2 FP8 KV, {} ({gpu}), {STORE}\n\n\
         Time to the last layer resident on every rank (slowest rank; each layer's event waited), \
         median of {} runs after one warm-up. Replicated components are shared on the device: \
         one upload of each rank's part, the collective on device staging, the scatter after \
         its event.{}\n",
        fabric.label(),
        args.reps,
        if tp == 1 {
            " One rank: every mode reads its own copy (a dry run of the program, not a dedup number)."
        } else {
            ""
        }
    );
    let mut t = Markdown::new(&[
        "cached prefix",
        "every rank loads (AllRanks)",
        "rank 0 loads + broadcast (Rank0Broadcast)",
        "reduction",
        "split reads + all-gather (SplitAllGather)",
        "reduction",
    ]);
    for s in results {
        let all = find(s, ShareMode::AllRanks);
        let r0 = find(s, ShareMode::Rank0Broadcast);
        let sag = find(s, ShareMode::SplitAllGather);
        let cell = |m: Option<&ModeResult>| m.map_or("failed".into(), |m| secs(m.median()));
        t.row(vec![
            fmt_tokens(s.tokens),
            cell(all),
            cell(r0),
            reduction(all, r0),
            cell(sag),
            reduction(all, sag),
        ]);
    }
    out.push_str(&t.render());
    let _ = writeln!(
        out,
        "\nThe seed (SGLang, GLM-5.2 W4AFP8, 8×H20, TP8, Mooncake, TTFT): 128K 1.959 s every rank loads \
         vs 1.185 s rank 0 + broadcast; 256K 3.851 s vs 2.229 s; 512K 7.950 s vs 4.891 s.\n"
    );
    if let Fabric::OneGpu { .. } = fabric {
        let _ = writeln!(out, "{ONE_GPU_NOTE}\n");
    }
    let mut b = Markdown::new(&[
        "cached prefix",
        "mode",
        "last layer per rank (ms, median run; of an even count the faster middle one)",
        "PCIe per rank (measured)",
        "PCIe per rank (ideal)",
        "store read per rank",
        "best / median",
    ]);
    for s in results {
        for m in &s.modes {
            let want = effective(m.mode, tp);
            let list = |v: &[u64]| {
                v.iter()
                    .map(|&x| fmt_bytes(x))
                    .collect::<Vec<_>>()
                    .join(" / ")
            };
            let ideal: Vec<u64> = (0..tp).map(|r| ideal_pcie(want, r, tp, s.bytes)).collect();
            b.row(vec![
                fmt_tokens(s.tokens),
                format!("{:?}", m.mode),
                m.rank_last_ms
                    .iter()
                    .map(|t| format!("{t:.0}"))
                    .collect::<Vec<_>>()
                    .join(" / "),
                list(&m.pcie),
                list(&ideal),
                list(&m.reads),
                format!("{} / {}", secs(m.best()), secs(m.median())),
            ]);
        }
    }
    let _ = writeln!(
        out,
        "Per rank: time to the last layer, bytes over PCIe (host→device + device→host) against the \
         ideal (the reading rank moves one copy, a broadcast receiver nothing, a split rank 1/N), \
         store bytes read ({STORE}; one copy of the prefix per size below):\n"
    );
    out.push_str(&b.render());
    let mut c = Markdown::new(&[
        "cached prefix",
        "one copy",
        "store fill",
        "one layer of k",
        "pinned H2D per GPU (all at once)",
        "NCCL broadcast",
        "NCCL all-gather",
    ]);
    let bw = |bytes: u64, ms: Option<f64>| {
        ms.map_or("—".into(), |ms| {
            format!("{ms:.2} ms = {:.0} GB/s", gbps(bytes, ms))
        })
    };
    for s in results {
        let cl = &s.ceilings;
        c.row(vec![
            fmt_tokens(s.tokens),
            fmt_bytes(s.bytes),
            format!("{:.1} s", s.fill_s),
            fmt_bytes(cl.layer_bytes),
            cl.h2d.map_or("—".into(), |(slow, fast)| {
                format!("{slow:.1}–{fast:.1} GB/s")
            }),
            bw(cl.layer_bytes, cl.nccl_bcast_ms),
            bw(cl.layer_bytes, cl.nccl_ag_ms),
        ]);
    }
    let _ = writeln!(
        out,
        "\nCeilings measured in the same run (— : not measured; NCCL needs 2+ GPUs):\n"
    );
    out.push_str(&c.render());
    out
}
