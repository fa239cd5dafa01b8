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
