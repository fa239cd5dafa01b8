//! The linker's overhead over the store: the layer-wise load of a GLM-5.2 prefix (8K tokens,
//! 128 pages, all 78 layers, KV + indexer ≈ 442 MB) through `Linker` (validation, keys,
//! pins, size check, load thread, counter, waits, every store call bounded on a worker, and
//! each (object, layer) range checked against its checksum before the layer is published)
//! against the raw ranged reads of the same bytes into the same slots, same run, embedded
//! store; and the same load with checksum verification off, to price it.
//!
//! `cargo bench --bench linker_load`

use std::sync::Arc;

use divan::counter::BytesCount;
use divan::{black_box, Bencher};
use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec, PageHash};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, KvStore, RangedGet, ReadRange, SimulatedLink, SimulatedRemoteStore,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

const PAGES: u32 = 128;

fn main() {
    divan::main();
}

struct Fixture {
    g: KvGeometry,
    store: Arc<EmbeddedStore>,
    pages: Vec<PageHash>,
    slots: Vec<u32>,
}

fn fixture() -> Fixture {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let store = Arc::new(EmbeddedStore::new(8 << 30));
    let tokens: Vec<u32> = (0..PAGES * 64).map(|i| i ^ 0x5a5a).collect();
    let pages = page_hashes(&tokens, 64, None);
    let slots: Vec<u32> = (0..PAGES).collect();
    let src = Arc::new(HostKvPool::new(g.clone(), PAGES).unwrap());
    for c in g.components() {
        let data: Vec<u8> = (0..c.page_layer_bytes as usize).map(|i| i as u8).collect();
        for &l in &c.layers {
            for &s in &slots {
                // SAFETY: the source pool is filled before any linker uses it.
                unsafe { src.write_slot(c.id, l, s, &data) }.unwrap();
            }
        }
    }
    let saver = Linker::new(g.clone(), store.clone(), src, LinkerConfig::default()).unwrap();
    saver.save(&plan(&g, 0, &pages, &slots)).unwrap();
    saver.close().unwrap();
    // Scattered destination slots for the loads.
    let slots = (0..PAGES).map(|i| (i * 37) % PAGES).collect();
    Fixture {
        g,
        store,
        pages,
        slots,
    }
}

fn plan(g: &KvGeometry, b: u64, pages: &[PageHash], slots: &[u32]) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(b),
        vec![RequestPages {
            request: "bench".into(),
            pages: pages.to_vec(),
        }],
        slots.to_vec(),
    )
}

/// The full KvLoader path with `read_parallelism` store calls per layer at once (checksums
/// verified).
#[divan::bench(sample_count = 10, args = [1, 2])]
fn linker_layerwise_load(bencher: Bencher, read_parallelism: usize) {
    load(bencher, read_parallelism, true);
}

/// The same load with checksum verification off (length checks only): the price of
/// verification is the difference.
#[divan::bench(sample_count = 10, args = [1, 2])]
fn linker_layerwise_load_unverified(bencher: Bencher, read_parallelism: usize) {
    load(bencher, read_parallelism, false);
}

/// SIMULATED remote store: the embedded store paced to 3.6 GB/s per rank (what SGLang's runs
/// imply for Mooncake), 50 µs per call; checksums verified.
#[divan::bench(sample_count = 10)]
fn simulated_remote_3_6_gbps_load(bencher: Bencher) {
    simulated(bencher, true);
}

/// The same SIMULATED remote load with checksum verification off.
#[divan::bench(sample_count = 10)]
fn simulated_remote_3_6_gbps_load_unverified(bencher: Bencher) {
    simulated(bencher, false);
}

fn simulated(bencher: Bencher, verify_checksums: bool) {
    let f = fixture();
    let link = Arc::new(SimulatedLink::new(0.0));
    let store: Arc<dyn KvStore> = Arc::new(SimulatedRemoteStore::new(
        f.store.clone(),
        link,
        3.6,
        std::time::Duration::from_micros(50),
    ));
    run_loads(bencher, &f, store, 1, verify_checksums);
}

fn load(bencher: Bencher, read_parallelism: usize, verify_checksums: bool) {
    let f = fixture();
    let store: Arc<dyn KvStore> = f.store.clone();
    run_loads(bencher, &f, store, read_parallelism, verify_checksums);
}

fn run_loads(
    bencher: Bencher,
    f: &Fixture,
    store: Arc<dyn KvStore>,
    read_parallelism: usize,
    verify_checksums: bool,
) {
    let pool = Arc::new(HostKvPool::new(f.g.clone(), PAGES).unwrap());
    let config = LinkerConfig {
        read_parallelism,
        verify_checksums,
        // Every iteration reads its companions, as the numbers in docs/benchmarks.md did
        // before checksums were kept: the bench loads one prefix again and again.
        checksum_cache_entries: 0,
        ..LinkerConfig::default()
    };
    let linker = Linker::new(f.g.clone(), store, pool, config).unwrap();
    let mut batch = 1;
    bencher
        .counter(BytesCount::new(f.g.bytes_per_page() * u64::from(PAGES)))
        .bench_local(|| {
            batch += 1;
            let t = linker
                .start_load(plan(&f.g, batch, &f.pages, &f.slots))
                .unwrap();
            for l in 0..linker.num_layers() {
                linker.wait_layer(&t, l).unwrap();
            }
            black_box(linker.wait_batch(&t).unwrap().result.unwrap());
        });
    let m = linker.metrics();
    assert_eq!(m.ranges_length_only, 0);
    assert_eq!(m.ranges_checksummed > 0, verify_checksums);
}

#[divan::bench(sample_count = 10)]
fn raw_store_reads_same_bytes(bencher: Bencher) {
    let f = fixture();
    let pool = HostKvPool::new(f.g.clone(), PAGES).unwrap();
    let linker_keys = {
        let l = Linker::new(
            f.g.clone(),
            f.store.clone(),
            Arc::new(HostKvPool::new(f.g.clone(), 1).unwrap()),
            LinkerConfig::default(),
        )
        .unwrap();
        l.object_keys(&plan(&f.g, 0, &f.pages, &vec![0; f.pages.len()]))
            .unwrap()
    };
    bencher
        .counter(BytesCount::new(f.g.bytes_per_page() * u64::from(PAGES)))
        .bench_local(|| {
            for l in 0..f.g.num_layers() {
                for (c, keys) in f.g.components().iter().zip(&linker_keys) {
                    let Some(range) = c.layer_range(l) else {
                        continue;
                    };
                    let gets: Vec<RangedGet<'_>> = keys
                        .iter()
                        .zip(&f.slots)
                        .map(|(k, &s)| RangedGet {
                            key: k,
                            ranges: [ReadRange {
                                dst: pool.slot_addr(c.id, l, s).unwrap() as *mut u8,
                                len: c.page_layer_bytes as usize,
                                offset: range.start,
                            }]
                            .into_iter()
                            .collect(),
                        })
                        .collect();
                    // SAFETY: distinct slot slices of our own pool, untouched during the call.
                    let r = unsafe { f.store.get_ranges(&gets) };
                    // A read that failed would time an error path as a read.
                    assert!(r.iter().all(Result::is_ok), "a read failed: {r:?}");
                    black_box(r);
                }
            }
        });
}
