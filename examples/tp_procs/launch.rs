//! Rank processes of this program: started with their flags, their reports read from stdout
//! (lines that start with [`MARK`]) with deadlines, killed and reaped when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// What starts a report line of a rank process.
pub const MARK: &str = "TPPROCS|";

/// One rank process.
pub struct RankProc {
    pub rank: u32,
    child: Child,
    lines: mpsc::Receiver<String>,
    /// Every report seen so far.
    pub seen: Vec<String>,
}

impl RankProc {
    /// Starts this program with `flags`.
    pub fn spawn(rank: u32, flags: &[String]) -> Result<RankProc, String> {
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut child = kvlink_rig::child::end_with_parent(&mut Command::new(exe))
            .args(flags)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("starting rank {rank}: {e}"))?;
        let out = child.stdout.take().ok_or("a child without stdout")?;
        let (tx, lines) = mpsc::channel();
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
        Ok(RankProc {
            rank,
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// The process id (to stop and continue it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next report starting with `prefix` (the rest of it), or why none came by
    /// `deadline` (the process reported an error, exited, or was silent).
    pub fn expect(&mut self, prefix: &str, deadline: Instant) -> Result<String, String> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if let Some(rest) = line.strip_prefix(prefix) {
                        return Ok(rest.trim().to_string());
                    }
                    if let Some(e) = line.strip_prefix("error ") {
                        return Err(format!("rank {}: {e}", self.rank));
                    }
                }
                Err(_) => {
                    return Err(format!(
                        "rank {}: no report {prefix:?} in time (last: {:?})",
                        self.rank,
                        self.seen.last()
                    ))
                }
            }
        }
    }

    /// Waits for a clean exit by `deadline`.
    pub fn succeeds(&mut self, deadline: Instant) -> Result<(), String> {
        loop {
            if let Some(s) = self.child.try_wait().map_err(|e| e.to_string())? {
                return if s.success() {
                    Ok(())
                } else {
                    Err(format!("rank {} exited with {s}", self.rank))
                };
            }
            if Instant::now() >= deadline {
                return Err(format!("rank {} still running", self.rank));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value of `key` in a report `k=v k=v`.
pub fn field<'a>(report: &'a str, key: &str) -> Option<&'a str> {
    report
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
}

/// `key` of `report` parsed.
pub fn num<T: std::str::FromStr>(report: &str, key: &str) -> Result<T, String> {
    field(report, key)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| format!("report {report:?} has no number {key}"))
}

/// Starts `world` rank processes for `case`: rank 0 first on a port the system picks, the
/// others at the address it reports. `extra(rank)` adds flags.
pub fn start(
    args: &crate::Args,
    world: u32,
    case: &str,
    store_at: &str,
    extra: &dyn Fn(u32) -> Vec<String>,
    deadline: Instant,
) -> Result<Vec<RankProc>, String> {
    let flags = |rank: u32, meet: &str| {
        let mut f: Vec<String> = vec![
            "--rank".into(),
            rank.to_string(),
            "--world".into(),
            world.to_string(),
            "--rendezvous".into(),
            meet.into(),
            "--store-at".into(),
            store_at.into(),
            "--gpu".into(),
            rank.to_string(),
            "--case".into(),
            case.into(),
            "--pages".into(),
            args.pages.to_string(),
            "--seed".into(),
            args.seed.to_string(),
        ];
        if args.cpu {
            f.push("--cpu".into());
        }
        f.extend(extra(rank));
        f
    };
    let mut r0 = RankProc::spawn(0, &flags(0, "127.0.0.1:0"))?;
    let meet = r0.expect("addr ", deadline)?;
    let mut procs = vec![r0];
    for r in 1..world {
        procs.push(RankProc::spawn(r, &flags(r, &meet))?);
    }
    Ok(procs)
}
