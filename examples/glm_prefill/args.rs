//! Command-line flags of the example, hand-parsed (no dependency), with `--help`.

use std::fmt;
use std::path::PathBuf;

use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_loader::ShareMode;

#[path = "process_args.rs"]
mod process_args;
pub use process_args::{ProcessArgs, RanksAs};

/// A problem with the command line: the example prints it with the usage and exits 2.
#[derive(Debug)]
pub struct UsageError(pub String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}\n\nRun with --help for the flags.", self.0)
    }
}

impl std::error::Error for UsageError {}

/// Where the KV objects live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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

/// The parsed flags.
#[derive(Debug, Clone)]
pub struct Args {
    /// Cached prefix length in tokens (whole pages of 64).
    pub tokens: u64,
    /// Tensor-parallel ranks (threads).
    pub tp: u32,
    /// Simulated attention compute per layer, microseconds.
    pub compute_us: u64,
    /// The store.
    pub store: StoreKind,
    /// Mode(s).
    pub mode: ModeSel,
    /// Where the timeline picture goes.
    pub svg: PathBuf,
    /// Seed of the prompt tokens, the KV bytes and the slot assignments.
    pub seed: u64,
    /// Print every layer in the timeline table, not the first and last five.
    pub full_timeline: bool,
    /// TP ranks as threads or processes, and what a rank process is.
    pub procs: ProcessArgs,
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

impl Default for Args {
    fn default() -> Self {
        Args {
            tokens: DEFAULT_TOKENS,
            tp: DEFAULT_TP,
            compute_us: DEFAULT_COMPUTE_US,
            store: StoreKind::Embedded,
            mode: ModeSel::Compare,
            svg: PathBuf::from(DEFAULT_SVG),
            seed: 1,
            full_timeline: false,
            procs: ProcessArgs::default(),
        }
    }
}

/// The `--help` text.
pub fn help() -> String {
    format!(
        "\
glm_prefill: load a long prompt's cached KV layer by layer into every TP rank's KV pool.

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
It prints bytes per rank, store bytes read, time to first and last layer, a per-layer timeline,
and writes the timeline as an SVG picture.

USAGE:
    cargo run --release --example glm_prefill -- [FLAGS]

FLAGS:
    --tokens N          Cached prefix length in tokens, rounded down to whole 64-token pages
                        [default: {DEFAULT_TOKENS} = 128 pages, 441.9 MB per rank]. Memory: about
                        (1 + 1.25 x TP) x 53,940 B x N (store copy + one pool per rank).
    --tp N              Tensor-parallel ranks, each a thread with its own KV pool and its own
                        linker over one shared store [default: {DEFAULT_TP}].
    --compute-us N      Simulated attention compute per layer, in microseconds; the engine
                        thread of each rank waits for layer l, then sleeps this long
                        [default: {DEFAULT_COMPUTE_US}]. 0 = no compute (pure load time).
    --store KIND        embedded: an in-process map (memory copies, no network) [default].
                        mooncake: a real Mooncake Store, one client per rank, configured from
                        MOONCAKE_MASTER and the other MOONCAKE_* variables (run it under
                        scripts/with-mooncake.sh after scripts/mooncake-build-shim.sh).
    --mode MODE         How ranks share replicated KV (LinkerConfig.mode) [default: compare]:
                          all-ranks         every rank reads every page itself (baseline)
                          rank0-broadcast   rank 0 reads each layer and broadcasts it
                          split-all-gather  each rank reads 1/TP of the pages, then all-gather
                          auto              the linker picks from measured bandwidths
                          compare           runs each mode and Auto on the same saved prefix and
                                            prints a table: time to last layer, store bytes
                                            read per rank and in total, reduction vs all-ranks,
                                            Auto's pick with its reason. Modes the linker does
                                            not support yet say so.
    --svg PATH          Where to write the timeline picture [default: {DEFAULT_SVG}].
    --seed N            Seed of the prompt tokens, the KV bytes and the slot assignments
                        [default: 1].
    --full-timeline     Print every layer in the timeline table (default: first and last 5;
                        with --mode compare, the tables are only in the picture).
{}    -h, --help          This text.

EXIT STATUS:
    0 loaded and verified; 1 a load failed or a pool differs from the saved bytes;
    2 bad flags, or the requested store is not available (e.g. no Mooncake environment).
",
        process_args::HELP
    )
}

fn parse_num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, UsageError> {
    let cleaned: String = v.chars().filter(|&c| c != '_' && c != ',').collect();
    cleaned
        .parse()
        .map_err(|_| UsageError(format!("{flag}: `{v}` is not a non-negative integer")))
}

/// Parses the flags (without the program name). `Ok(None)`: `--help` was asked for.
pub fn parse<I, S>(argv: I) -> Result<Option<Args>, UsageError>
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    let mut a = Args::default();
    let argv: Vec<String> = argv.into_iter().map(Into::into).collect();
    a.procs.argv = process_args::passthrough(&argv);
    let mut it = argv.into_iter();
    while let Some(arg) = it.next() {
        if arg == "-h" || arg == "--help" {
            return Ok(None);
        }
        if arg == "--full-timeline" {
            a.full_timeline = true;
            continue;
        }
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (arg.clone(), None),
        };
        let known = [
            "--tokens",
            "--tp",
            "--compute-us",
            "--store",
            "--mode",
            "--svg",
            "--seed",
        ];
        if !known.contains(&flag.as_str()) && !process_args::FLAGS.contains(&flag.as_str()) {
            return Err(UsageError(format!("unknown argument `{arg}`")));
        }
        let value = match inline {
            Some(v) => v,
            None => it
                .next()
                .ok_or_else(|| UsageError(format!("{flag} needs a value")))?,
        };
        match flag.as_str() {
            "--tokens" => a.tokens = parse_num(&flag, &value)?,
            "--tp" => a.tp = parse_num(&flag, &value)?,
            "--compute-us" => a.compute_us = parse_num(&flag, &value)?,
            "--seed" => a.seed = parse_num(&flag, &value)?,
            "--svg" => a.svg = PathBuf::from(value),
            "--store" => {
                a.store = match value.as_str() {
                    "embedded" => StoreKind::Embedded,
                    "mooncake" => StoreKind::Mooncake,
                    other => {
                        return Err(UsageError(format!(
                            "--store: `{other}` is not one of embedded, mooncake"
                        )))
                    }
                }
            }
            "--mode" => {
                a.mode = match value.as_str() {
                    "all-ranks" => ModeSel::One(ModeArg::AllRanks),
                    "rank0-broadcast" => ModeSel::One(ModeArg::Rank0Broadcast),
                    "split-all-gather" => ModeSel::One(ModeArg::SplitAllGather),
                    "auto" => ModeSel::One(ModeArg::Auto),
                    "compare" => ModeSel::Compare,
                    other => {
                        return Err(UsageError(format!(
                            "--mode: `{other}` is not one of all-ranks, rank0-broadcast, \
                             split-all-gather, auto, compare"
                        )))
                    }
                }
            }
            f if process_args::FLAGS.contains(&f) => a.procs.set(f, &value)?,
            _ => unreachable!("checked against the known flags"),
        }
    }
    a.procs.check(&mut a.tp)?;
    if a.tp == 0 || a.tp > 64 {
        return Err(UsageError(format!("--tp: {} is not in 1..=64", a.tp)));
    }
    if a.tokens < 64 {
        return Err(UsageError(format!(
            "--tokens: {} is less than one 64-token page",
            a.tokens
        )));
    }
    if a.compute_us > 1_000_000 {
        return Err(UsageError(format!(
            "--compute-us: {} is over one second per layer",
            a.compute_us
        )));
    }
    Ok(Some(a))
}
