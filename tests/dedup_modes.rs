//! Sharing replicated KV among TP ranks (threads, in-process group, embedded store): every
//! mode lands the same bytes as every rank reading its own copy, reads each byte once, falls
//! back on a plan mismatch, and fails symmetrically.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tp::{
    fail_v_read, poison_all, rank_matches, run, same_verdict, tp_ranks, tp_ranks_built, Path,
    RankBuild, TpRank,
};
use common::*;
use kvlink::kv_geometry::{ComponentSpec, ElementType, LayerMap, ModelKvSpec, PageHash, RowUnit};
use kvlink::kv_loader::{BatchOutcome, KvLoadError, KvLoader, LookupRequest, ShareMode};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, KvStore, ReadSession, StoreError,
};
use kvlink::mooncake_linker::{LinkerConfig, ReadGranularity};
use proptest::prelude::*;

const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

/// A DSA-like model plus a sharded component (a `v` of 32 B per token, 4 heads), so a batch
/// mixes shared and per-rank reads.
fn mixed_spec() -> ModelKvSpec {
    common::tp::mixed_spec_with_v(32, 4)
}

fn cfg(mode: ShareMode) -> LinkerConfig {
    LinkerConfig {
        namespace: "dedup".into(),
        mode: ModeChoice::Fixed(mode),
        wait_deadline: Duration::from_secs(10),
        collective_timeout: Duration::from_secs(5),
        // One layer per store call: the failure tests name the layer a fault hits.
        read_granularity: ReadGranularity::Fixed { layers_per_call: 1 },
        ..LinkerConfig::default()
    }
}

/// Every rank of a TP group over `store` (host pools, scattered slots), after the prefix was
/// saved the way TP ranks save it (rank 0 writes replicated objects, every rank its shard).
fn ranks(
    spec: &ModelKvSpec,
    tp: u32,
    store: Arc<dyn KvStore>,
    pages: usize,
    config: &LinkerConfig,
) -> (Vec<TpRank>, Vec<PageHash>) {
    tp_ranks(spec, tp, store, pages, config, Path::Host)
}

#[test]
fn every_mode_lands_every_rank_byte_identical_and_reads_once() {
    let spec = ModelKvSpec::glm52_dsa_fp8();
    let mut small = spec.clone();
    small.num_layers = 6;
    small.components[1].layers = LayerMap::Sparse(vec![0, 3]);
    for tp in [2u32, 4] {
        for mode in MODES {
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, pages) = ranks(&small, tp, store, 5, &cfg(mode));
            let outcomes = run(&rs, 1, &pages);
            let g = rs[0].linker.geometry().clone();
            let one_copy = 5 * g.bytes_per_page();
            let mut total = 0;
            for (rank, (r, o)) in rs.iter().zip(&outcomes).enumerate() {
                let stats = o
                    .result
                    .as_ref()
                    .unwrap_or_else(|e| panic!("tp{tp} {mode:?} rank {rank}: {e}"));
                assert_eq!(stats.mode, mode);
                assert_eq!(
                    stats.bytes_landed, one_copy,
                    "every rank's pool got every byte"
                );
                rank_matches(r, &pages, rank as u32).unwrap();
                total += stats.bytes_read;
                if mode == ShareMode::Rank0Broadcast {
                    assert_eq!(stats.bytes_read, if rank == 0 { one_copy } else { 0 });
                }
                if mode == ShareMode::SplitAllGather {
                    assert!(
                        stats.bytes_read < one_copy,
                        "rank {rank} read only its share"
                    );
                }
            }
            let expected_total = if mode == ShareMode::AllRanks {
                one_copy * u64::from(tp)
            } else {
                one_copy
            };
            assert_eq!(
                total, expected_total,
                "tp{tp} {mode:?}: store bytes over all ranks"
            );
        }
    }
}

#[test]
fn sharded_components_are_read_per_rank_in_every_mode() {
    for mode in MODES {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, pages) = ranks(&mixed_spec(), 2, store, 6, &cfg(mode));
        for (rank, (r, o)) in rs.iter().zip(run(&rs, 1, &pages)).enumerate() {
            o.result.unwrap();
            rank_matches(r, &pages, rank as u32).unwrap();
        }
    }
}

#[test]
fn plans_that_differ_fall_back_to_all_ranks() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, pages) = ranks(&mixed_spec(), 2, store, 4, &cfg(ShareMode::SplitAllGather));
    let outcomes: Vec<BatchOutcome> = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let pages = &pages;
                s.spawn(move || {
                    let mut plan = load_plan(r.linker.geometry(), 1, pages, r.slots.clone());
                    if rank == 1 {
                        plan.logical.requests[0].request = "another-request-id".into();
                    }
                    let t = r.linker.start_load(plan).unwrap();
                    wait_all(&r.linker, &t).unwrap();
                    r.linker.wait_batch(&t).unwrap()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, (r, o)) in rs.iter().zip(outcomes).enumerate() {
        let stats = o.result.unwrap();
        assert_eq!(stats.mode, ShareMode::AllRanks);
        assert_eq!(stats.plans_differ, vec![1], "the fallback is in the stats");
        rank_matches(r, &pages, rank as u32).unwrap();
    }
    // The next batch, with agreeing plans, shares again.
    for o in run(&rs, 2, &pages) {
        let stats = o.result.unwrap();
        assert_eq!(stats.mode, ShareMode::SplitAllGather);
        assert!(stats.plans_differ.is_empty());
    }
}

#[test]
fn a_failure_on_any_rank_at_any_layer_fails_every_rank_the_same_way() {
    let spec = mixed_spec();
    for mode in MODES {
        for fail_rank in [0u32, 1] {
            for layer in [0u32, 2, 4] {
                let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
                let (rs, pages) = ranks(&spec, 2, store, 4, &cfg(mode));
                // The failing rank's read of its own shard at `layer`: present in every mode.
                let r = &rs[fail_rank as usize];
                let key = format!("tp{fail_rank}_cp0_pp0_v");
                fail_v_read(&r.faults, r.linker.geometry(), key, layer);
                let t0 = Instant::now();
                let outcomes = run(&rs, 1, &pages);
                assert!(
                    t0.elapsed() < Duration::from_secs(5),
                    "no rank waited for a deadline"
                );
                same_verdict(
                    &outcomes,
                    fail_rank,
                    layer,
                    &format!("{mode:?} rank {fail_rank} layer {layer}"),
                );
                for r in &rs {
                    assert_eq!(r.linker.metrics().batches_failed, 1);
                }
                // The next batch loads on every rank (the layers the failed one published
                // are poisoned first, so they cannot pass for this one's).
                poison_all(&rs);
                for (rank, (r, o)) in rs.iter().zip(run(&rs, 2, &pages)).enumerate() {
                    o.result
                        .unwrap_or_else(|e| panic!("{mode:?} after failure, rank {rank}: {e}"));
                    rank_matches(r, &pages, rank as u32).unwrap();
                }
            }
        }
    }
}

#[test]
fn a_failed_shared_read_on_the_reader_fails_every_rank() {
    // Rank 0 reads every replicated page in Rank0Broadcast; rank 1 reads half of them in
    // SplitAllGather: fail exactly those reads.
    let spec = mixed_spec();
    for (mode, fail_rank, page) in [
        (ShareMode::Rank0Broadcast, 0usize, 3usize),
        (ShareMode::SplitAllGather, 1, 3),
    ] {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, pages) = ranks(&spec, 2, store, 4, &cfg(mode));
        let g = rs[0].linker.geometry().clone();
        let k = g.component_by_name("k").unwrap();
        rs[fail_rank].faults.inject(
            FaultRule {
                key_contains: Some(format!("{}_cp0_pp0_k", pages[page])),
                offset: Some(k.layer_range(3).unwrap().start),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Short,
        );
        let outcomes = run(&rs, 1, &pages);
        same_verdict(&outcomes, fail_rank as u32, 3, &format!("{mode:?}"));
    }
}

/// At TP 3 in `SplitAllGather` each rank reads a share of the replicated pages for all: a
/// failed read on whichever rank reads a page (the middle one included) fails every rank
/// with `PeerFailed` naming that rank, and the next batch loads.
#[test]
fn a_failed_shared_read_on_any_reader_at_tp3_fails_every_rank() {
    // `v` of 12 heads: TP 3 divides it.
    let spec = common::tp::mixed_spec();
    let mut readers = Vec::new();
    for page in 0..6usize {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, pages) = ranks(&spec, 3, store, 6, &cfg(ShareMode::SplitAllGather));
        let k = rs[0]
            .linker
            .geometry()
            .component_by_name("k")
            .unwrap()
            .clone();
        // Armed on every rank: only the rank that reads the page for the group hits it.
        for r in &rs {
            r.faults.inject(
                FaultRule {
                    key_contains: Some(format!("{}_cp0_pp0_k", pages[page])),
                    offset: Some(k.layer_range(2).unwrap().start),
                    times: Some(1),
                    ..FaultRule::default()
                },
                Fault::Short,
            );
        }
        let outcomes = run(&rs, 1, &pages);
        let hit: Vec<u32> = rs.iter().map(|r| r.faults.faults_hit()).collect();
        let reader = hit.iter().position(|&h| h > 0).expect("the fault was hit") as u32;
        assert_eq!(
            hit.iter().sum::<u32>(),
            1,
            "page {page}: one reader: {hit:?}"
        );
        same_verdict(
            &outcomes,
            reader,
            2,
            &format!("page {page} read by rank {reader}"),
        );
        for r in &rs {
            r.faults.clear();
        }
        poison_all(&rs);
        for (rank, (r, o)) in rs.iter().zip(run(&rs, 2, &pages)).enumerate() {
            o.result
                .unwrap_or_else(|e| panic!("page {page}: the next batch, rank {rank}: {e}"));
            rank_matches(r, &pages, rank as u32).unwrap();
        }
        readers.push(reader);
    }
    readers.sort_unstable();
    readers.dedup();
    assert_eq!(readers, vec![0, 1, 2], "every rank read some page");
}

#[test]
fn a_rank_that_never_arrives_fails_the_others_within_the_deadline() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let config = LinkerConfig {
        collective_timeout: Duration::from_millis(300),
        ..cfg(ShareMode::Rank0Broadcast)
    };
    let (rs, pages) = ranks(&mixed_spec(), 2, store, 4, &config);
    // Rank 1's thread stops issuing collectives: it never starts the batch.
    let r = &rs[0];
    let t0 = Instant::now();
    let t = r
        .linker
        .start_load(load_plan(r.linker.geometry(), 1, &pages, r.slots.clone()))
        .unwrap();
    let err = r.linker.wait_layer(&t, 0).unwrap_err();
    // The gate's typed error stays its source, naming the rank that never came (it was
    // only words before).
    let KvLoadError::Collective { detail, .. } = &err else {
        panic!("{err}")
    };
    assert!(
        matches!(
            detail.downcast_ref::<kvlink::dedup_broadcast::CollectiveError>(),
            Some(kvlink::dedup_broadcast::CollectiveError::Timeout { missing, .. })
                if missing.contains(&1)
        ),
        "{err}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "failed within the deadline"
    );
    assert!(r.linker.wait_batch(&t).unwrap().result.is_err());
}

#[test]
fn lookups_agree_on_the_group_minimum() {
    let spec = mixed_spec();
    let full: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, pages) = ranks(&spec, 2, full.clone(), 6, &cfg(ShareMode::SplitAllGather));
    let tokens = prompt(11, 6, spec.page_size);
    // Rank 1's copy of its shard of page 4 is gone: rank 1 alone could load 4 pages.
    let keys = rs[1]
        .linker
        .object_keys(&load_plan(rs[1].linker.geometry(), 9, &pages, vec![0; 6]))
        .unwrap();
    assert!(full.remove(&[keys[2][4].as_str()])[0].is_ok());
    let hits: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| {
                let tokens = &tokens;
                s.spawn(move || {
                    r.linker
                        .lookup(&LookupRequest {
                            tokens,
                            skip_pages: 0,
                        })
                        .unwrap()
                        .pages
                        .len()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(hits, vec![4, 4]);
}

/// An engine that looks up from several threads of one rank (a tokio server's tasks, each on
/// a blocking thread): two lookups of one rank at once take the control handle in turn (a
/// collective's calls on one handle must not overlap), and agree with the peer's two. Before,
/// their gathers overlapped on the one handle.
#[test]
fn two_lookups_at_once_on_one_rank_take_turns_on_the_group() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let spec = mixed_spec();
    let full: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let most = Arc::new(AtomicUsize::new(0));
    let wrap = |rank: u32, mut g: kvlink::mooncake_linker::TpGroup| {
        if rank == 0 {
            g.control = Arc::new(common::coll::Overlaps::new(g.control, most.clone()));
            g.formation = None;
        }
        g
    };
    let build = RankBuild::wrapped(&wrap);
    let cfg = cfg(ShareMode::SplitAllGather);
    let (rs, _pages) = tp_ranks_built(&spec, 2, full, 6, &cfg, Path::Host, &build);
    let tokens = prompt(11, 6, spec.page_size);
    let lookup = |r: &TpRank| {
        r.linker
            .lookup(&LookupRequest {
                tokens: &tokens,
                skip_pages: 0,
            })
            .unwrap()
            .pages
            .len()
    };
    for _ in 0..5 {
        let hits: Vec<usize> = std::thread::scope(|s| {
            let at_once = [s.spawn(|| lookup(&rs[0])), s.spawn(|| lookup(&rs[0]))];
            let in_turn = s.spawn(|| [lookup(&rs[1]), lookup(&rs[1])]);
            let mut hits: Vec<usize> = at_once.into_iter().map(|h| h.join().unwrap()).collect();
            hits.extend(in_turn.join().unwrap());
            hits
        });
        assert_eq!(hits, vec![6; 4]);
    }
    assert_eq!(
        most.load(Ordering::Acquire),
        1,
        "gathers at once on rank 0's handle"
    );
}

/// Notes every key an `exists` asks for; everything else is forwarded.
struct ExistsKeys {
    inner: Arc<dyn KvStore>,
    asked: std::sync::Mutex<Vec<String>>,
}

// SAFETY: a test decorator: every call reaches the inner store with the caller's arguments
// and its results come back unchanged; it only notes keys.
unsafe impl KvStore for ExistsKeys {
    kvlink::mooncake_linker::forward_store_calls!(inner => object_size, get_into, get_ranges,
        put, remove, discard, register, unregister, start_session, end_session, health);

    fn name(&self) -> &str {
        "exists-keys"
    }

    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        let mut asked = self.asked.lock().unwrap();
        asked.extend(keys.iter().map(|k| k.to_string()));
        drop(asked);
        self.inner.exists(keys)
    }
}

/// In a TP group only rank 0 asks the store whether the replicated components' objects are
/// there (their keys are every rank's); the group's hit still ends where any is missing.
/// Before, every rank asked the same replicated keys (TP times the master's work per lookup).
#[test]
fn only_rank_0_asks_for_the_replicated_objects_at_lookup() {
    let spec = mixed_spec();
    let full: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let noted: Vec<Arc<ExistsKeys>> = (0..4)
        .map(|_| {
            Arc::new(ExistsKeys {
                inner: full.clone(),
                asked: Default::default(),
            })
        })
        .collect();
    let per_rank =
        |rank: u32, _: Arc<dyn KvStore>| -> Arc<dyn KvStore> { noted[rank as usize].clone() };
    let build = RankBuild {
        store: &per_rank,
        ..RankBuild::default()
    };
    let cfg = cfg(ShareMode::SplitAllGather);
    let (rs, pages) = tp_ranks_built(&spec, 4, full.clone(), 6, &cfg, Path::Host, &build);
    let tokens = prompt(11, 6, spec.page_size);
    // Page 4's replicated `k` is gone: the group's hit is 4 pages, on every rank.
    let keys = rs[0]
        .linker
        .object_keys(&load_plan(rs[0].linker.geometry(), 9, &pages, vec![0; 6]))
        .unwrap();
    assert!(full.remove(&[keys[0][4].as_str()])[0].is_ok());
    for n in &noted {
        n.asked.lock().unwrap().clear();
    }
    let hits: Vec<usize> = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| {
                let tokens = &tokens;
                s.spawn(move || {
                    let req = LookupRequest {
                        tokens,
                        skip_pages: 0,
                    };
                    r.linker.lookup(&req).unwrap().pages.len()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(hits, vec![4; 4]);
    for (rank, (n, r)) in noted.iter().zip(&rs).enumerate() {
        let asked = n.asked.lock().unwrap();
        let plan = load_plan(r.linker.geometry(), 9, &pages, vec![0; 6]);
        let components = r.linker.geometry().components();
        let (mut replicated, mut sharded) = (0, 0);
        for (c, keys) in components.iter().zip(r.linker.object_keys(&plan).unwrap()) {
            let n = keys.iter().filter(|k| asked.contains(k)).count();
            if c.replicated {
                replicated += n;
            } else {
                sharded += n;
            }
        }
        assert_eq!(sharded, 6, "rank {rank}: {asked:?}");
        let expected = if rank == 0 { 12 } else { 0 };
        assert_eq!(replicated, expected, "rank {rank}: {asked:?}");
        assert_eq!(
            asked.len(),
            sharded + replicated,
            "rank {rank}: only its keys"
        );
    }
}

/// A lookup reads ahead the companions each rank's load will read, in every mode: its
/// sharded component's on every page, and of the replicated ones the pages the mode has it
/// read (all in `AllRanks` and on rank 0 of `Rank0Broadcast`, none on the other ranks there,
/// its share in `SplitAllGather`); the load then reads none of them itself.
#[test]
fn a_lookup_reads_ahead_the_companions_each_ranks_load_reads_in_every_mode() {
    // TP 3: `v` of 12 heads (4 per rank).
    let spec = common::tp::mixed_spec();
    for mode in [
        ShareMode::AllRanks,
        ShareMode::Rank0Broadcast,
        ShareMode::SplitAllGather,
    ] {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
        let (rs, pages) = ranks(&spec, 3, store, 6, &cfg(mode));
        // `k` and `indexer` replicated, `v` sharded; 6 pages over 3 ranks.
        let expected = |rank: u32| -> u64 {
            let replicated = match mode {
                ShareMode::AllRanks => 6,
                ShareMode::Rank0Broadcast if rank == 0 => 6,
                ShareMode::Rank0Broadcast => 0,
                ShareMode::SplitAllGather => 2,
            };
            6 + 2 * replicated
        };
        std::thread::scope(|s| {
            for r in &rs {
                let pages = &pages;
                s.spawn(move || {
                    assert_eq!(r.linker.lookup_pages(pages, 0).unwrap().pages.len(), 6)
                });
            }
        });
        let limit = Instant::now() + Duration::from_secs(10);
        for (rank, r) in rs.iter().enumerate() {
            let want = expected(rank as u32);
            while r.linker.metrics().companions_prefetched < want && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(2));
            }
            assert_eq!(
                r.linker.metrics().companions_prefetched,
                want,
                "{mode:?} rank {rank}"
            );
        }
        for (rank, (r, o)) in rs.iter().zip(run(&rs, 1, &pages)).enumerate() {
            let stats = o
                .result
                .unwrap_or_else(|e| panic!("{mode:?} rank {rank}: {e}"));
            // Read in the mode the read ahead assumed (a fallback to AllRanks would read more).
            assert_eq!(stats.mode, mode, "rank {rank}");
            rank_matches(r, &pages, rank as u32).unwrap();
            let m = r.linker.metrics();
            assert_eq!(
                m.companions_kept,
                expected(rank as u32),
                "{mode:?} rank {rank}: {m:?}"
            );
            assert_eq!(m.ranges_length_only, 0, "{mode:?} rank {rank}: {m:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// Random geometries, plans and per-rank slots: every mode's pools equal AllRanks'.
    #[test]
    fn modes_equal_all_ranks(layers in 2u32..6, page_pow in 0u32..3, rows in 1u32..40,
                             pages in 0usize..7, tp in 2u32..4, seed in any::<u64>()) {
        let page = 1 << page_pow;
        let sparse: Vec<u32> = (0..layers).filter(|l| (seed >> l) & 1 == 1).collect();
        let mut comps = vec![ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, rows)];
        if !sparse.is_empty() {
            comps.push(ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, rows + 5).on_layers(LayerMap::Sparse(sparse)));
        }
        if seed % 3 == 0 {
            comps.push(ComponentSpec::new("v", RowUnit::Token, ElementType::Bytes, 6 * tp).sharded(tp * 2));
        }
        let spec = ModelKvSpec::new("prop", layers, page, comps).unwrap();
        for mode in MODES {
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, hashes) = ranks(&spec, tp, store, pages, &cfg(mode));
            for (rank, (r, o)) in rs.iter().zip(run(&rs, 1, &hashes)).enumerate() {
                prop_assert!(o.result.is_ok(), "{:?}", o.result);
                prop_assert_eq!(rank_matches(r, &hashes, rank as u32), Ok(()));
            }
        }
    }
}

#[test]
fn auto_measures_each_mode_then_keeps_one() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    // Pages large enough (≥ 1 MiB landed per batch) to be measured.
    let mut spec = ModelKvSpec::glm52_dsa_fp8();
    spec.num_layers = 4;
    spec.components[1].layers = LayerMap::Sparse(vec![0, 2]);
    let config = LinkerConfig {
        mode: ModeChoice::Auto,
        ..cfg(ShareMode::AllRanks)
    };
    let (rs, pages) = ranks(&spec, 2, store, 8, &config);
    let mut modes = Vec::new();
    // Until two batches after the decision (at most 19 batches before it: 6 per mode in a
    // close call, and one while the last time travels), and no longer.
    let mut after = 0;
    for batch in 1..=23 {
        if rs[0].linker.auto_decision().is_some() {
            after += 1;
            if after > 2 {
                break;
            }
        }
        let outcomes = run(&rs, batch, &pages);
        let m: Vec<ShareMode> = outcomes
            .iter()
            .map(|o| o.result.as_ref().unwrap().mode)
            .collect();
        assert_eq!(m[0], m[1], "every rank runs rank 0's proposal");
        modes.push(m[0]);
    }
    assert_eq!(&modes[..3], &MODES, "one round of every mode first");
    // It measures 3 batches per mode (6 in a close call), and runs one more while the last
    // one's group time travels to the next gate (which it keeps depends on this machine's
    // timing; the decision rule is unit-tested in mooncake-linker's linker/auto/), then keeps one.
    let kept = rs[0]
        .linker
        .auto_decision()
        .expect("decided within 23 batches");
    let first_kept = modes.iter().rposition(|&m| m != kept).map_or(0, |i| i + 1);
    assert!(first_kept <= 19, "measured {first_kept} batches: {modes:?}");
    assert!(
        modes[modes.len() - 2..].iter().all(|&m| m == kept),
        "the batches after the decision run the kept mode: {modes:?}"
    );
}

/// 4 layers of a replicated `k` (1 KiB per token) and a sharded `v`: nine pages land 2.3 MB
/// per rank, enough for `Auto` to measure (it ignores batches under 1 MiB).
fn auto_spec() -> ModelKvSpec {
    ModelKvSpec::new(
        "auto-group-time",
        4,
        64,
        vec![
            ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 1024),
            ComponentSpec::new("v", RowUnit::Token, ElementType::Bf16, 48).sharded(12),
        ],
    )
    .unwrap()
}

/// `Auto` with no bandwidth configured: it measures.
fn auto_cfg() -> LinkerConfig {
    LinkerConfig {
        mode: ModeChoice::Auto,
        ..cfg(ShareMode::AllRanks)
    }
}

/// Each rank's outcome of `batch`: its mode, or its error.
fn modes_of(rs: &[TpRank], batch: u64, pages: &[PageHash]) -> Vec<Result<ShareMode, String>> {
    run(rs, batch, pages)
        .into_iter()
        .map(|o| o.result.map(|s| s.mode).map_err(|e| e.to_string()))
        .collect()
}

/// A batch that failed (here on the middle rank of three) leaves no time: the next gate
/// carries none, `Auto` records nothing for it; the failure counts as one of that mode's
/// batches, so another mode runs next, and the mode is measured again later (it failed once,
/// not again after another mode's batch): Auto still decides.
#[test]
fn auto_measures_again_a_mode_whose_batch_failed_on_a_middle_rank() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, pages) = ranks(&auto_spec(), 3, store, 9, &auto_cfg());
    let all = |m: ShareMode| vec![Ok(m); 3];
    assert_eq!(modes_of(&rs, 1, &pages), all(ShareMode::AllRanks));
    // Rank 1's read of its `v` shard of page 4, layer 2, fails once: in batch 2.
    let g = rs[1].linker.geometry().clone();
    let v_keys = rs[1]
        .linker
        .object_keys(&load_plan(&g, 0, &pages, vec![0; 9]))
        .unwrap()
        .swap_remove(1);
    fail_v_read(&rs[1].faults, &g, v_keys[4].clone(), 2);
    let failed = modes_of(&rs, 2, &pages);
    assert!(failed.iter().all(Result::is_err), "{failed:?}");
    // Batch 2 ran Rank0Broadcast (the round's second mode) and left no time: the round's
    // third mode runs next, and Rank0Broadcast is measured again after.
    assert_eq!(modes_of(&rs, 3, &pages), all(ShareMode::SplitAllGather));
    let mut batch = 4;
    let mut later = Vec::new();
    while rs[0].linker.auto_decision().is_none() && batch <= 24 {
        let modes = modes_of(&rs, batch, &pages);
        assert!(modes.iter().all(Result::is_ok), "{modes:?}");
        later.push(modes[0].clone().unwrap());
        batch += 1;
    }
    assert!(
        rs[0].linker.auto_decision().is_some(),
        "decided after {batch} batches"
    );
    assert!(later.contains(&ShareMode::Rank0Broadcast), "{later:?}");
}

/// A mode `Auto` kept that then fails every batch is given up for one that loads. TP 3, nine
/// pages of a replicated `k`: once Auto has kept a mode, a read that only some modes make
/// fails for good: rank 1's `k` of page 4 (read there by `AllRanks` and `SplitAllGather`), or,
/// when `Rank0Broadcast` was kept, rank 0's `k` of page 8 (`AllRanks` and `Rank0Broadcast`).
/// After three failures in a row one batch tries another mode (a second one when that fails
/// too), the kept mode fails once more and is given up, and Auto keeps the one mode that
/// loads. Before, a kept mode was never revisited: every later batch failed.
#[test]
fn auto_gives_up_a_kept_mode_that_goes_bad() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let (rs, pages) = ranks(&auto_spec(), 3, store, 9, &auto_cfg());
    let mut batch = 1;
    while rs[0].linker.auto_decision().is_none() && batch <= 24 {
        let modes = modes_of(&rs, batch, &pages);
        assert!(modes.iter().all(Result::is_ok), "{modes:?}");
        batch += 1;
    }
    let kept = rs[0].linker.auto_decision().expect("decided");
    let (rank, page, survivor) = match kept {
        ShareMode::Rank0Broadcast => (0, 8, ShareMode::SplitAllGather),
        _ => (1, 4, ShareMode::Rank0Broadcast),
    };
    let g = rs[rank].linker.geometry().clone();
    let k_keys = rs[rank]
        .linker
        .object_keys(&load_plan(&g, 0, &pages, vec![0; 9]))
        .unwrap()
        .swap_remove(0);
    rs[rank].faults.inject(
        FaultRule {
            key_contains: Some(k_keys[page].clone()),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
    );
    let mut seen = Vec::new();
    for _ in 0..40 {
        let modes = modes_of(&rs, batch, &pages);
        batch += 1;
        seen.push(modes[0].clone());
        let tail = &seen[seen.len().saturating_sub(3)..];
        if tail.len() == 3 && tail.iter().all(|m| *m == Ok(survivor)) {
            break;
        }
    }
    assert_eq!(
        rs[0].linker.auto_decision(),
        Some(survivor),
        "kept {kept:?} first, then: {seen:?}"
    );
    assert!(seen.len() <= 25, "{} batches: {seen:?}", seen.len());
}

/// A store whose `end_session` of a read session over any of `keys` first sleeps `delay` (a
/// SIMULATED slow tail: the rank's batch ends after the group's last collective, so the other
/// ranks never wait for it); counts the sessions it delayed. Everything else is forwarded.
struct SlowSessionEnd {
    inner: Arc<dyn KvStore>,
    keys: std::collections::HashSet<String>,
    delay: Duration,
    delayed: std::sync::atomic::AtomicUsize,
}

// SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
// writes reach the inner store, whose results it returns as they are or fails before it
// (touching nothing); it starts no thread that touches caller memory.
unsafe impl KvStore for SlowSessionEnd {
    kvlink::mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into,
        get_ranges, put, remove, discard, register, unregister, start_session, health);

    fn name(&self) -> &str {
        "slow-session-end"
    }

    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        if session.keys.iter().any(|k| self.keys.contains(k)) {
            self.delayed
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(self.delay);
        }
        self.inner.end_session(session)
    }
}

/// `Auto` decides from the group's time (the slowest rank's), not rank 0's own. TP 3, nine
/// pages of a replicated `k` (and a sharded `v`), three pages per rank in `SplitAllGather`:
/// - rank 0 reads page 8's `k` slowly (80 ms per store call, one call per layer): it reads it
///   in `AllRanks` and `Rank0Broadcast` only, and every rank waits for it (the status words);
/// - rank 1 ends its read session 1.2 s late whenever it read any `k` page (`AllRanks`,
///   `SplitAllGather`): after the group's last collective, so no other rank waits for it.
///
/// Rank 0's own times put `SplitAllGather` far ahead (no delay at all there), so deciding
/// from them keeps it (the code before this test did); the group's times put
/// `Rank0Broadcast` (0.32 s of delays) far ahead of `SplitAllGather` (1.2 s) and `AllRanks`
/// (both). The margins are several times any noise of a busy host.
#[test]
fn auto_decides_from_the_slowest_rank_not_rank_0() {
    let spec = auto_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let config = auto_cfg();
    // Page hashes and keys first (the rig saves the prefix itself, from the same prompt).
    let tokens = prompt(11, 9, spec.page_size);
    let pages = kvlink::kv_geometry::page_hashes(&tokens, spec.page_size, None);
    let probe = kvlink::kv_geometry::KvGeometry::new(spec.clone(), 3, 0).unwrap();
    let probe_linker = kvlink::mooncake_linker::Linker::new(
        probe.clone(),
        store.clone(),
        Arc::new(kvlink::kv_device::HostKvPool::new(probe.clone(), 1).unwrap()),
        config.clone(),
    )
    .unwrap();
    let k_keys = probe_linker
        .object_keys(&load_plan(&probe, 0, &pages, vec![0; 9]))
        .unwrap()
        .swap_remove(0);
    probe_linker.close().unwrap();
    let slow = Arc::new(SlowSessionEnd {
        inner: store.clone(),
        keys: k_keys.iter().cloned().collect(),
        delay: Duration::from_millis(1200),
        delayed: Default::default(),
    });
    let per_rank = |rank: u32, s: Arc<dyn KvStore>| -> Arc<dyn KvStore> {
        if rank == 1 {
            slow.clone()
        } else {
            s
        }
    };
    let build = RankBuild {
        store: &per_rank,
        ..RankBuild::default()
    };
    let (rs, saved) = tp_ranks_built(&spec, 3, store, 9, &config, Path::Host, &build);
    assert_eq!(saved, pages);
    rs[0].faults.inject(
        FaultRule {
            key_contains: Some(k_keys[8].clone()),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(80)),
    );
    // (mode, each rank's time from start_load to its last layer), per batch.
    let mut seen: Vec<(ShareMode, Vec<Duration>)> = Vec::new();
    let mut batch = 1;
    // Bounded: Auto keeps a mode within 10 batches (19 in a close call).
    while rs[0].linker.auto_decision().is_none() && batch <= 21 {
        let outcomes = run(&rs, batch, &pages);
        let stats: Vec<_> = outcomes
            .iter()
            .map(|o| {
                o.result
                    .as_ref()
                    .unwrap_or_else(|e| panic!("batch {batch}: {e}"))
            })
            .collect();
        assert!(stats.iter().all(|s| s.mode == stats[0].mode), "one mode");
        seen.push((stats[0].mode, stats.iter().map(|s| s.last_layer).collect()));
        batch += 1;
    }
    assert!(
        slow.delayed.load(std::sync::atomic::Ordering::Relaxed) > 0,
        "rank 1's slow tail never ran: {seen:?}"
    );
    assert_eq!(
        rs[0].linker.auto_decision(),
        Some(ShareMode::Rank0Broadcast),
        "Auto must keep the mode fastest on the slowest rank; batches (mode, each rank's \
         time): {seen:?}"
    );
    // Every rank runs it from now on, and every pool holds its bytes.
    for (rank, (r, o)) in rs.iter().zip(run(&rs, batch, &pages)).enumerate() {
        assert_eq!(o.result.unwrap().mode, ShareMode::Rank0Broadcast);
        rank_matches(r, &pages, rank as u32).unwrap();
    }
}

#[test]
fn auto_with_configured_bandwidths_follows_the_model() {
    use kvlink::mooncake_linker::dedup_broadcast::Bandwidths;
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let config = LinkerConfig {
        mode: ModeChoice::Auto,
        // Each rank's path to the store is its limit (1 GB/s, 2 GB/s for both together) and
        // the fabric is NVLink-class: split reads use both paths and win.
        bandwidths: Bandwidths {
            store_per_rank_gbps: 1.0,
            store_aggregate_gbps: 2.0,
            fabric_broadcast_gbps: 300.0,
            fabric_all_gather_gbps: 300.0,
        },
        ..cfg(ShareMode::AllRanks)
    };
    let (rs, pages) = ranks(&mixed_spec(), 2, store, 4, &config);
    for o in run(&rs, 1, &pages) {
        assert_eq!(o.result.unwrap().mode, ShareMode::SplitAllGather);
    }
}
