//! The in-process device group over the CPU device: device regions broadcast and all-gathered
//! by copies on each rank's comm stream, ordered by events; deadlines, aborts and re-forming;
//! the safe share entry points over real landings.

mod common;

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::threads::on_threads;
use dedup_broadcast::{
    share_rows, share_stage, Collective, CollectiveError, GroupFormation, InProcessFormation,
    InProcessGroup, RowsShare, StageShare, StagingLayout,
};
use kv_device::{
    BatchShape, CpuDevice, CpuDeviceConfig, Device, DeviceKvPool, DeviceMemory, DeviceShare,
    DirectLanding, HostKvPool, HostShare, KvPool, LayerLanding, PinnedMemory, SharedEvent,
    StagedLanding, StagingPool, Transfer,
};
use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
use kv_loader::ShareMode;

fn soon() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(10))
}

fn jittery(ordinal: u32) -> Arc<dyn Device> {
    CpuDevice::with_config(
        ordinal,
        CpuDeviceConfig {
            max_op_delay: Duration::from_micros(500),
            ..CpuDeviceConfig::default()
        },
    )
    .unwrap()
}

/// One rank's device memory and a pinned mirror to fill and check it through its load stream.
struct Mem {
    dev: Arc<dyn Device>,
    region: DeviceMemory,
    host: PinnedMemory,
}

impl Mem {
    fn new(dev: Arc<dyn Device>, len: usize) -> Self {
        Mem {
            region: dev.alloc(len, "t").unwrap(),
            host: dev.alloc_pinned(len, "t").unwrap(),
            dev,
        }
    }

    /// Enqueues the upload of `bytes` at `at` (load stream) and returns its event.
    fn upload(&self, at: usize, bytes: &[u8]) -> SharedEvent {
        // SAFETY: `host` is ours; no copy reads it now (the previous round was waited for).
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                (self.host.addr() + at) as *mut u8,
                bytes.len(),
            );
            self.dev
                .load_stream()
                .transfer(Transfer::ToDevice {
                    dst: self.region.addr() + at as u64,
                    src: self.host.addr() + at,
                    len: bytes.len(),
                })
                .unwrap();
        }
        self.dev.load_stream().record().unwrap()
    }

    /// The region's bytes once `after` completes (load stream waits for it, then copies out).
    fn read(&self, after: &SharedEvent) -> Vec<u8> {
        let s = self.dev.load_stream();
        s.wait(after).unwrap();
        // SAFETY: both ours; the copy runs after `after` (the collective) completes.
        unsafe {
            s.transfer(Transfer::ToHost {
                dst: self.host.addr(),
                src: self.region.addr(),
                len: self.region.len(),
            })
            .unwrap();
        }
        assert!(s.record().unwrap().wait_until(soon()).unwrap());
        // SAFETY: the copy finished.
        unsafe { std::slice::from_raw_parts(self.host.addr() as *const u8, self.region.len()) }
            .to_vec()
    }
}

fn pattern(round: usize, rank: usize, i: usize) -> u8 {
    (round * 37 + rank * 11 + i * 3) as u8
}

#[test]
fn device_broadcasts_and_all_gathers_are_ordered_by_events() {
    for (size, shared_device) in [(2usize, true), (3, false), (5, true)] {
        let devs: Vec<Arc<dyn Device>> = if shared_device {
            let d = jittery(0);
            (0..size).map(|_| d.clone()).collect()
        } else {
            (0..size).map(|r| jittery(r as u32)).collect()
        };
        let ranks = InProcessGroup::on_devices(devs.clone()).unwrap();
        let len = 4096 * size;
        on_threads(&ranks, |c| {
            let r = c.rank() as usize;
            let mem = Mem::new(devs[r].clone(), len);
            for round in 0..12 {
                let root = round % size;
                let bytes: Vec<u8> = (0..len).map(|i| pattern(round, root, i)).collect();
                let after = if r == root {
                    Some(mem.upload(0, &bytes))
                } else {
                    None
                };
                let region = mem.region.region();
                // SAFETY: `mem.region` is this rank's own, read by the load stream only after
                // the returned event (below), and reused only in the next round, after it.
                let done =
                    unsafe { c.broadcast_device(region, after, root as u32, soon()) }.unwrap();
                assert_eq!(mem.read(&done), bytes, "size {size} round {round} rank {r}");
                // All-gather in place: each rank's chunk from its own upload.
                let chunk = len / size;
                let mine: Vec<u8> = (0..chunk).map(|i| pattern(round, r, i)).collect();
                let after = mem.upload(r * chunk, &mine);
                // SAFETY: as above.
                let done = unsafe { c.all_gather_device(region, Some(after), soon()) }.unwrap();
                let got = mem.read(&done);
                for p in 0..size {
                    let want: Vec<u8> = (0..chunk).map(|i| pattern(round, p, i)).collect();
                    assert_eq!(got[p * chunk..(p + 1) * chunk], want[..], "chunk {p}");
                }
            }
        });
    }
}

/// A rank whose device copy fails to enqueue (a driver error) gets its own device error as the
/// typed source (`CollectiveError::Device`), its peers a failure naming it, and the group is
/// broken on every rank. Before, the rank's error was flattened to text.
#[test]
fn a_rank_whose_copy_fails_keeps_its_device_error_and_the_group_breaks() {
    let cpus: Vec<Arc<CpuDevice>> = (0..3u32)
        .map(|r| CpuDevice::with_config(r, CpuDeviceConfig::default()).unwrap())
        .collect();
    cpus[1].fail_enqueue(kv_device::cpu::CpuOp::OnDevice, 0);
    let devs: Vec<Arc<dyn Device>> = cpus.iter().map(|d| d.clone() as Arc<dyn Device>).collect();
    let ranks = InProcessGroup::on_devices(devs.clone()).unwrap();
    let len = 3 * 1024;
    let results = on_threads(&ranks, |c| {
        let mem = Mem::new(devs[c.rank() as usize].clone(), len);
        // SAFETY: `mem.region` is this rank's own and untouched until the round ends (the
        // test reads nothing of it); on an error with the handle broken it is kept for good
        // (below), as the call's contract asks.
        let r = unsafe { c.all_gather_device(mem.region.region(), None, soon()) }.map(drop);
        if r.is_err() && c.broken().is_some() {
            // A peer's copies of the failed round may still be queued on this rank's region
            // (or read from it): freeing it corrupted the heap once in ~100 runs.
            std::mem::forget(mem);
        }
        r
    });
    match &results[1] {
        Err(CollectiveError::Device { source, .. }) => {
            assert!(
                matches!(source, kv_device::DeviceError::Driver(_)),
                "{source:?}"
            )
        }
        other => panic!("rank 1: {other:?}"),
    }
    for r in [0usize, 2] {
        let Err(e) = &results[r] else {
            panic!("rank {r}: {:?}", results[r])
        };
        // Before, the failing rank's words came with their own "collective backend:" inside
        // the peer's (twice or three times in all).
        let text = e.to_string();
        assert_eq!(
            text.matches("collective backend").count(),
            1,
            "rank {r}: {text}"
        );
        assert!(
            text.contains("rank 1"),
            "names the rank whose copy failed: {text}"
        );
    }
    for c in &ranks {
        assert!(c.broken().is_some(), "rank {} not broken", c.rank());
    }
}

#[test]
fn a_rank_that_never_issues_fails_the_others_by_their_deadline() {
    let dev: Arc<dyn Device> = CpuDevice::new(0).unwrap();
    let ranks = InProcessGroup::on_devices(vec![dev.clone(), dev.clone(), dev.clone()]).unwrap();
    let t0 = Instant::now();
    let r = on_threads(&ranks[..2], |c| {
        let mem = Mem::new(dev.clone(), 64);
        // SAFETY: refused or timed out before anything is enqueued: nothing touches `mem`.
        unsafe {
            c.broadcast_device(
                mem.region.region(),
                None,
                0,
                kv_loader::deadline_after(Duration::from_millis(200)),
            )
        }
        .map(|_| ())
    });
    assert!(t0.elapsed() < Duration::from_secs(3));
    for r in r {
        assert!(
            matches!(&r, Err(CollectiveError::Timeout { missing, .. }) if missing == &vec![2]),
            "{r:?}"
        );
    }
}

#[test]
fn a_stalled_peer_holds_the_completion_and_abort_breaks_the_group() {
    let quick = CpuDevice::new(0).unwrap();
    let slow = CpuDevice::new(1).unwrap();
    let devs: Vec<Arc<dyn Device>> = vec![quick.clone(), slow.clone()];
    let ranks = InProcessGroup::on_devices(devs.clone()).unwrap();
    slow.stall_for(Duration::from_millis(400));
    let events = on_threads(&ranks, |c| {
        let mem = Mem::new(devs[c.rank() as usize].clone(), 256);
        // SAFETY: `mem` lives until the completion is known (waited below).
        let ev = unsafe { c.all_gather_device(mem.region.region(), None, soon()) }.unwrap();
        let early = ev
            .wait_until(kv_loader::deadline_after(Duration::from_millis(50)))
            .unwrap();
        let later = ev.wait_until(soon()).unwrap();
        (early, later)
    });
    // The call itself returned (host-side matching), but the device work waited for the stall.
    assert_eq!(events, vec![(false, true), (false, true)]);
    assert!(ranks.iter().all(|c| c.broken().is_none()));
    ranks[1].abort("a test gave up on an event");
    for c in &ranks {
        assert!(c.broken().unwrap().contains("a test gave up"));
        assert!(matches!(
            c.all_gather_u64(1, soon()),
            Err(CollectiveError::Aborted { .. })
        ));
    }
    // Host-only groups have nothing in flight, but abort breaks them too: it is how ranks
    // whose collectives shifted resynchronise (every rank re-forms at its next batch).
    let host = InProcessGroup::new(2);
    host[0].abort("out of step");
    for c in &host {
        assert!(c.broken().unwrap().contains("out of step"));
        assert!(matches!(
            c.all_gather_u64(1, soon()),
            Err(CollectiveError::Aborted { .. })
        ));
    }
}

#[test]
fn a_formation_gives_every_rank_a_fresh_working_group() {
    let dev: Arc<dyn Device> = CpuDevice::new(0).unwrap();
    let f = InProcessFormation::on_devices(vec![dev.clone(), dev.clone()]);
    for epoch in 1..=3u64 {
        let pairs: Vec<_> = (0..2)
            .map(|r| f.reform(r, epoch, soon()).unwrap())
            .collect();
        // Asked again while held (a second user of rank 0): the same handles, not a group
        // of its own.
        let again = f.reform(0, epoch, soon()).unwrap();
        assert!(
            Arc::ptr_eq(&again.data, &pairs[0].data),
            "the held handles again"
        );
        drop(again);
        assert!(pairs.iter().all(|p| p.epoch == epoch));
        // Device data handles, host control handles.
        assert!(pairs
            .iter()
            .all(|p| p.data.memory().device && p.control.memory().host));
        let handles: Vec<Arc<dyn Collective>> = pairs.iter().map(|p| p.data.clone()).collect();
        let sums: Vec<u64> = thread::scope(|s| {
            let hs: Vec<_> = handles
                .iter()
                .map(|h| {
                    s.spawn(move || {
                        h.all_reduce_min_u64(epoch + u64::from(h.rank()), soon())
                            .unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(sums, vec![epoch, epoch]);
        handles[0].abort("next epoch");
        assert!(handles[1].broken().is_some());
    }
    assert!(f.reform(2, 9, soon()).is_err(), "no rank 2");
}

#[test]
fn a_rank_that_lags_joins_the_formation_its_peers_made() {
    let f = InProcessFormation::host(2);
    // Rank 0 re-forms twice (its first new group broke before rank 1 came for it); rank 1,
    // still on epoch 0, asks for epoch 1 and must meet rank 0 in epoch 2, not a group of its
    // own.
    let a1 = f.reform(0, 1, soon()).unwrap();
    a1.data.abort("rank 1 is slow");
    let a2 = f.reform(0, 2, soon()).unwrap();
    let b = f.reform(1, 1, soon()).unwrap();
    assert_eq!((a2.epoch, b.epoch), (2, 2));
    let mins: Vec<u64> = thread::scope(|s| {
        let hs: Vec<_> = [&a2, &b]
            .into_iter()
            .map(|h| {
                s.spawn(move || {
                    h.data
                        .all_reduce_min_u64(10 + u64::from(h.data.rank()), soon())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert_eq!(mins, vec![10, 10]);
}

#[test]
fn a_rank_waits_for_a_slow_build_only_until_its_deadline() {
    // A build as slow as an NCCL group's set-up can be.
    let building = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = building.clone();
    let f = Arc::new(InProcessFormation::new(2, move || {
        started.store(true, std::sync::atomic::Ordering::Release);
        thread::sleep(Duration::from_millis(3000));
        Ok(InProcessGroup::new(2)
            .into_iter()
            .zip(InProcessGroup::new(2))
            .map(|(d, c)| {
                (
                    Arc::new(d) as Arc<dyn Collective>,
                    Arc::new(c) as Arc<dyn Collective>,
                )
            })
            .collect())
    }));
    let builder = {
        let f = f.clone();
        thread::spawn(move || f.reform(0, 1, soon()))
    };
    let end = soon();
    while !building.load(std::sync::atomic::Ordering::Acquire) {
        assert!(Instant::now() < end, "rank 0 never began the build");
        thread::sleep(Duration::from_millis(1));
    }
    let t0 = Instant::now();
    let late = f.reform(1, 1, Instant::now() + Duration::from_millis(100));
    assert!(
        matches!(late, Err(CollectiveError::Formation { .. })),
        "{:?}",
        late.map(|h| h.epoch)
    );
    assert!(
        t0.elapsed() < Duration::from_millis(1000),
        "{:?}",
        t0.elapsed()
    );
    // Asked again once the group is built, the rank joins it.
    assert_eq!(builder.join().unwrap().unwrap().epoch, 1);
    assert_eq!(f.reform(1, 1, soon()).unwrap().epoch, 1);
}

/// Three ranks, one layer, `k` shared by Rank0Broadcast and SplitAllGather through real
/// landings: host rows (host pools) and device stages (CPU device pools).
#[test]
fn share_entry_points_move_a_layer_and_count_it() {
    let spec = one_layer_spec("share-test");
    let pages = 7usize;
    let row = 40usize;
    let byte = |p: usize, i: usize| (p * 17 + i) as u8;
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        // Host path.
        let groups = InProcessGroup::new(3);
        let pools: Vec<Arc<HostKvPool>> = (0..3)
            .map(|r| {
                Arc::new(HostKvPool::new(KvGeometry::new(spec.clone(), 3, r).unwrap(), 16).unwrap())
            })
            .collect();
        on_threads(&groups, |c| {
            let r = c.rank() as usize;
            let g = pools[r].geometry().clone();
            let k = g.components()[0].clone();
            let layout = StagingLayout::new(mode, 0, [&k], pages, 3).unwrap();
            let slots: Vec<u32> = (0..pages as u32).map(|p| (p * 2 + r as u32) % 16).collect();
            let shape = BatchShape {
                own: vec![],
                shared: vec![k.id],
                share_bytes: vec![],
            };
            let mut l = DirectLanding::new(pools[r].clone(), slots.clone().into(), shape).unwrap();
            let mut st = l.take_stages();
            l.open(&mut st[0], 0, soon()).unwrap();
            let mut loan = l.lend(&mut st[0]).unwrap();
            for p in layout.share(c.rank()) {
                let at = l.target(&loan, k.id, p).unwrap();
                let data: Vec<u8> = (0..row).map(|i| byte(p, i)).collect();
                loan.write(at, &data).unwrap();
            }
            drop(loan);
            let blocks = layout.blocks();
            let counts = layout.rows_per_rank();
            {
                let mut rows = l.rows(&mut st[0], &blocks).unwrap();
                let how = match mode {
                    ShareMode::SplitAllGather => RowsShare::AllGather { counts: &counts },
                    _ => RowsShare::Broadcast { root: 0 },
                };
                share_rows(c, &mut rows, how, soon()).unwrap();
            }
            for (p, &s) in slots.iter().enumerate() {
                let mut got = vec![0u8; row];
                // SAFETY: this rank's share finished (share_rows returned) and no landing of
                // the pool writes it meanwhile.
                unsafe { pools[r].read_slot(k.id, 0, s, &mut got) }.unwrap();
                assert_eq!(
                    got,
                    (0..row).map(|i| byte(p, i)).collect::<Vec<_>>(),
                    "{mode:?} rank {r}"
                );
            }
            let t = l.transfers()[0];
            let mine = (layout.share(c.rank()).len() * row) as u64;
            assert_eq!(
                (t.collective_sent, t.collective_received),
                (mine, (pages * row) as u64 - mine)
            );
            assert_eq!(t.pcie(), 0);
        });
        // Device path.
        let dev: Arc<dyn Device> = jittery(0);
        let groups =
            InProcessGroup::on_devices(vec![dev.clone(), dev.clone(), dev.clone()]).unwrap();
        on_threads(&groups, |c| {
            let r = c.rank() as usize;
            let g = KvGeometry::new(spec.clone(), 3, r as u32).unwrap();
            let k = g.components()[0].clone();
            let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 16).unwrap());
            let staging =
                StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, pages, 3), 1)
                    .unwrap();
            let layout = StagingLayout::new(mode, 0, [&k], pages, 3).unwrap();
            let slots: Vec<u32> = (0..pages as u32).map(|p| (p * 2 + r as u32) % 16).collect();
            let shape = BatchShape {
                own: vec![],
                shared: vec![k.id],
                share_bytes: vec![layout.len()],
            };
            let mut l = StagedLanding::new(
                pool.clone(),
                staging.lease().unwrap(),
                slots.clone().into(),
                shape,
            )
            .unwrap();
            let mut st = l.take_stages();
            let s = &mut st[0];
            l.open(s, 0, soon()).unwrap();
            let mut loan = l.lend(s).unwrap();
            for rw in layout.rows(layout.share(c.rank())) {
                let at = l.share_target(&loan, rw.offset, rw.len).unwrap();
                let data: Vec<u8> = (0..row).map(|i| byte(rw.plan_page, i)).collect();
                loan.write(at, &data).unwrap();
            }
            drop(loan);
            l.upload(s, layout.chunk(c.rank())).unwrap();
            let ev = {
                let mut ds = l.device_stage(s).unwrap();
                let how = match mode {
                    ShareMode::SplitAllGather => StageShare::AllGather,
                    _ => StageShare::Broadcast { root: 0 },
                };
                share_stage(c, &mut ds, how, soon()).unwrap()
            };
            l.scatter(s, &layout.blocks(), &ev).unwrap();
            l.land(s).unwrap();
            for (p, &sl) in slots.iter().enumerate() {
                let mut got = vec![0u8; row];
                // SAFETY: the layer landed (its copies come first on the load stream) and
                // nothing else writes this rank's pool.
                unsafe { pool.read_slot(k.id, 0, sl, &mut got) }.unwrap();
                assert_eq!(
                    got,
                    (0..row).map(|i| byte(p, i)).collect::<Vec<_>>(),
                    "{mode:?} device rank {r}"
                );
            }
            let t = l.transfers()[0];
            let chunk = layout.chunk(c.rank()).len() as u64;
            assert_eq!(
                t.host_to_device, chunk,
                "{mode:?} rank {r}: only its part crosses PCIe"
            );
            if mode == ShareMode::Rank0Broadcast && r > 0 {
                assert_eq!(t.pcie(), 0, "a broadcast receiver moves nothing over PCIe");
            }
            assert_eq!(
                t.collective_sent + t.collective_received,
                layout.len() as u64
            );
        });
    }
}

/// A rank that reaches its share step after a peer aborted the group issues nothing, and its
/// stage is not quarantined: the staging lease comes back when the landing drops (it stayed
/// poisoned for good, one lease per such failure, until the staging ran out).
/// A share whose round an abort fails while it waits (a peer never came; the group was
/// broken from outside during the call) enqueued nothing: its stage stays reusable on every
/// rank that waited. Before, the group being broken after the failure poisoned the stage, and
/// its staging lease was quarantined for good.
#[test]
fn a_share_whose_open_round_an_abort_fails_leaves_the_stage_reusable() {
    let spec = one_layer_spec("aborted-share");
    let pages = 6usize;
    let dev: Arc<dyn Device> = jittery(0);
    let ranks = InProcessGroup::on_devices(vec![dev.clone(), dev.clone(), dev.clone()]).unwrap();
    let reusable = std::thread::scope(|s| {
        let waiting: Vec<_> = ranks[..2]
            .iter()
            .map(|c| {
                let (spec, dev) = (spec.clone(), dev.clone());
                s.spawn(move || {
                    let g = KvGeometry::new(spec, 3, c.rank()).unwrap();
                    let k = g.components()[0].clone();
                    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
                    let staging =
                        StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, pages, 2), 1)
                            .unwrap();
                    let layout =
                        StagingLayout::new(ShareMode::SplitAllGather, 0, [&k], pages, 3).unwrap();
                    let shape = BatchShape {
                        own: vec![],
                        shared: vec![k.id],
                        share_bytes: vec![layout.len()],
                    };
                    let slots: Vec<u32> = (0..pages as u32).collect();
                    let mut l =
                        StagedLanding::new(pool, staging.lease().unwrap(), slots.into(), shape)
                            .unwrap();
                    let mut st = l.take_stages();
                    let stage = &mut st[0];
                    l.open(stage, 0, soon()).unwrap();
                    l.upload(stage, layout.chunk(c.rank())).unwrap();
                    let r = {
                        let mut ds = l.device_stage(stage).unwrap();
                        share_stage(c, &mut ds, StageShare::AllGather, soon())
                    };
                    assert!(matches!(r, Err(CollectiveError::Aborted { .. })), "{r:?}");
                    drop(st);
                    drop(l);
                    staging.lease().is_ok()
                })
            })
            .collect();
        // Rank 2 never issues; the group is aborted while ranks 0 and 1 wait in the round.
        std::thread::sleep(Duration::from_millis(300));
        ranks[2].abort("test: the group gave up");
        waiting
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<bool>>()
    });
    assert_eq!(reusable, vec![true, true], "a stage was quarantined");
}

#[test]
fn a_share_on_a_group_broken_before_it_leaves_the_stage_reusable() {
    let spec = one_layer_spec("broken-share");
    let pages = 4usize;
    let dev: Arc<dyn Device> = jittery(0);
    let ranks = InProcessGroup::on_devices(vec![dev.clone(), dev.clone()]).unwrap();
    ranks[0].abort("rank 0 gave up on this layer");
    let c = &ranks[1];
    let g = KvGeometry::new(spec, 2, 1).unwrap();
    let k = g.components()[0].clone();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging =
        StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, pages, 2), 1).unwrap();
    let layout = StagingLayout::new(ShareMode::Rank0Broadcast, 0, [&k], pages, 2).unwrap();
    let slots: Vec<u32> = (0..pages as u32).collect();
    let shape = BatchShape {
        own: vec![],
        shared: vec![k.id],
        share_bytes: vec![layout.len()],
    };
    let mut l = StagedLanding::new(pool, staging.lease().unwrap(), slots.into(), shape).unwrap();
    let mut st = l.take_stages();
    let s = &mut st[0];
    l.open(s, 0, soon()).unwrap();
    l.upload(s, layout.chunk(c.rank())).unwrap();
    let r = {
        let mut ds = l.device_stage(s).unwrap();
        share_stage(c, &mut ds, StageShare::Broadcast { root: 0 }, soon())
    };
    assert!(matches!(r, Err(CollectiveError::Aborted { .. })), "{r:?}");
    drop(st);
    drop(l);
    assert!(
        staging.lease().is_ok(),
        "the stage of a share that issued nothing was quarantined"
    );
}

/// One layer, pages of 2 tokens, one replicated component `k` of 20 bytes a token.
fn one_layer_spec(name: &str) -> ModelKvSpec {
    ModelKvSpec::new(
        name,
        1,
        2,
        vec![ComponentSpec::new(
            "k",
            RowUnit::Token,
            ElementType::Bytes,
            20,
        )],
    )
    .unwrap()
}

/// What [`SlowWaits`] streams share: while `armed`, each `wait` first says so on `entered`,
/// then takes `delay` (a driver call that blocks on a full queue).
#[derive(Debug)]
struct SlowWaitState {
    armed: std::sync::atomic::AtomicBool,
    entered: std::sync::Mutex<std::sync::mpsc::Sender<()>>,
    delay: Duration,
}

/// A CPU device whose new streams (the comm streams) wait slowly while armed.
#[derive(Debug)]
struct SlowWaits {
    inner: Arc<CpuDevice>,
    state: Arc<SlowWaitState>,
}

// SAFETY: every promise is the inner CPU device's: each method forwards to it, and its streams
// are wrapped by `SlowStream`, which keeps theirs.
unsafe impl Device for SlowWaits {
    fn ordinal(&self) -> u32 {
        self.inner.ordinal()
    }

    fn name(&self) -> String {
        self.inner.name()
    }

    fn alloc(
        &self,
        len: usize,
        what: &'static str,
    ) -> Result<DeviceMemory, kv_device::DeviceError> {
        self.inner.alloc(len, what)
    }

    fn alloc_pinned(
        &self,
        len: usize,
        what: &'static str,
    ) -> Result<PinnedMemory, kv_device::DeviceError> {
        self.inner.alloc_pinned(len, what)
    }

    fn load_stream(&self) -> Arc<dyn kv_device::Stream> {
        self.inner.load_stream()
    }

    fn new_stream(&self) -> Result<Arc<dyn kv_device::Stream>, kv_device::DeviceError> {
        Ok(Arc::new(SlowStream {
            inner: self.inner.new_stream()?,
            state: self.state.clone(),
        }))
    }
}

#[derive(Debug)]
struct SlowStream {
    inner: Arc<dyn kv_device::Stream>,
    state: Arc<SlowWaitState>,
}

// SAFETY: every operation is the inner stream's, in the same order; `wait` only takes longer
// before it forwards.
unsafe impl kv_device::Stream for SlowStream {
    unsafe fn transfer(&self, t: Transfer) -> Result<(), kv_device::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.transfer(t) }
    }

    unsafe fn copy_rows(&self, c: kv_device::RowCopy) -> Result<(), kv_device::DeviceError> {
        // SAFETY: the caller's promise, passed on.
        unsafe { self.inner.copy_rows(c) }
    }

    fn record(&self) -> Result<SharedEvent, kv_device::DeviceError> {
        self.inner.record()
    }

    fn wait(&self, event: &SharedEvent) -> Result<(), kv_device::DeviceError> {
        if self.state.armed.load(std::sync::atomic::Ordering::SeqCst) {
            let _ = self.state.entered.lock().unwrap().send(());
            thread::sleep(self.state.delay);
        }
        self.inner.wait(event)
    }
}

/// A comm stream whose `wait` blocks (a driver call on a full queue) holds up no other rank's
/// use of the group: `broken` and `abort` answer at once. Before, a round's completion made its
/// stream calls under the group's lock, and every peer's `broken`, `abort` and drop waited for
/// them.
#[test]
fn a_comm_stream_that_blocks_holds_up_no_peers_look_at_the_group() {
    let (entered, entries) = std::sync::mpsc::channel();
    let state = Arc::new(SlowWaitState {
        armed: false.into(),
        entered: std::sync::Mutex::new(entered),
        delay: Duration::from_millis(3000),
    });
    let dev: Arc<dyn Device> = Arc::new(SlowWaits {
        inner: CpuDevice::new(0).unwrap(),
        state: state.clone(),
    });
    let ranks = InProcessGroup::on_devices(vec![dev.clone(), dev.clone()]).unwrap();
    state.armed.store(true, std::sync::atomic::Ordering::SeqCst);
    let len = 4096;
    thread::scope(|s| {
        let rounds: Vec<_> = ranks
            .iter()
            .map(|c| {
                let dev = dev.clone();
                s.spawn(move || {
                    let mem = Mem::new(dev, len);
                    // SAFETY: `mem.region` is this rank's own; it is read only after the
                    // returned event, and freed after that.
                    let done = unsafe { c.broadcast_device(mem.region.region(), None, 0, soon()) }
                        .unwrap();
                    mem.read(&done).len()
                })
            })
            .collect();
        entries
            .recv_timeout(Duration::from_secs(10))
            .expect("a comm stream's wait");
        let t0 = Instant::now();
        assert!(ranks[0].broken().is_none());
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(1), "broken() waited {took:?}");
        for r in rounds {
            assert_eq!(r.join().unwrap(), len);
        }
    });
}
