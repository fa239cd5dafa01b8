//! Parts 1 and 2 (see the program's docs): the prefix saved and served, the rank processes
//! started, their reports checked into the result table.

use std::time::{Duration, Instant};

use kvlink::kv_loader::ShareMode;
use kvlink::mooncake_linker::store::{ServeAt, StoreServer};

use crate::launch::{field, num, start, RankProc};
use crate::Args;
use kvlink_rig::measure::fmt_bytes;
use kvlink_rig::report::{Report, Status};
use kvlink_rig::tp::{save_prefix, MODES};

const SEC_ONE: &str = "1 process";
const SEC_GROUP: &str = "processes";

/// When the whole run must be done by (`--limit-s`): every wait ends by then at the latest,
/// so that a silent rank fails its row and the tables are still written before the script's
/// own limit stops the program.
static END: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();

/// Sets the run's end, `limit` from now (the first call only).
pub fn end_by(limit: Duration) {
    let _ = END.set(kvlink::kv_loader::deadline_after(limit));
}

/// `s` seconds from now, or the run's end if sooner.
pub(crate) fn deadline(s: u64) -> Instant {
    let d = kvlink::kv_loader::deadline_after(Duration::from_secs(s));
    END.get().map_or(d, |&end| d.min(end))
}

/// Parts 1 and 2.
pub fn run(args: &Args, gpus: u32, report: &mut Report) {
    let world = match (args.cpu, args.tp) {
        (true, 0) => 2,
        (_, 0) if gpus >= 2 => gpus,
        (_, t) => t,
    };
    let prefix = match save_prefix(world.max(1), args.pages, args.seed, args.threads) {
        Ok(p) => p,
        Err(e) => return report.push("setup", "save the prefix", Status::Fail, e),
    };
    let one_copy = prefix.bytes;
    let server = match StoreServer::start(prefix.store.clone(), ServeAt::Unix) {
        Ok(s) => s,
        Err(e) => return report.push("setup", "serve the store", Status::Fail, e.to_string()),
    };
    report.info(
        "setup",
        "prefix served to the rank processes",
        format!(
            "{} pages of GLM-5.2 FP8 ({} per copy) in an embedded store kept by this launcher, \
             served over a Unix socket at {}; saved in {:.1} s",
            args.pages,
            fmt_bytes(one_copy),
            server.location(),
            prefix.fill_s
        ),
    );
    let store_at = server.address().to_string();
    one_process(args, &store_at, one_copy, report);
    if world >= 2 && (args.cpu || world <= gpus) {
        group(args, world, &store_at, one_copy, report);
    } else {
        report.push(
            SEC_GROUP,
            "one rank process per GPU, NCCL, every mode, timeout → re-form",
            Status::Skip,
            format!("{gpus} GPU visible: give the same command 2 or more GPUs"),
        );
    }
}

/// The mode rows of one process's reports.
fn mode_rows(
    p: &mut RankProc,
    sec: &'static str,
    world: u32,
    one_copy: u64,
    reads: &mut [Vec<u64>],
    report: &mut Report,
) {
    for (i, mode) in MODES.into_iter().enumerate() {
        let r = p.rank;
        let name = format!("rank {r} of {world}: {mode:?} through the Linker, pool = saved bytes");
        let got = p.expect("mode ", deadline(180));
        report.check(sec, &name, || {
            let got = got?;
            if let Some(e) = field(&got, "failed") {
                return Err(e.to_string());
            }
            let want = if world > 1 { mode } else { ShareMode::AllRanks };
            let ran = field(&got, "ran").unwrap_or("?");
            if ran != format!("{want:?}") {
                return Err(format!("ran {ran}, expected {want:?}"));
            }
            let landed: u64 = num(&got, "landed")?;
            let verified: u64 = num(&got, "verified")?;
            if landed != one_copy || verified != one_copy {
                return Err(format!(
                    "landed {landed} B, compared {verified} B; one copy is {one_copy} B"
                ));
            }
            let read: u64 = num(&got, "read")?;
            reads[i].push(read);
            Ok(format!(
                "{} landed and compared; store read {}; {} host→device; {} ms",
                fmt_bytes(landed),
                fmt_bytes(read),
                fmt_bytes(num::<u64>(&got, "h2d")?),
                field(&got, "ms").unwrap_or("?")
            ))
        });
    }
}

/// Part 1: one rank process, NCCL through the whole path.
fn one_process(args: &Args, store_at: &str, one_copy: u64, report: &mut Report) {
    let mut procs = match start(args, 1, "one", store_at, &|_| Vec::new(), deadline(120)) {
        Ok(p) => p,
        Err(e) => return report.push(SEC_ONE, "start", Status::Fail, e),
    };
    let p = &mut procs[0];
    let formed = p.expect("formed ", deadline(120));
    report.check(
        SEC_ONE,
        "rank 0 of 1 formed its group at the rendezvous",
        || {
            let f = formed?;
            Ok(format!(
                "epoch {} ({}; NCCL ids from the rendezvous, data + control communicators)",
                field(&f, "epoch").unwrap_or("?"),
                if args.cpu { "DRY RUN: sockets" } else { "NCCL" }
            ))
        },
    );
    let mut reads = vec![Vec::new(); MODES.len()];
    mode_rows(p, SEC_ONE, 1, one_copy, &mut reads, report);
    if !args.cpu {
        for round in 0..2 {
            for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
                let got = p.expect("share ", deadline(120));
                let when = if round == 0 {
                    "first group"
                } else {
                    "re-formed group"
                };
                report.check(
                    SEC_ONE,
                    &format!("{mode:?} share step on the process's NCCL communicator ({when})"),
                    || {
                        let got = got?;
                        Ok(format!(
                            "epoch {}: {} layers, {} compared",
                            field(&got, "epoch").unwrap_or("?"),
                            field(&got, "layers").unwrap_or("?"),
                            fmt_bytes(num(&got, "compared")?)
                        ))
                    },
                );
            }
            if round == 0 {
                let got = p.expect("reform ", deadline(120));
                report.check(
                    SEC_ONE,
                    "abort (as after a timeout) → re-formed at the rendezvous: new epoch, new ids, new communicators",
                    || {
                        let got = got?;
                        let epoch: u64 = num(&got, "epoch")?;
                        if field(&got, "broken_before") != Some("true") || epoch < 2 {
                            return Err(got);
                        }
                        Ok(format!("epoch {epoch}, device memory: {}", field(&got, "device").unwrap_or("?")))
                    },
                );
            }
        }
    }
    let done = p
        .expect("done", deadline(60))
        .and_then(|_| p.succeeds(deadline(30)));
    report.check(SEC_ONE, "the rank process exits cleanly", || {
        done.map(|()| "exit 0".into())
    });
}

/// Part 2: one rank process per GPU.
/// How long the launcher stops the slow rank's process: past the collective deadline (6 s).
const STALL: Duration = Duration::from_secs(9);

/// Stops rank `slow`'s process (SIGSTOP) shortly after it says `stall-me` (it is then in its
/// slow read, mid-batch) for [`STALL`], then continues it, whatever happens in between.
fn stall(procs: &mut [RankProc], slow: u32, report: &mut Report) {
    let Some(p) = procs.iter_mut().find(|p| p.rank == slow) else {
        return;
    };
    if let Err(e) = p.expect("stall-me", deadline(60)) {
        return report.push(SEC_GROUP, "stall the slow rank", Status::Fail, e);
    }
    std::thread::sleep(Duration::from_millis(700));
    let pid = p.pid().to_string();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .is_ok_and(|s| s.success())
    };
    let stopped = signal("-STOP");
    std::thread::sleep(STALL);
    let continued = signal("-CONT");
    report.check(
        SEC_GROUP,
        &format!(
            "rank {slow}'s process stopped mid-batch for {} s",
            STALL.as_secs()
        ),
        || match (stopped, continued) {
            (true, true) => Ok(format!("SIGSTOP, {} s, SIGCONT", STALL.as_secs())),
            _ => Err(format!("kill -STOP: {stopped}, kill -CONT: {continued}")),
        },
    );
}

fn group(args: &Args, world: u32, store_at: &str, one_copy: u64, report: &mut Report) {
    let slow = world - 1;
    let extra = |_r: u32| vec!["--slow-rank".to_string(), slow.to_string()];
    let mut procs = match start(args, world, "group", store_at, &extra, deadline(120)) {
        Ok(p) => p,
        Err(e) => return report.push(SEC_GROUP, "start", Status::Fail, e),
    };
    for p in procs.iter_mut() {
        let f = p.expect("formed ", deadline(180));
        let r = p.rank;
        report.check(
            SEC_GROUP,
            &format!("rank {r} of {world} formed at the rendezvous"),
            || f.map(|f| format!("epoch {}", field(&f, "epoch").unwrap_or("?"))),
        );
    }
    let mut reads = vec![Vec::new(); MODES.len()];
    for p in procs.iter_mut() {
        mode_rows(p, SEC_GROUP, world, one_copy, &mut reads, report);
    }
    for (i, mode) in MODES.into_iter().enumerate() {
        let r = &reads[i];
        report.check(
            SEC_GROUP,
            &format!("{mode:?}: store bytes read per rank"),
            || {
                if r.len() != world as usize {
                    return Err(format!("only {} ranks reported", r.len()));
                }
                let total: u64 = r.iter().sum();
                let ok = match mode {
                    ShareMode::AllRanks => r.iter().all(|&b| b == one_copy),
                    ShareMode::Rank0Broadcast => r[0] == one_copy && r[1..].iter().all(|&b| b == 0),
                    // One copy in all, and each rank its share: pages split by count, so a
                    // rank's bytes are within one page's of an even share (a tolerance of half
                    // a share let 0.74 / 0.26 of one copy pass at TP 2).
                    ShareMode::SplitAllGather => {
                        let share = one_copy / u64::from(world);
                        let page = one_copy / args.pages.max(1) as u64;
                        total == one_copy && r.iter().all(|&b| b.abs_diff(share) <= page)
                    }
                };
                let per: Vec<String> = r.iter().map(|&b| fmt_bytes(b)).collect();
                if ok {
                    Ok(format!(
                        "{} (one copy: {})",
                        per.join(" / "),
                        fmt_bytes(one_copy)
                    ))
                } else {
                    Err(format!(
                        "{} (one copy: {})",
                        per.join(" / "),
                        fmt_bytes(one_copy)
                    ))
                }
            },
        );
    }
    stall(&mut procs, slow, report);
    let limit_ms = 2.0 * (6.0 + STALL.as_secs_f64() + 10.0) * 1e3;
    for p in procs.iter_mut() {
        let r = p.rank;
        let got = p.expect("slow ", deadline(120));
        report.check(
            SEC_GROUP,
            &format!("rank {slow} stalled past the deadline → rank {r} fails that batch in time"),
            || {
                let got = got?;
                let ms: f64 = num(&got, "failed_ms")?;
                if ms > limit_ms {
                    return Err(format!("after {ms:.0} ms: {got}"));
                }
                Ok(format!(
                    "after {ms:.0} ms, {} layers ready: {}",
                    field(&got, "ready").unwrap_or("?"),
                    field(&got, "err").unwrap_or("?")
                ))
            },
        );
    }
    for p in procs.iter_mut() {
        let r = p.rank;
        let got = p.expect("reformed ", deadline(150));
        report.check(
            SEC_GROUP,
            &format!(
                "rank {r}: the linker re-formed the group at the rendezvous, next batch verified"
            ),
            || {
                let got = got?;
                let epoch: u64 = num(&got, "epoch")?;
                let verified: u64 = num(&got, "verified")?;
                if epoch < 2 || verified != one_copy {
                    return Err(got);
                }
                Ok(format!(
                    "epoch {epoch} after {} tries, {} in {} ms, {} compared",
                    field(&got, "tries").unwrap_or("?"),
                    field(&got, "ran").unwrap_or("?"),
                    field(&got, "ms").unwrap_or("?"),
                    fmt_bytes(verified)
                ))
            },
        );
    }
    for p in procs.iter_mut() {
        let r = p.rank;
        let done = p
            .expect("done", deadline(60))
            .and_then(|_| p.succeeds(deadline(30)));
        report.check(SEC_GROUP, &format!("rank {r} exits cleanly"), || {
            done.map(|()| "exit 0".into())
        });
    }
}
