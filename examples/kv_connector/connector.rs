//! A mistral.rs-style prefix-cache connector over kvlink: the seam a Rust server's block
//! manager offers an external KV store, filled by kvlink's `KvLoader`.
//!
//! [`KvCacheConnector`] mirrors the trait of mistral.rs's open PR #2364 (kvlink does not
//! depend on mistral.rs, so the shape is copied here): `lookup_blocks` after the engine's own
//! prefix match, `observe_store` when full blocks are cached, `observe_evict` when one is
//! dropped. [`KvlinkConnector`] implements it with kvlink:
//!
//! - `lookup_blocks` = `KvLoader::lookup_pages` of the block hashes, blocks from the engine's
//!   pool, then a [`LoadHandle`] waited layer by layer and finished. The hook must return
//!   blocks already hydrated, so it waits for every layer before it returns: this seam has no
//!   per-layer overlap (for that, hand the `LoadHandle` to the model's forward and wait per
//!   layer, as docs/integration.md shows).
//! - `observe_store` = `KvLoader::save` of the full blocks (their page hashes and block ids).
//! - `observe_evict`: nothing to tell kvlink; the store keeps its copy.
//!
//! Block hashes must be kvlink's page hashes (`kv_geometry::page_hashes(tokens, block_size,
//! None)`), the block size kvlink's page size, and a block id a page slot of the pool. In a
//! TP group every rank's connector must see the same calls in the same order (`lookup` and
//! `start_load` are collective), and every rank's block pool must answer an allocation
//! alike (one scheduler decides for all ranks, as in vLLM and mistral.rs): a rank whose
//! `allocate` failed after the collective lookup skips the `start_load` its peers make, and
//! they wait for it until their `collective_timeout`, then fail the batch.

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{
    BatchId, BatchPlan, EngineAction, KvLoadError, KvLoader, LoadHandle, RequestPages,
};

/// A block's hash: kvlink's page hash (chained from the prompt's start).
pub type BlockHash = PageHash;

/// The connector seam of mistral.rs's paged KV manager (PR #2364's shape).
pub trait KvCacheConnector: Send + Sync {
    /// Blocks (already local and hydrated) holding the longest prefix of `block_hashes` the
    /// connector can give, at most `max_blocks`; `None` when it gives none.
    fn lookup_blocks(
        &self,
        block_hashes: &[BlockHash],
        group_ids: &[u32],
        max_blocks: usize,
    ) -> Option<Vec<usize>> {
        let _ = (block_hashes, group_ids, max_blocks);
        None
    }

    /// The engine reused `block_ids` from its own cache.
    fn observe_hit(&self, block_hashes: &[BlockHash], block_ids: &[usize], computed: usize) {
        let _ = (block_hashes, block_ids, computed);
    }

    /// The engine cached its first `num_full_blocks` blocks (computed, whole).
    fn observe_store(
        &self,
        block_hashes: &[BlockHash],
        block_ids: &[usize],
        num_full_blocks: usize,
    ) {
        let _ = (block_hashes, block_ids, num_full_blocks);
    }

    /// The engine evicted block `block_id`.
    fn observe_evict(&self, block_hashes: &[BlockHash], block_id: usize) {
        let _ = (block_hashes, block_id);
    }
}

/// The engine's block pool, as the connector needs it: blocks for pages it hydrates.
pub trait BlockSource: Send + Sync {
    /// `n` free blocks, or `None` when the pool has fewer.
    fn allocate(&self, n: usize) -> Option<Vec<usize>>;
    /// Gives blocks back (a load into them failed).
    fn free(&self, blocks: &[usize]);
}

/// What the connector did, for a report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnectorStats {
    /// `lookup_blocks` calls.
    pub lookups: u64,
    /// Blocks hydrated from the store.
    pub blocks_loaded: u64,
    /// Loads that failed (their blocks were given back; the engine computes them).
    pub loads_failed: u64,
    /// What the engine was told to do about each failed load.
    pub actions: Vec<EngineAction>,
    /// Blocks saved (written by this rank).
    pub blocks_saved: u64,
    /// Blocks a save skipped (already in the store).
    pub blocks_skipped: u64,
    /// Evictions observed.
    pub evictions: u64,
    /// Blocks the engine reused from its own cache (no store traffic).
    pub local_hits: u64,
    /// Blocks kept out of the pool after a reset said a late store call may still write them
    /// (`SlotsHeld`), and not given back yet.
    pub blocks_held_out: u64,
    /// Blocks given back once the outcomes of the loads that held them came.
    pub blocks_reclaimed: u64,
    /// The last error a hook swallowed (hooks return no errors), in words.
    pub last_error: Option<String>,
}

/// [`KvCacheConnector`] over a kvlink loader (the linker of this rank).
pub struct KvlinkConnector {
    loader: Arc<dyn KvLoader>,
    geometry: KvGeometry,
    blocks: Arc<dyn BlockSource>,
    next_batch: AtomicU64,
    stats: Mutex<ConnectorStats>,
    /// Blocks a late store call may still write, with the batches whose outcomes say when it
    /// returned (a `SlotsHeld` answer's): given back once every one of them came.
    held_out: Mutex<Vec<(HashSet<BatchId>, Vec<usize>)>>,
}

impl KvlinkConnector {
    /// A connector over `loader` (laid out as `geometry`), hydrating into `blocks`.
    pub fn new(
        loader: Arc<dyn KvLoader>,
        geometry: KvGeometry,
        blocks: Arc<dyn BlockSource>,
    ) -> Self {
        KvlinkConnector {
            loader,
            geometry,
            blocks,
            next_batch: AtomicU64::new(1),
            stats: Mutex::new(ConnectorStats::default()),
            held_out: Mutex::new(Vec::new()),
        }
    }

    /// What the connector did so far.
    pub fn stats(&self) -> ConnectorStats {
        self.stats_mut().clone()
    }

    fn note(&self, error: String) {
        self.stats_mut().last_error = Some(error);
    }

    fn stats_mut(&self) -> std::sync::MutexGuard<'_, ConnectorStats> {
        self.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives back the held-out blocks whose loads' outcomes came (`completed`): their late
    /// store calls returned, and nothing writes the blocks any more. `completed` hands out
    /// every finished outcome: this connector must be its loader's only user (the engine's
    /// one scheduler thread calls it). Besides the held loads', it takes there only the
    /// outcomes of loads it reset after their `finish` failed, which it needs no more.
    fn reclaim_held_out(&self) {
        let mut held = self.held_out.lock().unwrap_or_else(|e| e.into_inner());
        if held.is_empty() {
            return;
        }
        let came: HashSet<BatchId> = self.loader.completed().iter().map(|o| o.batch).collect();
        let mut freed = 0u64;
        held.retain_mut(|(batches, blocks)| {
            batches.retain(|b| !came.contains(b));
            if batches.is_empty() {
                self.blocks.free(blocks);
                freed += blocks.len() as u64;
            }
            !batches.is_empty()
        });
        drop(held);
        let mut s = self.stats_mut();
        s.blocks_held_out -= freed;
        s.blocks_reclaimed += freed;
    }

    fn plan(&self, pages: Vec<PageHash>, blocks: &[usize]) -> BatchPlan {
        let batch = BatchId(self.next_batch.fetch_add(1, Ordering::Relaxed));
        let slots = blocks.iter().map(|&b| b as u32).collect();
        let request = RequestPages {
            request: format!("connector-{}", batch.0).as_str().into(),
            pages,
        };
        BatchPlan::all_components(&self.geometry, batch, vec![request], slots)
    }

    /// Loads `plan` and waits for every layer: the blocks are hydrated when it returns Ok.
    /// A failure comes with what the engine does about it.
    fn hydrate(&self, plan: BatchPlan) -> Result<(), (KvLoadError, EngineAction)> {
        let with_action = |e: KvLoadError| {
            let action = e.action();
            (e, action)
        };
        let load = LoadHandle::start(self.loader.clone(), plan).map_err(with_action)?;
        for layer in 0..load.num_layers() {
            if load.wait_layer_on(layer, None).is_err() {
                break; // the outcome says why, the same on every rank
            }
        }
        match load.finish() {
            Ok(outcome) => outcome.result.map(|_| ()).map_err(with_action),
            // No outcome could be taken: the load may still write the blocks.
            Err(e) => Err((e, EngineAction::ResetThenRecompute)),
        }
    }
}

impl KvCacheConnector for KvlinkConnector {
    fn lookup_blocks(
        &self,
        block_hashes: &[BlockHash],
        group_ids: &[u32],
        max_blocks: usize,
    ) -> Option<Vec<usize>> {
        self.stats_mut().lookups += 1;
        self.reclaim_held_out();
        if group_ids.len() > 1 {
            return None; // one KV cache group (MLA's latent); hybrid caches are not mapped here
        }
        let asked = &block_hashes[..block_hashes.len().min(max_blocks)];
        let hit = match self.loader.lookup_pages(asked, 0) {
            Ok(hit) if !hit.pages.is_empty() => hit,
            Ok(_) => return None,
            Err(e) => {
                self.note(format!("lookup: {e}"));
                return None;
            }
        };
        // Alike on every rank of a TP group (see the module docs), or the ranks part here.
        let blocks = self.blocks.allocate(hit.pages.len())?;
        match self.hydrate(self.plan(hit.pages, &blocks)) {
            Ok(()) => {
                self.stats_mut().blocks_loaded += blocks.len() as u64;
                Some(blocks)
            }
            Err((e, action)) => {
                self.note(format!("load ({action:?}): {e}"));
                let mut s = self.stats_mut();
                s.loads_failed += 1;
                s.actions.push(action);
                drop(s);
                if action == EngineAction::ResetThenRecompute {
                    if let Err(e) = self.loader.reset() {
                        // SlotsHeld: a late store call may still write them; keep them out
                        // until the outcomes of the batches it names come.
                        self.note(format!("reset: {e}; blocks kept out of the pool"));
                        // Counted before the entry is there to be reclaimed.
                        self.stats_mut().blocks_held_out += blocks.len() as u64;
                        if let KvLoadError::SlotsHeld { batches } = &e {
                            let batches = batches.iter().copied().collect();
                            self.held_out
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((batches, blocks.clone()));
                        }
                        return None;
                    }
                }
                self.blocks.free(&blocks);
                None
            }
        }
    }

    fn observe_store(
        &self,
        block_hashes: &[BlockHash],
        block_ids: &[usize],
        num_full_blocks: usize,
    ) {
        let n = num_full_blocks.min(block_hashes.len()).min(block_ids.len());
        if n == 0 {
            return;
        }
        match self
            .loader
            .save(&self.plan(block_hashes[..n].to_vec(), &block_ids[..n]))
        {
            Ok(report) => {
                let mut s = self.stats_mut();
                s.blocks_saved += report.pages_written.len() as u64;
                s.blocks_skipped += report.pages_skipped.len() as u64;
            }
            // The blocks stay local only.
            Err(e) => self.note(format!("save ({:?}): {e}", e.action())),
        }
    }

    fn observe_hit(&self, _block_hashes: &[BlockHash], block_ids: &[usize], _computed: usize) {
        // The engine's own hit: nothing to load.
        self.stats_mut().local_hits += block_ids.len() as u64;
    }

    fn observe_evict(&self, _block_hashes: &[BlockHash], _block_id: usize) {
        // The store keeps its copy; a later lookup_blocks can hydrate it again.
        self.stats_mut().evictions += 1;
    }
}
