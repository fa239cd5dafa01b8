//! The staged landing over the CPU device: own rows and shared rows land byte for byte in
//! every scatter strategy, bytes are counted by direction, a stage is never reused before its
//! fences complete (two stages, or a ring of more holding a group of layers at once), and a
//! poisoned lease is quarantined until its work is done.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_device::cpu::CpuOp;
use kv_device::{
    BatchShape, CpuDevice, CpuDeviceConfig, Device, DeviceError, DeviceKvPool, DeviceShare,
    LandingFactory, LayerLanding, RowBlock, ScatterStrategy, ShareSide, StagedLanding,
    StagedLandingFactory, StagingPool,
};
use kv_geometry::{
    ComponentId, ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, RowUnit,
};
use kv_loader::LayerReady;

/// 4 layers: `k` (replicated, every layer), `ix` (replicated, layers 1 and 3), `v` (sharded).
fn geometry() -> KvGeometry {
    let spec = ModelKvSpec::new(
        "staged-test",
        4,
        4,
        vec![
            ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 10),
            ComponentSpec::new("ix", RowUnit::Page, ElementType::Bytes, 24)
                .on_layers(LayerMap::Sparse(vec![1, 3])),
            ComponentSpec::new("v", RowUnit::Token, ElementType::Bytes, 6).sharded(2),
        ],
    )
    .unwrap();
    KvGeometry::new(spec, 2, 1).unwrap()
}

fn byte(c: ComponentId, layer: u32, page: usize, i: usize) -> u8 {
    (c.0 as usize * 71 + layer as usize * 13 + page * 7 + i) as u8
}

fn soon() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(10))
}

fn row(g: &KvGeometry, c: ComponentId, layer: u32, page: usize) -> Vec<u8> {
    let len = g.component(c).unwrap().page_layer_bytes as usize;
    (0..len).map(|i| byte(c, layer, page, i)).collect()
}

fn check_pool(pool: &DeviceKvPool, g: &KvGeometry, slots: &[u32], comps: &[ComponentId]) {
    for &c in comps {
        for &l in &g.component(c).unwrap().layers {
            for (p, &s) in slots.iter().enumerate() {
                let want = row(g, c, l, p);
                let mut got = vec![0u8; want.len()];
                // SAFETY: the landings compared have ended: nothing writes the pool meanwhile.
                unsafe { pool.read_slot(c, l, s, &mut got) }.unwrap();
                assert_eq!(got, want, "component {} layer {l} page {p} slot {s}", c.0);
            }
        }
    }
}

struct Rig {
    dev: Arc<CpuDevice>,
    g: KvGeometry,
    pool: Arc<DeviceKvPool>,
    staging: Arc<StagingPool>,
}

fn rig(config: CpuDeviceConfig, pool_pages: u32, batch_pages: usize, leases: usize) -> Rig {
    let dev = CpuDevice::with_config(0, config).unwrap();
    let g = geometry();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), pool_pages).unwrap());
    let half = StagingPool::half_bytes_for(&g, batch_pages, 2);
    let staging = StagingPool::new(dev.clone(), half, leases).unwrap();
    Rig {
        dev,
        g,
        pool,
        staging,
    }
}

fn all(g: &KvGeometry) -> Vec<ComponentId> {
    g.components().iter().map(|c| c.id).collect()
}

/// Opens `stage` for `layer` and writes every component's rows of `pages` plan pages into
/// it, as a store read would; the bytes written.
fn fill_layer(
    g: &KvGeometry,
    landing: &StagedLanding,
    stage: &mut kv_device::LayerStage,
    layer: u32,
    pages: usize,
) -> u64 {
    landing.open(stage, layer, soon()).unwrap();
    let mut loan = landing.lend(stage).unwrap();
    let mut bytes = 0;
    for c in g
        .components()
        .iter()
        .filter(|c| c.position(layer).is_some())
    {
        for p in 0..pages {
            let t = landing.target(&loan, c.id, p).unwrap();
            loan.write(t, &row(g, c.id, layer, p)).unwrap();
        }
        bytes += c.page_layer_bytes * pages as u64;
    }
    bytes
}

#[test]
fn own_rows_land_byte_for_byte_in_every_strategy() {
    let jitter = CpuDeviceConfig {
        max_op_delay: Duration::from_micros(300),
        ..CpuDeviceConfig::default()
    };
    let r = rig(jitter, 40, 12, 1);
    let scattered: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 40).collect();
    let contiguous: Vec<u32> = (20..32).collect();
    for (slots, strategy) in [
        (&scattered, ScatterStrategy::Auto),
        (&scattered, ScatterStrategy::Runs),
        (&contiguous, ScatterStrategy::Auto),
        (&contiguous, ScatterStrategy::Kernel),
    ] {
        let comps = all(&r.g);
        let mut landing = StagedLanding::new(
            r.pool.clone(),
            r.staging.lease().unwrap(),
            slots.clone().into(),
            BatchShape::own_only(comps.clone()),
        )
        .unwrap()
        .with_strategy(strategy);
        let mut stages = landing.take_stages();
        let mut expect_h2d = 0;
        for layer in 0..r.g.num_layers() {
            let stage = &mut stages[layer as usize % 2];
            expect_h2d += fill_layer(&r.g, &landing, stage, layer, slots.len());
            assert!(matches!(landing.land(stage).unwrap(), LayerReady::Event(_)));
        }
        let moved: u64 = landing.transfers().iter().map(|t| t.host_to_device).sum();
        assert_eq!(
            moved, expect_h2d,
            "{strategy:?}: every own byte crosses once"
        );
        let stats = landing.stats();
        drop(landing);
        assert_eq!(r.staging.available(), 1, "the lease is back");
        check_pool(&r.pool, &r.g, slots, &comps);
        let runs = 1 + slots.windows(2).filter(|w| w[0] + 1 != w[1]).count();
        let kernel = match strategy {
            ScatterStrategy::Kernel => true,
            ScatterStrategy::Runs => false,
            ScatterStrategy::Auto => runs > kv_device::DIRECT_RUNS_MAX,
        };
        assert_eq!(
            stats.kernel_launches > 0,
            kernel,
            "{strategy:?}, {runs} runs"
        );
    }
}

#[test]
fn a_ring_of_stages_holds_a_group_of_layers_and_reuses_each_stage_after_its_fences() {
    // Slow copies (up to 2 ms each): a stage reopened before its copies finished would be
    // overwritten under them, and the pool would differ.
    let jitter = CpuDeviceConfig {
        max_op_delay: Duration::from_millis(2),
        ..CpuDeviceConfig::default()
    };
    let dev = CpuDevice::with_config(0, jitter).unwrap();
    let g = geometry();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 40).unwrap());
    let stage_bytes = StagingPool::half_bytes_for(&g, 12, 2);
    let staging = StagingPool::with_stages(dev.clone(), stage_bytes, 3, 1).unwrap();
    assert_eq!((staging.stages(), staging.stage_bytes()), (3, stage_bytes));
    let slots: Vec<u32> = (0..12).map(|i| (i * 7 + 3) % 40).collect();
    let comps = all(&g);
    let mut landing = StagedLanding::new(
        pool.clone(),
        staging.lease().unwrap(),
        slots.clone().into(),
        BatchShape::own_only(comps.clone()),
    )
    .unwrap();
    let mut ring: std::collections::VecDeque<_> = landing.take_stages().into();
    assert_eq!(ring.len(), 3);
    // Groups of two layers (the ring's 3 stages minus the one landing): 0-1, then 2-3.
    for group in [0u32..2, 2..4] {
        let mut held: Vec<_> = group.clone().map(|_| ring.pop_front().unwrap()).collect();
        let mut regions = Vec::new();
        for (stage, layer) in held.iter_mut().zip(group.clone()) {
            landing.open(stage, layer, soon()).unwrap();
            let mut loan = landing.lend(stage).unwrap();
            for c in g
                .components()
                .iter()
                .filter(|c| c.position(layer).is_some())
            {
                for p in 0..slots.len() {
                    let t = landing.target(&loan, c.id, p).unwrap();
                    regions.push(t);
                    loan.write(t, &row(&g, c.id, layer, p)).unwrap();
                }
            }
        }
        assert_eq!(
            kv_device::first_overlap(&regions),
            None,
            "the open stages' targets overlap"
        );
        for stage in held.iter_mut() {
            assert!(matches!(landing.land(stage).unwrap(), LayerReady::Event(_)));
        }
        ring.extend(held);
    }
    drop(landing);
    assert_eq!(staging.available(), 1, "the lease is back");
    check_pool(&pool, &g, &slots, &comps);
    // A stage index past the ring is refused by the lease.
    let lease = staging.lease().unwrap();
    assert!(lease.host_stage(2).is_ok());
    assert!(matches!(
        lease.host_stage(3),
        Err(DeviceError::InvalidStage(_))
    ));
}

/// The share path on one rank: rows written into the share area, uploaded, then scattered
/// from device staging after the upload's event.
#[test]
fn shared_rows_scatter_from_device_staging_and_are_counted() {
    let r = rig(CpuDeviceConfig::default(), 30, 6, 1);
    let slots: Vec<u32> = vec![29, 3, 17, 4, 5, 11];
    let g = &r.g;
    let k = g.component_by_name("k").unwrap().clone();
    let ix = g.component_by_name("ix").unwrap().clone();
    let v = g.component_by_name("v").unwrap().id;
    // Share area: one block per shared component carried on the layer, pages in plan order.
    let blocks = |layer: u32| -> Vec<RowBlock> {
        let mut off = 0;
        [&k, &ix]
            .into_iter()
            .filter(|c| c.position(layer).is_some())
            .map(|c| {
                let b = RowBlock {
                    component: c.id,
                    first_page: 0,
                    pages: 6,
                    offset: off,
                };
                off += 6 * c.page_layer_bytes as usize;
                b
            })
            .collect()
    };
    let share_bytes: Vec<usize> = (0..4)
        .map(|l| {
            blocks(l)
                .iter()
                .map(|b| b.pages * g.component(b.component).unwrap().page_layer_bytes as usize)
                .sum()
        })
        .collect();
    let shape = BatchShape {
        own: vec![v],
        shared: vec![k.id, ix.id],
        share_bytes: share_bytes.clone(),
    };
    let factory = StagedLandingFactory::new(r.pool.clone(), r.staging.clone());
    let mut landing = factory.begin(slots.clone().into(), shape).unwrap();
    let mut stages = landing.take_stages();
    let ShareSide::Device(share) = landing.share() else {
        panic!("a staged landing shares through device memory");
    };
    for layer in 0..4 {
        let stage = &mut stages[layer as usize % 2];
        landing.open(stage, layer, soon()).unwrap();
        let mut loan = landing.lend(stage).unwrap();
        for b in blocks(layer) {
            let len = g.component(b.component).unwrap().page_layer_bytes as usize;
            for i in 0..b.pages {
                let t = share.share_target(&loan, b.offset + i * len, len).unwrap();
                loan.write(t, &row(g, b.component, layer, b.first_page + i))
                    .unwrap();
            }
        }
        for p in 0..6 {
            let t = landing.target(&loan, v, p).unwrap();
            loan.write(t, &row(g, v, layer, p)).unwrap();
        }
        drop(loan);
        share.upload(stage, 0..share_bytes[layer as usize]).unwrap();
        let after = share
            .device_stage(stage)
            .unwrap()
            .after()
            .expect("an upload event");
        share.scatter(stage, &blocks(layer), &after).unwrap();
        landing.land(stage).unwrap();
    }
    let t = landing.transfers();
    drop(landing);
    check_pool(&r.pool, g, &slots, &[k.id, ix.id, v]);
    let v_bytes = g.component(v).unwrap().page_layer_bytes * 6;
    for (l, t) in t.iter().enumerate() {
        assert_eq!(
            t.host_to_device,
            share_bytes[l] as u64 + v_bytes,
            "layer {l}"
        );
        assert!(
            t.device_to_device >= share_bytes[l] as u64,
            "layer {l}: the scatter"
        );
        assert_eq!(t.device_to_host, 0);
    }
    // Misuse: a block outside the share area, a stage of another landing.
    let mut other = factory
        .begin(slots.clone().into(), BatchShape::own_only(vec![v]))
        .unwrap();
    let mut foreign = other.take_stages();
    let mut landing = factory.begin(slots.into(), BatchShape::own_only(vec![v]));
    assert!(landing.is_err(), "one lease: the second batch is refused");
    assert!(matches!(
        other.open(&mut foreign[0], 9, soon()),
        Err(DeviceError::InvalidStage(_))
    ));
    landing = Ok(other);
    let l = landing.unwrap();
    let mut mine = stages.pop().unwrap();
    assert!(matches!(
        l.open(&mut mine, 0, soon()),
        Err(DeviceError::InvalidStage(_))
    ));
}

#[test]
fn a_stage_is_never_reused_before_its_fences_complete() {
    let r = rig(CpuDeviceConfig::default(), 10, 4, 1);
    let slots: Vec<u32> = vec![0, 1, 2, 3];
    let k = r.g.component_by_name("k").unwrap().id;
    let share: Vec<usize> = (0..4).map(|_| 4 * 10 * 4).collect();
    let shape = BatchShape {
        own: vec![],
        shared: vec![k],
        share_bytes: share,
    };
    let slow = CpuDevice::new(7).unwrap();
    slow.stall_for(Duration::from_millis(2000));
    let mut landing = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        slots.into(),
        shape,
    )
    .unwrap()
    .with_drain_limit(Duration::from_millis(50));
    let mut stages = landing.take_stages();
    let stage = &mut stages[0];
    landing.open(stage, 0, soon()).unwrap();
    landing.upload(stage, 0..160).unwrap();
    {
        // A collective whose completion is late: its event fences the stage.
        let mut ds = landing.device_stage(stage).unwrap();
        ds.fence(slow.load_stream().record().unwrap());
    }
    landing.land(stage).unwrap();
    let t0 = Instant::now();
    let reopened = landing.open(
        stage,
        2,
        kv_loader::deadline_after(Duration::from_millis(100)),
    );
    assert!(
        matches!(reopened, Err(DeviceError::Timeout { .. })),
        "{reopened:?}"
    );
    // Bounded by the 100 ms deadline (slack for a loaded CI host), not by the slow stream.
    assert!(
        t0.elapsed() < Duration::from_millis(1500),
        "{:?}",
        t0.elapsed()
    );
    // Nothing can be written into it: no layer is open, and it stays poisoned.
    assert!(landing.lend(stage).is_err());
    assert!(matches!(
        landing.open(stage, 2, soon()),
        Err(DeviceError::Poisoned(_))
    ));
    drop(landing);
    assert_eq!(
        r.staging.quarantined(),
        1,
        "poisoned: quarantined, not freed"
    );
    assert!(r.staging.lease().is_err());
    // Back once the late work completed (polled, bounded).
    let limit = Instant::now() + Duration::from_secs(10);
    while r.staging.available() != 1 {
        assert!(Instant::now() < limit, "never back after the late work");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(r
        .dev
        .load_stream()
        .record()
        .unwrap()
        .wait_until(soon())
        .unwrap());
}

#[test]
fn saves_gather_what_loads_landed() {
    let r = rig(CpuDeviceConfig::default(), 16, 5, 1);
    let slots: Vec<u32> = vec![9, 2, 15, 3, 4];
    let comps = all(&r.g);
    for (c, l, p) in comps.iter().flat_map(|&c| {
        let layers = r.g.component(c).unwrap().layers.clone();
        layers
            .into_iter()
            .flat_map(move |l| (0..5).map(move |p| (c, l, p)))
    }) {
        // SAFETY: nothing else uses the pool yet.
        unsafe { r.pool.write_slot(c, l, slots[p], &row(&r.g, c, l, p)) }.unwrap();
    }
    for strategy in [ScatterStrategy::Runs, ScatterStrategy::Kernel] {
        let f =
            StagedLandingFactory::new(r.pool.clone(), r.staging.clone()).with_strategy(strategy);
        let mut save = f.begin_save(slots.clone().into()).unwrap();
        for &c in &comps {
            let len = r.g.component(c).unwrap().page_layer_bytes as usize;
            for &l in &r.g.component(c).unwrap().layers {
                let rows = save.gather(c, l).unwrap();
                assert_eq!(rows.len(), 5 * len);
                for (p, got) in rows.chunks(len).enumerate() {
                    assert_eq!(got, &row(&r.g, c, l, p)[..], "{strategy:?}");
                }
            }
        }
    }
    assert_eq!(r.staging.available(), 1);
    assert_eq!(r.dev.ordinal(), 0);
    // SAFETY: the saves have ended: nothing else uses the pool.
    unsafe { r.pool.clear() }.unwrap();
    let c = comps[0];
    let mut got = vec![1u8; r.g.component(c).unwrap().page_layer_bytes as usize];
    // SAFETY: as above.
    unsafe { r.pool.read_slot(c, 0, slots[0], &mut got) }.unwrap();
    assert!(got.iter().all(|&b| b == 0), "cleared");
}

/// A landing of `k` alone, shared (its 4 pages' rows, 160 bytes per layer), on slots 0 to 3
/// of a rig with one staging lease.
fn k_shared_on_4_slots() -> (Rig, StagedLanding) {
    let r = rig(CpuDeviceConfig::default(), 10, 4, 1);
    let k = r.g.component_by_name("k").unwrap().id;
    let shape = BatchShape {
        own: vec![],
        shared: vec![k],
        share_bytes: vec![4 * 10 * 4; 4],
    };
    let landing = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        vec![0, 1, 2, 3].into(),
        shape,
    )
    .unwrap();
    (r, landing)
}

#[test]
fn a_stage_is_not_lent_while_its_upload_may_still_read_it() {
    let (r, mut landing) = k_shared_on_4_slots();
    let mut stages = landing.take_stages();
    let stage = &mut stages[0];
    landing.open(stage, 0, soon()).unwrap();
    drop(landing.lend(stage).unwrap());
    // The share area's upload reads the pinned stage, on a device stalled until resumed
    // below; the layer stays open (the collective and the scatter come next).
    r.dev.stall_for(Duration::from_secs(30));
    landing.upload(stage, 0..160).unwrap();
    // A store must not write the stage while the upload may still read it.
    let again = landing.lend(stage);
    assert!(
        matches!(again, Err(DeviceError::InvalidStage(_))),
        "{:?}",
        again.map(|_| ())
    );
    r.dev.resume();
    // Once the upload has run, the stage may be lent again.
    let end = soon();
    while landing.lend(stage).is_err() {
        assert!(Instant::now() < end, "the upload never completed");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A stage lent again after its upload holds what the new loan wrote, not what was uploaded:
/// the device area is shared (and scattered) only after the next upload. Before, the old
/// upload was shared and scattered, landing the first loan's bytes while the pinned stage
/// (and its checksums) held the second's.
#[test]
fn a_stage_lent_again_after_its_upload_is_shared_only_after_the_next_upload() {
    let (r, mut landing) = k_shared_on_4_slots();
    let share_len = 4 * 10 * 4;
    let mut stages = landing.take_stages();
    let stage = &mut stages[0];
    landing.open(stage, 0, soon()).unwrap();
    let write = |landing: &StagedLanding, stage: &mut kv_device::LayerStage, byte: u8| {
        let end = soon();
        let mut loan = loop {
            match landing.lend(stage) {
                Ok(l) => break l,
                Err(_) if Instant::now() < end => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("never lent again: {e}"),
            }
        };
        let at = landing.share_target(&loan, 0, share_len).unwrap();
        loan.write(at, &vec![byte; share_len]).unwrap();
    };
    write(&landing, stage, 0xA1);
    landing.upload(stage, 0..share_len).unwrap();
    write(&landing, stage, 0xB2);
    assert!(matches!(
        landing.device_stage(stage).map(|_| ()),
        Err(DeviceError::InvalidStage(_))
    ));
    let ev = r.dev.new_stream().unwrap().record().unwrap();
    assert!(matches!(
        landing.scatter(stage, &[], &ev),
        Err(DeviceError::InvalidStage(_))
    ));
    // Uploaded again: shared as before.
    landing.upload(stage, 0..share_len).unwrap();
    assert!(landing.device_stage(stage).is_ok());
}

/// Waits (bounded) until the staging pool has `n` buffers free again.
fn await_available(staging: &StagingPool, n: usize) -> bool {
    let end = soon();
    while Instant::now() < end {
        if staging.available() == n {
            return true;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[test]
fn a_save_gather_that_fails_half_queued_keeps_its_staging_until_the_queued_part_ran() {
    let r = rig(CpuDeviceConfig::default(), 16, 5, 2);
    let c = all(&r.g)[0];
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_strategy(ScatterStrategy::Runs);
    // Two runs of slots: the first run's copy is queued (on a stalled device), the second's
    // enqueue fails.
    let mut save = f.begin_save(vec![1, 2, 9, 10, 11].into()).unwrap();
    r.dev.stall_for(Duration::from_secs(30));
    r.dev.fail_enqueue(CpuOp::ToHost, 1);
    let got = save.gather(c, 0).map(|rows| rows.len());
    assert!(matches!(got, Err(DeviceError::Driver(_))), "{got:?}");
    drop(save);
    // The queued copy may still write stage 0: the staging is not leased again yet, and the
    // copy may still read slot 9: no landing writes it yet.
    assert_eq!((r.staging.available(), r.staging.quarantined()), (1, 1));
    assert!(busy(own_landing(&r, &[9]), 9));
    r.dev.resume();
    assert!(
        await_available(&r.staging, 2),
        "fenced: free again once the copy ran"
    );
    assert!(own_landing(&r, &[9]).is_ok(), "released with the staging");
}

#[test]
fn a_save_gather_queued_but_not_fenced_keeps_its_staging_for_good() {
    // One staging buffer per strategy.
    let r = rig(CpuDeviceConfig::default(), 16, 5, 2);
    let c = all(&r.g)[0];
    for (i, strategy) in [ScatterStrategy::Runs, ScatterStrategy::Kernel]
        .into_iter()
        .enumerate()
    {
        let f =
            StagedLandingFactory::new(r.pool.clone(), r.staging.clone()).with_strategy(strategy);
        let mut save = f.begin_save(vec![1, 2, 9, 10, 11].into()).unwrap();
        // The gather is queued on a stalled device; the event that would fence it cannot be
        // recorded.
        r.dev.stall_for(Duration::from_millis(200));
        r.dev.fail_enqueue(CpuOp::Record, 0);
        let got = save.gather(c, 0).map(|rows| rows.len());
        assert!(
            matches!(got, Err(DeviceError::Driver(_))),
            "{strategy:?}: {got:?}"
        );
        drop(save);
        r.dev.resume();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(
            (r.staging.available(), r.staging.quarantined()),
            (1 - i, i + 1),
            "{strategy:?}: never fenced, kept for good"
        );
    }
}

#[test]
fn a_slot_table_copy_queued_but_not_fenced_keeps_its_staging_for_good() {
    let r = rig(CpuDeviceConfig::default(), 10, 2, 1);
    // The table's copy through stage 0 is queued but does not run yet (a stalled device),
    // and the event that would fence it cannot be recorded.
    r.dev.stall_for(Duration::from_millis(300));
    r.dev.fail_enqueue(CpuOp::Record, 0);
    let made = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        vec![3, 5].into(),
        BatchShape::own_only(all(&r.g)),
    );
    assert!(
        matches!(made, Err(DeviceError::Driver(_))),
        "{:?}",
        made.err()
    );
    // The staging is not leased again: the copy may still read its stage 0 (and write the
    // table, which is kept with it).
    assert_eq!((r.staging.available(), r.staging.quarantined()), (0, 1));
    assert!(r.staging.lease().is_err());
    // The device runs the copy later; nothing it touches was freed or handed out.
    r.dev.resume();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(r.staging.quarantined(), 1, "never fenced: kept for good");
}

#[test]
fn shapes_that_do_not_fit_or_do_not_match_are_refused() {
    let r = rig(CpuDeviceConfig::default(), 10, 2, 2);
    let g = &r.g;
    let k = g.component_by_name("k").unwrap().id;
    let v = g.component_by_name("v").unwrap().id;
    let lease = || r.staging.lease().unwrap();
    let too_many: Vec<u32> = (0..8).collect();
    assert!(matches!(
        StagedLanding::new(
            r.pool.clone(),
            lease(),
            too_many.into(),
            BatchShape::own_only(all(g))
        ),
        Err(DeviceError::StageTooSmall { layer: 0, .. })
    ));
    let sharded_shared = BatchShape {
        own: vec![],
        shared: vec![v],
        share_bytes: vec![0; 4],
    };
    assert!(StagedLanding::new(r.pool.clone(), lease(), vec![0].into(), sharded_shared).is_err());
    let short = BatchShape {
        own: vec![],
        shared: vec![k],
        share_bytes: vec![0; 3],
    };
    assert!(StagedLanding::new(r.pool.clone(), lease(), vec![0].into(), short).is_err());
    assert!(StagedLanding::new(
        r.pool.clone(),
        lease(),
        vec![10].into(),
        BatchShape::own_only(all(g))
    )
    .is_err());
}

#[test]
fn store_regions_keep_their_memory_owner_alive() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let staging = StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, 8, 1), 2).unwrap();
    let pool = Arc::new(DeviceKvPool::new(dev, g, 8).unwrap());
    let factory = StagedLandingFactory::new(pool, staging.clone());
    let regions = factory.store_regions();
    let ranges: Vec<(usize, usize)> = regions.iter().map(|r| (r.addr(), r.len())).collect();
    assert_eq!(ranges, staging.host_regions());
    let weak = Arc::downgrade(&staging);
    drop((factory, staging));
    assert!(
        weak.upgrade().is_some(),
        "the regions alone keep the staging buffers allocated"
    );
    drop(regions);
    assert!(weak.upgrade().is_none(), "the last region let the pool go");
}

#[test]
fn a_lent_stage_is_the_loans_alone_and_its_staging_waits_for_the_loan() {
    let r = rig(CpuDeviceConfig::default(), 10, 4, 1);
    let comps = all(&r.g);
    let slots: Vec<u32> = vec![3, 1, 2, 0];
    let landing = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        slots.into(),
        BatchShape::own_only(comps.clone()),
    )
    .unwrap();
    let mut landing = landing;
    let mut stages = landing.take_stages();
    let stage = &mut stages[0];
    landing.open(stage, 0, soon()).unwrap();
    let mut loan = landing.lend(stage).unwrap();
    let t = landing.target(&loan, comps[0], 1).unwrap();
    loan.write(t, &row(&r.g, comps[0], 0, 1)).unwrap();
    // While the loan is out (a store call that may still write the stage), nothing else
    // touches the stage: typed refusals, no data race.
    assert!(matches!(landing.lend(stage), Err(DeviceError::Lent(_))));
    assert!(matches!(
        landing.target_bytes(stage, comps[0], 1),
        Err(DeviceError::Lent(_))
    ));
    assert!(matches!(landing.land(stage), Err(DeviceError::Lent(_))));
    assert!(matches!(
        landing.open(stage, 1, soon()),
        Err(DeviceError::Lent(_))
    ));
    // The batch ends while the loan is out: its staging is quarantined, not leased again
    // while the loan is out, and stays allocated (the loan keeps the staging pool) for
    // whoever still writes it.
    drop(landing);
    assert_eq!(r.staging.available(), 0);
    let held = r.staging.quarantined_work();
    assert!(
        held.len() == 1
            && held[0].starts_with("landing ")
            && held[0].ends_with(" of pool slots [3, 1, 2, 0]"),
        "the quarantine names the batch and its slots: {held:?}"
    );
    let staging = Arc::downgrade(&r.staging);
    drop(r);
    assert!(staging.upgrade().is_some(), "the loan keeps the staging");
    loan.write(t, &row(&geometry(), comps[0], 0, 2)).unwrap();
    let pool = staging.upgrade().unwrap();
    assert_eq!(pool.available(), 0, "lent: still quarantined");
    // The late read returns (its loan drops): the buffer can be leased again, not lost.
    drop(loan);
    assert_eq!((pool.available(), pool.quarantined()), (1, 0));
    drop(pool);
    assert!(staging.upgrade().is_none());
}

/// One shared component (`k`, every layer) over `slots`, its whole share area on each layer.
fn k_shared(r: &Rig, pages: usize) -> (ComponentId, u64, BatchShape) {
    let k = r.g.component_by_name("k").unwrap();
    let row = k.page_layer_bytes;
    let shape = BatchShape {
        own: vec![],
        shared: vec![k.id],
        share_bytes: vec![pages * row as usize; 4],
    };
    (k.id, row, shape)
}

/// A row block whose offset and length wrap past `u64::MAX` is refused: its end, summed
/// unchecked, panicked in a debug build and, wrapped in a release one, passed the bound and
/// pointed the copy before the staging buffer.
#[test]
fn a_row_block_whose_end_wraps_is_refused() {
    let r = rig(CpuDeviceConfig::default(), 10, 4, 1);
    let (k, row, shape) = k_shared(&r, 1);
    let mut landing = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        vec![0].into(),
        shape,
    )
    .unwrap();
    let mut stages = landing.take_stages();
    let stage = &mut stages[0];
    landing.open(stage, 0, soon()).unwrap();
    // Uploaded, so that the scatter meets the bound's check, not the missing upload's.
    landing.upload(stage, 0..row as usize).unwrap();
    let after = r.dev.load_stream().record().unwrap();
    let block = RowBlock {
        component: k,
        first_page: 0,
        pages: 1,
        offset: usize::MAX - row as usize + 1,
    };
    let got = landing.scatter(stage, &[block], &after);
    assert!(
        matches!(&got, Err(DeviceError::InvalidStage(m)) if m.contains("outside the share area")),
        "{got:?}"
    );
}

/// A slot named twice is refused when the landing is made: the row-copy kernel writes each
/// destination row from its own thread block, so two blocks would write that slot at once.
#[test]
fn a_slot_named_twice_in_a_staged_batch_is_refused() {
    let r = rig(CpuDeviceConfig::default(), 16, 4, 1);
    let got = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        vec![3, 5, 3, 7].into(),
        BatchShape::own_only(all(&r.g)),
    );
    assert!(
        matches!(got, Err(DeviceError::SlotBusy { slot: 3, .. })),
        "{:?}",
        got.err()
    );
}

/// A save that waits on an engine event that does not complete fails alone: later saves do
/// not queue behind it (the factory's one save stream failed for good, and every later save
/// on it failed too).
#[test]
fn a_save_held_by_an_engine_event_does_not_fail_the_later_saves() {
    let r = rig(
        CpuDeviceConfig {
            wait_limit: Duration::from_millis(100),
            ..CpuDeviceConfig::default()
        },
        16,
        4,
        2,
    );
    let slots: Vec<u32> = vec![1, 4, 9, 2];
    let engine = CpuDevice::new(3).unwrap();
    engine.stall_for(Duration::from_secs(30));
    let late = engine.load_stream().record().unwrap();
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone());
    let k = r.g.component_by_name("k").unwrap().id;
    {
        let mut held = f.begin_save_after(slots.clone().into(), &late).unwrap();
        assert!(held.gather(k, 0).is_err(), "its engine event never came");
    }
    // The stuck gather's staging waits in quarantine under a name that says which slots it
    // keeps claimed (a landing into them is refused SlotBusy until it has run).
    assert_eq!(
        r.staging.quarantined_work(),
        vec!["save gather of pool slots [1, 4, 9, 2]".to_string()]
    );
    engine.resume();
    let mut next = f.begin_save(slots.into()).unwrap();
    assert!(next.gather(k, 0).is_ok(), "a later save gathers");
}

/// A staging pool, a pool and one landing's parts over one CPU device, for the refusal tests
/// below.
fn small_landing(shape: BatchShape) -> Result<StagedLanding, DeviceError> {
    let dev = CpuDevice::with_config(0, CpuDeviceConfig::default()).unwrap();
    let g = geometry();
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging =
        StagingPool::with_stages(dev, StagingPool::half_bytes_for(&g, 2, 2), 2, 1).unwrap();
    StagedLanding::new(pool, staging.lease().unwrap(), vec![0u32, 1].into(), shape)
}

/// A shape whose layer bytes overflow is refused, not wrapped to a size that passes the
/// stage's bound (then a share row could be placed anywhere in memory from safe code).
#[test]
fn a_shape_whose_layer_bytes_overflow_is_refused() {
    let g = geometry();
    let k = g.component_by_name("k").unwrap().id;
    let v = g.component_by_name("v").unwrap().id;
    let shape = BatchShape {
        own: vec![v],
        shared: vec![k],
        share_bytes: vec![usize::MAX - 3; 4],
    };
    assert!(small_landing(shape).is_err());
}

/// A layer is one stage's at a time, until that stage is opened again after landing it: a
/// second stage opening it is refused, so the layer's ready event (its stage's land) covers
/// every copy into its slots.
#[test]
fn a_layer_open_in_one_stage_is_refused_to_another() {
    let g = geometry();
    let mut landing = small_landing(BatchShape::own_only(all(&g))).unwrap();
    let mut stages = landing.take_stages();
    let (a, b) = stages.split_at_mut(1);
    landing.open(&mut a[0], 1, soon()).unwrap();
    assert!(landing.open(&mut b[0], 1, soon()).is_err());
    // Landed in the first, whose copies may still run: still the first's.
    landing.land(&mut a[0]).unwrap();
    assert!(landing.open(&mut b[0], 1, soon()).is_err());
    // The first opened again (after waiting for those copies): the layer is free.
    landing.open(&mut a[0], 2, soon()).unwrap();
    landing.open(&mut b[0], 1, soon()).unwrap();
}

/// A land refused (the landing finished) leaves its stage's layer as it was: a second try
/// gives the same reason. Before, the first cleared the layer, and the second said "no layer
/// is open".
#[test]
fn a_refused_land_keeps_its_stages_layer() {
    let g = geometry();
    let mut landing = small_landing(BatchShape::own_only(all(&g))).unwrap();
    let mut stages = landing.take_stages();
    landing.open(&mut stages[0], 1, soon()).unwrap();
    landing.finish();
    for attempt in 0..2 {
        let e = landing.land(&mut stages[0]).unwrap_err();
        assert!(
            e.to_string().contains("after the landing finished"),
            "attempt {attempt}: {e}"
        );
    }
}

/// A landing of two plan pages on `dev` whose one shared component is `k` (its share area of
/// `len` bytes per layer: two rows), with two stages; `k` and `len`.
fn shared_k_landing(dev: &Arc<CpuDevice>) -> (StagedLanding, kv_geometry::ComponentLayout, usize) {
    let g = geometry();
    let k = g.component_by_name("k").unwrap().clone();
    let len = 2 * k.page_layer_bytes as usize;
    let shape = BatchShape {
        own: vec![],
        shared: vec![k.id],
        share_bytes: vec![len; 4],
    };
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging =
        StagingPool::with_stages(dev.clone(), StagingPool::half_bytes_for(&g, 2, 2), 2, 1).unwrap();
    let landing =
        StagedLanding::new(pool, staging.lease().unwrap(), vec![0u32, 1].into(), shape).unwrap();
    (landing, k, len)
}

/// Device staging holds a layer's share area only after that layer's upload: sharing it
/// before the upload, or after an upload that failed, is refused (a collective would share
/// what an earlier layer left there, and peers would publish it as this layer).
#[test]
fn a_stage_is_shared_only_after_its_layers_upload() {
    let dev = CpuDevice::with_config(0, CpuDeviceConfig::default()).unwrap();
    let (mut landing, _, len) = shared_k_landing(&dev);
    let mut stages = landing.take_stages();
    let (a, b) = stages.split_at_mut(1);
    landing.open(&mut a[0], 0, soon()).unwrap();
    let before = landing.device_stage(&mut a[0]).map(drop);
    assert!(
        matches!(before, Err(DeviceError::InvalidStage(_))),
        "{before:?}"
    );
    landing.upload(&mut a[0], 0..len).unwrap();
    landing.device_stage(&mut a[0]).unwrap();
    // A second device stage of the same upload is refused: its collective would start after
    // the upload alone, not after the first one's collective (and scatter) on the area.
    let twice = landing.device_stage(&mut a[0]).map(drop);
    assert!(
        matches!(&twice, Err(DeviceError::InvalidStage(m)) if m.contains("twice")),
        "{twice:?}"
    );
    landing.upload(&mut a[0], 0..0).unwrap();
    landing.device_stage(&mut a[0]).unwrap();
    // The next layer's upload fails to enqueue: its stage is not shared.
    landing.open(&mut b[0], 1, soon()).unwrap();
    dev.fail_enqueue(CpuOp::ToDevice, 0);
    assert!(landing.upload(&mut b[0], 0..len).is_err());
    assert!(landing.device_stage(&mut b[0]).map(drop).is_err());
}

/// A scatter of a layer whose stage has no upload (none made, or it failed) is refused: the
/// share area still holds an earlier layer's rows (here layer 0's, of this batch; another
/// batch's where the lease is reused), and before, they landed in this layer's slots.
#[test]
fn a_stage_is_scattered_only_after_its_layers_upload() {
    let dev = CpuDevice::with_config(0, CpuDeviceConfig::default()).unwrap();
    let (mut landing, k, len) = shared_k_landing(&dev);
    let mut stages = landing.take_stages();
    let block = RowBlock {
        component: k.id,
        first_page: 0,
        pages: 2,
        offset: 0,
    };
    landing.open(&mut stages[0], 0, soon()).unwrap();
    landing.upload(&mut stages[0], 0..len).unwrap();
    let done = dev.load_stream().record().unwrap();
    landing.scatter(&mut stages[0], &[block], &done).unwrap();
    landing.land(&mut stages[0]).unwrap();
    for fails in [false, true] {
        landing.open(&mut stages[0], 2, soon()).unwrap();
        if fails {
            dev.fail_enqueue(CpuOp::ToDevice, 0);
            assert!(landing.upload(&mut stages[0], 0..len).is_err());
        }
        let done = dev.load_stream().record().unwrap();
        let r = landing.scatter(&mut stages[0], &[block], &done);
        assert!(
            matches!(r, Err(DeviceError::InvalidStage(_))),
            "upload failed: {fails}: {r:?}"
        );
    }
}

/// A collective on `stage`'s device area as a caller runs one: on `comm`, after the stage's
/// upload and behind `busy`'s queued work (on `comm` alone: the load stream is not held), a
/// device-side write of the area, fenced through the `DeviceStage`. Returns the upload's
/// event (what the collective waited for).
fn slow_collective(
    landing: &StagedLanding,
    stage: &mut kv_device::LayerStage,
    comm: &dyn kv_device::Stream,
    busy: &kv_device::DeviceMemory,
    len: usize,
) -> kv_device::SharedEvent {
    let mut ds = landing.device_stage(stage).unwrap();
    let region = ds.region();
    let upload = ds.after().unwrap();
    comm.wait(&upload).unwrap();
    // Tens of milliseconds of copies on `comm`: the collective comes after them.
    let half = (busy.len() / 2) as u64;
    for _ in 0..40 {
        let t = kv_device::Transfer::OnDevice {
            dst: busy.addr(),
            src: busy.addr() + half,
            len: half as usize,
        };
        // SAFETY: both halves lie in `busy`, which the caller keeps until the streams are
        // done (the landing's next `open` drains the fences, the last recorded after these).
        unsafe { comm.transfer(t) }.unwrap();
    }
    let t = kv_device::Transfer::OnDevice {
        dst: region.addr,
        src: region.addr + (len / 2) as u64,
        len: len / 2,
    };
    // SAFETY: both halves lie in the stage's share area (the region, `len` bytes), which the
    // landing keeps allocated until the stage's fences complete; the fence below covers it.
    unsafe { comm.transfer(t) }.unwrap();
    ds.fence(comm.record().unwrap());
    upload
}

/// An upload or a scatter queued after a collective on the stage's device area (fenced
/// through the `DeviceStage`) runs after it, whatever event the caller names: before, the
/// second upload was queued with no wait on the collective's fence, and the load stream's copy
/// ran while the collective (a slow device-side write here) still wrote the area.
#[test]
fn uploads_and_scatters_run_after_the_stages_collective() {
    let config = CpuDeviceConfig {
        trace: true,
        ..CpuDeviceConfig::default()
    };
    let dev = CpuDevice::with_config(0, config).unwrap();
    let (mut landing, k, len) = shared_k_landing(&dev);
    let mut stages = landing.take_stages();
    landing.open(&mut stages[0], 0, soon()).unwrap();
    landing.upload(&mut stages[0], 0..len).unwrap();
    let comm = dev.new_stream().unwrap();
    let busy = dev.alloc(32 << 20, "test").unwrap();
    slow_collective(&landing, &mut stages[0], comm.as_ref(), &busy, len);
    // Named nothing of the collective: still after it.
    landing.upload(&mut stages[0], 0..len).unwrap();
    let upload_event = slow_collective(&landing, &mut stages[0], comm.as_ref(), &busy, len);
    let block = RowBlock {
        component: k.id,
        first_page: 0,
        pages: 2,
        offset: 0,
    };
    // Named the upload's event, not the collective's: still after the collective.
    landing
        .scatter(&mut stages[0], &[block], &upload_event)
        .unwrap();
    landing.open(&mut stages[0], 2, soon()).unwrap();
    let trace = dev.trace();
    // The collectives: the area-sized writes on the comm stream.
    let collectives: Vec<_> = trace
        .iter()
        .filter(|o| o.stream != 0 && o.op == CpuOp::OnDevice && o.bytes == (len / 2) as u64)
        .collect();
    assert_eq!(collectives.len(), 2, "{trace:?}");
    let uploads: Vec<_> = trace
        .iter()
        .filter(|o| o.stream == 0 && o.op == CpuOp::ToDevice && o.bytes == len as u64)
        .collect();
    assert_eq!(uploads.len(), 2, "{trace:?}");
    assert!(
        uploads[1].started >= collectives[0].finished,
        "the second upload ran before the first collective was done: {trace:?}"
    );
    let scatters: Vec<_> = trace
        .iter()
        .filter(|o| o.stream == 0 && matches!(o.op, CpuOp::Rows | CpuOp::OnDevice))
        .collect();
    assert!(!scatters.is_empty(), "{trace:?}");
    assert!(
        scatters
            .iter()
            .all(|o| o.started >= collectives[1].finished),
        "the scatter ran before the second collective was done: {trace:?}"
    );
}

/// A stage whose device work failed (a collective aborted) takes no more work: nothing lands
/// in the slots behind a collective whose end is unknown.
#[test]
fn a_poisoned_stage_takes_no_more_device_work() {
    let g = geometry();
    let mut landing = small_landing(BatchShape::own_only(all(&g))).unwrap();
    let mut stages = landing.take_stages();
    landing.open(&mut stages[0], 0, soon()).unwrap();
    landing.poison(&mut stages[0]);
    assert!(matches!(
        landing.land(&mut stages[0]),
        Err(DeviceError::Poisoned(_))
    ));
}

/// Staging of another device than the pool's is refused for a save too (its gather would
/// copy one device's slots into another's staging), as for a load.
#[test]
fn staging_of_another_device_is_refused_for_loads_and_saves() {
    let g = geometry();
    let pool_dev = CpuDevice::with_config(1, CpuDeviceConfig::default()).unwrap();
    let other = CpuDevice::with_config(0, CpuDeviceConfig::default()).unwrap();
    let pool = Arc::new(DeviceKvPool::new(pool_dev, g.clone(), 8).unwrap());
    let staging =
        StagingPool::with_stages(other, StagingPool::half_bytes_for(&g, 2, 2), 2, 1).unwrap();
    let f = StagedLandingFactory::new(pool, staging);
    assert!(matches!(
        f.begin_save(vec![0u32, 1].into()),
        Err(DeviceError::InvalidStage(_))
    ));
}

fn busy(r: Result<impl Sized, DeviceError>, slot: u32) -> bool {
    matches!(r, Err(DeviceError::SlotBusy { slot: s, .. }) if s == slot)
}

fn own_landing(r: &Rig, slots: &[u32]) -> Result<StagedLanding, DeviceError> {
    StagedLanding::new(
        r.pool.clone(),
        r.staging.lease()?,
        slots.into(),
        BatchShape::own_only(all(&r.g)),
    )
}

/// Loads and saves share the staging pool. Before, a batch that started while a save's gather
/// held the only buffer failed at once (`Alloc`, its request recomputed); it now waits for the
/// buffer, up to the factory's lease wait.
#[test]
fn a_landing_waits_for_a_save_to_give_the_staging_back() {
    let r = rig(CpuDeviceConfig::default(), 16, 5, 1);
    // A wait far past the save's hold, for a loaded machine's late wake-ups.
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_lease_wait(Duration::from_secs(20));
    let shape = || BatchShape::own_only(all(&r.g));
    let save = f.begin_save(vec![1, 2].into()).unwrap();
    let quick = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_lease_wait(Duration::ZERO);
    let t0 = Instant::now();
    let refused = quick.begin(vec![5, 6].into(), shape()).map(|_| ());
    assert!(
        matches!(refused, Err(DeviceError::Alloc { .. })),
        "{refused:?}"
    );
    assert!(t0.elapsed() < Duration::from_millis(500), "no wait asked");
    let hold = Duration::from_millis(200);
    // Taken before the spawn: the giver's sleep starts no earlier.
    let t0 = Instant::now();
    let giver = std::thread::spawn(move || {
        std::thread::sleep(hold);
        drop(save);
    });
    let landing = f.begin(vec![5, 6].into(), shape());
    let waited = t0.elapsed();
    giver.join().unwrap();
    assert!(landing.is_ok(), "{:?}", landing.err());
    assert!(
        waited >= hold,
        "it waited {waited:?}: the save held the buffer"
    );
    // Held past the wait: refused with the same error as before, after the wait.
    let short = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_lease_wait(Duration::from_millis(50));
    let t0 = Instant::now();
    let refused = short.begin_save(vec![9].into()).map(|_| ());
    assert!(
        matches!(refused, Err(DeviceError::Alloc { .. })),
        "{refused:?}"
    );
    assert!(t0.elapsed() >= Duration::from_millis(50));
}

/// A device pool's slots are claimed as a host pool's are: a staged landing writes its slots
/// alone, and a save's gather (on its own stream, which orders itself only after the load
/// stream's work so far) never reads a slot a landing may still write.
#[test]
fn a_staged_landing_and_a_save_gather_never_touch_one_slot_at_once() {
    let r = rig(CpuDeviceConfig::default(), 16, 4, 3);
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone());
    let landing = own_landing(&r, &[1, 2, 3]).unwrap();
    assert!(busy(f.begin_save(vec![5, 3].into()).map(|_| ()), 3));
    assert!(busy(own_landing(&r, &[6, 2]), 2), "another landing");
    // The refusals kept nothing: slots 5 and 6 are free.
    let save = f.begin_save(vec![5, 6].into()).unwrap();
    assert!(busy(own_landing(&r, &[6]), 6), "a save reads it");
    drop(landing);
    let mut again = f.begin_save(vec![3].into()).unwrap();
    let k = r.g.component_by_name("k").unwrap().id;
    assert!(again.gather(k, 0).is_ok());
    drop((save, again));
    assert!(own_landing(&r, &[2, 3, 5, 6]).is_ok(), "all free again");
}

/// A finished landing lets its slots go at once, with its copies still queued (a stalled
/// device): they are on the load stream, and a later save's gather is ordered after them
/// there, so it reads what landed; a later landing's copies queue behind them too. A landing
/// lands nothing once finished.
#[test]
fn a_finished_landing_lets_its_slots_go_and_later_work_orders_after_its_copies() {
    let r = rig(CpuDeviceConfig::default(), 16, 4, 2);
    let slots: Vec<u32> = vec![9, 2, 15, 3];
    let mut landing = own_landing(&r, &slots).unwrap();
    let mut stages = landing.take_stages();
    let last = r.g.num_layers() - 1;
    for layer in 0..=last {
        let stage = &mut stages[layer as usize % 2];
        fill_layer(&r.g, &landing, stage, layer, slots.len());
        if layer + 1 == last {
            // This layer's copies queue behind a stalled device.
            r.dev.stall_for(Duration::from_millis(400));
        }
        if layer < last {
            landing.land(stage).unwrap();
        }
    }
    landing.finish();
    let open = &mut stages[last as usize % 2];
    let after = r.dev.load_stream().record().unwrap();
    let scattered = landing.scatter(open, &[], &after);
    assert!(
        matches!(scattered, Err(DeviceError::InvalidStage(m)) if m.contains("finished")),
        "nothing is scattered once finished: {scattered:?}"
    );
    let got = landing.land(open);
    assert!(
        matches!(got, Err(DeviceError::InvalidStage(m)) if m.contains("finished")),
        "nothing lands once finished"
    );
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone());
    let mut save = f.begin_save(slots.clone().into()).unwrap();
    for c in r.g.components() {
        let len = c.page_layer_bytes as usize;
        for &l in c.layers.iter().filter(|&&l| l < last) {
            let rows = save.gather(c.id, l).unwrap();
            for (p, got) in rows.chunks(len).enumerate() {
                assert_eq!(
                    got,
                    &row(&r.g, c.id, l, p)[..],
                    "{:?} layer {l} page {p}",
                    c.id
                );
            }
        }
    }
    drop(save);
    assert!(own_landing(&r, &slots).is_ok(), "free for the next batch");
}

/// Paths a device pool does not offer answer `Unsupported`, which a caller must not take for a
/// machine without the backend: before, they answered `Unavailable` (`is_unavailable`), and a
/// caller following its docs would fall back to another backend. A staging pool asked for
/// more buffers than the address space holds fails to allocate (it aborted on the capacity).
#[test]
fn a_path_a_device_pool_does_not_offer_is_unsupported_not_unavailable() {
    let r = rig(CpuDeviceConfig::default(), 8, 2, 1);
    let pool: Arc<dyn kv_device::KvPool> = r.pool.clone();
    let shape = BatchShape::own_only(vec![r.g.components()[0].id]);
    let direct = kv_device::DirectLanding::new(pool, vec![0].into(), shape).map(drop);
    assert!(
        matches!(&direct, Err(e @ DeviceError::Unsupported(_)) if !e.is_unavailable()),
        "{direct:?}"
    );
    let huge = StagingPool::new(r.dev.clone(), 1 << 40, usize::MAX).map(drop);
    assert!(matches!(huge, Err(DeviceError::Alloc { .. })), "{huge:?}");
}

/// Lands every layer of `slots` (one own-only batch, the row-copy kernel, which reads the
/// slot table) and checks the pool.
fn land_batch_by_kernel(r: &Rig, slots: &[u32]) {
    let comps = all(&r.g);
    let mut landing = StagedLanding::new(
        r.pool.clone(),
        r.staging.lease().unwrap(),
        slots.into(),
        BatchShape::own_only(comps.clone()),
    )
    .unwrap()
    .with_strategy(ScatterStrategy::Kernel);
    let mut stages = landing.take_stages();
    for layer in 0..r.g.num_layers() {
        let stage = &mut stages[layer as usize % 2];
        fill_layer(&r.g, &landing, stage, layer, slots.len());
        landing.land(stage).unwrap();
    }
    assert!(landing.stats().kernel_launches > 0);
    drop(landing);
    check_pool(&r.pool, &r.g, slots, &comps);
}

/// Before, every batch allocated its slot table and freed it when it ended (on CUDA a
/// `cuMemAlloc` and a `cuMemFree` per batch, which may synchronize the whole device and stall
/// the engine's compute). The table is kept with the staging buffer: batches reuse it, and
/// only a batch larger than any before on that buffer allocates (a larger) one; loads and
/// saves alike land and gather the right slots through the reused table.
#[test]
fn batches_reuse_their_staging_buffers_slot_table_instead_of_allocating_one_each() {
    let r = rig(CpuDeviceConfig::default(), 3000, 1500, 1);
    for round in 0..4u32 {
        let slots: Vec<u32> = (0..12).map(|i| (i * 7 + 3 + round * 11) % 40).collect();
        land_batch_by_kernel(&r, &slots);
    }
    assert_eq!(
        r.dev.allocations("slot table"),
        1,
        "one table for four batches"
    );
    // Saves lease the same buffer and use its table too.
    let f = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_strategy(ScatterStrategy::Kernel);
    let slots: Vec<u32> = vec![9, 2, 15, 3];
    let k = r.g.component_by_name("k").unwrap().id;
    let len = r.g.component(k).unwrap().page_layer_bytes as usize;
    let mut save = f.begin_save(slots.clone().into()).unwrap();
    let rows = save.gather(k, 2).unwrap().to_vec();
    drop(save);
    for (p, &s) in slots.iter().enumerate() {
        let mut want = vec![0u8; len];
        // SAFETY: the loads and the save have ended: nothing writes the pool meanwhile.
        unsafe { r.pool.read_slot(k, 2, s, &mut want) }.unwrap();
        assert_eq!(&rows[p * len..(p + 1) * len], &want[..], "slot {s}");
    }
    assert_eq!(r.dev.allocations("slot table"), 1, "the save reused it");
    // A batch past the table's size replaces it once; smaller ones after it reuse that.
    let large: Vec<u32> = (0..1500).map(|i| (i * 2 + 1) % 3000).collect();
    land_batch_by_kernel(&r, &large);
    assert_eq!(r.dev.allocations("slot table"), 2);
    land_batch_by_kernel(&r, &[5, 1, 30]);
    land_batch_by_kernel(&r, &large[700..1400]);
    assert_eq!(r.dev.allocations("slot table"), 2);
}

/// A copy into the slots whose fence could not be recorded (its end unknown) is told by a
/// fresh event on the load stream, which runs in order: a settle that times out keeps the
/// slots claimed until the stream has passed the copy, then they are free. Before, they were
/// held for good (only the engine's `unsafe` release let go).
#[test]
fn slots_of_a_copy_whose_fence_failed_are_held_until_the_load_stream_passes_it() {
    let r = rig(CpuDeviceConfig::default(), 10, 2, 1);
    let slots = vec![3, 5];
    let mut landing = own_landing(&r, &slots).unwrap();
    let mut stages = landing.take_stages();
    fill_layer(&r.g, &landing, &mut stages[0], 0, slots.len());
    // The layer's copies are queued on a stalled device; the fence after them cannot be
    // recorded.
    r.dev.stall_for(Duration::from_secs(30));
    r.dev.fail_enqueue(CpuOp::Record, 0);
    let landed = landing.land(&mut stages[0]);
    assert!(matches!(landed, Err(DeviceError::Driver(_))), "{landed:?}");
    assert!(landing
        .settle_unless_stalled(Duration::from_millis(50))
        .is_err());
    let pool: &dyn kv_device::KvPool = r.pool.as_ref();
    let claims = pool.slot_claims().unwrap();
    let mut held = claims.held_slots();
    held.sort_unstable();
    assert_eq!(held, slots, "claimed while the copies may still write them");
    r.dev.resume();
    kv_device::SlotClaims::wait_free(pool, &slots, Instant::now() + Duration::from_secs(10))
        .expect("free once the load stream passed the copies");
    assert!(claims.held_slots().is_empty());
    drop(stages);
    drop(landing);
}

/// A settle that gives up on a stalled device still waits for one that keeps finishing the
/// copies: two layers whose uploads each wait 400 ms finish 800 ms in, past an idle bound of
/// 700 ms but each within it of the one before. Before, the bound was on the whole wait (a
/// busy, healthy device's failed batch left copies running under its outcome).
#[test]
fn a_settle_unless_stalled_waits_for_copies_that_keep_finishing() {
    let r = rig(CpuDeviceConfig::default(), 10, 2, 1);
    let slots = vec![3, 5];
    let mut landing = own_landing(&r, &slots).unwrap();
    let mut stages = landing.take_stages();
    for (layer, stage) in stages.iter_mut().enumerate() {
        fill_layer(&r.g, &landing, stage, layer as u32, slots.len());
    }
    // Each layer's first copy waits 400 ms on the device, one after the other (layer 0
    // lands its two components' rows in four copies: the second stall is layer 1's first).
    r.dev
        .stall_at(CpuOp::ToDevice, 0, Duration::from_millis(400));
    r.dev
        .stall_at(CpuOp::ToDevice, 3, Duration::from_millis(400));
    let t0 = Instant::now();
    for stage in stages.iter_mut() {
        landing.land(stage).unwrap();
    }
    landing
        .settle_unless_stalled(Duration::from_millis(700))
        .expect("the copies kept finishing");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(750),
        "{took:?}: both stalls ran"
    );
    let pool: &dyn kv_device::KvPool = r.pool.as_ref();
    assert!(pool.slot_claims().unwrap().held_slots().is_empty());
    drop(stages);
    drop(landing);
}

/// A batch no stage holds fails `StageTooSmall` at once, before any lease. Before, it waited
/// for a buffer (the lease wait) and, with every buffer leased, failed as the lease's `Alloc`
/// (a `Device` error, whose action resets the loader) instead.
#[test]
fn a_batch_no_stage_holds_is_refused_before_the_lease() {
    let r = rig(CpuDeviceConfig::default(), 16, 2, 1);
    let factory = StagedLandingFactory::new(r.pool.clone(), r.staging.clone())
        .with_lease_wait(Duration::from_secs(5));
    let _held = r.staging.lease().unwrap();
    let t0 = Instant::now();
    let too_many: Vec<u32> = (0..8).collect();
    let e = factory
        .begin(too_many.into(), BatchShape::own_only(all(&r.g)))
        .err()
        .unwrap();
    assert!(matches!(e, DeviceError::StageTooSmall { .. }), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
}

/// `max_batch_pages` is a multiple of the TP size (`SplitAllGather` pads its shared rows to
/// one): a stage of three pages' widest layer at TP 2 says two, and a batch of two fits.
#[test]
fn max_batch_pages_is_a_multiple_of_the_tp_size() {
    let r = rig(CpuDeviceConfig::default(), 16, 2, 1);
    let w = r.g.max_layer_bytes_per_page() as usize;
    let staging = StagingPool::new(r.dev.clone(), 3 * w, 1).unwrap();
    assert_eq!(staging.max_batch_pages(&r.g), 2);
    let factory = StagedLandingFactory::new(r.pool.clone(), staging);
    let slots: Vec<u32> = (0..2).collect();
    assert!(factory
        .begin(slots.into(), BatchShape::own_only(all(&r.g)))
        .is_ok());
}
