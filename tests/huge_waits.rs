//! `Duration::MAX` (and any huge wait) in every `LinkerConfig` duration: lookups, loads, layer
//! and batch waits, reset and close work as usual on a real linker (host pool, embedded
//! store), alone and in a TP group of in-process ranks, and on the device path (CPU devices
//! whose stream waits and landing drains are `Duration::MAX` too), and nothing panics on
//! `Instant + Duration` overflow.

mod common;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvlink::kv_device::{
    CpuDevice, CpuDeviceConfig, Device, DeviceKvPool, HostKvPool, KvPool, StagedLandingFactory,
    StagingPool,
};
use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{KvLoader, LookupRequest, ShareMode};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};

fn huge(mode: ShareMode, wait: Duration) -> LinkerConfig {
    LinkerConfig {
        namespace: "huge-waits".into(),
        wait_deadline: wait,
        layer_read_timeout: wait,
        lease_renewal: wait,
        collective_timeout: wait,
        mode: ModeChoice::Fixed(mode),
        ..LinkerConfig::default()
    }
}

/// Runs `f` on a thread and fails the test if it takes longer than a minute (the waits under
/// test are unbounded by design; the test is not).
fn bounded(name: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            f();
            let _ = tx.send(());
        })
        .unwrap();
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => worker.join().unwrap(),
        // The worker panicked: join re-raises its panic here.
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            if let Err(p) = worker.join() {
                std::panic::resume_unwind(p);
            }
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{name}: still running after 60 s"),
    }
}

/// One rank's whole life: lookup, load with a wait per layer, the outcome, another load cut
/// by reset, close.
fn one_rank_life(linker: &Linker, pool: &HostKvPool, tokens: &[u32], slots: Vec<u32>) {
    let hit = linker
        .lookup(&LookupRequest {
            tokens,
            skip_pages: 0,
        })
        .expect("lookup");
    assert_eq!(hit.pages.len(), slots.len());
    let g = linker.geometry().clone();
    let ticket = linker
        .start_load(load_plan(&g, 1, &hit.pages, slots.clone()))
        .expect("start_load");
    wait_all(linker, &ticket).expect("every layer");
    let outcome = linker.wait_batch(&ticket).expect("wait_batch");
    assert!(outcome.result.is_ok(), "{:?}", outcome.result);
    assert!(pool_matches(pool, &hit.pages, &slots, g.num_layers()).is_ok());
    let _ = linker
        .start_load(load_plan(&g, 2, &hit.pages, slots))
        .expect("start_load");
    linker.reset().expect("reset");
    assert!(linker.completed().len() <= 1);
    linker.close().expect("close");
}

#[test]
fn one_rank_with_duration_max_everywhere() {
    for wait in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        bounded("kvlink-test-huge-1", move || {
            let spec = small_spec();
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
            let cfg = huge(ShareMode::AllRanks, wait);
            let tokens = prompt(3, 4, spec.page_size);
            save_prefix(&spec, store.clone(), &tokens, &cfg);
            let g = KvGeometry::new(spec, 1, 0).unwrap();
            let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
            let linker = Linker::new(g, store, pool.clone(), cfg).unwrap();
            one_rank_life(&linker, &pool, &tokens, vec![7, 1, 4, 2]);
        });
    }
}

#[test]
fn tp3_group_with_duration_max_everywhere() {
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        bounded("kvlink-test-huge-3", move || {
            let spec = small_spec();
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
            let cfg = huge(mode, Duration::MAX);
            let tokens = prompt(5, 5, spec.page_size);
            save_prefix(&spec, store.clone(), &tokens, &cfg);
            std::thread::scope(|s| {
                for (rank, group) in TpGroup::in_process(3).into_iter().enumerate() {
                    let (spec, store, cfg, tokens) =
                        (spec.clone(), store.clone(), cfg.clone(), tokens.clone());
                    s.spawn(move || {
                        let g = KvGeometry::new(spec, 3, rank as u32).unwrap();
                        let pool = Arc::new(HostKvPool::new(g.clone(), 16).unwrap());
                        let linker =
                            Linker::with_group(g, store, pool.clone(), cfg, group).unwrap();
                        let slots = (0..5).map(|i| (i * 3 + rank as u32) % 16).collect();
                        one_rank_life(&linker, &pool, &tokens, slots);
                    });
                }
            });
        });
    }
}

/// Every layer of every page in a device pool holds its saved bytes.
fn device_pool_matches(pool: &DeviceKvPool, pages: &[PageHash], slots: &[u32]) {
    for (pi, (page, &slot)) in pages.iter().zip(slots).enumerate() {
        for c in pool.geometry().components() {
            for &l in &c.layers {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                // SAFETY: the batch's outcome was taken: nothing writes the pool meanwhile.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }.unwrap();
                let want: Vec<u8> = (0..got.len())
                    .map(|i| page_byte(page, c.id.0, l, i))
                    .collect();
                assert!(got == want, "page {pi} comp {} layer {l}", c.name);
            }
        }
    }
}

#[test]
fn tp3_device_path_with_duration_max_everywhere() {
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        bounded("kvlink-test-huge-dev", move || {
            let spec = small_spec();
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
            let cfg = huge(mode, Duration::MAX);
            let tokens = prompt(6, 5, spec.page_size);
            save_prefix(&spec, store.clone(), &tokens, &cfg);
            let dev = CpuDevice::with_config(
                0,
                CpuDeviceConfig {
                    wait_limit: Duration::MAX,
                    ..CpuDeviceConfig::default()
                },
            )
            .unwrap();
            let devices: Vec<Arc<dyn Device>> = vec![dev.clone(); 3];
            let groups = TpGroup::in_process_on_devices(devices).unwrap();
            std::thread::scope(|s| {
                for (rank, group) in groups.into_iter().enumerate() {
                    let (spec, store, cfg, tokens, dev) = (
                        spec.clone(),
                        store.clone(),
                        cfg.clone(),
                        tokens.clone(),
                        dev.clone(),
                    );
                    s.spawn(move || {
                        let g = KvGeometry::new(spec, 3, rank as u32).unwrap();
                        let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 16).unwrap());
                        let half = StagingPool::half_bytes_for(&g, 5, 3);
                        let staging = StagingPool::new(dev, half, 2).unwrap();
                        let landings = Arc::new(
                            StagedLandingFactory::new(pool.clone(), staging)
                                .with_drain_limit(Duration::MAX),
                        );
                        let linker = Linker::with_landings(
                            g.clone(),
                            store,
                            pool.clone(),
                            landings,
                            cfg,
                            Some(group),
                        )
                        .unwrap();
                        let hit = linker
                            .lookup(&LookupRequest {
                                tokens: &tokens,
                                skip_pages: 0,
                            })
                            .expect("lookup");
                        let slots: Vec<u32> = (0..5).map(|i| (i * 3 + rank as u32) % 16).collect();
                        let ticket = linker
                            .start_load(load_plan(&g, 1, &hit.pages, slots.clone()))
                            .expect("start_load");
                        wait_all(&linker, &ticket).expect("every layer");
                        let outcome = linker.wait_batch(&ticket).expect("wait_batch");
                        assert!(outcome.result.is_ok(), "{:?}", outcome.result);
                        device_pool_matches(&pool, &hit.pages, &slots);
                        linker.reset().expect("reset");
                        linker.close().expect("close");
                    });
                }
            });
        });
    }
}
