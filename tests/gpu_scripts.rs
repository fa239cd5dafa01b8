//! The GPU scripts (and each part of gpu-mooncake-table.sh) clear what they write before they
//! run: a reused `$OUT` (a warm GPU machine, a fixed folder) must not show an earlier run's
//! table, with its "N passed, 0 failed", as the result of a run that was cut off or stopped
//! early. Runs without a GPU: with no binaries the
//! scripts stop at once (exit 2), after the clearing. With stub binaries, the scripts' exit
//! status and closing count say what the binaries did.

use std::path::Path;
use std::process::Command;

/// `bash` under coreutils' `timeout`: a script that hangs ends (exit 124, killed 5 s after)
/// instead of holding the test.
fn bounded_bash() -> Command {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", "120", "bash"]);
    c
}

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
    let status = bounded_bash()
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

/// `gpu-mooncake-table.sh` clears its part's earlier tables, and only its part's (the parts run
/// one after another into one folder). Run from a copy of `scripts/` with no Mooncake bundle
/// beside it: the part stops at once (its run finds no bundle), after the clearing.
#[test]
fn gpu_mooncake_table_clears_its_parts_earlier_tables_only() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp = std::env::temp_dir().join(format!("kvlink-mc-table-{}", std::process::id()));
    let (scripts, out) = (tmp.join("repo").join("scripts"), tmp.join("out"));
    std::fs::create_dir_all(&scripts).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    for entry in std::fs::read_dir(root.join("scripts")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "sh") {
            std::fs::copy(&path, scripts.join(path.file_name().unwrap())).unwrap();
        }
    }
    let host = "mooncake_modes_h200x1_host_32k_n1.md";
    let host_128k = "mooncake_modes_h200x1_host_128k_n1.md";
    let nodes = "mooncake_modes_h200x1_host_32k_n4.md";
    let device = "mooncake_modes_h200x1_gpu_32k_n1.md";
    let reads = "mooncake_read_h200x1_32k.md";
    let procs = "glm_prefill_procs_h200x1_tp8_32k_n1.md";
    let run = |part: &str, stale: &[&str]| -> Vec<&'static str> {
        for name in stale {
            std::fs::write(out.join(name), "9 passed, 0 failed\n").unwrap();
        }
        let got = bounded_bash()
            .arg(scripts.join("gpu-mooncake-table.sh"))
            .args(["--part", part])
            .env("OUT", &out)
            .output()
            .unwrap();
        assert_ne!(
            got.status.code(),
            Some(0),
            "{part}: ran with no bundle: {got:?}"
        );
        [host, host_128k, nodes, device, reads, procs]
            .into_iter()
            .filter(|n| out.join(n).exists())
            .collect()
    };
    let all = [host, host_128k, nodes, device, reads, procs];
    assert_eq!(run("host", &all), vec![nodes, device, reads, procs]);
    assert_eq!(
        run("reads", &all),
        vec![host, host_128k, nodes, device, procs]
    );
    assert_eq!(
        run("procs", &all),
        vec![host, host_128k, nodes, device, reads]
    );
    assert_eq!(
        run("device", &all),
        vec![host, host_128k, nodes, reads, procs]
    );
    assert_eq!(
        run("nodes", &all),
        vec![host, host_128k, device, reads, procs]
    );
    let _ = std::fs::remove_dir_all(&tmp);
}

/// Runs `script` with stub binaries (`name`, its bash body) and `env`; its exit status and the
/// last line of its output.
fn run_stubbed(script: &str, stubs: &[(&str, &str)], env: &[(&str, &str)]) -> (i32, String) {
    use std::os::unix::fs::PermissionsExt;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let tmp =
        std::env::temp_dir().join(format!("kvlink-gpu-stubs-{}-{script}", std::process::id()));
    let (bin, out) = (tmp.join("bin"), tmp.join("out"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(&out).unwrap();
    for (name, body) in stubs {
        let path = bin.join(name);
        std::fs::write(&path, format!("#!/usr/bin/env bash\n{body}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut cmd = bounded_bash();
    cmd.arg(root.join("scripts").join(script))
        .env("KVLINK_GPU_BIN", &bin)
        .env("OUT", &out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let got = cmd.output().unwrap();
    let _ = std::fs::remove_dir_all(&tmp);
    let stdout = String::from_utf8_lossy(&got.stdout);
    let last = stdout.lines().last().unwrap_or_default().to_string();
    (got.status.code().unwrap_or(-1), last)
}

/// A failed GPU test fails the run even when the benchmarks exit 2 (their "CUDA unavailable"):
/// before, the run exited 2, which reads as "skipped, no GPU".
#[test]
fn gpu_run_fails_on_a_failed_test_whatever_the_benchmarks_exit() {
    let (code, last) = run_stubbed(
        "gpu-run.sh",
        &[
            ("gpu_tests", "echo '0 passed, 1 failed'; exit 1"),
            ("gpu_check", "exit 2"),
        ],
        &[],
    );
    // The benchmarks' exit 2 with no row of theirs counts as one failure too.
    assert_eq!((code, last.as_str()), (1, "0 passed, 2 failed"));
}

/// A `tp_procs` stopped at its limit before its table still leaves a closing count, with the
/// stop counted as a failure: before, the output ended with the empty table.
#[test]
fn gpu_procs_run_counts_a_stopped_run_as_failed() {
    let (code, last) = run_stubbed(
        "gpu-procs-run.sh",
        &[
            ("tp_procs", "echo 'row 1 PASS' >&2; sleep 30"),
            ("glm_prefill", "exit 0"),
        ],
        &[("KVLINK_PROCS_TIMEOUT", "1")],
    );
    assert_eq!((code, last.as_str()), (124, "0 passed, 1 failed"));
}
