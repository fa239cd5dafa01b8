//! `gpu_check`: the CUDA backend and the NCCL collective, checked and measured on a GPU in one
//! run (built here with `--features cuda`, run on the GPU machine by `scripts/gpu-run.sh`).
//!
//! 1. Correctness: the copy kernel (NVRTC and the shipped PTX), the staged landing (device pool
//!    bytes equal the host pool's after the same load; scattered, contiguous and mixed slots;
//!    every scatter strategy), a batch that fails at a layer, misuse refused with typed
//!    errors, the save-direction gather, and the device share step on one rank (upload of
//!    the share area, `broadcast_device` over NCCL through `share_stage`, scatter after its
//!    event).
//! 2. NCCL: one rank end to end (set-up, event-ordered `broadcast_device` / `all_gather_device`,
//!    host rows, small host exchanges), an initialisation that times out, and two ranks when
//!    two GPUs are visible (otherwise skipped).
//! 3. Benchmarks, each with its ceiling measured in the same run: host→device through the
//!    staged landing vs a plain pinned copy of the same bytes; the layer wait on a compute
//!    stream; the layer-wise load of a GLM-5.2 prefix (32K and 128K tokens) from the embedded
//!    store vs the sum of its parts, with a per-layer timeline (SVG); NCCL broadcast of one
//!    GLM-5.2 layer of a 128K prefix vs raw NCCL (two GPUs).
//!
//! Prints a table last. Exit status: 0 all passed, 1 a check failed, 2 CUDA is unavailable.
//! Flags: `--quick` (smaller sizes), `--out DIR` (CSV and SVG; default `$OUT` when set),
//! `--no-128k`, `--no-checks` (benchmarks only: the same checks are the `gpu` test target,
//! `cargo test --release --features cuda --test gpu`, which `scripts/gpu-run.sh` runs first).

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod checks;
mod linker;
mod nccl_checks;
#[path = "../gpu_common/util.rs"]
mod util;

use std::process::ExitCode;
use std::time::Instant;

use kvlink::kv_device::cuda::cuda_device_count;
use tracing_subscriber::EnvFilter;

use util::{Report, Status};

/// Run settings (clap).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "gpu_check",
    about = "The CUDA backend and the NCCL collective on a GPU: checks and benchmarks."
)]
pub struct Args {
    /// Smaller sizes, fewer iterations.
    #[arg(long)]
    pub quick: bool,
    /// Skip the 128K-token load.
    #[arg(long = "no-128k")]
    pub no_128k: bool,
    /// Where CSV and SVG files go [default: $OUT when set].
    #[arg(long, value_name = "DIR")]
    pub out: Option<std::path::PathBuf>,
    /// Benchmarks only: the same checks are the `gpu` test target (`tests/gpu/`), which
    /// `scripts/gpu-run.sh` runs first.
    #[arg(long)]
    pub no_checks: bool,
}

fn parse_args() -> Result<Args, String> {
    use clap::Parser;
    let mut a = Args::try_parse().map_err(|e| e.render().to_string())?;
    if a.out.is_none() {
        a.out = std::env::var_os("OUT").map(Into::into);
    }
    Ok(a)
}

/// Runs one part; a panic that escapes its own checks becomes a FAIL row, and the run goes on.
fn section(report: &mut Report, name: &'static str, f: impl FnOnce(&mut Report)) {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(report)));
    if let Err(p) = r {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "panic".into());
        report.push(
            name,
            "(section aborted)",
            Status::Fail,
            format!("PANIC: {msg}"),
        );
    }
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let gpus = match cuda_device_count() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("gpu_check: {e}");
            eprintln!("gpu_check: nothing was run (this program needs an NVIDIA GPU and driver)");
            return ExitCode::from(2);
        }
    };
    if let Some(dir) = &args.out {
        let _ = std::fs::create_dir_all(dir);
    }
    let started = Instant::now();
    let mut report = Report::default();
    report.info("env", "GPUs visible", gpus.to_string());
    if args.no_checks {
        report.push("correctness", "all", Status::Skip, "--no-checks");
    } else {
        section(&mut report, "correctness", |r| checks::run(&args, r));
        section(&mut report, "nccl", |r| nccl_checks::run(&args, gpus, r));
        section(&mut report, "linker", |r| linker::run(&args, r));
    }
    section(&mut report, "bench", |r| linker::run_bench(&args, r));
    section(&mut report, "bench", |r| bench::run(&args, gpus, r));
    if !args.no_checks {
        section(&mut report, "nccl", |r| nccl_checks::run_aborts(gpus, r));
    }
    report.info(
        "env",
        "total run time",
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    );
    let text = report.table();
    if let Some(dir) = &args.out {
        let _ = std::fs::write(dir.join("gpu_check_table.txt"), &text);
    }
    println!("\n{text}");
    if report.rows.iter().any(|r| r.status == Status::Fail) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
