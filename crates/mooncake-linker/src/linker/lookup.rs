//! Lookup: the longest run of pages the store holds after the engine's own hit, agreed over
//! the TP group.
//!
//! Every rank issues exactly one (settled) gather per lookup on the control handle, whatever its own
//! lookup did (a store error included): a rank that failed counts a hit of 0 (and returns its
//! error), so the ranks' collectives never shift. The collective carries a digest of the
//! candidate pages: ranks that looked up different pages (or a control channel that shifted)
//! get no hit on any rank, and the group (both handles) is re-formed at its next use.

use dedup_broadcast::{agree_lookup, lookup_digest, LookupAgreement};
use kv_geometry::{page_hashes, PageHash};
use kv_loader::{KvLoadError, LookupHit, LookupRequest};
use tracing::{debug, warn};

use super::group::GroupLink;
use super::handle_use::Channel;
use super::{GroupFallback, Inner};
use crate::log_every::LogEvery;
use crate::store::StoreCalls;

impl Inner {
    /// One batched `exists` over every component's key of every candidate page (in a group,
    /// the replicated components' on rank 0 only); the hit ends at the first page with any
    /// component missing; then the group's minimum.
    pub(crate) fn lookup(&self, req: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        let all = page_hashes(req.tokens, self.geometry.page_size(), None);
        self.lookup_pages(&all, req.skip_pages)
    }

    /// [`lookup`](Self::lookup) of the prompt's page hashes (from its first page).
    pub(crate) fn lookup_pages(
        &self,
        all: &[PageHash],
        skip_pages: usize,
    ) -> Result<LookupHit, KvLoadError> {
        let page_size = self.geometry.page_size();
        let first = skip_pages.min(all.len());
        let candidates = &all[first..];
        let hit = match &self.group {
            None => self.local_hit(candidates, first, true),
            Some(link) => {
                // The replicated components' keys are every rank's: rank 0 alone asks for
                // them, and the group's minimum covers them on every rank.
                let local = self.local_hit(candidates, first, self.geometry.tp_rank() == 0);
                match self.group_hit(link, candidates, first, local) {
                    GroupHit::Agreed(hit) => hit,
                    GroupHit::Alone(local) => {
                        let alone = self.alone_hit(candidates, first, local);
                        if alone.is_ok() {
                            self.metrics.lookup_alone();
                        }
                        alone
                    }
                }
            }
        }
        // A failed lookup asked too and found nothing: the hit ratio falls with an outage.
        .inspect_err(|_| self.metrics.lookup(candidates.len() as u64, 0))?;
        self.metrics.lookup(candidates.len() as u64, hit as u64);
        debug!(candidates = candidates.len(), hit, "lookup");
        Ok(LookupHit {
            pages: candidates[..hit].to_vec(),
            first_page: first,
            tokens: hit * page_size as usize,
        })
    }

    /// This rank's own hit: pages in a row whose every component (with `replicated`; else
    /// its sharded ones only) the store holds. With none to ask for, every candidate.
    fn local_hit(
        &self,
        candidates: &[PageHash],
        first: usize,
        replicated: bool,
    ) -> Result<usize, KvLoadError> {
        let comps: Vec<_> = self
            .geometry
            .components()
            .iter()
            .filter(|c| replicated || !c.replicated)
            .collect();
        if comps.is_empty() {
            return Ok(candidates.len());
        }
        let keys: Vec<String> = candidates
            .iter()
            .flat_map(|p| comps.iter().map(move |c| (p, *c)))
            .map(|(p, c)| self.keys.object_key(p, c))
            .collect();
        present_run(
            &self.calls,
            &keys,
            comps.len(),
            first,
            self.store_deadline(),
        )
    }

    /// The hit of a rank that looks up alone (`GroupFallback::ReadAlone`, the group down):
    /// `local`, asked with every component on rank 0; a rank that left the replicated ones
    /// to rank 0 asks for them now.
    fn alone_hit(
        &self,
        candidates: &[PageHash],
        first: usize,
        local: Result<usize, KvLoadError>,
    ) -> Result<usize, KvLoadError> {
        if self.geometry.tp_rank() == 0 {
            return local;
        }
        self.local_hit(candidates, first, true)
    }

    /// The group's hit: one settled gather on the control handle whatever `local` is (this
    /// rank's own hit, or its sharded components' on a rank other than 0), or, where the
    /// group cannot answer and the engine configured reading alone, [`GroupHit::Alone`].
    /// Returns once it let go of the control handle and its turn on it.
    fn group_hit(
        &self,
        link: &GroupLink,
        candidates: &[PageHash],
        first: usize,
        local: Result<usize, KvLoadError>,
    ) -> GroupHit {
        // One lookup at a time on this rank's control handle (each bounded below): two at
        // once would interleave their gathers. Their order across ranks is the engine's. A
        // lookup holds the handle at most two `collective_timeout`s (a re-formation, then the
        // gather); one that waited that long for its turn goes without the group (its peers'
        // gather times out and the group re-forms).
        let turn_by = kv_loader::deadline_after(self.config.collective_timeout.saturating_mul(2));
        let Some(_turn) = link.lookup_turn(turn_by) else {
            let why = "another lookup of this rank held the group handle past two \
                       collective_timeouts (make group calls from one issuer per rank)";
            return self.without_group(why, local);
        };
        let reform_by = kv_loader::deadline_after(self.config.collective_timeout);
        // Marked in use to the lookup's end: a re-formation on the load thread leaves it.
        let (coll, _in_use) = match link.handles_for(Channel::Control, reform_by) {
            Ok((handles, in_use)) => (handles.control, in_use),
            Err(down) => {
                return match self.config.group_fallback {
                    GroupFallback::Fail => GroupHit::Agreed(Err(down.error(None))),
                    GroupFallback::ReadAlone => {
                        if link.down_lookup_log.due("lookup alone") {
                            warn!(
                                reason = %down,
                                "lookup alone: the TP group is down (logged once a minute \
                                 while it lasts)"
                            );
                        } else {
                            tracing::debug!(reason = %down, "lookup alone: the TP group is down");
                        }
                        GroupHit::Alone(local)
                    }
                };
            }
        };
        // The exchange's own bound, as a batch's gate takes after its re-formation: one that
        // just ended (it may end past `reform_by`) must not leave the gather no time, failing
        // and aborting the group every rank just formed.
        let deadline = kv_loader::deadline_after(self.config.collective_timeout);
        let digest = lookup_digest(first as u64, candidates);
        let mine = local.as_ref().ok().map(|&h| h as u64);
        match agree_lookup(coll.as_ref(), &digest, mine, deadline) {
            Ok(LookupAgreement::Hit(min)) => {
                GroupHit::Agreed(local.map(|hit| hit.min(min as usize)))
            }
            Ok(LookupAgreement::Mismatch { differing }) => {
                warn!(?differing, "ranks looked up different pages: no hit on any rank; the group re-forms at its next use");
                coll.abort("lookups differ across ranks");
                GroupHit::Agreed(local.map(|_| 0))
            }
            Err(e) => {
                // The ranks may no longer be in step on this channel: re-form it.
                coll.abort(&format!("lookup collective failed: {e}"));
                match self.config.group_fallback {
                    // As a batch whose gate failed: a peer that found the group down looks up
                    // alone, and so does this rank.
                    GroupFallback::ReadAlone => {
                        warn!(error = %e, "the lookup's collective failed: looking up alone");
                        GroupHit::Alone(local)
                    }
                    // The collective's error stays the detail's source
                    // (`downcast_ref::<CollectiveError>`).
                    GroupFallback::Fail => GroupHit::Agreed(Err(KvLoadError::Collective {
                        batch: None,
                        detail: kv_loader::Cause::with_source(format!("lookup: {e}"), e),
                    })),
                }
            }
        }
    }

    /// The lookup could not take its turn on the group handle (`why`): alone under
    /// `GroupFallback::ReadAlone`, else a `Collective` failure saying why.
    fn without_group(&self, why: &str, local: Result<usize, KvLoadError>) -> GroupHit {
        match self.config.group_fallback {
            GroupFallback::ReadAlone => {
                warn!(why, "looking up alone");
                GroupHit::Alone(local)
            }
            GroupFallback::Fail => GroupHit::Agreed(Err(KvLoadError::Collective {
                batch: None,
                detail: format!("lookup: {why}").into(),
            })),
        }
    }
}

/// What the group said of a lookup.
enum GroupHit {
    /// The group's hit on this rank, or why there is none.
    Agreed(Result<usize, KvLoadError>),
    /// The group could not answer and the engine configured reading alone: this rank's own
    /// hit (as asked in the group: a rank other than 0 asks for the replicated components
    /// again, [`Inner::alone_hit`], once it let go of the group handle).
    Alone(Result<usize, KvLoadError>),
}

/// How many pages in a row, from the first, have every one of their `per_page` keys in the
/// store: `keys` holds `per_page` keys per page, page after page (one batched `exists`). A
/// store error on the first page is the lookup's, naming plan page `first`; one on a later
/// page ends the run there (the pages before it are present: a shorter hit, as SGLang's
/// `batch_exists` answers), logged at `warn` once a minute. Before, it failed the whole
/// lookup: a transient error on page 1,000 threw away a 999-page hit.
pub(crate) fn present_run(
    calls: &StoreCalls,
    keys: &[String],
    per_page: usize,
    first: usize,
    deadline: std::time::Instant,
) -> Result<usize, KvLoadError> {
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let present = calls.exists(&refs, deadline);
    let pages = keys.len() / per_page.max(1);
    let mut hit = 0;
    for i in 0..pages {
        for j in 0..per_page {
            match present.get(i * per_page + j) {
                Some(Ok(true)) => {}
                Some(Ok(false)) | None => return Ok(hit),
                Some(Err(e)) if hit > 0 => {
                    static CUT_SHORT: LogEvery = LogEvery::new();
                    if CUT_SHORT.due("cut short") {
                        warn!(hit, page = first + i, error = %e, "lookup: a later page's presence could not be told: the hit ends before it");
                    } else {
                        debug!(hit, page = first + i, error = %e, "lookup: a later page's presence could not be told: the hit ends before it");
                    }
                    return Ok(hit);
                }
                Some(Err(e)) => {
                    return Err(KvLoadError::Store {
                        batch: None,
                        layer: None,
                        pages: vec![(first + i) as u32].into(),
                        kind: e.failure(),
                        // The store's error stays the source (`downcast_ref::<StoreError>`).
                        detail: kv_loader::Cause::with_source(format!("lookup: {e}"), e.clone()),
                    });
                }
            }
        }
        hit = i + 1;
    }
    Ok(hit)
}
