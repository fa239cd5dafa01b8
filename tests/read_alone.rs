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
            }
        }
    }
}

#[test]
fn lookups_go_alone_on_every_rank_when_one_rank_finds_the_group_down() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let build = RankBuild::wrapped(&split);
    let cfg = alone_config(ShareMode::SplitAllGather);
    let (rs, hashes) = tp_ranks_built(&mixed_spec(), 3, store, 5, &cfg, Path::Host, &build);
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
        assert_eq!(hit.pages.len(), hashes.len(), "rank {rank}");
    }
}

/// A rank the group went past (its peers settled a batch without it, and met again at a later
/// one) loads that batch alone too when it comes to it. Before, its gate found it behind and it
/// failed the batch a peer had loaded alone. Here rank 1's engine starts batch 2 before batch
/// 1: the gate rank 0 meets at batch 1 is the one a peer that loaded batch 1 alone (the group
/// down) and came back at batch 2 leaves it.
#[test]
fn a_rank_the_group_went_past_loads_the_batch_alone_too() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_secs(2),
        ..alone_config(ShareMode::SplitAllGather)
    };
    let (rs, hashes) = common::tp::tp_ranks(&mixed_spec(), 2, store, 5, &cfg, Path::Host);
    let load = |r: &common::tp::TpRank, batch| {
        let plan = common::load_plan(r.linker.geometry(), batch, &hashes, r.slots.clone());
        let t = r.linker.start_load(plan).unwrap();
        let _ = common::wait_all(&r.linker, &t);
        r.linker.wait_batch(&t).unwrap().result
    };
    let (zero, one) = std::thread::scope(|s| {
        let zero = s.spawn(|| [load(&rs[0], 1), load(&rs[0], 2)]);
        let one = s.spawn(|| [load(&rs[1], 2), load(&rs[1], 1)]);
        (zero.join().unwrap(), one.join().unwrap())
    });
    let [zero_1, zero_2] = zero;
    let [one_2, one_1] = one;
    let zero_1 = zero_1.expect("rank 0, batch 1: behind the group, it loads alone");
    assert!(zero_1.alone.is_some(), "{zero_1:?}");
    // Rank 1 comes to batch 1 alone: its gate fails by the timeout, and it loads alone too.
    assert!(one_1.expect("rank 1, batch 1").alone.is_some());
    for (rank, stats) in [(0, zero_2), (1, one_2)] {
        let stats = stats.unwrap_or_else(|e| panic!("rank {rank}, batch 2: {e}"));
        assert!(stats.alone.is_none(), "rank {rank}: batch 2 in step");
    }
    for (rank, r) in rs.iter().enumerate() {
        rank_matches(r, &hashes, rank as u32).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
}
