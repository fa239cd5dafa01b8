//! `tp_gpu`: benchmarks of the device path of TP dedup through the Linker into device pools.
//! Built here with `--features cuda`, run on the GPU machine by `scripts/gpu-tp-run.sh`.
//!
//! **One GPU** (the one-H200 machine): NCCL refuses two ranks on one GPU, so the ranks are
//! threads of this process on GPU 0 (each with its own load stream and comm stream), sharing
//! through the in-process device group (device-to-device copies ordered by events): 8 ranks
//! (`--bench-ranks`), 128K tokens (8K with `--quick`), every mode: time to the last layer on
//! every rank, PCIe bytes per rank against the ideal, store bytes per rank; the tables say
//! plainly what one shared GPU does to the timings.
//!
//! **Two or more GPUs**: one rank per GPU over NCCL (TP = the GPUs, or `--tp N`): 128K / 256K /
//! 512K per mode beside the seed's table.
//!
//! **The store is the embedded one (in-process)**, not Mooncake. Every table says so.
//!
//! Correctness lives in the `gpu` test target (`tests/gpu/`): `cargo test --release --features
//! cuda --test gpu tp_` (every mode landing the saved bytes on every rank, plan mismatch, read
//! failures on rank 0, a middle rank and the last rank, one NCCL rank through the Linker), which
//! `scripts/gpu-tp-run.sh` runs before this program.
//!
//! Prints the benchmark tables, then the result table (it ends with the line `N passed, N
//! failed`), also written to `$OUT/tp_gpu_<gpu>x<gpus>_ranks<N>.txt` (e.g.
//! `tp_gpu_h200x1_ranks8.txt`). Exit status: 0 all passed, 1 a benchmark failed, 2 CUDA
//! unavailable (or fewer GPUs than `--tp`, or bad flags). Flags:
//! - `--bench-ranks N`: ranks on one GPU (default 8).
//! - `--tp N`: NCCL ranks, one per GPU (default: every visible GPU when there are 2 or more).
//! - `--quick`: 8K tokens only, one repetition.
//! - `--max-tokens T` / `--min-tokens T`: the largest / smallest prefix benchmarked.
//! - `--reps R`: measured repetitions after one warm-up (default 3, 1 with `--quick`).
//! - `--budget-s S`: start no size that would end past S seconds (default 540).
//! - `--host-mem-gib G`: plan with G GiB of host memory instead of `MemAvailable`.
//! - `--threads T`: store fill threads.
//! - `--cpu`: the same flow on CPU devices (a dry run of the program's logic without a GPU).
//! - `--out DIR`: tables, and SVG + CSV timelines in `DIR/timelines/` (default `$OUT`).

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;

use std::process::ExitCode;
use std::time::Instant;

use kvlink::dedup_broadcast::nccl::nccl_version;
use kvlink::kv_device::cuda::cuda_device_count;
use tracing_subscriber::EnvFilter;

use kvlink_rig::measure::fmt_bytes;
use kvlink_rig::report::{Report, Status};
use kvlink_rig::tp::{host_available, open_device, Fabric};

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().min(16))
}

fn gib(v: &str) -> Result<u64, String> {
    v.parse::<u64>()
        .map(|g| g << 30)
        .map_err(|_| format!("`{v}` is not a whole number of GiB"))
}

/// Run settings (clap).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "tp_gpu",
    about = "TP dedup on the device through the Linker into device pools: benchmarks (checks: cargo test --features cuda --test gpu tp_)."
)]
pub struct Args {
    /// NCCL ranks, one per GPU (0 on one GPU; from --tp or the GPUs visible).
    #[arg(skip)]
    pub tp: u32,
    /// Ranks on one GPU for the benchmark.
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub bench_ranks: u32,
    /// Small sizes: 8K tokens only, one repetition.
    #[arg(long)]
    pub quick: bool,
    /// Largest prefix benchmarked, in tokens.
    #[arg(long, value_name = "T", default_value_t = 524_288,
          value_parser = clap::value_parser!(u64).range(64..))]
    pub max_tokens: u64,
    /// Smallest prefix benchmarked, in tokens.
    #[arg(long, value_name = "T", default_value_t = 0)]
    pub min_tokens: u64,
    /// Host memory to plan with, in GiB on the command line (bytes here), instead of
    /// `MemAvailable`.
    #[arg(long = "host-mem-gib", value_name = "G", value_parser = gib)]
    pub host_mem: Option<u64>,
    /// Measured repetitions per mode after one warm-up (from --reps: 3, 1 with --quick).
    #[arg(skip)]
    pub reps: usize,
    /// Start no size that would end past this many seconds.
    #[arg(long, value_name = "S", default_value_t = 540.0)]
    pub budget_s: f64,
    /// Threads that fill the store.
    #[arg(long, value_name = "T", default_value_t = default_threads())]
    pub threads: usize,
    /// Run on CPU devices instead of GPUs: a dry run of this program's logic (orchestration,
    /// tables) on a machine without a GPU; no GPU number comes out of it.
    #[arg(long)]
    pub cpu: bool,
    /// Where logs, tables, SVG and CSV go [default: $OUT when set].
    #[arg(long, value_name = "DIR")]
    pub out: Option<std::path::PathBuf>,
    /// NCCL ranks, one per GPU [default: every visible GPU when there are 2 or more].
    #[arg(long = "tp", value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    tp_given: Option<u32>,
    /// Measured repetitions per mode after one warm-up [default: 3, 1 with --quick].
    #[arg(long = "reps", value_name = "R")]
    reps_given: Option<usize>,
}

fn parse_args() -> Result<Args, String> {
    use clap::Parser;
    let mut a = Args::try_parse().map_err(|e| e.render().to_string())?;
    if a.out.is_none() {
        a.out = std::env::var_os("OUT")
            .filter(|s| !s.is_empty())
            .map(Into::into);
    }
    a.reps = a.reps_given.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    a.threads = a.threads.max(1);
    Ok(a)
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let mut args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let gpus = match if args.cpu { Ok(1) } else { cuda_device_count() } {
        Ok(0) => {
            eprintln!("tp_gpu: CUDA unavailable: the driver sees no GPU");
            eprintln!("tp_gpu: nothing was run (exit 2)");
            return ExitCode::from(2);
        }
        Ok(n) => n,
        Err(e) => {
            eprintln!("tp_gpu: CUDA unavailable: {e}");
            eprintln!(
                "tp_gpu: nothing was run (this program needs NVIDIA GPUs and their driver; exit 2)"
            );
            return ExitCode::from(2);
        }
    };
    // Two or more GPUs: one rank per GPU over NCCL. One GPU: ranks share it.
    args.tp = match args.tp_given {
        Some(t) => t,
        None if gpus >= 2 => gpus,
        None => 0,
    };
    if args.tp > gpus {
        eprintln!(
            "tp_gpu: --tp {} needs {} GPUs, {gpus} visible: nothing was run (exit 2)",
            args.tp, args.tp
        );
        return ExitCode::from(2);
    }
    if let Some(dir) = &args.out {
        let _ = std::fs::create_dir_all(dir);
    }
    let started = Instant::now();
    let mut report = Report::default();
    let gpu_name = open_device(args.cpu, 0)
        .map(|d| d.name())
        .unwrap_or_else(|e| e);
    report.info("env", "GPUs visible", gpus.to_string());
    for r in 0..gpus {
        let name = open_device(args.cpu, r)
            .map(|d| d.name())
            .unwrap_or_else(|e| e);
        report.info("env", format!("GPU {r}"), name);
    }
    if args.cpu {
        report.info(
            "env",
            "DRY RUN",
            "--cpu: CPU devices, not GPUs; exercises the program's logic only, no GPU number",
        );
    } else {
        match nccl_version() {
            Ok(v) => report.info("env", "NCCL", v.to_string()),
            Err(e) => report.push("env", "NCCL", Status::Fail, e.to_string()),
        }
    }
    if let Some(avail) = host_available() {
        report.info(
            "env",
            "host memory",
            format!(
                "{} available now{}",
                fmt_bytes(avail),
                args.host_mem.map_or(String::new(), |m| format!(
                    "; planning with {} (--host-mem-gib)",
                    fmt_bytes(m)
                ))
            ),
        );
    }
    report.info(
        "env",
        "store / share path",
        "embedded store (in-process), not Mooncake; replicated KV shared on the device (upload, collective on device staging, scatter)",
    );
    let benched = if args.tp >= 1 {
        Fabric::Nccl { tp: args.tp }
    } else {
        Fabric::OneGpu {
            ranks: args.bench_ranks,
        }
    };
    if gpus < 2 {
        report.push(
            "env",
            "NCCL across GPUs (one rank per GPU), 128K/256K/512K beside the seed",
            Status::Skip,
            format!("{gpus} GPU visible: this machine runs N ranks on one GPU; give the same command 2, 4 or 8 GPUs"),
        );
    }
    let mut bench_text = String::new();
    report.section("bench", |r| {
        bench_text = bench::run(&args, benched, started, r)
    });
    report.info(
        "env",
        "total run time",
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    );
    if !report.failed() && report.passed() == 0 {
        // Every size skipped (none in range, too little memory, out of budget): a run that
        // measured nothing is not a pass, in its table as in its exit status.
        report.push(
            "env",
            "measured",
            Status::Fail,
            "nothing was measured or checked (every row skipped)",
        );
    }
    let text = report.table();
    // "NVIDIA H200" → "h200": the first word of the GPU's name with a digit in it.
    let machine = if args.cpu {
        "cpu".to_string()
    } else {
        gpu_name
            .split_whitespace()
            .find(|w| w.chars().any(|c| c.is_ascii_digit()))
            .unwrap_or("gpu")
            .to_lowercase()
    };
    let ranks = benched.tp();
    if let Some(dir) = &args.out {
        let name = format!("tp_gpu_{machine}x{gpus}_ranks{ranks}.txt");
        let mut file = String::new();
        if !bench_text.is_empty() {
            file.push_str(&bench_text);
            file.push('\n');
        }
        file.push_str(&text);
        let _ = std::fs::write(dir.join(name), file);
    }
    if !bench_text.is_empty() {
        println!("{bench_text}");
    }
    println!("{text}");
    if report.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
