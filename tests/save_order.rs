//! Saving from a device pool is ordered after the engine's compute that wrote the pages: the
//! engine passes the event it recorded after that compute (`Linker::save_after`), and the
//! gather waits for it device-side. On CPU devices: the engine's compute stream writes the
//! pages late (held behind a stalled device); the saved objects hold the new bytes, not what
//! the slots held before.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{load_plan, page_byte, prompt, small_spec};
use kvlink::kv_device::{
    CpuDevice, Device, DeviceKvPool, HostKvPool, LandingFactory, StagedLandingFactory, StagingPool,
    Transfer,
};
use kvlink::kv_geometry::{page_hashes, KvGeometry};
use kvlink::kv_loader::{KvLoadError, KvLoader};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore, ObjectGet};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

fn get(store: &dyn KvStore, key: &str, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    let g = ObjectGet {
        key,
        dst: buf.as_mut_ptr(),
        len,
    };
    // SAFETY: `buf` is ours and untouched during the call.
    assert_eq!(unsafe { store.get_into(&[g]) }[0], Ok(len as u64));
    buf
}

/// This file's linker config.
fn config() -> LinkerConfig {
    LinkerConfig {
        namespace: "order".into(),
        ..LinkerConfig::default()
    }
}

/// A linker over a device pool of 8 slots on `dev` (staged landings, wrapped by `wrap`), its
/// pool and store.
fn device_linker_with<F: LandingFactory + 'static>(
    dev: &Arc<CpuDevice>,
    g: &KvGeometry,
    wrap: impl FnOnce(StagedLandingFactory) -> F,
) -> (Linker, Arc<DeviceKvPool>, Arc<dyn KvStore>) {
    let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging = StagingPool::new(dev.clone(), StagingPool::half_bytes_for(g, 3, 1), 2).unwrap();
    let landings = Arc::new(wrap(StagedLandingFactory::new(pool.clone(), staging)));
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let linker = Linker::with_landings(
        g.clone(),
        store.clone(),
        pool.clone(),
        landings,
        config(),
        None,
    )
    .unwrap();
    (linker, pool, store)
}

/// [`device_linker_with`] the staged factory itself.
fn device_linker(
    dev: &Arc<CpuDevice>,
    g: &KvGeometry,
) -> (Linker, Arc<DeviceKvPool>, Arc<dyn KvStore>) {
    device_linker_with(dev, g, |f| f)
}

/// Through the trait an engine holds (`Arc<dyn KvLoader>`), a device pool's save names the
/// engine's compute stream (`save_after_stream`): the linker records its event on the pool's
/// device and orders the gather after it. The CPU device's engine has no stream (its work is
/// done when it asks: the event is complete at once), so this checks the path and the bytes;
/// the ordering itself is checked on a GPU (`tests/gpu`, `linker`).
#[test]
fn a_device_pool_save_through_the_trait_names_the_engines_stream() {
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let (linker, pool, store) = device_linker(&dev, &g);
    let pages = page_hashes(&prompt(43, 2, spec.page_size), spec.page_size, None);
    let slots = vec![2u32, 6];
    for (page, &slot) in pages.iter().zip(&slots) {
        for c in g.components() {
            for &l in &c.layers {
                let row: Vec<u8> = (0..c.page_layer_bytes as usize)
                    .map(|i| page_byte(page, c.id.0, l, i))
                    .collect();
                // SAFETY: nothing else touches the pool (no load or save has started).
                unsafe { pool.write_slot(c.id, l, slot, &row) }.unwrap();
            }
        }
    }
    let plan = load_plan(&g, 1, &pages, slots);
    let keys = linker.object_keys(&plan).unwrap();
    let loader: Arc<dyn KvLoader> = Arc::new(linker);
    // SAFETY: 0 names the default stream, which the CPU device does not use.
    let stream = unsafe { kvlink::kv_loader::RawStream::from_raw(0) };
    let report = loader.save_after_stream(&plan, stream).unwrap();
    assert_eq!(
        report.objects_written as usize,
        pages.len() * g.components().len()
    );
    for (c, keys) in g.components().iter().zip(&keys) {
        for (page, key) in pages.iter().zip(keys) {
            let object = get(store.as_ref(), key, c.object_bytes() as usize);
            for &l in &c.layers {
                let r = c.layer_range(l).unwrap();
                let at = r.start as usize;
                assert_eq!(
                    object[at + 5],
                    page_byte(page, c.id.0, l, 5),
                    "{key} layer {l}"
                );
            }
        }
    }
    loader.close().unwrap();
}

#[test]
fn a_device_pool_save_waits_for_the_engines_compute_that_wrote_the_pages() {
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let blocker = CpuDevice::new(1).unwrap();
    let (linker, pool, store) = device_linker(&dev, &g);
    let pages = page_hashes(&prompt(41, 3, spec.page_size), spec.page_size, None);
    let slots = vec![5u32, 1, 3];
    // What the slots held before the compute: zeros.
    for c in g.components() {
        for &l in &c.layers {
            for &s in &slots {
                // SAFETY: nothing else touches the pool yet (no load or save has started).
                unsafe { pool.write_slot(c.id, l, s, &vec![0u8; c.page_layer_bytes as usize]) }
                    .unwrap();
            }
        }
    }
    // The engine's compute stream writes the pages' new bytes, held behind a device that is
    // stalled for a while (a long kernel). Timed from before the stall: it ends 300 ms after
    // it is set, whatever the copies below take.
    let t0 = Instant::now();
    blocker.stall_for(Duration::from_millis(300));
    let gate = blocker.load_stream().record().unwrap();
    let compute = dev.new_stream().unwrap();
    compute.wait(&gate).unwrap();
    let mut sources: Vec<Vec<u8>> = Vec::new();
    for (page, &slot) in pages.iter().zip(&slots) {
        for c in g.components() {
            for &l in &c.layers {
                let row = c.page_layer_bytes as usize;
                let bytes: Vec<u8> = (0..row).map(|i| page_byte(page, c.id.0, l, i)).collect();
                let (buf, len) = pool.buffer(c.id, l).unwrap();
                assert!((slot as usize + 1) * row <= len);
                let t = Transfer::ToDevice {
                    dst: buf + (slot as usize * row) as u64,
                    src: bytes.as_ptr() as usize,
                    len: row,
                };
                // SAFETY: the destination is slot `slot`'s slice of the pool buffer (inside
                // it, checked above), written by nothing else meanwhile (this test is the
                // engine); the source is kept in `sources` until the copy is known complete
                // (the save waits for `done`, and the end of the test waits for it again).
                unsafe { compute.transfer(t) }.unwrap();
                sources.push(bytes);
            }
        }
    }
    let done = compute.record().unwrap();
    let plan = load_plan(&g, 1, &pages, slots.clone());
    let report = linker.save_after(&plan, &done).unwrap();
    assert_eq!(
        report.objects_written as usize,
        pages.len() * g.components().len()
    );
    assert!(
        t0.elapsed() >= Duration::from_millis(300),
        "the save waited for the compute"
    );
    // Every saved object holds the compute's bytes.
    for (c, keys) in g
        .components()
        .iter()
        .zip(linker.object_keys(&plan).unwrap())
    {
        for (page, key) in pages.iter().zip(&keys) {
            let object = get(store.as_ref(), key, c.object_bytes() as usize);
            for &l in &c.layers {
                let r = c.layer_range(l).unwrap();
                let want: Vec<u8> = (0..c.page_layer_bytes as usize)
                    .map(|i| page_byte(page, c.id.0, l, i))
                    .collect();
                assert_eq!(
                    &object[r.start as usize..r.end as usize],
                    &want[..],
                    "{key} layer {l}: the save read the slots before the compute wrote them"
                );
            }
        }
    }
    assert!(done
        .wait_until(kv_loader_deadline(Duration::from_secs(5)))
        .unwrap());
    drop(sources);
    linker.close().unwrap();
}

#[test]
fn a_host_pool_save_after_an_event_waits_for_it_on_the_host() {
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let linker = Linker::new(g.clone(), store, pool.clone(), LinkerConfig::default()).unwrap();
    let pages = page_hashes(&prompt(42, 2, spec.page_size), spec.page_size, None);
    common::fill_pool(&pool, &pages, &[0, 1]);
    let dev = CpuDevice::new(0).unwrap();
    let t0 = Instant::now();
    dev.stall_for(Duration::from_millis(200));
    let done = dev.load_stream().record().unwrap();
    let report = linker
        .save_after(&load_plan(&g, 1, &pages, vec![0, 1]), &done)
        .unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(200));
    assert_eq!(report.objects_written, 4);
}

fn kv_loader_deadline(d: Duration) -> Instant {
    kvlink::kv_loader::deadline_after(d)
}

/// A save plan naming one slot twice for the same page (two requests sharing a prefix block,
/// saved in one plan) saves that page, from a host pool and from a device pool (whose gather
/// reads the slot twice); a slot named for two pages is still refused. Before, both plans
/// were refused (`DuplicateSlot`), and nothing of either request was saved.
#[test]
fn a_save_may_name_a_slot_twice_for_the_same_page() {
    use kvlink::kv_loader::{KvLoadError, PlanError};
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let pages = page_hashes(&prompt(43, 2, spec.page_size), spec.page_size, None);
    let dev = CpuDevice::new(0).unwrap();
    let device_pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 8).unwrap());
    let staging = StagingPool::new(dev, StagingPool::half_bytes_for(&g, 3, 1), 2).unwrap();
    let landings = Arc::new(StagedLandingFactory::new(device_pool.clone(), staging));
    let host_pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    common::fill_pool(&host_pool, &pages[..1], &[2]);
    for pool in ["host", "device"] {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
        let linker = match pool {
            "host" => Linker::new(
                g.clone(),
                store.clone(),
                host_pool.clone(),
                LinkerConfig::default(),
            ),
            _ => Linker::with_landings(
                g.clone(),
                store.clone(),
                device_pool.clone(),
                landings.clone(),
                LinkerConfig::default(),
                None,
            ),
        }
        .unwrap();
        let twice = load_plan(&g, 1, &[pages[0], pages[0]], vec![2, 2]);
        let report = linker
            .save(&twice)
            .unwrap_or_else(|e| panic!("{pool}: {e}"));
        assert!(report.pages_not_saved.is_empty(), "{pool}: {report:?}");
        let keys = linker.object_keys(&twice).unwrap();
        for key in keys.iter().flatten() {
            assert_eq!(
                store.exists(&[key.as_str()]),
                vec![Ok(true)],
                "{pool}: {key}"
            );
        }
        let two_pages = load_plan(&g, 2, &pages, vec![3, 3]);
        assert!(
            matches!(
                linker.save(&two_pages),
                Err(KvLoadError::InvalidPlan {
                    reason: PlanError::DuplicateSlot { .. },
                    ..
                })
            ),
            "{pool}"
        );
        linker.close().unwrap();
    }
}

/// A device pool's staged factory that forwards all but `record_on_engine_stream` (a wrapper
/// written before the method existed).
struct Unforwarded(StagedLandingFactory);

impl LandingFactory for Unforwarded {
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: kvlink::kv_device::BatchShape,
    ) -> Result<Box<dyn kvlink::kv_device::LayerLanding>, kvlink::kv_device::DeviceError> {
        self.0.begin(slots, shape)
    }
    fn store_regions(&self) -> Vec<kvlink::kv_device::StoreRegion> {
        self.0.store_regions()
    }
    fn share_path(&self) -> kvlink::kv_device::SharePath {
        self.0.share_path()
    }
    fn begin_save(
        &self,
        slots: Arc<[u32]>,
    ) -> Result<Box<dyn kvlink::kv_device::SaveGather>, kvlink::kv_device::DeviceError> {
        self.0.begin_save(slots)
    }
}

/// A save through the trait on a device pool whose factory cannot record on the engine's
/// stream is refused as the engine's to fix (`Config`, not a device failure that would
/// reset every batch), nothing is stored, and it counts as a failed save. On a host pool the
/// stream is not needed: the save writes the pages.
#[test]
fn a_save_after_a_stream_that_cannot_be_ordered_is_refused_and_a_host_pool_saves() {
    let spec = small_spec();
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let dev = CpuDevice::new(0).unwrap();
    let (linker, _, store) = device_linker_with(&dev, &g, Unforwarded);
    let pages = page_hashes(&prompt(47, 2, spec.page_size), spec.page_size, None);
    let plan = load_plan(&g, 1, &pages, vec![1, 4]);
    // SAFETY: never used: the factory records nothing.
    let stream = unsafe { kvlink::kv_loader::RawStream::from_raw(0x20) };
    let err = linker.save_after_stream(&plan, stream).unwrap_err();
    assert!(matches!(err, KvLoadError::Config(_)), "{err}");
    let m = linker.metrics();
    assert_eq!((m.saves, m.saves_failed, m.bytes_written), (1, 1, 0));
    linker.close().unwrap();
    let host = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g.clone(), store, host, config()).unwrap();
    let report = linker.save_after_stream(&plan, stream).unwrap();
    assert_eq!(
        report.objects_written as usize,
        pages.len() * g.components().len()
    );
    linker.close().unwrap();
}
