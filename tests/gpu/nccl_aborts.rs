//! NCCL failures end by their deadlines: an initialisation with a rank that never joins times
//! out, and on two GPUs a rank that never issues makes its peer time out, abort, and the late
//! rank fail instead of hang.

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
    if gpus >= 2 {
        report.check(
            SEC,
            "2 ranks: rank 1 never issues: Timeout then Aborted",
            two_ranks_timeout,
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

fn two_ranks_timeout() -> Result<String, String> {
    let cfg = NcclConfig {
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let ranks = NcclGroup::new_in_process_with(&[0, 1], cfg).map_err(ce)?;
    // Both ranks once (so connections exist), then rank 0 alone.
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for coll in &ranks {
            let b = &barrier;
            s.spawn(move || {
                let _ = coll.all_gather_u64(1, soon());
                b.wait();
            });
        }
    });
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
    // Rank 1 issues late: its peer aborted, so it must fail by its own deadline, not hang.
    let t1 = Instant::now();
    let late =
        ranks[1].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    if late.is_ok() {
        return Err("rank 1 completed against an aborted peer".into());
    }
    Ok(format!(
        "rank 0: {first} after {:.1} s; then {next}; rank 1 late: failed after {:.1} s",
        took.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    ))
}
