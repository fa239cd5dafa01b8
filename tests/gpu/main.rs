//! The GPU checks as tests (feature `cuda`): the CUDA backend (copy kernels, staged landing,
//! failures, misuse, gather), the NCCL collective (one rank, two GPUs, aborts), the Linker into
//! device pools, and TP dedup on the device (ranks on one GPU, or one per GPU over NCCL).
//!
//! The checks' code is shared with the examples that show the same paths with benchmarks
//! (`examples/gpu_check`, `examples/tp_gpu`); here each test runs one group of them, prints its
//! rows (`--nocapture` shows them) and fails when any row failed. The tests run one at a time
//! (one lock): they share the GPU, and some measure deadlines.
//!
//! Without a GPU (no driver, or the driver sees none) every test prints why and passes: `cargo
//! test --workspace --all-features` on a machine without a GPU builds and skips them. On the GPU
//! machine `scripts/gpu-run.sh` runs the binary that `scripts/gpu-build.sh` builds
//! (`cargo test --release --features cuda --test gpu --no-run`). `KVLINK_GPU_QUICK=1` runs the
//! smaller sizes; `KVLINK_REQUIRE_GPU=1` fails a test that finds no GPU.
#![allow(clippy::print_stdout, clippy::print_stderr, missing_docs)]

use std::sync::Mutex;

use kvlink::kv_device::cuda::cuda_device_count;

#[path = "../../examples/gpu_common/util.rs"]
mod util;

use util::Report;

/// The checks of `examples/gpu_check`: one GPU's backend, NCCL, the Linker.
#[allow(dead_code)]
mod device;
/// The checks of `examples/tp_gpu`: TP dedup on device pools.
#[allow(dead_code)]
mod tp;

/// One test on the GPU at a time.
static GPU: Mutex<()> = Mutex::new(());

fn quick() -> bool {
    std::env::var("KVLINK_GPU_QUICK").as_deref() == Ok("1")
}

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
                    util::Status::Fail,
                    format!("PANIC: {}", util::panic_msg(&*p)),
                );
            }
        }
        Err(why) if std::env::var("KVLINK_REQUIRE_GPU").as_deref() == Ok("1") => {
            report.push(
                "tests",
                test.to_string(),
                util::Status::Fail,
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

fn device_args() -> device::Args {
    device::Args {
        quick: quick(),
        no_128k: true,
        out: None,
    }
}

fn tp_args() -> tp::Args {
    tp::Args {
        quick: quick(),
        threads: std::thread::available_parallelism().map_or(4, |n| n.get().min(16)),
        cpu: false,
    }
}

#[test]
fn kernels_staged_landing_failures_misuse_gather() {
    run("device", |_, r| device::checks::run(&device_args(), r));
}

#[test]
fn nccl_one_rank_and_two_gpus() {
    run("nccl", |n, r| {
        device::nccl_checks::run(&device_args(), n, r)
    });
}

#[test]
fn nccl_timeouts_abort() {
    run("nccl aborts", device::nccl_checks::run_aborts);
}

#[test]
fn linker_into_device_pools() {
    run("linker", |_, r| device::linker::run(&device_args(), r));
}

/// Every mode on device pools: ranks on one GPU (2, 4, 8), or one rank per GPU over NCCL.
#[test]
fn tp_dedup_on_device_pools() {
    run("tp", |n, r| {
        let fabrics: Vec<tp::setup::Fabric> = if n >= 2 {
            vec![tp::setup::Fabric::Nccl { tp: n }]
        } else {
            [2, 4, 8]
                .map(|ranks| tp::setup::Fabric::OneGpu { ranks })
                .to_vec()
        };
        for fabric in fabrics {
            tp::checks::run(&tp_args(), fabric, r);
        }
    });
}

#[test]
fn tp_one_nccl_rank_through_the_linker() {
    run("tp nccl-1", |_, r| tp::nccl_one::run(&tp_args(), r));
}
