//! Command-line flags (clap).

use clap::{value_parser, Arg, ArgAction, Command};

/// What to run.
#[derive(Debug, Clone)]
pub struct Args {
    /// Cached tokens (a multiple of the 64-token page).
    pub tokens: u32,
    /// Interleaved rounds: every variant runs once per round; the table gives the median.
    pub rounds: usize,
    /// Layers per call for the grouped variants.
    pub groups: Vec<u32>,
    /// Concurrent calls per layer for the `read_parallelism`-style variants.
    pub parallel: Vec<usize>,
    /// Concurrent whole-object calls (each over a contiguous part of the keys), one row each.
    pub whole_parallel: Vec<usize>,
    /// `read_streams` of the clients with kvlink's store-level reads (staged merge on).
    pub streams: Vec<usize>,
    /// Layers per call of the store-level variants.
    pub store_groups: Vec<u32>,
    /// `MC_TCP_LANES_PER_PEER` values of extra clients (each its own transfer engine).
    pub lanes: Vec<usize>,
    /// Per-layer compute times (µs, modelled) to plan layer groups for.
    pub compute_us: Vec<u64>,
    /// Most layers per call the plans may use.
    pub max_layers_per_call: u32,
    /// Per-layer compute (µs, SIMULATED by the engine thread's sleep) of the `Linker` rows.
    pub linker_compute_us: Vec<u64>,
    /// `MC_TCP_LANES_PER_PEER` of the `Linker` rows' clients (0: the wheel's default, 4).
    pub linker_lanes: Vec<usize>,
    /// `read_streams` of the `Linker` rows' stores (0: the store's default for this machine).
    pub linker_streams: Vec<usize>,
    /// `verify_threads` of the `Linker` rows (0: the library's default).
    pub linker_verify_threads: Vec<usize>,
    /// `checksums_as_landed` of the `Linker` rows.
    pub linker_as_landed: Vec<OnOff>,
    /// How the `Linker` rows get their checksum companions (one row set each).
    pub linker_companions: Vec<Companions>,
    /// With `at-lookup`: the engine's time between its lookup and `start_load` (SIMULATED).
    pub linker_lookup_gap_us: u64,
    /// Write no checksum companions (the objects as SGLang writes them: the `Linker` rows
    /// check them by length only, after a size query).
    pub no_companions: bool,
    /// Skip the wheel's Python client.
    pub no_python: bool,
    /// Only the variants whose label contains one of these.
    pub only: Vec<String>,
}

fn list<T: Clone + Send + Sync + 'static>(m: &clap::ArgMatches, id: &str) -> Vec<T> {
    m.get_many::<T>(id)
        .map(|v| v.cloned().collect())
        .unwrap_or_default()
}

fn command() -> Command {
    Command::new("mooncake_read")
        .about(
            "One Mooncake client reading GLM-5.2 FP8 objects from a storage node: the wheel's \
             Python client against kvlink's read variants, same objects, same run. Run under \
             scripts/with-mooncake.sh --storage-node.",
        )
        .arg(
            Arg::new("tokens")
                .long("tokens")
                .value_parser(value_parser!(u32).range(64..))
                .default_value("16384")
                .help("cached tokens (64-token pages): 8192, 16384, 32768"),
        )
        .arg(
            Arg::new("rounds")
                .long("rounds")
                .value_parser(value_parser!(u64).range(1..))
                .default_value("5")
                .help("interleaved rounds (each variant once per round; round 1 checks the bytes)"),
        )
        .arg(
            Arg::new("groups")
                .long("groups")
                .value_parser(value_parser!(u32).range(1..))
                .value_delimiter(',')
                .default_value("2,4,8,26,78")
                .help("layers per call of the grouped variants"),
        )
        .arg(
            Arg::new("parallel")
                .long("parallel")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("2,4,8")
                .help("concurrent calls per layer (what LinkerConfig::read_parallelism does)"),
        )
        .arg(
            Arg::new("whole-parallel")
                .long("whole-parallel")
                .value_parser(value_parser!(u64).range(2..64))
                .value_delimiter(',')
                .help(
                    "rows of kvlink's whole-object read split into this many concurrent \
                     `get_into` calls over contiguous parts of the keys (none by default)",
                ),
        )
        .arg(
            Arg::new("streams")
                .long("streams")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("1,2,4")
                .help("MooncakeConfig::read_streams of the store-level variants (staged merge on)"),
        )
        .arg(
            Arg::new("store-groups")
                .long("store-groups")
                .value_parser(value_parser!(u32).range(1..))
                .value_delimiter(',')
                .default_value("8,26,78")
                .help("layers per call of the store-level variants (pool slots)"),
        )
        .arg(
            Arg::new("lanes")
                .long("lanes")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("8")
                .help("MC_TCP_LANES_PER_PEER of extra clients (the wheel's default is 4)"),
        )
        .arg(
            Arg::new("compute-us")
                .long("compute-us")
                .value_parser(value_parser!(u64))
                .value_delimiter(',')
                .default_value("0,5000,20000")
                .help("per-layer compute (µs, MODELLED) to plan read_plan groups for"),
        )
        .arg(
            Arg::new("no-plan")
                .long("no-plan")
                .action(ArgAction::SetTrue)
                .help("no read_plan table (whatever --compute-us says): its rounds read the objects again"),
        )
        .arg(
            Arg::new("max-layers-per-call")
                .long("max-layers-per-call")
                .value_parser(value_parser!(u32).range(1..))
                .default_value("78")
                .help("most layers per call the read_plan groups may use"),
        )
        .arg(
            Arg::new("linker-compute-us")
                .long("linker-compute-us")
                .value_parser(value_parser!(u64))
                .value_delimiter(',')
                .default_value("0,5000")
                .help(
                    "the Linker itself (adaptive layer groups, store defaults) loading everything \
                     with an engine computing this long per layer (µs, SIMULATED by a sleep); \
                     --no-linker: no Linker rows",
                ),
        )
        .arg(
            Arg::new("linker-companions")
                .long("linker-companions")
                .value_parser(value_parser!(Companions))
                .value_delimiter(',')
                .default_value("every-load")
                .help(
                    "how the Linker rows get their checksum companions: every-load (read by \
                     each load, none kept), kept (kept between loads: every round after the \
                     first reads none), at-lookup (each round forgets what was kept, looks the \
                     prefix up, waits --linker-lookup-gap-us, then loads: the lookup reads them \
                     ahead and pins the objects), at-lookup-pin-at-load (the same, but the load \
                     pins the objects, pin_at_lookup off), kept-at-lookup (kept, and each round \
                     looks the prefix up, which pins the objects, waits the gap, then loads), \
                     kept-at-lookup-pin-at-load (the same, the load pins); one row set per value",
                ),
        )
        .arg(
            Arg::new("linker-lookup-gap-us")
                .long("linker-lookup-gap-us")
                .value_parser(value_parser!(u64))
                .default_value("20000")
                .help("with at-lookup: the engine's time between lookup and start_load (µs, SIMULATED by a sleep)"),
        )
        .arg(
            Arg::new("linker-lanes")
                .long("linker-lanes")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("0")
                .help("MC_TCP_LANES_PER_PEER of the Linker rows' clients (0: the wheel's default, 4); one row per value and compute"),
        )
        .arg(
            Arg::new("linker-streams")
                .long("linker-streams")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("0")
                .help("read_streams of the Linker rows' stores (0: the store's default for this machine); one row per value, lanes and compute"),
        )
        .arg(
            Arg::new("linker-verify-threads")
                .long("linker-verify-threads")
                .value_parser(value_parser!(usize))
                .value_delimiter(',')
                .default_value("0")
                .help("LinkerConfig::verify_threads of the Linker rows (threads one layer's checksum check may use; 0: the library's default); one row set per value"),
        )
        .arg(
            Arg::new("linker-as-landed")
                .long("linker-as-landed")
                .value_parser(value_parser!(OnOff))
                .value_delimiter(',')
                .default_value("on")
                .help("LinkerConfig::checksums_as_landed of the Linker rows (on: the store takes each staged range's checksum as it copies it; off: each layer's check hashes its rows in the pool); one row set per value"),
        )
        .arg(
            Arg::new("no-companions")
                .long("no-companions")
                .action(ArgAction::SetTrue)
                .help(
                    "write no checksum companions beside the objects (as SGLang writes them: \
                     the Linker rows check them by length only); by default each object has \
                     its companion, as kvlink's save writes it",
                ),
        )
        .arg(
            Arg::new("no-linker")
                .long("no-linker")
                .action(ArgAction::SetTrue)
                .help("no Linker rows (whatever --linker-compute-us says)"),
        )
        .arg(
            Arg::new("no-python")
                .long("no-python")
                .action(ArgAction::SetTrue)
                .help("skip the wheel's Python client"),
        )
        .arg(
            Arg::new("only")
                .long("only")
                .action(ArgAction::Append)
                .help(
                    "run only variants whose label contains this text (labels hold commas: \
                     repeat the flag for several)",
                ),
        )
}

/// Parses the process arguments (clap prints help and usage errors itself).
pub fn parse() -> Args {
    let m = command().get_matches();
    Args {
        tokens: *m.get_one("tokens").expect("defaulted"),
        rounds: *m.get_one::<u64>("rounds").expect("defaulted") as usize,
        groups: list(&m, "groups"),
        parallel: list(&m, "parallel"),
        whole_parallel: list::<u64>(&m, "whole-parallel")
            .into_iter()
            .map(|p| p as usize)
            .collect(),
        streams: list(&m, "streams"),
        store_groups: list(&m, "store-groups"),
        lanes: list(&m, "lanes"),
        compute_us: if m.get_flag("no-plan") {
            Vec::new()
        } else {
            list(&m, "compute-us")
        },
        max_layers_per_call: *m.get_one("max-layers-per-call").expect("defaulted"),
        linker_compute_us: if m.get_flag("no-linker") {
            Vec::new()
        } else {
            list(&m, "linker-compute-us")
        },
        linker_lanes: list(&m, "linker-lanes"),
        linker_streams: list(&m, "linker-streams"),
        linker_verify_threads: list(&m, "linker-verify-threads"),
        linker_as_landed: list(&m, "linker-as-landed"),
        linker_companions: list(&m, "linker-companions"),
        linker_lookup_gap_us: *m.get_one("linker-lookup-gap-us").expect("defaulted"),
        no_companions: m.get_flag("no-companions"),
        no_python: m.get_flag("no-python"),
        only: list(&m, "only"),
    }
}

/// A setting switched on or off for a row set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    /// On.
    On,
    /// Off.
    Off,
}

/// How the `Linker` rows get their checksum companions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Companions {
    /// Read by every load (`checksum_cache_entries` 0).
    EveryLoad,
    /// Kept between loads: every round after the first reads none.
    Kept,
    /// Each round forgets what was kept, looks the prefix up (which reads them ahead and pins
    /// the objects, `LinkerConfig::pin_at_lookup`), waits the engine's gap, then loads.
    AtLookup,
    /// As `AtLookup`, with `pin_at_lookup` off: the load pins the objects itself.
    AtLookupPinAtLoad,
    /// Kept between loads (as `Kept`), and each round looks the prefix up (which pins the
    /// objects: nothing is read ahead), waits the engine's gap, then loads: a hot prefix,
    /// where the pin is all a lookup does ahead of the load.
    KeptAtLookup,
    /// As `KeptAtLookup`, with `pin_at_lookup` off: the load pins the objects itself.
    KeptAtLookupPinAtLoad,
}

impl Companions {
    /// Each round forgets what was kept and looks the prefix up, which reads them ahead.
    pub fn read_at_lookup(self) -> bool {
        matches!(self, Companions::AtLookup | Companions::AtLookupPinAtLoad)
    }

    /// Kept, and each round looks the prefix up (which then only pins).
    pub fn kept_at_lookup(self) -> bool {
        matches!(
            self,
            Companions::KeptAtLookup | Companions::KeptAtLookupPinAtLoad
        )
    }

    /// `LinkerConfig::pin_at_lookup` for these rows (off only for the `*PinAtLoad` ones).
    pub fn pins_at_lookup(self) -> bool {
        !matches!(
            self,
            Companions::AtLookupPinAtLoad | Companions::KeptAtLookupPinAtLoad
        )
    }
}
