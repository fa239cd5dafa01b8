//! The engine's flow on the facade's mock (`kvlink = { features = ["mock"] }`): loads, a
//! failed load turned into recompute, a timed-out load turned into reset then recompute.

use std::sync::Arc;

use kvlink::kv_loader::{BatchId, EngineAction, KvLoader};
use kvlink::mock::{MockCall, MockKvLoader, MockScript, MOCK_PAGE_SIZE};
use kvlink_downstream::{Step, TinyEngine};

fn prompt(pages: u32) -> Vec<u32> {
    (0..pages * MOCK_PAGE_SIZE + 3).collect()
}

fn engine(script: MockScript) -> (Arc<MockKvLoader>, TinyEngine) {
    let mock = Arc::new(MockKvLoader::new(4, script));
    let loader: Arc<dyn KvLoader> = mock.clone();
    (mock, TinyEngine::new(loader, MOCK_PAGE_SIZE))
}

#[test]
fn a_hit_is_loaded_layer_by_layer_then_saved() {
    let (mock, mut engine) = engine(MockScript::default());
    let step = engine.prefill("r1", &prompt(3)).unwrap();
    assert_eq!(
        step,
        Step {
            loaded_pages: 3,
            recomputed_pages: 0,
            layers_run: 4,
            action: None
        }
    );
    let b = BatchId(1);
    let mut want = vec![
        MockCall::Lookup {
            tokens: prompt(3).len(),
            skip_pages: 0,
        },
        MockCall::StartLoad { batch: b, pages: 3 },
    ];
    want.extend((0..4).map(|layer| MockCall::WaitLayer { batch: b, layer }));
    want.push(MockCall::WaitBatch { batch: b });
    want.push(MockCall::Save { batch: b, pages: 3 });
    assert_eq!(mock.calls(), want);
}

#[test]
fn a_failed_layer_turns_into_recompute_without_a_reset() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(BatchId(2), 2);
    let (mock, mut engine) = engine(script);
    assert_eq!(engine.prefill("r1", &prompt(2)).unwrap().loaded_pages, 2);
    let step = engine.prefill("r2", &prompt(2)).unwrap();
    assert_eq!(step.action, Some(EngineAction::Recompute));
    assert_eq!((step.loaded_pages, step.recomputed_pages), (0, 2));
    assert_eq!(step.layers_run, 4, "the forward pass runs every layer");
    let calls = mock.calls();
    assert!(!calls.contains(&MockCall::Reset));
    let waits: Vec<u32> = calls
        .iter()
        .filter_map(|c| match c {
            MockCall::WaitLayer {
                batch: BatchId(2),
                layer,
            } => Some(*layer),
            _ => None,
        })
        .collect();
    assert_eq!(waits, vec![0, 1, 2], "no wait after the failed one");
    // The loader stays usable: the next batch loads.
    assert_eq!(engine.prefill("r3", &prompt(2)).unwrap().loaded_pages, 2);
}

#[test]
fn a_timed_out_load_is_reset_before_its_slots_are_recomputed() {
    let mut script = MockScript::default();
    script.time_out.push(BatchId(1));
    let (mock, mut engine) = engine(script);
    let step = engine.prefill("r1", &prompt(1)).unwrap();
    assert_eq!(step.action, Some(EngineAction::ResetThenRecompute));
    assert_eq!(step.recomputed_pages, 1);
    let calls = mock.calls();
    let reset = calls.iter().position(|c| *c == MockCall::Reset);
    let save = calls
        .iter()
        .position(|c| matches!(c, MockCall::Save { .. }));
    assert!(
        reset.is_some() && reset < save,
        "reset before the slots are reused: {calls:?}"
    );
    assert_eq!(engine.prefill("r2", &prompt(1)).unwrap().loaded_pages, 1);
}

#[test]
fn a_closed_loader_refuses_the_step_with_fix_input() {
    let (mock, mut engine) = engine(MockScript::default());
    mock.close().unwrap();
    let e = engine.prefill("r1", &prompt(1)).unwrap_err();
    assert_eq!(e.action(), EngineAction::FixInput);
}
