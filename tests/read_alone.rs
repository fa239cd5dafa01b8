//! `GroupFallback::ReadAlone` when only one rank finds the group down: that rank loads (and
//! looks up) alone without meeting the others, so their gate (their lookup's collective)
//! fails; they load (look up) alone too, and every rank ends the batch loaded, every byte
//! right, none failed while another reported the batch loaded.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::coll::{Misbehave, Misbehaving};
use common::tp::{config, mixed_spec, rank_matches, run, tp_ranks_built, Path, RankBuild};
use kvlink::dedup_broadcast::{Collective, CollectiveError, GroupFormation, GroupHandles};
use kvlink::kv_loader::{KvLoader, LookupRequest, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{GroupFallback, LinkerConfig, TpGroup};

/// A formation that never forms (the rank's peers are not back, as it sees it).
struct NeverForms;

impl GroupFormation for NeverForms {
    fn reform(
        &self,
        _rank: u32,
        _epoch: u64,
        _deadline: Instant,
    ) -> Result<GroupHandles, CollectiveError> {
        Err(CollectiveError::Backend(
            "the test's formation never forms".into(),
        ))
    }
}

/// Rank 1's handles are gone and it cannot re-form: it finds the group down. The other ranks'
/// handles are whole and have no formation.
fn split(rank: u32, g: TpGroup) -> TpGroup {
    if rank == 1 {
        let gone = |h: Arc<dyn Collective>| {
            let m = Misbehaving::new(h, Misbehave::SkipStatus { nth: u64::MAX });
            m.leave();
            m as Arc<dyn Collective>
        };
        TpGroup {
            data: gone(g.data),
            control: gone(g.control),
            formation: Some(Arc::new(NeverForms)),
        }
    } else {
        TpGroup {
            formation: None,
            ..g
        }
    }
}

fn alone_config(mode: ShareMode) -> LinkerConfig {
    LinkerConfig {
        group_fallback: GroupFallback::ReadAlone,
        collective_timeout: Duration::from_millis(500),
        ..config(mode)
    }
}

#[test]
fn a_rank_that_alone_finds_the_group_down_leaves_no_rank_failing_the_batch() {
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let build = RankBuild::wrapped(&split);
        let (rs, hashes) = tp_ranks_built(
            &mixed_spec(),
            3,
            store,
            5,
            &alone_config(mode),
            Path::Host,
            &build,
        );
        for batch in 1..=2 {
            let outcomes = run(&rs, batch, &hashes);
            for (rank, (r, o)) in rs.iter().zip(outcomes).enumerate() {
                let stats = o
                    .result
                    .unwrap_or_else(|e| panic!("{mode:?} batch {batch} rank {rank}: {e}"));
                assert_eq!(stats.mode, ShareMode::AllRanks, "rank {rank}");
                assert!(stats.alone.is_some(), "{mode:?} batch {batch} rank {rank}");
                rank_matches(r, &hashes, rank as u32)
                    .unwrap_or_else(|e| panic!("{mode:?} batch {batch}: {e}"));
                // Counted for an operator to alert on, not only in each batch's stats.
                assert_eq!(r.linker.metrics().batches_alone, batch, "rank {rank}");
            }
        }
    }
}

#[test]
fn lookups_go_alone_on_every_rank_when_one_rank_finds_the_group_down() {
    lookups_alone_with_page_gone(None);
}

/// The same with page 3's replicated `k` gone: every rank alone finds 3 pages, the ranks
/// other than 0 too, though in the group they leave the replicated objects to rank 0.
#[test]
fn lookups_alone_ask_for_the_replicated_objects_on_every_rank() {
    lookups_alone_with_page_gone(Some(3));
}

/// One rank finds the group down; every rank looks up alone, with the replicated `k` of
/// page `gone` removed first (if any): every rank's hit ends there.
fn lookups_alone_with_page_gone(gone: Option<usize>) {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let build = RankBuild::wrapped(&split);
    let cfg = alone_config(ShareMode::SplitAllGather);
    let (rs, hashes) = tp_ranks_built(&mixed_spec(), 3, store.clone(), 5, &cfg, Path::Host, &build);
    if let Some(page) = gone {
        let plan = common::load_plan(rs[0].linker.geometry(), 9, &hashes, vec![0; 5]);
        let keys = rs[0].linker.object_keys(&plan).unwrap();
        assert!(store.remove(&[keys[0][page].as_str()])[0].is_ok());
    }
    let expected = gone.unwrap_or(hashes.len());
    let tokens = common::prompt(11, hashes.len(), mixed_spec().page_size);
    let hits: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = rs
            .iter()
            .map(|r| {
                let tokens = &tokens;
                s.spawn(move || {
                    r.linker.lookup(&LookupRequest {
                        tokens,
                        skip_pages: 0,
                    })
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, hit) in hits.into_iter().enumerate() {
        let hit = hit.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(hit.pages.len(), expected, "rank {rank}");
        assert_eq!(rs[rank].linker.metrics().lookups_alone, 1, "rank {rank}");
    }
}

/// Loads batch `batch` on rank `r` into its slots; the outcome's result.
fn load(
    r: &common::tp::TpRank,
    batch: u64,
    hashes: &[kvlink::kv_geometry::PageHash],
) -> Result<kvlink::kv_loader::LoadStats, kvlink::kv_loader::KvLoadError> {
    let plan = common::load_plan(r.linker.geometry(), batch, hashes, r.slots.clone());
    let t = r.linker.start_load(plan).unwrap();
    let _ = common::wait_all(&r.linker, &t);
    r.linker.wait_batch(&t).unwrap().result
}

/// Two ranks with `ReadAlone` whose gates wait `collective_timeout` for each other.
fn two_alone_ranks(
    collective_timeout: Duration,
) -> (Vec<common::tp::TpRank>, Vec<kvlink::kv_geometry::PageHash>) {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = LinkerConfig {
        collective_timeout,
        ..alone_config(ShareMode::SplitAllGather)
    };
    common::tp::tp_ranks(&mixed_spec(), 2, store, 5, &cfg, Path::Host)
}

/// A rank the group went past loads the batch alone when its peers loaded it alone. Rank 1
/// comes to batch 1 first: its gate times out (rank 0 is not there), the group breaks, and it
/// loads batch 1 alone; at batch 2 it re-forms the group and meets rank 0, only now at batch
/// 1. Before, rank 0 failed batch 1 (behind the group) while rank 1 had loaded it.
#[test]
fn a_rank_the_group_went_past_loads_alone_a_batch_its_peers_loaded_alone() {
    let (rs, hashes) = two_alone_ranks(Duration::from_secs(2));
    let one_1 = load(&rs[1], 1, &hashes).expect("rank 1, batch 1: alone");
    assert!(one_1.alone.is_some(), "{one_1:?}");
    let (zero, one_2) = std::thread::scope(|s| {
        let one = s.spawn(|| load(&rs[1], 2, &hashes));
        let zero = [load(&rs[0], 1, &hashes), load(&rs[0], 2, &hashes)];
        (zero, one.join().unwrap())
    });
    let [zero_1, zero_2] = zero;
    let zero_1 = zero_1.expect("rank 0, batch 1: behind the group, it loads alone");
    let why = zero_1.alone.clone().unwrap_or_default();
    assert!(why.contains("went on past"), "{why:?}");
    for (rank, stats) in [(0, zero_2), (1, one_2)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank {rank}, batch 2: {e}"));
        assert!(stats.alone.is_none(), "rank {rank}: batch 2 in step");
    }
    for (rank, r) in rs.iter().enumerate() {
        rank_matches(r, &hashes, rank as u32).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// ... also when the engine's batch ids leave gaps (it numbers batches by scheduler step).
/// Rank 1 loads batches 1 and 100 alone (its gate at 1 times out; at 100 the group cannot
/// re-form without rank 0), then meets rank 0 at 200 while rank 0 is at batch 1. Before, the
/// gate word told only of the last 64 ids (100 back to 37): rank 0 failed batch 1, which rank
/// 1 had loaded.
#[test]
fn batch_ids_far_apart_still_tell_a_rank_behind_what_its_peer_loaded_alone() {
    let (rs, hashes) = two_alone_ranks(Duration::from_secs(2));
    for batch in [1, 100] {
        let stats = load(&rs[1], batch, &hashes).expect("rank 1 alone");
        assert!(stats.alone.is_some(), "rank 1, batch {batch}: {stats:?}");
    }
    let (zero, one_200) = std::thread::scope(|s| {
        let one = s.spawn(|| load(&rs[1], 200, &hashes));
        let zero = [1, 100, 200].map(|b| load(&rs[0], b, &hashes));
        (zero, one.join().unwrap())
    });
    let [zero_1, zero_100, zero_200] = zero;
    for (batch, stats) in [(1, zero_1), (100, zero_100)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank 0, batch {batch}: {e}"));
        let why = stats.alone.clone().unwrap_or_default();
        assert!(why.contains("went on past"), "batch {batch}: {why:?}");
    }
    for (rank, stats) in [(0, zero_200), (1, one_200)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank {rank}, batch 200: {e}"));
        assert!(stats.alone.is_none(), "rank {rank}: batch 200 in step");
    }
    for (rank, r) in rs.iter().enumerate() {
        rank_matches(r, &hashes, rank as u32).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}

/// ... and fails it when a peer ahead failed it. Rank 1 refuses batch 1 (a slot twice): its
/// refusal meets no one by the timeout and the group breaks; at batch 2 it re-forms and meets
/// rank 0, only now at batch 1. Rank 0 must not load a batch rank 1 failed (its gate word says
/// it did not load it alone); it fails it as behind the group, and batch 2 loads on both.
#[test]
fn a_rank_the_group_went_past_fails_a_batch_a_peer_failed() {
    let timeout = Duration::from_secs(2);
    let (rs, hashes) = two_alone_ranks(timeout);
    refuse(&rs[1], 1, &hashes);
    // Both come once the refusal's gate gave up (queued first on rank 1's load thread).
    std::thread::sleep(timeout + Duration::from_secs(1));
    let (zero, one_2) = std::thread::scope(|s| {
        let one = s.spawn(|| load(&rs[1], 2, &hashes));
        let zero = [load(&rs[0], 1, &hashes), load(&rs[0], 2, &hashes)];
        (zero, one.join().unwrap())
    });
    let [zero_1, zero_2] = zero;
    behind_failure(zero_1, "rank 0, batch 1 (rank 1 refused it)");
    for (rank, stats) in [(0, zero_2), (1, one_2)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank {rank}, batch 2: {e}"));
        assert!(stats.alone.is_none(), "rank {rank}: batch 2 in step");
    }
}

/// A peer's later failure does not hide a batch it loaded alone. Rank 1 loads batch 1 alone
/// (its gate times out), then fails batch 2 (refused; its gate times out too), and meets rank 0
/// at batch 3 while rank 0 is at batch 1: rank 0 loads batch 1 alone (rank 1 did) and fails
/// batch 2 (rank 1 did). Before, the gate word kept only a run of batches loaded alone, which
/// batch 2 ended: rank 0 failed batch 1, which rank 1 had loaded.
#[test]
fn a_peers_later_failure_does_not_hide_a_batch_it_loaded_alone() {
    let timeout = Duration::from_secs(3);
    let (rs, hashes) = two_alone_ranks(timeout);
    let (zero, one) = std::thread::scope(|s| {
        let one = s.spawn(|| {
            let one_1 = load(&rs[1], 1, &hashes);
            refuse(&rs[1], 2, &hashes);
            (one_1, load(&rs[1], 3, &hashes))
        });
        // Rank 1's gates: batch 1 until 3 s, the refusal until 6 s, batch 3 until 9 s.
        std::thread::sleep(2 * timeout + timeout / 2);
        let zero = [1, 2, 3].map(|b| load(&rs[0], b, &hashes));
        (zero, one.join().unwrap())
    });
    let (one_1, one_3) = one;
    assert!(one_1.expect("rank 1, batch 1").alone.is_some());
    let [zero_1, zero_2, zero_3] = zero;
    let zero_1 = zero_1.expect("rank 0, batch 1: rank 1 loaded it alone");
    let why = zero_1.alone.clone().unwrap_or_default();
    assert!(why.contains("went on past"), "{why:?}");
    behind_failure(zero_2, "rank 0, batch 2 (rank 1 refused it)");
    for (rank, stats) in [(0, zero_3), (1, one_3)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank {rank}, batch 3: {e}"));
        assert!(stats.alone.is_none(), "rank {rank}: batch 3 in step");
    }
}

/// A rank far behind still settles each batch as the ranks ahead did once they stopped
/// waiting for it. Rank 1 runs batches 1 to 10 without rank 0 (the group down): it refuses 1
/// and 10 and loads 2 to 9 alone. It meets rank 0 at batch 11 while rank 0 is at batch 1, and
/// gates 11 again while rank 0 catches up, 9 times in all; then it gives up, aborts the group
/// and loads 11 alone. Rank 0's batch 10 finds the group down: it must fail it (rank 1 did),
/// not load it alone as a rank that merely finds the group down does. Before, it loaded it.
#[test]
fn a_rank_far_behind_fails_a_batch_a_peer_ahead_failed_after_the_group_broke() {
    let timeout = Duration::from_secs(2);
    let (rs, hashes) = two_alone_ranks(timeout);
    refuse(&rs[1], 1, &hashes);
    for batch in 2..=9 {
        let stats = load(&rs[1], batch, &hashes).expect("rank 1 alone");
        assert!(stats.alone.is_some(), "rank 1, batch {batch}: {stats:?}");
    }
    refuse(&rs[1], 10, &hashes);
    // The refusal's attempt to re-form the group ends by the timeout.
    std::thread::sleep(timeout + Duration::from_secs(1));
    let (zero, one_11) = std::thread::scope(|s| {
        let one = s.spawn(|| load(&rs[1], 11, &hashes));
        let zero: Vec<_> = (1..=11).map(|b| load(&rs[0], b, &hashes)).collect();
        (zero, one.join().unwrap())
    });
    let one_11 = one_11.expect("rank 1, batch 11: alone once it gave up");
    assert!(one_11.alone.is_some(), "{one_11:?}");
    let mut zero = zero.into_iter();
    behind_failure(zero.next().unwrap(), "rank 0, batch 1 (rank 1 refused it)");
    for batch in 2..=9 {
        let stats = zero.next().unwrap();
        let stats = stats.unwrap_or_else(|e| panic!("rank 0, batch {batch}: {e}"));
        let why = stats.alone.clone().unwrap_or_default();
        assert!(
            why.contains("went on past"),
            "rank 0, batch {batch}: {why:?}"
        );
    }
    behind_failure(zero.next().unwrap(), "rank 0, batch 10 (rank 1 refused it)");
    let zero_11 = zero
        .next()
        .unwrap()
        .expect("rank 0, batch 11: alone, as rank 1");
    assert!(zero_11.alone.is_some(), "{zero_11:?}");
    rank_matches(&rs[0], &hashes, 0).unwrap();
}

/// `got` is the failure of a batch its rank skipped as behind the group.
fn behind_failure(
    got: Result<kvlink::kv_loader::LoadStats, kvlink::kv_loader::KvLoadError>,
    what: &str,
) {
    match got {
        Err(e @ kvlink::kv_loader::KvLoadError::Collective { .. }) => {
            assert!(e.to_string().contains("skipped to catch up"), "{what}: {e}")
        }
        other => panic!("{what}: {other:?}"),
    }
}

/// Rank `r` refuses batch `batch`: its plan names one slot twice, so `start_load` fails
/// (the batch still goes through the gate, where the rank says it did not load it).
fn refuse(r: &common::tp::TpRank, batch: u64, hashes: &[kvlink::kv_geometry::PageHash]) {
    let mut twice = common::load_plan(r.linker.geometry(), batch, hashes, r.slots.clone());
    twice.slots[1] = twice.slots[0];
    assert!(
        r.linker.start_load(twice).is_err(),
        "batch {batch}: a slot twice is refused"
    );
}
