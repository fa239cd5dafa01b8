//! Shared fixtures of the cross-crate tests: geometries, filled pools, saved prefixes.
#![allow(dead_code)]

use std::sync::Arc;

use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{
    page_hashes, ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, PageHash, RowUnit,
};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
use kvlink::mooncake_linker::store::KvStore;
use kvlink::mooncake_linker::{Linker, LinkerConfig};

pub mod coll;
pub mod paced;
pub mod sessions;
pub mod tp;

/// A small DSA-like model: 6 layers, page size 4, a 40 B/token KV and a 24 B/page indexer on
/// layers 0, 2, 5. Small enough for many test cases, shaped like GLM-5.2.
pub fn small_spec() -> ModelKvSpec {
    ModelKvSpec::new(
        "small-dsa",
        6,
        4,
        vec![
            ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 40),
            ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, 24)
                .on_layers(LayerMap::Sparse(vec![0, 2, 5])),
        ],
    )
    .expect("valid spec")
}

/// Deterministic bytes for (page hash, component, layer, byte index): what a page "is".
pub fn page_byte(page: &PageHash, comp: u16, layer: u32, i: usize) -> u8 {
    page.0[i % 32] ^ (comp as u8).wrapping_mul(31) ^ (layer as u8).wrapping_mul(7) ^ (i / 32) as u8
}

/// Writes each page's bytes into `pool` at `slots` (as the engine's prefill would).
pub fn fill_pool(pool: &HostKvPool, pages: &[PageHash], slots: &[u32]) {
    let g = pool.geometry().clone();
    for (page, &slot) in pages.iter().zip(slots) {
        for c in g.components() {
            for &l in &c.layers {
                let data: Vec<u8> = (0..c.page_layer_bytes as usize)
                    .map(|i| page_byte(page, c.id.0, l, i))
                    .collect();
                // SAFETY: the engine's prefill: no batch of the pool is in flight (the
                // fixtures fill pools before they load or save them).
                unsafe { pool.write_slot(c.id, l, slot, &data) }.expect("write slot");
            }
        }
    }
}

/// Checks that `pool` holds each page's bytes at `slots`, up to (not including) `layers`.
pub fn pool_matches(
    pool: &HostKvPool,
    pages: &[PageHash],
    slots: &[u32],
    layers: u32,
) -> Result<(), String> {
    let g = pool.geometry().clone();
    for (pi, (page, &slot)) in pages.iter().zip(slots).enumerate() {
        for c in g.components() {
            for &l in c.layers.iter().filter(|&&l| l < layers) {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                // SAFETY: callers check after the layers they name have landed (their waits
                // returned), and nothing else writes these slots.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }.map_err(|e| e.to_string())?;
                let bad = got
                    .iter()
                    .enumerate()
                    .position(|(i, &b)| b != page_byte(page, c.id.0, l, i));
                if let Some(i) = bad {
                    return Err(format!(
                        "page {pi} slot {slot} comp {} layer {l}: byte {i} differs",
                        c.name
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Tokens of a prompt of `pages` whole pages (seeded so prompts differ).
pub fn prompt(seed: u32, pages: usize, page_size: u32) -> Vec<u32> {
    (0..pages as u32 * page_size)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect()
}

/// Saves a prompt's pages to `store` through a rank-0 linker (a previous request's prefill).
pub fn save_prefix(
    spec: &ModelKvSpec,
    store: Arc<dyn KvStore>,
    tokens: &[u32],
    cfg: &LinkerConfig,
) -> Vec<PageHash> {
    let g = KvGeometry::new(spec.clone(), 1, 0).expect("geometry");
    let pages = page_hashes(tokens, g.page_size(), None);
    let pool = Arc::new(HostKvPool::new(g.clone(), pages.len() as u32).expect("pool"));
    let slots: Vec<u32> = (0..pages.len() as u32).collect();
    fill_pool(&pool, &pages, &slots);
    let linker = Linker::new(g.clone(), store, pool, cfg.clone()).expect("linker");
    let plan = BatchPlan::all_components(
        &g,
        BatchId(0),
        vec![RequestPages {
            request: "prefill".into(),
            pages: pages.clone(),
        }],
        slots,
    );
    let report = linker.save(&plan).expect("save");
    assert_eq!(
        report.objects_written as usize + report.objects_present as usize,
        pages.len() * g.components().len()
    );
    linker.close().expect("close");
    pages
}

/// A plan loading `pages` into `slots`.
pub fn load_plan(g: &KvGeometry, batch: u64, pages: &[PageHash], slots: Vec<u32>) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: format!("req-{batch}").as_str().into(),
            pages: pages.to_vec(),
        }],
        slots,
    )
}

/// Threads of this process whose name starts with `prefix`.
pub fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(Result::ok)
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .filter(|c| c.starts_with(prefix))
        .count()
}

/// Loads every layer, waiting for each in order like an engine's forward pass.
pub fn wait_all(
    linker: &dyn KvLoader,
    ticket: &kvlink::kv_loader::LoadTicket,
) -> Result<(), kvlink::kv_loader::KvLoadError> {
    for l in 0..linker.num_layers() {
        linker.wait_layer(ticket, l)?;
    }
    Ok(())
}

/// Waits every layer of `ticket` like an engine: the wait must fail with a store's
/// `NotFound` (an object of the plan is missing); that error.
pub fn wait_fails_not_found(
    linker: &dyn KvLoader,
    ticket: &kvlink::kv_loader::LoadTicket,
) -> kvlink::kv_loader::KvLoadError {
    let err = wait_all(linker, ticket).unwrap_err();
    assert!(
        matches!(
            &err,
            kvlink::kv_loader::KvLoadError::Store {
                kind: kvlink::kv_loader::StoreFailure::NotFound,
                ..
            }
        ),
        "{err}"
    );
    err
}
