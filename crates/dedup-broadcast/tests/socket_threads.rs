//! The socket collective with ranks as threads (Unix socket pairs, the same code path as
//! ranks in separate processes): every operation leaves the same bytes as the in-process
//! group; mismatches, bad arguments, departed ranks and deadlines fail with typed errors and
//! break the handle.
#![cfg(target_os = "linux")]

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::script::{run, script};
use common::threads::{far, on_threads};
use dedup_broadcast::{
    all_gather_in_place, broadcast_slice, Algorithm, Collective, CollectiveError, InProcessGroup,
    SocketCollective,
};

#[test]
fn every_op_matches_the_in_process_group_for_every_size_and_algorithm() {
    for size in 1..=5u32 {
        let ops = script(u64::from(size) * 17, size, 70, 50_000);
        let reference = on_threads(&InProcessGroup::new(size), |c| {
            run(c, &ops, true, far()).expect("reference run")
        });
        for algorithm in [Algorithm::Ring, Algorithm::Direct] {
            let ranks = SocketCollective::over_socket_pairs(size, algorithm).unwrap();
            let got = on_threads(&ranks, |c| run(c, &ops, false, far()).expect("socket run"));
            for r in 0..size as usize {
                assert!(
                    got[r] == reference[r],
                    "size {size} {algorithm:?} rank {r}: bytes differ from the in-process group"
                );
            }
            assert!(ranks.iter().all(|c| c.broken().is_none()));
        }
    }
}

#[test]
fn large_rows_cross_many_socket_buffers() {
    // A few MiB per operation: the ring relays while bytes are still arriving.
    let ops = script(5, 4, 14, 6 << 20);
    let reference = on_threads(&InProcessGroup::new(4), |c| {
        run(c, &ops, true, far()).unwrap()
    });
    let ranks = SocketCollective::over_socket_pairs(4, Algorithm::Ring).unwrap();
    let got = on_threads(&ranks, |c| run(c, &ops, false, far()).unwrap());
    assert!(got == reference);
}

#[test]
fn a_length_mismatch_is_typed_and_breaks_the_group_on_every_rank() {
    let ranks = SocketCollective::over_socket_pairs(3, Algorithm::Ring).unwrap();
    let errs = on_threads(&ranks, |c| {
        let n = if c.rank() == 1 { 9 } else { 8 };
        let mut buf = vec![0u8; n];
        let e = broadcast_slice(c, &mut buf, 0, far()).unwrap_err();
        // Broken: the next operation is refused at once.
        let next = c.all_gather_u64(1, far()).unwrap_err();
        assert!(
            matches!(next, CollectiveError::Aborted { seq: 1, .. }),
            "{next:?}"
        );
        assert!(c.broken().is_some());
        e
    });
    // Rank 1 sees rank 0's header differ, rank 2 sees rank 1's; whoever fails first shuts
    // its sockets, so a rank may learn of it as a departure instead.
    assert!(
        matches!(
            errs[1],
            CollectiveError::SizeMismatch {
                op: "broadcast_rows",
                rank: 0,
                expected: 9,
                got: 8,
                ..
            } | CollectiveError::RankGone { .. }
        ),
        "{:?}",
        errs[1]
    );
    assert!(
        matches!(
            errs[2],
            CollectiveError::SizeMismatch {
                rank: 1,
                expected: 8,
                got: 9,
                ..
            } | CollectiveError::RankGone { .. }
        ),
        "{:?}",
        errs[2]
    );
    assert!(
        matches!(errs[0], CollectiveError::RankGone { .. }),
        "{:?}",
        errs[0]
    );
    assert!(errs
        .iter()
        .any(|e| matches!(e, CollectiveError::SizeMismatch { .. })));
}

#[test]
fn an_op_mismatch_is_typed_on_the_rank_that_sees_it() {
    let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Direct).unwrap();
    let errs = on_threads(&ranks, |c| {
        if c.rank() == 0 {
            c.all_gather_u64(5, far()).unwrap_err()
        } else {
            let mut b = [0u8; 8];
            broadcast_slice(c, &mut b, 0, far()).unwrap_err()
        }
    });
    assert!(
        matches!(errs[1], CollectiveError::Mismatch { rank: 0, .. }),
        "{:?}",
        errs[1]
    );
    assert!(
        matches!(
            errs[0],
            CollectiveError::Mismatch { rank: 1, .. } | CollectiveError::RankGone { .. }
        ),
        "{:?}",
        errs[0]
    );
}

#[test]
fn bad_arguments_are_refused_and_the_peers_fail_at_once() {
    let ranks = SocketCollective::over_socket_pairs(3, Algorithm::Ring).unwrap();
    let t = Instant::now();
    let errs = on_threads(&ranks, |c| {
        let mut buf = vec![0u8; 30];
        if c.rank() == 2 {
            // 30 bytes do not split into 3 chunks of 7.
            let send = [0u8; 7];
            dedup_broadcast::all_gather_slices(c, &send, &mut buf, far()).unwrap_err()
        } else {
            all_gather_in_place(c, &mut buf, far()).unwrap_err()
        }
    });
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "nobody waited for the deadline"
    );
    assert!(
        matches!(errs[2], CollectiveError::InvalidArgument { rank: 2, .. }),
        "{:?}",
        errs[2]
    );
    assert!(
        matches!(errs[0], CollectiveError::RankGone { .. }),
        "{:?}",
        errs[0]
    );
    assert!(
        matches!(errs[1], CollectiveError::RankGone { .. }),
        "{:?}",
        errs[1]
    );
}

#[test]
fn a_rank_that_never_arrives_times_out_the_others_at_their_deadline() {
    let ranks = SocketCollective::over_socket_pairs(3, Algorithm::Ring).unwrap();
    let errs = on_threads(&ranks, |c| {
        if c.rank() == 1 {
            // Stays silent past the others' deadline, then finds the group broken.
            thread::sleep(Duration::from_millis(400));
            return c.all_gather_u64(0, far()).unwrap_err();
        }
        let t = Instant::now();
        let e = c
            .all_gather_u64(0, kv_loader::deadline_after(Duration::from_millis(150)))
            .unwrap_err();
        // A rank that timed out waited its deadline; the other may learn of it sooner (by as
        // much as the two threads' start apart), from the first one's sockets shutting.
        if matches!(e, CollectiveError::Timeout { .. }) {
            assert!(
                t.elapsed() >= Duration::from_millis(140),
                "{:?}",
                t.elapsed()
            );
        }
        assert!(t.elapsed() < Duration::from_secs(10));
        e
    });
    // Whichever of 0 and 2 times out first shuts its sockets; the other may see that first.
    let timeouts = errs
        .iter()
        .filter(|e| matches!(e, CollectiveError::Timeout { missing, .. } if missing.contains(&1)))
        .count();
    assert!(timeouts >= 1, "{errs:?}");
    for e in &errs {
        assert!(
            matches!(
                e,
                CollectiveError::Timeout { .. }
                    | CollectiveError::RankGone { .. }
                    | CollectiveError::Aborted { .. }
            ),
            "{e:?}"
        );
    }
}

/// A verdict word settled: rank 1 sends its word at once and gives up at its short deadline;
/// rank 0 comes a little later with a long one, rank 2 only after rank 1 gave up. Rank 0
/// then holds every word (rank 1's was sent before it left, rank 2's after), and a plain
/// gather returned `Ok` there while rank 1 failed: a batch loaded on one rank and failed on
/// another, with no later operation to bring them in step. Settled, every rank fails. The
/// same for a batch's gate (before, its plain gather let a rank whose gate failed load alone
/// with `ReadAlone` while the others went on with a broken group and failed).
#[test]
fn a_settled_gather_fails_on_every_rank_when_one_gave_up() {
    type Op = fn(&SocketCollective, u32, Instant) -> Result<(), CollectiveError>;
    let verdict: Op = |c, rank, deadline| {
        c.all_gather_u64_settled(u64::from(rank), deadline)
            .map(drop)
    };
    let gate: Op = |c, rank, deadline| {
        let word = dedup_broadcast::GateWord {
            digest: [7; 16],
            batch: 1,
            count: 0,
            proposal: u64::from(rank),
            last_batch_us: 0,
            alone: Default::default(),
        };
        dedup_broadcast::check_batch(c, &word, deadline).map(drop)
    };
    for (what, op) in [("verdict", verdict), ("gate", gate)] {
        let ranks = SocketCollective::over_socket_pairs(3, Algorithm::Direct).unwrap();
        let (gave_up, after) = std::sync::mpsc::channel::<()>();
        let (rank1_in, rank0_go) = std::sync::mpsc::channel::<()>();
        let t0 = Instant::now();
        let results = thread::scope(|s| {
            let (r0, r1, r2) = (&ranks[0], &ranks[1], &ranks[2]);
            let h1 = s.spawn(move || {
                // Rank 1 comes first, with a short deadline, and gives up.
                let _ = rank1_in.send(());
                let r = op(r1, 1, kv_loader::deadline_after(Duration::from_millis(100)));
                let _ = gave_up.send(());
                r
            });
            let h0 = s.spawn(move || {
                // Rank 0 comes once rank 1 is in, with a long deadline.
                let _ = rank0_go.recv();
                op(r0, 0, kv_loader::deadline_after(Duration::from_secs(3)))
            });
            let h2 = s.spawn(move || {
                // Rank 2 comes only after rank 1 gave up.
                let _ = after.recv();
                op(r2, 2, kv_loader::deadline_after(Duration::from_secs(3)))
            });
            [h0, h1, h2].map(|h| h.join().unwrap())
        });
        assert!(results.iter().all(Result::is_err), "{what}: {results:?}");
        assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
    }
}

/// Settled, a gather every rank comes to in time is the plain gather's result.
#[test]
fn a_settled_gather_in_time_gives_every_word_on_every_rank() {
    for algorithm in [Algorithm::Ring, Algorithm::Direct] {
        let ranks = SocketCollective::over_socket_pairs(4, algorithm).unwrap();
        let words = on_threads(&ranks, |c| {
            c.all_gather_u64_settled(u64::from(c.rank()) * 7, far())
                .unwrap()
        });
        assert!(words.iter().all(|w| *w == vec![0, 7, 14, 21]), "{words:?}");
    }
}

#[test]
fn a_dropped_rank_fails_pending_and_later_ops_at_once() {
    let mut ranks = SocketCollective::over_socket_pairs(4, Algorithm::Ring).unwrap();
    let gone = ranks.remove(2);
    let t = Instant::now();
    let errs = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut buf = vec![0u8; 1 << 20];
                    let first = broadcast_slice(c, &mut buf, 0, far()).unwrap_err();
                    let later = c.all_gather_u64(0, far()).unwrap_err();
                    (first, later, c.broken())
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(100));
        drop(gone);
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert!(t.elapsed() < Duration::from_secs(30));
    for (first, later, broken) in errs {
        assert!(
            matches!(first, CollectiveError::RankGone { .. }),
            "{first:?}"
        );
        assert!(
            matches!(later, CollectiveError::Aborted { .. }),
            "{later:?}"
        );
        assert!(broken.is_some());
    }
}

#[test]
fn abort_from_another_thread_ends_an_operation_in_flight() {
    let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Ring).unwrap();
    let (a, _b) = (&ranks[0], &ranks[1]);
    let e = thread::scope(|s| {
        let h = s.spawn(|| a.all_gather_u64(1, far()).unwrap_err());
        thread::sleep(Duration::from_millis(50));
        a.abort("event wait passed its deadline");
        h.join().unwrap()
    });
    assert!(
        matches!(&e, CollectiveError::Aborted { cause, .. } if cause.contains("event wait")),
        "{e:?}"
    );
    assert_eq!(
        a.broken().as_deref(),
        Some("event wait passed its deadline")
    );
}

#[test]
fn device_ops_are_unsupported_and_do_not_advance_the_sequence() {
    let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Ring).unwrap();
    let region = kv_device::DeviceRegion {
        ordinal: 0,
        addr: 0,
        len: 8,
    };
    on_threads(&ranks, |c| {
        assert!(c.memory().host && !c.memory().device);
        if c.rank() == 0 {
            // SAFETY: refused before any memory is touched.
            let e = unsafe { c.broadcast_device(region, None, 0, far()) }.unwrap_err();
            assert!(matches!(e, CollectiveError::Unsupported { .. }));
        }
        // Both ranks' next operation is still number 0 and meets.
        assert_eq!(
            c.all_gather_u64(u64::from(c.rank()), far()).unwrap(),
            vec![0, 1]
        );
    });
}
