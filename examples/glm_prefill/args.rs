//! Command-line flags of the example (clap, derive), with `--help`.

use std::fmt;
use std::path::PathBuf;

use clap::{CommandFactory, Parser, ValueEnum};

use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_loader::ShareMode;

#[path = "process_args.rs"]
mod process_args;
pub use process_args::{ProcessArgs, RanksAs};

/// A problem with the command line (the whole message, with its hint): the example prints it
/// and exits 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.trim_end())
    }
}

impl std::error::Error for UsageError {}

/// Where the KV objects live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    /// `EmbeddedStore`: a map in this process's memory. No network, no setup.
    Embedded,
    /// A real Mooncake Store (one client per TP rank), from the `MOONCAKE_*` environment.
    Mooncake,
}

impl StoreKind {
    /// The label every table carries.
    pub fn label(self) -> &'static str {
        match self {
            StoreKind::Embedded => "embedded (in-process)",
            StoreKind::Mooncake => "mooncake",
        }
    }
}

/// How replicated components are shared among the TP ranks (`LinkerConfig.mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeArg {
    /// Every rank reads its own copy (the baseline).
    AllRanks,
    /// Rank 0 reads each layer and broadcasts it.
    Rank0Broadcast,
    /// Each rank reads 1/TP of the pages, then an all-gather.
    SplitAllGather,
    /// The linker picks from measured bandwidths.
    Auto,
}

impl ModeArg {
    /// Every mode, in the order `--mode compare` runs them.
    pub const ALL: [ModeArg; 4] = [
        ModeArg::AllRanks,
        ModeArg::Rank0Broadcast,
        ModeArg::SplitAllGather,
        ModeArg::Auto,
    ];

    /// The name in tables (the `ShareMode` variant's name, or `Auto`).
    pub fn name(self) -> &'static str {
        match self {
            ModeArg::AllRanks => "AllRanks",
            ModeArg::Rank0Broadcast => "Rank0Broadcast",
            ModeArg::SplitAllGather => "SplitAllGather",
            ModeArg::Auto => "Auto",
        }
    }

    /// The `LinkerConfig.mode` to ask the linker for.
    pub fn choice(self) -> ModeChoice {
        match self {
            ModeArg::AllRanks => ModeChoice::Fixed(ShareMode::AllRanks),
            ModeArg::Rank0Broadcast => ModeChoice::Fixed(ShareMode::Rank0Broadcast),
            ModeArg::SplitAllGather => ModeChoice::Fixed(ShareMode::SplitAllGather),
            ModeArg::Auto => ModeChoice::Auto,
        }
    }
}

/// Which modes to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeSel {
    /// One mode.
    One(ModeArg),
    /// Every mode on the same saved prefix, side by side.
    Compare,
}

impl ModeSel {
    /// The modes to run, in order.
    pub fn modes(self) -> Vec<ModeArg> {
        match self {
            ModeSel::One(m) => vec![m],
            ModeSel::Compare => ModeArg::ALL.to_vec(),
        }
    }

    /// `--mode`'s values, as the help lists them.
    const VALUES: [&'static str; 5] = [
        "all-ranks",
        "rank0-broadcast",
        "split-all-gather",
        "auto",
        "compare",
    ];

    /// Parses a `--mode` value.
    fn parse(v: &str) -> Result<ModeSel, String> {
        Ok(match v {
            "all-ranks" => ModeSel::One(ModeArg::AllRanks),
            "rank0-broadcast" => ModeSel::One(ModeArg::Rank0Broadcast),
            "split-all-gather" => ModeSel::One(ModeArg::SplitAllGather),
            "auto" => ModeSel::One(ModeArg::Auto),
            "compare" => ModeSel::Compare,
            other => {
                return Err(format!(
                    "`{other}` is not one of {}",
                    ModeSel::VALUES.join(", ")
                ))
            }
        })
    }
}

/// Default prefix: 8,192 tokens = 128 pages = 441.9 MB per rank in a release build; 1,024
/// tokens (16 pages) in a debug build, whose unoptimized copies and checksums are about 100×
/// slower, so that the first `cargo run --example glm_prefill` takes seconds.
pub const DEFAULT_TOKENS: u64 = if cfg!(debug_assertions) { 1024 } else { 8192 };
/// Default TP size.
pub const DEFAULT_TP: u32 = 2;
/// Default simulated compute per layer.
pub const DEFAULT_COMPUTE_US: u64 = 1000;
/// Default picture path.
pub const DEFAULT_SVG: &str = "target/glm_prefill_timeline.svg";

const ABOUT: &str = "\
glm_prefill: load a long prompt's cached KV layer by layer into every TP rank's KV pool, in
every share mode and Auto, side by side.

It plays one prefill of GLM-5.2 with FP8 KV (DSA: 656 B/token KV on 78 layers + an 8,448 B/page
indexer on 21 layers = 53,940 B/token) on TP ranks that are threads of this process (or
processes: --ranks-as processes, or one process per rank started with --rank):
  1. save: rank 0's pool is filled with deterministic pseudo-random KV bytes and saved to the
     store (as the request that first computed the prefix would have; only rank 0 writes
     replicated components);
  2. load: a new request with the same prompt looks the prefix up and loads it on every rank,
     into different scattered pool slots per rank, while a simulated attention pass waits for
     each layer and then \"computes\" it (a sleep: the GPU's work, not the CPU's);
  3. check: every rank's pool is compared, slot by slot, with the bytes that were saved.
It prints bytes per rank, store bytes read per rank, time to first and last layer, Auto's pick
with its reason, a per-layer timeline, and writes the timeline as an SVG picture.";

const AFTER: &str = "\
EXIT STATUS:
    0 loaded and verified; 1 a load failed or a pool differs from the saved bytes;
    2 bad flags, or the requested store is not available (e.g. no Mooncake environment).";

/// The parsed flags.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "glm_prefill",
    about = "Load a GLM-5.2 prefix's cached KV layer by layer on every TP rank, every share mode side by side.",
    long_about = ABOUT,
    after_long_help = AFTER,
    override_usage = "cargo run --release --example glm_prefill -- [FLAGS]"
)]
pub struct Args {
    /// Cached prefix length in tokens, rounded down to whole 64-token pages [8192 = 128 pages,
    /// 441.9 MB per rank, in a release build; 1024 in a debug build]. Memory: about
    /// (1 + 1.25 x TP) x 53,940 B x N (store copy + one pool per rank).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_TOKENS,
          value_parser = clap::value_parser!(u64).range(64..))]
    pub tokens: u64,
    /// Tensor-parallel ranks, each a thread with its own KV pool and its own linker over one
    /// shared store.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_TP,
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub tp: u32,
    /// Simulated attention compute per layer, in microseconds; the engine thread of each rank
    /// waits for layer l, then sleeps this long. 0 = no compute (pure load time).
    #[arg(long, value_name = "N", default_value_t = DEFAULT_COMPUTE_US,
          value_parser = clap::value_parser!(u64).range(..=1_000_000))]
    pub compute_us: u64,
    /// Where the KV objects live. embedded: an in-process map (memory copies, no network).
    /// mooncake: a real Mooncake Store, one client per rank, configured from MOONCAKE_MASTER
    /// and the other MOONCAKE_* variables (run it under scripts/with-mooncake.sh after
    /// scripts/mooncake-build-shim.sh).
    #[arg(
        long,
        value_enum,
        value_name = "KIND",
        default_value = "embedded",
        hide_possible_values = true
    )]
    pub store: StoreKind,
    /// How ranks share replicated KV (LinkerConfig.mode): all-ranks (every rank reads every
    /// page itself, the baseline), rank0-broadcast (rank 0 reads each layer and broadcasts
    /// it), split-all-gather (each rank reads 1/TP of the pages, then all-gather), auto (the
    /// linker picks from measured bandwidths), compare (each mode and Auto on the same saved
    /// prefix: time to last layer, store bytes read per rank and in total, reduction vs
    /// all-ranks, Auto's pick with its reason; modes the linker does not support yet say so).
    #[arg(long, value_name = "MODE", default_value = "compare", value_parser = ModeSel::parse)]
    pub mode: ModeSel,
    /// Batches each fixed mode loads before the measured one (with the same simulated
    /// compute, not reported beyond their last layer): the linker plans each batch's reads from
    /// what its earlier batches measured (a call's cost, the share step, the compute), as an
    /// engine's linker has from its earlier requests. 0: the measured batch is the linker's
    /// first. Auto calibrates instead.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(..=8))]
    pub warmup: u32,
    /// Where to write the timeline picture.
    #[arg(long, value_name = "PATH", default_value = DEFAULT_SVG)]
    pub svg: PathBuf,
    /// Seed of the prompt tokens, the KV bytes and the slot assignments.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// Print every layer in the timeline table (default: first and last 5; with --mode
    /// compare, the tables are only in the picture).
    #[arg(long)]
    pub full_timeline: bool,
    /// TP ranks as threads or processes, and what a rank process is.
    #[command(flatten)]
    pub procs: ProcessArgs,
}

impl Default for Args {
    fn default() -> Self {
        Args::parse_from(["glm_prefill"])
    }
}

/// The `--help` text.
pub fn help() -> String {
    Args::command().render_long_help().to_string()
}

/// Parses the flags (without the program name). `Ok(None)`: `--help` was asked for.
pub fn parse<I, S>(argv: I) -> Result<Option<Args>, UsageError>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let argv: Vec<String> = argv.into_iter().map(Into::into).collect();
    let mut a = match Args::try_parse_from(
        std::iter::once("glm_prefill".to_string()).chain(argv.iter().cloned()),
    ) {
        Ok(a) => a,
        Err(e) if e.kind() == clap::error::ErrorKind::DisplayHelp => return Ok(None),
        Err(e) => return Err(UsageError(e.render().to_string())),
    };
    a.procs.argv = process_args::passthrough(&argv);
    a.procs
        .check(&mut a.tp)
        .map_err(|e| UsageError(format!("error: {}\n\nRun with --help for the flags.", e.0)))?;
    Ok(Some(a))
}
