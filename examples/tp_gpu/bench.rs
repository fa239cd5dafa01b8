//! The TP benchmark: GLM-5.2 FP8 prefixes (128K / 256K / 512K tokens; 8K with `--quick`) in
//! one embedded store, every mode, time to the last layer resident on every rank, store bytes
//! read, the reduction vs `AllRanks`; and the raw ceilings measured in the same run.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{nccl_result_name, NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::{all_gather_slices, broadcast_slice};
use kvlink::kv_device::cuda::cudarc::driver::{sys, CudaContext};
use kvlink::kv_device::cuda::cudarc::nccl as cnccl;
use kvlink::kv_device::cuda::{CudaDevice, DeviceBuffer, PinnedBuffer};
use kvlink::kv_loader::ShareMode;
use kvlink::mooncake_linker::store::KvStore;

use crate::setup::{
    clear_pools, close_all, compare_all, config, effective, glm, gpu_mem, half_bytes,
    host_available, linkers, plan, rank_devs, run_batch, save_prefix, Groups, Prefix, RankDev,
    MODES,
};
use crate::util::{
    all_ok, de, fmt_bytes, fmt_tokens, gbps, median, on_ranks, timing_event, Markdown, Report, Rng,
    Status, TimedBarrier,
};
use crate::Args;

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
    /// Store bytes read per rank (last repetition).
    reads: Vec<u64>,
}

impl ModeResult {
    fn median(&self) -> f64 {
        median(&mut self.last_ms.clone())
    }

    fn best(&self) -> f64 {
        self.last_ms.iter().copied().fold(f64::INFINITY, f64::min)
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
    /// kvlink's NcclCollective on HOST buffers (the linker's current path): broadcast,
    /// all-gather (ms of the call, slowest rank's median).
    host_bcast_ms: Option<f64>,
    host_ag_ms: Option<f64>,
}

/// One size's results.
struct SizeResult {
    tokens: u64,
    bytes: u64,
    fill_s: f64,
    modes: Vec<ModeResult>,
    ceilings: Ceilings,
}

fn sizes(args: &Args) -> Vec<u64> {
    if args.quick {
        return vec![8192];
    }
    let mut v: Vec<u64> = [131_072u64, 262_144, 524_288]
        .into_iter()
        .filter(|&t| t <= args.max_tokens && t >= args.min_tokens)
        .collect();
    if v.is_empty() && args.max_tokens < 131_072 {
        v.push((args.max_tokens / 64).max(1) * 64);
    }
    v
}

/// Runs the benchmark; returns the markdown tables (also written to `$OUT`).
pub fn run(args: &Args, groups: &mut Groups, started: Instant, report: &mut Report) -> String {
    let tp = args.tp;
    let gpu = CudaDevice::new(0)
        .and_then(|d| d.name())
        .unwrap_or_else(|e| e.to_string());
    let mut results: Vec<SizeResult> = Vec::new();
    let mut last_cost: Option<(u64, f64)> = None;
    let sizes = sizes(args);
    if sizes.is_empty() {
        report.push(
            SEC,
            format!("TP{tp} prefixes"),
            Status::Skip,
            format!(
                "no size of 128K/256K/512K lies in --min-tokens {} ..= --max-tokens {}",
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
        if let Err(why) = memory_fits(tp, tokens, args.threads, args.host_mem) {
            report.push(SEC, label, Status::Skip, why);
            continue;
        }
        let t_size = Instant::now();
        let r = one_size(args, groups, tokens, &gpu, report);
        last_cost = Some((tokens, t_size.elapsed().as_secs_f64()));
        match r {
            Ok(s) => results.push(s),
            Err(e) => {
                report.push(SEC, label, Status::Fail, e);
                groups.reset();
            }
        }
        // Written after every size, so a run cut short keeps the sizes it finished.
        write_tables(tp, &gpu, args, &results);
    }
    write_tables(tp, &gpu, args, &results)
}

fn write_tables(tp: u32, gpu: &str, args: &Args, results: &[SizeResult]) -> String {
    let text = tables(tp, gpu, args, results);
    if let Some(dir) = &args.out {
        let _ = std::fs::write(dir.join(format!("tp_gpu_bench_tp{tp}.md")), &text);
    }
    text
}

/// Host and GPU memory for a size, or why it does not fit.
fn memory_fits(tp: u32, tokens: u64, threads: usize, host_mem: Option<u64>) -> Result<(), String> {
    let g = glm(tp, 0)?;
    let n = (tokens / u64::from(g.page_size())) as usize;
    let bytes = g.bytes_per_page() * n as u64;
    let half = half_bytes(&g, n) as u64;
    // Store + per rank (pinned staging 2 × 2 halves, the linker's host staging 2 halves,
    // ceilings' pinned layer) + the savers' chunk pools + margin.
    let host_need = bytes
        + bytes / 20
        + u64::from(tp) * 7 * half
        + threads as u64 * 32 * g.bytes_per_page()
        + (4 << 30);
    let dev_need = bytes + 7 * half + (2 << 30);
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
    for r in 0..tp {
        let dev = CudaDevice::new(r).map_err(de)?;
        let (free, _) = gpu_mem(&dev)?;
        if free < dev_need {
            return Err(format!(
                "GPU {r}: {} free, about {} needed (pool {})",
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
    groups: &mut Groups,
    tokens: u64,
    gpu: &str,
    report: &mut Report,
) -> Result<SizeResult, String> {
    let tp = args.tp;
    let g = glm(tp, 0)?;
    let n = (tokens / u64::from(g.page_size())) as usize;
    let k = g.component_by_name("k").map_err(|e| e.to_string())?;
    let layer_bytes = k.page_layer_bytes * n as u64;
    let tag = fmt_tokens(tokens);

    let ceilings = ceilings(args, layer_bytes, report, &tag);

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
    let devs = rank_devs(tp, n as u32, n)?;
    // A different permutation of the pool's slots on every rank.
    let slots: Vec<Vec<u32>> = (0..tp)
        .map(|r| Rng(tokens ^ (0x9e37 * u64::from(r + 1))).scattered_slots(n, n as u32))
        .collect();
    let mut modes = Vec::new();
    for mode in MODES {
        let name = format!("TP{tp} {tag} {mode:?} ({STORE}, {gpu})");
        match one_mode(args, groups, &devs, &slots, &prefix, mode, &tag) {
            Ok(m) => {
                report.push(
                    SEC,
                    name,
                    Status::Pass,
                    format!(
                        "last layer on every rank: median {:.0} ms, best {:.0} ms of {}; first layer {:.1} ms; store read per rank [{}] = {}; sampled bytes equal on every rank",
                        m.median(),
                        m.best(),
                        m.last_ms.len(),
                        m.first_ms,
                        m.reads.iter().map(|&b| fmt_bytes(b)).collect::<Vec<_>>().join(", "),
                        fmt_bytes(m.reads.iter().sum())
                    ),
                );
                modes.push(m);
            }
            Err(e) => {
                report.push(SEC, name, Status::Fail, e);
                groups.reset();
            }
        }
    }
    Ok(SizeResult {
        tokens,
        bytes: prefix.bytes,
        fill_s: prefix.fill_s,
        modes,
        ceilings,
    })
}

#[allow(clippy::too_many_arguments)]
fn one_mode(
    args: &Args,
    groups: &mut Groups,
    devs: &[RankDev],
    slots: &[Vec<u32>],
    prefix: &Prefix,
    mode: ShareMode,
    tag: &str,
) -> Result<ModeResult, String> {
    let tp = args.tp;
    let cfg = config(mode, Duration::from_secs(120), Duration::from_secs(600));
    let stores: Vec<Arc<dyn KvStore>> = (0..tp)
        .map(|_| prefix.store.clone() as Arc<dyn KvStore>)
        .collect();
    let ls = linkers(devs, &stores, groups.get()?, &cfg)?;
    let want = effective(mode, tp);
    let mut last_ms = Vec::new();
    let mut first_ms = Vec::new();
    let mut timelines: Vec<Vec<Vec<f64>>> = Vec::new();
    let mut reads = Vec::new();
    let mut failure = None;
    // One warm-up (staging and NCCL scratch allocations), then the measured repetitions.
    for rep in 0..=args.reps {
        if let Err(e) = clear_pools(devs) {
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
        for (r, run) in runs.iter().enumerate() {
            match &run.outcome.result {
                Ok(s) if s.mode == want => rep_reads.push(s.bytes_read),
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
    }
    let closed = close_all(ls);
    if let Some(e) = failure {
        return Err(e);
    }
    closed?;
    // The last repetition's bytes, sampled: three layers, every page, every rank.
    let layers = devs[0].g.num_layers();
    let pick = move |l: u32| l == 0 || l == layers / 2 || l + 1 == layers;
    compare_all(devs, slots, layers, &pick)?;
    // The timeline of the median repetition.
    let mut order: Vec<usize> = (0..last_ms.len()).collect();
    order.sort_by(|&a, &b| last_ms[a].total_cmp(&last_ms[b]));
    if let (Some(out), Some(&mid)) = (&args.out, order.get(order.len() / 2)) {
        // In a folder of their own: scripts/gpu-tp-run.sh packs it into one file (the device
        // tool brings back at most 8 files).
        let dir = out.join("timelines");
        let _ = std::fs::create_dir_all(&dir);
        let file = format!("timeline_tp{tp}_{}_{mode:?}", tag.to_lowercase());
        let title = format!(
            "GLM-5.2 FP8, TP{tp}, {tag} tokens, {mode:?}, {STORE}: each layer resident on each rank"
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
        reads,
    })
}

/// The raw ceilings of one layer's bytes, measured now: pinned H2D on every GPU at once;
/// with more than one rank, NCCL broadcast and all-gather on device buffers (raw cudarc), and
/// kvlink's collective on host buffers (what the linker does today).
fn ceilings(args: &Args, layer_bytes: u64, report: &mut Report, tag: &str) -> Ceilings {
    let tp = args.tp;
    let (warm, iters) = if args.quick { (1, 3) } else { (3, 10) };
    let bytes = layer_bytes as usize;
    let mut c = Ceilings {
        layer_bytes,
        ..Ceilings::default()
    };
    let mb = fmt_bytes(layer_bytes);
    let barrier = TimedBarrier::new(tp as usize);
    let h2d = all_ok(on_ranks(tp as usize, |r| {
        let dev = CudaDevice::new(r as u32).map_err(de)?;
        let pinned = PinnedBuffer::zeroed(dev.context(), bytes, "ceiling").map_err(de)?;
        let dbuf = DeviceBuffer::alloc(dev.context(), bytes, "ceiling").map_err(de)?;
        let stream = dev.load_stream();
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
                    "TP{tp} {tag} ceiling: pinned H2D of one layer ({mb}), all {tp} GPUs at once"
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
    if tp < 2 {
        report.push(
            SEC,
            format!("TP{tp} {tag} ceilings: NCCL broadcast / all-gather of one layer"),
            Status::Skip,
            "one rank: nothing crosses the fabric",
        );
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
    match host_collectives(tp, bytes, warm, iters) {
        Ok((b, a)) => {
            c.host_bcast_ms = Some(b);
            c.host_ag_ms = Some(a);
            report.info(
                SEC,
                format!("TP{tp} {tag}: kvlink NcclCollective on HOST buffers, one layer ({mb}) — the linker's path"),
                format!(
                    "broadcast {b:.2} ms ({:.1} GB/s); all-gather {a:.2} ms ({:.1} GB/s) (slowest rank, median call)",
                    gbps(layer_bytes, b),
                    gbps(layer_bytes, a)
                ),
            );
        }
        Err(e) => report.push(
            SEC,
            format!("TP{tp} {tag}: kvlink host-buffer collectives"),
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

/// kvlink's `NcclCollective` on host buffers (each moved through the comm thread's device
/// scratch), as the linker calls it today: broadcast of `bytes`, all-gather of `bytes / tp`
/// per rank. Slowest rank's median call time.
fn host_collectives(
    tp: u32,
    bytes: usize,
    warm: usize,
    iters: usize,
) -> Result<(f64, f64), String> {
    let ordinals: Vec<u32> = (0..tp).collect();
    let ranks = NcclGroup::new_in_process_with(
        &ordinals,
        NcclConfig {
            timing: true,
            ..NcclConfig::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let barrier = TimedBarrier::new(tp as usize);
    let chunk = bytes / tp as usize;
    let per = all_ok(on_ranks(tp as usize, |r| {
        let coll = &ranks[r];
        let mut buf = vec![r as u8; bytes];
        let send = vec![r as u8; chunk];
        let mut recv = vec![0u8; chunk * tp as usize];
        let (mut b, mut a) = (Vec::new(), Vec::new());
        for i in 0..warm + iters {
            barrier.wait(BARRIER_WAIT)?;
            let t0 = Instant::now();
            broadcast_slice(
                coll,
                &mut buf,
                0,
                kvlink::kv_loader::deadline_after(Duration::from_secs(60)),
            )
            .map_err(|e| e.to_string())?;
            let tb = t0.elapsed().as_secs_f64() * 1e3;
            barrier.wait(BARRIER_WAIT)?;
            let t0 = Instant::now();
            all_gather_slices(
                coll,
                &send,
                &mut recv,
                kvlink::kv_loader::deadline_after(Duration::from_secs(60)),
            )
            .map_err(|e| e.to_string())?;
            let ta = t0.elapsed().as_secs_f64() * 1e3;
            if i >= warm {
                b.push(tb);
                a.push(ta);
            }
        }
        if buf.iter().any(|&x| x != 0) {
            return Err(format!("rank {r}: broadcast bytes differ from rank 0's"));
        }
        Ok((median(&mut b), median(&mut a)))
    }));
    // Every rank's communicator finalized at once.
    std::thread::scope(|s| {
        for c in ranks {
            s.spawn(move || drop(c));
        }
    });
    let per = per?;
    Ok((
        per.iter().map(|p| p.0).fold(0.0, f64::max),
        per.iter().map(|p| p.1).fold(0.0, f64::max),
    ))
}

/// Each rank's layer-ready times as a polyline (x: ms since the common start, y: layer).
fn timeline_svg(title: &str, ranks: &[Vec<f64>]) -> String {
    const COLORS: [&str; 8] = [
        "#3b78c2", "#e8862a", "#3a9d4a", "#c23b3b", "#8a5cc2", "#8c6d31", "#d66fb3", "#6b6b6b",
    ];
    let (w, h) = (1000.0, 640.0);
    let (left, top, right, bottom) = (60.0, 40.0, 140.0, 40.0);
    let end = ranks
        .iter()
        .flat_map(|r| r.iter().copied())
        .fold(1e-3, f64::max);
    let layers = ranks.iter().map(Vec::len).max().unwrap_or(1).max(1);
    let x = |ms: f64| left + ms / end * (w - left - right);
    let y = |l: usize| top + l as f64 / (layers.max(2) - 1) as f64 * (h - top - bottom);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"monospace\" font-size=\"11\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"18\">{title}</text>\n"
    );
    // Axes and gridlines every 10 layers.
    for l in (0..layers).step_by(10) {
        let _ = writeln!(
            s,
            "<line x1=\"{left}\" y1=\"{0:.1}\" x2=\"{1:.1}\" y2=\"{0:.1}\" stroke=\"#eee\"/><text x=\"8\" y=\"{2:.1}\">L{l}</text>",
            y(l),
            w - right,
            y(l) + 4.0
        );
    }
    for i in 0..=4 {
        let ms = end * f64::from(i) / 4.0;
        let _ = writeln!(
            s,
            "<line x1=\"{0:.1}\" y1=\"{top}\" x2=\"{0:.1}\" y2=\"{1:.1}\" stroke=\"#eee\"/><text x=\"{2:.1}\" y=\"{3:.1}\">{ms:.0} ms</text>",
            x(ms),
            h - bottom,
            x(ms) - 15.0,
            h - bottom + 16.0
        );
    }
    for (r, times) in ranks.iter().enumerate() {
        let color = COLORS[r % COLORS.len()];
        let mut pts = String::new();
        let mut prev = 0.0;
        for (l, &t) in times.iter().enumerate() {
            // A step: the rank waits at layer l-1 until layer l is resident.
            let _ = write!(pts, "{:.1},{:.1} {:.1},{:.1} ", x(prev), y(l), x(t), y(l));
            prev = t;
        }
        let _ = writeln!(
            s,
            "<polyline points=\"{pts}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" opacity=\"0.8\"/>"
        );
        let last = times.last().copied().unwrap_or(0.0);
        let _ = writeln!(
            s,
            "<text x=\"{:.1}\" y=\"{:.1}\" fill=\"{color}\">rank {r}: {last:.0} ms</text>",
            w - right + 8.0,
            top + 14.0 * r as f64
        );
    }
    s.push_str("</svg>\n");
    s
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

/// The tables in the shape of design.md §1, then store bytes and ceilings.
fn tables(tp: u32, gpu: &str, args: &Args, results: &[SizeResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### GLM-5.2 FP8 KV, TP{tp} on {tp} × {gpu}, {STORE}\n\n\
         Time to the last layer resident on every rank (slowest rank; each layer's event waited), \
         median of {} runs after one warm-up. Replicated components are shared through HOST staging \
         (the collective gets host buffers; NcclCollective moves them through a device scratch \
         buffer), not the device-native path.{}\n",
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
        "\nReference (design.md §1; SGLang, GLM-5.2 W4AFP8, 8×H20, TP8, Mooncake, TTFT): 128K 1.959 s vs 1.185 s; \
         256K 3.851 s vs 2.229 s; 512K 7.950 s vs 4.891 s.\n"
    );
    let mut b = Markdown::new(&[
        "cached prefix",
        "mode",
        "store bytes read per rank",
        "total",
        "vs AllRanks total",
        "best / median",
    ]);
    for s in results {
        for m in &s.modes {
            let total: u64 = m.reads.iter().sum();
            b.row(vec![
                fmt_tokens(s.tokens),
                format!("{:?}", m.mode),
                m.reads
                    .iter()
                    .map(|&x| fmt_bytes(x))
                    .collect::<Vec<_>>()
                    .join(" / "),
                fmt_bytes(total),
                format!(
                    "{:.0} %",
                    total as f64 / (s.bytes as f64 * f64::from(tp)) * 100.0
                ),
                format!("{} / {}", secs(m.best()), secs(m.median())),
            ]);
        }
    }
    let _ = writeln!(
        out,
        "Store bytes read ({STORE}; one copy of the prefix per size below):\n"
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
        "kvlink host-buffer broadcast (linker path)",
        "kvlink host-buffer all-gather",
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
            bw(cl.layer_bytes, cl.host_bcast_ms),
            bw(cl.layer_bytes, cl.host_ag_ms),
        ]);
    }
    let _ = writeln!(
        out,
        "\nCeilings measured in the same run (— : not measured; NCCL needs 2+ ranks):\n"
    );
    out.push_str(&c.render());
    out
}
