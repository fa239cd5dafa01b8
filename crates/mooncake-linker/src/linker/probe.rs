//! The scheduler's side of a load: how much of a prompt every TP rank could load from the
//! store, asked from any process with a store client (no pool, no group, no GPU).

use std::sync::Arc;
use std::time::Duration;

use kv_geometry::{page_hashes, KeyScheme, KvGeometry, ModelKvSpec, PageHash};
use kv_loader::{KvLoadError, LookupHit};
use tracing::debug;

use super::lookup::present_run;
use super::LinkerConfig;
use crate::store::{KvStore, StoreCalls};

/// Answers a scheduler's question, "how many of this prompt's pages can the TP group load?",
/// without taking part in the group: it checks every key any rank would read (the replicated
/// components' one copy, and every rank's shard of the sharded ones) in one batched `exists`,
/// so its hit equals the one the ranks' collective [`lookup`](kv_loader::KvLoader::lookup)
/// agrees on (the group's minimum) when the store does not change in between.
///
/// It is the scheduler half of a split like vLLM's connector: a scheduler process (or thread)
/// that owns no KV pool asks the probe; the ranks then load with `start_load` on the hit's
/// pages, which are re-checked on the ranks (an object evicted in between fails that batch on
/// every rank, as `PeerFailed` with `store_not_found` in a group, and the engine recomputes).
/// It issues no collective, so any process may call it at any time.
///
/// ```
/// use std::sync::Arc;
/// use kv_geometry::ModelKvSpec;
/// use mooncake_linker::store::EmbeddedStore;
/// use mooncake_linker::{LinkerConfig, PrefixProbe};
/// let store = Arc::new(EmbeddedStore::new(1 << 20));
/// let probe = PrefixProbe::new(ModelKvSpec::llama3_70b(), 8, store, &LinkerConfig::default())?;
/// // An empty store holds no page of any prompt.
/// let hit = probe.probe(&[7u32; 256], 0)?;
/// assert_eq!((hit.pages.len(), hit.tokens), (0, 0));
/// # Ok::<(), kv_loader::KvLoadError>(())
/// ```
pub struct PrefixProbe {
    /// Rank 0's geometry: pages, components, and which are sharded.
    geometry: KvGeometry,
    /// One key scheme per TP rank (the sharded components' keys differ by rank); rank 0's
    /// alone when no component is sharded.
    schemes: Vec<KeyScheme>,
    calls: StoreCalls,
    store_call_timeout: Duration,
}

impl PrefixProbe {
    /// A probe for `spec` split over `tp_size` ranks, with the key settings of `config` (the
    /// namespace, CP and PP ranks, `store_call_timeout`): the same the ranks' linkers use.
    pub fn new(
        spec: ModelKvSpec,
        tp_size: u32,
        store: Arc<dyn KvStore>,
        config: &LinkerConfig,
    ) -> Result<Self, KvLoadError> {
        config.check()?;
        let geometry = KvGeometry::new(spec, tp_size, 0)?;
        // Every rank reads the same keys of replicated components: rank 0's scheme names
        // them all.
        let sharded = geometry.components().iter().any(|c| !c.replicated);
        let ranks = if sharded { tp_size } else { 1 };
        let schemes = (0..ranks)
            .map(|rank| {
                let g = KvGeometry::new(geometry.spec().clone(), tp_size, rank)?;
                Ok(KeyScheme::new(
                    &config.namespace.resolve(&g),
                    rank,
                    config.cp_rank,
                    config.pp_rank,
                ))
            })
            .collect::<Result<Vec<_>, KvLoadError>>()?;
        Ok(PrefixProbe {
            geometry,
            schemes,
            calls: StoreCalls::new(store),
            store_call_timeout: config.store_call_timeout,
        })
    }

    /// The loadable pages of a prompt after the engine's own hit of `skip_pages` pages (its
    /// tokens hashed as the ranks' `lookup` does).
    pub fn probe(&self, tokens: &[u32], skip_pages: usize) -> Result<LookupHit, KvLoadError> {
        let all = page_hashes(tokens, self.geometry.page_size(), None);
        self.probe_pages(&all, skip_pages)
    }

    /// [`probe`](Self::probe) of the prompt's page hashes (from its first page), as the
    /// ranks' `lookup_pages`.
    pub fn probe_pages(
        &self,
        all: &[PageHash],
        skip_pages: usize,
    ) -> Result<LookupHit, KvLoadError> {
        let first = skip_pages.min(all.len());
        let candidates = &all[first..];
        let keys = self.keys(candidates);
        let per_page = keys.len() / candidates.len().max(1);
        let deadline = kv_loader::deadline_after(self.store_call_timeout);
        let hit = present_run(&self.calls, &keys, per_page, first, deadline)?;
        debug!(candidates = candidates.len(), hit, "probe");
        Ok(LookupHit {
            pages: candidates[..hit].to_vec(),
            first_page: first,
            tokens: hit * self.geometry.page_size() as usize,
        })
    }

    /// Every key any rank reads for `pages`, page after page: each replicated component
    /// once, each sharded one once per rank.
    fn keys(&self, pages: &[PageHash]) -> Vec<String> {
        let comps = self.geometry.components();
        let mut keys = Vec::new();
        for page in pages {
            for c in comps {
                let ranks = if c.replicated {
                    &self.schemes[..1]
                } else {
                    &self.schemes[..]
                };
                keys.extend(ranks.iter().map(|s| s.object_key(page, c)));
            }
        }
        keys
    }
}

impl std::fmt::Debug for PrefixProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixProbe")
            .field("model", &self.geometry.spec().model)
            .field("tp_size", &self.geometry.tp_size())
            .finish_non_exhaustive()
    }
}
