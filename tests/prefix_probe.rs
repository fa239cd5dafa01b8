//! The scheduler's side of a load (`PrefixProbe`): from a process with only a store client,
//! its hit equals the one the TP ranks' collective lookup agrees on (TP 3, a replicated and a
//! sharded component), with objects missing on one rank's shard and on a replicated
//! component; it takes no part in the group.

mod common;

use std::sync::Arc;

use common::prompt;
use common::tp::{config, mixed_spec, tp_ranks, Path, TpRank};
use kvlink::kv_geometry::PageHash;
use kvlink::kv_loader::{KvLoader, LookupRequest, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::PrefixProbe;

/// Every rank's collective lookup of `tokens` after `skip` pages, in rank order.
fn group_lookup(ranks: &[TpRank], tokens: &[u32], skip: usize) -> Vec<Vec<PageHash>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|r| {
                s.spawn(move || {
                    r.linker
                        .lookup(&LookupRequest {
                            tokens,
                            skip_pages: skip,
                        })
                        .unwrap()
                        .pages
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The key rank `rank` reads for component `comp` of page `page`.
fn key(r: &TpRank, pages: &[PageHash], comp: usize, page: usize) -> String {
    let g = r.linker.geometry();
    let plan = common::load_plan(g, 99, pages, vec![0; pages.len()]);
    r.linker.object_keys(&plan).unwrap()[comp][page].clone()
}

#[test]
fn the_probe_hit_is_the_groups_hit() {
    let spec = mixed_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = config(ShareMode::SplitAllGather);
    let (ranks, pages) = tp_ranks(&spec, 3, store.clone(), 8, &cfg, Path::Host);
    let tokens = prompt(11, 8, spec.page_size);
    let probe = PrefixProbe::new(spec.clone(), 3, store.clone(), &cfg).unwrap();

    // Everything saved: all 8 pages, from the first or after the engine's own 2.
    let all = probe.probe(&tokens, 0).unwrap();
    assert_eq!(all.pages, pages);
    assert_eq!(all.tokens, 8 * spec.page_size as usize);
    let after = probe.probe_pages(&pages, 2).unwrap();
    assert_eq!((after.first_page, after.pages.len()), (2, 6));
    assert_eq!(
        group_lookup(&ranks, &tokens, 2),
        vec![pages[2..].to_vec(); 3]
    );

    // The middle rank's shard of `v` (component 2) of page 5 is gone: only rank 1 misses it,
    // and the group (its minimum) stops there; so does the probe. (Discarded: the lookups'
    // read-ahead pins it, so a plain remove is refused, as Mooncake refuses a leased one.)
    assert!(store.discard(&[key(&ranks[1], &pages, 2, 5).as_str()])[0].is_ok());
    let hit = probe.probe(&tokens, 0).unwrap();
    assert_eq!(hit.pages, pages[..5].to_vec());
    assert_eq!(
        group_lookup(&ranks, &tokens, 0),
        vec![pages[..5].to_vec(); 3]
    );

    // The replicated `k` (one copy for all ranks) of page 3 is gone too.
    assert!(store.discard(&[key(&ranks[0], &pages, 0, 3).as_str()])[0].is_ok());
    let hit = probe.probe(&tokens, 0).unwrap();
    assert_eq!(hit.pages, pages[..3].to_vec());
    assert_eq!(
        group_lookup(&ranks, &tokens, 0),
        vec![pages[..3].to_vec(); 3]
    );
    // Past the engine's own hit of 4 pages: page 4, then page 5 misses a shard.
    assert_eq!(probe.probe(&tokens, 4).unwrap().pages, vec![pages[4]]);
    assert_eq!(group_lookup(&ranks, &tokens, 4), vec![vec![pages[4]]; 3]);
    // More skipped pages than the prompt has: an empty hit at its end.
    let beyond = probe.probe(&tokens, 20).unwrap();
    assert_eq!((beyond.first_page, beyond.pages.len()), (8, 0));
}

#[test]
fn a_probe_for_a_tp_size_the_model_cannot_split_is_refused() {
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
    // `v` has 12 heads: 5 ranks cannot share them.
    let err = PrefixProbe::new(mixed_spec(), 5, store, &config(ShareMode::AllRanks)).unwrap_err();
    assert_eq!(err.kind_name(), "geometry", "{err}");
}

/// A store error of a lookup or a probe keeps the store's typed error as the detail's source,
/// as a batch's does (`detail.downcast_ref::<StoreError>()`); before, only its words.
#[test]
fn lookup_and_probe_store_errors_keep_their_typed_source() {
    use kvlink::kv_loader::KvLoadError;
    use kvlink::mooncake_linker::store::{Fault, FaultCall, FaultRule, FaultyStore, StoreError};
    let spec = mixed_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = config(ShareMode::AllRanks);
    let (ranks, _) = tp_ranks(&spec, 1, store.clone(), 4, &cfg, Path::Host);
    let down = StoreError::RpcTimeout {
        key: "exists".into(),
    };
    let tokens = prompt(11, 4, spec.page_size);
    let check = |got: Result<kvlink::kv_loader::LookupHit, KvLoadError>, what: &str| match got {
        Err(KvLoadError::Store { detail, .. }) => {
            assert_eq!(detail.downcast_ref::<StoreError>(), Some(&down), "{what}")
        }
        other => panic!("{what}: {other:?}"),
    };
    ranks[0].faults.inject_on(
        FaultCall::Exists,
        FaultRule::default(),
        Fault::Error(down.clone()),
    );
    let req = LookupRequest {
        tokens: &tokens,
        skip_pages: 0,
    };
    check(ranks[0].linker.lookup(&req), "lookup");
    // The failed lookup counts as asked, with nothing found (before, not at all: the hit
    // ratio held still through a store outage).
    let m = ranks[0].linker.metrics();
    assert_eq!((m.pages_looked_up, m.pages_hit), (4, 0), "{m:?}");
    let faulty = Arc::new(FaultyStore::new(store));
    faulty.inject_on(
        FaultCall::Exists,
        FaultRule::default(),
        Fault::Error(down.clone()),
    );
    let probe = PrefixProbe::new(spec, 1, faulty, &cfg).unwrap();
    check(probe.probe(&tokens, 0), "probe");
}

/// A store error on a later page's presence ends the hit before that page (the pages before it
/// are present), for the lookup and the probe alike; on the first page it is still the
/// lookup's error. Before, any page's error failed the whole lookup: a transient error on page
/// 1,000 threw away a 999-page hit.
#[test]
fn a_store_error_on_a_later_page_cuts_the_hit_short() {
    use kvlink::mooncake_linker::store::{Fault, FaultCall, FaultRule, FaultyStore, StoreError};
    let spec = mixed_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let cfg = config(ShareMode::AllRanks);
    let (ranks, pages) = tp_ranks(&spec, 1, store.clone(), 6, &cfg, Path::Host);
    let tokens = prompt(11, 6, spec.page_size);
    let faulty = Arc::new(FaultyStore::new(store));
    let probe = PrefixProbe::new(spec, 1, faulty.clone(), &cfg).unwrap();
    let req = LookupRequest {
        tokens: &tokens,
        skip_pages: 0,
    };
    for (page, hit) in [(4, Some(4)), (0, None)] {
        let on = |faults: &FaultyStore| {
            faults.inject_on(
                FaultCall::Exists,
                FaultRule {
                    key_contains: Some(key(&ranks[0], &pages, 0, page)),
                    ..FaultRule::default()
                },
                Fault::Error(StoreError::RpcTimeout {
                    key: "exists".into(),
                }),
            )
        };
        on(&ranks[0].faults);
        on(&faulty);
        let looked = ranks[0].linker.lookup(&req).map(|h| h.pages.len());
        let probed = probe.probe(&tokens, 0).map(|h| h.pages.len());
        match hit {
            Some(n) => {
                assert_eq!(looked.unwrap(), n, "page {page}");
                assert_eq!(probed.unwrap(), n, "page {page}");
            }
            None => {
                assert!(looked.is_err(), "page {page}: {looked:?}");
                assert!(probed.is_err(), "page {page}: {probed:?}");
            }
        }
        ranks[0].faults.clear();
        faulty.clear();
    }
}
