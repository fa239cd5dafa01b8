//! Ranks as real processes (this test binary, spawned as rank processes): the socket
//! collective leaves the same bytes as the in-process group; a rank killed with `kill -9`
//! (or stopped) at the start, the middle or the end of a sequence fails every other rank
//! within the deadline, and after it restarts the group re-forms at a new epoch and works;
//! bad input at the rendezvous is refused with the same typed error on every rank.
//!
//! Every test bounds its waits and kills every process it started (`RankProc` kills on
//! drop, also when the test panics).
#![cfg(target_os = "linux")]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::procs::{arg, field, report, role, RankProc, CHILD_LIFETIME};
use common::script::{run, run_one, script};
use dedup_broadcast::{
    Algorithm, Collective, CollectiveError, FileExchange, InProcessGroup, MeetingPoint, Rendezvous,
    RendezvousConfig, RendezvousError, TransportChoice,
};
use kv_geometry::{KvGeometry, ModelKvSpec};

/// Every child runs this test (and only this one): it does nothing in a normal run.
#[test]
#[ignore = "a rank process's entry: its parent test runs it with --ignored"]
fn rank_process() {
    let Some(role) = role() else { return };
    match role.get("role").map(String::as_str) {
        Some("script") => child_script(&role),
        Some("recover") => child_recover(&role),
        Some("refuse") => child_refuse(&role),
        Some("idle") => {
            report(&format!("idle pid={}", std::process::id()));
            std::thread::sleep(Duration::from_secs(60));
        }
        other => panic!("unknown role {other:?}"),
    }
}

const MAX_BYTES: usize = 200_000;

fn far() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(30))
}

fn digest(log: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(log))
}

fn collective_kind(e: &CollectiveError) -> &'static str {
    match e {
        CollectiveError::Timeout { .. } => "Timeout",
        CollectiveError::Aborted { .. } => "Aborted",
        CollectiveError::RankGone { .. } => "RankGone",
        CollectiveError::SizeMismatch { .. } => "SizeMismatch",
        CollectiveError::Mismatch { .. } => "Mismatch",
        CollectiveError::InvalidArgument { .. } => "InvalidArgument",
        CollectiveError::Backend(_) => "Backend",
        CollectiveError::Device { .. } => "Device",
        CollectiveError::Socket { .. } => "Socket",
        CollectiveError::Wait { .. } => "Wait",
        CollectiveError::Unsupported { .. } => "Unsupported",
        CollectiveError::Formation { .. } => "Formation",
        _ => "Other",
    }
}

fn rendezvous_kind(e: &RendezvousError) -> &'static str {
    match e {
        RendezvousError::WorldSizeMismatch { .. } => "WorldSizeMismatch",
        RendezvousError::DuplicateRank { .. } => "DuplicateRank",
        RendezvousError::GeometryMismatch { .. } => "GeometryMismatch",
        RendezvousError::VersionMismatch { .. } => "VersionMismatch",
        RendezvousError::SettingsMismatch { .. } => "SettingsMismatch",
        RendezvousError::Timeout { .. } => "Timeout",
        RendezvousError::Occupied { .. } => "Occupied",
        _ => "Other",
    }
}

/// The meeting point of a role: `tcp:host:port` or `file:dir`.
fn meeting_point(spec: &str) -> MeetingPoint {
    match spec.split_once(':') {
        Some(("tcp", a)) => MeetingPoint::Tcp(a.to_string()),
        Some(("file", dir)) => MeetingPoint::Exchange {
            exchange: Arc::new(FileExchange::new(dir).unwrap()),
            prefix: "kvlink-test".into(),
        },
        _ => panic!("meeting point {spec:?}"),
    }
}

/// A rendezvous from a role; rank 0 of a TCP meeting point reports where it listens.
fn rendezvous(role: &HashMap<String, String>) -> Rendezvous {
    let rank: u32 = arg(role, "rank");
    let world: u32 = arg(role, "world");
    let mut c = RendezvousConfig::new(rank, world, meeting_point(&role["meet"])).timeout(
        Duration::from_millis(role.get("rv_ms").map_or(20_000, |v| v.parse().unwrap())),
    );
    if let Some(a) = role.get("algo") {
        c = c.algorithm(Algorithm::parse(a).unwrap());
    }
    if let Some(t) = role.get("transport") {
        c = c.transport(TransportChoice::parse(t).unwrap());
    }
    let model = match role.get("model").map(String::as_str) {
        Some("glm5") => ModelKvSpec::glm5_dsa_fp8(),
        _ => ModelKvSpec::glm52_dsa_fp8(),
    };
    // Every rank of a group shares the TP size; a rank of another world size says so in its
    // geometry too, but the world-size check comes first.
    let geometry = KvGeometry::new(model, world, rank.min(world - 1)).unwrap();
    c = c.geometry(&geometry);
    if let Some(v) = role.get("version") {
        c = c.version(v.clone());
    }
    let rv = Rendezvous::new(c).unwrap();
    if let Some(a) = rv.listen_addr() {
        report(&format!("addr {a}"));
    }
    rv
}

fn child_script(role: &HashMap<String, String>) {
    let mut rv = rendezvous(role);
    let group = rv.form().expect("forming");
    report(&format!(
        "formed epoch={} transport={:?}",
        group.epoch(),
        group.transport()
    ));
    let coll = group.connect(1).expect("connecting").remove(0);
    let ops = script(
        arg(role, "seed"),
        arg(role, "world"),
        arg(role, "count"),
        MAX_BYTES,
    );
    let log = run(&coll, &ops, false, far()).expect("socket run");
    report(&format!("digest d={}", digest(&log)));
}

fn child_recover(role: &HashMap<String, String>) {
    let (rank, world): (u32, u32) = (arg(role, "rank"), arg(role, "world"));
    let victim: u32 = arg(role, "victim");
    let stop: usize = arg(role, "stop");
    let restarted = role.get("restarted").is_some();
    let deadline_ms: u64 = arg(role, "deadline_ms");
    let mut rv = rendezvous(role);
    if !restarted {
        let group = rv.form().expect("forming");
        report(&format!("formed epoch={}", group.epoch()));
        let coll = group.connect(1).expect("connecting").remove(0);
        let ops = script(arg(role, "seed"), world, arg(role, "count"), MAX_BYTES);
        let mut log = Vec::new();
        let mut failed = false;
        for (i, op) in ops.iter().enumerate() {
            if rank == victim && i == stop {
                report(&format!("stopped at={i}"));
                std::thread::sleep(CHILD_LIFETIME);
            }
            let t = Instant::now();
            let deadline = t + Duration::from_millis(deadline_ms);
            if let Err(e) = run_one(&coll, i, op, false, deadline, &mut log) {
                let gone = match &e {
                    CollectiveError::RankGone { gone, .. } => format!("{gone:?}").replace(' ', ""),
                    _ => "-".into(),
                };
                report(&format!(
                    "failed at={i} kind={} ms={} gone={gone} broken={}",
                    collective_kind(&e),
                    t.elapsed().as_millis(),
                    coll.broken().is_some()
                ));
                let again = coll.all_gather_u64(0, far()).unwrap_err();
                report(&format!("then kind={}", collective_kind(&again)));
                failed = true;
                break;
            }
        }
        if !failed {
            report("completed");
        }
    }
    let group = rv.form().expect("re-forming");
    report(&format!("reformed epoch={}", group.epoch()));
    let coll = group.connect(1).expect("connecting again").remove(0);
    let ops = script(arg(role, "seed2"), world, 21, MAX_BYTES);
    let log = run(&coll, &ops, false, far()).expect("run after re-forming");
    report(&format!("digest d={}", digest(&log)));
}

fn child_refuse(role: &HashMap<String, String>) {
    let mut rv = rendezvous(role);
    report("joining");
    match rv.form() {
        Ok(g) => report(&format!("formed epoch={}", g.epoch())),
        Err(e) => report(&format!("refused kind={} msg={e}", rendezvous_kind(&e))),
    }
}

/// Per-rank digests of `ops` on the in-process group (the reference).
fn reference(world: u32, seed: u64, count: usize) -> Vec<String> {
    let ops = script(seed, world, count, MAX_BYTES);
    let ranks = InProcessGroup::new(world);
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                let ops = &ops;
                s.spawn(move || digest(&run(c, ops, true, far()).expect("reference")))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Starts rank 0 with `role(0, "tcp:127.0.0.1:0")`, reads its address, starts the others
/// with it; returns the processes and the meeting point.
fn start(world: u32, role: impl Fn(u32, &str) -> String) -> (Vec<RankProc>, String) {
    let mut r0 = RankProc::spawn("rank 0", &role(0, "tcp:127.0.0.1:0"));
    let addr = r0.expect("addr ", Duration::from_secs(20));
    let meet = format!("tcp:{addr}");
    let mut procs = vec![r0];
    for r in 1..world {
        procs.push(RankProc::spawn(&format!("rank {r}"), &role(r, &meet)));
    }
    (procs, meet)
}

const WAIT: Duration = Duration::from_secs(60);

fn check_script_run(world: u32, algo: &str, transport: &str, expect_transport: &str) {
    let (seed, count) = (11 + u64::from(world), 35);
    let want = reference(world, seed, count);
    let (mut procs, _) = start(world, |r, meet| {
        format!("role=script,rank={r},world={world},meet={meet},seed={seed},count={count},algo={algo},transport={transport}")
    });
    for (r, p) in procs.iter_mut().enumerate() {
        let formed = p.expect("formed ", WAIT);
        assert_eq!(field(&formed, "epoch"), "1");
        assert_eq!(field(&formed, "transport"), expect_transport);
        let got = p.expect("digest ", WAIT);
        assert_eq!(field(&got, "d"), want[r], "rank {r} ({algo}, {transport})");
        p.succeeds(WAIT);
    }
}

#[test]
fn processes_over_unix_sockets_leave_the_in_process_groups_bytes() {
    check_script_run(3, "ring", "auto", "Unix");
}

#[test]
fn processes_over_tcp_with_direct_sends_leave_the_in_process_groups_bytes() {
    check_script_run(4, "direct", "tcp", "Tcp");
}

#[test]
fn processes_meeting_through_a_file_exchange_form_and_share() {
    let dir = tempdir("fx");
    let meet = format!("file:{}", dir.display());
    let (world, seed, count) = (3u32, 5u64, 21usize);
    let want = reference(world, seed, count);
    let mut procs: Vec<RankProc> = (0..world)
        .map(|r| {
            RankProc::spawn(
                &format!("rank {r}"),
                &format!(
                    "role=script,rank={r},world={world},meet={meet},seed={seed},count={count}"
                ),
            )
        })
        .collect();
    for (r, p) in procs.iter_mut().enumerate() {
        assert_eq!(field(&p.expect("formed ", WAIT), "epoch"), "1");
        assert_eq!(field(&p.expect("digest ", WAIT), "d"), want[r]);
        p.succeeds(WAIT);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(
        format!("kvlink-{tag}-{}-{:?}", std::process::id(), Instant::now())
            .replace([' ', '.', '{', '}', ':', ','], "_"),
    );
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// How the victim leaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Leave {
    /// `kill -9`.
    Killed,
    /// `SIGSTOP`: alive, silent, then killed once the others have timed out.
    Stopped,
}

/// Three (or more) ranks run `count` operations; `victim` stops before operation `stop` and
/// is then killed or stopped. Every survivor's pending operation must fail within the
/// deadline with a typed error, later ones at once; the victim restarts; all re-form at
/// epoch 2 and run another script with the in-process group's bytes.
fn kill_and_recover(world: u32, victim: u32, stop: usize, leave: Leave, algo: &str) {
    let (seed, seed2, count) = (3u64, 77u64, 14usize);
    let deadline_ms: u64 = if leave == Leave::Stopped {
        1_500
    } else {
        20_000
    };
    let role = |r: u32, meet: &str| {
        format!(
            "role=recover,rank={r},world={world},meet={meet},victim={victim},stop={stop},\
             count={count},seed={seed},seed2={seed2},deadline_ms={deadline_ms},algo={algo}"
        )
    };
    let (mut procs, meet) = start(world, role);
    for p in procs.iter_mut() {
        assert_eq!(field(&p.expect("formed ", WAIT), "epoch"), "1");
    }
    let v = victim as usize;
    assert_eq!(
        field(&procs[v].expect("stopped ", WAIT), "at"),
        stop.to_string()
    );
    // Let the survivors enter operation `stop` and wait in it.
    std::thread::sleep(Duration::from_millis(300));
    match leave {
        Leave::Killed => procs[v].kill9(),
        Leave::Stopped => {
            // SAFETY: sends a signal to our own child process, which is alive (it reported).
            let r = unsafe { libc::kill(procs[v].pid() as libc::pid_t, libc::SIGSTOP) };
            assert_eq!(r, 0);
        }
    }
    let mut kinds = Vec::new();
    for (r, p) in procs.iter_mut().enumerate() {
        if r == v {
            continue;
        }
        let failed = p.expect("failed ", WAIT);
        assert_eq!(field(&failed, "at"), stop.to_string(), "rank {r}: {failed}");
        let kind = field(&failed, "kind");
        kinds.push(kind.to_string());
        let ms: u64 = field(&failed, "ms").parse().unwrap();
        assert_eq!(field(&failed, "broken"), "true", "rank {r}");
        match leave {
            Leave::Killed => {
                // A dead peer is noticed at once (its sockets close), not at the deadline.
                assert_eq!(kind, "RankGone", "rank {r}: {failed}");
                assert!(ms < deadline_ms / 2, "rank {r} took {ms} ms: {failed}");
                assert!(
                    field(&failed, "gone").contains(&victim.to_string()),
                    "rank {r} names the dead rank: {failed}"
                );
            }
            Leave::Stopped => {
                assert!(
                    ["Timeout", "RankGone", "Aborted"].contains(&kind),
                    "rank {r}: {failed}"
                );
                assert!(ms < deadline_ms + 5_000, "rank {r} took {ms} ms: {failed}");
            }
        }
        assert_eq!(p.expect("then ", WAIT), "kind=Aborted", "rank {r}");
    }
    if leave == Leave::Stopped {
        // At least one rank waited for the silent one until its deadline (the others may
        // have learnt of the failure from it first).
        assert!(kinds.iter().any(|k| k == "Timeout"), "{kinds:?}");
        procs[v].kill9();
    }
    // The victim comes back (same rank, same meeting point: rank 0 binds the same port).
    procs[v] = RankProc::spawn(
        &format!("rank {victim} (restarted)"),
        &format!("{},restarted=1", role(victim, &meet)),
    );
    let want = reference(world, seed2, 21);
    for (r, p) in procs.iter_mut().enumerate() {
        assert_eq!(
            field(&p.expect("reformed ", WAIT), "epoch"),
            "2",
            "rank {r}"
        );
        assert_eq!(
            field(&p.expect("digest ", WAIT), "d"),
            want[r],
            "rank {r} after re-forming"
        );
        p.succeeds(WAIT);
    }
}

#[test]
fn rank_0_killed_at_the_start_then_the_group_reforms() {
    kill_and_recover(3, 0, 0, Leave::Killed, "ring");
}

#[test]
fn a_middle_rank_killed_mid_sequence_then_the_group_reforms() {
    kill_and_recover(3, 1, 7, Leave::Killed, "ring");
}

#[test]
fn the_last_rank_killed_at_the_end_then_the_group_reforms() {
    kill_and_recover(3, 2, 13, Leave::Killed, "direct");
}

#[test]
fn a_middle_rank_of_four_that_hangs_times_the_others_out_then_the_group_reforms() {
    kill_and_recover(4, 2, 5, Leave::Stopped, "ring");
}

/// Starts `ranks` (each `(rank, world, extra role keys)`), rank 0 first; every process
/// must report the same refusal kind.
fn refused_everywhere(ranks: &[(u32, u32, &str)], want: &str) {
    let role = |r: u32, w: u32, extra: &str, meet: &str| {
        format!("role=refuse,rank={r},world={w},meet={meet},rv_ms=30000{extra}")
    };
    let (r0, w0, e0) = ranks[0];
    // Timed from the first start: a refusal that waited for the 30 s rendezvous timeout of
    // any process ends past the bound.
    let t = Instant::now();
    let mut first = RankProc::spawn("rank 0", &role(r0, w0, e0, "tcp:127.0.0.1:0"));
    let meet = format!("tcp:{}", first.expect("addr ", WAIT));
    let mut procs = vec![first];
    for (i, &(r, w, extra)) in ranks.iter().enumerate().skip(1) {
        procs.push(RankProc::spawn(
            &format!("process {i} (rank {r})"),
            &role(r, w, extra, &meet),
        ));
    }
    for p in procs.iter_mut() {
        let got = p.expect("refused ", WAIT);
        assert_eq!(field(&got, "kind"), want, "{}: {got}", p.name);
        p.succeeds(WAIT);
    }
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "a refusal waited for the timeout: {:?}",
        t.elapsed()
    );
}

#[test]
fn a_wrong_world_size_is_refused_on_every_rank() {
    refused_everywhere(&[(0, 3, ""), (1, 3, ""), (2, 4, "")], "WorldSizeMismatch");
}

/// Over TCP the newest hello of a rank replaces an earlier one (a crashed host's claim never
/// reads as gone, and its restart must join): the earlier claimant alone is refused, the
/// others form. Before, every rank was refused with `DuplicateRank`.
#[test]
fn a_rank_joining_twice_refuses_the_earlier_claim_alone() {
    let role = |r: u32, meet: &str| {
        let meet = if r == 0 {
            "tcp:127.0.0.1:0".to_string()
        } else {
            format!("tcp:{meet}")
        };
        format!("role=refuse,rank={r},world=3,meet={meet},rv_ms=30000")
    };
    common::procs::earlier_claim_refused_alone(&role, Duration::from_millis(2_000));
}

#[test]
fn a_different_geometry_is_refused_on_every_rank() {
    refused_everywhere(
        &[(0, 3, ""), (1, 3, ",model=glm5"), (2, 3, "")],
        "GeometryMismatch",
    );
}

#[test]
fn a_different_version_is_refused_on_every_rank() {
    refused_everywhere(
        &[(0, 3, ""), (1, 3, ""), (2, 3, ",version=0.0.0-other")],
        "VersionMismatch",
    );
}

#[test]
fn a_wrong_world_size_is_refused_through_a_file_exchange_too() {
    let dir = tempdir("fxw");
    let meet = format!("file:{}", dir.display());
    let mut procs: Vec<RankProc> = [(0, 2), (1, 3)]
        .iter()
        .map(|&(r, w)| {
            RankProc::spawn(
                &format!("rank {r}"),
                &format!("role=refuse,rank={r},world={w},meet={meet},rv_ms=15000"),
            )
        })
        .collect();
    for p in procs.iter_mut() {
        let got = p.expect("refused ", WAIT);
        assert_eq!(
            field(&got, "kind"),
            "WorldSizeMismatch",
            "{}: {got}",
            p.name
        );
        p.succeeds(WAIT);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A rank process ends with the thread that spawned it: a test binary killed without running
/// its drops (a CI time limit, a SIGKILL) leaves no rank behind. Before, one lived on until its
/// own lifetime ran out (two minutes).
#[test]
fn a_rank_process_ends_with_the_thread_that_spawned_it() {
    use std::os::unix::process::ExitStatusExt;
    let mut idle = std::thread::spawn(|| {
        let mut p = RankProc::spawn("idle", "role=idle");
        p.expect("idle ", WAIT);
        p
    })
    .join()
    .expect("the spawning thread");
    let status = idle.exit_status(Duration::from_secs(10));
    assert_eq!(status.signal(), Some(libc::SIGKILL), "{status}");
}
