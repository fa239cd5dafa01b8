//! `gpu_check`: benchmarks of the CUDA backend and the NCCL collective on a GPU, each with its
//! ceiling measured in the same run (built here with `--features cuda`, run on the GPU machine
//! by `scripts/gpu-run.sh`):
//! - host→device through the staged landing vs a plain pinned copy of the same bytes;
//! - the layer wait on a compute stream;
//! - the layer-wise load of a GLM-5.2 prefix (32K and 128K tokens) from the embedded store vs
//!   the sum of its parts, with a per-layer timeline (SVG), and the same through the Linker
//!   into a device pool (1 and 8 store calls per layer at once);
//! - NCCL broadcast of one GLM-5.2 layer of a 128K prefix vs raw NCCL (two GPUs).
//!
//! Correctness lives in the `gpu` test target (`tests/gpu/`): `cargo test --release --features
//! cuda --test gpu` (the copy kernels, the staged landing, failures and misuse, NCCL, the Linker
//! into device pools, TP dedup), which `scripts/gpu-run.sh` runs before this program.
//!
//! Prints a table last (its last line `N passed, N failed` counts the benchmarks that ran
//! through or failed). Exit status: 0 all passed, 1 a benchmark failed, 2 CUDA is unavailable.
//! Flags: `--quick` (smaller sizes), `--out DIR` (CSV and SVG; default `$OUT` when set),
//! `--no-128k`.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod bench;
mod linker_bench;
mod nccl_bench;

use std::process::ExitCode;
use std::time::Instant;

use kvlink::kv_device::cuda::cuda_device_count;
use tracing_subscriber::EnvFilter;

use kvlink_rig::report::{Report, Status};

/// Run settings (clap).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "gpu_check",
    about = "The CUDA backend and the NCCL collective on a GPU: benchmarks (checks: cargo test --features cuda --test gpu)."
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
}

fn parse_args() -> Result<Args, String> {
    use clap::Parser;
    let mut a = Args::try_parse().map_err(|e| e.render().to_string())?;
    if a.out.is_none() {
        a.out = std::env::var_os("OUT").map(Into::into);
    }
    Ok(a)
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
        Ok(0) => {
            eprintln!("gpu_check: the driver sees no GPU: nothing was run");
            return ExitCode::from(2);
        }
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
    report.section("bench", |r| linker_bench::run(&args, r));
    report.section("bench", |r| bench::run(&args, gpus, r));
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
