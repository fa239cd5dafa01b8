//! The `kv_connector` example's own code (compiled into this test, not its binary): a
//! mistral.rs-style connector over kvlink hydrates evicted blocks from the embedded store
//! byte for byte, saves skip what the store has, and a failed load gives its blocks back.

#[allow(dead_code)]
#[path = "../examples/kv_connector/connector.rs"]
mod connector;
#[allow(dead_code)]
#[path = "../examples/kv_connector/demo.rs"]
mod demo;

use kvlink::kv_loader::EngineAction;

#[test]
fn the_connector_hydrates_saves_and_falls_back() {
    let mut out = Vec::new();
    let s = demo::run(&mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(s.hydrated, 6, "{text}");
    assert!(s.bytes_match, "{text}");
    assert_eq!(s.after_fault, None, "{text}");
    assert!(s.fault_hits > 0, "the injected fault fired: {text}");
    assert_eq!(s.stats.actions, vec![EngineAction::Recompute]);
    assert_eq!(s.stats.blocks_saved, 6);
    assert_eq!((s.stats.evictions, s.stats.loads_failed), (7, 1));
    assert_eq!(s.free_blocks, 32, "every block back in the pool");
    assert_eq!(s.stats.local_hits, 6);
    assert!(text.contains("6 of 8 full blocks hydrated"), "{text}");
}

/// A load whose store call outlives the reset's bound (`SlotsHeld`): the connector keeps its
/// blocks out of the pool, and gives them back at its next lookup once the load's outcome came
/// (the call returned). Before, they stayed out for good, and the outcome was never taken.
#[cfg(feature = "mock")]
#[test]
fn blocks_a_late_store_call_held_come_back_once_its_outcome_comes() {
    use std::sync::{Arc, Mutex};

    use connector::{BlockSource, KvCacheConnector, KvlinkConnector};
    use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec};
    use kvlink::kv_loader::BatchId;
    use kvlink::mock::{MockKvLoader, MockScript};

    struct Pool(Mutex<Vec<usize>>);
    impl BlockSource for Pool {
        fn allocate(&self, n: usize) -> Option<Vec<usize>> {
            let mut free = self.0.lock().unwrap();
            let at = free.len().checked_sub(n)?;
            Some(free.split_off(at))
        }
        fn free(&self, blocks: &[usize]) {
            self.0.lock().unwrap().extend_from_slice(blocks);
        }
    }

    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let mut script = MockScript::for_geometry(&g);
    script.hold_slots.push(BatchId(1));
    let mock = Arc::new(MockKvLoader::new(g.num_layers(), script));
    let pool = Arc::new(Pool(Mutex::new((0..8).collect())));
    let c = KvlinkConnector::new(mock.clone(), g.clone(), pool.clone());
    let tokens: Vec<u32> = (0..2 * g.page_size()).collect();
    let blocks = page_hashes(&tokens, g.page_size(), None);

    assert_eq!(
        c.lookup_blocks(&blocks, &[0], 8),
        None,
        "batch 1's call is out"
    );
    let s = c.stats();
    assert_eq!((s.blocks_held_out, s.blocks_reclaimed), (2, 0), "{s:?}");
    assert_eq!(pool.0.lock().unwrap().len(), 6, "its blocks kept out");

    mock.release(BatchId(1));
    let got = c.lookup_blocks(&blocks, &[0], 8).expect("batch 2 loads");
    let s = c.stats();
    assert_eq!((s.blocks_held_out, s.blocks_reclaimed), (0, 2), "{s:?}");
    assert_eq!(
        pool.0.lock().unwrap().len() + got.len(),
        8,
        "every block accounted for"
    );
}
