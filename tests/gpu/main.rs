//! The GPU checks as tests (feature `cuda`), one file per idea:
//! - the CUDA backend: the copy kernel (`kernels`), the staged landing into a device pool with
//!   a failure at a layer and the save-direction gather (`staged_landing`), misuse refused
//!   with typed errors (`landing_misuse`), an engine thread's own context kept current
//!   (`context`);
//! - NCCL: one rank end to end and two GPUs (`nccl`), the device share step on one rank
//!   (`nccl_share_step`), initialisations and ranks that time out and abort (`nccl_aborts`), a
//!   host operation not held by work on the legacy default stream (`nccl_default_stream`);
//! - the Linker into device pools: loaded bytes, a save from a device pool, a failure at a
//!   layer (`linker`);
//! - TP dedup on device pools: every mode, plan mismatch, read failures on rank 0, a middle
//!   rank and the last rank, with 2, 4 and 8 ranks on one GPU or one rank per GPU over NCCL
//!   (`tp_dedup`), and one NCCL rank through the Linker and the share step (`tp_nccl_one`).
//!
//! Each test runs one group of checks, prints its rows as a table that ends with `N passed, N
//! failed` (`--nocapture` shows it) and fails when any row failed. The tests run one at a time
//! (one lock): they share the GPU, and some measure deadlines. What the checks and the
//! examples share (the table, the byte pattern, TP ranks on device pools) is the dev-only
//! crate `kvlink-rig`; the examples `gpu_check` and `tp_gpu` only measure.
//!
//! Without a GPU (no driver, or the driver sees none) every test prints why and passes: `cargo
//! test --workspace --all-features` on a machine without a GPU builds and skips them. On the GPU
//! machine `scripts/gpu-run.sh` and `scripts/gpu-tp-run.sh` run the binary that
//! `scripts/gpu-build.sh` builds (`cargo test --release --features cuda,failpoints --test gpu
//! --no-run`: without `failpoints` the check that makes a comm thread panic is skipped).
//! `KVLINK_GPU_QUICK=1` runs the smaller sizes; `KVLINK_REQUIRE_GPU=1` fails a test that finds
//! no GPU.
#![allow(clippy::print_stdout, missing_docs)]

use std::sync::Mutex;

use kvlink::kv_device::cuda::cuda_device_count;
use kvlink_rig::report::{panic_msg, Report, Status};
use kvlink_rig::tp::Fabric;

mod context;
mod kernels;
mod landing_misuse;
mod linker;
mod nccl;
mod nccl_aborts;
mod nccl_default_stream;
mod nccl_gated;
mod nccl_share_step;
mod staged_landing;
mod tp_dedup;
mod tp_nccl_one;

/// The settings the checks read.
#[derive(Debug)]
pub struct Args {
    /// Smaller sizes (`KVLINK_GPU_QUICK=1`).
    pub quick: bool,
    /// Threads that fill the store of the TP checks.
    pub threads: usize,
}

fn args() -> Args {
    Args {
        quick: std::env::var("KVLINK_GPU_QUICK").as_deref() == Ok("1"),
        threads: std::thread::available_parallelism().map_or(4, |n| n.get().min(16)),
    }
}

/// One test on the GPU at a time.
static GPU: Mutex<()> = Mutex::new(());

/// The GPUs visible, or why there are none.
fn gpus() -> Result<u32, String> {
    match cuda_device_count() {
        Ok(0) => Err("the CUDA driver sees no GPU".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("CUDA unavailable ({e})")),
    }
}

/// Runs one group of checks on the GPU(s), prints its rows (the table ends with `N passed, N
/// failed`), fails on a failed row. Without a GPU: skipped with a message, or with
/// `KVLINK_REQUIRE_GPU=1` (as `scripts/gpu-run.sh` sets) a FAIL row.
fn run(test: &str, f: impl FnOnce(u32, &mut Report)) {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    let mut report = Report::default();
    match gpus() {
        Ok(n) => {
            // A panic that escapes the checks' own rows becomes a FAIL row, so the table says it.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(n, &mut report)));
            if let Err(p) = ran {
                report.push(
                    "tests",
                    format!("{test} (aborted)"),
                    Status::Fail,
                    format!("PANIC: {}", panic_msg(&*p)),
                );
            }
        }
        Err(why) if std::env::var("KVLINK_REQUIRE_GPU").as_deref() == Ok("1") => {
            report.push(
                "tests",
                test.to_string(),
                Status::Fail,
                format!("KVLINK_REQUIRE_GPU=1 but {why}"),
            );
        }
        Err(why) => {
            println!("{test}: skipped: {why}; these tests need an NVIDIA GPU");
            return;
        }
    }
    let table = report.table();
    println!("== {test}\n{table}");
    assert!(!report.failed(), "{test}: a check failed:\n{table}");
}

#[test]
fn engine_context_kept() {
    run("context", |_, r| context::run(r));
}

#[test]
fn copy_kernels() {
    run("kernels", |_, r| kernels::run(r));
}

#[test]
fn staged_landing_failure_gather_misuse() {
    run("staged landing", |_, r| staged_landing::run(&args(), r));
}

#[test]
fn nccl_one_rank_and_two_gpus() {
    run("nccl", |n, r| nccl::run(&args(), n, r));
}

#[test]
fn nccl_host_ops_not_held_by_the_default_stream() {
    run("nccl default stream", |_, r| nccl_default_stream::run(r));
}

#[test]
fn nccl_timeouts_abort() {
    run("nccl aborts", nccl_aborts::run_aborts);
}

/// A diagnostic of an abort with the comm stream held (see `nccl_gated`): prints its steps,
/// checks nothing; `gpu_tests nccl_abort_with_the_comm_stream_gated --ignored --nocapture`.
#[test]
#[ignore = "a diagnostic that may leave the GPU context in a bad state: run it by name"]
fn nccl_abort_with_the_comm_stream_gated() {
    let _one = GPU.lock().unwrap_or_else(|p| p.into_inner());
    if gpus().is_ok() {
        nccl_gated::run();
    }
}

#[test]
fn linker_into_device_pools() {
    run("linker", |_, r| linker::run(&args(), r));
}

/// Every mode on device pools: ranks on one GPU (2, 4, 8), or one rank per GPU over NCCL.
#[test]
fn tp_dedup_on_device_pools() {
    run("tp", |n, r| {
        let fabrics: Vec<Fabric> = if n >= 2 {
            vec![Fabric::Nccl { tp: n }]
        } else {
            [2, 4, 8].map(|ranks| Fabric::OneGpu { ranks }).to_vec()
        };
        for fabric in fabrics {
            tp_dedup::run(&args(), fabric, r);
        }
    });
}

#[test]
fn tp_one_nccl_rank_through_the_linker() {
    run("tp nccl-1", |_, r| tp_nccl_one::run(&args(), r));
}
