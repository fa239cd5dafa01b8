//! Command-line flags (clap).

use std::path::PathBuf;

use clap::{value_parser, Arg, ArgAction, Command};

/// Where the ranks' KV pools live and how the ranks share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pools {
    /// Host pools; ranks are threads sharing through the in-process host group.
    Host,
    /// Device pools on GPU 0, every rank on it (in-process device group: device-to-device
    /// copies ordered by events). Needs the `cuda` feature.
    Gpu,
    /// Device pools, one rank per GPU, NCCL (only TP sizes up to the GPUs visible). Needs the
    /// `cuda` feature.
    Nccl,
    /// Device pools on CPU devices (host memory, worker-thread streams): a dry run of the
    /// device orchestration on a machine without a GPU; no GPU number comes out of it.
    Cpu,
}

impl Pools {
    /// The name in tables and file names.
    pub fn name(self) -> &'static str {
        match self {
            Pools::Host => "host",
            Pools::Gpu => "gpu",
            Pools::Nccl => "nccl",
            Pools::Cpu => "cpu-device",
        }
    }
}

/// The parsed flags.
#[derive(Debug, Clone)]
pub struct Args {
    pub tokens: Vec<u64>,
    pub tp: Vec<u32>,
    pub pools: Vec<Pools>,
    pub modes: Vec<String>,
    pub reps: usize,
    pub warmup: usize,
    pub auto_runs: usize,
    pub suffix_tokens: u64,
    pub no_compute: bool,
    pub staging_mib: u64,
    pub budget_s: f64,
    pub out: Option<PathBuf>,
    pub machine: Option<String>,
    pub savers: usize,
    pub seed: u64,
}

fn list<T: Clone + Send + Sync + 'static>(m: &clap::ArgMatches, id: &str) -> Vec<T> {
    m.get_many::<T>(id)
        .map(|v| v.cloned().collect())
        .unwrap_or_default()
}

fn command() -> Command {
    Command::new("mooncake_modes")
        .about(
            "The dedup modes against a real Mooncake Store: TP ranks as threads (one Mooncake \
             client each), host or device pools, every mode and Auto, every pool verified, time \
             to the last layer and forward done with a MODELLED per-layer compute, store and \
             PCIe bytes per rank. Run it under scripts/with-mooncake.sh --storage-nodes N (or \
             scripts/gpu-mooncake-table.sh on the GPU host).",
        )
        .arg(
            Arg::new("tokens")
                .long("tokens")
                .value_parser(value_parser!(u64).range(64..))
                .value_delimiter(',')
                .default_value("32768,131072")
                .help("cached prefix sizes in tokens (64-token pages)"),
        )
        .arg(
            Arg::new("tp")
                .long("tp")
                .value_parser(value_parser!(u32).range(1..=64))
                .value_delimiter(',')
                .default_value("2,4,8")
                .help("TP sizes (ranks as threads of this process)"),
        )
        .arg(
            Arg::new("pools")
                .long("pools")
                .value_delimiter(',')
                .default_value("host")
                .help("host, gpu (every rank on GPU 0), nccl (one rank per GPU), cpu (device pools on CPU devices: a dry run)"),
        )
        .arg(
            Arg::new("modes")
                .long("modes")
                .value_delimiter(',')
                .default_value("all-ranks,rank0-broadcast,split-all-gather,auto")
                .help("modes to run"),
        )
        .arg(
            Arg::new("reps")
                .long("reps")
                .value_parser(value_parser!(usize))
                .default_value("2")
                .help("measured batches per fixed mode (the table gives the median)"),
        )
        .arg(
            Arg::new("warmup")
                .long("warmup")
                .value_parser(value_parser!(usize))
                .default_value("1")
                .help(
                    "unreported batches per fixed mode before the measured ones (a fresh \
                     linker's first batch plans from its prior; Auto's measured batches come \
                     after its calibration)",
                ),
        )
        .arg(
            Arg::new("auto-runs")
                .long("auto-runs")
                .value_parser(value_parser!(usize))
                .default_value("2")
                .help("fresh Auto runs per TP size (each measures, then keeps a mode; their picks are compared)"),
        )
        .arg(
            Arg::new("suffix-tokens")
                .long("suffix-tokens")
                .value_parser(value_parser!(u64))
                .default_value("4096")
                .help("uncached suffix the MODELLED per-layer compute is for"),
        )
        .arg(
            Arg::new("no-compute")
                .long("no-compute")
                .action(ArgAction::SetTrue)
                .help("no modelled compute: pure load time"),
        )
        .arg(
            Arg::new("staging-mib")
                .long("staging-mib")
                .value_parser(value_parser!(u64))
                .default_value("1024")
                .help("pinned staging per rank for device pools (sets the ring of layer stages, so the largest group)"),
        )
        .arg(
            Arg::new("budget-s")
                .long("budget-s")
                .value_parser(value_parser!(f64))
                .default_value("540")
                .help("start no (size, TP) whose estimated end is past this many seconds"),
        )
        .arg(
            Arg::new("out")
                .long("out")
                .value_parser(value_parser!(PathBuf))
                .help("where the tables go (default: $OUT, else the working directory)"),
        )
        .arg(
            Arg::new("machine")
                .long("machine")
                .help("machine name in the file names (default: the GPU's, e.g. h200x1, else the host name)"),
        )
        .arg(
            Arg::new("savers")
                .long("savers")
                .value_parser(value_parser!(usize))
                .default_value("4")
                .help("threads (each its own Mooncake client) saving the prefix"),
        )
        .arg(
            Arg::new("seed")
                .long("seed")
                .value_parser(value_parser!(u64))
                .default_value("1"),
        )
}

/// Parses the process arguments (clap prints help and usage errors itself).
pub fn parse() -> Result<Args, String> {
    let m = command().get_matches();
    let pools = list::<String>(&m, "pools")
        .iter()
        .map(|p| match p.as_str() {
            "host" => Ok(Pools::Host),
            "gpu" => Ok(Pools::Gpu),
            "nccl" => Ok(Pools::Nccl),
            "cpu" => Ok(Pools::Cpu),
            other => Err(format!("--pools: `{other}` is not host, gpu, nccl or cpu")),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let modes = list::<String>(&m, "modes");
    for mode in &modes {
        if !["all-ranks", "rank0-broadcast", "split-all-gather", "auto"].contains(&mode.as_str()) {
            return Err(format!("--modes: `{mode}` is not a mode"));
        }
    }
    Ok(Args {
        tokens: list(&m, "tokens"),
        tp: list(&m, "tp"),
        pools,
        modes,
        reps: (*m.get_one::<usize>("reps").expect("defaulted")).max(1),
        warmup: *m.get_one::<usize>("warmup").expect("defaulted"),
        auto_runs: *m.get_one::<usize>("auto-runs").expect("defaulted"),
        suffix_tokens: *m.get_one("suffix-tokens").expect("defaulted"),
        no_compute: m.get_flag("no-compute"),
        staging_mib: *m.get_one("staging-mib").expect("defaulted"),
        budget_s: *m.get_one("budget-s").expect("defaulted"),
        out: m.get_one::<PathBuf>("out").cloned().or_else(|| {
            std::env::var_os("OUT")
                .filter(|s| !s.is_empty())
                .map(Into::into)
        }),
        machine: m.get_one::<String>("machine").cloned(),
        savers: (*m.get_one::<usize>("savers").expect("defaulted")).max(1),
        seed: *m.get_one("seed").expect("defaulted"),
    })
}
