//! The cost of verifying a layer's bytes by checksum (issue 16: within 3 % of the load time).
//!
//! `cargo bench --bench checksum`
//!
//! One GLM-5.2 KV layer of a 32K-token prefix, as a load lands it: 512 page slices of
//! 41,984 B (≈ 21.5 MB). `verify_layer_checksums` runs `ObjectChecksums::verify_layer` on every
//! slice (XXH3-64 and the compare); `memcpy_same_bytes` copies the same bytes (the baseline,
//! in the same run); `embedded_ranged_layer_read` is what the load itself costs per layer on
//! the embedded store (the same reads as `benches/store_read.rs`).

use std::sync::Arc;

use divan::{black_box, Bencher};
use kvlink::kv_geometry::{KvGeometry, ModelKvSpec, ObjectChecksums};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore, ObjectPut, RangedGet, ReadRange};

const PAGES: usize = 512;
const LAYER: u32 = 40;

fn main() {
    divan::main();
}

fn geometry() -> KvGeometry {
    KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap()
}

/// The layer's slices, and each page's checksums.
fn layer() -> (Vec<u8>, Vec<ObjectChecksums>) {
    let g = geometry();
    let c = g.component_by_name("k").unwrap();
    let row = c.page_layer_bytes as usize;
    let object: Vec<u8> = (0..c.object_bytes()).map(|i| (i * 7 + 3) as u8).collect();
    let sums = ObjectChecksums::of_object(&object, c.page_layer_bytes).unwrap();
    let r = c.layer_range(LAYER).unwrap();
    let slice = &object[r.start as usize..r.end as usize];
    let mut bytes = Vec::with_capacity(row * PAGES);
    for _ in 0..PAGES {
        bytes.extend_from_slice(slice);
    }
    (bytes, vec![sums; PAGES])
}

#[divan::bench]
fn verify_layer_checksums(bencher: Bencher) {
    let g = geometry();
    let c = g.component_by_name("k").unwrap().clone();
    let (bytes, sums) = layer();
    let row = c.page_layer_bytes as usize;
    bencher
        .counter(divan::counter::BytesCount::new(bytes.len()))
        .bench_local(|| {
            for (page, s) in bytes.chunks(row).zip(&sums) {
                let v = ObjectChecksums::verify_layer(Some(s), &c, LAYER, black_box(page));
                assert!(v.is_ok());
            }
        });
}

#[divan::bench]
fn memcpy_same_bytes(bencher: Bencher) {
    let (bytes, _) = layer();
    let mut out = vec![0u8; bytes.len()];
    bencher
        .counter(divan::counter::BytesCount::new(bytes.len()))
        .bench_local(|| out.copy_from_slice(black_box(&bytes)));
}

#[divan::bench]
fn embedded_ranged_layer_read(bencher: Bencher) {
    let g = geometry();
    let c = g.component_by_name("k").unwrap().clone();
    let store = Arc::new(EmbeddedStore::new(4 << 30));
    let object = vec![5u8; c.object_bytes() as usize];
    let keys: Vec<String> = (0..PAGES).map(|p| format!("o{p}")).collect();
    for k in &keys {
        let put = ObjectPut {
            key: k,
            parts: [(object.as_ptr(), object.len())].into_iter().collect(),
        };
        // SAFETY: `object` is live and unchanged during the call.
        assert!(unsafe { store.put(&[put]) }[0].is_ok());
    }
    let row = c.page_layer_bytes as usize;
    let mut out = vec![0u8; row * PAGES];
    let offset = c.layer_range(LAYER).unwrap().start;
    bencher
        .counter(divan::counter::BytesCount::new(out.len()))
        .bench_local(|| {
            let base = out.as_mut_ptr();
            let gets: Vec<RangedGet<'_>> = keys
                .iter()
                .enumerate()
                .map(|(p, k)| RangedGet {
                    key: k,
                    ranges: [ReadRange {
                        // Stays inside `out`: page p's row.
                        dst: base.wrapping_add(p * row),
                        len: row,
                        offset,
                    }]
                    .into_iter()
                    .collect(),
                })
                .collect();
            // SAFETY: every destination is a distinct row of `out`, ours for the call.
            let r = unsafe { store.get_ranges(&gets) };
            assert!(r.iter().all(Result::is_ok));
        });
}
