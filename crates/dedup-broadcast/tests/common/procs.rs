//! Ranks as real processes under `cargo test`: the test binary spawns itself, running only
//! the test named [`ENTRY`] with a role in [`ROLE_VAR`]. A child reports on stdout with lines
//! that start with [`MARK`]; the parent reads them with deadlines. Every child is killed
//! and reaped when its handle drops (also when a test panics). A child is killed when the
//! thread that spawned it ends (`PR_SET_PDEATHSIG`: also when the test binary is killed, by
//! a signal or a time limit, without running any drop), and exits by itself after
//! [`CHILD_LIFETIME`] in any case.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The environment variable that carries a child's role.
pub const ROLE_VAR: &str = "KVLINK_TEST_ROLE";
/// The test function every child runs (`#[ignore]`d: a normal run skips it; children run it
/// with `--ignored`).
pub const ENTRY: &str = "rank_process";
/// What starts a report line.
pub const MARK: &str = "KVLINK|";
/// A child never outlives this.
pub const CHILD_LIFETIME: Duration = Duration::from_secs(120);

/// The role of this process, when it is a child.
pub fn role() -> Option<HashMap<String, String>> {
    let spec = std::env::var(ROLE_VAR).ok()?;
    std::thread::spawn(|| {
        std::thread::sleep(CHILD_LIFETIME);
        std::process::exit(9);
    });
    Some(
        spec.split(',')
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// A child reports `line` (prefixed with [`MARK`]).
pub fn report(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{MARK}{line}");
    let _ = out.flush();
}

/// A rank process, killed and reaped when dropped.
pub struct RankProc {
    pub name: String,
    child: Child,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl RankProc {
    /// Starts this test binary as a child with `role` (`k=v,k=v`).
    pub fn spawn(name: &str, role: &str) -> RankProc {
        let exe = std::env::current_exe().expect("test binary path");
        let mut cmd = Command::new(exe);
        let mut child = end_with_parent(&mut cmd)
            .args([
                "--exact",
                ENTRY,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
                "-q",
            ])
            .env(ROLE_VAR, role)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning a rank process");
        let out = child.stdout.take().expect("child stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if let Some(rest) = line.strip_prefix(MARK) {
                    if tx.send(rest.to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        RankProc {
            name: name.to_string(),
            child,
            lines: rx,
            seen: Vec::new(),
        }
    }

    /// The OS process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next report that starts with `prefix` (earlier ones are kept in `seen`); panics
    /// after `timeout`.
    pub fn expect(&mut self, prefix: &str, timeout: Duration) -> String {
        let deadline = kv_loader::deadline_after(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return rest.trim().to_string();
                    }
                }
                Err(_) => panic!(
                    "{}: no report {prefix:?} within {timeout:?}; saw {:?}",
                    self.name, self.seen
                ),
            }
        }
    }

    /// `kill -9`.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits for the process to exit by itself; panics after `timeout` (it is then killed on
    /// drop).
    pub fn exit_status(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = kv_loader::deadline_after(timeout);
        loop {
            if let Some(s) = self.child.try_wait().expect("waiting for a child") {
                return s;
            }
            if Instant::now() >= deadline {
                panic!(
                    "{}: still running after {timeout:?}; saw {:?}",
                    self.name, self.seen
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for a clean exit.
    pub fn succeeds(&mut self, timeout: Duration) {
        let s = self.exit_status(timeout);
        assert!(
            s.success(),
            "{} exited with {s}; saw {:?}",
            self.name,
            self.seen
        );
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// kvlink-rig's (this crate's tests cannot depend on it: it depends on this crate).
#[path = "../../../kvlink-rig/src/child/end_with_parent.rs"]
mod end_with_parent;
use end_with_parent::end_with_parent;

/// A `key=value` of a role, parsed.
pub fn arg<T: std::str::FromStr>(role: &HashMap<String, String>, key: &str) -> T {
    role.get(key)
        .unwrap_or_else(|| panic!("role without {key}"))
        .parse()
        .unwrap_or_else(|_| panic!("role: bad {key}"))
}

/// The value of `key` in a report of the form `k=v k=v`.
pub fn field<'a>(report: &'a str, key: &str) -> &'a str {
    report
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("report {report:?} has no {key}"))
}

/// A rank of a world of 3 claimed twice over TCP: rank 0 (`role(0, "")` reports its `addr `),
/// the first claim of rank 1, and once it has reached rank 0 (`settle`), the second, then rank
/// 2 (`role(rank, meeting point)` for each). The earlier claim alone must be refused with
/// `DuplicateRank`, and the others form one group (each reports `formed epoch=..`).
pub fn earlier_claim_refused_alone(role: &dyn Fn(u32, &str) -> String, settle: Duration) {
    let wait = Duration::from_secs(60);
    let mut leader = RankProc::spawn("rank 0", &role(0, ""));
    let meet = leader.expect("addr ", wait);
    let mut earlier = RankProc::spawn("rank 1, first", &role(1, &meet));
    earlier.expect("joining", wait);
    leader.expect("joining", wait);
    // The first claim has reached rank 0 before the second is made.
    std::thread::sleep(settle);
    let mut second = RankProc::spawn("rank 1, second", &role(1, &meet));
    second.expect("joining", wait);
    // The second claim has reached rank 0 before the group can be complete.
    std::thread::sleep(settle);
    let mut procs = [leader, second, RankProc::spawn("rank 2", &role(2, &meet))];
    let got = earlier.expect("refused ", wait);
    assert_eq!(field(&got, "kind"), "DuplicateRank", "{got}");
    earlier.succeeds(wait);
    let epochs: Vec<String> = procs
        .iter_mut()
        .map(|p| field(&p.expect("formed ", wait), "epoch").to_string())
        .collect();
    assert!(epochs.iter().all(|e| *e == epochs[0]), "{epochs:?}");
    for p in procs.iter_mut() {
        p.succeeds(wait);
    }
}
