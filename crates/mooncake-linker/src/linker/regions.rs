//! The landing memory a store writes into: registered when a linker is built, let go at
//! close (or, when store calls past their deadline still run, once the last of them returned),
//! and never freed while the store may still use it.

use std::sync::Arc;

use kv_device::LandingFactory;
use kv_loader::KvLoadError;
use tracing::error;

use crate::store::{KvStore, MemoryRegion};

fn regions(landings: &dyn LandingFactory) -> Vec<MemoryRegion> {
    landings
        .store_regions()
        .into_iter()
        .map(|(addr, len)| MemoryRegion { addr, len })
        .collect()
}

/// Registers every store region of `landings` with `store`; on a failure, lets go of those
/// already registered.
pub(crate) fn register_regions(
    store: &Arc<dyn KvStore>,
    landings: &Arc<dyn LandingFactory>,
) -> Result<(), KvLoadError> {
    let all = regions(landings.as_ref());
    for (i, &region) in all.iter().enumerate() {
        // SAFETY: the region is memory the landing factory owns for as long as it lives (its
        // `store_regions` contract). The linker keeps `landings` until `release_regions` has
        // unregistered every region, and keeps it forever when that fails.
        if let Err(e) = unsafe { store.register(region) } {
            release(store, landings, &all[..i]);
            return Err(KvLoadError::Config(format!(
                "registering landing memory: {e}"
            )));
        }
    }
    Ok(())
}

/// Unregisters every store region of `landings`. A region the store will not let go (a
/// transfer still in flight) must not be freed: the landing factory (which owns it) is then
/// leaked, so its memory stays for the rest of the process.
pub(crate) fn release_regions(store: &Arc<dyn KvStore>, landings: &Arc<dyn LandingFactory>) {
    release(store, landings, &regions(landings.as_ref()));
}

fn release(store: &Arc<dyn KvStore>, landings: &Arc<dyn LandingFactory>, regions: &[MemoryRegion]) {
    let mut kept = 0usize;
    for &region in regions {
        if let Err(e) = store.unregister(region) {
            error!(error = %e, bytes = region.len, "landing memory stays registered: kept, never freed");
            kept += 1;
        }
    }
    if kept > 0 {
        std::mem::forget(Arc::clone(landings));
    }
}

/// The landing memory registered with the store, let go (unregistered) when the last holder
/// drops it: the linker, and every store call past its deadline that may still write that
/// memory (through its memory hold). So a region is never unregistered while a call that
/// uses it runs.
pub(crate) struct Registered {
    store: Arc<dyn KvStore>,
    landings: Arc<dyn LandingFactory>,
}

impl Registered {
    /// Registers every store region of `landings` with `store`.
    pub(crate) fn new(
        store: Arc<dyn KvStore>,
        landings: Arc<dyn LandingFactory>,
    ) -> Result<Arc<Self>, KvLoadError> {
        register_regions(&store, &landings)?;
        Ok(Arc::new(Registered { store, landings }))
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        release_regions(&self.store, &self.landings);
    }
}
