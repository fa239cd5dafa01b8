//! The demo: a tiny engine's block pool and prefix cache, a kvlink linker over the embedded
//! store, and the connector between them. Request 1 computes and caches its blocks (saved
//! through the connector), the engine evicts them all, request 2 (the same prompt and more)
//! misses locally and gets its prefix hydrated by the connector; a third request's load
//! fails (an injected store fault) and falls back to compute.

use std::io::Write;
use std::sync::{Arc, Mutex};

use anyhow::{ensure, Context, Result};
use kvlink::kv_device::{HostKvPool, KvPool};
use kvlink::kv_geometry::{
    page_hashes, ComponentId, ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit,
};
use kvlink::kv_loader::KvLoader;
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, StoreError,
};
use kvlink::mooncake_linker::Linker;

use crate::connector::{BlockSource, ConnectorStats, KvCacheConnector, KvlinkConnector};

/// Tokens per block (= kvlink's page size).
pub const BLOCK: u32 = 16;
const LAYERS: u32 = 4;
const ROW_BYTES: u32 = 32;
const BLOCKS: u32 = 32;

/// What the demo saw.
#[derive(Debug, Clone)]
pub struct Summary {
    /// Blocks request 2 got from the connector.
    pub hydrated: usize,
    /// Request 2's hydrated blocks held request 1's bytes, layer by layer.
    pub bytes_match: bool,
    /// Blocks request 3 got (its load failed: none).
    pub after_fault: Option<Vec<usize>>,
    /// Keys the injected read fault hit (request 3 fell back because of it, not otherwise).
    pub fault_hits: u32,
    /// Free blocks at the end (every failed load's blocks given back).
    pub free_blocks: usize,
    /// The connector's counters.
    pub stats: ConnectorStats,
}

/// The engine's block pool: a free list.
struct FreeList(Mutex<Vec<usize>>);

impl FreeList {
    fn list(&self) -> std::sync::MutexGuard<'_, Vec<usize>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl BlockSource for FreeList {
    fn allocate(&self, n: usize) -> Option<Vec<usize>> {
        let mut free = self.list();
        let at = free.len().checked_sub(n)?;
        Some(free.split_off(at))
    }

    fn free(&self, blocks: &[usize]) {
        self.list().extend_from_slice(blocks);
    }
}

/// The bytes the engine's "attention" writes for page `page` of a prompt at `layer`.
fn page_bytes(page: usize, layer: u32) -> Vec<u8> {
    let len = (BLOCK * ROW_BYTES) as usize;
    (0..len)
        .map(|i| (page * 31 + layer as usize * 7 + i) as u8)
        .collect()
}

fn write_block(pool: &HostKvPool, block: usize, data: impl Fn(u32) -> Vec<u8>) -> Result<()> {
    for layer in 0..LAYERS {
        // SAFETY: the demo's engine owns this block: no load targets it and nothing else
        // reads or writes it now.
        unsafe { KvPool::write_slot(pool, ComponentId(0), layer, block as u32, &data(layer)) }?;
    }
    Ok(())
}

fn block_matches(pool: &HostKvPool, block: usize, page: usize) -> Result<bool> {
    let mut out = vec![0u8; (BLOCK * ROW_BYTES) as usize];
    for layer in 0..LAYERS {
        // SAFETY: the block's load finished (the connector returned it hydrated); nothing
        // writes it now.
        unsafe { KvPool::read_slot(pool, ComponentId(0), layer, block as u32, &mut out) }?;
        if out != page_bytes(page, layer) {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Runs the three requests and writes what happened to `out`.
pub fn run(out: &mut dyn Write) -> Result<Summary> {
    let spec = ModelKvSpec::new(
        "tiny-mla",
        LAYERS,
        BLOCK,
        vec![ComponentSpec::new(
            "k",
            RowUnit::Token,
            ElementType::Bytes,
            ROW_BYTES,
        )],
    )?;
    let geometry = KvGeometry::new(spec, 1, 0)?;
    let faults = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(64 << 20))));
    let store: Arc<dyn KvStore> = faults.clone();
    let pool = Arc::new(HostKvPool::new(geometry.clone(), BLOCKS)?);
    let linker = Linker::builder(geometry.clone(), store, pool.clone()).build()?;
    let loader: Arc<dyn KvLoader> = Arc::new(linker);
    let free = Arc::new(FreeList(Mutex::new((0..BLOCKS as usize).rev().collect())));
    let connector = KvlinkConnector::new(loader.clone(), geometry, free.clone());

    // Request 1: 100 tokens in 7 blocks, 6 of them full; the engine computes them and caches
    // them (the connector saves the full ones).
    let prompt: Vec<u32> = (0..100).map(|t| t * 7 + 3).collect();
    let hashes = page_hashes(&prompt, BLOCK, None);
    let blocks = free
        .allocate(prompt.len().div_ceil(BLOCK as usize))
        .context("pool full")?;
    for (page, &b) in blocks.iter().enumerate() {
        write_block(&pool, b, |layer| page_bytes(page, layer))?;
    }
    connector.observe_store(&hashes, &blocks, hashes.len());
    writeln!(
        out,
        "request 1: computed {} blocks ({} full), saved {} through the connector",
        blocks.len(),
        hashes.len(),
        connector.stats().blocks_saved
    )?;

    // The engine evicts them (and the blocks are reused: zeroed here).
    for (i, &b) in blocks.iter().enumerate() {
        // A full block with its hash; the partial last block has none.
        connector.observe_evict(hashes.get(i..=i).unwrap_or_default(), b);
        write_block(&pool, b, |_| vec![0u8; (BLOCK * ROW_BYTES) as usize])?;
    }
    free.free(&blocks);
    writeln!(out, "evicted all {} blocks locally", blocks.len())?;

    // Request 2: the same prompt and 40 more tokens; no local hit, the connector hydrates.
    let longer: Vec<u32> = prompt.iter().copied().chain(1000..1040).collect();
    let hashes2 = page_hashes(&longer, BLOCK, None);
    let got = connector
        .lookup_blocks(&hashes2, &[0], usize::MAX)
        .unwrap_or_default();
    let mut bytes_match = got.len() == hashes.len();
    for (page, &b) in got.iter().enumerate() {
        bytes_match &= block_matches(&pool, b, page)?;
    }
    writeln!(
        out,
        "request 2: {} of {} full blocks hydrated from the store, bytes {}",
        got.len(),
        hashes2.len(),
        if bytes_match {
            "equal to request 1's"
        } else {
            "DIFFERENT"
        }
    )?;
    // The next request with this prefix hits the hydrated blocks in the engine's own cache.
    connector.observe_hit(&hashes2[..got.len()], &got, got.len() * BLOCK as usize);
    free.free(&got);

    // Request 3: the same prefix, but the store fails a layer read: the connector gives
    // its blocks back and the engine computes the prefix.
    faults.inject(
        FaultRule {
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
    );
    let after_fault = connector.lookup_blocks(&hashes, &[0], usize::MAX);
    let stats = connector.stats();
    writeln!(
        out,
        "request 3 (injected read fault): {} from the store; engine action {:?}",
        after_fault.as_ref().map_or(0, Vec::len),
        stats.actions.last()
    )?;
    let free_blocks = free.list().len();
    ensure!(
        free_blocks == BLOCKS as usize,
        "{free_blocks} of {BLOCKS} blocks free at the end"
    );
    loader.close()?;
    Ok(Summary {
        hydrated: got.len(),
        bytes_match,
        after_fault,
        fault_hits: faults.faults_hit(),
        free_blocks,
        stats,
    })
}
