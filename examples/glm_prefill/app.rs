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

// The steps of a run, one job each (after `say!`, which they use). Each is part of this one
// run: it sees this module's items and imports (`use super::*`).
#[path = "calibrate.rs"]
mod calibrate;
#[path = "engine.rs"]
mod engine;
#[path = "load.rs"]
mod load;
#[path = "outcome.rs"]
mod outcome;
#[path = "picture.rs"]
mod picture;
#[path = "save.rs"]
mod save;
#[path = "stores.rs"]
mod stores;
#[path = "tables.rs"]
mod tables;
#[path = "verify.rs"]
mod verify;

use calibrate::calibrate_auto;
use engine::run_ranks;
use load::{close_all, load_mode, pretouch, LoadRun, ModeOutcome, RankDone, RankRaw, RankRig};
use outcome::{loaded, mode_outcome};
use picture::write_svg;
use save::{header, save_plans, save_step};
use stores::{open_stores, Stores};
use tables::{compare_table, mode_label, report_run};
use verify::verify_pool;

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
            // Every batch reads its checksum companions, as a load of a prefix not loaded
            // before: this example loads one prefix again and again, which kept checksums
            // would flatter.
            checksum_cache_entries: 0,
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

    /// The header's first line: the model and its KV.
    fn title_line(&self) -> String {
        let spec = &self.spec;
        format!(
            "kvlink glm_prefill — {} with FP8 KV (DSA): {} layers, {}-token pages, {} B/token",
            spec.model,
            spec.num_layers,
            spec.page_size,
            thousands(spec.bytes_per_token() as u64)
        )
    }

    /// The heading of the load of `mode`, the `i`th of `count` modes run.
    fn step2_line(&self, i: usize, count: usize, mode: ModeArg) -> String {
        format!(
            "step 2{} — load it as a new request, mode {} (LinkerConfig.mode), store: {}",
            if count > 1 {
                format!(".{}", i + 1)
            } else {
                String::new()
            },
            mode.name(),
            self.store_label()
        )
    }

    /// The header's line about the cached prefix (`g`: rank 0's geometry).
    fn prefix_line(&self, g: &KvGeometry) -> Result<String> {
        let n = self.pages.len() as u64;
        Ok(format!(
            "  cached prefix: {} tokens = {} pages = {} per rank ({} B per page); every \
             component is replicated: each TP rank needs the same bytes",
            thousands(n * u64::from(self.spec.page_size)),
            n,
            bytes(self.bytes_per_rank()?),
            thousands(g.bytes_per_page())
        ))
    }

    /// Writes the prefix's pages (their pattern bytes, every component and layer of `g`) into
    /// `pool`'s slots `0..`, calling `on_page` after each page.
    ///
    /// # Safety
    /// Nothing else uses `pool` during the call (no load or save in flight).
    unsafe fn fill_prefix(
        &self,
        g: &KvGeometry,
        pool: &HostKvPool,
        on_page: impl Fn(),
    ) -> Result<()> {
        let mut buf = Vec::new();
        for (slot, page) in self.pages.iter().enumerate() {
            for c in g.components() {
                buf.resize(c.page_layer_bytes as usize, 0);
                for &l in &c.layers {
                    self.pattern.fill(page, c.id.0, l, &mut buf);
                    // SAFETY: nothing else uses the pool (the caller's promise).
                    unsafe { pool.write_slot(c.id, l, slot as u32, &buf) }?;
                }
            }
            on_page();
        }
        Ok(())
    }
}

/// The picture of every mode that loaded, when any did.
fn picture_loaded(
    ctx: &Ctx,
    results: &[(ModeArg, ModeOutcome)],
    out: &mut dyn Write,
) -> Result<()> {
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
    Ok(())
}

/// This run's namespace.
fn run_namespace(store: StoreKind) -> String {
    match store {
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
    }
}

/// Fails naming every mode whose load failed, or that did not run as asked (it ran as
/// another mode with more than one rank, or its start was refused), after the tables were
/// written: a comparison missing a mode is not a passing run. With one rank every mode runs
/// as AllRanks (nothing to share), which is no failure.
/// Closes the report with one check per mode (loaded in the mode asked for, every rank's pool
/// verified), as `N passed, N failed`, and fails the run when any failed.
fn fail_on_failed_modes(
    results: &[(ModeArg, ModeOutcome)],
    tp: u32,
    out: &mut dyn Write,
) -> Result<()> {
    let failed: Vec<String> = results
        .iter()
        .filter_map(|(m, o)| match o {
            ModeOutcome::Failed(e) => Some(format!("{}: {e}", m.name())),
            ModeOutcome::RanAs(other, why) if tp > 1 => {
                Some(format!("{}: ran as {other:?}: {why}", m.name()))
            }
            ModeOutcome::Unsupported(why) => Some(format!("{}: not run: {why}", m.name())),
            _ => None,
        })
        .collect();
    say!(out);
    say!(
        out,
        "Checks, one per mode (loaded in that mode, every rank's pool byte-identical to the saved \
         bytes):"
    );
    say!(
        out,
        "{} passed, {} failed",
        results.len() - failed.len(),
        failed.len()
    );
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(())
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
    let namespace = run_namespace(args.store);
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

    let modes = args.mode.modes();
    let mut results = Vec::new();
    for (i, &mode) in modes.iter().enumerate() {
        say!(out);
        say!(out, "{}", ctx.step2_line(i, modes.len(), mode));
        let outcome = load_mode(&ctx, mode, out)?;
        results.push((mode, outcome));
    }

    picture_loaded(&ctx, &results, out)?;
    if args.mode == ModeSel::Compare {
        compare_table(&ctx, &results, out)?;
    }
    fail_on_failed_modes(&results, ctx.tp(), out)?;
    Ok(())
}
