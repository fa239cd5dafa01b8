//! Ranks never drift apart (TP 3, host pools and device pools on CPU devices, every mode,
//! Auto included): batch N misbehaves on one rank — rank 0, the middle rank, the last — and
//! batches N+1 and N+2 then load correctly, byte for byte, in the mode the group used before,
//! on every rank. The ways a rank used to consume a group operation alone: a queued batch
//! cancelled by `reset`, a `Busy` refusal, a duplicate batch id, a store error in a lookup, a
//! device error while landing; and, for anything else, a rank whose collectives shift (one
//! status exchange never issued), which the group must detect and recover from.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::coll::{Misbehave, Misbehaving};
use common::tp::{
    every_mode, mixed_spec, run_ok, tp_ranks, tp_ranks_built, Path, RankBuild, TpRank,
};
use common::{load_plan, prompt, wait_all};
use kvlink::kv_device::cpu::CpuOp;
use kvlink::kv_device::ScatterStrategy;
use kvlink::kv_geometry::PageHash;
use kvlink::kv_loader::{
    BatchId, EngineAction, KvLoadError, KvLoader, LoadStats, LookupRequest, PlanError,
};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultCall, FaultRule, KvStore, StoreError,
};
use kvlink::mooncake_linker::{LinkerConfig, TpGroup};

const TP: u32 = 3;
const PAGES: usize = 6;

fn configs() -> Vec<(&'static str, LinkerConfig)> {
    every_mode(|c| LinkerConfig {
        collective_timeout: Duration::from_secs(2),
        ..c
    })
}

fn paths() -> [Path; 2] {
    [Path::Host, Path::device_per_rank(ScatterStrategy::Auto)]
}

fn store() -> Arc<dyn KvStore> {
    Arc::new(EmbeddedStore::new(1 << 30))
}

/// Runs `scenario` for every path, mode and failing rank, each on fresh ranks: batch 1 sets
/// the mode, the scenario makes batch 2 (and a few around it) misbehave on `fail`, then
/// batches `next` and `next + 1` must load in batch 1's mode.
fn every_case(
    name: &str,
    device_only: bool,
    scenario: impl Fn(&[TpRank], &[PageHash], u32, &str) -> u64,
) {
    let t0 = Instant::now();
    for path in paths() {
        if device_only && path == Path::Host {
            continue;
        }
        for (mode, cfg) in configs() {
            for fail in 0..TP {
                let what = format!("{name}: {path:?} {mode} rank {fail}");
                let (rs, hashes) = tp_ranks(&mixed_spec(), TP, store(), PAGES, &cfg, path);
                let base = run_ok(&rs, 1, &hashes, &what);
                let next = scenario(&rs, &hashes, fail, &what);
                for b in [next, next + 1] {
                    let mode = run_ok(&rs, b, &hashes, &what);
                    assert_eq!(mode, base, "{what}: batch {b} loaded in another mode");
                }
            }
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{name}: {:?}",
        t0.elapsed()
    );
}

/// Every rank runs `f(rank, linker)` at once.
fn each<T: Send>(rs: &[TpRank], f: impl Fn(u32, &TpRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let f = &f;
                s.spawn(move || f(rank as u32, r))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Slots of batch `b` (2, 3 or 4) on `rank`, none shared with the other two: batches whose
/// outcomes are not taken yet may not land in one slot (`PlanError::SlotInFlight`).
fn batch_slots(rank: u32, b: u64) -> Vec<u32> {
    let block = 6 * (b % 3) as u32;
    (0..PAGES as u32)
        .map(|i| block + (i * 5 + rank) % 6)
        .collect()
}

/// What a batch ended as, in a word: `loaded`, `peer_failed/<the rank named>`, or the error's
/// kind.
fn verdict(result: &Result<LoadStats, KvLoadError>) -> String {
    match result {
        Ok(_) => "loaded".into(),
        Err(KvLoadError::PeerFailed { rank, .. }) => format!("peer_failed/{rank}"),
        Err(e) => e.kind_name().into(),
    }
}

/// Starts `batch`, waits every layer, takes the outcome: its [`verdict`].
fn load(r: &TpRank, batch: u64, hashes: &[PageHash]) -> String {
    let t = r
        .linker
        .start_load(load_plan(
            r.linker.geometry(),
            batch,
            hashes,
            r.slots.clone(),
        ))
        .unwrap();
    let _ = wait_all(&r.linker, &t);
    verdict(&r.linker.wait_batch(&t).unwrap().result)
}

#[test]
fn a_queued_batch_cancelled_by_reset_still_meets_the_group() {
    every_case("reset", false, |rs, hashes, fail, what| {
        // The failing rank's batch 2 reads slowly, so its batch 3 is queued when it resets.
        rs[fail as usize].faults.inject(
            FaultRule {
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Delay(Duration::from_millis(250)),
        );
        let before: Vec<_> = rs.iter().map(|r| r.linker.metrics()).collect();
        let loaded = each(rs, |rank, r| {
            let g = r.linker.geometry().clone();
            if rank != fail {
                return (load(r, 2, hashes), load(r, 3, hashes));
            }
            let t2 = r
                .linker
                .start_load(load_plan(&g, 2, hashes, batch_slots(rank, 2)))
                .unwrap();
            let t3 = r
                .linker
                .start_load(load_plan(&g, 3, hashes, batch_slots(rank, 3)))
                .unwrap();
            std::thread::sleep(Duration::from_millis(80));
            r.linker.reset().unwrap();
            // As an engine does after a reset: the outcomes it ended are taken (their slots
            // are free again).
            let taken: Vec<String> = [t2, t3]
                .iter()
                .map(|t| verdict(&r.linker.wait_batch(t).unwrap().result))
                .collect();
            (taken[0].clone(), taken[1].clone())
        });
        // The rank that reset still met its peers at each batch's gate, failed: every rank
        // fails each with `PeerFailed` naming it (the peers not at their collective timeout).
        let expected = format!("peer_failed/{fail}");
        for (rank, (two, three)) in loaded.into_iter().enumerate() {
            assert_eq!(
                (&two, &three),
                (&expected, &expected),
                "{what}: rank {rank}"
            );
        }
        // The metrics count both as cancelled on every rank, as on a rank alone: the engine's
        // doing, no rank's failure. Before, every rank counted two `peer_failed` and no rank
        // a cause (or the resetting rank an own `cancelled` failure).
        for (rank, (r, before)) in rs.iter().zip(&before).enumerate() {
            let now = r.linker.metrics();
            let more = |now: &std::collections::BTreeMap<&str, u64>,
                        was: &std::collections::BTreeMap<&str, u64>,
                        kind| {
                now.get(kind).copied().unwrap_or(0) - was.get(kind).copied().unwrap_or(0)
            };
            assert_eq!(
                (
                    more(&now.failures, &before.failures, "cancelled"),
                    more(&now.failures, &before.failures, "peer_failed"),
                    now.own_failures.values().sum::<u64>()
                        - before.own_failures.values().sum::<u64>(),
                    now.batches_failed - before.batches_failed,
                ),
                (2, 0, 0, 2),
                "{what}: rank {rank}: {:?}, own {:?}",
                now.failures,
                now.own_failures
            );
        }
        rs[fail as usize].faults.clear();
        4
    });
}

#[test]
fn a_batch_refused_as_busy_on_one_rank_still_meets_the_group() {
    let t0 = Instant::now();
    for path in paths() {
        for (mode, cfg) in configs() {
            let cfg = LinkerConfig {
                max_in_flight: 2,
                ..cfg
            };
            for fail in 0..TP {
                let what = format!("busy: {path:?} {mode} rank {fail}");
                let (rs, hashes) = tp_ranks(&mixed_spec(), TP, store(), PAGES, &cfg, path);
                let base = run_ok(&rs, 1, &hashes, &what);
                // Batches 2 and 3: the failing rank leaves their outcomes untaken.
                let mut kept = vec![];
                for b in [2, 3] {
                    let t = each(&rs, |rank, r| {
                        let t = r
                            .linker
                            .start_load(load_plan(
                                r.linker.geometry(),
                                b,
                                &hashes,
                                batch_slots(rank, b),
                            ))
                            .unwrap();
                        wait_all(&r.linker, &t).unwrap();
                        if rank != fail {
                            assert!(r.linker.wait_batch(&t).unwrap().result.is_ok());
                        }
                        t
                    });
                    kept.push(t[fail as usize]);
                }
                // Batch 4: the failing rank is full.
                let four = each(&rs, |rank, r| {
                    let plan = load_plan(r.linker.geometry(), 4, &hashes, batch_slots(rank, 4));
                    match r.linker.start_load(plan) {
                        Err(e @ KvLoadError::Busy { .. }) => {
                            assert_eq!(rank, fail);
                            // The peers fail batch 4 (below): this rank recomputes it too.
                            // Before, `RetryLater`: a start of it again met peers past it.
                            assert_eq!(e.action(), EngineAction::Recompute, "{what}: {e}");
                            "busy".to_string()
                        }
                        Err(e) => panic!("{what}: rank {rank}: {e}"),
                        Ok(t) => {
                            let _ = wait_all(&r.linker, &t);
                            verdict(&r.linker.wait_batch(&t).unwrap().result)
                        }
                    }
                });
                // The full rank still met its peers at batch 4's gate, failed: they fail it
                // with `PeerFailed` naming it (not at their collective timeout).
                for (rank, v) in four.iter().enumerate() {
                    let expected = if rank as u32 == fail {
                        "busy".to_string()
                    } else {
                        format!("peer_failed/{fail}")
                    };
                    assert_eq!(*v, expected, "{what}: rank {rank}");
                }
                for t in kept {
                    assert!(rs[fail as usize]
                        .linker
                        .wait_batch(&t)
                        .unwrap()
                        .result
                        .is_ok());
                }
                for b in [5, 6] {
                    assert_eq!(run_ok(&rs, b, &hashes, &what), base, "{what}: batch {b}");
                }
            }
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
}

#[test]
fn a_duplicate_batch_id_on_one_rank_is_refused_and_nothing_shifts() {
    every_case("duplicate", false, |rs, hashes, fail, what| {
        let loaded = each(rs, |rank, r| {
            let g = r.linker.geometry().clone();
            let t = r
                .linker
                .start_load(load_plan(&g, 2, hashes, r.slots.clone()))
                .unwrap();
            if rank == fail {
                let again = r
                    .linker
                    .start_load(load_plan(&g, 2, hashes, r.slots.clone()));
                assert!(
                    matches!(again, Err(KvLoadError::DuplicateBatch { .. })),
                    "{what}: {again:?}"
                );
            }
            wait_all(&r.linker, &t).map_err(|e| format!("rank {rank}: {e}"))?;
            r.linker
                .wait_batch(&t)
                .unwrap()
                .result
                .map_err(|e| e.to_string())
        });
        // Nothing lost: the batch in flight loaded on every rank.
        for l in loaded {
            l.unwrap_or_else(|e| panic!("{what}: {e}"));
        }
        3
    });
}

/// One rank's plan lands in a slot of its batch whose outcome it has not taken: that rank
/// refuses the batch (`SlotInFlight`), every other rank fails it (no hang), and the group
/// goes on in step.
#[test]
fn a_slot_in_flight_on_one_rank_fails_the_batch_on_every_rank() {
    every_case("slot in flight", false, |rs, hashes, fail, what| {
        let loaded = each(rs, |rank, r| {
            let g = r.linker.geometry().clone();
            let two = r
                .linker
                .start_load(load_plan(&g, 2, hashes, batch_slots(rank, 2)))
                .unwrap();
            wait_all(&r.linker, &two).unwrap();
            if rank != fail {
                assert!(r.linker.wait_batch(&two).unwrap().result.is_ok());
                let t = r
                    .linker
                    .start_load(load_plan(&g, 3, hashes, batch_slots(rank, 3)))
                    .unwrap();
                let _ = wait_all(&r.linker, &t);
                return r
                    .linker
                    .wait_batch(&t)
                    .unwrap()
                    .result
                    .map_err(|e| e.kind_name());
            }
            // Batch 3 into batch 2's slots, whose outcome this rank has not taken.
            let three = r
                .linker
                .start_load(load_plan(&g, 3, hashes, batch_slots(rank, 2)));
            let refused = match three {
                Err(KvLoadError::InvalidPlan {
                    reason: PlanError::SlotInFlight { batch, .. },
                    ..
                }) => batch,
                other => panic!("{what}: {:?}", other.map(|t| t.batch)),
            };
            assert_eq!(refused, BatchId(2), "{what}");
            assert!(r.linker.wait_batch(&two).unwrap().result.is_ok());
            Err("refused")
        });
        for (rank, l) in loaded.into_iter().enumerate() {
            let expected = if rank as u32 == fail {
                "refused"
            } else {
                "peer_failed"
            };
            assert_eq!(l.map(drop), Err(expected), "{what}: rank {rank}");
        }
        4
    });
}

/// An engine aborts a request mid-load on one rank (`abandon`, then its outcome, which is
/// what `LoadHandle::abort` does): that rank's wait for the outcome returns within its
/// deadline, the ranks agree on the batch (`PeerFailed` naming the aborting rank on every
/// rank, itself included, or every rank loaded where the load ended first), and the next
/// batches load in the group's mode.
#[test]
fn a_batch_aborted_on_one_rank_fails_it_on_every_rank_and_nothing_shifts() {
    let mid_load = std::sync::atomic::AtomicUsize::new(0);
    every_case("aborted", false, |rs, hashes, fail, what| {
        // The aborting rank's own reads are slow, so that its abort lands mid-load.
        rs[fail as usize].faults.inject(
            FaultRule {
                key_contains: Some("_v".into()),
                ..FaultRule::default()
            },
            Fault::Delay(Duration::from_millis(60)),
        );
        let verdicts = each(rs, |rank, r| {
            let g = r.linker.geometry().clone();
            let t = r
                .linker
                .start_load(load_plan(&g, 2, hashes, r.slots.clone()))
                .unwrap();
            if rank != fail {
                let _ = wait_all(&r.linker, &t);
                return verdict(&r.linker.wait_batch(&t).unwrap().result);
            }
            let _ = r.linker.wait_layer(&t, 0);
            r.linker.abandon(&t);
            let t0 = Instant::now();
            let outcome = r.linker.wait_batch(&t);
            let took = t0.elapsed();
            assert!(took < Duration::from_secs(10), "{what}: {took:?}");
            verdict(&outcome.unwrap_or_else(|e| panic!("{what}: {e}")).result)
        });
        rs[fail as usize].faults.clear();
        let aborting = &verdicts[fail as usize];
        if aborting != "loaded" {
            mid_load.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        for (rank, v) in verdicts.iter().enumerate() {
            let expected = match aborting.as_str() {
                "loaded" => "loaded".to_string(),
                _ => format!("peer_failed/{fail}"),
            };
            assert_eq!(*v, expected, "{what}: rank {rank} ({verdicts:?})");
        }
        3
    });
    // Each of the 24 cases either aborted mid-load or loaded first; most must have aborted
    // (the aborting rank's reads are slowed), else the abort went untested.
    let aborted = mid_load.load(std::sync::atomic::Ordering::Relaxed);
    assert!(aborted >= 12, "only {aborted} of 24 cases aborted mid-load");
}

#[test]
fn a_store_error_in_a_lookup_on_one_rank_leaves_the_control_channel_in_step() {
    every_case("lookup", false, |rs, hashes, fail, what| {
        let tokens = prompt(11, PAGES, 4);
        rs[fail as usize].faults.inject_on(
            FaultCall::Exists,
            FaultRule {
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Error(StoreError::Unavailable {
                detail: "injected".into(),
            }),
        );
        let req = LookupRequest {
            tokens: &tokens,
            skip_pages: 0,
        };
        let first = each(rs, |_, r| r.linker.lookup(&req).map(|h| h.pages.len()));
        for (rank, got) in first.iter().enumerate() {
            match got {
                Err(_) => assert_eq!(rank as u32, fail, "{what}"),
                Ok(n) => assert_eq!(*n, 0, "{what}: rank {rank} may load nothing"),
            }
        }
        for round in 0..2 {
            let hits = each(rs, |_, r| r.linker.lookup(&req).map(|h| h.pages));
            for (rank, h) in hits.into_iter().enumerate() {
                let h = h.unwrap_or_else(|e| panic!("{what}: round {round} rank {rank}: {e}"));
                assert_eq!(h, hashes, "{what}: round {round} rank {rank}");
            }
        }
        2
    });
}

#[test]
fn a_device_error_while_landing_on_one_rank_leaves_the_group_in_step() {
    every_case("landing", true, |rs, hashes, fail, what| {
        // The failing rank's fourth host-to-device copy of batch 2 fails to enqueue (a layer's
        // own rows, or its share's upload, wherever the mode puts it).
        rs[fail as usize]
            .device
            .as_ref()
            .unwrap()
            .fail_enqueue(CpuOp::ToDevice, 3);
        let outcomes = common::tp::run(rs, 2, hashes);
        // Every rank fails the batch with `PeerFailed` naming the failing rank (its own
        // error gated to the others, not a timeout of theirs).
        for (rank, o) in outcomes.iter().enumerate() {
            assert_eq!(
                verdict(&o.result),
                format!("peer_failed/{fail}"),
                "{what}: rank {rank}: {o:?}"
            );
        }
        3
    });
}

#[test]
fn a_rank_whose_collectives_shift_is_caught_and_the_group_resynchronises() {
    let t0 = Instant::now();
    for path in paths() {
        for (mode, cfg) in configs() {
            for fail in 0..TP {
                let what = format!("shift: {path:?} {mode} rank {fail}");
                // Batch 1 exchanges 6 status words (5 layers and the verdict); the failing
                // rank never issues batch 2's third.
                let wrap = |rank: u32, g: TpGroup| {
                    if rank != fail {
                        return g;
                    }
                    let data: Arc<dyn kvlink::dedup_broadcast::Collective> =
                        Misbehaving::new(g.data.clone(), Misbehave::SkipStatus { nth: 8 });
                    TpGroup { data, ..g }
                };
                let (rs, hashes) = tp_ranks_built(
                    &mixed_spec(),
                    TP,
                    store(),
                    PAGES,
                    &cfg,
                    path,
                    &RankBuild::wrapped(&wrap),
                );
                let base = run_ok(&rs, 1, &hashes, &what);
                let outcomes = common::tp::run(&rs, 2, &hashes);
                assert!(
                    outcomes.iter().all(|o| o.result.is_err()),
                    "{what}: {outcomes:?}"
                );
                for b in [3, 4] {
                    assert_eq!(run_ok(&rs, b, &hashes, &what), base, "{what}: batch {b}");
                }
            }
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
}

/// The batch rank 1 runs from `first` to 12 in turn (each waited for), while ranks 0 and 2
/// run batch 12: what each of rank 1's batches ended as, in order, and ranks 0's and 2's.
fn rank_1_behind_from(rs: &[TpRank], hashes: &[PageHash], first: u64) -> Vec<Vec<String>> {
    each(rs, |rank, r| {
        let batches: Vec<u64> = if rank == 1 {
            (first..=12).collect()
        } else {
            vec![12]
        };
        batches
            .into_iter()
            .map(|b| {
                let t = r
                    .linker
                    .start_load(load_plan(r.linker.geometry(), b, hashes, r.slots.clone()))
                    .unwrap();
                let _ = wait_all(&r.linker, &t);
                match r.linker.wait_batch(&t).unwrap().result {
                    Ok(_) => "loaded".to_string(),
                    Err(e) => e.to_string(),
                }
            })
            .collect()
    })
}

/// A rank one batch behind its peers (it starts batch 11 where they start 12) has that batch
/// skipped to catch up, and every rank then loads batch 12 together (the peers hold their
/// gate once more); on both pool paths.
#[test]
fn a_rank_one_batch_behind_skips_it_and_the_group_loads_the_next_together() {
    for path in paths() {
        let cfg = &configs()[0].1;
        let (rs, hashes) = tp_ranks(&mixed_spec(), TP, store(), PAGES, cfg, path);
        run_ok(&rs, 1, &hashes, "first");
        let ended = rank_1_behind_from(&rs, &hashes, 11);
        assert!(
            ended[1][0].contains("skipped to catch up"),
            "{path:?}: {ended:?}"
        );
        for (rank, e) in ended.iter().enumerate() {
            assert_eq!(
                e.last().unwrap(),
                "loaded",
                "{path:?}: rank {rank}: {ended:?}"
            );
        }
        for r in &rs {
            assert_eq!(r.linker.metrics().group_reforms, 0, "{path:?}");
        }
    }
}

/// A rank further behind than the gate catches up (its peers hold their gate nine times,
/// each time meeting one more of its batches, skipped): the peers fail the batch, the group
/// is aborted and re-forms, and the next batch loads on every rank; on both pool paths.
#[test]
fn a_rank_more_than_nine_batches_behind_aborts_the_group_and_the_next_batch_loads() {
    for path in paths() {
        let what = format!("{path:?}");
        let cfg = &configs()[0].1;
        let (rs, hashes) = tp_ranks(&mixed_spec(), TP, store(), PAGES, cfg, path);
        run_ok(&rs, 1, &hashes, &what);
        let ended = rank_1_behind_from(&rs, &hashes, 2);
        for rank in [0, 2] {
            assert!(
                ended[rank][0].contains("still out of step after 9 gates"),
                "{what}: rank {rank}: {ended:?}"
            );
        }
        // The first nine of rank 1's batches met the peers' nine gates, each skipped.
        for e in &ended[1][..9] {
            assert!(e.contains("skipped to catch up"), "{what}: {ended:?}");
        }
        run_ok(&rs, 13, &hashes, &what);
        assert!(
            rs.iter().all(|r| r.linker.metrics().group_reforms >= 1),
            "{what}"
        );
    }
}
