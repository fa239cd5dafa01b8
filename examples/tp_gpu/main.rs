//! `tp_gpu`: the NCCL dedup run on N GPUs (issues 8, 9, 10: TP2, TP4, TP8) in one process,
//! one thread per rank, rank `r` on GPU `r`, two NCCL communicators per rank (the linker's
//! `data` and `control` handles). Built here with `--features cuda`, run on the GPU machine
//! by `scripts/gpu-tp-run.sh`. TP = the number of visible GPUs unless `--tp N`; `--tp 1` (or
//! one visible GPU) is the dry run.
//!
//! 1. Correctness (GLM-5.2 FP8 geometry at TP N; a prefix saved by rank 0 into ONE shared
//!    embedded store; every rank loads it into its own `CudaKvPool` at its own, different,
//!    scattered slots): for every mode (`AllRanks`, `Rank0Broadcast`, `SplitAllGather`) every
//!    rank's device pool equals the saved bytes, and each rank read from the store what the
//!    mode says; a plan whose request id differs on rank N-1 falls back to `AllRanks` on every
//!    rank with the bytes still right, and the next batch shares again; a read failure
//!    injected (a `FaultyStore` per rank) on rank 0 and on rank N-1 at the middle layer gives
//!    every rank the same failed outcome (same error string, `PeerFailed` naming that rank)
//!    well within the deadline, the layers before it are right, and the next batch loads.
//!    (In `Rank0Broadcast` rank N-1 reads nothing, so a read fault there is never reached:
//!    that check asserts the batch loads. With one rank, every mode reads its own copy and
//!    the checks hold trivially.)
//! 2. Benchmark: GLM-5.2 FP8 prefixes of 128K, 256K and 512K tokens (each skipped with a
//!    message when host or GPU memory is short, or when the time budget would run out; 8K
//!    with `--quick`), every mode: time to the last layer resident on every rank (slowest
//!    rank; each layer's event synchronized), store bytes read per rank and in total, the
//!    reduction vs `AllRanks`, printed in the shape of design.md §1's table; with the raw
//!    ceilings of one layer of `k` measured in the same run: pinned host→device on every GPU
//!    at once, raw NCCL broadcast and all-gather of device buffers (not at TP1), and kvlink's
//!    `NcclCollective` on host buffers. A per-layer timeline (SVG + CSV) per size and mode.
//!
//! **The store is the embedded one (in-process)**, not Mooncake: this program does not carry
//! Mooncake to the GPU machine. Every table says so.
//!
//! **Caveat: what the TP numbers measure.** The linker currently shares replicated
//! components through HOST staging: the reader reads into a host buffer, the collective gets
//! host buffers (`NcclCollective` moves them through a device scratch buffer: host→device,
//! NCCL, device→host on every rank), each rank scatters the rows into its pinned staging,
//! and the staged landing copies them up to the pool. The device-native path
//! (`StagedLanding::stage_to_device` → broadcast on device memory → `land_from_device`,
//! proven on one GPU by `gpu_check`) is not driven by the linker yet, so the
//! `Rank0Broadcast` and `SplitAllGather` numbers here are those of the host-staging path;
//! the "kvlink host-buffer" ceilings show its cost per layer next to raw NCCL's.
//!
//! Prints the benchmark tables, then a short result table last. Exit status: 0 all checks
//! passed, 1 a check failed, 2 CUDA unavailable (or fewer GPUs than `--tp`, or bad flags).
//! Flags:
//! - `--tp N`: ranks (GPUs 0..N-1); default every visible GPU.
//! - `--quick`: correctness on 32 pages, benchmark at 8K tokens only, one repetition.
//! - `--max-tokens T` / `--min-tokens T`: the largest / smallest prefix benchmarked (of 128K,
//!   256K, 512K; a `--max-tokens` below 128K benchmarks that size alone; `--min-tokens 524288
//!   --no-checks` runs 512K alone).
//! - `--reps R`: measured repetitions after one warm-up (default 3, 1 with `--quick`).
//! - `--budget-s S`: start no size that would end past S seconds (default 540).
//! - `--host-mem-gib G`: plan with G GiB of host memory instead of `MemAvailable` (which on
//!   the lent machines starts small and grows as memory is used; scripts/gpu-tp-run.sh passes
//!   the machine's size).
//! - `--no-bench`, `--no-checks`, `--threads T` (store fill threads).
//! - `--out DIR`: tables, and SVG + CSV timelines in `DIR/timelines/` (default `$OUT`).

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod checks;
mod setup;
#[path = "../gpu_common/util.rs"]
mod util;

use std::process::ExitCode;
use std::time::Instant;

use kvlink::dedup_broadcast::nccl::nccl_version;
use kvlink::kv_device::cuda::cuda_device_count;
use tracing_subscriber::EnvFilter;

use util::{fmt_bytes, Report, Status};

/// Run settings.
#[derive(Debug, Clone)]
pub struct Args {
    /// Ranks (GPUs 0..tp).
    pub tp: u32,
    /// Small sizes (the 1-GPU dry run takes well under a minute).
    pub quick: bool,
    /// Largest prefix benchmarked, in tokens.
    pub max_tokens: u64,
    /// Smallest prefix benchmarked, in tokens.
    pub min_tokens: u64,
    /// Host memory to plan with, in bytes (`--host-mem-gib`), instead of `MemAvailable`.
    pub host_mem: Option<u64>,
    /// Measured repetitions per mode (after one warm-up).
    pub reps: usize,
    /// Seconds after which no further size is started.
    pub budget_s: f64,
    /// Skip the benchmark.
    pub no_bench: bool,
    /// Skip the correctness checks.
    pub no_checks: bool,
    /// Threads that fill the store.
    pub threads: usize,
    /// Where logs, tables, SVG and CSV go.
    pub out: Option<std::path::PathBuf>,
    tp_given: Option<u32>,
    reps_given: Option<usize>,
}

const USAGE: &str =
    "usage: tp_gpu [--tp N] [--quick] [--max-tokens T] [--min-tokens T] [--reps R] \
                     [--budget-s S] [--host-mem-gib G] [--no-bench] [--no-checks] [--threads T] \
                     [--out DIR]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        tp: 0,
        quick: false,
        max_tokens: 524_288,
        min_tokens: 0,
        host_mem: None,
        reps: 3,
        budget_s: 540.0,
        no_bench: false,
        no_checks: false,
        threads: std::thread::available_parallelism().map_or(4, |n| n.get().min(16)),
        out: std::env::var_os("OUT")
            .filter(|s| !s.is_empty())
            .map(Into::into),
        tp_given: None,
        reps_given: None,
    };
    let mut it = std::env::args().skip(1);
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        v.as_deref()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{flag} needs a number\n{USAGE}"))
    }
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--tp" => a.tp_given = Some(num("--tp", it.next())?),
            "--quick" => a.quick = true,
            "--max-tokens" => a.max_tokens = num("--max-tokens", it.next())?,
            "--min-tokens" => a.min_tokens = num("--min-tokens", it.next())?,
            "--host-mem-gib" => {
                a.host_mem = Some(num::<u64>("--host-mem-gib", it.next())? << 30);
            }
            "--reps" => a.reps_given = Some(num("--reps", it.next())?),
            "--budget-s" => a.budget_s = num("--budget-s", it.next())?,
            "--no-bench" => a.no_bench = true,
            "--no-checks" => a.no_checks = true,
            "--threads" => a.threads = num::<usize>("--threads", it.next())?.max(1),
            "--out" => a.out = Some(it.next().ok_or("--out needs a directory")?.into()),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.tp_given == Some(0) {
        return Err(format!("--tp must be at least 1\n{USAGE}"));
    }
    if a.max_tokens < 64 {
        return Err(format!(
            "--max-tokens must be at least 64 (one page)\n{USAGE}"
        ));
    }
    a.reps = a.reps_given.unwrap_or(if a.quick { 1 } else { 3 }).max(1);
    Ok(a)
}

/// Runs one part; a panic that escapes its own checks becomes a FAIL row, and the run goes on.
fn section(report: &mut Report, name: &'static str, f: impl FnOnce(&mut Report)) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(report)));
    if let Err(p) = r {
        report.push(
            name,
            "(section aborted)",
            Status::Fail,
            format!("PANIC: {}", util::panic_msg(&*p)),
        );
    }
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
    let gpus = match cuda_device_count() {
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
    args.tp = args.tp_given.unwrap_or(gpus);
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
    report.info(
        "env",
        "GPUs visible / TP",
        format!(
            "{gpus} / {}{}",
            args.tp,
            if args.tp == 1 {
                " (dry run: one rank)"
            } else {
                ""
            }
        ),
    );
    for r in 0..args.tp {
        let name = kvlink::kv_device::cuda::CudaDevice::new(r)
            .map(|d| kvlink::kv_device::Device::name(&*d))
            .unwrap_or_else(|e| e.to_string());
        report.info("env", format!("GPU {r}"), name);
    }
    match nccl_version() {
        Ok(v) => report.info("env", "NCCL", v.to_string()),
        Err(e) => report.push("env", "NCCL", Status::Fail, e.to_string()),
    }
    if let Some(avail) = setup::host_available() {
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
        "store",
        "embedded store (in-process); replicated KV shared through host staging (see the header)",
    );
    let mut groups = setup::Groups::new(args.tp);
    if args.no_checks {
        report.push("correctness", "all", Status::Skip, "--no-checks");
    } else {
        section(&mut report, "correctness", |r| {
            checks::run(&args, &mut groups, r)
        });
    }
    let mut bench_text = String::new();
    if args.no_bench {
        report.push("bench", "all", Status::Skip, "--no-bench");
    } else {
        section(&mut report, "bench", |r| {
            bench_text = bench::run(&args, &mut groups, started, r)
        });
    }
    groups.reset();
    report.info(
        "env",
        "NCCL group pairs made / total run time",
        format!("{} / {:.1} s", groups.made, started.elapsed().as_secs_f64()),
    );
    let text = report.table();
    if let Some(dir) = &args.out {
        let _ = std::fs::write(dir.join(format!("tp_gpu_table_tp{}.txt", args.tp)), &text);
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
