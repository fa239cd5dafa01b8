//! The GPU scripts clear what they write before they run: a reused `$OUT` (a warm GPU machine,
//! a fixed folder) must not show an earlier run's table, with its "N passed, 0 failed", as the
//! result of a run that was cut off or stopped early. Runs without a GPU: with no binaries the
//! scripts stop at once (exit 2), after the clearing.

use std::path::Path;
use std::process::Command;

/// Runs `script` with an empty binaries folder and `OUT` holding `stale` files; the files
/// still there afterwards.
fn left_after(script: &str, stale: &[&str]) -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = std::env::temp_dir().join(format!(
        "kvlink-gpu-scripts-{}-{script}",
        std::process::id()
    ));
    let (bin, out) = (tmp.join("bin"), tmp.join("out"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    for name in stale {
        std::fs::write(out.join(name), "9 passed, 0 failed\n").unwrap();
    }
    let status = Command::new("bash")
        .arg(root.join("scripts").join(script))
        .env("KVLINK_GPU_BIN", &bin)
        .env("OUT", &out)
        .output()
        .unwrap();
    assert_eq!(status.status.code(), Some(2), "{script}: {status:?}");
    let left = stale
        .iter()
        .filter(|n| out.join(n).exists())
        .map(|n| n.to_string())
        .collect();
    let _ = std::fs::remove_dir_all(&tmp);
    left
}

#[test]
fn gpu_run_clears_its_earlier_outputs() {
    let stale = [
        "gpu_check_table.txt",
        "gpu_result.txt",
        "timeline_32k.csv",
        "timeline_128k.svg",
        "gpu_tests.stdout.log",
        "env.txt",
    ];
    assert_eq!(left_after("gpu-run.sh", &stale), Vec::<String>::new());
}

#[test]
fn gpu_tp_run_clears_its_earlier_outputs() {
    let stale = [
        "tp_gpu_bench_tp8.md",
        "tp_gpu_h100x1_ranks8.txt",
        "timelines_tp8.tar",
        "tp_result.txt",
        "tp_gpu.stdout.log",
        "gpu_tests_tp.stdout.log",
    ];
    assert_eq!(left_after("gpu-tp-run.sh", &stale), Vec::<String>::new());
}

#[test]
fn gpu_procs_run_clears_its_earlier_outputs() {
    let stale = [
        "tp_procs.txt",
        "glm_prefill_processes.txt",
        "tp_procs.stdout.log",
        "env_procs.txt",
    ];
    assert_eq!(left_after("gpu-procs-run.sh", &stale), Vec::<String>::new());
}
