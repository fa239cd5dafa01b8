//! Benchmarks, each with its ceiling measured in the same run.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::kv_device::cuda::cudarc::driver::{sys, CudaEvent};
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool, DeviceBuffer, PinnedBuffer};
use kvlink::kv_device::{LayerLanding, ScatterStrategy, StagedLanding, StagingPool};
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::{LayerReady, RawStream};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore, ObjectPut, RangedGet, ReadRange};

use super::Args;
use kvlink_rig::glm::{glm, half_bytes, own_all, tag};
use kvlink_rig::measure::{gbps, median, timing_event};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::{de, Report, Status};

#[allow(dead_code)] // the examples share it; this one draws without `chained`
#[path = "../common/timeline_svg.rs"]
mod chart;

const SEC: &str = "bench";

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

pub fn run(args: &Args, gpus: u32, report: &mut Report) {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            report.push(SEC, "open GPU 0", Status::Fail, de(e));
            return;
        }
    };
    h2d(&dev, args, report);
    wait_cost(&dev, report);
    for tokens in [32_768u64, 131_072] {
        if tokens > 32_768 && (args.no_128k || args.quick) {
            report.push(
                SEC,
                format!("layer-wise load {}K", tokens / 1024),
                Status::Skip,
                "--no-128k/--quick",
            );
            continue;
        }
        let tokens = if args.quick { tokens / 8 } else { tokens };
        let name = format!("layer-wise load {}K tokens (embedded store)", tokens / 1024);
        report.check(SEC, &name, || store_load(&dev, tokens, args));
    }
    super::nccl_bench::run(args, gpus, report);
}

/// The layer of the batch with the most bytes.
fn widest_layer(g: &KvGeometry) -> u32 {
    (0..g.num_layers())
        .max_by_key(|&l| {
            g.components()
                .iter()
                .filter(|c| c.position(l).is_some())
                .map(|c| c.page_layer_bytes)
                .sum::<u64>()
        })
        .unwrap_or(0)
}

fn time_on<F: FnMut() -> Result<(), String>>(
    dev: &CudaDevice,
    warm: usize,
    iters: usize,
    mut f: F,
) -> Result<f64, String> {
    let mut ms = Vec::with_capacity(iters);
    for i in 0..warm + iters {
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        let start = timing_event(unsafe { dev.cuda_load_stream() })?;
        f()?;
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        let end = timing_event(unsafe { dev.cuda_load_stream() })?;
        let t = start.elapsed_ms(&end).map_err(|e| e.to_string())?;
        if i >= warm {
            ms.push(f64::from(t));
        }
    }
    Ok(median(&mut ms))
}

/// Staged landing of one GLM-5.2 layer (scattered slots) vs a plain pinned copy of its bytes.
fn h2d(dev: &Arc<CudaDevice>, args: &Args, report: &mut Report) {
    let r = (|| -> Result<(), String> {
        let g = glm(1, 0)?;
        let n = if args.quick { 512 } else { 2048 };
        let pages = n as u32 + 128;
        let layer = widest_layer(&g);
        let bytes: usize = g
            .components()
            .iter()
            .filter(|c| c.position(layer).is_some())
            .map(|c| c.page_layer_bytes as usize * n)
            .sum();
        let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
        let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
        let (warm, iters) = if args.quick { (2, 5) } else { (3, 15) };
        // Ceiling: one plain pinned → device copy of the same bytes, same stream.
        let pinned = PinnedBuffer::zeroed(dev.context(), bytes, "bench").map_err(de)?;
        let dbuf = DeviceBuffer::alloc(dev.context(), bytes, "bench").map_err(de)?;
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        let stream = unsafe { dev.cuda_load_stream() }.cu_stream();
        let ceiling = time_on(dev, warm, iters, || {
            dev.bind().map_err(de)?;
            // SAFETY: our pinned buffer and device buffer, `bytes` each; the timing event
            // after it is synchronized before the next iteration or the drop.
            unsafe {
                sys::cuMemcpyHtoDAsync_v2(dbuf.ptr(), pinned.addr() as *const _, bytes, stream)
            }
            .result()
            .map_err(|e| e.to_string())
        })?;
        report.info(
            SEC,
            format!(
                "H2D ceiling: plain pinned copy, {:.1} MB",
                bytes as f64 / 1e6
            ),
            format!("{ceiling:.3} ms = {:.1} GB/s", gbps(bytes as u64, ceiling)),
        );
        let scattered: Arc<[u32]> = Rng(11).scattered_slots(n, pages)?.into();
        let contiguous: Arc<[u32]> = (64..64 + n as u32).collect::<Vec<_>>().into();
        for (label, slots, strategy, target) in [
            (
                "scattered, kernel (auto)",
                &scattered,
                ScatterStrategy::Auto,
                true,
            ),
            (
                "contiguous, one copy (auto)",
                &contiguous,
                ScatterStrategy::Auto,
                true,
            ),
            (
                "scattered, one copy per page (for contrast)",
                &scattered,
                ScatterStrategy::Runs,
                false,
            ),
        ] {
            let mut calls = (0, 0);
            // Set-up (a fresh landing, targets) stays off the timed span: only `land` is
            // between the two events.
            let t = {
                let mut ms = Vec::new();
                for i in 0..warm + iters {
                    let mut l = StagedLanding::new(
                        pool.clone(),
                        staging.lease().map_err(de)?,
                        slots.clone(),
                        own_all(&g),
                    )
                    .map_err(de)?
                    .with_strategy(strategy);
                    let mut stages = l.take_stages();
                    let stage = &mut stages[0];
                    l.open(stage, layer, soon()).map_err(de)?;
                    // SAFETY: events and raw copies of this crate's memory on the load stream: no
                    // `CudaSlice` is made through it.
                    let start = timing_event(unsafe { dev.cuda_load_stream() })?;
                    l.land(stage).map_err(de)?;
                    // SAFETY: events and raw copies of this crate's memory on the load stream: no
                    // `CudaSlice` is made through it.
                    let end = timing_event(unsafe { dev.cuda_load_stream() })?;
                    let e = start.elapsed_ms(&end).map_err(|e| e.to_string())?;
                    if i >= warm {
                        ms.push(f64::from(e));
                    }
                    let s = l.stats();
                    calls = (s.copies, s.kernel_launches);
                }
                median(&mut ms)
            };
            let ratio = ceiling / t;
            let status = if !target {
                Status::Info
            } else if ratio >= 0.8 {
                Status::Pass
            } else {
                Status::Fail
            };
            report.push(
                SEC,
                format!("H2D staged landing, {label}"),
                status,
                format!(
                    "{t:.3} ms = {:.1} GB/s = {:.0} % of ceiling{} ({} copies, {} launches)",
                    gbps(bytes as u64, t),
                    ratio * 100.0,
                    if target { " (target ≥ 80 %)" } else { "" },
                    calls.0,
                    calls.1
                ),
            );
        }
        Ok(())
    })();
    if let Err(e) = r {
        report.push(SEC, "H2D staged landing", Status::Fail, e);
    }
}

/// The layer wait's cost on the compute stream: `cuStreamWaitEvent` enqueue time.
fn wait_cost(dev: &Arc<CudaDevice>, report: &mut Report) {
    report.check(SEC, "layer wait on the compute stream (cuStreamWaitEvent)", || {
        let g = glm(1, 0)?;
        let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), 8).map_err(de)?);
        let staging = StagingPool::new(dev.clone(), half_bytes(&g, 4), 1).map_err(de)?;
        let mut l = StagedLanding::new(
            pool,
            staging.lease().map_err(de)?,
            vec![0, 2, 4, 6].into(),
            own_all(&g),
        )
        .map_err(de)?;
        let mut stages = l.take_stages();
        l.open(&mut stages[0], 0, soon()).map_err(de)?;
        let LayerReady::Event(ev) = l.land(&mut stages[0]).map_err(de)? else {
            return Err("no event".into());
        };
        // A stream of kvlink's handle: the tracked one's first stream would synchronize the
        // whole context, with no bound. SAFETY: a stream for raw kernels and events: no
        // `CudaSlice` is made through it.
        let compute = unsafe { dev.untracked_context() }
            .new_stream()
            .map_err(|e| e.to_string())?;
        // SAFETY: `compute` is a live stream of this process's context, kept until the end
        // of this block, after the last wait on `raw`.
        let raw = unsafe { RawStream::from_raw(compute.cu_stream() as usize) };
        let mut per_call = Vec::new();
        for _ in 0..20 {
            let n = 1000;
            let t0 = Instant::now();
            for _ in 0..n {
                ev.wait_on_stream(raw).map_err(|e| e.to_string())?;
            }
            per_call.push(t0.elapsed().as_nanos() as f64 / f64::from(n));
        }
        compute.synchronize().map_err(|e| e.to_string())?;
        let wait_ns = median(&mut per_call);
        let mut q = Vec::new();
        for _ in 0..20 {
            let t0 = Instant::now();
            for _ in 0..1000 {
                let _ = ev.synchronize();
            }
            q.push(t0.elapsed().as_nanos() as f64 / 1000.0);
        }
        let q_ns = median(&mut q);
        Ok(format!(
            "cuStreamWaitEvent enqueue {wait_ns:.0} ns/call (CPU thread not blocked); host synchronize on a finished layer {q_ns:.0} ns"
        ))
    });
}

struct LayerTimes {
    read: (f64, f64),
    copy: (f64, f64),
}

/// Layer-wise load of `tokens` tokens of GLM-5.2 from the embedded store through the staged
/// landing; pipelined time vs the sum of its parts; timeline CSV + SVG; sampled check.
fn store_load(dev: &Arc<CudaDevice>, tokens: u64, args: &Args) -> Result<String, String> {
    let g = glm(1, 0)?;
    let n = (tokens / u64::from(g.page_size())) as usize;
    let pages = n as u32 + 64;
    let total: u64 = g.components().iter().map(|c| c.object_bytes()).sum::<u64>() * n as u64;
    let store = EmbeddedStore::new(total + (1 << 30));
    let t_fill = Instant::now();
    let keys: Vec<Vec<String>> = g
        .components()
        .iter()
        .map(|c| (0..n).map(|p| format!("bench_p{p}_c{}", c.id.0)).collect())
        .collect();
    for (ci, c) in g.components().iter().enumerate() {
        let mut obj = vec![0u8; c.object_bytes() as usize];
        let row = c.page_layer_bytes as usize;
        for (p, key) in keys[ci].iter().enumerate() {
            for &l in &c.layers {
                let pos = c.position(l).unwrap_or(0) as usize;
                fill_row(&mut obj[pos * row..(pos + 1) * row], tag(c), l, p as u64);
            }
            let put = ObjectPut {
                key,
                parts: vec![(obj.as_ptr(), obj.len())].into(),
            };
            // SAFETY: `obj` is a live Vec read (not written) during the call.
            let r = unsafe { store.put(&[put]) };
            if let Some(Err(e)) = r.first() {
                return Err(format!("put: {e}"));
            }
        }
    }
    let fill_s = t_fill.elapsed().as_secs_f64();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
    for (a, l) in staging.host_regions() {
        let region = kvlink::mooncake_linker::store::MemoryRegion { addr: a, len: l };
        // SAFETY: an EmbeddedStore keeps nothing of a registration (a no-op), and `staging`
        // outlives every read of this function anyway.
        let _ = unsafe { store.register(region) };
    }
    let slots: Arc<[u32]> = Rng(tokens).scattered_slots(n, pages)?.into();
    let readers = 8usize;
    let mut best: Option<(f64, Vec<LayerTimes>, String)> = None;
    // Sampled check of what a rep landed (the pool is cleared before each, so a rep that
    // landed nothing cannot pass on an earlier one's bytes): three layers, every component on
    // them, every seventh page.
    let check = || -> Result<u64, String> {
        let mut row = Vec::new();
        let mut want = Vec::new();
        let mut checked = 0u64;
        for layer in [0u32, g.num_layers() / 2, g.num_layers() - 1] {
            for c in g
                .components()
                .iter()
                .filter(|c| c.position(layer).is_some())
            {
                let len = c.page_layer_bytes as usize;
                row.resize(len, 0u8);
                want.resize(len, 0u8);
                for p in (0..n).step_by(7) {
                    // SAFETY: the load finished (waited for): nothing writes the pool meanwhile.
                    unsafe { pool.read_slot(c.id, layer, slots[p], &mut row) }.map_err(de)?;
                    fill_row(&mut want, tag(c), layer, p as u64);
                    if row != want {
                        return Err(format!(
                            "layer {layer} component {} page {p}: wrong bytes",
                            c.id.0
                        ));
                    }
                    checked += len as u64;
                }
            }
        }
        Ok(checked)
    };
    let reps = if args.quick { 1 } else { 3 };
    let mut checked = 0u64;
    for _ in 0..reps {
        // SAFETY: no load of this bench is in flight (each rep's landing was dropped after
        // its last layer was waited for).
        unsafe { pool.clear() }.map_err(de)?;
        let mut landing = StagedLanding::new(
            pool.clone(),
            staging.lease().map_err(de)?,
            slots.clone(),
            own_all(&g),
        )
        .map_err(de)?;
        let mut stages = landing.take_stages();
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        let base = timing_event(unsafe { dev.cuda_load_stream() })?;
        let t0 = Instant::now();
        let mut marks: Vec<(f64, f64, CudaEvent, CudaEvent)> = Vec::new();
        let mut last = None;
        for layer in 0..g.num_layers() {
            let r0 = t0.elapsed().as_secs_f64() * 1e3;
            let stage = &mut stages[layer as usize % 2];
            landing.open(stage, layer, soon()).map_err(de)?;
            // The stage is lent while the readers below write it (this bench calls the raw
            // store, as the linker's typed read does underneath).
            let loan = landing.lend(stage).map_err(de)?;
            let mut dsts: Vec<(usize, usize, usize)> = Vec::new();
            for (ci, c) in g.components().iter().enumerate() {
                if c.position(layer).is_none() {
                    continue;
                }
                for p in 0..n {
                    let t = landing.target(&loan, c.id, p).map_err(de)?;
                    dsts.push((ci, p, t.addr()));
                }
            }
            let chunk = dsts.len().div_ceil(readers).max(1);
            let failed = std::thread::scope(|s| {
                let hs: Vec<_> = dsts
                    .chunks(chunk)
                    .map(|part| {
                        let store = &store;
                        let keys = &keys;
                        let g = &g;
                        s.spawn(move || {
                            let gets: Vec<RangedGet<'_>> = part
                                .iter()
                                .map(|&(ci, p, dst)| {
                                    let c = &g.components()[ci];
                                    let range = c.layer_range(layer).unwrap_or(0..0);
                                    RangedGet {
                                        key: &keys[ci][p],
                                        ranges: vec![ReadRange {
                                            dst: dst as *mut u8,
                                            len: c.page_layer_bytes as usize,
                                            offset: range.start,
                                        }]
                                        .into(),
                                    }
                                })
                                .collect();
                            // SAFETY: every destination is a distinct staging row of this
                            // layer, a target of the stage's loan (which lives until every
                            // reader joined), untouched by the landing while it is lent.
                            let res = unsafe { store.get_ranges(&gets) };
                            res.iter().filter(|r| r.is_err()).count()
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap_or(1)).sum::<usize>()
            });
            drop(loan);
            if failed > 0 {
                return Err(format!("{failed} reads failed at layer {layer}"));
            }
            let r1 = t0.elapsed().as_secs_f64() * 1e3;
            // SAFETY: events and raw copies of this crate's memory on the load stream: no
            // `CudaSlice` is made through it.
            let s = timing_event(unsafe { dev.cuda_load_stream() })?;
            let ready = landing.land(stage).map_err(de)?;
            // SAFETY: events and raw copies of this crate's memory on the load stream: no
            // `CudaSlice` is made through it.
            let e = timing_event(unsafe { dev.cuda_load_stream() })?;
            marks.push((r0, r1, s, e));
            last = Some(ready);
        }
        if let Some(LayerReady::Event(ev)) = &last {
            ev.synchronize().map_err(|e| e.to_string())?;
        }
        let wall = t0.elapsed().as_secs_f64() * 1e3;
        let mut times = Vec::new();
        for (r0, r1, s, e) in &marks {
            let cs = f64::from(base.elapsed_ms(s).map_err(|x| x.to_string())?);
            let ce = f64::from(base.elapsed_ms(e).map_err(|x| x.to_string())?);
            times.push(LayerTimes {
                read: (*r0, *r1),
                copy: (cs, ce),
            });
        }
        let stats = landing.stats();
        let detail = format!(
            "{} copies + {} launches",
            stats.copies, stats.kernel_launches
        );
        drop(landing);
        checked = check()?;
        if best.as_ref().is_none_or(|b| wall < b.0) {
            best = Some((wall, times, detail));
        }
    }
    let (wall, times, detail) = best.ok_or("no run")?;
    let read_sum: f64 = times.iter().map(|t| t.read.1 - t.read.0).sum();
    let copy_sum: f64 = times.iter().map(|t| t.copy.1 - t.copy.0).sum();
    let one_layer = times
        .iter()
        .map(|t| (t.read.1 - t.read.0).max(t.copy.1 - t.copy.0))
        .fold(0.0, f64::max);
    let bound = read_sum.max(copy_sum) + one_layer;
    let bytes = (total as f64) / 1e9;
    if let Some(dir) = &args.out {
        let tag = format!("{}k", tokens / 1024);
        let mut csv = String::from("layer,read_start_ms,read_end_ms,copy_start_ms,copy_end_ms\n");
        for (l, t) in times.iter().enumerate() {
            let _ = writeln!(
                csv,
                "{l},{:.3},{:.3},{:.3},{:.3}",
                t.read.0, t.read.1, t.copy.0, t.copy.1
            );
        }
        let _ = std::fs::write(dir.join(format!("timeline_{tag}.csv")), csv);
        let _ = std::fs::write(
            dir.join(format!("timeline_{tag}.svg")),
            timeline_svg(&times, &tag, wall),
        );
    }
    // With copies under 5 % of the reads, overlap cannot show against the noise of the reads:
    // the row says so rather than pass as overlapped.
    let measurable = copy_sum >= 0.05 * read_sum;
    let ok = !measurable || wall <= (read_sum + copy_sum) * 0.98;
    let verdict = if ok { "" } else { " — NOT overlapped" };
    let overlap = if measurable {
        "overlapped"
    } else {
        "overlap not measurable: copies under 5 % of the reads"
    };
    if !ok {
        return Err(format!(
            "{:.2} GB: pipelined {wall:.0} ms vs sum of parts {:.0} ms (read {read_sum:.0} + copy {copy_sum:.0}){verdict}",
            bytes,
            read_sum + copy_sum
        ));
    }
    Ok(format!(
        "{bytes:.2} GB in {wall:.0} ms (best of {reps}; {:.1} GB/s); sum of parts {:.0} ms (read {read_sum:.0} with {readers} threads + H2D {copy_sum:.0}; {overlap}); bound max+1 layer {bound:.0} ms; {detail}; store fill {fill_s:.1} s; {:.0} MB sampled equal",
        bytes / (wall / 1e3),
        read_sum + copy_sum,
        checked as f64 / 1e6
    ))
}

/// The load's layers on two rows, store read (host) and H2D landing (device), drawn by the
/// examples' timeline module.
fn timeline_svg(times: &[LayerTimes], tag: &str, wall: f64) -> String {
    const READ: [&str; 2] = ["#2f6ea8", "#8fbce6"];
    const COPY: [&str; 2] = ["#e0701b", "#f7b77a"];
    let row =
        |label: &str, shades: [&'static str; 2], of: fn(&LayerTimes) -> (f64, f64)| chart::Row {
            label: label.to_string(),
            spans: times
                .iter()
                .enumerate()
                .map(|(l, t)| {
                    let (a, b) = of(t);
                    chart::Span {
                        start: a,
                        end: b,
                        fill: shades[l % 2],
                        thin: false,
                        title: format!("layer {l} {label}: {a:.2} to {b:.2} ms"),
                    }
                })
                .collect(),
            mark: None,
            tags: Vec::new(),
        };
    let mut landing = row("H2D landing (device)", COPY, |t| t.copy);
    landing.mark = Some(chart::Mark {
        at: wall,
        color: "#7a3300",
        text: format!("all landed {wall:.0} ms"),
    });
    let rows = vec![row("store read (host)", READ, |t| t.read), landing];
    chart::render(&chart::Chart {
        title: format!("GLM-5.2 {tag} layer-wise load: {wall:.0} ms total"),
        subtitle: "store read on the host, then the H2D landing on the device, layer by layer"
            .into(),
        axis_label: "time since the load started (ms)".into(),
        blocks: vec![chart::Block {
            lanes: vec![chart::Lane {
                label: tag.to_string(),
                rows,
            }],
            ..chart::Block::default()
        }],
        legend: vec![
            (READ[0], READ[1], "store read of a layer (host)".into()),
            (COPY[0], COPY[1], "H2D landing of a layer (device)".into()),
        ],
    })
}
