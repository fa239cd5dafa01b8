//! The adapter on its own: pool ↔ tensor round trips (partial pages, dtypes), refusals of
//! bad input with typed errors, and the layer gate over the mock loader (one wait per layer,
//! failures kept and typed, events synchronized or handed to a stream).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use kv_device::{HostKvPool, KvPool};
use kv_geometry::{ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, RowUnit};
use kv_loader::mock::{MockCall, MockKvLoader, MockScript};
use kv_loader::{
    BatchId, BatchOutcome, BatchPlan, KvLoadError, KvLoader, LayerReady, LoadTicket, LogicalPlan,
    LookupHit, LookupRequest, RawStream, SaveReport, StreamWaitable,
};
use kvlink_candle::{
    candle_core, CandleKvError, LatentFormat, LatentPool, LayerGate, PagedLatentCache,
};

const PAGE: u32 = 4;

fn pool_for(element: ElementType, row_bytes: u32, pages: u32) -> Arc<HostKvPool> {
    let spec = ModelKvSpec::new(
        "t",
        3,
        PAGE,
        vec![
            ComponentSpec::new("k", RowUnit::Token, element, row_bytes),
            ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, 24)
                .on_layers(LayerMap::Sparse(vec![1])),
        ],
    )
    .unwrap();
    Arc::new(HostKvPool::new(KvGeometry::new(spec, 1, 0).unwrap(), pages).unwrap())
}

fn f32_latents(pages: u32) -> LatentPool {
    let f = LatentFormat::new(4, 2, DType::F32).unwrap();
    LatentPool::new(
        pool_for(ElementType::Bytes, f.row_bytes() as u32, pages),
        "k",
        f,
        Device::Cpu,
    )
    .unwrap()
}

// The adapter's raw slot copies, for tests whose pool is theirs alone: one thread, no
// loader writing it.
fn read(
    lp: &LatentPool,
    layer: u32,
    table: &[u32],
    tokens: usize,
) -> Result<Tensor, CandleKvError> {
    // SAFETY: each test's pool is its own, used from one thread, and nothing loads into it.
    unsafe { lp.read_tokens(layer, table, tokens) }
}

fn pages(lp: &LatentPool, layer: u32, slots: &[u32]) -> Result<Tensor, CandleKvError> {
    // SAFETY: as in `read`.
    unsafe { lp.read_pages(layer, slots) }
}

fn write(
    lp: &LatentPool,
    layer: u32,
    table: &[u32],
    start: usize,
    rows: &Tensor,
) -> Result<(), CandleKvError> {
    // SAFETY: as in `read`.
    unsafe { lp.write_tokens(layer, table, start, rows) }
}

fn rows(n: usize, base: f32) -> Tensor {
    Tensor::arange(base, base + (n * 6) as f32, &Device::Cpu)
        .unwrap()
        .reshape((n, 6))
        .unwrap()
}

#[test]
fn rows_round_trip_across_partial_pages_and_keep_their_neighbours() {
    let lp = f32_latents(8);
    let table = [6u32, 1, 3];
    // Tokens 0..3, then 3..9 (finishes page 0, fills page 1, starts page 2), then 9..11.
    write(&lp, 2, &table, 0, &rows(3, 0.0)).unwrap();
    write(&lp, 2, &table, 3, &rows(6, 18.0)).unwrap();
    write(&lp, 2, &table, 9, &rows(2, 54.0)).unwrap();
    let all = read(&lp, 2, &table, 11).unwrap();
    assert_eq!(
        all.to_vec2::<f32>().unwrap(),
        rows(11, 0.0).to_vec2::<f32>().unwrap()
    );
    // Prefix reads, the paged form, and other layers untouched.
    assert_eq!(
        read(&lp, 2, &table, 5).unwrap().to_vec2::<f32>().unwrap(),
        rows(5, 0.0).to_vec2::<f32>().unwrap()
    );
    let paged = pages(&lp, 2, &table[..2]).unwrap();
    assert_eq!(paged.dims(), &[2, 4, 6]);
    assert_eq!(
        paged.reshape((8, 6)).unwrap().to_vec2::<f32>().unwrap(),
        rows(8, 0.0).to_vec2::<f32>().unwrap()
    );
    let other = read(&lp, 1, &table, 11).unwrap();
    assert!(other
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .all(|&v| v == 0.0));
    // Zero tokens is an empty tensor, not an error.
    assert_eq!(read(&lp, 0, &table, 0).unwrap().dims(), &[0, 6]);
}

#[test]
fn bf16_and_f16_pools_take_f32_rows_converted() {
    for (element, dtype) in [
        (ElementType::Bf16, DType::BF16),
        (ElementType::F16, DType::F16),
    ] {
        let f = LatentFormat::new(4, 2, dtype).unwrap();
        assert_eq!(f.row_bytes(), 12);
        let lp = LatentPool::new(pool_for(element, 12, 4), "k", f, Device::Cpu).unwrap();
        let r = rows(5, 0.0); // small integers: exact in both
        write(&lp, 0, &[2, 0], 0, &r).unwrap();
        let back = read(&lp, 0, &[2, 0], 5).unwrap();
        assert_eq!(back.dtype(), dtype);
        assert_eq!(
            back.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
            r.to_vec2::<f32>().unwrap()
        );
    }
}

#[test]
fn formats_that_do_not_fit_the_component_are_refused() {
    let f32f = LatentFormat::new(4, 2, DType::F32).unwrap();
    let bad = |r: Result<LatentPool, CandleKvError>| match r {
        Err(e @ (CandleKvError::Format(_) | CandleKvError::Geometry(_))) => e.to_string(),
        other => panic!("accepted: {other:?}"),
    };
    // Row size, element type, page rows, unknown component.
    bad(LatentPool::new(
        pool_for(ElementType::Bytes, 20, 4),
        "k",
        f32f,
        Device::Cpu,
    ));
    let e = bad(LatentPool::new(
        pool_for(ElementType::Bf16, 24, 4),
        "k",
        f32f,
        Device::Cpu,
    ));
    assert!(e.contains("Bf16"), "{e}");
    bad(LatentPool::new(
        pool_for(ElementType::Bytes, 24, 4),
        "indexer",
        f32f,
        Device::Cpu,
    ));
    bad(LatentPool::new(
        pool_for(ElementType::Bytes, 24, 4),
        "v",
        f32f,
        Device::Cpu,
    ));
    assert!(LatentFormat::new(0, 2, DType::F32).is_err());
    assert!(LatentFormat::new(4, 2, DType::I64).is_err());
}

/// A format built as a struct literal skips `new`'s checks: its sizes overflowed `width` (a
/// panic in a debug build) and could wrap to a row size that passed `check` in a release one.
#[test]
fn a_literal_format_of_impossible_sizes_is_refused_not_a_panic() {
    let f = LatentFormat {
        kv_lora_rank: usize::MAX,
        rope_dim: 1,
        dtype: DType::F32,
    };
    assert_eq!(f.width(), usize::MAX);
    let got = LatentPool::new(pool_for(ElementType::Bytes, 24, 4), "k", f, Device::Cpu);
    assert!(matches!(got, Err(CandleKvError::Format(_))), "{got:?}");
    // No c_kv at all (`new` refuses it): passed `check` before, its row size matching.
    let zero = LatentFormat {
        kv_lora_rank: 0,
        rope_dim: 6,
        dtype: DType::F32,
    };
    let got = LatentPool::new(pool_for(ElementType::Bytes, 24, 4), "k", zero, Device::Cpu);
    assert!(matches!(got, Err(CandleKvError::Format(_))), "{got:?}");
}

#[test]
fn bad_reads_and_writes_are_typed_errors() {
    let lp = f32_latents(4);
    assert!(matches!(
        read(&lp, 0, &[0, 1], 9),
        Err(CandleKvError::PageTable {
            needed: 3,
            have: 2,
            ..
        })
    ));
    assert!(matches!(
        write(&lp, 0, &[0], 2, &rows(3, 0.0)),
        Err(CandleKvError::PageTable {
            start: 2,
            end: 5,
            ..
        })
    ));
    // Tokens past usize::MAX: refused, neither wrapped to an empty span nor a panic.
    assert!(matches!(
        write(&lp, 0, &[0], usize::MAX, &rows(1, 0.0)),
        Err(CandleKvError::PageTable {
            start: usize::MAX,
            ..
        })
    ));
    let wrong = Tensor::zeros((3, 5), DType::F32, &Device::Cpu).unwrap();
    assert!(matches!(
        write(&lp, 0, &[0], 0, &wrong),
        Err(CandleKvError::Shape { .. })
    ));
    // A slot past the pool, a layer past the model.
    assert!(matches!(read(&lp, 0, &[4], 1), Err(CandleKvError::Pool(_))));
    assert!(matches!(read(&lp, 3, &[0], 1), Err(CandleKvError::Pool(_))));
    assert!(matches!(
        write(&lp, 0, &[9], 0, &rows(1, 0.0)),
        Err(CandleKvError::Pool(_))
    ));
    let f = *lp.format();
    assert!(matches!(f.split(&wrong), Err(CandleKvError::Shape { .. })));
    let (c, k) = f.split(&rows(3, 0.0)).unwrap();
    assert_eq!((c.dims(), k.dims()), (&[3, 4][..], &[3, 2][..]));
}

fn plan(batch: u64) -> BatchPlan {
    BatchPlan {
        logical: LogicalPlan {
            batch: BatchId(batch),
            requests: vec![],
            components: vec![],
        },
        slots: vec![],
    }
}

fn waits(mock: &MockKvLoader) -> Vec<u32> {
    mock.calls()
        .into_iter()
        .filter_map(|c| match c {
            MockCall::WaitLayer { layer, .. } => Some(layer),
            _ => None,
        })
        .collect()
}

#[test]
fn every_read_of_a_loaded_layer_asks_the_loader_first() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(1)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 4) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    assert!(cache.gate().is_loading());
    for _ in 0..3 {
        cache.layer(1, 6).unwrap();
    }
    cache.layer_pages(0, 2).unwrap();
    // Writing a new token after the loaded prefix needs no wait; into the prefix it does.
    // Readiness is the loader's (its counter): each read asks it again.
    cache.write(2, 4, &rows(1, 0.0)).unwrap();
    assert_eq!(waits(&mock), vec![1, 1, 1, 0]);
    cache.write(2, 0, &rows(1, 0.0)).unwrap();
    assert_eq!(waits(&mock), vec![1, 1, 1, 0, 2]);
    assert!(matches!(
        cache.layer(3, 1),
        Err(CandleKvError::LayerOutOfRange {
            layer: 3,
            num_layers: 3
        })
    ));
    assert_eq!(cache.finish_load().unwrap().unwrap().layers, 3);
    assert!(!cache.gate().is_loading());
    assert_eq!(cache.loaded_tokens(), 4);
    assert!(
        cache.finish_load().unwrap().is_none(),
        "nothing left to finish"
    );
}

/// A mock loader of 3 layers whose batch `batch` fails at layer `layer`, and a cache of 8
/// tokens in slots 0 and 1 gated on that batch.
fn failing_load(batch: u64, layer: u32) -> (Arc<MockKvLoader>, PagedLatentCache) {
    let mut script = MockScript::default();
    script
        .fail_at_layer
        .insert(kv_loader::BatchId(batch), layer);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(batch)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    (mock, cache)
}

#[test]
fn a_failed_wait_is_kept_typed_and_ends_in_a_failed_outcome() {
    let (mock, mut cache) = failing_load(7, 1);
    cache.layer(0, 8).unwrap();
    let e = cache.layer(1, 8).unwrap_err();
    assert!(e.is_load_failure());
    assert!(matches!(
        e,
        CandleKvError::Load {
            layer: Some(1),
            source: KvLoadError::Store { .. }
        }
    ));
    // Later layers report the first failure without asking the loader again.
    let again = cache.layer(2, 8).unwrap_err();
    assert!(matches!(again, CandleKvError::Load { layer: Some(1), .. }));
    assert_eq!(waits(&mock), vec![0, 1]);
    // The outcome fails too; the prefix is gone and the engine recomputes into the slots.
    let out = cache.finish_load().unwrap_err();
    assert!(out.is_load_failure(), "{out}");
    assert_eq!(cache.loaded_tokens(), 0);
    cache.write(1, 0, &rows(8, 0.0)).unwrap();
    assert_eq!(cache.layer(1, 8).unwrap().dims(), &[8, 6]);
}

/// Before, once a failed load's outcome was taken, reads of its tokens returned whatever the
/// slots held before (another sequence's rows, zeros) as `Ok`, as if computed: an engine that
/// read a layer before recomputing it got wrong attention silently. Each layer's reads are
/// refused until the engine wrote its rows again from token 0 on; a retried load lifts it.
#[test]
fn a_failed_loads_tokens_are_refused_until_the_engine_writes_them_again() {
    let (mock, mut cache) = failing_load(9, 1);
    assert!(cache.finish_load().unwrap_err().is_load_failure());
    let stale = |r: Result<Tensor, CandleKvError>| match r {
        Err(CandleKvError::NotRecomputed { layer, from, to }) => Some((layer, from, to)),
        Ok(_) => None,
        Err(e) => panic!("{e}"),
    };
    // Layer 0 loaded before the failure, but the whole prefix is gone: every layer is stale.
    assert_eq!(stale(cache.layer(0, 8)), Some((0, 0, 8)));
    assert_eq!(stale(cache.layer(1, 3)), Some((1, 0, 3)));
    cache.write(1, 0, &rows(5, 0.0)).unwrap();
    assert_eq!(stale(cache.layer(1, 8)), Some((1, 5, 8)));
    assert_eq!(cache.layer(1, 5).unwrap().dims(), &[5, 6]);
    assert_eq!(stale(cache.layer_pages(1, 2)), Some((1, 5, 8)));
    assert_eq!(cache.layer_pages(1, 1).unwrap().dims(), &[1, 4, 6]);
    // The rest of the layer written, it reads again.
    cache.write(1, 5, &rows(3, 1.0)).unwrap();
    assert_eq!(cache.layer(1, 8).unwrap().dims(), &[8, 6]);
    assert_eq!(stale(cache.layer(2, 8)), Some((2, 0, 8)), "layers apart");
    let e = cache.layer(0, 1).unwrap_err();
    assert!(!e.is_load_failure() && !e.needs_reset(), "{e}");
    // A retried load covers the prefix again: its layers are waited for, not refused.
    let retried = mock.start_load(plan(10)).unwrap();
    let cache = cache.with_load(LayerGate::new(mock.clone(), retried));
    assert_eq!(cache.layer(0, 8).unwrap().dims(), &[8, 6]);
}

/// The engine's own prefix (its prefix cache's pages, maybe shared with other sequences) comes
/// before the pages the load fills: after a failed load the engine recomputes from the load's
/// first token, as the integration guide says, and reads its own prefix as it is. Before, the
/// cache counted the load from token 0: a write from the load's first token never lifted the
/// refusal, and the only way on was to rewrite the shared prefix pages.
#[test]
fn after_a_failed_load_the_engines_own_prefix_stays_readable_and_recompute_starts_after_it() {
    let (mock, cache) = failing_load(31, 0);
    // Page 0 is the engine's own (tokens 0..4), page 1 the load's (tokens 4..8).
    // SAFETY: the mock's load writes no slot (and none of page 0's).
    let mut cache = unsafe { cache.load_starts_at(4) };
    assert_eq!(cache.load_start(), 4);
    assert!(cache.finish_load().unwrap_err().is_load_failure());
    assert_eq!(cache.layer(0, 4).unwrap().dims(), &[4, 6], "its own prefix");
    assert!(matches!(
        cache.layer(0, 8),
        Err(CandleKvError::NotRecomputed {
            layer: 0,
            from: 4,
            to: 8
        })
    ));
    cache.write(0, 4, &rows(4, 0.0)).unwrap();
    assert_eq!(cache.layer(0, 8).unwrap().dims(), &[8, 6]);
    assert!(matches!(
        cache.layer(1, 8),
        Err(CandleKvError::NotRecomputed {
            layer: 1,
            from: 4,
            to: 8
        })
    ));
    // A start off a page boundary is the page's: loads land whole pages.
    let t = mock.start_load(plan(32)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `t`, which
    // writes none of page 0's.
    let cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8).load_starts_at(6) }
        .with_load(LayerGate::new(mock.clone(), t));
    assert_eq!(cache.load_start(), 4);
}

/// A load that did not settle fences its own tokens, not the engine's prefix before them.
#[test]
fn a_load_that_did_not_settle_fences_only_the_tokens_it_covers() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(33)).unwrap();
    // SAFETY: the test's own pool; the only load into slot 1 (page 1) is the mock's `ticket`.
    let mut cache =
        unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8).load_starts_at(4) }
            .with_load(LayerGate::new(mock.clone(), ticket));
    mock.wait_batch(&ticket).unwrap();
    assert!(cache.finish_load().unwrap_err().needs_reset());
    assert_eq!(cache.layer(0, 4).unwrap().dims(), &[4, 6], "its own prefix");
    assert!(matches!(
        cache.layer(0, 5),
        Err(CandleKvError::Unsettled { .. })
    ));
    assert!(matches!(
        cache.write(0, 4, &rows(1, 0.0)),
        Err(CandleKvError::Unsettled { .. })
    ));
}

/// A gate whose `finish` panicked (the loader's `wait_batch` did) kept no verdict: its next
/// `finish` takes the outcome. Before, the gate counted as finished and answered `Ok(None)`
/// ("finished a load before"), so a cache took a load it never settled as good.
#[test]
fn a_finish_that_panicked_is_taken_again_not_answered_ok() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(kv_loader::BatchId(37), 0);
    let loader = Arc::new(EventLoader {
        inner: MockKvLoader::new(2, script),
        event: Arc::new(CountingEvent::default()),
        outcome_error: None,
        panics: AtomicU32::new(1),
        hook: None,
    });
    let ticket = loader.start_load(plan(37)).unwrap();
    let mut gate = LayerGate::new(loader.clone(), ticket);
    let first = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gate.finish()));
    assert!(first.is_err(), "the loader panicked");
    let again = gate.finish().unwrap_err();
    assert!(again.is_load_failure(), "{again}");
}

/// A fence in place keeps its own first token: a later `load_starts_at` does not narrow it
/// (the load that did not settle may still write from token 0).
#[test]
fn a_later_load_start_does_not_narrow_a_fence_in_place() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(36)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    mock.wait_batch(&ticket).unwrap();
    assert!(cache.finish_load().unwrap_err().needs_reset());
    // SAFETY: later loads (none here) would write page 1's slot only.
    let cache = unsafe { cache.load_starts_at(4) };
    assert!(matches!(
        cache.layer(0, 4),
        Err(CandleKvError::Unsettled { .. })
    ));
}

/// A gate whose own `finish` took a failure, then attached to a cache, still tells the cache
/// the load failed: before, its second `finish` said `Ok(None)`, the cache never settled, and
/// an open gate attached next let the failed load's stale rows read as `Ok`.
#[test]
fn a_gate_finished_on_a_failure_then_attached_still_fails_the_cache() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(kv_loader::BatchId(35), 0);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(35)).unwrap();
    let mut gate = LayerGate::new(mock.clone(), ticket);
    assert!(gate.finish().unwrap_err().is_load_failure());
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }.with_load(gate);
    assert!(cache.finish_load().unwrap_err().is_load_failure());
    let cache = cache.with_load(LayerGate::open());
    assert!(
        matches!(cache.layer(0, 8), Err(CandleKvError::NotRecomputed { .. })),
        "{:?}",
        cache.layer(0, 8)
    );
}

/// An open gate attached after a failed load covers nothing: the failed load's tokens stay
/// refused until the engine writes them again. Before, `with_load` counted the tokens loaded
/// again for any gate, and with an open one the stale rows read as `Ok`.
#[test]
fn an_open_gate_attached_after_a_failed_load_leaves_its_tokens_refused() {
    let (mock, mut cache) = failing_load(21, 0);
    assert!(cache.finish_load().unwrap_err().is_load_failure());
    let cache = cache.with_load(LayerGate::open());
    assert_eq!(cache.loaded_tokens(), 0);
    assert!(
        matches!(cache.layer(0, 8), Err(CandleKvError::NotRecomputed { .. })),
        "{:?}",
        cache.layer(0, 8)
    );
    // A gate whose (failed) outcome a clone took answers its verdict, not stale rows.
    let t = mock.start_load(plan(22)).unwrap();
    let mut script_gate = LayerGate::new(mock.clone(), t);
    let attached = script_gate.clone();
    assert!(script_gate.finish().unwrap().is_some());
    let mut cache = cache.with_load(attached);
    assert_eq!(
        cache.layer(0, 8).unwrap().dims(),
        &[8, 6],
        "that load landed"
    );
    assert!(
        cache.finish_load().unwrap().is_some(),
        "the clone's verdict"
    );
}

/// Before, a later load's failure dropped the loaded tokens to zero, and with them the fence
/// of an earlier load that had not settled: safe code could then write slots that load might
/// still be writing.
#[test]
fn a_later_failed_load_does_not_lift_the_fence_of_one_that_did_not_settle() {
    let mut script = MockScript::default();
    script.time_out.push(kv_loader::BatchId(3));
    script.fail_at_layer.insert(kv_loader::BatchId(4), 0);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let unsettled = mock.start_load(plan(3)).unwrap();
    let failing = mock.start_load(plan(4)).unwrap();
    // SAFETY: the test's own pool; the only loads into slots 0 and 1 are the mock's.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), unsettled))
        .with_load(LayerGate::new(mock.clone(), failing));
    assert_eq!(cache.fenced_tokens(), 8, "the first load did not settle");
    let e = cache.finish_load().unwrap_err();
    assert!(e.is_load_failure() && !e.needs_reset(), "{e}");
    assert_eq!(cache.loaded_tokens(), 0);
    assert!(matches!(
        cache.write(0, 0, &rows(1, 0.0)),
        Err(CandleKvError::Unsettled { .. })
    ));
    assert!(matches!(
        cache.layer(0, 1),
        Err(CandleKvError::Unsettled { .. })
    ));
    assert_eq!(cache.fenced_tokens(), 8, "for the life of the cache");
}

/// A load attached again after a failed one (an engine retrying the plan) covers the loaded
/// tokens again: its layers are waited for, and when it does not settle they are fenced.
/// Before, the failure's zero loaded tokens stayed: the new load was neither waited for nor
/// fenced, and safe code read and wrote slots it might still be writing.
#[test]
fn a_load_attached_after_a_failed_one_is_waited_for_and_fenced() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(kv_loader::BatchId(5), 0);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let failing = mock.start_load(plan(5)).unwrap();
    // SAFETY: the test's own pool; the only loads into slots 0 and 1 are the mock's.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), failing));
    assert!(cache.finish_load().is_err());
    assert_eq!(cache.loaded_tokens(), 0);
    let retried = mock.start_load(plan(6)).unwrap();
    let mut cache = cache.with_load(LayerGate::new(mock.clone(), retried));
    assert_eq!(
        cache.loaded_tokens(),
        8,
        "the retried load covers the prefix again"
    );
    // Its outcome is taken elsewhere: the cache cannot learn that the load has stopped.
    mock.wait_batch(&retried).unwrap();
    let e = cache.finish_load().unwrap_err();
    assert!(e.needs_reset(), "{e}");
    assert_eq!(cache.fenced_tokens(), 8);
    assert!(matches!(
        cache.layer(0, 1),
        Err(CandleKvError::Unsettled { .. })
    ));
}

#[test]
fn a_load_that_did_not_settle_fences_the_loaded_tokens() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(9)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 4) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    // The outcome is taken elsewhere: the cache cannot learn that the load has stopped.
    mock.wait_batch(&ticket).unwrap();
    let e = cache.finish_load().unwrap_err();
    assert!(e.needs_reset(), "{e}");
    // The loaded tokens stay fenced: the load might still be writing them.
    assert!(matches!(
        cache.write(0, 0, &rows(1, 0.0)),
        Err(CandleKvError::Unsettled { .. })
    ));
    assert!(matches!(
        cache.layer(0, 4),
        Err(CandleKvError::Unsettled { .. })
    ));
    assert!(matches!(
        cache.layer_pages(0, 1),
        Err(CandleKvError::Unsettled { .. })
    ));
    // Past the loaded prefix the slots are the cache's own, as before.
    cache.write(0, 4, &rows(1, 0.0)).unwrap();
    assert_eq!(cache.loaded_tokens(), 4);
}

#[test]
fn an_open_gate_never_calls_a_loader() {
    // SAFETY: the test's own pool, no load.
    let cache = unsafe { PagedLatentCache::new(f32_latents(2), vec![1], 0) };
    assert!(cache.layer(2, 3).is_ok());
    assert!(format!("{:?}", cache.gate()).contains("open"));
}

/// A loader whose layers come back as device events (like a CUDA pool's), or as a test's hook says.
struct EventLoader {
    inner: MockKvLoader,
    event: Arc<CountingEvent>,
    /// What every batch outcome says instead of the mock's (`None`: the mock's).
    outcome_error: Option<KvLoadError>,
    /// `wait_batch` panics this many more times (a defect in the loader) before it answers.
    panics: AtomicU32,
    /// Layer waits through a test's hook instead of answering `event` (`None`: `event`).
    hook: Option<WaitHook>,
}

impl EventLoader {
    /// A loader of two layers over the default script whose layer waits go through `hook`.
    fn hooked(hook: WaitHook) -> Arc<EventLoader> {
        Arc::new(EventLoader {
            inner: MockKvLoader::new(2, MockScript::default()),
            event: Arc::new(CountingEvent::default()),
            outcome_error: None,
            panics: AtomicU32::new(0),
            hook: Some(hook),
        })
    }
}

/// A hook around a layer wait: run before the mock's, and over its answer.
struct WaitHook {
    before: Box<dyn Fn(u32) + Send + Sync>,
    answer: Box<dyn Fn(u32, LayerReady) -> LayerReady + Send + Sync>,
}

#[derive(Debug, Default)]
struct CountingEvent {
    synchronized: AtomicU32,
    streamed: AtomicU32,
}

impl StreamWaitable for CountingEvent {
    fn wait_on_stream(&self, stream: RawStream) -> Result<(), KvLoadError> {
        assert_eq!(stream.as_raw(), 0xabc);
        self.streamed.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn synchronize(&self) -> Result<(), KvLoadError> {
        self.synchronized.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
}

impl KvLoader for EventLoader {
    fn num_layers(&self) -> u32 {
        self.inner.num_layers()
    }
    fn lookup(&self, r: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        self.inner.lookup(r)
    }
    fn lookup_pages(
        &self,
        pages: &[kv_geometry::PageHash],
        skip: usize,
    ) -> Result<LookupHit, KvLoadError> {
        self.inner.lookup_pages(pages, skip)
    }
    fn start_load(&self, p: BatchPlan) -> Result<LoadTicket, KvLoadError> {
        self.inner.start_load(p)
    }
    fn wait_layer(&self, t: &LoadTicket, l: u32) -> Result<LayerReady, KvLoadError> {
        let Some(hook) = &self.hook else {
            self.inner.wait_layer(t, l)?;
            return Ok(LayerReady::Event(self.event.clone()));
        };
        (hook.before)(l);
        let ready = self.inner.wait_layer(t, l)?;
        Ok((hook.answer)(l, ready))
    }
    fn wait_batch(&self, t: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
        if self
            .panics
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok()
        {
            panic!("test: the loader's wait_batch panics");
        }
        let outcome = self.inner.wait_batch(t)?;
        Ok(match &self.outcome_error {
            Some(e) => BatchOutcome {
                batch: outcome.batch,
                result: Err(e.clone()),
            },
            None => outcome,
        })
    }
    fn abandon(&self, t: &LoadTicket) {
        self.inner.abandon(t)
    }
    fn completed(&self) -> Vec<BatchOutcome> {
        self.inner.completed()
    }
    fn save(&self, p: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        self.inner.save(p)
    }
    fn reset(&self) -> Result<(), KvLoadError> {
        self.inner.reset()
    }
    fn close(&self) -> Result<(), KvLoadError> {
        self.inner.close()
    }
}

/// An [`EventLoader`] of `layers` layers whose batches load, and its event.
fn event_loader(layers: u32) -> (Arc<EventLoader>, Arc<CountingEvent>) {
    let event = Arc::new(CountingEvent::default());
    let loader = Arc::new(EventLoader {
        inner: MockKvLoader::new(layers, MockScript::default()),
        event: event.clone(),
        outcome_error: None,
        panics: AtomicU32::new(0),
        hook: None,
    });
    (loader, event)
}

#[test]
fn device_events_are_synchronized_or_handed_to_the_compute_stream() {
    let (loader, event) = event_loader(2);
    let t1 = loader.start_load(plan(1)).unwrap();
    let host = LayerGate::new(loader.clone(), t1);
    host.wait(0).unwrap();
    host.wait(0).unwrap();
    let t2 = loader.start_load(plan(2)).unwrap();
    // SAFETY: the fake event only compares the handle; no driver ever sees it.
    let raw = unsafe { RawStream::from_raw(0xabc) };
    let mut stream = LayerGate::new(loader.clone(), t2).on_stream(raw);
    stream.wait(1).unwrap();
    assert_eq!(
        event.synchronized.load(Ordering::SeqCst),
        2,
        "one host wait per call"
    );
    assert_eq!(event.streamed.load(Ordering::SeqCst), 1);
    assert!(stream.finish().unwrap().is_some());
}

/// A clone's wait after another clone took the outcome still waits on the layer's device
/// event (its copies may be queued on the load stream when the outcome comes): the gate kept
/// each layer's event before taking the outcome. Before, such a wait answered ready at once,
/// and a kernel on that clone's stream could read the slots before the copies landed.
#[test]
fn a_clone_waiting_after_the_verdict_still_waits_on_the_layer_event() {
    let (loader, event) = event_loader(2);
    let t = loader.start_load(plan(12)).unwrap();
    let mut first = LayerGate::new(loader.clone(), t);
    // SAFETY: the fake event only compares the handle; no driver ever sees it.
    let raw = unsafe { RawStream::from_raw(0xabc) };
    let second = first.clone().on_stream(raw);
    assert!(first.finish().unwrap().is_some());
    let before = event.synchronized.load(Ordering::SeqCst);
    second.wait(1).unwrap();
    assert_eq!(event.streamed.load(Ordering::SeqCst), 1, "the stream waits");
    first.wait(0).unwrap();
    assert_eq!(
        event.synchronized.load(Ordering::SeqCst),
        before + 1,
        "the gate that finished answers its verdict and waits on the layer's event too"
    );
}

/// The cache reads and writes its slots by host-side copies: a layer's event is waited for
/// on the host even when the gate hands events to a compute stream (`on_stream`), which
/// would only order that stream's kernels after the copies, not the cache's own reads.
/// Before, the cache's read passed the event to the stream and copied the slots at once.
#[test]
fn the_cache_waits_on_the_host_for_a_layer_of_a_gate_on_a_stream() {
    let (loader, event) = event_loader(3);
    let t = loader.start_load(plan(24)).unwrap();
    // SAFETY: the fake event only compares the handle; no driver ever sees it.
    let raw = unsafe { RawStream::from_raw(0xabc) };
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is `t` (a mock's).
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(loader.clone(), t).on_stream(raw));
    cache.layer(1, 8).unwrap();
    cache.write(2, 0, &rows(1, 0.0)).unwrap();
    assert_eq!(event.synchronized.load(Ordering::SeqCst), 2, "host waits");
    assert_eq!(event.streamed.load(Ordering::SeqCst), 0);
    cache.gate().wait(1).unwrap();
    assert_eq!(
        event.streamed.load(Ordering::SeqCst),
        1,
        "the gate's own wait"
    );
    assert!(cache.finish_load().unwrap().is_some());
}

/// A gate's own `finish` keeps its verdict: a later wait on it answers the failure, as a
/// clone's does. Before, `finish` left the gate open, and every later wait said the failed
/// load's layers were ready.
#[test]
fn a_gate_that_finished_a_failed_load_keeps_refusing_its_layers() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(kv_loader::BatchId(23), 1);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(23)).unwrap();
    let mut gate = LayerGate::new(mock.clone(), ticket);
    let clone = gate.clone();
    assert!(gate.is_loading() && clone.is_loading());
    assert!(gate.finish().unwrap_err().is_load_failure());
    assert!(
        !gate.is_loading() && !clone.is_loading(),
        "the outcome is taken"
    );
    for (which, g) in [("finished", &gate), ("clone", &clone)] {
        for layer in 0..3 {
            let e = g.wait(layer).unwrap_err();
            assert!(e.is_load_failure(), "{which}, layer {layer}: {e}");
        }
    }
    let again = gate.finish().unwrap_err();
    assert!(again.is_load_failure(), "a failure stays one: {again}");
}

/// A clone of a gate that finished a failed load, attached to the cache again, gives the
/// verdict at the cache's `finish_load`, so the cache settles it and the engine can write the
/// tokens again. Before, the clone copied the finished mark: its `finish` said nothing was
/// loading, the cache never settled, and every read and write of the tokens failed for good.
#[test]
fn a_clone_of_a_finished_gate_gives_the_verdict_again() {
    let (_mock, mut cache) = failing_load(26, 0);
    let mut first = cache.gate().clone();
    assert!(first.finish().unwrap_err().is_load_failure());
    assert!(
        cache.finish_load().unwrap_err().is_load_failure(),
        "the clone's verdict"
    );
    let mut cache = cache.with_load(first.clone());
    assert!(
        cache.finish_load().unwrap_err().is_load_failure(),
        "and again"
    );
    cache.write(0, 0, &rows(8, 0.0)).unwrap();
    assert_eq!(cache.layer(0, 8).unwrap().dims(), &[8, 6]);
}

/// A ticket's fields are public: one built by hand with a huge layer count is held to the
/// loader's layers (no event list sized by it, no wait past the model). Before, `finish`
/// sized its event list by the ticket: 64 GiB for `u32::MAX` layers.
#[test]
fn a_hand_built_ticket_is_held_to_the_loaders_layers() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let real = mock.start_load(plan(25)).unwrap();
    let forged = LoadTicket {
        num_layers: u32::MAX,
        ..real
    };
    let mut gate = LayerGate::new(mock.clone(), forged);
    assert!(matches!(
        gate.wait(3),
        Err(CandleKvError::LayerOutOfRange {
            layer: 3,
            num_layers: 3
        })
    ));
    // The mock knows the ticket it gave, not the forged one: stale, and no outcome taken
    // (the event list is held to 3 layers on the way).
    let e = gate.finish().unwrap_err();
    assert!(e.needs_reset(), "{e}");
    assert!(mock.wait_batch(&real).unwrap().result.is_ok());
}

/// A layer whose event `finish` could not keep (its wait failed, here past its deadline, on
/// a load that then ended well) fails the batch on this rank (`WaitFailed`, no reset): a
/// clone's later wait could not wait on that event. Before, the verdict was `Ok` and such a
/// wait answered ready at once.
#[test]
fn a_layer_event_finish_could_not_keep_fails_the_batch_on_this_rank() {
    let mut script = MockScript::default();
    script.wait_time_out_from.insert(kv_loader::BatchId(13), 2);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(13)).unwrap();
    let mut gate = LayerGate::new(mock.clone(), ticket);
    let e = gate.finish().unwrap_err();
    assert!(
        matches!(e, CandleKvError::WaitFailed { layer: 2, .. }) && !e.needs_reset(),
        "{e:?}"
    );
}

/// A layer wait past its deadline on a load that then ended well: the prefix is failed on
/// this rank (the engine gave the layer up) but the load has ended, so no reset is asked
/// for (a reset cancels every other batch in flight). Before, the wait's `Timeout` came back
/// as `Load` and asked for one.
#[test]
fn a_wait_that_failed_on_a_load_that_ended_asks_for_no_reset() {
    let mut script = MockScript::default();
    script.wait_time_out_from.insert(kv_loader::BatchId(8), 1);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(8)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    cache.layer(0, 8).unwrap();
    let waited = cache.layer(1, 8).unwrap_err();
    assert!(waited.needs_reset(), "the load may still run: {waited}");
    let e = cache.finish_load().unwrap_err();
    assert!(
        matches!(
            &e,
            CandleKvError::WaitFailed {
                layer: 1,
                source: KvLoadError::Timeout { .. }
            }
        ),
        "{e:?}"
    );
    assert!(e.is_load_failure() && !e.needs_reset(), "{e}");
    // The engine recomputes into the same slots: nothing is fenced.
    assert_eq!((cache.loaded_tokens(), cache.fenced_tokens()), (0, 0));
    cache.write(1, 0, &rows(8, 0.0)).unwrap();
    assert_eq!(cache.layer(1, 8).unwrap().dims(), &[8, 6]);
}

/// A clone's wait after another clone took the outcome answers with that verdict, not with
/// the failed wait seen before it: the load has ended, so no reset is asked for. Before, the
/// clone got the wait's `Timeout` as `Load`, which asks for a reset (cancelling every other
/// batch in flight on the rank).
#[test]
fn a_clone_waiting_after_the_verdict_gets_the_verdict() {
    let mut script = MockScript::default();
    script.wait_time_out_from.insert(kv_loader::BatchId(9), 1);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(9)).unwrap();
    let mut first = LayerGate::new(mock.clone(), ticket);
    let second = first.clone();
    first.wait(0).unwrap();
    assert!(
        first.wait(1).unwrap_err().needs_reset(),
        "the load may still run"
    );
    let verdict = first.finish().unwrap_err();
    assert!(
        matches!(verdict, CandleKvError::WaitFailed { layer: 1, .. }),
        "{verdict:?}"
    );
    let e = second.wait(0).unwrap_err();
    assert!(
        matches!(e, CandleKvError::WaitFailed { layer: 1, .. }) && !e.needs_reset(),
        "{e:?}"
    );
}

/// A cache dropped with its load unfinished (a request aborted mid-prefill) takes the load's
/// outcome as its gate goes: the batch is settled, its id free again, and nothing is left
/// for `completed`. Before, the load was left unwatched: its id stayed in use and, once
/// `max_in_flight` such drops piled up, every load was refused `Busy`.
#[test]
fn a_cache_dropped_unfinished_settles_its_load() {
    let mock = Arc::new(MockKvLoader::new(2, MockScript::default()));
    let ticket = mock.start_load(plan(11)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    let clone = cache.gate().clone();
    drop(cache);
    assert!(
        matches!(
            mock.start_load(plan(11)),
            Err(KvLoadError::DuplicateBatch { .. })
        ),
        "a clone still holds the gate"
    );
    drop(clone);
    assert!(mock.completed().is_empty(), "the outcome was taken on drop");
    let _ = mock.start_load(plan(11)).unwrap();
}

#[test]
fn an_outcome_that_cannot_be_taken_asks_for_a_reset() {
    let mock = Arc::new(MockKvLoader::new(2, MockScript::default()));
    let ticket = mock.start_load(plan(4)).unwrap();
    let mut gate = LayerGate::new(mock.clone(), ticket);
    gate.wait(0).unwrap();
    // The outcome is taken elsewhere (the engine drained `completed`): the gate's
    // `wait_batch` finds no outcome for its ticket.
    assert_eq!(mock.completed().len(), 1);
    let e = gate.finish().unwrap_err();
    assert!(e.is_load_failure() && e.needs_reset(), "{e}");
    assert!(matches!(
        e,
        CandleKvError::Unsettled {
            source: KvLoadError::StaleTicket { .. }
        }
    ));
}

#[test]
fn latents_read_and_write_a_device_pool_through_the_pool_trait() {
    // A device pool (on the CPU backend): slot copies now come from `KvPool` itself.
    let f = LatentFormat::new(4, 2, DType::F32).unwrap();
    let host = pool_for(ElementType::Bytes, f.row_bytes() as u32, 4);
    let device = kv_device::CpuDevice::new(0).unwrap();
    let pool = Arc::new(kv_device::DeviceKvPool::new(device, host.geometry().clone(), 4).unwrap());
    let lp = LatentPool::new(pool.clone(), "k", f, Device::Cpu).unwrap();
    let r = rows(6, 1.0);
    write(&lp, 2, &[3, 1], 0, &r).unwrap();
    let back = read(&lp, 2, &[3, 1], 6).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), r.to_vec2::<f32>().unwrap());
    // Inputs are checked through the trait object too: a slot past the pool, a wrong length.
    let dyn_pool: &dyn KvPool = pool.as_ref();
    let mut page = vec![0u8; PAGE as usize * f.row_bytes()];
    // SAFETY: the pool is this test's alone, used from one thread.
    unsafe { dyn_pool.read_slot(kv_geometry::ComponentId(0), 2, 3, &mut page) }.unwrap();
    assert!(page.iter().any(|&b| b != 0), "slot 3 holds the first page");
    // SAFETY: as above.
    let past = unsafe { dyn_pool.read_slot(kv_geometry::ComponentId(0), 2, 4, &mut page) };
    assert!(matches!(
        past,
        Err(kv_device::DeviceError::OutOfPool { .. })
    ));
    // SAFETY: as above.
    let short = unsafe { dyn_pool.write_slot(kv_geometry::ComponentId(0), 2, 0, &page[1..]) };
    assert!(matches!(
        short,
        Err(kv_device::DeviceError::OutOfPool { .. })
    ));
}

/// Loads land whole pages: a write after the last loaded token but inside its page rewrites
/// that page beside the load, so it waits for the layer too (it raced the load before).
#[test]
fn a_write_into_the_last_loaded_page_waits_for_the_load() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(11)).unwrap();
    let loaded = PAGE as usize + 2; // the load lands pages 0 and 1 whole
                                    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1, 2], loaded) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    cache.write(1, loaded, &rows(1, 0.0)).unwrap();
    assert_eq!(
        waits(&mock),
        vec![1, 2],
        "the write into page 1 waited for layer 1, then for the load's last layer (its \
         landing holds the slot until the batch is done)"
    );
    cache.write(1, 2 * PAGE as usize, &rows(1, 0.0)).unwrap();
    assert_eq!(waits(&mock), vec![1, 2], "page 2 is not the load's");
    cache.finish_load().unwrap();
}

/// A write into a page the load lands, on a pool that tracks claims, waits until the landing
/// lets go of the slot (as the batch ends) instead of failing `SlotBusy`. Before, it waited
/// for its own layer only and then failed while later layers were still landing.
#[test]
fn a_write_into_a_loaded_page_waits_for_the_landing_to_let_go_of_its_slot() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(14)).unwrap();
    let lp = f32_latents(4);
    let pool: Arc<dyn KvPool> = lp.pool().clone();
    // The landing's claim on slot 1, let go a moment later (as its batch ends).
    let landing = kv_device::SlotClaims::write(&pool, &[1]).unwrap();
    let loaded = PAGE as usize + 2;
    // SAFETY: the test's own pool; the only load into slots 0 and 1 is the mock's `ticket`.
    let mut cache = unsafe { PagedLatentCache::new(lp, vec![0, 1, 2], loaded) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    let let_go = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let_go.store(true, Ordering::SeqCst);
            drop(landing);
        });
        cache.write(0, loaded, &rows(1, 7.0)).unwrap();
        assert!(
            let_go.load(Ordering::SeqCst),
            "the write went ahead while the landing held the slot"
        );
    });
    cache.finish_load().unwrap();
    let got = cache
        .layer(0, loaded + 1)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(got[loaded], rows(1, 7.0).to_vec2::<f32>().unwrap()[0]);
}

/// Attaching a second load finishes the first (its outcome taken) instead of leaving it
/// writing the slots unwatched.
#[test]
fn attaching_another_load_finishes_the_one_attached() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let first = mock.start_load(plan(12)).unwrap();
    let second = mock.start_load(plan(13)).unwrap();
    // SAFETY: as above.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 4) }
        .with_load(LayerGate::new(mock.clone(), first))
        .with_load(LayerGate::new(mock.clone(), second));
    let taken: Vec<u64> = mock
        .calls()
        .into_iter()
        .filter_map(|c| match c {
            MockCall::WaitBatch { batch, .. } => Some(batch.0),
            _ => None,
        })
        .collect();
    assert_eq!(taken, vec![12], "the first load's outcome was taken");
    assert!(cache.gate().is_loading());
    cache.finish_load().unwrap();
}

/// One batch feeding two sequences' caches (a plan of two requests): the gate is cloned into
/// both, the first `finish_load` takes the outcome and the second gets the same verdict
/// without asking the loader again. Before, the gate could not be shared: a second gate on the
/// same ticket found the outcome already taken, `Unsettled`, fenced its loaded tokens for good
/// and asked for a reset (which cancels every batch in flight).
#[test]
fn one_batch_gates_two_caches_and_both_take_its_outcome() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(11)).unwrap();
    let gate = LayerGate::new(mock.clone(), ticket);
    // SAFETY: the test's own pool; slots 0 and 1 are sequence a's, 2 and 3 sequence b's, and
    // the only load into them is the mock's `ticket`.
    let mut a =
        unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1], 8) }.with_load(gate.clone());
    // SAFETY: as above.
    let mut b = unsafe { PagedLatentCache::new(f32_latents(4), vec![2, 3], 4) }.with_load(gate);
    a.layer(2, 8).unwrap();
    b.layer(2, 4).unwrap();
    let first = a.finish_load().unwrap().unwrap();
    let second = b.finish_load().unwrap().unwrap();
    assert_eq!(first, second);
    let taken = mock
        .calls()
        .into_iter()
        .filter(|c| matches!(c, MockCall::WaitBatch { .. }))
        .count();
    assert_eq!(taken, 1, "the loader was asked for the outcome once");
    assert_eq!((a.fenced_tokens(), b.fenced_tokens()), (0, 0));
    assert_eq!((a.loaded_tokens(), b.loaded_tokens()), (8, 4));
}

/// A failed wait seen through one clone of a gate is the batch's: the other clone's caches
/// fail on it too, without asking the loader again, and both outcomes say the load failed.
#[test]
fn a_failed_wait_through_one_clone_fails_the_others() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(kv_loader::BatchId(12), 1);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(12)).unwrap();
    let gate = LayerGate::new(mock.clone(), ticket);
    let mut other = gate.clone();
    let mut gate = gate;
    assert!(gate.wait(1).is_err());
    let again = other.wait(1).unwrap_err();
    assert!(matches!(again, CandleKvError::Load { layer: Some(1), .. }));
    assert_eq!(waits(&mock), vec![1], "the clone did not ask again");
    assert!(gate.finish().unwrap_err().is_load_failure());
    assert!(other.finish().unwrap_err().is_load_failure());
}

/// A load whose outcome is a failure that may leave copies in flight (`needs_reset`: here a
/// timeout) fences the loaded tokens as an outcome that could not be taken does. Before, the
/// loaded tokens dropped to zero and safe code could write slots the load might still write.
#[test]
fn a_failed_load_that_needs_a_reset_fences_the_loaded_tokens() {
    let event = Arc::new(CountingEvent::default());
    let loader = Arc::new(EventLoader {
        inner: MockKvLoader::new(2, MockScript::default()),
        event,
        outcome_error: Some(KvLoadError::Timeout {
            batch: kv_loader::BatchId(13),
            layer: 1,
            waited: std::time::Duration::from_secs(5),
        }),
        panics: AtomicU32::new(0),
        hook: None,
    });
    let ticket = loader.start_load(plan(13)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 0, 1 and 2 is `ticket`'s.
    let mut cache = unsafe { PagedLatentCache::new(f32_latents(4), vec![0, 1, 2], 8) }
        .with_load(LayerGate::new(loader.clone(), ticket));
    let e = cache.finish_load().unwrap_err();
    assert!(e.needs_reset(), "{e}");
    assert_eq!(cache.fenced_tokens(), 8);
    assert!(matches!(
        cache.write(0, 0, &rows(1, 0.0)),
        Err(CandleKvError::Unsettled { .. })
    ));
    // Past the loaded prefix the slots are the cache's own.
    cache.write(0, 8, &rows(1, 0.0)).unwrap();
}

/// A clone that waits after another clone took the outcome (its sequence ended this step, the
/// other reads its prefix next step) answers from the verdict: the loader has forgotten the
/// ticket, and its `StaleTicket` must not fail the batch for every clone.
#[test]
fn a_clone_that_waits_after_another_finished_answers_from_the_verdict() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(14)).unwrap();
    let mut first = LayerGate::new(mock.clone(), ticket);
    let mut second = first.clone();
    assert!(first.finish().unwrap().is_some());
    // `finish` asked for each layer's event (none: a host pool) before the outcome, last
    // layer first (no back-to-back pair of consecutive layers for the compute meter).
    assert_eq!(waits(&mock), vec![2, 1, 0]);
    second.wait(2).unwrap();
    assert_eq!(
        waits(&mock),
        vec![2, 1, 0],
        "the loader was not asked again"
    );
    assert!(second.finish().unwrap().is_some(), "the same verdict");
}

/// A reset (another batch's timeout, say) between the engine's last layer wait and the gate's
/// `finish` ends the ticket, not the load: every layer was waited for and landed, so the
/// verdict is the load's (`Ok`), and a clone's wait, before or after `finish`, answers ready
/// (a device layer's event kept from the wait that saw it). Before, `finish` asked the loader
/// again for each layer, met the ended ticket and failed the prefix on this rank
/// (`WaitFailed`).
#[test]
fn a_reset_after_every_layer_was_waited_leaves_the_verdict_the_loads() {
    for device_events in [false, true] {
        let script = MockScript {
            device_events,
            ..MockScript::default()
        };
        let mock = Arc::new(MockKvLoader::new(3, script));
        let ticket = mock.start_load(plan(40)).unwrap();
        let mut gate = LayerGate::new(mock.clone(), ticket);
        let clone = gate.clone();
        for layer in 0..3 {
            gate.wait(layer).unwrap();
        }
        mock.reset().unwrap();
        // A clone's wait between the reset and `finish` answers ready too.
        clone.wait(1).unwrap();
        let verdict = gate.finish();
        assert!(
            matches!(verdict, Ok(Some(_))),
            "events {device_events}: {verdict:?}"
        );
        for layer in 0..3 {
            clone.wait(layer).unwrap();
        }
        if device_events {
            assert!(mock.events_not_waited().is_empty());
        }
    }
}

/// An event whose first wait succeeds and every later one fails (a device fault).
#[derive(Debug, Default)]
struct FailsAfterOnce {
    waits: AtomicU32,
}

impl StreamWaitable for FailsAfterOnce {
    fn wait_on_stream(&self, _stream: RawStream) -> Result<(), KvLoadError> {
        self.synchronize()
    }
    fn synchronize(&self) -> Result<(), KvLoadError> {
        if self.waits.fetch_add(1, Ordering::SeqCst) == 0 {
            Ok(())
        } else {
            Err(KvLoadError::Device("event wait failed (test)".into()))
        }
    }
}

/// A layer seen ready whose event wait then fails (no reset): the failure is kept for every
/// clone and the verdict is `WaitFailed`, as for any failed wait; what was seen stands in only
/// for a ticket a reset ended. (A first version took any failed wait of a seen layer for
/// ready: the clone's next wait answered `Ok` and the verdict was `Ok`.)
#[test]
fn a_failed_event_wait_of_a_layer_seen_ready_is_kept() {
    let event = Arc::new(FailsAfterOnce::default());
    let layer_0 = event.clone();
    let loader = EventLoader::hooked(WaitHook {
        before: Box::new(|_| {}),
        answer: Box::new(move |l, ready| match l {
            0 => LayerReady::Event(layer_0.clone()),
            _ => ready,
        }),
    });
    let ticket = loader.start_load(plan(41)).unwrap();
    let mut gate = LayerGate::new(loader.clone(), ticket);
    let clone = gate.clone();
    gate.wait(0).unwrap();
    gate.wait(1).unwrap();
    assert!(clone.wait(0).unwrap_err().is_load_failure());
    assert!(clone.wait(1).unwrap_err().is_load_failure(), "kept");
    assert_eq!(
        event.waits.load(Ordering::SeqCst),
        2,
        "each event waited once"
    );
    let verdict = gate.finish();
    assert!(
        matches!(verdict, Err(CandleKvError::WaitFailed { layer: 0, .. })),
        "{verdict:?}"
    );
}

/// Two clones wait for one layer at once and a reset lands between: the clone whose wait
/// meets the ended ticket answers what the other's wait saw, and the verdict is the load's.
/// (A first version read what was seen before asking the loader: `WaitFailed`.)
#[test]
fn a_wait_that_meets_a_reset_answers_what_another_clones_wait_saw() {
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (parked_tx, parked_rx) = std::sync::mpsc::sync_channel::<()>(1);
    let go = std::sync::Mutex::new(Some(go_rx));
    let loader = EventLoader::hooked(WaitHook {
        // The first wait of layer 1 on thread "b" parks until the test lets it go.
        before: Box::new(move |l| {
            if l == 1 && std::thread::current().name() == Some("b") {
                if let Some(go) = go.lock().unwrap().take() {
                    parked_tx.send(()).unwrap();
                    go.recv().unwrap();
                }
            }
        }),
        answer: Box::new(|_, ready| ready),
    });
    let ticket = loader.start_load(plan(42)).unwrap();
    let mut gate = LayerGate::new(loader.clone(), ticket);
    let clone = gate.clone();
    let b = std::thread::Builder::new()
        .name("b".into())
        .spawn(move || clone.wait(1))
        .unwrap();
    parked_rx.recv().unwrap();
    gate.wait(0).unwrap();
    gate.wait(1).unwrap();
    loader.reset().unwrap();
    go_tx.send(()).unwrap();
    b.join().unwrap().unwrap();
    let verdict = gate.finish();
    assert!(matches!(verdict, Ok(Some(_))), "{verdict:?}");
}

/// A layer seen ready, then the batch fails and a reset lets its slot go to another batch:
/// a clone's wait of that layer answers the failure (the outcome, taken there), not ready
/// from what was seen, and `finish` gives the same verdict. (A first version answered ready
/// while the slot was the next batch's.)
#[test]
fn a_layer_seen_ready_of_a_batch_that_failed_is_not_ready_after_a_reset() {
    let mut script = MockScript::default();
    script.fail_at_layer.insert(BatchId(43), 1);
    let mock = Arc::new(MockKvLoader::new(3, script));
    let ticket = mock.start_load(plan(43)).unwrap();
    let mut gate = LayerGate::new(mock.clone(), ticket);
    let clone = gate.clone();
    gate.wait(0).unwrap();
    mock.reset().unwrap();
    let e = clone.wait(0).unwrap_err();
    assert!(e.is_load_failure(), "{e}");
    assert!(gate.finish().unwrap_err().is_load_failure());
}

/// A gated read returns the rows of its own layer from the sequence's slots, in page-table
/// order (the other tests of the gate check shapes and waits): the landed bytes, not another
/// layer's or slot's.
#[test]
fn a_gated_read_returns_its_layers_rows_from_the_sequences_slots() {
    let mock = Arc::new(MockKvLoader::new(3, MockScript::default()));
    let ticket = mock.start_load(plan(15)).unwrap();
    let lp = f32_latents(4);
    let table = vec![2u32, 0];
    // What the load landed: layer 0 and layer 1 differ; slot 1 (not the sequence's) too.
    write(&lp, 0, &table, 0, &rows(6, 100.0)).unwrap();
    write(&lp, 1, &table, 0, &rows(6, 0.0)).unwrap();
    write(&lp, 1, &[1], 0, &rows(4, 500.0)).unwrap();
    // SAFETY: the test's own pool; the only load into slots 2 and 0 is the mock's `ticket`.
    let cache = unsafe { PagedLatentCache::new(lp, table, 2 * PAGE as usize) }
        .with_load(LayerGate::new(mock.clone(), ticket));
    let want = |base| rows(6, base).to_vec2::<f32>().unwrap();
    assert_eq!(
        cache.layer(1, 6).unwrap().to_vec2::<f32>().unwrap(),
        want(0.0)
    );
    assert_eq!(
        cache.layer(0, 6).unwrap().to_vec2::<f32>().unwrap(),
        want(100.0)
    );
    let paged = cache.layer_pages(1, 2).unwrap();
    assert_eq!(paged.dims(), &[2, PAGE as usize, 6]);
    let flat = paged.reshape((2 * PAGE as usize, 6)).unwrap();
    assert_eq!(
        flat.narrow(0, 0, 6).unwrap().to_vec2::<f32>().unwrap(),
        want(0.0)
    );
    assert_eq!(waits(&mock), vec![1, 0, 1]);
}
