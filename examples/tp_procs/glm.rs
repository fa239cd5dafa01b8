//! Part 3: `glm_prefill --mode compare` with TP ranks as threads and as processes on this
//! host (host pools, embedded store), one after the other; both must verify every pool.
//! The whole outputs go to `$OUT`; the table gets each mode's time to the last layer.

use std::io::Read;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::Args;
use kvlink_rig::report::{Report, Status};

const SEC: &str = "glm_prefill";

/// How long one `glm_prefill` run may take before it is killed (the GPU script gives the
/// whole of `tp_procs` 290 s).
const RUN_LIMIT: Duration = Duration::from_secs(120);

/// Runs `cmd` to its end with its output captured, or kills it, with every process it started
/// (its process group: glm_prefill's rank processes), after `limit`: the output up to then,
/// with the kill's status and a line saying so on stderr.
fn output_within(cmd: &mut Command, limit: Duration) -> std::io::Result<Output> {
    use std::os::unix::process::CommandExt;
    // Its own process group (killed as one at the limit), ending with this process too:
    // `timeout` signals only its own group.
    let mut child = kvlink_rig::child::end_with_parent(cmd)
        .process_group(0)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_end(&mut bytes);
            }
            bytes
        })
    };
    let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
    let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
    let deadline = Instant::now() + limit;
    let mut killed = false;
    // The whole group: the rank processes hold the pipes too.
    let kill_group = |child: &mut std::process::Child| {
        let group = format!("-{}", child.id());
        let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
        let _ = child.kill();
    };
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) => {}
            Err(e) => {
                // Not left running when its wait cannot be asked.
                kill_group(&mut child);
                let _ = child.wait();
                return Err(e);
            }
        }
        if Instant::now() >= deadline {
            kill_group(&mut child);
            killed = true;
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = stderr.join().unwrap_or_default();
    if killed {
        stderr.extend_from_slice(
            format!(
                "tp_procs: killed with its processes after {} s\n",
                limit.as_secs()
            )
            .as_bytes(),
        );
    }
    Ok(Output {
        status,
        stdout: stdout.join().unwrap_or_default(),
        stderr,
    })
}

/// `| 32,768 | AllRanks | store | 123.4 ms | ...` → ("AllRanks", "123.4 ms", store bytes).
fn compare_rows(out: &str) -> Vec<(String, String, String)> {
    out.lines()
        .filter(|l| l.starts_with('|'))
        .filter_map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            let first = cells.first()?;
            (cells.len() >= 7 && first.chars().next()?.is_ascii_digit()).then(|| {
                (
                    cells[1].to_string(),
                    cells[3].to_string(),
                    cells[6].to_string(),
                )
            })
        })
        .collect()
}

/// Part 3.
pub fn run(args: &Args, report: &mut Report) {
    let tokens = args.glm_tokens.to_string();
    let tp = args.glm_tp.to_string();
    for shape in ["threads", "processes"] {
        let name = format!(
            "TP {tp}, {tokens} tokens, ranks as {shape}: --mode compare, every pool verified"
        );
        let t = Instant::now();
        let mut glm = Command::new(&args.glm_bin);
        glm.args([
            "--mode",
            "compare",
            "--tp",
            &tp,
            "--tokens",
            &tokens,
            "--ranks-as",
            shape,
        ]);
        // The chart goes with the results; without a results folder, none is drawn (a
        // fixed file in /tmp was left behind, and overwritten by a concurrent run).
        if let Some(d) = &args.out {
            glm.arg("--svg")
                .arg(d.join(format!("glm_prefill_{shape}.svg")));
        }
        let left =
            super::cases::deadline(RUN_LIMIT.as_secs()).saturating_duration_since(Instant::now());
        if left.is_zero() {
            report.push(
                SEC,
                name,
                Status::Fail,
                "not run: the run's --limit-s has passed",
            );
            continue;
        }
        let run = output_within(&mut glm, left);
        let out = match run {
            Ok(o) => o,
            Err(e) => {
                report.push(SEC, name, Status::Fail, format!("{}: {e}", args.glm_bin));
                continue;
            }
        };
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        if let Some(dir) = &args.out {
            let _ = std::fs::write(dir.join(format!("glm_prefill_{shape}.txt")), &text);
        }
        let verified = text.matches(" ranks × ").count();
        let ok = out.status.success() && verified >= 4;
        let rows = compare_rows(&text);
        let summary: Vec<String> = rows
            .iter()
            .map(|(m, last, _)| format!("{m} {last}"))
            .collect();
        report.push(
            SEC,
            name,
            if ok { Status::Pass } else { Status::Fail },
            if ok {
                format!(
                    "{} modes verified in {:.1} s; last layer ready: {}",
                    verified,
                    t.elapsed().as_secs_f64(),
                    summary.join(", ")
                )
            } else {
                format!(
                    "{}; {verified} verified; stderr: {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                        .lines()
                        .last()
                        .unwrap_or("")
                )
            },
        );
    }
}
