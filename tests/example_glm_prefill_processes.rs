//! The `glm_prefill` example with its TP ranks as processes, run small: its own code (the
//! modules under `examples/glm_prefill/`, compiled into this test), with this test binary as
//! the rank processes (a child runs only `rank_process`, with the example's flags in
//! [`ARGS_VAR`]).
//! - Launched: `--ranks-as processes --tp 3 --mode compare` runs every mode on three rank
//!   processes (the launcher serves the embedded store) and every pool verifies.
//! - Started by hand: two processes with the same `--rendezvous` and no other flags (the
//!   example's defaults: 8,192 tokens, rank 0 serving its embedded store through the
//!   rendezvous) load and verify.
//! - With a Mooncake master in the environment, the launched shape over Mooncake.
//!
//! Every process started here is killed when its handle drops (also when a test fails).
#![cfg(target_os = "linux")]

// The example's own modules, and `report`.
include!("glm_prefill_example/harness.rs");

use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A child's flags, separated by `\x1f`.
const ARGS_VAR: &str = "KVLINK_GLM_PREFILL_ARGS";
/// No child outlives this (it exits by itself, in case the test vanished first).
const CHILD_LIFETIME: Duration = Duration::from_secs(300);

/// In a child: runs the example with the flags given; a failure fails the process.
#[test]
#[ignore = "a rank process's entry: its parent test runs it with --ignored"]
fn rank_process() {
    let Ok(flags) = std::env::var(ARGS_VAR) else {
        return;
    };
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIFETIME);
        std::process::exit(9);
    });
    let args = args::parse(flags.split('\u{1f}'))
        .expect("flags")
        .expect("not --help");
    let mut out = std::io::stdout();
    app::run(&args, &mut out).expect("the rank process");
    out.flush().unwrap();
}

fn command(flags: &[String]) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("test binary"));
    c.args([
        "--exact",
        "rank_process",
        "--ignored",
        "--nocapture",
        "--test-threads=1",
        "-q",
    ])
    .env(ARGS_VAR, flags.join("\u{1f}"))
    .stdin(Stdio::null())
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    c
}

fn svg_path(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "kvlink_glm_prefill_procs_{name}_{}.svg",
        std::process::id()
    ))
}

/// Runs the launcher with `flags` (its rank processes are this test binary); its report.
fn launch(flags: &[&str]) -> Result<String, String> {
    let spawn = |f: &[String]| command(f).spawn();
    report(flags, |args, out| app::processes::launch(args, out, &spawn))
}

#[test]
fn ranks_as_processes_run_every_mode_and_every_pool_verifies() {
    let svg = svg_path("compare");
    let out = launch(&[
        "--ranks-as",
        "processes",
        "--tp",
        "3",
        "--tokens",
        "300",
        "--compute-us",
        "50",
        "--mode",
        "compare",
        "--svg",
        svg.to_str().unwrap(),
    ])
    .unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(out.contains("TP ranks: 3 PROCESSES"), "{out}");
    // A warm-up batch for each fixed mode (three), none for Auto (it calibrates).
    assert_eq!(
        out.matches("warm-up batch 1 of 1 (not reported below)")
            .count(),
        3,
        "{out}"
    );
    assert!(
        out.contains("the launcher keeps the embedded store and serves it"),
        "{out}"
    );
    assert_eq!(
        out.matches("verified: 3 ranks × 4 pages byte-identical")
            .count(),
        4,
        "every mode, every pool: {out}"
    );
    // Sharing modes read one copy in total, AllRanks three (Auto: whichever it picked).
    let copies = |n: &str| {
        out.matches(&format!("= {n} × one copy of the prefix"))
            .count()
    };
    assert_eq!(copies("3.00") + copies("1.00"), 4, "{out}");
    assert!(copies("3.00") >= 1 && copies("1.00") >= 2, "{out}");
    for mode in [
        "| AllRanks ",
        "| Rank0Broadcast ",
        "| SplitAllGather ",
        "| Auto → ",
    ] {
        assert!(out.contains(mode), "no row {mode}: {out}");
    }
    // Auto measured until it decided (rank 0's word ends the calibration on every rank), and
    // the measured load ran the mode it keeps.
    let auto = out
        .lines()
        .find(|l| l.contains("Auto chose "))
        .unwrap_or_else(|| panic!("no Auto line: {out}"));
    let chose = auto
        .split("Auto chose ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .unwrap_or_default();
    assert!(auto.contains(&format!("Auto keeps {chose}:")), "{auto}");
    assert!(auto.contains(" ms/GB ("), "{auto}");
    assert!(!out.contains("FAILED"), "{out}");
    for r in 0..3 {
        assert!(
            out.contains(&format!("  rank {r}: exit status: 0")),
            "{out}"
        );
    }
    // The other ranks' own checks, relayed.
    assert!(out.contains("[rank 2]"), "{out}");
}

/// A rank process started by hand, its stdout collected; killed on drop.
struct Started {
    child: Child,
    out: std::sync::mpsc::Receiver<String>,
}

impl Started {
    fn new(flags: &[&str]) -> Started {
        let flags: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        let mut child = command(&flags).spawn().expect("a rank process");
        let mut stdout = child.stdout.take().expect("stdout");
        let (tx, out) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stdout.read_to_string(&mut s);
            let _ = tx.send(s);
        });
        Started { child, out }
    }

    /// Its whole stdout and whether it exited 0, within `limit`.
    fn finish(&mut self, limit: Duration) -> (String, bool) {
        let deadline = kvlink::kv_loader::deadline_after(limit);
        let text = self
            .out
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("the rank process ran past its limit");
        loop {
            if let Some(s) = self.child.try_wait().expect("waiting") {
                return (text, s.success());
            }
            assert!(Instant::now() < deadline, "still running: {text}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Started {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

#[test]
fn two_rank_processes_started_by_hand_with_one_rendezvous_load_and_verify() {
    let at = format!("127.0.0.1:{}", free_port());
    // The example's defaults otherwise (its default prefix length), one mode; only the picture
    // goes to a temporary file instead of target/.
    let svg = svg_path("by_hand");
    let svg = svg.to_str().unwrap();
    let rank = |r: &'static str, extra: &[&str]| {
        let mut flags = vec!["--rank", r, "--world", "2", "--rendezvous", &at];
        flags.extend(["--mode", "all-ranks"]);
        flags.extend(extra);
        Started::new(&flags)
    };
    let mut r0 = rank("0", &["--svg", svg]);
    let mut r1 = rank("1", &[]);
    let pages = args::DEFAULT_TOKENS / 64;
    let limit = Duration::from_secs(240);
    let (out0, ok0) = r0.finish(limit);
    let (out1, ok1) = r1.finish(limit);
    let _ = std::fs::remove_file(svg);
    assert!(ok0 && ok1, "rank 0:\n{out0}\nrank 1:\n{out1}");
    assert!(
        out0.contains(&format!("verified: 2 ranks × {pages} pages byte-identical")),
        "{out0}"
    );
    assert!(
        out0.contains("rank 0 keeps the embedded store and serves it"),
        "{out0}"
    );
    // The served store's address is printed without its key.
    assert!(
        out0.contains("at unix:@") && !out0.contains("#key="),
        "{out0}"
    );
    // Counted after the save: every page's two components, each with its checksum companion.
    assert!(
        out0.contains(&format!("embedded store now holds {} objects", 4 * pages)),
        "{out0}"
    );
    assert!(
        out1.contains(&format!(
            "verified: {pages} pages byte-identical to the saved bytes"
        )),
        "{out1}"
    );
}

#[test]
fn ranks_as_processes_over_mooncake_when_the_environment_has_one() {
    let have = std::env::var("MOONCAKE_MASTER").is_ok_and(|m| !m.is_empty());
    if !have {
        assert!(
            std::env::var("KVLINK_REQUIRE_MOONCAKE").as_deref() != Ok("1"),
            "KVLINK_REQUIRE_MOONCAKE=1 but MOONCAKE_MASTER is not set"
        );
        return;
    }
    let svg = svg_path("mooncake");
    let out = launch(&[
        "--ranks-as",
        "processes",
        "--store",
        "mooncake",
        "--tp",
        "2",
        "--tokens",
        "128",
        "--compute-us",
        "0",
        "--mode",
        "split-all-gather",
        "--svg",
        svg.to_str().unwrap(),
    ])
    .unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(
        out.contains("verified: 2 ranks × 2 pages byte-identical"),
        "{out}"
    );
    assert!(out.contains("store: mooncake ("), "{out}");
}

#[test]
fn process_flags_are_checked() {
    let parse = |f: &[&str]| args::parse(f.iter().copied()).map(|a| a.expect("not --help"));
    for bad in [
        &["--ranks-as", "fibers"][..],
        &["--rank", "0"],
        &["--rank", "2", "--world", "2", "--rendezvous", "h:1"],
        &["--rank", "0", "--world", "0", "--rendezvous", "h:1"],
        &["--store-at", "unix:@x"],
    ] {
        assert!(parse(bad).is_err(), "{bad:?}");
    }
    let a = parse(&[
        "--tokens",
        "640",
        "--rank",
        "1",
        "--world=3",
        "--rendezvous",
        "h:1",
        "--tp",
        "5",
    ])
    .unwrap();
    assert_eq!(a.tp, 3, "--world replaces --tp");
    assert_eq!(a.procs.ranks_as, args::RanksAs::Processes);
    // What a launcher passes on: everything but the flags of how ranks run.
    assert_eq!(a.procs.argv, vec!["--tokens", "640"]);
    assert!(args::help().contains("--ranks-as"));
}
