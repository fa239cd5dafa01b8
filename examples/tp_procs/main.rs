//! `tp_procs`: TP ranks as **processes** on the GPU machine, checked in one run (issue 14).
//! Built here with `--features cuda`, run there by `scripts/gpu-procs-run.sh`.
//!
//! This program is the launcher: it saves a GLM-5.2 prefix into an embedded store and serves
//! it over a Unix socket, then starts rank processes of itself (`--rank R ...`) that meet at a
//! rendezvous on 127.0.0.1, and checks what they report:
//! 1. **One rank process with NCCL through the whole path** (any GPU count): the rendezvous
//!    carries NCCL unique ids to the process, which joins its data and control
//!    communicators (`RendezvousFormation::nccl`) and loads every mode through the Linker into
//!    a `CudaKvPool` (one rank reads its own copy), pool compared; the device share step
//!    (upload → `share_stage` on the process's NCCL communicator → scatter → land) for every
//!    layer, bytes compared; then its communicators are aborted and the group re-forms at the
//!    rendezvous (new epoch, new ids, new communicators) and the share step runs again.
//! 2. **One rank process per GPU** (2 or more GPUs, `--tp`): NCCL across processes, the
//!    device path through the Linker, every mode, every rank's pool compared and its store
//!    reads checked against the mode; then a rank process stopped mid-batch (SIGSTOP) past
//!    the collective deadline (a slow read alone fails in time through the status words and
//!    leaves the group whole): every rank fails that batch (NCCL aborts on timeout), the linkers
//!    re-form the group at the rendezvous by themselves, and the next batch loads and
//!    verifies.
//! 3. **`glm_prefill` with TP ranks as threads and as processes** on this host (host pools,
//!    embedded store; `--glm-bin`): `--mode compare` in both shapes, every pool verified, the
//!    comparison tables kept in `$OUT`.
//!
//! `--cpu`: a dry run without a GPU: host pools and socket collectives stand in for device
//! pools and NCCL (two rank processes for part 2), no GPU number comes out of it.
//!
//! Prints the result table last (it ends with the line `N passed, N failed`), also written to
//! `$OUT/tp_procs.txt`. Exit status: 0 all passed, 1 a check failed, 2 bad flags or no GPU.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod cases;
mod glm;
mod launch;
mod rank;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use kvlink::kv_device::cuda::cuda_device_count;
use tracing_subscriber::EnvFilter;

use kvlink_rig::report::{Report, Status};

/// Run settings (the launcher's and a rank process's).
#[derive(Debug, Clone)]
pub struct Args {
    /// Dry run on the CPU (host pools, socket collectives).
    pub cpu: bool,
    /// Rank processes of part 2 (one per GPU); 0: every visible GPU when 2 or more.
    pub tp: u32,
    /// Pages of the saved prefix.
    pub pages: usize,
    /// Seed of the prefix's tokens.
    pub seed: u32,
    /// Threads that fill the store.
    pub threads: usize,
    /// The `glm_prefill` binary (part 3); empty: skip.
    pub glm_bin: String,
    /// TP ranks of the `glm_prefill` runs.
    pub glm_tp: u32,
    /// Cached tokens of the `glm_prefill` runs.
    pub glm_tokens: u64,
    /// Where tables and logs go.
    pub out: Option<std::path::PathBuf>,
    /// A rank process: its settings.
    pub rank: Option<rank::RankArgs>,
}

const USAGE: &str = "usage: tp_procs [--cpu] [--tp N] [--pages N] [--quick] [--threads T] \
                     [--glm-bin PATH|none] [--glm-tp N] [--glm-tokens T] [--out DIR] \
                     [--limit-s S]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        cpu: false,
        tp: 0,
        pages: 64,
        seed: 7,
        threads: std::thread::available_parallelism().map_or(4, |n| n.get().min(16)),
        glm_bin: std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(|d| d.join("glm_prefill")))
            .map(|p| p.display().to_string())
            .unwrap_or_default(),
        glm_tp: 8,
        glm_tokens: 32_768,
        out: std::env::var_os("OUT")
            .filter(|s| !s.is_empty())
            .map(Into::into),
        rank: None,
    };
    let mut it = std::env::args().skip(1);
    let mut rank = rank::RankArgs::default();
    let mut is_rank = false;
    fn num<T: std::str::FromStr>(flag: &str, v: Option<String>) -> Result<T, String> {
        v.as_deref()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("{flag} needs a number\n{USAGE}"))
    }
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--cpu" => a.cpu = true,
            "--tp" => a.tp = num("--tp", it.next())?,
            "--pages" => {
                a.pages = num::<usize>("--pages", it.next())?;
                // Part 1's share step moves 32 pages through staging sized for --pages.
                if a.pages < 32 {
                    return Err(format!("--pages {}: at least 32", a.pages));
                }
            }
            "--quick" => {
                a.pages = 32;
                a.glm_tokens = 8192;
                a.glm_tp = 4;
            }
            "--seed" => a.seed = num("--seed", it.next())?,
            "--threads" => a.threads = num::<usize>("--threads", it.next())?.max(1),
            "--glm-bin" => a.glm_bin = it.next().unwrap_or_default(),
            "--glm-tp" => a.glm_tp = num::<u32>("--glm-tp", it.next())?.max(1),
            "--glm-tokens" => a.glm_tokens = num("--glm-tokens", it.next())?,
            "--out" => a.out = Some(it.next().ok_or("--out needs a directory")?.into()),
            "--limit-s" => cases::end_by(Duration::from_secs(num("--limit-s", it.next())?)),
            // A rank process (started by the launcher).
            "--rank" => {
                is_rank = true;
                rank.rank = num("--rank", it.next())?;
            }
            "--world" => rank.world = num("--world", it.next())?,
            "--rendezvous" => rank.rendezvous = it.next().unwrap_or_default(),
            "--store-at" => rank.store_at = it.next().unwrap_or_default(),
            "--gpu" => rank.gpu = num("--gpu", it.next())?,
            "--case" => rank.case = it.next().unwrap_or_default(),
            "--slow-rank" => rank.slow_rank = Some(num("--slow-rank", it.next())?),
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.glm_bin == "none" {
        a.glm_bin.clear();
    }
    if is_rank {
        a.rank = Some(rank);
    }
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
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    if let Some(r) = &args.rank {
        return match rank::run(&args, r) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                rank::say(&format!("error {e}"));
                eprintln!("tp_procs rank {}: {e}", r.rank);
                ExitCode::FAILURE
            }
        };
    }
    let gpus = if args.cpu {
        1
    } else {
        match cuda_device_count() {
            Ok(n) if n > 0 => n,
            Ok(_) => {
                eprintln!("tp_procs: CUDA unavailable: the driver sees no GPU (exit 2)");
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("tp_procs: CUDA unavailable: {e} (exit 2)");
                return ExitCode::from(2);
            }
        }
    };
    if let Some(dir) = &args.out {
        let _ = std::fs::create_dir_all(dir);
    }
    let started = Instant::now();
    let mut report = Report::default();
    report.info("env", "GPUs visible", gpus.to_string());
    report.info(
        "env",
        "CPUs",
        std::thread::available_parallelism().map_or("?".into(), |n| n.get().to_string()),
    );
    if args.cpu {
        report.info(
            "env",
            "DRY RUN",
            "--cpu: host pools and socket collectives stand in for CUDA pools and NCCL; no GPU number",
        );
    }
    cases::run(&args, gpus, &mut report);
    if args.glm_bin.is_empty() {
        report.push(
            "glm_prefill",
            "threads vs processes",
            Status::Skip,
            "--glm-bin none",
        );
    } else {
        glm::run(&args, &mut report);
    }
    report.info(
        "env",
        "total run time",
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    );
    let text = report.table();
    if let Some(dir) = &args.out {
        let _ = std::fs::write(dir.join("tp_procs.txt"), &text);
    }
    println!("{text}");
    if report.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
