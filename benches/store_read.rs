//! Embedded store: a ranged batched read of one GLM-5.2 layer of a 32K-token prefix (512
//! pages × 41,984 B ≈ 21.5 MB into scattered pool slots) against plain memcpy of the same
//! bytes, same run. Target (issue 3): the store reaches at least half of memcpy.
//!
//! `cargo bench --bench store_read`

use divan::counter::BytesCount;
use divan::{black_box, Bencher};
use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{page_hashes, ComponentId, KeyScheme, KvGeometry, ModelKvSpec};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore, ObjectPut, RangedGet, ReadRange};

const PAGES: usize = 512; // 32K tokens at page size 64

fn main() {
    divan::main();
}

struct Fixture {
    store: EmbeddedStore,
    keys: Vec<String>,
    pool: HostKvPool,
    slots: Vec<u32>,
    layer_offset: u64,
    slice: usize,
}

fn fixture() -> Fixture {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let kv = g.component(ComponentId(0)).unwrap().clone();
    let tokens: Vec<u32> = (0..(PAGES as u32 * 64)).collect();
    let pages = page_hashes(&tokens, 64, None);
    let ks = KeyScheme::new("bench", 0, 0, 0);
    let store = EmbeddedStore::new(4 << 30);
    let object: Vec<u8> = (0..kv.object_bytes() as usize)
        .map(|i| (i * 7) as u8)
        .collect();
    let keys: Vec<String> = pages.iter().map(|p| ks.object_key(p, &kv)).collect();
    for k in &keys {
        let put = ObjectPut {
            key: k,
            parts: [(object.as_ptr(), object.len())].into_iter().collect(),
        };
        // SAFETY: `object` is live and unchanged during the call.
        assert!(unsafe { store.put(&[put]) }[0].is_ok());
    }
    // Scattered slots: pages land in reverse order with a gap between them.
    let slots: Vec<u32> = (0..PAGES as u32)
        .map(|i| 2 * (PAGES as u32 - 1 - i))
        .collect();
    let pool = HostKvPool::new(g, 2 * PAGES as u32).unwrap();
    Fixture {
        store,
        keys,
        pool,
        slots,
        layer_offset: kv.layer_range(40).unwrap().start,
        slice: kv.page_layer_bytes as usize,
    }
}

#[divan::bench(sample_count = 30)]
fn embedded_ranged_layer_read(bencher: Bencher) {
    let f = fixture();
    let dsts: Vec<usize> = f
        .slots
        .iter()
        .map(|&s| f.pool.slot_addr(ComponentId(0), 40, s).unwrap())
        .collect();
    bencher
        .counter(BytesCount::new(PAGES * f.slice))
        .bench_local(|| {
            let gets: Vec<RangedGet<'_>> = f
                .keys
                .iter()
                .zip(&dsts)
                .map(|(k, &d)| RangedGet {
                    key: k,
                    ranges: [ReadRange {
                        dst: d as *mut u8,
                        len: f.slice,
                        offset: f.layer_offset,
                    }]
                    .into_iter()
                    .collect(),
                })
                .collect();
            // SAFETY: every destination is a distinct slot slice of the pool, untouched otherwise.
            let r = unsafe { f.store.get_ranges(&gets) };
            // A read that failed would time an error path as a read.
            assert!(r.iter().all(Result::is_ok), "a read failed: {r:?}");
            black_box(r);
        });
}

#[divan::bench(sample_count = 30)]
fn memcpy_same_bytes(bencher: Bencher) {
    let src: Vec<u8> = (0..PAGES * 41_984).map(|i| i as u8).collect();
    let mut dst = vec![0u8; src.len()];
    bencher.counter(BytesCount::new(src.len())).bench_local(|| {
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
    });
}
