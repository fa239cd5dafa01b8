//! The example's core: save a GLM-5.2 prefix, load it on every TP rank layer by layer with a
//! simulated attention pass, check every pool, report, draw. Writes its report to `out` (the
//! binary passes stdout; the test passes a buffer).

use std::fmt;
use std::io::Write;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec, PageHash};
use kvlink::kv_loader::{
    BatchId, BatchPlan, KvLoader, LoadStats, LookupRequest, RequestPages, SaveReport, ShareMode,
};
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};

use crate::args::{Args, ModeArg, ModeSel, RanksAs, StoreKind};
use crate::auto_reason::Calibration;
use crate::pattern::Pattern;
use crate::progress::Progress;
use crate::report::{bytes, ms, thousands, Table};
use crate::shows::{ModeRow, Shows};
use crate::timeline_svg::{self, RankTimeline, RunTimeline};

/// The requested store cannot be used here (missing build, library or environment): the
/// example exits 2.
#[derive(Debug)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Unavailable {}

macro_rules! say {
    ($out:expr) => { writeln!($out)? };
    ($out:expr, $($t:tt)*) => { writeln!($out, $($t)*)? };
}

// TP ranks as processes: the launcher and the rank processes (after `say!`, which they use).
#[path = "processes/mod.rs"]
pub(crate) mod processes;

/// Pages saved per `save` call, so the progress bar moves on large prefixes.
const SAVE_CHUNK_PAGES: usize = 8;

/// Everything a load needs, built once.
struct Ctx {
    args: Args,
    spec: ModelKvSpec,
    namespace: String,
    store: Stores,
    tokens: Vec<u32>,
    pages: Vec<PageHash>,
    pool_pages: u32,
    pattern: Pattern,
}

impl Ctx {
    fn tp(&self) -> u32 {
        self.args.tp
    }

    fn layers(&self) -> u32 {
        self.spec.num_layers
    }

    fn geometry(&self, rank: u32) -> Result<KvGeometry> {
        Ok(KvGeometry::new(self.spec.clone(), self.tp(), rank)?)
    }

    fn config(&self, mode: ModeChoice) -> LinkerConfig {
        LinkerConfig {
            namespace: self.namespace.as_str().into(),
            mode,
            ..LinkerConfig::default()
        }
    }

    fn store_label(&self) -> &str {
        &self.store.label
    }

    /// Bytes of the whole prefix on one rank (every component is replicated: the same bytes
    /// on every rank).
    fn bytes_per_rank(&self) -> Result<u64> {
        Ok(self.geometry(0)?.bytes_per_page() * self.pages.len() as u64)
    }
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The prompt's token ids (deterministic in the seed).
fn prompt(seed: u64, n: usize) -> Vec<u32> {
    (0..n as u64)
        .map(|i| (splitmix(seed.wrapping_mul(1_000_003) ^ i) % 151_552) as u32)
        .collect()
}

/// Scattered page slots of one rank: `pages` distinct slots out of `pool_pages`, in a
/// seeded random order that differs per rank (as each rank's allocator would hand them out).
fn scattered_slots(seed: u64, rank: u32, pages: usize, pool_pages: u32) -> Vec<u32> {
    let mut all: Vec<u32> = (0..pool_pages).collect();
    let mut s = splitmix(seed ^ 0x5107 ^ (u64::from(rank) << 40));
    for i in (1..all.len()).rev() {
        s = splitmix(s);
        let j = (s % (i as u64 + 1)) as usize;
        all.swap(i, j);
    }
    all.truncate(pages);
    all
}

/// The store(s) of a run: one handle per rank (the same embedded store for all, or one
/// Mooncake client per rank), and how to name them in every table.
struct Stores {
    per_rank: Vec<Arc<dyn KvStore>>,
    embedded: Option<Arc<EmbeddedStore>>,
    label: String,
    sharing: String,
}

fn open_stores(args: &Args, prefix_bytes: u64) -> Result<Stores> {
    match args.store {
        StoreKind::Embedded => {
            let store = Arc::new(EmbeddedStore::new(
                prefix_bytes + prefix_bytes / 8 + (64 << 20),
            ));
            let per_rank = (0..args.tp)
                .map(|_| store.clone() as Arc<dyn KvStore>)
                .collect();
            Ok(Stores {
                per_rank,
                embedded: Some(store),
                label: args.store.label().to_string(),
                sharing: "its own Linker over one shared EmbeddedStore (a map in this \
                          process's memory: a store read is a memory copy, no network)"
                    .into(),
            })
        }
        StoreKind::Mooncake => {
            let how =
                "run it under scripts/with-mooncake.sh (after scripts/mooncake-build-shim.sh), \
                       which starts a master on loopback and sets MOONCAKE_MASTER and the other \
                       MOONCAKE_* variables";
            let config = MooncakeConfig::from_env()
                .map_err(|e| Unavailable(format!("--store mooncake: {e}; {how}")))?;
            let mut per_rank: Vec<Arc<dyn KvStore>> = Vec::new();
            for rank in 0..args.tp {
                let store = MooncakeStore::connect(config.clone()).map_err(|e| {
                    Unavailable(format!(
                        "--store mooncake: rank {rank}: connecting to the Mooncake master at {}: \
                         {e}; {how}",
                        config.master_addr()
                    ))
                })?;
                store
                    .health()
                    .map_err(|e| Unavailable(format!("--store mooncake: rank {rank}: {e}")))?;
                per_rank.push(Arc::new(store));
            }
            Ok(Stores {
                per_rank,
                embedded: None,
                label: format!(
                    "mooncake ({}, master {})",
                    config.protocol_name(),
                    config.master_addr()
                ),
                sharing: format!(
                    "its own Linker and its own Mooncake client ({}, master {}; each client \
                     lends {} to the store)",
                    config.protocol_name(),
                    config.master_addr(),
                    bytes(config.global_segment_bytes())
                ),
            })
        }
    }
}

/// Runs the example with `args`, writing the report to `out`.
pub fn run(args: &Args, out: &mut dyn Write) -> Result<()> {
    if args.procs.ranks_as == RanksAs::Processes {
        return processes::run(args, out);
    }
    let spec = ModelKvSpec::glm52_dsa_fp8();
    let page = u64::from(spec.page_size);
    let n_pages = (args.tokens / page) as usize;
    let tokens = prompt(args.seed, n_pages * page as usize);
    let pages = page_hashes(&tokens, spec.page_size, None);
    let g0 = KvGeometry::new(spec.clone(), args.tp, 0)?;
    let max_slice = g0
        .components()
        .iter()
        .map(|c| c.page_layer_bytes as usize)
        .max()
        .unwrap_or(0);
    let prefix_bytes = g0.bytes_per_page() * n_pages as u64;
    let store = open_stores(args, prefix_bytes)?;
    let namespace = match args.store {
        StoreKind::Embedded => "glm52".to_string(),
        // A real store outlives this process: a fresh namespace per run keeps objects of an
        // earlier run (first write wins) out of this one.
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
    };
    let ctx = Ctx {
        args: args.clone(),
        pool_pages: (n_pages + n_pages / 4 + 1) as u32,
        spec,
        namespace,
        store,
        tokens,
        pages,
        pattern: Pattern::new(args.seed, max_slice),
    };
    header(&ctx, out)?;
    save_step(&ctx, out)?;

    let modes: Vec<ModeArg> = match args.mode {
        ModeSel::One(m) => vec![m],
        ModeSel::Compare => ModeArg::ALL.to_vec(),
    };
    let mut results = Vec::new();
    for (i, &mode) in modes.iter().enumerate() {
        say!(out);
        say!(
            out,
            "step 2{} — load it as a new request, mode {} (LinkerConfig.mode), store: {}",
            if modes.len() > 1 {
                format!(".{}", i + 1)
            } else {
                String::new()
            },
            mode.name(),
            ctx.store_label()
        );
        let outcome = load_mode(&ctx, mode, out)?;
        results.push((mode, outcome));
    }

    let runs: Vec<RunTimeline> = results
        .iter()
        .filter_map(|(_, o)| match o {
            ModeOutcome::Loaded(r) => Some(r.timeline.clone()),
            _ => None,
        })
        .collect();
    if !runs.is_empty() {
        write_svg(&ctx, &runs, out)?;
    }
    if args.mode == ModeSel::Compare {
        compare_table(&ctx, &results, out)?;
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
    if let ModeSel::One(m) = args.mode {
        if let Some((_, ModeOutcome::Unsupported(why))) = results.first() {
            bail!("mode {} is not supported yet: {why}", m.name());
        }
    }
    Ok(())
}

fn header(ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let g = ctx.geometry(0)?;
    let n = ctx.pages.len() as u64;
    let comps: Vec<String> = g
        .components()
        .iter()
        .map(|c| {
            let per = if c.rows_per_page == 1 {
                format!("{} B/page", thousands(u64::from(c.row_bytes)))
            } else {
                format!("{} B/token", thousands(u64::from(c.row_bytes)))
            };
            format!(
                "{} ({per} on {} layers, {})",
                c.name,
                c.layers.len(),
                if c.replicated {
                    "replicated"
                } else {
                    "sharded"
                }
            )
        })
        .collect();
    say!(
        out,
        "kvlink glm_prefill — {} with FP8 KV (DSA): {} layers, {}-token pages, {} B/token",
        ctx.spec.model,
        ctx.spec.num_layers,
        ctx.spec.page_size,
        thousands(ctx.spec.bytes_per_token() as u64)
    );
    say!(out, "  components: {}", comps.join(", "));
    say!(
        out,
        "  cached prefix: {} tokens = {} pages = {} per rank ({} B per page); every component is \
         replicated: each TP rank needs the same bytes",
        thousands(n * u64::from(ctx.spec.page_size)),
        n,
        bytes(ctx.bytes_per_rank()?),
        thousands(g.bytes_per_page())
    );
    if !ctx
        .args
        .tokens
        .is_multiple_of(u64::from(ctx.spec.page_size))
    {
        say!(
            out,
            "  (--tokens {} rounded down to whole pages: a partial page is never stored)",
            ctx.args.tokens
        );
    }
    say!(
        out,
        "  TP ranks: {} (threads of this process); each rank has its own HostKvPool of {} page \
         slots and {}",
        ctx.tp(),
        ctx.pool_pages,
        ctx.store.sharing
    );
    say!(out, "  store: {}", ctx.store_label());
    say!(
        out,
        "  attention compute: SIMULATED, {} µs per layer (the engine thread sleeps: stands for \
         GPU work, uses no CPU)",
        thousands(ctx.args.compute_us)
    );
    Ok(())
}

fn save_step(ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let n = ctx.pages.len();
    say!(out);
    say!(
        out,
        "step 1 — save the prefix as the request that computed it would have (store: {})",
        ctx.store_label()
    );
    // Every rank has a pool and a linker; rank 0's pool holds the prefill's KV in slots 0..n.
    let mut rigs = Vec::new();
    for rank in 0..ctx.tp() {
        let g = ctx.geometry(rank)?;
        let pool = Arc::new(HostKvPool::new(g.clone(), n as u32)?);
        let linker = Linker::new(
            g,
            ctx.store.per_rank[rank as usize].clone(),
            pool.clone(),
            ctx.config(ModeChoice::Fixed(ShareMode::AllRanks)),
        )
        .with_context(|| format!("rank {rank}: Linker::new"))?;
        rigs.push((pool, linker));
    }
    let t = Instant::now();
    let g = ctx.geometry(0)?;
    let fill = Progress::new("fill rank-0 pool", n as u64, "pages");
    let mut buf = Vec::new();
    for (slot, page) in ctx.pages.iter().enumerate() {
        for c in g.components() {
            buf.resize(c.page_layer_bytes as usize, 0);
            for &l in &c.layers {
                ctx.pattern.fill(page, c.id.0, l, &mut buf);
                // SAFETY: rank 0's pool is filled here, before any load or save uses it.
                unsafe { rigs[0].0.write_slot(c.id, l, slot as u32, &buf) }?;
            }
        }
        fill.inc(1);
    }
    fill.finish();
    let fill_time = t.elapsed();

    let t = Instant::now();
    let save = Progress::new("save (rank 0 writes)", n as u64, "pages");
    let mut reports = Vec::new();
    for (rank, (_, linker)) in rigs.iter().enumerate() {
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
            let r = linker
                .save(&plan)
                .with_context(|| format!("rank {rank}: save"))?;
            total.objects_written += r.objects_written;
            total.objects_present += r.objects_present;
            total.objects_not_owned += r.objects_not_owned;
            total.bytes_written += r.bytes_written;
            if rank == 0 {
                save.inc(chunk.len() as u64);
            }
        }
        reports.push(total);
    }
    save.finish();
    let save_time = t.elapsed();
    for (_, linker) in &rigs {
        linker.close()?;
    }
    drop(rigs);

    say!(
        out,
        "  rank 0's pool filled with deterministic pseudo-random bytes per (page hash, component, \
         layer), seed {}: {} pages in {}",
        ctx.args.seed,
        n,
        ms(fill_time)
    );
    say!(
        out,
        "  every rank calls save(); replicated objects are written by TP rank 0 only ({} in \
         total; {} save calls per rank of up to {} pages each, for the progress bar):",
        ms(save_time),
        n.div_ceil(SAVE_CHUNK_PAGES),
        SAVE_CHUNK_PAGES
    );
    let mut t = Table::new(&[
        "rank",
        "objects written",
        "already present",
        "not owned (replicated: rank 0 writes)",
        "bytes written",
    ]);
    for (rank, r) in reports.iter().enumerate() {
        t.row(vec![
            rank.to_string(),
            thousands(u64::from(r.objects_written)),
            thousands(u64::from(r.objects_present)),
            thousands(u64::from(r.objects_not_owned)),
            bytes(r.bytes_written),
        ]);
    }
    t.write(out, "  ")?;
    if let Some(e) = &ctx.store.embedded {
        say!(
            out,
            "  the store now holds {} objects ({} pages × {} components: all layers of one \
             component of one page per object), {} [{}]",
            thousands(e.len() as u64),
            n,
            ctx.geometry(0)?.components().len(),
            bytes(e.used_bytes()),
            ctx.store_label()
        );
    }
    Ok(())
}

/// What one rank's thread brings back from a load.
struct RankRaw {
    start: Instant,
    ready: Vec<Instant>,
    seen: Vec<Instant>,
    done: Vec<Instant>,
    start_err: Option<String>,
    layer_err: Option<String>,
    stats: Result<LoadStats, String>,
    store_bytes_read: u64,
}

/// One rank's numbers of a finished load.
struct RankDone {
    stats: LoadStats,
    store_bytes_read: u64,
    forward_done: Duration,
    stalled: Duration,
    compute: Duration,
}

/// A load that ran in the mode asked for and was verified.
struct LoadRun {
    effective: ShareMode,
    ranks: Vec<RankDone>,
    timeline: RunTimeline,
    /// Auto's pick and why (Auto only).
    auto_reason: Option<String>,
}

impl LoadRun {
    fn last_ready(&self) -> Duration {
        self.ranks
            .iter()
            .map(|r| r.stats.last_layer)
            .max()
            .unwrap_or_default()
    }

    fn forward_done(&self) -> Duration {
        self.ranks
            .iter()
            .map(|r| r.forward_done)
            .max()
            .unwrap_or_default()
    }

    fn store_bytes_total(&self) -> u64 {
        self.ranks.iter().map(|r| r.store_bytes_read).sum()
    }
}

enum ModeOutcome {
    Loaded(Box<LoadRun>),
    Unsupported(String),
    /// The linker took the mode but loaded the batch in another one.
    RanAs(ShareMode, String),
    Failed(String),
}

struct RankRig {
    pool: Arc<HostKvPool>,
    linker: Linker,
    slots: Vec<u32>,
}

/// Writes zeros over every slot once, so the load does not pay first-touch page faults (a
/// server's pools are allocated and touched at startup).
fn pretouch(pool: &HostKvPool, progress: &Progress) -> Result<()> {
    let g = pool.geometry().clone();
    let zeros = vec![
        0u8;
        g.components()
            .iter()
            .map(|c| c.page_layer_bytes as usize)
            .max()
            .unwrap_or(0)
    ];
    for slot in 0..pool.pages() {
        for c in g.components() {
            for &l in &c.layers {
                // SAFETY: cleared between runs, when no batch of this pool is in flight.
                unsafe { pool.write_slot(c.id, l, slot, &zeros[..c.page_layer_bytes as usize]) }?;
            }
        }
        progress.inc(1);
    }
    Ok(())
}

fn load_mode(ctx: &Ctx, mode: ModeArg, out: &mut dyn Write) -> Result<ModeOutcome> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    let layers = ctx.layers();

    // Each rank: a fresh pool (touched), a linker in one in-process TP group, its own
    // scattered slots.
    let pools: Vec<Arc<HostKvPool>> = (0..tp)
        .map(|r| Ok(Arc::new(HostKvPool::new(ctx.geometry(r)?, ctx.pool_pages)?)))
        .collect::<Result<_>>()?;
    let touch = Progress::new(
        "allocate + touch pools",
        u64::from(tp) * u64::from(ctx.pool_pages),
        "rank-slots",
    );
    std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let touch = &touch;
                s.spawn(move || pretouch(p, touch))
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().map_err(|_| anyhow!("pretouch panicked"))?)
    })?;
    touch.finish();
    let mut rigs: Vec<RankRig> = Vec::new();
    for ((rank, pool), group) in (0..tp).zip(pools).zip(TpGroup::in_process(tp)) {
        let linker = match Linker::with_group(
            ctx.geometry(rank)?,
            ctx.store.per_rank[rank as usize].clone(),
            pool.clone(),
            ctx.config(mode.choice()),
            group,
        ) {
            Ok(l) => l,
            Err(e) if mode != ModeArg::AllRanks => {
                let why = format!("Linker::with_group refused mode {}: {e}", mode.name());
                say!(out, "  not supported yet: {why}");
                return Ok(ModeOutcome::Unsupported(why));
            }
            Err(e) => return Err(anyhow!(e).context(format!("rank {rank}: Linker::with_group"))),
        };
        rigs.push(RankRig {
            pool,
            linker,
            slots: scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages),
        });
    }

    // Lookup on every rank at once (in a TP group the ranks agree on the shortest hit).
    let hits: Vec<Result<usize>> = std::thread::scope(|s| {
        let hs: Vec<_> = rigs
            .iter()
            .enumerate()
            .map(|(rank, rig)| {
                s.spawn(move || {
                    rig.linker
                        .lookup(&LookupRequest {
                            tokens: &ctx.tokens,
                            skip_pages: 0,
                        })
                        .map(|h| h.pages.len())
                        .with_context(|| format!("rank {rank}: lookup"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("lookup panicked"))))
            .collect()
    });
    let hits: Vec<usize> = hits.into_iter().collect::<Result<_>>()?;
    let agreed = hits.iter().copied().min().unwrap_or(0);
    say!(
        out,
        "  lookup: pages found per rank {:?}; agreed prefix {} pages ({} tokens)",
        hits,
        agreed,
        thousands(agreed as u64 * u64::from(ctx.spec.page_size))
    );
    if agreed < n {
        close_all(&rigs);
        bail!("the store holds only {agreed} of the {n} saved pages (evicted?)");
    }
    for (rank, rig) in rigs.iter().enumerate() {
        let shown: Vec<String> = rig.slots.iter().take(6).map(|s| s.to_string()).collect();
        say!(
            out,
            "  rank {rank} slots (page i → slot): [{}, ...] (scattered, differs per rank)",
            shown.join(", ")
        );
    }

    let calibration = if mode == ModeArg::Auto {
        Some(calibrate_auto(&rigs, &ctx.pages[..agreed], out)?)
    } else {
        None
    };

    // Load on every rank at once: a load thread per rank (the linker's), an engine thread per
    // rank waiting for each layer and "computing" it, and a watcher thread per rank that
    // notes when each layer becomes ready.
    let compute = Duration::from_micros(ctx.args.compute_us);
    let barrier = Barrier::new(tp as usize);
    let progress = Progress::new(
        &format!("load {}", mode.name()),
        u64::from(tp) * u64::from(layers),
        "rank-layers",
    );
    let raws: Vec<RankRaw> = std::thread::scope(|s| {
        let handles: Vec<_> = rigs
            .iter()
            .map(|rig| {
                let (barrier, progress) = (&barrier, &progress);
                s.spawn(move || {
                    let linker = &rig.linker;
                    let plan = BatchPlan::all_components(
                        linker.geometry(),
                        BatchId(1),
                        vec![RequestPages {
                            request: "new-request".into(),
                            pages: ctx.pages[..agreed].to_vec(),
                        }],
                        rig.slots.clone(),
                    );
                    barrier.wait();
                    let start = Instant::now();
                    let mut raw = RankRaw {
                        start,
                        ready: Vec::new(),
                        seen: Vec::new(),
                        done: Vec::new(),
                        start_err: None,
                        layer_err: None,
                        stats: Err("not started".into()),
                        store_bytes_read: 0,
                    };
                    let ticket = match linker.start_load(plan) {
                        Ok(t) => t,
                        Err(e) => {
                            raw.start_err = Some(e.to_string());
                            return raw;
                        }
                    };
                    std::thread::scope(|s2| {
                        let watcher = s2.spawn(|| {
                            let mut ready = Vec::with_capacity(layers as usize);
                            for l in 0..layers {
                                if linker.wait_layer(&ticket, l).is_err() {
                                    break;
                                }
                                ready.push(Instant::now());
                                progress.inc(1);
                            }
                            ready
                        });
                        for l in 0..layers {
                            if let Err(e) = linker.wait_layer(&ticket, l) {
                                raw.layer_err = Some(format!("layer {l}: {e}"));
                                break;
                            }
                            raw.seen.push(Instant::now());
                            if !compute.is_zero() {
                                std::thread::sleep(compute);
                            }
                            raw.done.push(Instant::now());
                        }
                        raw.ready = watcher.join().unwrap_or_default();
                    });
                    raw.stats = match linker.wait_batch(&ticket) {
                        Ok(o) => o.result.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    // This batch's own reads (Auto ran calibration batches before it).
                    raw.store_bytes_read = match &raw.stats {
                        Ok(stats) => stats.bytes_read,
                        Err(_) => linker.metrics().bytes_read,
                    };
                    raw
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    progress.finish();

    // Not supported, or failed?
    if let Some((rank, e)) = raws
        .iter()
        .enumerate()
        .find_map(|(r, x)| x.start_err.as_ref().map(|e| (r, e)))
    {
        let why = format!("rank {rank}: start_load: {e}");
        close_all(&rigs);
        if mode != ModeArg::AllRanks {
            say!(out, "  not supported yet: {why}");
            return Ok(ModeOutcome::Unsupported(why));
        }
        say!(out, "  FAILED: {why}");
        return Ok(ModeOutcome::Failed(why));
    }
    let mut stats = Vec::new();
    for (rank, raw) in raws.iter().enumerate() {
        match (&raw.stats, &raw.layer_err) {
            (Ok(s), None) => stats.push(s.clone()),
            (Err(e), _) | (Ok(_), Some(e)) => {
                let why = format!("rank {rank}: {e}");
                say!(out, "  FAILED: {why}");
                close_all(&rigs);
                return Ok(ModeOutcome::Failed(why));
            }
        }
    }
    let effective = stats[0].mode;
    // Check every rank's pool against the generator.
    let t = Instant::now();
    let verify = Progress::new("verify pools", u64::from(tp) * n as u64, "rank-pages");
    let checks: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = rigs
            .iter()
            .enumerate()
            .map(|(rank, rig)| {
                let verify = &verify;
                s.spawn(move || verify_pool(ctx, rank, &rig.pool, &rig.slots, verify))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("verify panicked".into())))
            .collect()
    });
    verify.finish();
    close_all(&rigs);
    let mut compared = 0;
    for c in checks {
        match c {
            Ok(b) => compared += b,
            Err(e) => {
                say!(out, "  FAILED: {e}");
                return Ok(ModeOutcome::Failed(e));
            }
        }
    }
    let verify_time = t.elapsed();

    // Did it run in the mode asked for? (Checked after the pools: they must be right anyway.)
    if let ModeChoice::Fixed(share) = mode.choice() {
        if stats.iter().any(|s| s.mode != share) {
            let modes: Vec<String> = stats.iter().map(|s| format!("{:?}", s.mode)).collect();
            let reason = if tp == 1 {
                "with one rank there is nothing to share"
            } else {
                "a per-batch fallback (the linker logs why), or the mode is not implemented"
            };
            let why = format!(
                "the linker was configured with {share:?} but loaded the batch as [{}] \
                 (LoadStats.mode per rank): {reason}; its numbers are not shown as {}",
                modes.join(", "),
                mode.name()
            );
            say!(out, "  not run as {}: {why}", mode.name());
            say!(
                out,
                "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (as loaded \
                 by {effective:?}; {} compared in {})",
                bytes(compared),
                ms(verify_time)
            );
            return Ok(ModeOutcome::RanAs(effective, why));
        }
    }

    // Times, relative to the first start_load of any rank.
    let t0 = raws
        .iter()
        .map(|r| r.start)
        .min()
        .unwrap_or_else(Instant::now);
    let rel = |i: Instant| i.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let mut ranks = Vec::new();
    let mut timeline = RunTimeline {
        label: mode_label(mode, effective),
        ..RunTimeline::default()
    };
    for (rank, (raw, st)) in raws.iter().zip(&stats).enumerate() {
        // A layer was ready no later than either thread saw it.
        let ready: Vec<f64> = raw
            .ready
            .iter()
            .zip(&raw.seen)
            .map(|(&a, &b)| rel(a.min(b)))
            .collect();
        let mut stalled = Duration::ZERO;
        for l in 1..raw.seen.len() {
            stalled += raw.seen[l].saturating_duration_since(raw.done[l - 1]);
        }
        let compute: Duration = raw.seen.iter().zip(&raw.done).map(|(a, b)| *b - *a).sum();
        timeline.ranks.push(RankTimeline {
            rank: rank as u32,
            start: rel(raw.start),
            ready,
            seen: raw.seen.iter().map(|&i| rel(i)).collect(),
            done: raw.done.iter().map(|&i| rel(i)).collect(),
        });
        ranks.push(RankDone {
            stats: st.clone(),
            store_bytes_read: raw.store_bytes_read,
            forward_done: raw
                .done
                .last()
                .map(|d| d.saturating_duration_since(raw.start))
                .unwrap_or_default(),
            stalled,
            compute,
        });
    }
    let run = LoadRun {
        effective,
        ranks,
        timeline,
        auto_reason: calibration.map(|c| c.reason(effective)),
    };
    report_run(ctx, &run, out)?;
    let slices_per_page: usize = ctx
        .geometry(0)?
        .components()
        .iter()
        .map(|c| c.layers.len())
        .sum();
    say!(
        out,
        "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (each page: \
         {slices_per_page} (component, layer) slices at the rank's own slot; {} compared in {})",
        bytes(compared),
        ms(verify_time)
    );
    let mut run = run;
    run.timeline.note = format!(
        "last layer ready {} · forward done {} · store bytes read {} total",
        ms(run.last_ready()),
        ms(run.forward_done()),
        bytes(run.store_bytes_total())
    );
    Ok(ModeOutcome::Loaded(Box::new(run)))
}

/// Auto measures before it chooses: batches in each mode on the same linkers (no simulated
/// compute, not timed here) until rank 0's linker keeps a mode (at most 3 per mode), so the
/// measured load that follows runs the mode Auto kept. Returns rank 0's batches, for the reason.
fn calibrate_auto(
    rigs: &[RankRig],
    pages: &[PageHash],
    out: &mut dyn Write,
) -> Result<Calibration> {
    let mut seen = Calibration::default();
    for batch in 100..112u64 {
        if rigs[0].linker.auto_decision().is_some() {
            break;
        }
        let stats: Vec<Result<LoadStats>> = std::thread::scope(|s| {
            let hs: Vec<_> = rigs
                .iter()
                .map(|rig| {
                    s.spawn(move || -> Result<LoadStats> {
                        let plan = BatchPlan::all_components(
                            rig.linker.geometry(),
                            BatchId(batch),
                            vec![RequestPages {
                                request: "auto-calibration".into(),
                                pages: pages.to_vec(),
                            }],
                            rig.slots.clone(),
                        );
                        let t = rig.linker.start_load(plan)?;
                        for l in 0..rig.linker.num_layers() {
                            rig.linker.wait_layer(&t, l)?;
                        }
                        Ok(rig.linker.wait_batch(&t)?.result?)
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("calibration panicked")))
                })
                .collect()
        });
        let stats: Vec<LoadStats> = stats.into_iter().collect::<Result<_>>()?;
        seen.record(stats[0].mode, stats[0].bytes_landed, stats[0].last_layer);
    }
    say!(
        out,
        "  Auto: {} calibration batches (measured by rank 0's linker) ran {}; it keeps {:?}",
        seen.batches(),
        seen.order().join(", "),
        rigs[0].linker.auto_decision()
    );
    Ok(seen)
}

fn close_all(rigs: &[RankRig]) {
    for r in rigs {
        // Closing is best effort here: the report already has the outcome.
        let _ = r.linker.close();
    }
}

/// Compares one rank's pool, slot by slot, with the generator. Returns the bytes compared.
fn verify_pool(
    ctx: &Ctx,
    rank: usize,
    pool: &HostKvPool,
    slots: &[u32],
    progress: &Progress,
) -> Result<u64, String> {
    let g = pool.geometry().clone();
    let mut want = Vec::new();
    let mut got = Vec::new();
    let mut compared = 0;
    for (i, (page, &slot)) in ctx.pages.iter().zip(slots).enumerate() {
        for c in g.components() {
            let len = c.page_layer_bytes as usize;
            want.resize(len, 0);
            got.resize(len, 0);
            for &l in &c.layers {
                ctx.pattern.fill(page, c.id.0, l, &mut want);
                // SAFETY: compared after the batch's outcome was taken: no load writes it.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }
                    .map_err(|e| format!("rank {rank}: reading slot {slot}: {e}"))?;
                if want != got {
                    let b = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(format!(
                        "rank {rank}: page {i} (slot {slot}), component {}, layer {l}: byte {b} \
                         differs from the saved bytes ({} B slice)",
                        c.name, len
                    ));
                }
                compared += len as u64;
            }
        }
        progress.inc(1);
    }
    Ok(compared)
}

fn report_run(ctx: &Ctx, run: &LoadRun, out: &mut dyn Write) -> Result<()> {
    if let Some(reason) = &run.auto_reason {
        say!(
            out,
            "  Auto chose {:?} (LoadStats.mode). {reason}",
            run.effective
        );
    }
    say!(
        out,
        "  per rank (times from that rank's start_load; store: {}; compute SIMULATED):",
        ctx.store_label()
    );
    let mut t = Table::new(&[
        "rank",
        "bytes landed in pool",
        "store bytes read",
        "first layer ready",
        "last layer ready",
        "forward done (SIM. compute)",
        "engine waited for layers",
    ]);
    for (rank, r) in run.ranks.iter().enumerate() {
        t.row(vec![
            rank.to_string(),
            bytes(r.stats.bytes_landed),
            bytes(r.store_bytes_read),
            ms(r.stats.first_layer),
            ms(r.stats.last_layer),
            ms(r.forward_done),
            ms(r.stalled),
        ]);
    }
    t.write(out, "  ")?;
    let one_copy = ctx.bytes_per_rank()?;
    say!(
        out,
        "  store bytes read: {} in total = {:.2} × one copy of the prefix ({}) [{}]",
        bytes(run.store_bytes_total()),
        run.store_bytes_total() as f64 / one_copy as f64,
        bytes(one_copy),
        ctx.store_label()
    );
    // Pipelining, on the rank that finished last.
    if let Some(slow) = run.ranks.iter().max_by_key(|r| r.forward_done) {
        let l = f64::from(ctx.layers());
        let read = slow.stats.last_layer.as_secs_f64() * 1e3;
        let comp = slow.compute.as_secs_f64() * 1e3;
        let ideal = (read + comp / l).max(comp + read / l);
        say!(
            out,
            "  pipelining (slowest rank): forward done {:.1} ms; the load took {read:.1} ms (to \
             its last layer ready) and the {l} layers' compute {comp:.1} ms (measured sleeps): \
             {:.1} ms if one waited for the other; ideal overlap ≈ max(load + one layer's \
             compute, compute + one layer's load) = {ideal:.1} ms",
            slow.forward_done.as_secs_f64() * 1e3,
            read + comp
        );
    }
    if ctx.args.mode == ModeSel::Compare && !ctx.args.full_timeline {
        say!(
            out,
            "  per-layer timeline: in the picture (--full-timeline prints it here too)"
        );
    } else {
        timeline_table(ctx, &run.timeline, out)?;
    }
    Ok(())
}

fn timeline_table(ctx: &Ctx, tl: &RunTimeline, out: &mut dyn Write) -> Result<()> {
    let layers = ctx.layers() as usize;
    let shown: Vec<usize> = if tl.ranks.len() <= 4 {
        (0..tl.ranks.len()).collect()
    } else {
        vec![0, 1, tl.ranks.len() - 1]
    };
    say!(
        out,
        "  per-layer timeline, ms since the first start_load (ready: when a thread blocked in \
         wait_layer saw it; compute: SIMULATED sleep){}:",
        if shown.len() < tl.ranks.len() {
            format!(" — ranks {shown:?} of {}", tl.ranks.len())
        } else {
            String::new()
        }
    );
    let mut head = vec!["layer".to_string()];
    for &r in &shown {
        head.push(format!("r{r} ready"));
        head.push(format!("r{r} compute"));
    }
    let mut t = Table::new(&head);
    let rows: Vec<Option<usize>> = if ctx.args.full_timeline || layers <= 10 {
        (0..layers).map(Some).collect()
    } else {
        (0..5)
            .map(Some)
            .chain([None])
            .chain((layers - 5..layers).map(Some))
            .collect()
    };
    for row in rows {
        match row {
            None => t.row(
                std::iter::once("…".to_string())
                    .chain(
                        shown
                            .iter()
                            .flat_map(|_| ["…".to_string(), "…".to_string()]),
                    )
                    .collect(),
            ),
            Some(l) => {
                let mut cells = vec![l.to_string()];
                for &r in &shown {
                    let k = &tl.ranks[r];
                    cells.push(format!("{:.2}", k.ready[l]));
                    cells.push(format!("{:.2} – {:.2}", k.seen[l], k.done[l]));
                }
                t.row(cells);
            }
        }
    }
    t.write(out, "  ")?;
    Ok(())
}

fn write_svg(ctx: &Ctx, runs: &[RunTimeline], out: &mut dyn Write) -> Result<()> {
    let title = format!(
        "kvlink glm_prefill — {} FP8 KV, {} cached tokens ({} per rank), TP {}",
        ctx.spec.model,
        thousands(ctx.pages.len() as u64 * u64::from(ctx.spec.page_size)),
        bytes(ctx.bytes_per_rank()?),
        ctx.tp()
    );
    let subtitle = format!(
        "store: {} · attention compute SIMULATED: {} µs/layer (sleep) · each rank: own pool, own linker, \
         different scattered slots · layer ready = seen by a thread blocked in wait_layer",
        ctx.store_label(),
        thousands(ctx.args.compute_us)
    );
    let svg = timeline_svg::render(&title, &subtitle, runs);
    let path = &ctx.args.svg;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    say!(out);
    say!(out, "timeline picture: {}", path.display());
    Ok(())
}

fn compare_table(ctx: &Ctx, results: &[(ModeArg, ModeOutcome)], out: &mut dyn Write) -> Result<()> {
    let tokens = ctx.pages.len() as u64 * u64::from(ctx.spec.page_size);
    let base = results.iter().find_map(|(m, o)| match (m, o) {
        (ModeArg::AllRanks, ModeOutcome::Loaded(r)) => Some(r),
        _ => None,
    });
    say!(out);
    say!(
        out,
        "modes on the same saved prefix — GLM-5.2 FP8 KV, TP {}, compute SIMULATED {} µs/layer, \
         store: {}{}",
        ctx.tp(),
        thousands(ctx.args.compute_us),
        ctx.store_label(),
        if ctx.store.embedded.is_some() {
            " (no network: a store read here is a memory copy)"
        } else {
            ""
        }
    );
    let mut t = Table::new(&[
        "cached tokens",
        "mode",
        "store",
        "last layer ready",
        "forward done (SIM.)",
        "store bytes read per rank",
        "store bytes read total",
        "reduction vs AllRanks: last layer ready",
        "reduction vs AllRanks: store bytes",
    ]);
    let mut notes = Vec::new();
    for (m, o) in results {
        let name = match o {
            ModeOutcome::Loaded(r) => mode_label(*m, r.effective),
            _ => m.name().to_string(),
        };
        let mut row = vec![thousands(tokens), name, ctx.store_label().to_string()];
        match o {
            ModeOutcome::Loaded(r) => {
                let per: Vec<String> = r.ranks.iter().map(|x| bytes(x.store_bytes_read)).collect();
                row.push(ms(r.last_ready()));
                row.push(ms(r.forward_done()));
                row.push(per.join(" / "));
                row.push(bytes(r.store_bytes_total()));
                match base {
                    Some(b) if *m != ModeArg::AllRanks => {
                        let dt = 1.0 - r.last_ready().as_secs_f64() / b.last_ready().as_secs_f64();
                        let db = 1.0 - r.store_bytes_total() as f64 / b.store_bytes_total() as f64;
                        row.push(signed_percent(dt));
                        row.push(signed_percent(db));
                    }
                    Some(_) => row.extend(["baseline", "baseline"].map(String::from)),
                    None => row.extend(["no baseline", "no baseline"].map(String::from)),
                }
            }
            ModeOutcome::RanAs(other, why) => {
                notes.push(format!("{}: {why}", m.name()));
                row.push(format!("ran as {other:?} [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
            ModeOutcome::Unsupported(why) => {
                notes.push(format!("{}: {why}", m.name()));
                row.push(format!("not supported yet [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
            ModeOutcome::Failed(why) => {
                notes.push(format!("{}: FAILED: {why}", m.name()));
                row.push(format!("FAILED [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
        }
        t.row(row);
    }
    t.write(out, "")?;
    say!(
        out,
        "reduction = 1 − mode / AllRanks: positive is better, negative is slower (or more bytes) \
         than every rank reading its own copy. Times: the slowest rank, from its start_load."
    );
    for (i, n) in notes.iter().enumerate() {
        say!(out, "[{}] {n}", i + 1);
    }
    let rows: Vec<ModeRow> = results
        .iter()
        .filter_map(|(m, o)| match o {
            ModeOutcome::Loaded(r) => Some(ModeRow {
                mode: r.effective,
                auto: *m == ModeArg::Auto,
                last_ready: r.last_ready(),
                per_rank: r.ranks.iter().map(|x| x.store_bytes_read).collect(),
            }),
            _ => None,
        })
        .collect();
    let auto_reason = results.iter().find_map(|(_, o)| match o {
        ModeOutcome::Loaded(r) => r.auto_reason.as_deref(),
        _ => None,
    });
    Shows {
        rows: &rows,
        auto_reason,
        embedded: ctx.store.embedded.is_some(),
    }
    .write(out)?;
    Ok(())
}

/// A mode's name in tables and the picture; `Auto` says what it chose.
fn mode_label(mode: ModeArg, effective: ShareMode) -> String {
    match mode {
        ModeArg::Auto => format!("Auto → {effective:?}"),
        m => m.name().to_string(),
    }
}

/// `0.248` → `+24.8 %`; values that round to zero print as `0.0 %`.
fn signed_percent(x: f64) -> String {
    let p = x * 100.0;
    if p.abs() < 0.05 {
        "0.0 %".to_string()
    } else {
        format!("{p:+.1} %")
    }
}
