//! The device path of the linker on CPU devices (the backend that runs it in CI): every mode
//! lands every rank byte for byte, receivers move nothing over PCIe, no layer event reaches the
//! engine before its collective completed, a collective whose event never completes is
//! bounded and aborted and the next batch loads on a re-formed group.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tp::{
    config, mixed_spec, rank_matches, rank_matches_below, run, tp_ranks, tp_ranks_built, Path,
    RankBuild, TpRank,
};
use common::{load_plan, wait_all};
use kvlink::kv_device::cpu::CpuOp;
use kvlink::kv_device::{
    CpuDevice, Device, DeviceKvPool, HostKvPool, KvPool, ScatterStrategy, SlotClaims,
    StagedLandingFactory, StagingPool,
};
use kvlink::kv_geometry::{
    ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, PageHash, RowUnit,
};
use kvlink::kv_loader::{KvLoadError, KvLoader, LoadTicket, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};

const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

fn store() -> Arc<dyn KvStore> {
    Arc::new(EmbeddedStore::new(1 << 30))
}

#[test]
fn every_mode_lands_every_rank_byte_for_byte_on_the_device_path() {
    let spec = mixed_spec();
    for (tp, one_device, strategy) in [
        (2u32, false, ScatterStrategy::Auto),
        (3, true, ScatterStrategy::Kernel),
        (4, true, ScatterStrategy::Runs),
    ] {
        let path = Path::Device {
            one_device,
            jitter: Duration::from_micros(300),
            strategy,
        };
        for mode in MODES {
            let pages = 7;
            let (rs, hashes) = tp_ranks(&spec, tp, store(), pages, &config(mode), path);
            for batch in 1..=2 {
                for (rank, (r, o)) in rs.iter().zip(run(&rs, batch, &hashes)).enumerate() {
                    let stats = o
                        .result
                        .unwrap_or_else(|e| panic!("tp{tp} {mode:?} rank {rank}: {e}"));
                    assert_eq!(stats.mode, mode);
                    let one_copy = pages as u64 * r.linker.geometry().bytes_per_page();
                    assert_eq!(stats.bytes_landed, one_copy, "tp{tp} {mode:?} rank {rank}");
                    rank_matches(r, &hashes, rank as u32)
                        .unwrap_or_else(|e| panic!("tp{tp} {mode:?} batch {batch}: {e}"));
                }
            }
        }
    }
}

/// Every component replicated, 8 layers: the layer bytes L of one rank are easy to count.
fn replicated_spec() -> ModelKvSpec {
    ModelKvSpec::new(
        "replicated",
        8,
        4,
        vec![
            ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 64),
            ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, 96)
                .on_layers(LayerMap::Sparse(vec![0, 3, 6])),
        ],
    )
    .unwrap()
}

#[test]
fn receivers_move_nothing_over_pcie_and_split_ranks_about_one_nth() {
    let spec = replicated_spec();
    let (tp, pages) = (4u32, 10usize);
    for mode in MODES {
        let (rs, hashes) = tp_ranks(&spec, tp, store(), pages, &config(mode), Path::device());
        let whole = pages as u64
            * KvGeometry::new(spec.clone(), tp, 0)
                .unwrap()
                .bytes_per_page();
        for (rank, o) in run(&rs, 1, &hashes).into_iter().enumerate() {
            let s = o.result.unwrap();
            let t = s.transfers;
            assert_eq!(
                s.layer_transfers
                    .iter()
                    .copied()
                    .sum::<kvlink::kv_loader::TransferBytes>(),
                t
            );
            assert_eq!(t.device_to_host, 0);
            match mode {
                ShareMode::AllRanks => {
                    assert_eq!(t.host_to_device, whole, "rank {rank} reads and uploads all");
                    assert_eq!(t.collective_received + t.collective_sent, 0);
                }
                ShareMode::Rank0Broadcast if rank == 0 => {
                    assert_eq!(t.host_to_device, whole);
                    assert_eq!(t.collective_sent, whole);
                }
                ShareMode::Rank0Broadcast => {
                    assert_eq!(t.pcie(), 0, "receiver {rank}: 0 bytes over PCIe");
                    assert_eq!(t.collective_received, whole);
                    assert_eq!(s.bytes_read, 0);
                }
                ShareMode::SplitAllGather => {
                    // The padded share: 10 pages over 4 ranks are chunks of 3 pages.
                    let chunk = whole / pages as u64 * 3;
                    assert_eq!(t.host_to_device, chunk, "rank {rank}: about L/N");
                    assert!(t.host_to_device * u64::from(tp) < whole * 3 / 2);
                    assert_eq!(t.collective_sent, chunk);
                    assert_eq!(t.collective_received, 3 * chunk);
                }
            }
            assert!(
                t.device_to_device >= whole,
                "every row is scattered on the device"
            );
        }
    }
}

#[test]
fn no_layer_event_reaches_the_engine_before_its_collective_completed() {
    let spec = mixed_spec();
    let path = Path::Device {
        one_device: false,
        jitter: Duration::from_millis(2),
        strategy: ScatterStrategy::Kernel,
    };
    let cfg = config(ShareMode::Rank0Broadcast);
    let (rs, hashes) = tp_ranks(&spec, 3, store(), 4, &cfg, path);
    let returned: Vec<Vec<Instant>> = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| {
                let hashes = &hashes;
                s.spawn(move || {
                    let t = r
                        .linker
                        .start_load(load_plan(r.linker.geometry(), 1, hashes, r.slots.clone()))
                        .unwrap();
                    let at = (0..r.linker.num_layers())
                        .map(|l| {
                            r.linker.wait_layer(&t, l).unwrap();
                            Instant::now()
                        })
                        .collect();
                    r.linker.wait_batch(&t).unwrap().result.unwrap();
                    at
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in rs.iter().enumerate().skip(1) {
        rank_matches(r, &hashes, rank as u32).unwrap();
        // The receiver's broadcast copies run on its comm stream (not the load stream, 0),
        // one per layer, in order.
        let copies: Vec<Instant> = r
            .device
            .as_ref()
            .unwrap()
            .trace()
            .into_iter()
            .filter(|o| o.stream != 0 && o.op == CpuOp::OnDevice)
            .map(|o| o.finished)
            .collect();
        assert_eq!(copies.len(), 5, "rank {rank}: one broadcast per layer");
        for (layer, (copied, waited)) in copies.iter().zip(&returned[rank]).enumerate() {
            assert!(
                copied <= waited,
                "rank {rank} layer {layer}: the wait returned before the broadcast copy finished"
            );
        }
    }
}

/// Every rank starts batch 1 of `hashes` on a thread of its own and hands its ticket to
/// `then`: what each returned, in rank order.
fn each_rank_loads<T: Send>(
    rs: &[TpRank],
    hashes: &[PageHash],
    then: impl Fn(&TpRank, &LoadTicket) -> T + Sync,
) -> Vec<T> {
    let then = &then;
    std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| {
                s.spawn(move || {
                    let plan = load_plan(r.linker.geometry(), 1, hashes, r.slots.clone());
                    let t = r.linker.start_load(plan).unwrap();
                    then(r, &t)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Three device-path ranks in `mode` with a 300 ms `collective_timeout`, the middle one's
/// device stopped for `stall` at its first device-to-device copy: its part of the first
/// layer's collective (every other copy comes after that collective's event).
fn middle_rank_stalled(mode: ShareMode, stall: Duration) -> (Vec<TpRank>, Vec<PageHash>) {
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_millis(300),
        ..config(mode)
    };
    let path = Path::device_per_rank(ScatterStrategy::Auto);
    let (rs, hashes) = tp_ranks(&mixed_spec(), 3, store(), 6, &cfg, path);
    rs[1].stall_first_device_copy(stall);
    (rs, hashes)
}

#[test]
fn a_collective_that_never_completes_is_aborted_and_the_next_batch_loads() {
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        // Failed by the 300 ms collective timeout, well before the stall ends (the bound
        // below leaves 2 s for a loaded machine, and 0.5 s from the stall).
        let stall = Duration::from_millis(3000);
        let (rs, hashes) = middle_rank_stalled(mode, stall);
        let t0 = Instant::now();
        let failed: Vec<(Result<(), KvLoadError>, Result<_, _>)> =
            each_rank_loads(&rs, &hashes, |r, t| {
                let first = r.linker.wait_layer(t, 0).map(drop);
                (first, r.linker.wait_batch(t).unwrap().result)
            });
        assert!(
            t0.elapsed() < Duration::from_millis(2500),
            "bounded: {:?}",
            t0.elapsed()
        );
        for (rank, (first, outcome)) in failed.into_iter().enumerate() {
            // A broadcast receiver other than the stalled one completes its own copy: its
            // layer 0 may be published. Every rank whose collective depends on the stalled
            // copy publishes nothing.
            let depends = mode == ShareMode::SplitAllGather || rank != 2;
            if depends {
                assert!(
                    first.is_err(),
                    "{mode:?} rank {rank}: layer 0 was published"
                );
            }
            assert!(
                matches!(outcome, Err(KvLoadError::Collective { .. })),
                "{mode:?} rank {rank}: {outcome:?}"
            );
        }
        // Once the device runs again, the next batch loads on a re-formed group.
        std::thread::sleep(stall.saturating_sub(t0.elapsed()) + Duration::from_millis(200));
        for (rank, (r, o)) in rs.iter().zip(run(&rs, 2, &hashes)).enumerate() {
            o.result
                .unwrap_or_else(|e| panic!("{mode:?} after the abort, rank {rank}: {e}"));
            rank_matches(r, &hashes, rank as u32).unwrap();
        }
    }
}

/// A device error under a rank's collective (its event reports it) stays a device error on
/// that rank: `KvLoadError::Device`, whose source downcasts to `DeviceError`, with a device
/// reset as its action; the rank aborts the group, so every other rank fails the batch too.
/// Before, it was `KvLoadError::Collective` with the error as text.
#[test]
fn a_device_error_under_a_collective_is_a_device_error() {
    use common::coll::{Misbehave, Misbehaving};
    use common::tp::{tp_ranks_built, RankBuild};
    use kvlink::kv_device::DeviceError;
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let wrap = |rank: u32, g: TpGroup| match rank {
            1 => {
                let m = Misbehaving::new(g.data.clone(), Misbehave::FailedDeviceEvent { nth: 0 });
                let data: Arc<dyn kvlink::dedup_broadcast::Collective> = m;
                TpGroup { data, ..g }
            }
            _ => g,
        };
        let (rs, hashes) = tp_ranks_built(
            &mixed_spec(),
            3,
            store(),
            4,
            &config(mode),
            Path::device_per_rank(ScatterStrategy::Auto),
            &RankBuild::wrapped(&wrap),
        );
        let outcomes = run(&rs, 1, &hashes);
        for (rank, o) in outcomes.iter().enumerate() {
            let Err(e) = &o.result else {
                panic!("{mode:?} rank {rank}: loaded");
            };
            if rank != 1 {
                continue;
            }
            let KvLoadError::Device(cause) = e else {
                panic!("{mode:?} rank 1: {e:?}");
            };
            let device = cause.downcast_ref::<DeviceError>();
            assert!(
                matches!(device, Some(DeviceError::Driver(m)) if m.contains("injected")),
                "{mode:?}: {cause:?}"
            );
        }
    }
}

/// A collective that does not complete in time fails the batch before anything that writes
/// the rank's pool slots is enqueued behind it: no slot copy of the failed batch runs after
/// its outcome reached the engine (which may recompute into those slots), even when the
/// collective's event completes later.
#[test]
fn no_slot_copy_of_a_failed_batch_runs_after_its_outcome() {
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let stall = Duration::from_millis(1200);
        let (rs, hashes) = middle_rank_stalled(mode, stall);
        let failed_at: Vec<Instant> = each_rank_loads(&rs, &hashes, |r, t| {
            let outcome = r.linker.wait_batch(t).unwrap().result;
            assert!(
                matches!(outcome, Err(KvLoadError::Collective { .. })),
                "{mode:?}: {outcome:?}"
            );
            Instant::now()
        });
        // Past the stall: the stalled copy has finished (seen in its trace, bounded), and
        // whatever was queued behind it has had time to run.
        let stalled = rs[1].device.as_ref().unwrap();
        let by = Instant::now() + Duration::from_secs(10);
        while !stalled
            .trace()
            .iter()
            .any(|o| o.stream != 0 && o.op == CpuOp::OnDevice && o.finished > failed_at[1])
        {
            assert!(
                Instant::now() < by,
                "{mode:?}: the stalled copy never finished"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        std::thread::sleep(Duration::from_millis(300));
        for (rank, (r, &at)) in rs.iter().zip(&failed_at).enumerate() {
            let late: Vec<_> = r
                .device
                .as_ref()
                .unwrap()
                .trace()
                .into_iter()
                .filter(|o| o.stream == 0 && matches!(o.op, CpuOp::Rows | CpuOp::OnDevice))
                .filter(|o| o.finished > at)
                .collect();
            assert!(
                late.is_empty(),
                "{mode:?} rank {rank}: slot copies after the failed outcome: {late:?}"
            );
        }
    }
}

#[test]
fn a_rank_that_never_starts_fails_the_others_within_the_deadline() {
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_millis(300),
        ..config(ShareMode::SplitAllGather)
    };
    let (rs, hashes) = tp_ranks(&mixed_spec(), 3, store(), 4, &cfg, Path::device());
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for r in &rs[..2] {
            let hashes = &hashes;
            s.spawn(move || {
                let plan = load_plan(r.linker.geometry(), 1, hashes, r.slots.clone());
                let t = r.linker.start_load(plan).unwrap();
                assert!(wait_all(&r.linker, &t).is_err());
                let o = r.linker.wait_batch(&t).unwrap();
                assert!(
                    matches!(o.result, Err(KvLoadError::Collective { .. })),
                    "{o:?}"
                );
            });
        }
    });
    assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
}

#[test]
fn a_device_landing_needs_a_group_that_moves_device_memory() {
    let spec = mixed_spec();
    let g = KvGeometry::new(spec, 2, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&g, 4, 2), 1).unwrap();
    let landings = Arc::new(StagedLandingFactory::new(pool.clone(), staging));
    let host_group = TpGroup::in_process(2).remove(0);
    let r = Linker::with_landings(
        g,
        store(),
        pool,
        landings,
        LinkerConfig::default(),
        Some(host_group),
    );
    assert!(
        matches!(r, Err(KvLoadError::Config(ref m)) if m.contains("Device")),
        "{:?}",
        r.err()
    );
}

/// A group bound to another GPU than the pool's (a rank given its global rank as its GPU
/// where the local one was meant) is refused at build. Before, it built, and every batch's
/// first share failed (the region on another device) and re-formed the group.
#[test]
fn a_device_group_on_another_gpu_than_the_pool_is_refused() {
    let g = KvGeometry::new(mixed_spec(), 2, 0).unwrap();
    let on_0 = CpuDevice::new(0).unwrap();
    let on_1 = CpuDevice::new(1).unwrap();
    let build = |group_devices: Vec<Arc<dyn Device>>| {
        let pool = Arc::new(DeviceKvPool::new(on_0.clone(), g.clone(), 8).unwrap());
        let staging =
            StagingPool::new(on_0.clone(), StagingPool::half_bytes_for(&g, 4, 2), 1).unwrap();
        let landings = Arc::new(StagedLandingFactory::new(pool.clone(), staging));
        let group = TpGroup::in_process_on_devices(group_devices)
            .unwrap()
            .remove(0);
        Linker::with_landings(
            g.clone(),
            store(),
            pool,
            landings,
            LinkerConfig::default(),
            Some(group),
        )
    };
    let r = build(vec![on_1.clone(), on_0.clone()]);
    assert!(
        matches!(r, Err(KvLoadError::Config(ref m)) if m.contains("GPU 1") && m.contains("GPU 0")),
        "{:?}",
        r.err()
    );
    let ok = build(vec![on_0.clone(), on_1.clone()]);
    ok.unwrap().close().unwrap();
}

/// A group whose data and control handles are one handle is refused at build: the load
/// thread's and the lookups' collectives would pair across ranks in no agreed order. It built.
#[test]
fn a_group_with_one_handle_for_data_and_control_is_refused() {
    let g = KvGeometry::new(mixed_spec(), 2, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let group = TpGroup::in_process(2).remove(0);
    let one = TpGroup {
        control: group.data.clone(),
        ..group
    };
    let r = Linker::with_group(g, store(), pool, LinkerConfig::default(), one);
    assert!(
        matches!(r, Err(KvLoadError::Config(ref m)) if m.to_string().contains("one handle")),
        "{:?}",
        r.err()
    );
}

/// The rule behind "after an NCCL handle timeout a buffer can be freed while the comm thread
/// may still write it", on the in-process device group: a collective that fails after it may
/// have enqueued copies (a peer's copy could not be enqueued: the group breaks, no event tells
/// when the rest ends) poisons the stage with no fence, and its staging lease is quarantined
/// for good: never handed to another batch, never freed. A collective whose event only
/// completes late (a stalled device) quarantines the lease until that event completes.
#[test]
fn staging_a_failed_collective_may_still_write_is_never_reused() {
    let spec = mixed_spec();
    let path = Path::device_per_rank(ScatterStrategy::Auto);
    let cfg = LinkerConfig {
        collective_timeout: Duration::from_millis(300),
        ..config(ShareMode::Rank0Broadcast)
    };
    let (rs, hashes) = tp_ranks(&spec, 3, store(), 6, &cfg, path);
    // Rank 2 cannot enqueue its first device-to-device copy (its part of layer 0's broadcast).
    rs[2]
        .device
        .as_ref()
        .unwrap()
        .fail_enqueue(CpuOp::OnDevice, 0);
    let outcomes = run(&rs, 1, &hashes);
    assert!(outcomes.iter().all(|o| o.result.is_err()), "{outcomes:?}");
    let staging = rs[2].staging.as_ref().unwrap();
    assert_eq!(
        staging.quarantined(),
        1,
        "the lease the broken group may write is kept"
    );
    // The engine's metrics show it, held for good, of the pool's capacity.
    let m = rs[2].linker.metrics();
    assert_eq!(m.staging_quarantined, 1);
    let capacity = staging.capacity() as u64;
    assert_eq!((m.staging_held_for_good, m.staging_capacity), (1, capacity));
    // The next batches load on a re-formed group, with the other leases; the kept one stays.
    for batch in 2..=4 {
        for (rank, (r, o)) in rs.iter().zip(run(&rs, batch, &hashes)).enumerate() {
            o.result
                .unwrap_or_else(|e| panic!("batch {batch} rank {rank}: {e}"));
            rank_matches(r, &hashes, rank as u32).unwrap();
        }
        assert_eq!(staging.quarantined(), 1);
        assert_eq!(staging.available(), staging.capacity() - 1);
    }

    // A stalled copy: the lease waits in quarantine until its fences complete, then returns.
    // Long beside the batch's failure (its collective timeout), so that the lease is seen
    // in quarantine on a loaded machine too.
    let stall = Duration::from_millis(4000);
    rs[1].stall_first_device_copy(stall);
    let t0 = Instant::now();
    let outcomes = run(&rs, 5, &hashes);
    assert!(outcomes.iter().all(|o| o.result.is_err()), "{outcomes:?}");
    let quarantined = rs[1].staging.as_ref().unwrap();
    let failed_after = t0.elapsed();
    assert!(
        failed_after < stall,
        "the batch failed only after {failed_after:?}, past the stall: its quarantine was not seen"
    );
    assert_eq!(
        quarantined.quarantined(),
        1,
        "kept while the stalled copy may run"
    );
    // Back once its fences completed (polled, bounded: the reclaim runs on the device's own
    // thread after the stall).
    std::thread::sleep(stall.saturating_sub(t0.elapsed()));
    let by = Instant::now() + Duration::from_secs(10);
    while quarantined.quarantined() != 0 {
        assert!(
            Instant::now() < by,
            "still quarantined 10 s after its fences' stall ended"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (rank, (r, o)) in rs.iter().zip(run(&rs, 6, &hashes)).enumerate() {
        o.result
            .unwrap_or_else(|e| panic!("after the stall, rank {rank}: {e}"));
        rank_matches(r, &hashes, rank as u32).unwrap();
    }
}

/// A middle rank of three whose last copy into its slots stalls past its landing's drain
/// limit after every layer was queued. Before, that rank's outcome was `Ok` with the copy
/// still queued (its slots unclaimed); it is now that rank's device failure, carried by the
/// batch's verdict to every rank (each fails, the peers `PeerFailed`), and the next batch
/// loads on every rank once the device runs again.
#[test]
fn a_middle_ranks_slot_copies_stalled_past_the_drain_limit_fail_the_batch_on_every_rank() {
    // A drain limit the clean batches' copies keep well within on a loaded machine, and a
    // stall well past it.
    stalled_last_slot_copy(
        Duration::from_secs(1),
        Duration::from_secs(5),
        Duration::from_secs(4),
    );
}

/// The same with a drain limit past the peers' wait for the verdict word
/// (`collective_timeout`): the rank settles within half that wait instead, so its failure
/// still reaches the peers as `PeerFailed`. Waiting the drain limit out, the peers gave up
/// first and the group was aborted.
#[test]
fn a_stalled_slot_copy_is_settled_within_the_peers_wait() {
    stalled_last_slot_copy(
        Duration::from_secs(30),
        Duration::from_secs(3),
        Duration::from_secs(6),
    );
}

/// Three device ranks whose landings drain for `drain` at most and whose collectives wait
/// `collective_timeout`; batch 2 stalls rank 1's last copy into its slots for `stall`: every
/// rank fails it (rank 1 `Device`, the others `PeerFailed`), rank 1's slots stay claimed until
/// the copy ran, rank 1's outcome comes only then (its engine recomputes into those slots once
/// it has it), and batch 3 loads everywhere.
fn stalled_last_slot_copy(drain: Duration, collective_timeout: Duration, stall: Duration) {
    let spec = mixed_spec();
    let path = Path::device_per_rank(ScatterStrategy::Auto);
    let cfg = LinkerConfig {
        collective_timeout,
        ..config(ShareMode::Rank0Broadcast)
    };
    let build = RankBuild {
        drain,
        ..RankBuild::default()
    };
    let (rs, hashes) = tp_ranks_built(&spec, 3, store(), 6, &cfg, path, &build);
    let dev = rs[1].device.clone().unwrap();
    for (rank, o) in run(&rs, 1, &hashes).into_iter().enumerate() {
        o.result
            .unwrap_or_else(|e| panic!("batch 1 rank {rank}: {e}"));
    }
    stall_at_last_slot_copy(&dev, stall);
    let common::tp::RankPool::Device(pool) = &rs[1].pool else {
        unreachable!("a device path")
    };
    let claims_of: &dyn KvPool = pool.as_ref();
    let held = || claims_of.slot_claims().unwrap().held_slots();
    // Rank 1's slots are held once the batch failed (its last layer's waiter has the event of
    // the stalled copy), before its outcome comes, and no longer once it is in.
    let held_soon = || {
        let by = Instant::now() + drain + Duration::from_secs(3);
        loop {
            let h = held();
            if !h.is_empty() || Instant::now() > by {
                return h;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let (outcomes, held_then): (Vec<_>, Vec<_>) = std::thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let hashes = &hashes;
                s.spawn(move || {
                    let plan = load_plan(r.linker.geometry(), 2, hashes, r.slots.clone());
                    let t = r.linker.start_load(plan).unwrap();
                    let _ = wait_all(&r.linker, &t);
                    let failed = (rank == 1).then(held_soon);
                    let outcome = r.linker.wait_batch(&t).unwrap();
                    (outcome, failed.map(|f| (f, held())))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).unzip()
    });
    let (at_failure, at_outcome) = held_then[1].clone().unwrap();
    assert!(
        !at_failure.is_empty(),
        "no slot held while the copy is stalled"
    );
    assert!(
        at_outcome.is_empty(),
        "{at_outcome:?} held when the outcome came"
    );
    for (rank, o) in outcomes.iter().enumerate() {
        assert!(o.result.is_err(), "rank {rank}: {:?}", o.result);
    }
    assert!(
        matches!(outcomes[1].result, Err(KvLoadError::Device(_))),
        "{:?}",
        outcomes[1].result
    );
    assert_eq!(rs[1].linker.metrics().own_failures.get("device"), Some(&1));
    for rank in [0, 2] {
        assert!(
            matches!(outcomes[rank].result, Err(KvLoadError::PeerFailed { .. })),
            "rank {rank}: {:?}",
            outcomes[rank].result
        );
    }
    let by = Instant::now() + Duration::from_secs(1);
    SlotClaims::wait_free(claims_of, &rs[1].slots, by).expect("free once the copy ran");
    for (rank, (r, o)) in rs.iter().zip(run(&rs, 3, &hashes)).enumerate() {
        o.result
            .unwrap_or_else(|e| panic!("after the stall, rank {rank}: {e}"));
        rank_matches(r, &hashes, rank as u32).unwrap();
    }
}

/// Stalls `dev` for `stall` at the next batch's last copy into the slots: the last one of the
/// batch just run (the load stream's, of a kind no other stream runs, so that counting that
/// kind's operations gives the load stream's order alone).
fn stall_at_last_slot_copy(dev: &CpuDevice, stall: Duration) {
    let trace = dev.trace();
    let load_stream_only = |op: CpuOp| trace.iter().all(|o| o.op != op || o.stream == 0);
    let slot_copy = |o: &&kvlink::kv_device::cpu::TraceOp| {
        o.stream == 0
            && matches!(o.op, CpuOp::ToDevice | CpuOp::Rows | CpuOp::OnDevice)
            && load_stream_only(o.op)
    };
    let last = trace
        .iter()
        .filter(slot_copy)
        .max_by_key(|o| o.started)
        .unwrap();
    let before = trace
        .iter()
        .filter(|o| o.op == last.op && o.started < last.started)
        .count();
    dev.stall_at(last.op, before as u32, stall);
}

/// A rank whose upload of a layer's share area fails (its enqueue fails, as a driver call
/// that returns an error would) says so in that layer's status word: every rank stops at the
/// same layer, none shares or publishes it, every layer a rank did publish holds that rank's
/// own bytes, and the batch fails everywhere. Before, the rank still entered the layer's
/// collective and its peers shared, scattered and published what its device staging held
/// from an earlier layer; the failure reached them one status word later. The failing rank
/// is the middle one for `SplitAllGather` and the root (the only rank whose upload moves
/// anything) for `Rank0Broadcast`.
#[test]
fn a_failed_upload_stops_every_rank_before_the_layer_is_shared() {
    for (mode, failing) in [
        (ShareMode::SplitAllGather, 1usize),
        (ShareMode::Rank0Broadcast, 0),
    ] {
        let spec = replicated_spec();
        let path = Path::device_per_rank(ScatterStrategy::Auto);
        let (rs, hashes) = tp_ranks(&spec, 3, store(), 6, &config(mode), path);
        let layers = rs[0].linker.geometry().num_layers();
        // Host-to-device copies before the layers' uploads: at most the slot table's.
        rs[failing]
            .device
            .as_ref()
            .expect("a device-path rank")
            .fail_enqueue(CpuOp::ToDevice, 3);
        let ends = each_rank_loads(&rs, &hashes, |r, t| {
            let published = (0..layers)
                .take_while(|&l| r.linker.wait_layer(t, l).is_ok())
                .count() as u32;
            (published, r.linker.wait_batch(t).unwrap().result)
        });
        let published: Vec<u32> = ends.iter().map(|(p, _)| *p).collect();
        assert!(
            published.windows(2).all(|w| w[0] == w[1]),
            "{mode:?}: every rank stops at the same layer: {published:?}"
        );
        assert!(
            (1..layers).contains(&published[0]),
            "{mode:?}: the upload fault hit a middle layer: {published:?}"
        );
        for (rank, ((upto, outcome), r)) in ends.into_iter().zip(&rs).enumerate() {
            assert!(outcome.is_err(), "{mode:?} rank {rank}: {outcome:?}");
            rank_matches_below(r, &hashes, rank as u32, &r.slots, upto)
                .unwrap_or_else(|e| panic!("{mode:?}: a published layer is wrong: {e}"));
        }
    }
}

/// A save whose gather from the device fails names what it was saving: the component, the
/// layer and the plan pages (before, only the batch and the device's words).
#[test]
fn a_failed_save_gather_names_its_component_layer_and_pages() {
    let path = Path::device_per_rank(ScatterStrategy::Auto);
    let (rs, hashes) = tp_ranks(
        &replicated_spec(),
        1,
        store(),
        4,
        &config(ShareMode::AllRanks),
        path,
    );
    let r = &rs[0];
    r.device
        .as_ref()
        .expect("a device-path rank")
        .fail_enqueue(CpuOp::ToHost, 0);
    // Pages the store does not hold (the rig saved `hashes`): the save gathers them.
    let page_size = r.linker.geometry().spec().page_size;
    let fresh = kvlink::kv_geometry::page_hashes(
        &common::prompt(99, hashes.len(), page_size),
        page_size,
        None,
    );
    let plan = load_plan(r.linker.geometry(), 9, &fresh, r.slots.clone());
    let err = r.linker.save(&plan).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, KvLoadError::Device(_))
            && text.contains("saving `k` layer 0, plan pages 0..=3"),
        "{text}"
    );
}

/// A batch larger than the staging holds fails as `InvalidPlan` (`LargerThanStaging`), whose
/// action is a plain recompute: nothing was started. Before, it failed as a `Device` error,
/// whose action reset the loader (cancelling every other batch in flight) on every such
/// request. A batch of the pages `StagingPool::max_batch_pages` says then loads.
#[test]
fn a_batch_larger_than_the_staging_is_recomputed_without_a_reset() {
    use kvlink::kv_loader::{EngineAction, PlanError};
    let spec = mixed_spec();
    let store = store();
    let tokens = common::prompt(7, 4, spec.page_size);
    let cfg = config(ShareMode::AllRanks);
    let hashes = common::save_prefix(&spec, store.clone(), &tokens, &cfg);
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&g, 2, 1), 2).unwrap();
    assert_eq!(staging.max_batch_pages(&g), 2);
    let linker = Linker::builder_staged(g.clone(), store, pool, staging)
        .config(cfg)
        .build()
        .unwrap();
    let ticket = linker
        .start_load(load_plan(&g, 1, &hashes, vec![0, 1, 2, 3]))
        .unwrap();
    let err = wait_all(&linker, &ticket).unwrap_err();
    assert!(
        matches!(
            err,
            KvLoadError::InvalidPlan {
                reason: PlanError::LargerThanStaging { .. },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(err.action(), EngineAction::Recompute);
    let _ = linker.wait_batch(&ticket);
    let ticket = linker
        .start_load(load_plan(&g, 2, &hashes[..2], vec![4, 5]))
        .unwrap();
    wait_all(&linker, &ticket).unwrap();
}

/// A device pool's save gathers each chunk's layer through one staging stage: chunks are cut
/// to what a stage holds. Before, a save of more missing pages than the stage held failed
/// (`Device`) every time, with `save_chunk` at its default of 64 and staging sized for fewer.
#[test]
fn a_device_save_is_cut_into_chunks_a_stage_holds() {
    let spec = mixed_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&g, 2, 1), 2).unwrap();
    let linker = Linker::builder_staged(g.clone(), store(), pool, staging)
        .config(config(ShareMode::AllRanks))
        .build()
        .unwrap();
    let tokens = common::prompt(11, 5, spec.page_size);
    let pages = kvlink::kv_geometry::page_hashes(&tokens, spec.page_size, None);
    let report = linker
        .save(&load_plan(&g, 1, &pages, vec![0, 1, 2, 3, 4]))
        .unwrap();
    assert_eq!(
        report.objects_written as usize,
        pages.len() * g.components().len()
    );
}
