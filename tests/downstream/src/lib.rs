//! A tiny engine's prefill step written only against the `kvlink` facade, the way a
//! downstream crate uses it: lookup, start a load, wait for each layer before its attention,
//! take the outcome, act on a failure ([`EngineAction`]), save.
//!
//! Its tests (`tests/engine_flow.rs`) run it on `kvlink::mock::MockKvLoader` with the facade's
//! `mock` feature: the one dependency line an engine's tests need.

use std::sync::Arc;

use kvlink::kv_geometry::{page_hashes, ComponentId};
use kvlink::kv_loader::{
    BatchId, BatchPlan, EngineAction, KvLoadError, KvLoader, LoadHandle, LogicalPlan,
    LookupRequest, RequestPages,
};

/// What one prefill step did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// Pages that came from the store.
    pub loaded_pages: usize,
    /// Pages the engine computed itself because their load failed.
    pub recomputed_pages: usize,
    /// Layers the forward pass ran.
    pub layers_run: u32,
    /// What the engine did about a failed load, if one failed.
    pub action: Option<EngineAction>,
}

/// An engine whose requests each land their pages in page slots `0..` of its pool.
pub struct TinyEngine {
    loader: Arc<dyn KvLoader>,
    page_size: u32,
    next_batch: u64,
}

impl std::fmt::Debug for TinyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TinyEngine")
            .field("page_size", &self.page_size)
            .finish_non_exhaustive()
    }
}

impl TinyEngine {
    /// An engine over `loader`, whose pages hold `page_size` tokens.
    pub fn new(loader: Arc<dyn KvLoader>, page_size: u32) -> Self {
        TinyEngine {
            loader,
            page_size,
            next_batch: 1,
        }
    }

    /// Prefills `tokens` of `request`: loads what the store has, recomputes what failed,
    /// saves the whole pages. Errors are the loader's refusals the engine cannot act on.
    pub fn prefill(&mut self, request: &str, tokens: &[u32]) -> Result<Step, KvLoadError> {
        let batch = BatchId(self.next_batch);
        self.next_batch += 1;
        let hit = self.loader.lookup(&LookupRequest {
            tokens,
            skip_pages: 0,
        })?;
        let n = hit.pages.len();
        let plan = |pages: Vec<_>| BatchPlan {
            logical: LogicalPlan {
                batch,
                requests: vec![RequestPages {
                    request: request.into(),
                    pages,
                }],
                // The tiny model's one component (a plan with pages names at least one).
                components: vec![ComponentId(0)],
            },
            slots: (0..n as u32).collect(),
        };
        let load = LoadHandle::start(self.loader.clone(), plan(hit.pages.clone()))?;
        let mut waits_failed = false;
        let mut layers_run = 0;
        for layer in 0..load.num_layers() {
            // Before attention on `layer`; after a failed wait, run on without the prefix.
            if !waits_failed && load.wait_layer_on(layer, None).is_err() {
                waits_failed = true;
            }
            layers_run += 1;
        }
        let action = match load.finish() {
            Ok(outcome) => outcome.result.err().map(|e| e.action()),
            // No outcome could be taken: the load may still write its slots.
            Err(_) => Some(EngineAction::ResetThenRecompute),
        };
        if action == Some(EngineAction::ResetThenRecompute) {
            self.loader.reset()?;
        }
        let (loaded_pages, recomputed_pages) = match action {
            None => (n, 0),
            Some(_) => (0, n),
        };
        let whole = page_hashes(tokens, self.page_size, None);
        let mut save = plan(whole);
        save.slots = (0..save.logical.num_pages() as u32).collect();
        self.loader.save(&save)?;
        Ok(Step {
            loaded_pages,
            recomputed_pages,
            layers_run,
            action,
        })
    }
}
