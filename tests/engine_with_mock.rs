//! An engine-like loop written only against the `KvLoader` trait, run on the mock: how an
//! engine tests its own integration (wait order, failure → recompute) with no store.

use std::sync::Arc;

use kvlink::kv_geometry::{page_hashes, ComponentId};
use kvlink::kv_loader::mock::{MockCall, MockKvLoader, MockScript};
use kvlink::kv_loader::{
    BatchId, BatchPlan, KvLoader, LayerReady, LogicalPlan, LookupRequest, RequestPages,
};

/// What the engine did for one request.
#[derive(Debug, PartialEq, Eq)]
struct Forward {
    loaded_pages: usize,
    recomputed_pages: usize,
    layers_run: u32,
}

/// A minimal prefill step: lookup, allocate, start_load, attention per layer after its
/// wait, outcome; a failed load turns into recompute of those pages; then save.
fn prefill(loader: &dyn KvLoader, batch: u64, tokens: &[u32]) -> Forward {
    let hit = loader
        .lookup(&LookupRequest {
            tokens,
            skip_pages: 0,
        })
        .expect("lookup");
    let n = hit.pages.len();
    let plan = BatchPlan {
        logical: LogicalPlan {
            batch: BatchId(batch),
            requests: vec![RequestPages {
                request: format!("r{batch}").as_str().into(),
                pages: hit.pages.clone(),
            }],
            // The mock's model has one component (a plan with pages names at least one).
            components: vec![ComponentId(0)],
        },
        slots: (0..n as u32).collect(),
    };
    let ticket = loader.start_load(plan.clone()).expect("start");
    let mut layers_run = 0;
    let mut load_failed = false;
    for layer in 0..loader.num_layers() {
        if !load_failed {
            match loader.wait_layer(&ticket, layer) {
                Ok(LayerReady::Resident) => {}
                // A device pool: the layer's copies may still be queued. A real engine
                // makes its compute stream wait (`wait_on_stream`); this one has no stream.
                Ok(LayerReady::Event(ev)) => ev.synchronize().expect("the layer's event"),
                Err(_) => load_failed = true, // stop waiting; the prefix will be recomputed
            }
        }
        layers_run += 1; // attention on this layer
    }
    let outcome = loader.wait_batch(&ticket).expect("outcome");
    assert_eq!(
        outcome.result.is_err(),
        load_failed,
        "the outcome agrees with the waits"
    );
    let (loaded, recomputed) = if outcome.result.is_ok() {
        (n, 0)
    } else {
        (0, n)
    };
    loader.save(&plan).expect("save");
    Forward {
        loaded_pages: loaded,
        recomputed_pages: recomputed,
        layers_run,
    }
}

#[test]
fn engine_loop_loads_or_falls_back_to_recompute() {
    let mut script = MockScript {
        page_size: 4,
        lookup_pages: Some(3),
        ..MockScript::default()
    };
    script.fail_at_layer.insert(BatchId(2), 4);
    let mock = Arc::new(MockKvLoader::new(6, script));
    let tokens: Vec<u32> = (0..20).collect();

    let ok = prefill(mock.as_ref(), 1, &tokens);
    assert_eq!(
        ok,
        Forward {
            loaded_pages: 3,
            recomputed_pages: 0,
            layers_run: 6
        }
    );
    let failed = prefill(mock.as_ref(), 2, &tokens);
    assert_eq!(
        failed,
        Forward {
            loaded_pages: 0,
            recomputed_pages: 3,
            layers_run: 6
        }
    );

    let calls = mock.calls();
    // Batch 1: lookup, start, six waits in layer order, outcome, save.
    let waits: Vec<u32> = calls
        .iter()
        .filter_map(|c| match c {
            MockCall::WaitLayer {
                batch: BatchId(1),
                layer,
            } => Some(*layer),
            _ => None,
        })
        .collect();
    assert_eq!(waits, vec![0, 1, 2, 3, 4, 5]);
    // Batch 2 stopped waiting at the failed layer.
    let waits2 = calls
        .iter()
        .filter(|c| {
            matches!(
                c,
                MockCall::WaitLayer {
                    batch: BatchId(2),
                    ..
                }
            )
        })
        .count();
    assert_eq!(waits2, 5);
    assert_eq!(
        calls[0],
        MockCall::Lookup {
            tokens: 20,
            skip_pages: 0
        }
    );
    assert!(calls.contains(&MockCall::Save {
        batch: BatchId(2),
        pages: 3
    }));
    // The mock's lookup hashes pages the same way the linker does.
    assert_eq!(
        mock.lookup(&LookupRequest {
            tokens: &tokens,
            skip_pages: 1
        })
        .unwrap()
        .pages,
        page_hashes(&tokens, 4, None)[1..4]
    );
}

/// With device events (as the linker answers on a device pool), the mock tells which layers
/// an engine read without waiting on their event: the loop above waits on every one; a loop
/// that takes `wait_layer`'s `Ok` as "resident" (fine on a host pool) is caught.
#[test]
fn the_mock_catches_an_engine_that_reads_a_layer_without_waiting_on_its_event() {
    let script = MockScript {
        page_size: 4,
        device_events: true,
        ..MockScript::default()
    };
    let mock = MockKvLoader::new(3, script);
    let tokens: Vec<u32> = (0..12).collect();
    let ok = prefill(&mock, 1, &tokens);
    assert_eq!(ok.loaded_pages, 3);
    assert_eq!(mock.events_not_waited(), vec![]);
    // The host-pool habit: `is_ok()` and read on.
    let plan = BatchPlan {
        logical: LogicalPlan {
            batch: BatchId(2),
            requests: vec![],
            components: vec![],
        },
        slots: vec![],
    };
    let t = mock.start_load(plan).unwrap();
    for layer in 0..3 {
        assert!(mock.wait_layer(&t, layer).is_ok());
    }
    mock.wait_batch(&t).unwrap().result.unwrap();
    assert_eq!(
        mock.events_not_waited(),
        vec![(BatchId(2), 0), (BatchId(2), 1), (BatchId(2), 2)]
    );
}

#[test]
fn closed_mock_refuses_calls() {
    let mock = MockKvLoader::new(
        2,
        MockScript {
            page_size: 4,
            ..MockScript::default()
        },
    );
    mock.close().unwrap();
    assert!(mock
        .lookup(&LookupRequest {
            tokens: &[1, 2, 3, 4],
            skip_pages: 0
        })
        .is_err());
    assert_eq!(
        mock.calls().last(),
        Some(&MockCall::Lookup {
            tokens: 4,
            skip_pages: 0
        })
    );
}
