//! The landing memory a store writes into: registered when a linker is built, let go at
//! close (or, when store calls past their deadline still run, once the last of them returned),
//! and never freed while the store may still use it: each region keeps its memory allocated
//! ([`StoreRegion`](kv_device::StoreRegion)), and a region the store will not let go of is
//! kept for good ([`Registration`]). Registering and unregistering are store calls like the
//! others, side by side: all are waited for at most `store_call_timeout` (registering: and a
//! second per GB), on workers that keep each region until the store answers, so a store whose
//! metadata service hangs fails the linker's build in time and does not hold `close`.

use std::sync::Arc;
use std::time::Duration;

use kv_device::LandingFactory;
use kv_loader::KvLoadError;

use crate::store::{Registration, StoreCalls};

/// The landing memory registered with the store, let go (unregistered) when the last holder
/// drops it: the linker, and every store call past its deadline that may still write that
/// memory (through its memory hold). So a region is never unregistered while a call that
/// uses it runs.
pub(crate) struct Registered {
    regions: Vec<Registration>,
    /// The landings the store writes through (each region also keeps its own memory's owner,
    /// for as long as an unregister past its bound runs).
    _landings: Arc<dyn LandingFactory>,
}

impl Registered {
    /// Registers every store region of `landings` with `store`, side by side, all waited for
    /// at most `bound` and a second per GB of them (each later unregister for `bound`); on a
    /// failure, lets go of those already registered.
    /// `calls`: of the store, on workers of their own (their overdue calls are the linker's).
    pub(crate) fn new(
        calls: StoreCalls,
        landings: Arc<dyn LandingFactory>,
        bound: Duration,
    ) -> Result<Arc<Self>, KvLoadError> {
        let calls = Arc::new(calls);
        let regions = landings.store_regions();
        let bytes = regions
            .iter()
            .map(|r| r.len())
            .fold(0usize, usize::saturating_add);
        let deadline = kv_loader::deadline_after(registering_bound(bound, bytes));
        let regions = Registration::bounded_all(&calls, regions, deadline, bound).map_err(|e| {
            KvLoadError::config(kv_loader::Cause::with_source(
                format!("registering landing memory: {e}"),
                e,
            ))
        })?;
        Ok(Arc::new(Registered {
            regions,
            _landings: landings,
        }))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        // Side by side: one bound for all of them, not one per region.
        let failed = Registration::release_all(std::mem::take(&mut self.regions))
            .into_iter()
            .filter(Result::is_err)
            .count();
        if failed > 0 {
            tracing::warn!(
                failed,
                "landing memory not unregistered in time, or refused: kept allocated until the store lets go"
            );
        }
    }
}

/// How long registering `bytes` may take: one store call, and a second per GB more (over
/// RDMA registering pins and maps every page of the region; over TCP it is bookkeeping).
fn registering_bound(store_call: Duration, bytes: usize) -> Duration {
    store_call.saturating_add(Duration::from_secs_f64(bytes as f64 / 1e9))
}
