//! One rank process: meets the others at the rendezvous, saves the prefix (rank 0), then per
//! mode loads it into its own pool through its own linker with the simulated compute,
//! verifies its pool, and sends its numbers to rank 0, which prints the tables.

use std::io::{IsTerminal, Write};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kvlink::dedup_broadcast::{Collective, MeetingPoint, ModeChoice, Rendezvous, RendezvousConfig};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec};
use kvlink::kv_loader::{
    BatchId, BatchPlan, KvLoader, LookupRequest, RequestPages, SaveReport, ShareMode,
};
use kvlink::mooncake_linker::{FormedTpGroup, Linker, TpGroup};

use super::super::calibrate::{calibration_batch, CALIBRATION_CAP};
use super::super::{prompt, run_namespace, save_plans, scattered_slots, verify_pool, Ctx, Stores};
use super::gather::{self, RankReport};
use super::stores::{self, NAMESPACE_ATTRIBUTE};
use super::tables::{assemble, finish, header, own_summary};
use crate::args::{Args, ModeArg};
use crate::auto_reason::Calibration;
use crate::pattern::Pattern;
use crate::progress::Progress;
use crate::report::{bytes, ms, thousands};

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
        rv.set_attribute(NAMESPACE_ATTRIBUTE, run_namespace(args.store));
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
        save(&ctx, &store, opened.embedded(), out)?;
    }
    gather::barrier(control.as_ref()).context("waiting for rank 0's save")?;

    let modes = args.mode.modes();
    let mut results = Vec::new();
    let mut mine = Vec::new();
    for (i, &mode) in modes.iter().enumerate() {
        if rank == 0 {
            writeln!(out)?;
            writeln!(out, "{}", ctx.step2_line(i, modes.len(), mode))?;
        }
        let report = load_mode(&ctx, rank, &formed, &store, mode);
        if rank == 0 {
            for (w, r) in report.warmups.iter().enumerate() {
                match r {
                    Ok(l) => writeln!(
                        out,
                        "  warm-up batch {} of {} (not reported below): rank 0's last layer ready {:.1} ms",
                        w + 1,
                        report.warmups.len(),
                        l.as_secs_f64() * 1e3
                    )?,
                    Err(e) => writeln!(
                        out,
                        "  warm-up batch {} failed on rank 0: {e} (rank 0's pool is not zeroed after the warm-ups)",
                        w + 1
                    )?,
                }
            }
        }
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

/// Rank 0 fills its pool with the prefix and saves it (only rank 0 writes replicated
/// objects; the other ranks' save calls would write nothing).
fn save(
    ctx: &Ctx,
    store: &Arc<dyn kvlink::mooncake_linker::store::KvStore>,
    embedded: Option<&Arc<kvlink::mooncake_linker::store::EmbeddedStore>>,
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
    // SAFETY: this pool is filled here, before its linker saves it.
    unsafe { ctx.fill_prefix(&g, &pool, || fill.inc(1)) }?;
    fill.finish();
    let fill_time = t.elapsed();
    let t = Instant::now();
    let mut total = SaveReport::default();
    for plan in save_plans(linker.geometry(), &ctx.pages) {
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
    // Counted once the save is done (it was counted before it, and said 0).
    if let Some(store) = embedded {
        writeln!(
            out,
            "  rank 0's embedded store now holds {} objects",
            thousands(store.len() as u64)
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
        let calibration = if mode == ModeArg::Auto {
            let seen = calibrate_auto(ctx, &linker, &slots, formed.group.control.as_ref())?;
            // SAFETY: every calibration batch loaded on every rank (`calibrate_auto` fails
            // otherwise) and was waited for to its outcome, so no load of this pool is in
            // flight; zeroed, the measured batch's check sees only what it landed.
            unsafe { pool.clear() };
            Some(seen)
        } else {
            None
        };
        if calibration.is_none() {
            // A fixed mode's warm-up batches (`--warmup`), run as the measured one is; a
            // failed one is noted and the next goes on (every rank meets every barrier).
            for w in 0..u64::from(ctx.args.warmup) {
                gather::barrier(formed.group.control.as_ref())?;
                let mut scratch = RankReport::default();
                load(ctx, rank, &linker, &slots, &mut scratch, 50 + w);
                rep.warmups.push(warmup_outcome(&scratch));
            }
            if rep.warmups.iter().all(Result::is_ok) {
                // SAFETY: every warm-up batch loaded and was waited for to its outcome
                // (`load` takes `wait_batch`), so no load of this pool is in flight; zeroed,
                // the measured batch's check sees only what it landed.
                unsafe { pool.clear() };
            }
        }
        // Every rank starts its load together (as the threads shape's barrier does).
        gather::barrier(formed.group.control.as_ref())?;
        load(ctx, rank, &linker, &slots, &mut rep, 1);
        if let Some(seen) = calibration {
            rep.auto_reason = Some(match linker.auto_decision() {
                Some(kept) => seen.reason(kept),
                None => format!(
                    "Auto had not decided after {} calibration batches ({})",
                    seen.batches(),
                    seen.order().join(", ")
                ),
            });
        }
        Ok(())
    })();
    if let Err(e) = loaded {
        rep.start_err = Some(format!("{e:#}"));
    }
    if rep.warmups.iter().any(Result::is_err) {
        // The pool keeps what a warm-up landed (it was not zeroed): a check could pass on
        // those bytes, so this rank's verdict is a failure rather than verified.
        rep.verified = Some(Err(
            "a warm-up batch failed, so this rank's pool was not zeroed \
                                 before the measured batch and its check cannot tell what it \
                                 landed"
                .into(),
        ));
    } else if rep.start_err.is_none() && rep.batch_err.is_none() && rep.layer_err.is_none() {
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

/// Auto measures before it chooses: batches in each mode on this rank's linker (every rank
/// does the same, not timed) until rank 0's linker keeps a mode, at most [`CALIBRATION_CAP`].
/// Before each batch (and once after the last) the ranks exchange a word over the control
/// handle (rank 0's linker decided; this rank's last batch failed; its last batch's time), and
/// every rank acts on the same words: all go on, all stop, or all fail (a rank whose own batch
/// went well fails naming the rank that did not), so no rank's next control collective meets
/// another's calibration word. Returns the batches with the slowest rank's time (what Auto
/// decides from; rank 0's give Auto's reason).
fn calibrate_auto(
    ctx: &Ctx,
    linker: &Linker,
    slots: &[u32],
    control: &dyn Collective,
) -> Result<Calibration> {
    let mut seen = Calibration::default();
    let mut failed: Option<anyhow::Error> = None;
    // This rank's last batch, waiting for every rank's time: (mode, bytes landed, µs).
    let mut last: Option<(ShareMode, u64, u32)> = None;
    for round in 0..=CALIBRATION_CAP {
        let decided = linker.auto_decision().is_some();
        let us = last.map_or(0, |(_, _, us)| us);
        let mine = u64::from(decided) * DECIDED
            + u64::from(failed.is_some()) * FAILED
            + (u64::from(us) << TIME_SHIFT);
        let words = match gather::words(control, mine) {
            Ok(w) => w,
            // This rank's own failed batch says more; the word's failure goes beside it.
            Err(e) => {
                return Err(match failed {
                    Some(own) => {
                        own.context(format!("the calibration word was not exchanged: {e:#}"))
                    }
                    None => e,
                })
            }
        };
        if let Some(r) = words.iter().position(|w| w & FAILED != 0) {
            return Err(failed.unwrap_or_else(|| {
                anyhow!("rank {r}'s Auto calibration batch failed: every rank stops calibrating")
            }));
        }
        if let Some((mode, landed, _)) = last.take() {
            // Every rank sent its time (a batch that failed anywhere stopped us above).
            let slowest = words.iter().map(|w| w >> TIME_SHIFT).max().unwrap_or(0);
            seen.record(mode, landed, Duration::from_micros(slowest));
        }
        if words.first().is_some_and(|w| w & DECIDED != 0) || round == CALIBRATION_CAP {
            break;
        }
        match calibration_batch(linker, &ctx.pages, slots, 100 + round) {
            Ok(stats) => {
                let us = u32::try_from(stats.last_layer.as_micros()).unwrap_or(u32::MAX);
                last = Some((stats.mode, stats.bytes_landed, us.max(1)));
            }
            Err(e) => failed = Some(e),
        }
    }
    Ok(seen)
}

/// Calibration words: rank 0's linker has decided; this rank's last batch failed; and in the
/// upper 32 bits, this rank's last batch's time in µs (0: none).
const DECIDED: u64 = 1;
const FAILED: u64 = 2;
const TIME_SHIFT: u32 = 32;

/// A warm-up batch's last layer, or what failed.
fn warmup_outcome(r: &RankReport) -> Result<Duration, String> {
    match (&r.start_err, &r.layer_err, &r.batch_err) {
        (Some(e), _, _) | (_, Some(e), _) | (_, _, Some(e)) => Err(e.clone()),
        _ => Ok(r.last_layer),
    }
}

/// The load of batch `batch` with the simulated compute: an engine thread waits for each
/// layer and "computes" it, a watcher notes when each layer is ready.
fn load(ctx: &Ctx, rank: u32, linker: &Linker, slots: &[u32], rep: &mut RankReport, batch: u64) {
    let layers = ctx.layers();
    let compute = Duration::from_micros(ctx.args.compute_us);
    let plan = BatchPlan::all_components(
        linker.geometry(),
        BatchId(batch),
        vec![RequestPages {
            request: "new-request".into(),
            pages: ctx.pages.clone(),
        }],
        slots.to_vec(),
    );
    let progress = progress(rank, "load", u64::from(layers), "layers");
    let start = Instant::now();
    let read_before = linker.metrics().bytes_read;
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
            // Counted as each call landed: what this batch read before it failed.
            rep.store_bytes_read = linker.metrics().bytes_read.saturating_sub(read_before);
        }
    }
}
