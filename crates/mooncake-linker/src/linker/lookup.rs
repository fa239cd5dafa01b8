//! Lookup: the longest run of pages the store holds after the engine's own hit.

use kv_geometry::page_hashes;
use kv_loader::{KvLoadError, LookupHit, LookupRequest};
use tracing::{debug, warn};

use super::{GroupFallback, Inner};
use crate::store::checked_results;

impl Inner {
    /// One batched `exists` over every component's key of every candidate page; the hit
    /// ends at the first page with any component missing.
    pub(crate) fn lookup(&self, req: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        let page_size = self.geometry.page_size();
        let all = page_hashes(req.tokens, page_size, None);
        let first = req.skip_pages.min(all.len());
        let candidates = &all[first..];
        let comps = self.geometry.components();
        let keys: Vec<String> = candidates
            .iter()
            .flat_map(|p| comps.iter().map(move |c| (p, c)))
            .map(|(p, c)| self.keys.object_key(p, c))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let present = checked_results(&refs, self.store.exists(&refs));
        let mut hit = 0;
        'pages: for (i, _) in candidates.iter().enumerate() {
            for j in 0..comps.len() {
                match present.get(i * comps.len() + j) {
                    Some(Ok(true)) => {}
                    Some(Ok(false)) | None => break 'pages,
                    Some(Err(e)) => {
                        return Err(KvLoadError::Store {
                            batch: None,
                            layer: None,
                            pages: vec![(first + i) as u32].into(),
                            kind: e.failure(),
                            detail: format!("lookup: {e}"),
                        })
                    }
                }
            }
            hit = i + 1;
        }
        if let Some(group) = &self.group {
            let deadline = kv_loader::deadline_after(self.config.collective_timeout);
            match group.handles(deadline) {
                Ok(handles) => {
                    let min = handles
                        .control
                        .all_reduce_min_u64(hit as u64, deadline)
                        .map_err(|e| KvLoadError::Collective {
                            batch: None,
                            detail: format!("lookup: {e}"),
                        })?;
                    hit = hit.min(min as usize);
                }
                Err(down) => match self.config.group_fallback {
                    GroupFallback::Fail => return Err(down.error(None)),
                    GroupFallback::ReadAlone => {
                        warn!(hit, reason = %down, "lookup alone: the TP group is down");
                    }
                },
            }
        }
        self.metrics.lookup(candidates.len() as u64, hit as u64);
        debug!(candidates = candidates.len(), hit, "lookup");
        Ok(LookupHit {
            pages: candidates[..hit].to_vec(),
            first_page: first,
            tokens: hit * page_size as usize,
        })
    }
}
