//! One rank process: meets the others at the rendezvous, saves the prefix (rank 0), then per
//! mode loads it into its own pool through its own linker with the simulated compute,
//! verifies its pool, and sends its numbers to rank 0, which prints the tables.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use kvlink::dedup_broadcast::{MeetingPoint, ModeChoice, Rendezvous, RendezvousConfig};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec};
use kvlink::kv_loader::{
    BatchId, BatchPlan, KvLoader, LoadStats, LookupRequest, RequestPages, SaveReport, ShareMode,
};
use kvlink::mooncake_linker::{FormedTpGroup, Linker, TpGroup};

use super::super::{
    compare_table, mode_label, prompt, report_run, scattered_slots, splitmix, verify_pool,
    write_svg, Ctx, LoadRun, ModeOutcome, RankDone, Stores, SAVE_CHUNK_PAGES,
};
use super::gather::{self, RankReport};
use super::stores::{self, NAMESPACE_ATTRIBUTE};
use crate::args::{Args, ModeArg, ModeSel, StoreKind};
use crate::pattern::Pattern;
use crate::progress::Progress;
use crate::report::{bytes, ms, thousands, Table};
use crate::timeline_svg::{RankTimeline, RunTimeline};

/// The line rank 0 prints first when it listens on a port the system chose (`:0`): the
/// launcher reads the address from it.
pub(crate) const RENDEZVOUS_MARK: &str = "glm_prefill rank 0 rendezvous at ";

/// How long the ranks wait for each other at the rendezvous.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(120);

fn progress(rank: u32, label: &str, total: u64, unit: &'static str) -> Progress {
    Progress::with_enabled(
        label,
        total,
        unit,
        rank == 0 && std::io::stderr().is_terminal(),
    )
}

/// A rank process (see the module docs).
pub(super) fn run(args: &Args, out: &mut dyn Write) -> Result<()> {
    let (Some(rank), Some(world), Some(meet)) = (
        args.procs.rank,
        args.procs.world,
        args.procs.rendezvous.clone(),
    ) else {
        bail!("a rank process needs --rank, --world and --rendezvous");
    };
    let spec = ModelKvSpec::glm52_dsa_fp8();
    let page = u64::from(spec.page_size);
    let n_pages = (args.tokens / page) as usize;
    let tokens = prompt(args.seed, n_pages * page as usize);
    let pages = page_hashes(&tokens, spec.page_size, None);
    let geometry = KvGeometry::new(spec.clone(), world, rank)?;
    let max_slice = geometry
        .components()
        .iter()
        .map(|c| c.page_layer_bytes as usize)
        .max()
        .unwrap_or(0);
    let prefix_bytes = geometry.bytes_per_page() * n_pages as u64;

    let config = RendezvousConfig::new(rank, world, MeetingPoint::Tcp(meet.clone()))
        .geometry(&geometry)
        .timeout(RENDEZVOUS_TIMEOUT);
    let mut rv = Rendezvous::new(config).with_context(|| format!("rank {rank}: rendezvous"))?;
    let meet = match rv.listen_addr() {
        Some(at) => {
            if meet.ends_with(":0") {
                writeln!(out, "{RENDEZVOUS_MARK}{at}")?;
                out.flush()?;
            }
            at.to_string()
        }
        None => meet,
    };
    let opened = stores::open(
        args,
        rank,
        prefix_bytes + prefix_bytes / 8 + (64 << 20),
        &mut rv,
    )?;
    if rank == 0 {
        rv.set_attribute(NAMESPACE_ATTRIBUTE, namespace(args.store));
    }
    let formed = TpGroup::from_rendezvous(rv)
        .with_context(|| format!("rank {rank}: forming the group at {meet}"))?;
    let store = opened.resolve(&formed, rank)?;
    let ctx = Ctx {
        args: args.clone(),
        pool_pages: (n_pages + n_pages / 4 + 1) as u32,
        namespace: formed
            .attributes
            .get(NAMESPACE_ATTRIBUTE)
            .cloned()
            .unwrap_or_else(|| "glm52".into()),
        store: Stores {
            per_rank: vec![store.clone()],
            embedded: None,
            label: stores::label(args),
            sharing: String::new(),
        },
        spec,
        tokens,
        pages,
        pattern: Pattern::new(args.seed, max_slice),
    };
    let control = formed.group.control.clone();
    if rank == 0 {
        header(&ctx, &formed, &meet, out)?;
    }
    // Rank 0 saves the prefix; the others wait for it before they look it up.
    if rank == 0 {
        save(&ctx, &store, opened.embedded().map(|e| e.len()), out)?;
    }
    gather::barrier(control.as_ref()).context("waiting for rank 0's save")?;

    let modes: Vec<ModeArg> = match args.mode {
        ModeSel::One(m) => vec![m],
        ModeSel::Compare => ModeArg::ALL.to_vec(),
    };
    let mut results = Vec::new();
    let mut mine = Vec::new();
    for (i, &mode) in modes.iter().enumerate() {
        if rank == 0 {
            writeln!(out)?;
            writeln!(
                out,
                "step 2{} — load it as a new request, mode {} (LinkerConfig.mode), store: {}",
                if modes.len() > 1 {
                    format!(".{}", i + 1)
                } else {
                    String::new()
                },
                mode.name(),
                ctx.store_label()
            )?;
        }
        let report = load_mode(&ctx, rank, &formed, &store, mode);
        mine.push((mode, own_verdict(&report)));
        let all = gather::all_gather(control.as_ref(), &report.encode())
            .context("gathering every rank's numbers")?;
        if rank == 0 {
            let reports: Vec<RankReport> = all
                .iter()
                .map(|b| RankReport::decode(b))
                .collect::<Result<_>>()?;
            let outcome = assemble(&ctx, mode, &reports, out)?;
            results.push((mode, outcome));
        }
    }
    if rank == 0 {
        finish(&ctx, &results, out)
    } else {
        own_summary(&ctx, rank, &mine, out)
    }
}

/// Rank 0's namespace for this run (the others take it from the rendezvous).
fn namespace(store: StoreKind) -> String {
    match store {
        StoreKind::Embedded => "glm52".to_string(),
        StoreKind::Mooncake => {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            format!(
                "glm52-{:x}",
                splitmix(nanos ^ u64::from(std::process::id())) >> 16
            )
        }
    }
}

fn header(ctx: &Ctx, formed: &FormedTpGroup, meet: &str, out: &mut dyn Write) -> Result<()> {
    let g = ctx.geometry(0)?;
    let n = ctx.pages.len() as u64;
    let transport = formed
        .formation
        .last()
        .map_or("?".to_string(), |m| format!("{:?}", m.transport));
    writeln!(
        out,
        "kvlink glm_prefill — {} with FP8 KV (DSA): {} layers, {}-token pages, {} B/token",
        ctx.spec.model,
        ctx.spec.num_layers,
        ctx.spec.page_size,
        thousands(ctx.spec.bytes_per_token() as u64)
    )?;
    writeln!(
        out,
        "  cached prefix: {} tokens = {} pages = {} per rank ({} B per page); every component is \
         replicated: each TP rank needs the same bytes",
        thousands(n * u64::from(ctx.spec.page_size)),
        n,
        bytes(ctx.bytes_per_rank()?),
        thousands(g.bytes_per_page())
    )?;
    writeln!(
        out,
        "  TP ranks: {} PROCESSES (this one is rank 0); each has its own HostKvPool of {} page \
         slots and its own Linker; the group formed at the rendezvous {meet} (epoch {}, socket \
         collectives over {transport})",
        ctx.tp(),
        ctx.pool_pages,
        formed.epoch
    )?;
    writeln!(
        out,
        "  store: {}; {}",
        ctx.store_label(),
        stores::whereabouts(&ctx.args, formed)
    )?;
    writeln!(
        out,
        "  attention compute: SIMULATED, {} µs per layer (the engine thread sleeps: stands for \
         GPU work, uses no CPU)",
        thousands(ctx.args.compute_us)
    )?;
    Ok(())
}

/// Rank 0 fills its pool with the prefix and saves it (only rank 0 writes replicated
/// objects; the other ranks' save calls would write nothing).
fn save(
    ctx: &Ctx,
    store: &Arc<dyn kvlink::mooncake_linker::store::KvStore>,
    held: Option<usize>,
    out: &mut dyn Write,
) -> Result<()> {
    let n = ctx.pages.len();
    writeln!(out)?;
    writeln!(
        out,
        "step 1 — save the prefix as the request that computed it would have (rank 0 writes; \
         store: {})",
        ctx.store_label()
    )?;
    let g = ctx.geometry(0)?;
    let pool = Arc::new(HostKvPool::new(g.clone(), n as u32)?);
    let linker = Linker::new(
        g.clone(),
        store.clone(),
        pool.clone(),
        ctx.config(ModeChoice::Fixed(ShareMode::AllRanks)),
    )
    .context("rank 0: Linker::new")?;
    let t = Instant::now();
    let fill = progress(0, "fill rank-0 pool", n as u64, "pages");
    let mut buf = Vec::new();
    for (slot, page) in ctx.pages.iter().enumerate() {
        for c in g.components() {
            buf.resize(c.page_layer_bytes as usize, 0);
            for &l in &c.layers {
                ctx.pattern.fill(page, c.id.0, l, &mut buf);
                // SAFETY: this pool is filled here, before its linker saves it.
                unsafe { pool.write_slot(c.id, l, slot as u32, &buf) }?;
            }
        }
        fill.inc(1);
    }
    fill.finish();
    let fill_time = t.elapsed();
    let t = Instant::now();
    let mut total = SaveReport::default();
    for (ci, chunk) in ctx.pages.chunks(SAVE_CHUNK_PAGES).enumerate() {
        let first = ci * SAVE_CHUNK_PAGES;
        let plan = BatchPlan::all_components(
            linker.geometry(),
            BatchId(0),
            vec![RequestPages {
                request: "previous-request".into(),
                pages: chunk.to_vec(),
            }],
            (first as u32..(first + chunk.len()) as u32).collect(),
        );
        let r = linker.save(&plan).context("rank 0: save")?;
        total.objects_written += r.objects_written;
        total.objects_present += r.objects_present;
        total.bytes_written += r.bytes_written;
    }
    linker.close()?;
    writeln!(
        out,
        "  rank 0's pool filled with deterministic pseudo-random bytes per (page hash, component, \
         layer), seed {}: {} pages in {}; saved in {}: {} objects written, {} already present, {}",
        ctx.args.seed,
        n,
        ms(fill_time),
        ms(t.elapsed()),
        thousands(u64::from(total.objects_written)),
        thousands(u64::from(total.objects_present)),
        bytes(total.bytes_written)
    )?;
    if let Some(objects) = held {
        writeln!(
            out,
            "  rank 0's embedded store now holds {} objects",
            thousands(objects as u64)
        )?;
    }
    Ok(())
}

/// What this rank alone can say about its load of one mode: `Ok` when it loaded and
/// verified.
fn own_verdict(r: &RankReport) -> Result<u64, String> {
    if let Some(e) = r
        .start_err
        .as_ref()
        .or(r.batch_err.as_ref())
        .or(r.layer_err.as_ref())
    {
        return Err(e.clone());
    }
    r.verified
        .clone()
        .unwrap_or_else(|| Err("not verified".into()))
}

/// One mode on this rank: a fresh pool (touched) and linker, the group's lookup, the load
/// with the simulated compute, the check of this rank's pool. Failures are recorded in the
/// report, so that every rank still reaches the gather.
fn load_mode(
    ctx: &Ctx,
    rank: u32,
    formed: &FormedTpGroup,
    store: &Arc<dyn kvlink::mooncake_linker::store::KvStore>,
    mode: ModeArg,
) -> RankReport {
    let mut rep = RankReport::default();
    let n = ctx.pages.len();
    let setup = || -> Result<(Arc<HostKvPool>, Linker)> {
        let g = ctx.geometry(rank)?;
        let pool = Arc::new(HostKvPool::new(g.clone(), ctx.pool_pages)?);
        let touch = progress(
            rank,
            "allocate + touch pool",
            u64::from(ctx.pool_pages),
            "slots",
        );
        super::super::pretouch(&pool, &touch)?;
        touch.finish();
        let linker = Linker::with_group(
            g,
            store.clone(),
            pool.clone(),
            ctx.config(mode.choice()),
            formed.group.clone(),
        )
        .with_context(|| format!("rank {rank}: Linker::with_group"))?;
        Ok((pool, linker))
    };
    let (pool, linker) = match setup() {
        Ok(x) => x,
        Err(e) => {
            rep.start_err = Some(format!("{e:#}"));
            return rep;
        }
    };
    let slots = scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages);
    let loaded = (|| -> Result<()> {
        let hit = linker
            .lookup(&LookupRequest {
                tokens: &ctx.tokens,
                skip_pages: 0,
            })
            .with_context(|| format!("rank {rank}: lookup"))?;
        rep.hit = hit.pages.len() as u64;
        if hit.pages.len() < n {
            bail!(
                "the store holds only {} of the {n} saved pages (evicted?)",
                hit.pages.len()
            );
        }
        if mode == ModeArg::Auto {
            calibrate_auto(ctx, &linker, &slots)?;
        }
        // Every rank starts its load together (as the threads shape's barrier does).
        gather::barrier(formed.group.control.as_ref())?;
        load(ctx, rank, &linker, &slots, &mut rep);
        Ok(())
    })();
    if let Err(e) = loaded {
        rep.start_err = Some(format!("{e:#}"));
    }
    if rep.start_err.is_none() && rep.batch_err.is_none() && rep.layer_err.is_none() {
        let t = Instant::now();
        let verify = progress(rank, "verify pool", n as u64, "pages");
        rep.verified = Some(verify_pool(ctx, rank as usize, &pool, &slots, &verify));
        verify.finish();
        rep.verify_time = t.elapsed();
    }
    // Closing is best effort: the report already has the outcome.
    let _ = linker.close();
    rep
}

/// Auto measures before it chooses: one batch per mode on this rank's linker (every rank
/// does the same), not timed.
fn calibrate_auto(ctx: &Ctx, linker: &Linker, slots: &[u32]) -> Result<()> {
    for batch in 100..103u64 {
        let plan = BatchPlan::all_components(
            linker.geometry(),
            BatchId(batch),
            vec![RequestPages {
                request: "auto-calibration".into(),
                pages: ctx.pages.clone(),
            }],
            slots.to_vec(),
        );
        let t = linker.start_load(plan)?;
        for l in 0..linker.num_layers() {
            linker.wait_layer(&t, l)?;
        }
        linker.wait_batch(&t)?.result?;
    }
    Ok(())
}

/// The load of batch 1 with the simulated compute: an engine thread waits for each layer and
/// "computes" it, a watcher notes when each layer is ready.
fn load(ctx: &Ctx, rank: u32, linker: &Linker, slots: &[u32], rep: &mut RankReport) {
    let layers = ctx.layers();
    let compute = Duration::from_micros(ctx.args.compute_us);
    let plan = BatchPlan::all_components(
        linker.geometry(),
        BatchId(1),
        vec![RequestPages {
            request: "new-request".into(),
            pages: ctx.pages.clone(),
        }],
        slots.to_vec(),
    );
    let progress = progress(rank, "load", u64::from(layers), "layers");
    let start = Instant::now();
    let ticket = match linker.start_load(plan) {
        Ok(t) => t,
        Err(e) => {
            rep.start_err = Some(format!("start_load: {e}"));
            return;
        }
    };
    let (mut seen, mut done) = (Vec::new(), Vec::new());
    let ready = std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            let mut ready = Vec::with_capacity(layers as usize);
            for l in 0..layers {
                if linker.wait_layer(&ticket, l).is_err() {
                    break;
                }
                ready.push(start.elapsed());
                progress.inc(1);
            }
            ready
        });
        for l in 0..layers {
            if let Err(e) = linker.wait_layer(&ticket, l) {
                rep.layer_err = Some(format!("layer {l}: {e}"));
                break;
            }
            seen.push(start.elapsed());
            if !compute.is_zero() {
                std::thread::sleep(compute);
            }
            done.push(start.elapsed());
        }
        watcher.join().unwrap_or_default()
    });
    progress.finish();
    rep.ready = ready;
    rep.seen = seen;
    rep.done = done;
    match linker.wait_batch(&ticket).map(|o| o.result) {
        Ok(Ok(stats)) => {
            rep.mode = Some(stats.mode);
            rep.pages = stats.pages;
            rep.bytes_read = stats.bytes_read;
            rep.bytes_landed = stats.bytes_landed;
            rep.first_layer = stats.first_layer;
            rep.last_layer = stats.last_layer;
            rep.store_bytes_read = stats.bytes_read;
        }
        Ok(Err(e)) | Err(e) => {
            rep.batch_err = Some(e.to_string());
            rep.store_bytes_read = linker.metrics().bytes_read;
        }
    }
}

/// Rank 0: every rank's report of one mode, checked and printed as the threads shape does.
fn assemble(
    ctx: &Ctx,
    mode: ModeArg,
    reports: &[RankReport],
    out: &mut dyn Write,
) -> Result<ModeOutcome> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    let hits: Vec<u64> = reports.iter().map(|r| r.hit).collect();
    let agreed = hits.iter().copied().min().unwrap_or(0);
    writeln!(
        out,
        "  lookup: pages found per rank {hits:?}; agreed prefix {agreed} pages ({} tokens)",
        thousands(agreed * u64::from(ctx.spec.page_size))
    )?;
    for rank in 0..tp {
        let shown: Vec<String> = scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages)
            .iter()
            .take(6)
            .map(|s| s.to_string())
            .collect();
        writeln!(
            out,
            "  rank {rank} slots (page i → slot): [{}, ...] (scattered, differs per rank; its own \
             process and pool)",
            shown.join(", ")
        )?;
    }
    for (rank, r) in reports.iter().enumerate() {
        let failed = r
            .start_err
            .as_ref()
            .or(r.batch_err.as_ref())
            .or(r.layer_err.as_ref());
        if let Some(e) = failed {
            let why = format!("rank {rank}: {e}");
            writeln!(out, "  FAILED: {why}")?;
            return Ok(ModeOutcome::Failed(why));
        }
        if let Some(Err(e)) = &r.verified {
            writeln!(out, "  FAILED: {e}")?;
            return Ok(ModeOutcome::Failed(e.clone()));
        }
    }
    let compared: u64 = reports
        .iter()
        .map(|r| r.verified.clone().and_then(Result::ok).unwrap_or(0))
        .sum();
    let verify_time = reports
        .iter()
        .map(|r| r.verify_time)
        .max()
        .unwrap_or_default();
    let stats: Vec<LoadStats> = reports.iter().map(|r| stats_of(ctx, r)).collect();
    let effective = stats[0].mode;
    if let ModeChoice::Fixed(share) = mode.choice() {
        if stats.iter().any(|s| s.mode != share) {
            let modes: Vec<String> = stats.iter().map(|s| format!("{:?}", s.mode)).collect();
            let why = format!(
                "the linker was configured with {share:?} but loaded the batch as [{}] \
                 (LoadStats.mode per rank); its numbers are not shown as {}",
                modes.join(", "),
                mode.name()
            );
            writeln!(out, "  not run as {}: {why}", mode.name())?;
            return Ok(ModeOutcome::RanAs(effective, why));
        }
    }
    let ms_of = |d: &Duration| d.as_secs_f64() * 1e3;
    let mut ranks = Vec::new();
    let mut timeline = RunTimeline {
        label: mode_label(mode, effective),
        ..RunTimeline::default()
    };
    for (rank, (r, st)) in reports.iter().zip(&stats).enumerate() {
        let ready: Vec<f64> = r
            .ready
            .iter()
            .zip(&r.seen)
            .map(|(a, b)| ms_of(a.min(b)))
            .collect();
        let stalled: Duration = (1..r.seen.len())
            .map(|l| r.seen[l].saturating_sub(r.done[l - 1]))
            .sum();
        let compute: Duration = r.seen.iter().zip(&r.done).map(|(a, b)| *b - *a).sum();
        timeline.ranks.push(RankTimeline {
            rank: rank as u32,
            start: 0.0,
            ready,
            seen: r.seen.iter().map(ms_of).collect(),
            done: r.done.iter().map(ms_of).collect(),
        });
        ranks.push(RankDone {
            stats: st.clone(),
            store_bytes_read: r.store_bytes_read,
            forward_done: r.done.last().copied().unwrap_or_default(),
            stalled,
            compute,
        });
    }
    let mut run = LoadRun {
        effective,
        ranks,
        timeline,
    };
    report_run(ctx, mode, &run, out)?;
    writeln!(
        out,
        "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (each rank process \
         checked its own pool; {} compared, slowest rank {})",
        bytes(compared),
        ms(verify_time)
    )?;
    run.timeline.note = format!(
        "last layer ready {} · forward done {} · store bytes read {} total",
        ms(run.last_ready()),
        ms(run.forward_done()),
        bytes(run.store_bytes_total())
    );
    Ok(ModeOutcome::Loaded(Box::new(run)))
}

fn stats_of(ctx: &Ctx, r: &RankReport) -> LoadStats {
    LoadStats {
        pages: r.pages,
        layers: ctx.layers(),
        bytes_read: r.bytes_read,
        bytes_landed: r.bytes_landed,
        mode: r.mode.unwrap_or(ShareMode::AllRanks),
        first_layer: r.first_layer,
        last_layer: r.last_layer,
        transfers: Default::default(),
        layer_transfers: Vec::new(),
        alone: None,
    }
}

/// Rank 0's end: the picture, the comparison, the verdict.
fn finish(ctx: &Ctx, results: &[(ModeArg, ModeOutcome)], out: &mut dyn Write) -> Result<()> {
    let runs: Vec<RunTimeline> = results
        .iter()
        .filter_map(|(_, o)| match o {
            ModeOutcome::Loaded(r) => Some(r.timeline.clone()),
            _ => None,
        })
        .collect();
    if !runs.is_empty() {
        write_svg(ctx, &runs, out)?;
    }
    if ctx.args.mode == ModeSel::Compare {
        compare_table(ctx, results, out)?;
        writeln!(
            out,
            "(TP ranks as PROCESSES: each rank's store reads and the group's collectives cross \
             process boundaries over Unix sockets; times are the slowest rank's, from its own \
             start_load, every rank starting after a barrier)"
        )?;
    }
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(m, o)| match o {
            ModeOutcome::Failed(e) => Some(format!("{}: {e}", m.name())),
            _ => None,
        })
        .collect();
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(())
}

/// A rank other than 0: one line per mode about its own pool (rank 0 prints the tables).
fn own_summary(
    ctx: &Ctx,
    rank: u32,
    mine: &[(ModeArg, Result<u64, String>)],
    out: &mut dyn Write,
) -> Result<()> {
    let mut t = Table::new(&["rank", "mode", "own pool"]);
    for (mode, v) in mine {
        t.row(vec![
            rank.to_string(),
            mode.name().to_string(),
            match v {
                Ok(b) => format!(
                    "verified: {} pages byte-identical to the saved bytes ({} compared)",
                    ctx.pages.len(),
                    bytes(*b)
                ),
                Err(e) => format!("FAILED: {e}"),
            },
        ]);
    }
    writeln!(
        out,
        "glm_prefill rank {rank} of {}: rank 0 prints the report; this process's own pool:",
        ctx.tp()
    )?;
    t.write(out, "  ")?;
    let failed: Vec<String> = mine
        .iter()
        .filter_map(|(m, v)| v.as_ref().err().map(|e| format!("{}: {e}", m.name())))
        .collect();
    if !failed.is_empty() {
        bail!("rank {rank}: {}", failed.join("; "));
    }
    Ok(())
}
