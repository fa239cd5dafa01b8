//! A store call that hangs (a `Fault::Stall`, released by the test): its batch fails within
//! `layer_read_timeout` whatever the store does, `reset` and `close` return within their
//! bounds, and the memory the hung call may still write is kept: a host pool's slots (the
//! batch's outcome is handed out only when the call returns, so the engine cannot reuse them),
//! the device path's staging lease (not handed to another batch), the registered regions (not
//! unregistered). The next batches load meanwhile. TP 1 and TP 3 (a middle rank hangs), host
//! pools and device pools on CPU devices.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tp::{config, mixed_spec, rank_matches_at, tp_ranks, Path, TpRank};
use common::{load_plan, pool_matches, prompt, save_prefix, small_spec, wait_all};
use kvlink::kv_device::cpu::CpuOp;
use kvlink::kv_device::{
    CpuDevice, DeviceKvPool, HostKvPool, KvPool, ScatterStrategy, SlotClaims, StagedLandingFactory,
    StagingPool,
};
use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{BatchId, KvLoadError, KvLoader, LoadTicket, ShareMode};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore, MemoryRegion, Stall,
    StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig, ReadGranularity};

const READ_TIMEOUT: Duration = Duration::from_millis(300);

fn cfg() -> LinkerConfig {
    LinkerConfig {
        namespace: "hung".into(),
        layer_read_timeout: READ_TIMEOUT,
        store_call_timeout: Duration::from_secs(2),
        collective_timeout: Duration::from_secs(3),
        wait_deadline: Duration::from_secs(3),
        // The faults name a layer: one layer per store call.
        read_granularity: ReadGranularity::Fixed { layers_per_call: 1 },
        ..LinkerConfig::default()
    }
}

/// A store that counts the regions registered and let go (over the faulty store).
struct Regions {
    inner: Arc<FaultyStore>,
    registered: AtomicUsize,
    released: AtomicUsize,
}

// SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
// writes reach the inner store, whose results it returns as they are or fails before it
// (touching nothing); it starts no thread that touches caller memory.
unsafe impl KvStore for Regions {
    kvlink::mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into,
        get_ranges, put, remove, discard, start_session, end_session, health);

    fn name(&self) -> &str {
        "regions"
    }
    unsafe fn register(&self, r: MemoryRegion) -> Result<(), StoreError> {
        self.registered.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded with the caller's promise.
        unsafe { self.inner.register(r) }
    }
    fn unregister(&self, r: MemoryRegion) -> Result<(), StoreError> {
        self.released.fetch_add(1, Ordering::SeqCst);
        self.inner.unregister(r)
    }
}

/// Rank 0 alone over a faulty store whose reads of layer 3 of `k` hang.
struct One {
    store: Arc<Regions>,
    g: KvGeometry,
    pages: Vec<PageHash>,
    stall: Stall,
}

fn one() -> One {
    let stall = Stall::new();
    one_faulted(Fault::Stall(stall.clone()), stall)
}

/// [`one`] with `fault` on the read of layer 3 of `k` instead of a stall (`stall`: the one the
/// test releases at its end, whatever the fault).
fn one_faulted(fault: Fault, stall: Stall) -> One {
    let spec = small_spec();
    let base: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
    let tokens = prompt(5, 4, spec.page_size);
    let pages = save_prefix(&spec, base.clone(), &tokens, &cfg());
    let faulty = Arc::new(FaultyStore::new(base));
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    faulty.inject(
        FaultRule {
            offset: Some(
                g.component_by_name("k")
                    .unwrap()
                    .layer_range(3)
                    .unwrap()
                    .start,
            ),
            times: Some(1),
            ..FaultRule::default()
        },
        fault,
    );
    One {
        store: Arc::new(Regions {
            inner: faulty,
            registered: AtomicUsize::new(0),
            released: AtomicUsize::new(0),
        }),
        g,
        pages,
        stall,
    }
}

/// Waits (bounded) until `f` holds.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Batch 2 into slots 8..12 loads whole (the load thread went on past batch 1).
fn loads_into_other_slots(linker: &Linker, o: &One, pool: &HostKvPool) {
    let other = vec![8, 9, 10, 11];
    let t2 = linker
        .start_load(load_plan(&o.g, 2, &o.pages, other.clone()))
        .unwrap();
    wait_all(linker, &t2).unwrap();
    linker.wait_batch(&t2).unwrap().result.unwrap();
    pool_matches(pool, &o.pages, &other, o.g.num_layers()).unwrap();
}

/// The hung batch fails within the read timeout; its ticket. `held`: the late call writes
/// the slots themselves (a host pool), not only a staging buffer (a device pool).
fn hung_batch_fails_in_time(linker: &Linker, o: &One, slots: Vec<u32>, held: bool) -> LoadTicket {
    let t0 = Instant::now();
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, slots))
        .unwrap();
    for l in 0..3 {
        linker.wait_layer(&t, l).unwrap();
    }
    let err = linker.wait_layer(&t, 3).unwrap_err();
    let took = t0.elapsed();
    assert!(
        took >= READ_TIMEOUT && took < Duration::from_secs(2),
        "{took:?}: {err}"
    );
    if held {
        // The late call may still write the slots: the wait says to hold them, not to
        // recompute into them (a `Store` error here said `Recompute`, and the late call then
        // overwrote the engine's rows). The outcome, once the call returns, says what failed.
        assert!(
            matches!(&err, KvLoadError::SlotsHeld { batches } if batches[..] == [BatchId(1)]),
            "{err:?}"
        );
        assert_eq!(err.action(), kvlink::kv_loader::EngineAction::HoldSlots);
    } else {
        // Only the staging is written late: the slots are free to recompute into.
        assert!(
            matches!(&err, KvLoadError::Store { layer: Some(3), .. }),
            "{err:?}"
        );
        assert_eq!(err.action(), kvlink::kv_loader::EngineAction::Recompute);
    }
    t
}

/// A read the store gave up on while its transfer may still run (Mooncake's client returns
/// after 60 s with transfers in flight; here `StoreError::Abandoned`, injected): the batch
/// fails, and its memory is kept for good: its outcome never comes, `reset` and `close` name
/// its slots as held every time, and the regions are never let go.
#[test]
fn a_read_the_store_gave_up_on_keeps_its_slots_and_registrations_for_good() {
    let o = one();
    o.store.inner.clear();
    let layer3 =
        o.g.component_by_name("k")
            .unwrap()
            .layer_range(3)
            .unwrap()
            .start;
    o.store.inner.inject(
        FaultRule {
            offset: Some(layer3),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::Abandoned {
            key: "injected".into(),
            call: "get_ranges",
            detail: "the client's transfer timeout (injected)".into(),
        }),
    );
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let linker = Linker::new(o.g.clone(), o.store.clone(), pool.clone(), cfg()).unwrap();
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, vec![1, 2, 3, 4]))
        .unwrap();
    for l in 0..3 {
        linker.wait_layer(&t, l).unwrap();
    }
    let err = linker.wait_layer(&t, 3).unwrap_err();
    assert!(
        matches!(&err, KvLoadError::SlotsHeld { batches } if batches[..] == [BatchId(1)]),
        "{err:?}"
    );
    // The engine's metrics say so (process-wide: other tests may keep memory too).
    let kept = linker.metrics().kept_for_good;
    assert!(kept.calls >= 1 && kept.bytes > 0, "{kept:?}");
    // Other slots load meanwhile.
    loads_into_other_slots(&linker, &o, &pool);
    // Batch 1's slots are held now and later: its outcome is never handed out.
    for _ in 0..2 {
        let r = linker.reset();
        assert!(
            matches!(&r, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(1)]),
            "{r:?}"
        );
        assert!(linker.completed().is_empty());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(matches!(linker.close(), Err(KvLoadError::SlotsHeld { .. })));
    drop(linker);
    assert_eq!(
        o.store.released.load(Ordering::SeqCst),
        0,
        "the regions the transfer may still write stay registered"
    );
}

#[test]
fn a_hung_read_on_a_host_pool_keeps_its_slots_and_registrations_until_it_returns() {
    let o = one();
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let linker = Linker::new(o.g.clone(), o.store.clone(), pool.clone(), cfg()).unwrap();
    let registered = o.store.registered.load(Ordering::SeqCst);
    assert!(registered > 0);
    let hung_slots = vec![1, 2, 3, 4];
    let _ = hung_batch_fails_in_time(&linker, &o, hung_slots.clone(), true);
    // The outcome (and so the slots) waits for the call: not handed out yet.
    assert!(linker.completed().is_empty());
    // The load thread goes on: a batch into other slots loads.
    loads_into_other_slots(&linker, &o, &pool);
    // reset returns within its bound, naming the batch whose slots are held.
    let t0 = Instant::now();
    let r = linker.reset();
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert!(
        matches!(&r, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(1)]),
        "{r:?}"
    );
    // So does close; the regions stay registered while the call may still write them.
    let t0 = Instant::now();
    assert!(matches!(linker.close(), Err(KvLoadError::SlotsHeld { .. })));
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert_eq!(o.store.released.load(Ordering::SeqCst), 0);
    // The call returns: its outcome comes, the regions are let go.
    o.stall.release();
    eventually("the held outcome comes", || {
        linker.completed().iter().any(|c| {
            c.batch == BatchId(1)
                && matches!(c.result, Err(KvLoadError::Store { layer: Some(3), .. }))
        })
    });
    eventually("the regions are let go", || {
        o.store.released.load(Ordering::SeqCst) == registered
    });
    drop(linker);
    // The late call wrote the same bytes the batch would have.
    pool_matches(&pool, &o.pages, &hung_slots, 3).unwrap();
}

/// The bytes read count as each store call lands: while layer 3's read hangs, the three
/// layers before it are counted. Before, a batch's bytes were counted as its reader ended, so
/// a scrape during a long batch saw none and then a spike.
#[test]
fn bytes_read_count_as_each_store_call_lands() {
    let o = one();
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let linker = Linker::new(o.g.clone(), o.store.clone(), pool, cfg()).unwrap();
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, vec![1, 2, 3, 4]))
        .unwrap();
    for l in 0..3 {
        linker.wait_layer(&t, l).unwrap();
    }
    let read = linker.metrics().bytes_read;
    assert!(read > 0 && read < 4 * o.g.bytes_per_page(), "{read}");
    assert!(linker.wait_layer(&t, 3).is_err());
    o.stall.release();
    eventually("the batch ends", || !linker.completed().is_empty());
    linker.close().unwrap();
}

#[test]
fn a_hung_read_on_a_device_pool_keeps_its_staging_out_of_other_batches_until_it_returns() {
    let o = one();
    let dev = CpuDevice::new(0).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), o.g.clone(), 16).unwrap());
    let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&o.g, 4, 1), 2).unwrap();
    let linker = staged_linker(&o, &pool, staging.clone(), Duration::from_secs(2));
    let t = hung_batch_fails_in_time(&linker, &o, vec![1, 2, 3, 4], false);
    // The device's slots are written from staging only, so the outcome is handed out now;
    // the staging the call writes is kept from other batches.
    assert!(linker.wait_batch(&t).unwrap().result.is_err());
    assert_eq!(
        staging.available(),
        1,
        "the hung call keeps its staging lease"
    );
    let t2 = linker
        .start_load(load_plan(&o.g, 2, &o.pages, vec![5, 6, 7, 8]))
        .unwrap();
    wait_all(&linker, &t2).unwrap();
    linker.wait_batch(&t2).unwrap().result.unwrap();
    assert_eq!(staging.available(), 1);
    let t0 = Instant::now();
    linker.reset().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(4));
    o.stall.release();
    eventually("the lease comes back", || staging.available() == 2);
    linker.close().unwrap();
}

/// A read the store gave up on while its transfer may still run (`Abandoned`) on the middle
/// rank of three: every rank fails the batch in time (the others `PeerFailed` naming rank
/// 1), and the next batch into other slots loads on every rank. On a host pool (the store
/// wrote the slots) rank 1 keeps the batch's slots for good: its outcome never comes and a
/// reset names it; on a device pool (the store wrote staging) the outcome comes and the
/// staging lease is kept for good instead.
#[test]
fn a_read_the_store_gave_up_on_on_a_middle_rank_fails_every_rank_and_the_group_goes_on() {
    for path in [Path::Host, Path::device_per_rank(ScatterStrategy::Auto)] {
        for mode in [
            ShareMode::AllRanks,
            ShareMode::Rank0Broadcast,
            ShareMode::SplitAllGather,
        ] {
            let what = format!("{path:?} {mode:?}");
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, hashes) = tp_ranks(&mixed_spec(), 3, store, 6, &config(mode), path);
            fault_rank_1_v_at_layer_2(
                &rs,
                Fault::Error(StoreError::Abandoned {
                    key: "injected".into(),
                    call: "get_ranges",
                    detail: "the client's transfer timeout (injected)".into(),
                }),
            );
            let leases = rs[1].staging.as_ref().map(|s| s.available());
            let failed = each_rank(&rs, |r| {
                let t = r
                    .linker
                    .start_load(load_plan(r.linker.geometry(), 1, &hashes, r.slots.clone()))
                    .unwrap();
                wait_all(&r.linker, &t).is_err()
            });
            assert!(failed.iter().all(|f| *f), "{what}: {failed:?}");
            for rank in [0, 2] {
                let outcome = eventually_outcome(&rs[rank].linker, &what);
                assert!(
                    matches!(outcome, Err(KvLoadError::PeerFailed { rank: 1, .. })),
                    "{what}: rank {rank}: {outcome:?}"
                );
            }
            match (&rs[1].staging, leases) {
                (Some(staging), Some(before)) => {
                    let outcome = eventually_outcome(&rs[1].linker, &what);
                    assert!(outcome.is_err(), "{what}");
                    assert_eq!(staging.available(), before - 1, "{what}: kept for good");
                }
                _ => {
                    std::thread::sleep(Duration::from_millis(200));
                    assert!(rs[1].linker.completed().is_empty(), "{what}");
                    let r = rs[1].linker.reset();
                    assert!(
                        matches!(&r, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(1)]),
                        "{what}: {r:?}"
                    );
                }
            }
            batch_2_loads_into_other_slots(&rs, &hashes, &what);
        }
    }
}

/// Rank 1's read of its shard `v` at layer 2 (every mode reads it) meets `fault`, once.
fn fault_rank_1_v_at_layer_2(rs: &[TpRank], fault: Fault) {
    let v = rs[1].linker.geometry().component_by_name("v").unwrap();
    rs[1].faults.inject(
        FaultRule {
            key_contains: Some("tp1_cp0_pp0_v".into()),
            offset: Some(v.layer_range(2).unwrap().start),
            times: Some(1),
            ..FaultRule::default()
        },
        fault,
    );
}

/// Batch 2 into other slots (each rank's moved by one) loads on every rank, every byte.
fn batch_2_loads_into_other_slots(rs: &[TpRank], hashes: &[PageHash], what: &str) {
    let shifted = |r: &TpRank| r.slots.iter().map(|s| s + 1).collect::<Vec<u32>>();
    for (rank, (r, o)) in rs
        .iter()
        .zip(common::tp::run_at(rs, 2, hashes, &shifted))
        .enumerate()
    {
        o.result
            .unwrap_or_else(|e| panic!("{what}: rank {rank}: {e}"));
        rank_matches_at(r, hashes, rank as u32, &shifted(r)).unwrap();
    }
}

/// Batch 1's outcome on `linker`, once it comes (within 10 s).
fn eventually_outcome(
    linker: &Linker,
    what: &str,
) -> Result<kvlink::kv_loader::LoadStats, KvLoadError> {
    let t0 = Instant::now();
    loop {
        if let Some(o) = linker
            .completed()
            .into_iter()
            .find(|o| o.batch == BatchId(1))
        {
            return o.result;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{what}: no outcome");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_hung_read_on_a_middle_rank_fails_every_rank_in_time_and_the_group_goes_on() {
    for path in [Path::Host, Path::device_per_rank(ScatterStrategy::Auto)] {
        for mode in [
            ShareMode::AllRanks,
            ShareMode::Rank0Broadcast,
            ShareMode::SplitAllGather,
        ] {
            let what = format!("{path:?} {mode:?}");
            let c = LinkerConfig {
                layer_read_timeout: READ_TIMEOUT,
                ..config(mode)
            };
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 30));
            let (rs, hashes) = tp_ranks(&mixed_spec(), 3, store, 6, &c, path);
            let stall = Stall::new();
            // Rank 1's read of its shard `v` at layer 2 hangs (every mode reads it).
            fault_rank_1_v_at_layer_2(&rs, Fault::Stall(stall.clone()));
            let t0 = Instant::now();
            let failed = each_rank(&rs, |r| {
                let t = r
                    .linker
                    .start_load(load_plan(r.linker.geometry(), 1, &hashes, r.slots.clone()))
                    .unwrap();
                wait_all(&r.linker, &t).is_err()
            });
            assert!(failed.iter().all(|f| *f), "{what}: {failed:?}");
            assert!(
                t0.elapsed() < Duration::from_secs(3),
                "{what}: {:?}",
                t0.elapsed()
            );
            // Batch 2 into other slots loads on every rank while the call still hangs.
            batch_2_loads_into_other_slots(&rs, &hashes, &what);
            stall.release();
            // Every rank's outcome of batch 1 comes, failed (the hung rank's once its call
            // returned, on a host pool).
            for (rank, r) in rs.iter().enumerate() {
                eventually(&format!("{what}: rank {rank}'s outcome"), || {
                    r.linker
                        .completed()
                        .iter()
                        .any(|c| c.batch == BatchId(1) && c.result.is_err())
                });
            }
        }
    }
}

fn each_rank<T: Send>(rs: &[TpRank], f: impl Fn(&TpRank) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let hs: Vec<_> = rs.iter().map(|r| s.spawn(|| f(r))).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A load thread still busy when `reset`'s wait ends (its pin hangs; the store call's own
/// bound is longer than the wait): `reset` says the batch's slots are held (`HoldSlots`), not
/// that they may be recomputed into at once. Only that batch's: one queued behind it never
/// started, and the reset made it stale (it never reads). Before, it was named too, and its
/// engine kept its slots out of use for nothing.
#[test]
fn a_reset_that_finds_the_load_thread_busy_holds_the_batchs_slots() {
    let o = one();
    o.store.inner.clear();
    let session = Stall::new();
    o.store.inner.inject_on(
        kvlink::mooncake_linker::store::FaultCall::Session,
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Stall(session.clone()),
    );
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let config = LinkerConfig {
        wait_deadline: Duration::from_millis(300),
        ..cfg()
    };
    let linker = Linker::new(o.g.clone(), o.store.clone(), pool, config).unwrap();
    let _t = linker
        .start_load(load_plan(&o.g, 7, &o.pages, vec![1, 2, 3, 4]))
        .unwrap();
    // The load thread is in the hung pin (bounded by store_call_timeout, 2 s).
    eventually("the pin hangs", || session.hits() == 1);
    let queued = linker
        .start_load(load_plan(&o.g, 8, &o.pages, vec![5, 6, 7, 8]))
        .unwrap();
    let t0 = Instant::now();
    let r = linker.reset();
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert!(
        matches!(&r, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(7)]),
        "{r:?}"
    );
    assert_eq!(
        r.unwrap_err().action(),
        kvlink::kv_loader::EngineAction::HoldSlots
    );
    session.release();
    // The queued batch ends cancelled, never having read (its wait's 300 ms may run out
    // while the released batch ends first: waited again, bounded).
    let until = Instant::now() + Duration::from_secs(10);
    let out = loop {
        match linker.wait_batch(&queued) {
            Err(KvLoadError::Timeout { .. }) if Instant::now() < until => continue,
            out => break out,
        }
    };
    assert!(
        matches!(&out, Ok(o) if matches!(o.result, Err(KvLoadError::Cancelled { .. })))
            || matches!(&out, Err(KvLoadError::StaleTicket { .. })),
        "{out:?}"
    );
}

/// A store whose `register` or `unregister` hangs (its metadata service stopped answering);
/// its reads do not.
fn hanging_registry(call: FaultCall) -> (One, Stall) {
    let o = one();
    // Reads do not hang here.
    o.stall.release();
    let stall = Stall::new();
    o.store
        .inner
        .inject_on(call, FaultRule::default(), Fault::Stall(stall.clone()));
    (o, stall)
}

#[test]
fn a_hung_register_fails_the_linkers_build_in_time_and_is_undone_when_it_returns() {
    let (o, stall) = hanging_registry(FaultCall::Register);
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let t0 = Instant::now();
    let built = Linker::new(o.g.clone(), o.store.clone(), pool.clone(), cfg());
    let took = t0.elapsed();
    let e = built.expect_err("the build fails");
    assert!(e.to_string().contains("register"), "{e}");
    // One store call (2 s) and a second per GB of the pool's region: well under 4 s here.
    assert!(took < Duration::from_secs(4), "{took:?}");
    assert!(took >= Duration::from_secs(2), "{took:?}: waited its bound");
    assert_eq!(o.store.released.load(Ordering::SeqCst), 0);
    stall.release();
    eventually("the late registration is undone", || {
        o.store.released.load(Ordering::SeqCst) == o.store.registered.load(Ordering::SeqCst)
    });
    eventually("the pool's memory is let go", || {
        Arc::strong_count(&pool) == 1
    });
}

#[test]
fn a_hung_unregister_does_not_hold_close_past_its_bound_and_keeps_the_memory_until_it_returns() {
    let (o, stall) = hanging_registry(FaultCall::Unregister);
    let pool = Arc::new(HostKvPool::new(o.g.clone(), 16).unwrap());
    let linker = Linker::new(o.g.clone(), o.store.clone(), pool.clone(), cfg()).unwrap();
    let t2 = linker
        .start_load(load_plan(&o.g, 2, &o.pages, vec![8, 9, 10, 11]))
        .unwrap();
    wait_all(&linker, &t2).unwrap();
    linker.wait_batch(&t2).unwrap().result.unwrap();
    let t0 = Instant::now();
    linker.close().unwrap();
    let took = t0.elapsed();
    // Every region's unregister side by side, one store call's bound (2 s) for all.
    assert!(took < Duration::from_secs(4), "{took:?}");
    // Counted as the linker's overdue store calls (before, registrations ran on store calls
    // of their own, whose count no metric read).
    assert!(
        linker.metrics().overdue_calls >= 1,
        "{:?}",
        linker.metrics()
    );
    drop(linker);
    assert!(
        Arc::strong_count(&pool) > 1,
        "the registered memory is kept while its unregister has not returned"
    );
    // (`released` counts an unregister as it starts: the pool's count says it returned.)
    stall.release();
    eventually("the pool's memory is let go", || {
        Arc::strong_count(&pool) == 1
    });
}

/// A host pool of [`small_spec`] holding two pages of a prompt in slots 3 and 5, and a store
/// whose first put stalls until `stall` is released.
struct FirstPutStalled {
    g: KvGeometry,
    faulty: Arc<FaultyStore>,
    stall: Stall,
    pool: Arc<HostKvPool>,
    pages: Vec<PageHash>,
    slots: Vec<u32>,
}

/// [`FirstPutStalled`] of prompt `seed`.
fn first_put_stalled(seed: u32) -> FirstPutStalled {
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 30))));
    let stall = Stall::new();
    faulty.inject_on(
        FaultCall::Put,
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Stall(stall.clone()),
    );
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let pages = kvlink::kv_geometry::page_hashes(&prompt(seed, 2, spec.page_size), 4, None);
    let slots = vec![3, 5];
    common::fill_pool(&pool, &pages, &slots);
    FirstPutStalled {
        g,
        faulty,
        stall,
        pool,
        pages,
        slots,
    }
}

/// A save whose put hangs past `store_call_timeout` fails, and its put may still read the host
/// pool's slots in place: they stay claimed for reading until it returns. Before, nothing said
/// when the engine could write them again (the guide said "at once"), and `write_slot` wrote
/// them under the put's read; now `write_slot` refuses them (`SlotBusy`) and
/// `SlotClaims::wait_free` waits for the put, bounded.
#[test]
fn a_hung_save_keeps_its_host_slots_claimed_until_the_put_returns() {
    use kvlink::kv_device::{DeviceError, KvPool, SlotClaims};
    use kvlink::kv_geometry::ComponentId;
    let FirstPutStalled {
        g,
        faulty,
        stall,
        pool,
        pages,
        slots,
    } = first_put_stalled(9);
    let linker = Linker::new(g.clone(), faulty.clone(), pool.clone(), cfg()).unwrap();
    let t0 = Instant::now();
    let err = linker
        .save(&load_plan(&g, 1, &pages, slots.clone()))
        .unwrap_err();
    assert!(
        t0.elapsed() < Duration::from_secs(4),
        "{:?}: {err}",
        t0.elapsed()
    );
    let row = vec![0u8; g.component(ComponentId(0)).unwrap().page_layer_bytes as usize];
    // SAFETY: this test is the engine: nothing else writes slot 3 (the late put only reads it).
    let refused = unsafe { pool.write_slot(ComponentId(0), 0, 3, &row) };
    assert!(
        matches!(refused, Err(DeviceError::SlotBusy { slot: 3, .. })),
        "{refused:?}"
    );
    let soon = Instant::now() + Duration::from_millis(100);
    let waited = SlotClaims::wait_free(pool.as_ref() as &dyn KvPool, &slots, soon);
    assert!(
        matches!(waited, Err(DeviceError::SlotBusy { .. })),
        "{waited:?}"
    );
    // The put returns: the slots are free again.
    stall.release();
    let by = Instant::now() + Duration::from_secs(10);
    SlotClaims::wait_free(pool.as_ref() as &dyn KvPool, &slots, by).unwrap();
    // SAFETY: as above; no save or load of the slot runs now.
    unsafe { pool.write_slot(ComponentId(0), 0, 3, &row) }.unwrap();
}

/// A save reads a host pool's slots chunk by chunk; all of them are claimed for reading from
/// its start until it returns: an engine that writes one a later chunk reads (the block of a
/// finished request handed to the next one while the save runs) is refused (`SlotBusy`).
/// Before, only the chunk being put was claimed, and the next request's bytes were saved under
/// this request's page hashes, with checksums of those same bytes.
#[test]
fn a_save_claims_every_slot_it_reads_until_it_returns() {
    use kvlink::kv_device::DeviceError;
    use kvlink::kv_geometry::ComponentId;
    let FirstPutStalled {
        g,
        faulty,
        stall,
        pool,
        pages,
        slots,
    } = first_put_stalled(10);
    let one_page_a_call = LinkerConfig {
        save_chunk: 1,
        ..cfg()
    };
    let linker = Linker::new(g.clone(), faulty.clone(), pool.clone(), one_page_a_call).unwrap();
    let plan = load_plan(&g, 1, &pages, slots.clone());
    std::thread::scope(|s| {
        let saving = s.spawn(|| linker.save(&plan));
        eventually("the first page's put is held", || stall.hits() >= 1);
        let row = vec![0u8; g.component(ComponentId(0)).unwrap().page_layer_bytes as usize];
        // SAFETY: this test is the engine: nothing else writes slot 5 (the save only reads it).
        let refused = unsafe { pool.write_slot(ComponentId(0), 0, 5, &row) };
        assert!(
            matches!(refused, Err(DeviceError::SlotBusy { slot: 5, .. })),
            "{refused:?}"
        );
        stall.release();
        let _ = saving.join().unwrap();
    });
}

/// A device pool over a traced CPU device whose load stream stalls for `stall` at layer 2's
/// first slot copy (the fifth upload: the slot table, layer 0's two components, layer 1's
/// one), the read of layer 3 hanging: the linker, the device, and the stall's end.
fn stalled_landing(drain: Duration, stall: Duration) -> (One, Linker, Arc<CpuDevice>) {
    stalled_landing_of(one(), drain, stall).0
}

/// A traced CPU device, a device pool of 16 slots for `o`'s model on it, and staging of two
/// stages for batches of 4 pages.
fn traced_device_pool(o: &One) -> (Arc<CpuDevice>, Arc<DeviceKvPool>, Arc<StagingPool>) {
    let traced = kvlink::kv_device::cpu::CpuDeviceConfig {
        trace: true,
        ..Default::default()
    };
    let dev = CpuDevice::with_config(0, traced).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), o.g.clone(), 16).unwrap());
    let staging =
        StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&o.g, 4, 1), 2).unwrap();
    (dev, pool, staging)
}

/// [`stalled_landing`] over `o`; with its staging pool.
fn stalled_landing_of(
    o: One,
    drain: Duration,
    stall: Duration,
) -> ((One, Linker, Arc<CpuDevice>), Arc<StagingPool>) {
    let (dev, pool, staging) = traced_device_pool(&o);
    let linker = staged_linker(&o, &pool, staging.clone(), drain);
    dev.stall_at(CpuOp::ToDevice, 4, stall);
    ((o, linker, dev), staging)
}

/// A linker of `o`'s store landing into the device `pool` through `staging`, whose landings
/// wait `drain` at most for their copies.
fn staged_linker(
    o: &One,
    pool: &Arc<DeviceKvPool>,
    staging: Arc<StagingPool>,
    drain: Duration,
) -> Linker {
    let landings =
        Arc::new(StagedLandingFactory::new(pool.clone(), staging).with_drain_limit(drain));
    linker_landing_through(o, pool, landings)
}

/// A linker of `o`'s store landing into `pool` through `landings`.
fn linker_landing_through(
    o: &One,
    pool: &Arc<DeviceKvPool>,
    landings: Arc<dyn kvlink::kv_device::LandingFactory>,
) -> Linker {
    Linker::with_landings(
        o.g.clone(),
        o.store.clone(),
        pool.clone(),
        landings,
        cfg(),
        None,
    )
    .unwrap()
}

/// Slot copies of the load stream that finished after `at`.
fn copies_after(dev: &CpuDevice, at: Instant) -> Vec<kvlink::kv_device::cpu::TraceOp> {
    dev.trace()
        .into_iter()
        .filter(|o| {
            o.stream == 0 && matches!(o.op, CpuOp::ToDevice | CpuOp::Rows | CpuOp::OnDevice)
        })
        .filter(|o| o.finished > at)
        .collect()
}

/// A batch that fails while a hung read keeps its landing alive (so the landing's drop does
/// not drain its work) and its layer 2's copy into the slots is stalled: its outcome, which
/// tells the engine to recompute into the slots, comes only once that copy has finished.
#[test]
fn a_failed_batchs_outcome_comes_after_its_queued_slot_copies() {
    let stall = Duration::from_millis(1000);
    let (o, linker, dev) = stalled_landing(Duration::from_secs(5), stall);
    let t = hung_batch_fails_in_time(&linker, &o, vec![1, 2, 3, 4], false);
    let outcome = linker.wait_batch(&t).unwrap().result;
    let at = Instant::now();
    assert!(
        matches!(outcome, Err(KvLoadError::Store { layer: Some(3), .. })),
        "{outcome:?}"
    );
    let stalled = dev
        .trace()
        .iter()
        .filter(|o| o.op == CpuOp::ToDevice)
        .count();
    assert!(
        stalled >= 5,
        "the stalled copy ran before the outcome: {stalled} uploads"
    );
    let late = copies_after(&dev, at);
    assert!(
        late.is_empty(),
        "slot copies after the failed outcome: {late:?}"
    );
    o.stall.release();
    linker.close().unwrap();
}

/// The same, the copy stalled past the landing's drain limit: the batch's layer waiters are
/// told within about the limit to hold its slots, which stay claimed (no later landing or save
/// takes them, `SlotClaims::wait_free` waits), a reset names the batch, and its outcome comes
/// once the stalled copies have run: a device failure (reset, then recompute), not a plain
/// recompute. Before, the outcome came at the drain limit and a reset answered `Ok` while the
/// copies still ran: an engine recomputed into slots they then overwrote.
#[test]
fn a_failed_batchs_outcome_waits_for_its_slot_copies_that_outlast_the_drain_limit() {
    let o = one();
    let (linker, _pool, _slots, told) =
        device_failure_with_slots_claimed(&o, 4, Duration::from_secs(2));
    assert!(told < Duration::from_millis(1500), "{told:?}");
    o.stall.release();
    linker.close().unwrap();
}

/// A batch whose every layer read and was queued, its last layer's copy into the slots stalled
/// past the landing's drain limit. Before, its outcome was `Ok` with that copy still queued
/// (the landing's drop quarantined the staging, and the slots' claim was gone): an engine that
/// freed the slots after the `Ok` (an aborted request) would reuse them on a stream nothing
/// orders after the copy. The outcome is a device failure now, the slots claimed until the
/// copy ran.
#[test]
fn a_loaded_batchs_outcome_is_not_ok_while_copies_into_its_slots_are_stalled() {
    let o = one_faulted(Fault::Delay(Duration::ZERO), Stall::new());
    // The ninth upload: the slot table, then layers 0 to 4's (2, 1, 2, 1, 1): the last
    // layer's first, which no later stage reuse waits for. Long beside the drain limit, so
    // that the claims are seen inside it on a loaded machine.
    let (linker, ..) = device_failure_with_slots_claimed(&o, 8, Duration::from_secs(5));
    // The next batch loads.
    let t = linker
        .start_load(load_plan(&o.g, 2, &o.pages, vec![8, 9, 10, 11]))
        .unwrap();
    linker.wait_batch(&t).unwrap().result.unwrap();
    linker.close().unwrap();
}

/// A linker over a traced device pool (200 ms drain limit) whose upload after `skip` others
/// stalls for `stall`: batch 1 into slots 1..=4 fails while copies into its slots are stalled
/// ([`fails_while_copies_run`]), its outcome a `Device` failure once they have run. The
/// linker, the pool, the slots and when the batch's waiter was told.
fn device_failure_with_slots_claimed(
    o: &One,
    skip: u32,
    stall: Duration,
) -> (Linker, Arc<DeviceKvPool>, Vec<u32>, Duration) {
    let (dev, pool, staging) = traced_device_pool(o);
    let linker = staged_linker(o, &pool, staging, Duration::from_millis(200));
    dev.stall_at(CpuOp::ToDevice, skip, stall);
    let slots = vec![1, 2, 3, 4];
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, slots.clone()))
        .unwrap();
    let told = fails_while_copies_run(&linker, &t, &pool, &slots);
    let err = outcome_once_copies_ran(&linker, &dev, &pool).unwrap_err();
    assert!(matches!(err, KvLoadError::Device(_)), "{err:?}");
    assert!(err.to_string().contains("did not finish"), "{err}");
    assert_eq!(
        err.action(),
        kvlink::kv_loader::EngineAction::ResetThenRecompute
    );
    (linker, pool, slots, told)
}

/// Batch `t` into `slots` of `pool` fails while copies it queued into them are stalled: its
/// last layer's waiter is told to hold the slots (`SlotsHeld` naming it; unless that layer
/// was published, with the event its stalled copy ends at), which stay claimed, and a reset
/// names it too. Before, the outcome (`Device`) came at once and a reset answered `Ok`: an
/// engine that then recomputed into the slots raced the stalled copies. The time the waiter
/// was answered.
fn fails_while_copies_run(
    linker: &Linker,
    t: &LoadTicket,
    pool: &Arc<DeviceKvPool>,
    slots: &[u32],
) -> Duration {
    let t0 = Instant::now();
    let last = linker.geometry().num_layers() - 1;
    let waited = linker.wait_layer(t, last);
    let took = t0.elapsed();
    let held_batch_1 = |e: &KvLoadError| matches!(e, KvLoadError::SlotsHeld { batches } if batches[..] == [BatchId(1)]);
    if let Err(err) = waited {
        assert!(held_batch_1(&err), "{err:?}");
        assert_eq!(err.action(), kvlink::kv_loader::EngineAction::HoldSlots);
    }
    let claims_of: &dyn KvPool = pool.as_ref();
    let soon = Instant::now() + Duration::from_millis(100);
    assert!(
        SlotClaims::wait_free(claims_of, slots, soon).is_err(),
        "the slots were free while copies into them were stalled"
    );
    let reset = linker.reset().unwrap_err();
    assert!(held_batch_1(&reset), "{reset:?}");
    took
}

/// The outcome of the one batch in flight, once it comes (within 15 s).
fn the_outcome(linker: &Linker) -> kvlink::kv_loader::BatchOutcome {
    let t0 = Instant::now();
    loop {
        if let Some(o) = linker.completed().pop() {
            return o;
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "no outcome");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The outcome of the one batch in flight, once it comes (within 15 s), and that no copy
/// into a slot finished after it came, nor is any slot of `pool` held then.
fn outcome_once_copies_ran(
    linker: &Linker,
    dev: &CpuDevice,
    pool: &Arc<DeviceKvPool>,
) -> Result<kvlink::kv_loader::LoadStats, KvLoadError> {
    let outcome = the_outcome(linker);
    let at = Instant::now();
    let late = copies_after(dev, at);
    assert!(late.is_empty(), "slot copies after the outcome: {late:?}");
    let claims_of: &dyn KvPool = pool.as_ref();
    assert!(claims_of.slot_claims().unwrap().held_slots().is_empty());
    outcome.result
}

/// A batch that fails at once (a store error at layer 3, no read left hanging) while layer 2's
/// copies are stalled past the drain limit: its outcome is a device failure after one drain
/// limit, and its landing's drop quarantines the staging at once (the settle that timed out
/// poisoned the stages) rather than wait the limit out a second time before the outcome.
#[test]
fn a_batch_whose_copies_outlast_the_drain_limit_waits_it_out_once() {
    let drain = Duration::from_millis(1000);
    let o = one_faulted(
        Fault::Error(StoreError::TransferFailed {
            key: "k".into(),
            code: -1,
        }),
        Stall::new(),
    );
    let ((o, linker, _dev), staging) = stalled_landing_of(o, drain, Duration::from_secs(4));
    let t0 = Instant::now();
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, vec![1, 2, 3, 4]))
        .unwrap();
    // Its waiters are told to hold the slots once it failed; its outcome waits for the copies.
    let err = linker.wait_layer(&t, o.g.num_layers() - 1).unwrap_err();
    let took = t0.elapsed();
    assert!(matches!(err, KvLoadError::SlotsHeld { .. }), "{err:?}");
    assert!(took >= drain, "{took:?}");
    // A second drain in the drop would make it two limits.
    assert!(took < drain.mul_f64(1.7), "{took:?}");
    assert_eq!(staging.available(), 1, "the stalled lease is quarantined");
    eventually("the lease comes back once its copies ran", || {
        staging.available() == 2
    });
    let err = the_outcome(&linker).result.unwrap_err();
    assert!(matches!(err, KvLoadError::Device(_)), "{err:?}");
    linker.close().unwrap();
}

/// What a [`FaultAtThirdLand`] does at its third `land`, after queuing its copies.
#[derive(Clone, Copy, PartialEq)]
enum AtThirdLand {
    /// Panics (a defect in an engine's landing, say): the load thread unwinds with those
    /// copies still on the load stream.
    Panics,
    /// Panics, and again in `finish`.
    PanicsAndInFinish,
    /// Fails as the device would (the batch fails `Device`).
    Fails,
}

/// A staged landing whose third `land` misbehaves after queuing its copies.
struct FaultAtThirdLand {
    inner: Box<dyn kvlink::kv_device::LayerLanding>,
    lands: std::sync::atomic::AtomicU32,
    fault: AtThirdLand,
}

impl kvlink::kv_device::LayerLanding for FaultAtThirdLand {
    fn take_stages(&mut self) -> Vec<kvlink::kv_device::LayerStage> {
        self.inner.take_stages()
    }
    fn open(
        &self,
        stage: &mut kvlink::kv_device::LayerStage,
        layer: u32,
        deadline: Instant,
    ) -> Result<(), kvlink::kv_device::DeviceError> {
        self.inner.open(stage, layer, deadline)
    }
    fn lend(
        &self,
        stage: &mut kvlink::kv_device::LayerStage,
    ) -> Result<kvlink::kv_device::StageLoan, kvlink::kv_device::DeviceError> {
        self.inner.lend(stage)
    }
    fn target(
        &self,
        loan: &kvlink::kv_device::StageLoan,
        component: kvlink::kv_geometry::ComponentId,
        plan_page: usize,
    ) -> Result<kvlink::kv_device::ReadTarget, kvlink::kv_device::DeviceError> {
        self.inner.target(loan, component, plan_page)
    }
    fn target_bytes<'s>(
        &'s self,
        stage: &'s kvlink::kv_device::LayerStage,
        component: kvlink::kv_geometry::ComponentId,
        plan_page: usize,
    ) -> Result<&'s [u8], kvlink::kv_device::DeviceError> {
        self.inner.target_bytes(stage, component, plan_page)
    }
    fn land(
        &self,
        stage: &mut kvlink::kv_device::LayerStage,
    ) -> Result<kvlink::kv_loader::LayerReady, kvlink::kv_device::DeviceError> {
        let ready = self.inner.land(stage);
        if self.lands.fetch_add(1, Ordering::SeqCst) == 2 {
            if self.fault == AtThirdLand::Fails {
                return Err(kvlink::kv_device::DeviceError::Poisoned(
                    "injected: the device failed after queuing the copies",
                ));
            }
            panic!("an engine's landing panicked after queuing its copies");
        }
        ready
    }
    fn poison(&self, stage: &mut kvlink::kv_device::LayerStage) {
        self.inner.poison(stage)
    }
    fn finish(&self) {
        self.inner.finish();
        if self.fault == AtThirdLand::PanicsAndInFinish {
            panic!("an engine's landing panicked again as it finished");
        }
    }
    fn settle(&self) -> Result<(), kvlink::kv_device::DeviceError> {
        self.inner.settle()
    }
    fn settle_unless_stalled(&self, idle: Duration) -> Result<(), kvlink::kv_device::DeviceError> {
        self.inner.settle_unless_stalled(idle)
    }
    fn transfers(&self) -> Vec<kvlink::kv_loader::TransferBytes> {
        self.inner.transfers()
    }
    fn share(&self) -> kvlink::kv_device::ShareSide<'_> {
        self.inner.share()
    }
}

/// Landings that panic at their third `land`, and in `finish` too when `.1`.
struct FaultyLandings(StagedLandingFactory, AtThirdLand);

impl kvlink::kv_device::LandingFactory for FaultyLandings {
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: kvlink::kv_device::BatchShape,
    ) -> Result<Box<dyn kvlink::kv_device::LayerLanding>, kvlink::kv_device::DeviceError> {
        Ok(Box::new(FaultAtThirdLand {
            inner: self.0.begin(slots, shape)?,
            lands: Default::default(),
            fault: self.1,
        }))
    }
    fn store_regions(&self) -> Vec<kvlink::kv_device::StoreRegion> {
        self.0.store_regions()
    }
    fn share_path(&self) -> kvlink::kv_device::SharePath {
        self.0.share_path()
    }
}

/// A batch whose load panics (here, in its landing) with copies into its slots still queued
/// past the drain limit (layer 2's, on a stalled load stream) fails as a device failure
/// (`ResetThenRecompute`: the slots may still be written), not `Internal` (`Recompute`), which
/// told the engine to recompute into slots a queued copy could still overwrite.
#[test]
fn a_panicked_batch_with_slot_copies_unfinished_is_a_device_failure() {
    panicked_batch_with_slot_copies_unfinished(AtThirdLand::Panics);
}

/// The same with a landing that panics again in `finish` as the batch unwinds: caught (a
/// second panic while unwinding aborts the process), the outcome the same.
#[test]
fn a_landing_that_panics_again_as_it_finishes_does_not_abort() {
    panicked_batch_with_slot_copies_unfinished(AtThirdLand::PanicsAndInFinish);
}

fn panicked_batch_with_slot_copies_unfinished(fault: AtThirdLand) {
    let o = one();
    let (dev, pool, staging) = traced_device_pool(&o);
    let landings = Arc::new(FaultyLandings(
        StagedLandingFactory::new(pool.clone(), staging)
            .with_drain_limit(Duration::from_millis(200)),
        fault,
    ));
    let linker = linker_landing_through(&o, &pool, landings);
    dev.stall_at(CpuOp::ToDevice, 4, Duration::from_secs(2));
    let slots = vec![1, 2, 3, 4];
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, slots.clone()))
        .unwrap();
    fails_while_copies_run(&linker, &t, &pool, &slots);
    let err = outcome_once_copies_ran(&linker, &dev, &pool).unwrap_err();
    assert!(matches!(err, KvLoadError::Device(_)), "{err:?}");
    assert!(err.to_string().contains("panicked"), "{err}");
    assert_eq!(
        err.action(),
        kvlink::kv_loader::EngineAction::ResetThenRecompute
    );
    o.stall.release();
    linker.close().unwrap();
}

/// A batch that fails on the device (its third `land`, after queuing copies the stalled load
/// stream has not run) gets its outcome without waiting the drain limit out: before, its
/// settle waited the whole limit (30 s by default) on a device that likely stopped with it,
/// delaying the engine's reset. Its slots stay claimed until the copies end all the same.
#[test]
fn a_batch_that_failed_on_the_device_does_not_wait_the_drain_limit_for_its_copies() {
    let o = one();
    let (dev, pool, staging) = traced_device_pool(&o);
    let drain = Duration::from_secs(3);
    let landings = Arc::new(FaultyLandings(
        StagedLandingFactory::new(pool.clone(), staging).with_drain_limit(drain),
        AtThirdLand::Fails,
    ));
    let linker = linker_landing_through(&o, &pool, landings);
    dev.stall_at(CpuOp::ToDevice, 4, Duration::from_secs(5));
    let slots = vec![1, 2, 3, 4];
    let t = linker
        .start_load(load_plan(&o.g, 1, &o.pages, slots.clone()))
        .unwrap();
    let took = fails_while_copies_run(&linker, &t, &pool, &slots);
    assert!(
        took < Duration::from_millis(2500),
        "waited the drain limit: {took:?}"
    );
    let claims_of: &dyn KvPool = pool.as_ref();
    let mut held = claims_of.slot_claims().unwrap().held_slots();
    held.sort_unstable();
    assert_eq!(
        held, slots,
        "the slots stay claimed while copies into them are stalled"
    );
    let err = outcome_once_copies_ran(&linker, &dev, &pool).unwrap_err();
    assert!(matches!(err, KvLoadError::Device(_)), "{err:?}");
    o.stall.release();
    linker.close().unwrap();
}
