//! The linker end to end on the embedded store: layer-wise loads into scattered slots,
//! single rank and TP ranks as threads, every failure rule, reset and close.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{KvGeometry, ModelKvSpec};
use kvlink::kv_loader::{
    BatchId, EngineAction, KvLoadError, KvLoader, LoadTicket, LookupRequest, PlanError,
    StoreFailure,
};
use kvlink::mooncake_linker::read_plan::ReadCost;
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore, StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig, ReadGranularity};

/// One layer per store call: these tests pin failures and timeouts to single layers (groups
/// of layers are tested in layer_groups.rs).
fn cfg() -> LinkerConfig {
    LinkerConfig {
        namespace: "test".into(),
        wait_deadline: Duration::from_secs(10),
        read_granularity: ReadGranularity::Fixed { layers_per_call: 1 },
        ..LinkerConfig::default()
    }
}

struct Rig {
    spec: ModelKvSpec,
    faulty: Arc<FaultyStore>,
    pages: Vec<kvlink::kv_geometry::PageHash>,
    tokens: Vec<u32>,
}

fn rig(pages: usize) -> Rig {
    let spec = small_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let tokens = prompt(7, pages, spec.page_size);
    let saved = save_prefix(&spec, store.clone(), &tokens, &cfg());
    Rig {
        faulty: Arc::new(FaultyStore::new(store)),
        spec,
        pages: saved,
        tokens,
    }
}

/// Rank 0 of TP 1 (a 16-slot pool) over `r`'s store, batch 1 started: `r`'s pages into slots
/// 0, 1 and 2.
fn start_batch_1(r: &Rig, config: LinkerConfig) -> (Linker, Arc<HostKvPool>, LoadTicket) {
    let (linker, pool) = rank_linker(r, 1, 0, 16, config);
    let plan = load_plan(linker.geometry(), 1, &r.pages, vec![0, 1, 2]);
    let t = linker.start_load(plan).unwrap();
    (linker, pool, t)
}

fn rank_linker(
    r: &Rig,
    tp: u32,
    rank: u32,
    pool_pages: u32,
    config: LinkerConfig,
) -> (Linker, Arc<HostKvPool>) {
    let g = KvGeometry::new(r.spec.clone(), tp, rank).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), pool_pages).unwrap());
    let linker = Linker::new(g, r.faulty.clone(), pool.clone(), config).unwrap();
    (linker, pool)
}

/// Scattered, reversed slots with gaps: page i goes to slot 3 * (n - i) + 1.
fn scattered(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 3 * (n as u32 - i) + 1).collect()
}

#[test]
fn loads_scattered_slots_layer_by_layer() {
    let r = rig(5);
    let (linker, pool) = rank_linker(&r, 1, 0, 32, cfg());
    let hit = linker
        .lookup(&LookupRequest {
            tokens: &r.tokens,
            skip_pages: 1,
        })
        .unwrap();
    assert_eq!((hit.first_page, hit.pages.len(), hit.tokens), (1, 4, 16));
    assert_eq!(hit.pages, r.pages[1..]);
    let slots = scattered(5);
    let ticket = linker
        .start_load(load_plan(linker.geometry(), 1, &r.pages, slots.clone()))
        .unwrap();
    for l in 0..linker.num_layers() {
        linker.wait_layer(&ticket, l).unwrap();
        // Layer l is resident as soon as its wait returns.
        pool_matches(&pool, &r.pages, &slots, l + 1).unwrap();
    }
    let outcome = linker.wait_batch(&ticket).unwrap();
    let stats = outcome.result.unwrap();
    let g = linker.geometry();
    assert_eq!(stats.bytes_read, 5 * g.bytes_per_page());
    assert!(stats.first_layer <= stats.last_layer);
    let m = linker.metrics();
    assert_eq!(m.bytes_read, stats.bytes_read);
    assert_eq!(m.layer_reads, 6);
    assert_eq!(m.batches_loaded, 1);
    assert_eq!(m.pages_hit, 4);
    // The ticket is spent.
    assert!(matches!(
        linker.wait_layer(&ticket, 0),
        Err(KvLoadError::StaleTicket { .. })
    ));
}

#[test]
fn tp_ranks_as_threads_each_load_their_own_slots() {
    let r = rig(6);
    std::thread::scope(|s| {
        for rank in 0..4u32 {
            let r = &r;
            s.spawn(move || {
                let (linker, pool) = rank_linker(r, 4, rank, 40, cfg());
                // Each rank allocates different slots.
                let slots: Vec<u32> = (0..6).map(|i| (i * 5 + rank * 3) % 40).collect();
                let t = linker
                    .start_load(load_plan(linker.geometry(), 1, &r.pages, slots.clone()))
                    .unwrap();
                wait_all(&linker, &t).unwrap();
                linker.wait_batch(&t).unwrap().result.unwrap();
                pool_matches(&pool, &r.pages, &slots, 6).unwrap();
            });
        }
    });
}

/// Settings no linker can run with are refused at build, naming the setting. Before, a zero
/// `layer_read_timeout` built and failed every batch with `RpcTimeout`, and an invalid prior
/// was replaced by the default unsaid.
#[test]
fn settings_no_linker_can_run_with_are_refused_at_build() {
    let g = KvGeometry::new(small_spec(), 1, 0).unwrap();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
    let build = |config: LinkerConfig| {
        let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
        Linker::new(g.clone(), store.clone(), pool, config)
    };
    let refused = |config: LinkerConfig, what: &str| match build(config) {
        Err(KvLoadError::Config(c)) => assert!(c.to_string().contains(what), "{c}"),
        Err(e) => panic!("{what}: {e:?}"),
        Ok(_) => panic!("{what}: built"),
    };
    refused(
        LinkerConfig {
            layer_read_timeout: Duration::ZERO,
            ..cfg()
        },
        "layer_read_timeout",
    );
    refused(
        LinkerConfig {
            store_call_timeout: Duration::ZERO,
            ..cfg()
        },
        "store_call_timeout",
    );
    let bad_prior = ReadCost::from_gbps(Duration::ZERO, Duration::ZERO, -1.0);
    refused(
        LinkerConfig {
            read_granularity: ReadGranularity::Adaptive {
                max_layers_per_call: 8,
                compute_per_layer: None,
                prior: bad_prior,
            },
            ..cfg()
        },
        "prior",
    );
    assert!(build(cfg()).is_ok());
    // A prefix probe checks the same settings (its store calls are bounded the same way).
    let probe = |config: &LinkerConfig| {
        kvlink::mooncake_linker::PrefixProbe::new(small_spec(), 1, store.clone(), config)
    };
    let zero = LinkerConfig {
        store_call_timeout: Duration::ZERO,
        ..cfg()
    };
    assert!(matches!(probe(&zero), Err(KvLoadError::Config(_))));
    assert!(probe(&cfg()).is_ok());
}

#[test]
fn bad_plans_are_refused_before_any_io() {
    let r = rig(3);
    let (linker, _pool) = rank_linker(&r, 1, 0, 8, cfg());
    let g = linker.geometry().clone();
    let before = linker.metrics();
    let dup = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![1, 2, 1]))
        .unwrap_err();
    assert!(matches!(
        dup,
        KvLoadError::InvalidPlan {
            reason: PlanError::DuplicateSlot {
                slot: 1,
                first: 0,
                second: 2
            },
            ..
        }
    ));
    let out = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![1, 2, 8]))
        .unwrap_err();
    assert!(matches!(
        out,
        KvLoadError::InvalidPlan {
            reason: PlanError::SlotOutOfPool { slot: 8, .. },
            ..
        }
    ));
    let count = linker
        .start_load(load_plan(&g, 3, &r.pages, vec![1, 2]))
        .unwrap_err();
    assert!(matches!(
        count,
        KvLoadError::InvalidPlan {
            reason: PlanError::SlotCount { .. },
            ..
        }
    ));
    assert!(!dup.is_retryable());
    assert_eq!(linker.metrics(), before, "no I/O for refused plans");
}

#[test]
fn object_size_mismatch_is_a_typed_error() {
    // The store holds the small model; a geometry with another KV row size must not load it.
    let r = rig(2);
    let mut spec = r.spec.clone();
    spec.components[0].row_bytes = 48;
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
    let linker = Linker::new(g.clone(), r.faulty.clone(), pool, cfg()).unwrap();
    let t = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1]))
        .unwrap();
    let err = linker.wait_layer(&t, 0).unwrap_err();
    assert!(
        matches!(
            &err,
            KvLoadError::InvalidPlan {
                reason: PlanError::ObjectSize {
                    expected: 1152,
                    actual: 960,
                    ..
                },
                ..
            }
        ),
        "{err}"
    );
}

fn failing_load(r: &Rig, layer: u32, fault: Fault) -> (KvLoadError, Linker, Arc<HostKvPool>) {
    let offset = k_layer_offset(r, layer);
    r.faulty.inject(
        FaultRule {
            key_contains: Some(format!("{}_cp0", r.pages[1])),
            offset: Some(offset),
            times: Some(1),
            ..FaultRule::default()
        },
        fault,
    );
    let (linker, pool) = rank_linker(r, 1, 0, 16, cfg());
    let g = linker.geometry().clone();
    let slots = scattered(r.pages.len());
    let t = linker
        .start_load(load_plan(&g, 1, &r.pages, slots.clone()))
        .unwrap();
    // Layers before the failure are ready and right; the failed layer and all after it fail.
    for l in 0..layer {
        linker.wait_layer(&t, l).unwrap();
    }
    pool_matches(&pool, &r.pages, &slots, layer).unwrap();
    let err = linker.wait_layer(&t, layer).unwrap_err();
    for l in layer..linker.num_layers() {
        assert_eq!(
            linker.wait_layer(&t, l).unwrap_err().to_string(),
            err.to_string()
        );
    }
    let outcome = linker.wait_batch(&t).unwrap();
    assert_eq!(outcome.result.unwrap_err().to_string(), err.to_string());
    r.faulty.clear();
    // A later batch on the same linker works.
    let t2 = linker
        .start_load(load_plan(&g, 2, &r.pages, slots.clone()))
        .unwrap();
    wait_all(&linker, &t2).unwrap();
    linker.wait_batch(&t2).unwrap().result.unwrap();
    pool_matches(&pool, &r.pages, &slots, 6).unwrap();
    (err, linker, pool)
}

#[test]
fn failed_read_at_first_middle_and_last_layer_fails_the_batch() {
    for layer in [0, 3, 5] {
        let r = rig(3);
        let fault = Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        });
        let (err, linker, _) = failing_load(&r, layer, fault);
        match &err {
            KvLoadError::Store {
                batch,
                layer: Some(l),
                pages,
                kind: StoreFailure::TransferFailed,
                detail,
            } => {
                assert_eq!(*batch, Some(kvlink::kv_loader::BatchId(1)));
                assert_eq!(*l, layer);
                assert_eq!(&pages[..], &[1]);
                // The store's typed error travels as the source, not only as words.
                assert!(
                    matches!(
                        detail.downcast_ref::<StoreError>(),
                        Some(StoreError::TransferFailed { code: -800, .. })
                    ),
                    "{detail:?}"
                );
                assert!(std::error::Error::source(&err).is_some());
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(err.is_retryable());
        let m = linker.metrics();
        assert_eq!((m.batches_failed, m.batches_loaded), (1, 1));
        assert_eq!(m.failures.get("store_transfer"), Some(&1));
    }
}

#[test]
fn short_read_fails_the_batch() {
    let r = rig(3);
    let (err, _, _) = failing_load(&r, 2, Fault::Short);
    assert!(
        matches!(
            &err,
            KvLoadError::Store {
                kind: StoreFailure::ShortRead,
                layer: Some(2),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("short read"));
}

#[test]
fn a_rank_alone_whose_first_layer_reads_slowly_still_takes_the_sizes_verdict() {
    // Every object has its companion, so the object sizes start only once the first group is
    // read. That read takes longer than the whole preflight bound of a rank alone (six store
    // calls and a quarter from the batch's start); the sizes then take a slow query (under
    // one store call). Their verdict must still be waited for, not called overdue.
    let r = rig(3);
    let store_call = Duration::from_millis(150);
    let config = LinkerConfig {
        store_call_timeout: store_call,
        layer_read_timeout: Duration::from_secs(5),
        ..cfg()
    };
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let layer0 = g
        .component_by_name("k")
        .unwrap()
        .layer_range(0)
        .unwrap()
        .start;
    r.faulty.inject(
        FaultRule {
            offset: Some(layer0),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(store_call * 8),
    );
    r.faulty.inject_on(
        FaultCall::Size,
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(store_call / 3),
    );
    let (linker, pool, t) = start_batch_1(&r, config);
    wait_all(&linker, &t).unwrap();
    let stats = linker.wait_batch(&t).unwrap().result.unwrap();
    assert_eq!(stats.bytes_read, 3 * g.bytes_per_page());
    pool_matches(&pool, &r.pages, &[0, 1, 2], linker.num_layers()).unwrap();
    // Nothing was called bad on the way.
    assert_eq!(linker.metrics().bad_objects, 0);
}

/// Where layer `layer` starts in a `k` object.
fn k_layer_offset(r: &Rig, layer: u32) -> u64 {
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let k = g.component_by_name("k").unwrap();
    k.layer_range(layer).unwrap().start
}

/// `fault` hits, once, a read of layer `layer` of the `k` objects.
fn once_at_k_layer(r: &Rig, layer: u32, fault: Fault) {
    let offset = k_layer_offset(r, layer);
    let once = FaultRule {
        offset: Some(offset),
        times: Some(1),
        ..FaultRule::default()
    };
    r.faulty.inject(once, fault);
}

#[test]
fn slow_read_times_out_the_batch() {
    let r = rig(3);
    // A limit the fast reads meet with room on a loaded CI machine (a 50 ms one could time
    // out an earlier layer there).
    let config = LinkerConfig {
        layer_read_timeout: Duration::from_secs(1),
        ..cfg()
    };
    once_at_k_layer(&r, 4, Fault::Delay(Duration::from_secs(3)));
    let (linker, _pool, t) = start_batch_1(&r, config);
    // The slow read may still write the slots when the batch fails: the waits say so.
    let err = wait_all(&linker, &t).unwrap_err();
    assert!(
        matches!(&err, KvLoadError::SlotsHeld { batches } if batches[..] == [BatchId(1)]),
        "{err}"
    );
    // Once it returned, the outcome says what failed.
    let out = linker.wait_batch(&t).unwrap();
    assert!(
        matches!(
            &out.result,
            Err(KvLoadError::Store {
                kind: StoreFailure::RpcTimeout,
                layer: Some(4),
                ..
            })
        ),
        "{:?}",
        out.result
    );
    // The call past its limit counts as failed (timed to its limit, where the linker stopped
    // waiting for it), not among the reads that landed.
    let m = linker.metrics();
    assert_eq!(m.failed_read_calls, 1, "{m:?}");
    assert!(m.failed_read_time >= Duration::from_secs(1), "{m:?}");
    assert!(m.layer_reads <= 4, "only layers before 4 landed: {m:?}");
    // The read-cost fit took the call that ran into its deadline as a censored sample: a
    // few times its predicted time, so a one-layer call is now predicted slower than the
    // calls that landed took, but not at the limit (taken at the limit, one such call made
    // the plan read in the fewest, largest groups for hundreds of calls after it).
    let cost = linker.read_cost(kvlink::kv_loader::ShareMode::AllRanks);
    let layer_bytes = m.bytes_read as f64 / m.layer_reads.max(1) as f64;
    let predicted = cost.per_call
        + cost.per_layer
        + Duration::from_secs_f64(layer_bytes * cost.seconds_per_byte);
    let landed = m.layer_read_time / m.layer_read_calls.max(1) as u32;
    assert!(
        predicted > landed && predicted < Duration::from_millis(500),
        "{cost:?}: {predicted:?}, the calls that landed {landed:?} each"
    );
}

/// A store that answers "RPC timeout" early (its master gave up, well before the linker's
/// own limit) read nothing: the fit takes the call as a censored sample too (a few times its
/// predicted time). Before, it took the call's own short time for all the bytes asked, as if
/// they were read at once: the fit came out faster, and the plan read in larger groups from a
/// store that was timing out.
#[test]
fn an_early_rpc_timeout_teaches_the_fit_a_slow_call_not_a_fast_read() {
    let r = rig(3);
    let config = LinkerConfig {
        layer_read_timeout: Duration::from_millis(300),
        ..cfg()
    };
    let rpc_timeout = StoreError::RpcTimeout {
        key: "injected".into(),
    };
    once_at_k_layer(&r, 1, Fault::Error(rpc_timeout));
    let (linker, _pool, t) = start_batch_1(&r, config);
    let _ = wait_all(&linker, &t);
    let out = linker.wait_batch(&t).unwrap();
    assert!(
        matches!(
            &out.result,
            Err(KvLoadError::Store {
                kind: StoreFailure::RpcTimeout,
                ..
            })
        ),
        "{:?}",
        out.result
    );
    let m = linker.metrics();
    let cost = linker.read_cost(kvlink::kv_loader::ShareMode::AllRanks);
    let g = linker.geometry();
    let layer_bytes = (3 * g.bytes_per_page()) as f64 / f64::from(g.num_layers());
    let predicted = cost.per_call
        + cost.per_layer
        + Duration::from_secs_f64(layer_bytes * cost.seconds_per_byte);
    let landed = m.layer_read_time / m.layer_read_calls.max(1) as u32;
    assert!(
        predicted > landed,
        "{cost:?}: one layer predicted in {predicted:?}, the calls that landed {landed:?} \
         each ({m:?})"
    );
}

#[test]
fn a_wait_never_outlives_its_deadline() {
    let r = rig(3);
    let config = LinkerConfig {
        wait_deadline: Duration::from_millis(100),
        ..cfg()
    };
    r.faulty.inject(
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(3000)),
    );
    let (linker, _pool, t) = start_batch_1(&r, config);
    let t0 = Instant::now();
    let err = linker.wait_layer(&t, 0).unwrap_err();
    assert!(
        matches!(err, KvLoadError::Timeout { layer: 0, .. }),
        "{err}"
    );
    // The 100 ms deadline, not the 3 s read (slack for a loaded CI host).
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    assert!(matches!(
        linker.wait_batch(&t),
        Err(KvLoadError::Timeout { .. })
    ));
    // The timed-out wait abandoned the batch: once the slow read is over it stops, cancelled,
    // rather than read the rest (polled, bounded).
    let limit = Instant::now() + Duration::from_secs(10);
    let outcome = loop {
        if let Some(o) = linker.completed().pop() {
            break o;
        }
        assert!(Instant::now() < limit, "the batch never ended");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_cancelled(&outcome);
}

#[test]
fn missing_object_fails_with_not_found() {
    let r = rig(3);
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, cfg());
    let g = linker.geometry().clone();
    let keys = linker
        .object_keys(&load_plan(&g, 9, &r.pages, vec![0, 1, 2]))
        .unwrap();
    let removed = r.faulty.remove(&[keys[1][2].as_str()]);
    assert!(removed[0].is_ok());
    let t = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    let err = wait_fails_not_found(&linker, &t);
    assert!(!err.is_retryable());
    // The missing object's page is named (page 2): the engine recomputes it. Before, the
    // session start that found it absent named no page.
    assert!(
        matches!(&err, KvLoadError::Store { pages, .. } if pages.as_ref() == [2]),
        "{err:?}"
    );
}

#[test]
fn reset_during_a_load_cancels_it_and_the_linker_goes_on() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    // Each key of a read call (one layer each) takes 100 ms: layer 5 lands 600 ms in at the
    // soonest, so the reset (after 60 ms) comes well before it even on a loaded machine, and
    // waits for one call in flight at most.
    r.faulty.inject(
        FaultRule::default(),
        Fault::Delay(Duration::from_millis(100)),
    );
    let (linker, pool, t) = start_batch_1(&r, cfg());
    let queued = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![3, 4, 5]))
        .unwrap();
    std::thread::scope(|s| {
        let waiter = s.spawn(|| linker.wait_layer(&t, 5));
        std::thread::sleep(Duration::from_millis(60));
        linker.reset().unwrap();
        let res = waiter.join().unwrap();
        assert!(
            matches!(
                res,
                Err(KvLoadError::Cancelled { .. }) | Err(KvLoadError::StaleTicket { .. })
            ),
            "{res:?}"
        );
    });
    // After reset nothing is in flight: both batches ended cancelled.
    let outcomes = linker.completed();
    assert_eq!(outcomes.len(), 2);
    assert!(outcomes
        .iter()
        .all(|o| matches!(o.result, Err(KvLoadError::Cancelled { .. }))));
    assert!(matches!(
        linker.wait_layer(&queued, 0),
        Err(KvLoadError::StaleTicket { .. })
    ));
    r.faulty.clear();
    let t = linker
        .start_load(load_plan(&g, 3, &r.pages, vec![7, 8, 9]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    linker.wait_batch(&t).unwrap().result.unwrap();
    pool_matches(&pool, &r.pages, &[7, 8, 9], 6).unwrap();
}

#[test]
fn an_untaken_outcome_keeps_its_batch_id_after_reset() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let (linker, pool, t) = start_batch_1(&r, cfg());
    wait_all(&linker, &t).unwrap();
    // A layer past the model is the engine's input error, typed as such.
    assert!(matches!(
        linker.wait_layer(&t, 6),
        Err(KvLoadError::InvalidPlan {
            reason: PlanError::LayerOutOfRange {
                layer: 6,
                num_layers: 6
            },
            ..
        })
    ));
    // Batch 1 is done but its outcome is not taken; the engine resets.
    linker.reset().unwrap();
    // Starting batch 1 again is refused until its outcome is taken: a new run must not be
    // handed the earlier run's outcome (nor have its own forgotten when that one is taken).
    r.faulty.inject(
        FaultRule::default(),
        Fault::Delay(Duration::from_millis(200)),
    );
    let again = linker.start_load(load_plan(&g, 1, &r.pages, vec![3, 4, 5]));
    assert!(
        matches!(again, Err(KvLoadError::DuplicateBatch { batch }) if batch == BatchId(1)),
        "{again:?}"
    );
    let taken = linker.completed();
    assert_eq!(taken.len(), 1);
    assert!(taken[0].result.is_ok(), "{:?}", taken[0].result);
    // Now the id is free, and the new run's outcome is its own.
    let t2 = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![3, 4, 5]))
        .unwrap();
    assert!(matches!(
        linker.start_load(load_plan(&g, 1, &r.pages, vec![6, 7, 8])),
        Err(KvLoadError::DuplicateBatch { .. })
    ));
    wait_all(&linker, &t2).unwrap();
    linker.wait_batch(&t2).unwrap().result.unwrap();
    r.faulty.clear();
    pool_matches(&pool, &r.pages, &[3, 4, 5], 6).unwrap();
}

#[test]
fn close_with_loads_in_flight_leaves_no_thread() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    r.faulty.inject(
        FaultRule::default(),
        Fault::Delay(Duration::from_millis(20)),
    );
    let before = threads_named("kvlink-load-r5");
    let (linker, _pool) = rank_linker(&r, 8, 5, 16, cfg());
    // The thread names itself as it starts.
    let t0 = Instant::now();
    while threads_named("kvlink-load-r5") == before && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(threads_named("kvlink-load-r5"), before + 1);
    let mut tickets = Vec::new();
    for b in 0..3 {
        let slots = (0..3).map(|i| b * 3 + i).collect();
        tickets.push(
            linker
                .start_load(load_plan(&g, u64::from(b) + 1, &r.pages, slots))
                .unwrap(),
        );
    }
    linker.close().unwrap();
    // close() joined the thread; the kernel drops its /proc entry just after the join.
    let t0 = Instant::now();
    while threads_named("kvlink-load-r5") != before && t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        threads_named("kvlink-load-r5"),
        before,
        "the load thread has exited"
    );
    assert!(matches!(
        linker.start_load(load_plan(&g, 9, &r.pages, vec![0, 1, 2])),
        Err(KvLoadError::Closed)
    ));
    assert!(matches!(
        linker.wait_layer(&tickets[0], 0),
        Err(KvLoadError::StaleTicket { .. })
    ));
    assert!(linker.close().is_ok(), "close twice is fine");
}

#[test]
fn save_skips_present_pages_and_only_rank0_writes_replicated() {
    let spec = small_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let tokens = prompt(3, 4, spec.page_size);
    let pages = save_prefix(&spec, store.clone(), &tokens, &cfg());
    // Saving again writes nothing.
    let g = KvGeometry::new(spec.clone(), 2, 1).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
    let linker = Linker::new(g.clone(), store.clone(), pool, cfg()).unwrap();
    let report = linker
        .save(&load_plan(&g, 1, &pages, vec![0, 1, 2, 3]))
        .unwrap();
    assert_eq!(report.objects_written, 0);
    assert_eq!(
        report.objects_not_owned, 8,
        "rank 1 does not write replicated objects"
    );
    assert!(report.pages_written.is_empty());
    assert_eq!(report.pages_skipped, vec![0, 1, 2, 3]);
    // A sharded model: every rank writes its own part.
    let llama = ModelKvSpec::llama3_70b();
    let mut small = llama.clone();
    small.num_layers = 2;
    small.page_size = 2;
    for rank in 0..2 {
        let g = KvGeometry::new(small.clone(), 2, rank).unwrap();
        let pool = Arc::new(HostKvPool::new(g.clone(), 2).unwrap());
        let linker = Linker::new(g.clone(), store.clone(), pool, cfg()).unwrap();
        let pages = kvlink::kv_geometry::page_hashes(&[1, 2, 3, 4], 2, None);
        let report = linker.save(&load_plan(&g, 1, &pages, vec![0, 1])).unwrap();
        assert_eq!((report.objects_written, report.objects_not_owned), (4, 0));
        // 4 objects of 2 layers x 2 tokens x 1024 B (4 of 8 heads x 128 x bf16).
        assert_eq!(report.bytes_written, 4 * 2 * 2 * 1024);
        assert_eq!(report.pages_written, vec![0, 1]);
        // A longer prompt: its first two pages are in the store, the third is new.
        let longer = kvlink::kv_geometry::page_hashes(&[1, 2, 3, 4, 5, 6], 2, None);
        let pool = Arc::new(HostKvPool::new(g.clone(), 3).unwrap());
        let linker = Linker::new(g.clone(), store.clone(), pool, cfg()).unwrap();
        let report = linker
            .save(&load_plan(&g, 2, &longer, vec![0, 1, 2]))
            .unwrap();
        assert_eq!(
            (report.pages_written, report.pages_skipped),
            (vec![2], vec![0, 1])
        );
    }
}

#[test]
fn outcomes_taken_by_completed_free_their_slots() {
    let r = rig(2);
    let config = LinkerConfig {
        max_in_flight: 2,
        ..cfg()
    };
    let (linker, _pool) = rank_linker(&r, 1, 0, 8, config);
    let g = linker.geometry().clone();
    let t1 = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1]))
        .unwrap();
    let _t2 = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![2, 3]))
        .unwrap();
    let busy = linker.start_load(load_plan(&g, 3, &r.pages, vec![4, 5]));
    assert!(
        matches!(
            busy,
            Err(KvLoadError::Busy {
                capacity: 2,
                peers_fail: false
            })
        ),
        "{busy:?}"
    );
    // One rank: nothing else was told; the same start may go through later.
    assert_eq!(busy.unwrap_err().action(), EngineAction::RetryLater);
    wait_all(&linker, &t1).unwrap();
    let mut taken = std::collections::HashSet::new();
    for batch in 3..8 {
        // Batch 1's outcome frees room for batch 3; from batch 4 on, the batch before landed
        // in the same slots, which are refused until its outcome is taken (`SlotInFlight`).
        let before = BatchId(if batch == 3 { 1 } else { batch - 1 });
        let deadline = kvlink::kv_loader::deadline_after(Duration::from_secs(5));
        while !taken.contains(&before) && Instant::now() < deadline {
            let outcomes = linker.completed();
            assert!(outcomes.iter().all(|o| o.result.is_ok()));
            taken.extend(outcomes.iter().map(|o| o.batch));
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = linker
            .start_load(load_plan(&g, batch, &r.pages, vec![6, 7]))
            .unwrap();
    }
}

#[test]
fn parallel_layer_reads_land_the_same_bytes_and_fail_the_same_way() {
    let r = rig(7);
    let config = LinkerConfig {
        read_parallelism: 3,
        ..cfg()
    };
    let (linker, pool) = rank_linker(&r, 1, 0, 32, config.clone());
    let slots = scattered(7);
    let t = linker
        .start_load(load_plan(linker.geometry(), 1, &r.pages, slots.clone()))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    let stats = linker.wait_batch(&t).unwrap().result.unwrap();
    assert_eq!(stats.bytes_read, 7 * linker.geometry().bytes_per_page());
    pool_matches(&pool, &r.pages, &slots, 6).unwrap();
    drop(linker);
    // A failure in one of the parallel parts names its page.
    let (err, _, _) = {
        let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
        let offset = g
            .component_by_name("k")
            .unwrap()
            .layer_range(2)
            .unwrap()
            .start;
        r.faulty.inject(
            FaultRule {
                key_contains: Some(format!("{}_cp0", r.pages[5])),
                offset: Some(offset),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Error(StoreError::TransferFailed {
                key: "injected".into(),
                code: -800,
            }),
        );
        let (linker, pool) = rank_linker(&r, 1, 0, 32, config);
        let t = linker
            .start_load(load_plan(&g, 2, &r.pages, slots.clone()))
            .unwrap();
        (wait_all(&linker, &t).unwrap_err(), linker, pool)
    };
    assert!(
        matches!(&err, KvLoadError::Store { layer: Some(2), pages, .. } if pages[..] == [5]),
        "{err}"
    );
}

/// A batch id already in flight is refused with a typed error before anything is counted: the
/// batch in flight keeps its outcome, and no counter slot leaks (with room for two batches,
/// refusals leave the second slot free).
#[test]
fn a_duplicate_batch_id_in_flight_is_refused_and_nothing_is_lost() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight: 2,
        ..cfg()
    };
    let (linker, pool) = rank_linker(&r, 1, 0, 16, config);
    let slots = scattered(r.pages.len());
    let t = linker
        .start_load(load_plan(&g, 7, &r.pages, slots.clone()))
        .unwrap();
    for _ in 0..3 {
        let again = linker.start_load(load_plan(&g, 7, &r.pages, vec![0, 1, 2]));
        assert!(
            matches!(again, Err(KvLoadError::DuplicateBatch { batch }) if batch.0 == 7),
            "{again:?}"
        );
    }
    // The refusals took no counter slot: another batch fits beside the first.
    let t8 = linker
        .start_load(load_plan(&g, 8, &r.pages, vec![0, 1, 2]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    let outcome = linker.wait_batch(&t).unwrap();
    assert!(outcome.result.is_ok(), "{:?}", outcome.result);
    pool_matches(&pool, &r.pages, &slots, g.num_layers()).unwrap();
    wait_all(&linker, &t8).unwrap();
    assert!(linker.wait_batch(&t8).unwrap().result.is_ok());
    // Taken: the id is free again.
    let t = linker
        .start_load(load_plan(&g, 7, &r.pages, vec![0, 1, 2]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    assert!(linker.wait_batch(&t).unwrap().result.is_ok());
}

/// Two batches in flight naming the same slot: the second is refused (typed, naming the slot
/// and the batch) until the first's outcome is taken. Before, the first landed, dropped its
/// slot claims with its run, and the second wrote its pages over the first's: the engine read
/// the second prompt's KV for the first with no error.
#[test]
fn a_slot_of_a_batch_in_flight_is_refused_until_its_outcome_is_taken() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight: 2,
        ..cfg()
    };
    let (linker, pool) = rank_linker(&r, 1, 0, 16, config);
    let t1 = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![3, 4, 5]))
        .unwrap();
    wait_all(&linker, &t1).unwrap();
    for _ in 0..3 {
        let second = linker.start_load(load_plan(&g, 2, &r.pages, vec![9, 8, 5]));
        assert!(
            matches!(
                &second,
                Err(KvLoadError::InvalidPlan {
                    batch: BatchId(2),
                    reason: PlanError::SlotInFlight {
                        slot: 5,
                        page: 2,
                        batch: BatchId(1)
                    },
                })
            ),
            "{second:?}"
        );
    }
    // The refusals took no counter slot: a batch on other slots fits beside the first.
    let t3 = linker
        .start_load(load_plan(&g, 3, &r.pages, vec![10, 11, 12]))
        .unwrap();
    assert!(linker.wait_batch(&t1).unwrap().result.is_ok());
    pool_matches(&pool, &r.pages, &[3, 4, 5], g.num_layers()).unwrap();
    // Taken: its slots are free for the next batch.
    let t2 = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![9, 8, 5]))
        .unwrap();
    for t in [t2, t3] {
        wait_all(&linker, &t).unwrap();
        assert!(linker.wait_batch(&t).unwrap().result.is_ok());
    }
    pool_matches(&pool, &r.pages, &[9, 8, 5], g.num_layers()).unwrap();
}

/// After a reset, the slots of a batch it cancelled go to the next batch at once (its
/// outcome, `Cancelled`, not taken yet: an engine frees a cancelled request's blocks), while
/// those of a batch that had loaded stay its own until its outcome is taken (the engine may
/// still read them).
#[test]
fn a_reset_frees_the_slots_of_the_batches_it_cancelled_not_of_those_loaded() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, cfg());
    let loaded = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    wait_all(&linker, &loaded).unwrap();
    r.faulty.inject(
        FaultRule::default(),
        Fault::Delay(Duration::from_millis(300)),
    );
    let cancelled = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![3, 4, 5]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    linker.reset().unwrap();
    r.faulty.clear();
    let over_loaded = linker.start_load(load_plan(&g, 3, &r.pages, vec![6, 7, 2]));
    assert!(
        matches!(
            &over_loaded,
            Err(KvLoadError::InvalidPlan {
                reason: PlanError::SlotInFlight {
                    slot: 2,
                    batch: BatchId(1),
                    ..
                },
                ..
            })
        ),
        "{over_loaded:?}"
    );
    let t = linker
        .start_load(load_plan(&g, 4, &r.pages, vec![3, 4, 5]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    assert!(linker.wait_batch(&t).unwrap().result.is_ok());
    assert!(matches!(
        linker.wait_batch(&cancelled).unwrap().result,
        Err(KvLoadError::Cancelled { .. })
    ));
    assert!(linker.wait_batch(&loaded).unwrap().result.is_ok());
}

/// Starts `plan` as soon as the slots it names are let go (within 5 s): a batch abandoned
/// before its outcome came lets them go once the load thread is done with it.
fn start_once_free(linker: &Linker, plan: impl Fn() -> kvlink::kv_loader::BatchPlan) -> LoadTicket {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        match linker.start_load(plan()) {
            Err(KvLoadError::InvalidPlan {
                reason: PlanError::SlotInFlight { .. },
                ..
            })
            | Err(KvLoadError::Busy { .. })
                if Instant::now() < until =>
            {
                std::thread::sleep(Duration::from_millis(5))
            }
            started => return started.unwrap(),
        }
    }
}

/// The batch ended `Cancelled` (a reset, or the engine abandoned it).
fn assert_cancelled(outcome: &kvlink::kv_loader::BatchOutcome) {
    assert!(
        matches!(outcome.result, Err(KvLoadError::Cancelled { .. })),
        "{:?}",
        outcome.result
    );
}

/// The outcomes `completed` still hands out, by batch.
fn outcomes_left(linker: &Linker) -> Vec<BatchId> {
    linker.completed().iter().map(|o| o.batch).collect()
}

/// A batch the engine abandons (a dropped handle, `KvLoader::abandon`) or whose
/// `wait_batch` timed out lets its slots go to another batch once its load is over, before
/// its outcome is taken (an engine frees an aborted request's blocks at once); the outcome
/// is still handed out.
#[test]
fn an_abandoned_or_timed_out_batch_lets_its_slots_go_once_over() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        wait_deadline: Duration::from_millis(100),
        ..cfg()
    };
    let (linker, pool) = rank_linker(&r, 1, 0, 16, config);
    // Abandoned while it loads: its first read is held in the store (an abandoned batch stops
    // at its next group of layers, so it must be abandoned inside a read to still be loading).
    let read = kvlink::mooncake_linker::store::Stall::new();
    r.faulty
        .inject(FaultRule::default(), Fault::Stall(read.clone()));
    let abandoned = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    let until = Instant::now() + Duration::from_secs(10);
    while read.hits() == 0 {
        assert!(Instant::now() < until, "the first read never came");
        std::thread::sleep(Duration::from_millis(2));
    }
    linker.abandon(&abandoned);
    // Still loading: its slots stay refused (the load may still write them).
    assert!(matches!(
        linker.start_load(load_plan(&g, 2, &r.pages, vec![7, 8, 0])),
        Err(KvLoadError::InvalidPlan {
            reason: PlanError::SlotInFlight {
                slot: 0,
                page: 2,
                batch: BatchId(1)
            },
            ..
        })
    ));
    // Timed out (the wait's 100 ms are shorter than the load).
    let timed_out = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![3, 4, 5]))
        .unwrap();
    assert!(matches!(
        linker.wait_batch(&timed_out),
        Err(KvLoadError::Timeout { .. })
    ));
    r.faulty.clear();
    read.release();
    let over_1 = start_once_free(&linker, || load_plan(&g, 3, &r.pages, vec![2, 1, 0]));
    let over_2 = start_once_free(&linker, || load_plan(&g, 4, &r.pages, vec![5, 4, 3]));
    for t in [over_1, over_2] {
        wait_all(&linker, &t).unwrap();
        assert!(linker.wait_batch(&t).unwrap().result.is_ok());
    }
    pool_matches(&pool, &r.pages, &[2, 1, 0], g.num_layers()).unwrap();
    pool_matches(&pool, &r.pages, &[5, 4, 3], g.num_layers()).unwrap();
    let left = outcomes_left(&linker);
    assert_eq!(left, [BatchId(1), BatchId(2)], "still handed out");
}

/// A batch the engine abandoned gives its place among `max_in_flight` back once its load is
/// over, not only once its outcome is taken or a reset ends it; its outcome is still handed
/// out. Before, after `max_in_flight` abandoned batches every start failed `Busy`, and the
/// engine's ways out each broke live requests (`completed` takes their outcomes too, a reset
/// cancels them).
#[test]
fn an_abandoned_batch_gives_its_place_in_flight_back_once_over() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight: 2,
        ..cfg()
    };
    let (linker, pool) = rank_linker(&r, 1, 0, 16, config);
    for (batch, slots) in [(1, vec![0, 1, 2]), (2, vec![3, 4, 5])] {
        let t = linker
            .start_load(load_plan(&g, batch, &r.pages, slots))
            .unwrap();
        wait_all(&linker, &t).unwrap();
        linker.abandon(&t);
    }
    // Their outcomes come in just after their last layers: `Busy` only until then.
    let t = start_once_free(&linker, || load_plan(&g, 3, &r.pages, vec![6, 7, 8]));
    wait_all(&linker, &t).unwrap();
    assert!(linker.wait_batch(&t).unwrap().result.is_ok());
    pool_matches(&pool, &r.pages, &[6, 7, 8], g.num_layers()).unwrap();
    let left = outcomes_left(&linker);
    assert_eq!(left, [BatchId(1), BatchId(2)], "still handed out");
}

/// A batch the engine abandons stops reading at its next group of layers (it fails
/// `Cancelled`), whether it still queued or had started, so the batches queued behind it load
/// at once. Before, it read and landed every layer: here 6 layers at 600 ms a read held the
/// next batch up for 3.6 s (3 s once its first layer had landed).
#[test]
fn an_abandoned_batch_stops_reading_and_lets_the_next_one_load() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    // One store call per layer (`cfg`).
    let (linker, pool) = rank_linker(&r, 1, 0, 16, cfg());
    r.faulty.inject(
        FaultRule {
            key_contains: Some(r.pages[0].to_hex()),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(600)),
    );
    let slow = linker
        .start_load(load_plan(&g, 1, &r.pages[..1], vec![0]))
        .unwrap();
    linker.abandon(&slow);
    let t0 = Instant::now();
    let next = linker
        .start_load(load_plan(&g, 2, &r.pages[1..], vec![4, 5]))
        .unwrap();
    wait_all(&linker, &next).unwrap();
    let took = t0.elapsed();
    assert!(linker.wait_batch(&next).unwrap().result.is_ok());
    pool_matches(&pool, &r.pages[1..], &[4, 5], g.num_layers()).unwrap();
    // At most the read under way, or two (the pin's and the first group's), not six.
    assert!(took < Duration::from_millis(2400), "{took:?}");
    let out = linker.wait_batch(&slow).unwrap();
    assert_cancelled(&out);
    // Abandoned after its first layer landed: the read under way ends it.
    let slow = linker
        .start_load(load_plan(&g, 3, &r.pages[..1], vec![0]))
        .unwrap();
    linker.wait_layer(&slow, 0).unwrap();
    linker.abandon(&slow);
    let t0 = Instant::now();
    let next = linker
        .start_load(load_plan(&g, 4, &r.pages[1..], vec![6, 7]))
        .unwrap();
    wait_all(&linker, &next).unwrap();
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(2400), "{took:?}");
    let out = linker.wait_batch(&slow).unwrap();
    assert_cancelled(&out);
}

/// The last clone of a candle layer gate dropped unfinished (a request aborted mid-prefill)
/// abandons its batch before it takes the outcome: the load stops at its next group, so the
/// dropping thread waits one read, not the rest of the load (one page, 6 layers at 600 ms a
/// read here: about 3 s once its first layer landed; before, the drop waited its 10 s
/// `wait_deadline`).
#[test]
fn a_gate_dropped_unfinished_stops_its_load_before_it_waits() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, cfg());
    let linker: Arc<dyn KvLoader> = Arc::new(linker);
    r.faulty.inject(
        FaultRule {
            key_contains: Some(r.pages[0].to_hex()),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_millis(600)),
    );
    let t = linker
        .start_load(load_plan(&g, 1, &r.pages[..1], vec![0]))
        .unwrap();
    let gate = kvlink_candle::LayerGate::new(linker.clone(), t);
    gate.wait(0).unwrap();
    let t0 = Instant::now();
    drop(gate);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(2400), "{took:?}");
    assert!(linker.completed().is_empty(), "the drop took the outcome");
}

/// `rounds` times: two batches from id `next` on, into `slots`, each loaded and abandoned
/// (its slots go once it is over: the next round reuses them), then a reset. The next id.
fn abandoned_rounds(
    linker: &Linker,
    r: &Rig,
    mut next: u64,
    rounds: usize,
    slots: [[u32; 3]; 2],
) -> u64 {
    let g = linker.geometry();
    for _ in 0..rounds {
        for s in &slots {
            let t = linker
                .start_load(load_plan(g, next, &r.pages, s.to_vec()))
                .unwrap_or_else(|e| panic!("batch {next}: {e}"));
            wait_all(linker, &t).unwrap();
            linker.abandon(&t);
            next += 1;
        }
        linker.reset().unwrap();
    }
    next
}

/// A linker of `max_in_flight` batches over `r` where batch 1 (slots 0-2) has loaded and
/// waits to be taken, and batch 2's read (slots 3-5) outlasts a reset's 300 ms bound: the
/// reset, already run, named batch 2 alone (`SlotsHeld`). Its ticket for batch 1.
fn loaded_beside_a_batch_a_reset_named(r: &Rig, max_in_flight: u32) -> (Linker, LoadTicket) {
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight,
        wait_deadline: Duration::from_millis(300),
        ..cfg()
    };
    let (linker, _pool) = rank_linker(r, 1, 0, 16, config);
    let loaded = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    wait_all(&linker, &loaded).unwrap();
    r.faulty.inject(
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_secs(2)),
    );
    let _slow = linker
        .start_load(load_plan(&g, 2, &r.pages, vec![3, 4, 5]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let reset = linker.reset();
    assert!(
        matches!(&reset, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(2)]),
        "{reset:?}"
    );
    (linker, loaded)
}

/// Outcomes a reset leaves untaken are kept up to the loader's capacity (the newest; an
/// engine may still take them): an engine that abandons its batches (a dropped `LoadHandle`,
/// a timed-out wait) and never calls `completed` neither meets `Busy` nor keeps them without
/// bound. Before, a reset gave their counter slots back while every such outcome stayed for
/// good (and on device pools its layers' events).
#[test]
fn outcomes_a_reset_leaves_untaken_are_kept_up_to_the_capacity() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight: 2,
        ..cfg()
    };
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, config);
    let next = abandoned_rounds(&linker, &r, 1, 4, [[0, 1, 2], [3, 4, 5]]);
    let kept: Vec<u64> = linker.completed().iter().map(|o| o.batch.0).collect();
    assert_eq!(kept, [next - 2, next - 1], "the newest two");
    let t = linker
        .start_load(load_plan(&g, next, &r.pages, vec![0, 1, 2]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    assert!(linker.wait_batch(&t).unwrap().result.is_ok());
}

/// Outcomes the engine may still wait for outlast abandoned ones: a batch a `SlotsHeld`
/// answer named is never let go untaken (its engine keeps its slots aside until its outcome
/// comes), and one the engine did not abandon goes only after every abandoned one. Before,
/// the lowest batch ids went first: the held batch's outcome was let go as it came, and the
/// engine never saw it.
#[test]
fn outcomes_the_engine_waits_for_outlast_abandoned_ones() {
    let r = rig(3);
    // Batch 1 loaded: the engine holds on to it (not abandoned, not taken yet).
    let (linker, _held_on) = loaded_beside_a_batch_a_reset_named(&r, 2);
    // Once batch 2's read returns, a reset finds the loader idle; its outcome is in, not
    // taken.
    let until = Instant::now() + Duration::from_secs(10);
    while linker.reset().is_err() {
        assert!(Instant::now() < until, "batch 2's read never returned");
        std::thread::sleep(Duration::from_millis(20));
    }
    // Rounds of abandoned batches, each ended by a reset, more than the capacity keeps.
    let next = abandoned_rounds(&linker, &r, 3, 3, [[6, 7, 8], [9, 10, 11]]);
    let kept: Vec<u64> = linker.completed().iter().map(|o| o.batch.0).collect();
    assert_eq!(
        kept,
        [1, 2, next - 1],
        "the held-on, the named and the latest abandoned"
    );
}

/// A batch whose layer waits were told `SlotsHeld` (a read past its limit) keeps its outcome
/// after a reset, however many others wait untaken: the engine waits for it before it reuses
/// the slots. Before, only the batches a reset or close named were kept, and this one, the
/// earliest started, was the first to go.
#[test]
fn an_outcome_whose_waits_were_told_slots_held_is_kept() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        max_in_flight: 2,
        layer_read_timeout: Duration::from_millis(300),
        ..cfg()
    };
    once_at_k_layer(&r, 2, Fault::Delay(Duration::from_millis(600)));
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, config);
    let t1 = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    let err = wait_all(&linker, &t1).unwrap_err();
    assert!(
        matches!(&err, KvLoadError::SlotsHeld { batches } if batches[..] == [BatchId(1)]),
        "{err}"
    );
    // The late read returns (600 ms from its start) before anything else happens.
    std::thread::sleep(Duration::from_millis(1500));
    // Three more batches load, each ended by a reset; the engine takes none of them.
    for (b, slots) in [(2, vec![3, 4, 5]), (3, vec![6, 7, 8]), (4, vec![9, 10, 11])] {
        let t = linker
            .start_load(load_plan(&g, b, &r.pages, slots))
            .unwrap();
        wait_all(&linker, &t).unwrap();
        linker.reset().unwrap();
    }
    let kept: Vec<u64> = linker.completed().iter().map(|o| o.batch.0).collect();
    assert_eq!(
        kept,
        [1, 3, 4],
        "the one told SlotsHeld is not counted, nor let go"
    );
}

/// Two shutdown paths close at once while a load is stuck past the close's bound: both hear
/// `SlotsHeld` naming it. Before, the second `close` returned `Ok` at once while the first
/// was still cancelling, and its caller took the slots for free.
#[test]
fn a_close_beside_another_close_gets_the_same_answer() {
    let r = rig(3);
    let g = KvGeometry::new(r.spec.clone(), 1, 0).unwrap();
    let config = LinkerConfig {
        wait_deadline: Duration::from_millis(300),
        ..cfg()
    };
    let (linker, _pool) = rank_linker(&r, 1, 0, 16, config);
    r.faulty.inject(
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Delay(Duration::from_secs(2)),
    );
    let _t = linker
        .start_load(load_plan(&g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let (first, second) = std::thread::scope(|s| {
        let first = s.spawn(|| (linker.close(), Instant::now()));
        std::thread::sleep(Duration::from_millis(50));
        let second_began = Instant::now();
        let second = linker.close();
        let (first, first_ended) = first.join().unwrap();
        // Otherwise the second was only a later close, not one beside the first.
        assert!(second_began < first_ended, "the first close ended first");
        (first, second)
    });
    for (which, answer) in [("first", &first), ("second", &second)] {
        assert!(
            matches!(answer, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(1)]),
            "{which}: {answer:?}"
        );
    }
    assert_eq!(
        format!("{:?}", linker.close()),
        format!("{first:?}"),
        "a later close answers the same"
    );
}

/// A reset whose wait ends with the load thread still busy names the batches whose load may
/// still write their slots, not a batch that had loaded and whose outcome waits to be taken
/// (nothing writes its slots). Before, it named every batch in flight.
#[test]
fn a_reset_past_its_bound_names_only_the_batches_still_loading() {
    let (linker, loaded) = loaded_beside_a_batch_a_reset_named(&rig(3), 64);
    assert!(linker.wait_batch(&loaded).unwrap().result.is_ok());
}
