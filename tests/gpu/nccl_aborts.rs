//! NCCL failures end by their deadlines: an initialisation with a rank that never joins times
//! out, and on two GPUs a rank that never issues makes its peer time out and abort, and the
//! late rank end by its own bound instead of hang; and an abort from another thread ends an
//! operation already in flight (a peer that never issues) at once, not at that operation's
//! deadline.
//!
//! Not checked on one GPU: holding the comm stream behind a gate (`cuStreamWaitValue32`)
//! leaves an NCCL kernel queued behind it, which `ncclCommAbort` may free resources under. A
//! device command that ran the checks with such a test (2026-12-04) reached its 600 s limit
//! with nothing back, so it was taken out. A peer that never issues is what the abort is
//! for, and needs two GPUs.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{nccl_unique_id, NcclCollective, NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::{Collective, CollectiveError};
use kvlink_rig::report::{Report, Status};

const SEC: &str = "nccl";

fn ce(e: CollectiveError) -> String {
    e.to_string()
}

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

/// The checks that abort communicators: a test of their own (the gpu target runs its tests
/// one at a time, `--test-threads=1`), so an abort cannot disturb another test's
/// communicators.
pub fn run_aborts(gpus: u32, report: &mut Report) {
    report.check(
        SEC,
        "init with a rank that never joins: Timeout, no hang",
        init_timeout,
    );
    report.check(
        SEC,
        "init with a rank that never joins, caller's deadline before init_timeout: Timeout by it",
        init_by_deadline,
    );
    #[cfg(feature = "failpoints")]
    report.check(
        SEC,
        "1 rank: the comm thread panics under an operation: the call fails at once, the communicator aborted, no work left",
        comm_thread_panics,
    );
    #[cfg(feature = "failpoints")]
    report.check(
        SEC,
        "1 rank: the comm thread goes silent under an operation: its host buffer is left to it and counted kept for good, work may be left",
        silent_comm_thread_keeps_its_buffer_counted,
    );
    #[cfg(feature = "failpoints")]
    report.check(
        SEC,
        "rank 0 of 2 cannot allocate its scratch: it never joins, its error at once",
        buffers_fail_before_join,
    );
    #[cfg(not(feature = "failpoints"))]
    report.push(
        SEC,
        "rank 0 of 2 cannot allocate its scratch",
        Status::Skip,
        "built without feature `failpoints`".to_string(),
    );
    #[cfg(not(feature = "failpoints"))]
    report.push(
        SEC,
        "1 rank: the comm thread panics under an operation",
        Status::Skip,
        "built without feature `failpoints`".to_string(),
    );
    if gpus >= 2 {
        report.check(
            SEC,
            "2 ranks: rank 1 never issues: Timeout then Aborted",
            two_ranks_timeout,
        );
        report.check(
            SEC,
            "2 ranks: rank 1 never issues, rank 0 aborted from another thread: Aborted at once",
            two_ranks_abort_in_flight,
        );
    } else {
        report.push(
            SEC,
            "2 ranks: a rank that never issues",
            Status::Skip,
            format!("{gpus} GPU visible; needs 2"),
        );
    }
}

/// A defect under an operation (a panic on the comm thread, injected through the failpoint
/// "nccl-comm-op"): the comm thread aborts its communicator, then answers the call at once
/// ("panicked during", not at its deadline), so the handle's `broken` names the panic by the
/// time the call returns; the next call fails at once; the handle drops at once (its thread
/// still serves, and is joined).
#[cfg(feature = "failpoints")]
fn comm_thread_panics() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process_with(&[0], short_grace()).map_err(ce)?;
    let warm = ranks[0].all_gather_u64(1, soon()).map_err(ce)?;
    fail::cfg("nccl-comm-op", "1*panic(test: injected defect)").map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let r = ranks[0].all_gather_u64(2, soon());
    let took = t0.elapsed();
    fail::remove("nccl-comm-op");
    let failed = match r {
        Err(e @ CollectiveError::Backend(_)) if e.to_string().contains("panicked during") => e,
        other => {
            return Err(format!(
                "expected Backend \"panicked during\", got {other:?}"
            ))
        }
    };
    if took > Duration::from_secs(5) {
        return Err(format!("the call ended after {took:?} (deadline 30 s)"));
    }
    let broken = ranks[0].broken().unwrap_or_default();
    if !broken.contains("panicked") {
        return Err(format!(
            "the communicator was not aborted by the panic: broken = {broken:?}"
        ));
    }
    // The abort drained the comm stream before the reply: no work of the handle is left on
    // the device, so a staging buffer a device operation failed on is not lost for good.
    if ranks[0].may_leave_work(&failed) {
        return Err("broken with its abort drained, yet may_leave_work answers true".into());
    }
    match ranks[0].all_gather_u64(3, soon()) {
        Err(CollectiveError::Aborted { .. }) => {}
        other => return Err(format!("the next call: expected Aborted, got {other:?}")),
    }
    let t1 = Instant::now();
    drop(ranks);
    let dropped = t1.elapsed();
    if dropped > Duration::from_secs(1) {
        return Err(format!("the handle took {dropped:?} to drop"));
    }
    Ok(format!(
        "warm-up gathered {warm:?}; then {failed} after {:.3} s; broken: {broken}; dropped in {:.3} s",
        took.as_secs_f64(),
        dropped.as_secs_f64()
    ))
}

/// A comm thread that goes silent under an operation (a sleep injected through the failpoint
/// "nccl-comm-op", past the call's deadline and its reply slack): the call fails unanswered,
/// its host buffer is left to the thread (the thread may still write it), and that buffer is
/// counted kept for good, process-wide (`memory_kept`, which a linker's `kept_for_good`
/// includes). Before, only the handle counted it, and a re-formed group dropped that count.
#[cfg(feature = "failpoints")]
fn silent_comm_thread_keeps_its_buffer_counted() -> Result<String, String> {
    use kvlink::dedup_broadcast::memory_kept;
    let ranks = NcclGroup::new_in_process_with(&[0], short_grace()).map_err(ce)?;
    ranks[0].all_gather_u64(1, soon()).map_err(ce)?;
    let before = memory_kept();
    fail::cfg("nccl-comm-op", "1*sleep(8000)").map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let r = ranks[0].all_gather_bytes(
        &[7u8; 4096],
        kvlink::kv_loader::deadline_after(Duration::from_millis(300)),
    );
    let took = t0.elapsed();
    fail::remove("nccl-comm-op");
    let leaked = ranks[0].leaked_host_bytes();
    let after = memory_kept();
    let Err(e) = r else {
        return Err("the call succeeded with its comm thread asleep".into());
    };
    // Unanswered: the comm thread has not aborted, so its work's end is unknown.
    if !ranks[0].may_leave_work(&e) {
        return Err(format!("{e} unanswered, yet may_leave_work answers false"));
    }
    if leaked == 0 {
        return Err(format!(
            "no buffer left to the silent thread: {e} after {took:?}"
        ));
    }
    if after.times <= before.times || after.bytes < before.bytes + leaked {
        return Err(format!(
            "{leaked} B left to the thread, but memory_kept went {before:?} → {after:?}"
        ));
    }
    drop(ranks);
    Ok(format!(
        "{e} after {:.1} s; {leaked} B left to the comm thread; memory_kept {before:?} → {after:?}",
        took.as_secs_f64()
    ))
}

/// A rank whose scratch cannot be allocated (injected through the failpoint "nccl-buffers")
/// fails before it joins its communicator, so it never joins: its peers' initialisation fails
/// at their deadline, as for any rank that never came, and no rank's join answers `Ok` for a
/// group one rank cannot serve. Here rank 0 of 2 joins alone: it answers the allocation
/// error at once. Allocating after the join, it would wait its 20 s `init_timeout` for rank 1
/// and answer `Timeout`.
#[cfg(feature = "failpoints")]
fn buffers_fail_before_join() -> Result<String, String> {
    let id = nccl_unique_id().map_err(ce)?;
    let cfg = NcclConfig {
        init_timeout: Duration::from_secs(20),
        ..NcclConfig::default()
    };
    fail::cfg("nccl-buffers", "1*return(test)").map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let r = NcclCollective::join(id, 0, 2, 0, cfg);
    let took = t0.elapsed();
    fail::remove("nccl-buffers");
    match r {
        Err(e @ CollectiveError::Backend(_))
            if e.to_string().contains("injected") && took < Duration::from_secs(5) =>
        {
            Ok(format!("{e} after {:.3} s", took.as_secs_f64()))
        }
        Err(e) => Err(format!(
            "expected the injected Backend error at once, got {e} after {took:?}"
        )),
        Ok(_) => Err("the join answered Ok with its scratch not allocated".into()),
    }
}

fn init_timeout() -> Result<String, String> {
    let id = nccl_unique_id().map_err(ce)?;
    let cfg = NcclConfig {
        init_timeout: Duration::from_secs(3),
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let t0 = Instant::now();
    let r = NcclCollective::join(id, 0, 2, 0, cfg);
    let took = t0.elapsed();
    match r {
        Err(CollectiveError::Timeout { .. }) if took < Duration::from_secs(20) => Ok(format!(
            "Timeout after {:.1} s (limit 3 s + abort)",
            took.as_secs_f64()
        )),
        Err(e) => Err(format!("expected Timeout, got {e} after {took:?}")),
        Ok(_) => Err("a group of 2 with one rank formed".into()),
    }
}

/// A re-formation's deadline bounds the join, not only `init_timeout` (60 s here).
fn init_by_deadline() -> Result<String, String> {
    let id = nccl_unique_id().map_err(ce)?;
    let cfg = NcclConfig {
        init_timeout: Duration::from_secs(60),
        abort_grace: Duration::from_secs(2),
        ..NcclConfig::default()
    };
    let t0 = Instant::now();
    let deadline = kvlink::kv_loader::deadline_after(Duration::from_secs(2));
    let r = NcclCollective::join_by((id, 0, 2), 0, cfg, deadline);
    let took = t0.elapsed();
    match r {
        // The deadline plus the reply's slack (twice the grace) at most.
        Err(CollectiveError::Timeout { .. }) if took < Duration::from_secs(8) => Ok(format!(
            "Timeout after {:.1} s (deadline 2 s, init_timeout 60 s)",
            took.as_secs_f64()
        )),
        Err(e) => Err(format!(
            "expected Timeout within 8 s, got {e} after {took:?}"
        )),
        Ok(_) => Err("a group of 2 with one rank formed".into()),
    }
}

fn two_ranks_timeout() -> Result<String, String> {
    let cfg = NcclConfig {
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let ranks = NcclGroup::new_in_process_with(&[0, 1], cfg).map_err(ce)?;
    both_once(&ranks);
    let t0 = Instant::now();
    let r = ranks[0].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    let took = t0.elapsed();
    let first = match r {
        Err(e @ CollectiveError::Timeout { .. }) => e.to_string(),
        other => return Err(format!("expected Timeout, got {other:?}")),
    };
    let next = match ranks[0].all_gather_u64(3, soon()) {
        Err(e @ CollectiveError::Aborted { .. }) => e.to_string(),
        other => return Err(format!("expected Aborted after the abort, got {other:?}")),
    };
    let late = late_rank_1(&ranks[1], Duration::from_secs(10))?;
    Ok(format!(
        "rank 0: {first} after {:.1} s; then {next}; {late}",
        took.as_secs_f64(),
    ))
}

/// Rank 1 issues the operation late, against a peer that aborted: it must end by its own bound (2 s
/// deadline plus twice `grace`), not hang. It may end either way. On two H200s over NVLink it
/// completed (2026-12-04), most likely because rank 0's kernel had pushed its share into rank 1's
/// buffers before the abort. That is why the linker decides a batch by its status words and
/// verdict, not by one collective's return.
fn late_rank_1(rank1: &NcclCollective, grace: Duration) -> Result<String, String> {
    let t1 = Instant::now();
    let late = rank1.all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    let took = t1.elapsed();
    let bound = Duration::from_secs(2) + grace * 2 + Duration::from_secs(1);
    if took > bound {
        return Err(format!(
            "rank 1 late: ended after {took:?}, past its bound {bound:?}"
        ));
    }
    let how = match late {
        Ok(_) => "completed (rank 0's share had landed before its abort)".to_string(),
        Err(e) => format!("failed ({e})"),
    };
    Ok(format!(
        "rank 1 late: {how} after {:.1} s",
        took.as_secs_f64()
    ))
}

/// How long an operation in flight may take to end after an abort from another thread: the
/// comm thread's drain wait after `ncclCommAbort` (`abort_grace`, 2 s here) and slack. The
/// operation's own deadline is 20 s, so an abort that waited for it shows.
const ABORTED_WITHIN: Duration = Duration::from_secs(6);
const IN_FLIGHT_DEADLINE: Duration = Duration::from_secs(20);

fn short_grace() -> NcclConfig {
    NcclConfig {
        abort_grace: Duration::from_secs(2),
        ..NcclConfig::default()
    }
}

/// Runs `op` on this thread and `coll.abort` on another after `after`; the op's result and how
/// long it took.
fn abort_during<T>(
    coll: &NcclCollective,
    after: Duration,
    op: impl FnOnce() -> T,
) -> (T, Duration) {
    std::thread::scope(|s| {
        s.spawn(move || {
            std::thread::sleep(after);
            coll.abort("test: abort from another thread");
        });
        let t0 = Instant::now();
        let r = op();
        (r, t0.elapsed())
    })
}

fn aborted_in_time<T: std::fmt::Debug>(
    r: Result<T, CollectiveError>,
    took: Duration,
) -> Result<String, String> {
    match r {
        Err(e @ CollectiveError::Aborted { .. }) if took < ABORTED_WITHIN => Ok(format!(
            "{e} after {:.2} s (abort at 0.5 s, deadline {} s)",
            took.as_secs_f64(),
            IN_FLIGHT_DEADLINE.as_secs()
        )),
        other => Err(format!(
            "expected Aborted within {ABORTED_WITHIN:?}, got {other:?} after {:.2} s",
            took.as_secs_f64()
        )),
    }
}

/// Two GPUs: rank 1 never issues, so rank 0's all-gather waits in NCCL until its deadline,
/// unless the abort from another thread ends it.
fn two_ranks_abort_in_flight() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process_with(&[0, 1], short_grace()).map_err(ce)?;
    both_once(&ranks);
    let (r, took) = abort_during(&ranks[0], Duration::from_millis(500), || {
        ranks[0].all_gather_u64(2, kvlink::kv_loader::deadline_after(IN_FLIGHT_DEADLINE))
    });
    let verdict = aborted_in_time(r, took)?;
    let late = late_rank_1(&ranks[1], short_grace().abort_grace)?;
    Ok(format!("{verdict}; {late}"))
}

/// Both ranks issue one exchange together (so their connections exist), before the checks
/// let rank 0 go on alone.
fn both_once(ranks: &[NcclCollective]) {
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for coll in ranks {
            let b = &barrier;
            s.spawn(move || {
                let _ = coll.all_gather_u64(1, soon());
                b.wait();
            });
        }
    });
}
