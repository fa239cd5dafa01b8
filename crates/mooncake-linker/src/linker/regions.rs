//! The landing memory a store writes into: registered when a linker is built, let go at
//! close (or, when store calls past their deadline still run, once the last of them returned),
//! and never freed while the store may still use it: each region keeps its memory allocated
//! ([`StoreRegion`](kv_device::StoreRegion)), and a region the store will not let go of is
//! kept for good ([`Registration`]).

use std::sync::Arc;

use kv_device::LandingFactory;
use kv_loader::KvLoadError;

use crate::store::{KvStore, Registration};

/// The landing memory registered with the store, let go (unregistered) when the last holder
/// drops it: the linker, and every store call past its deadline that may still write that
/// memory (through its memory hold). So a region is never unregistered while a call that
/// uses it runs.
pub(crate) struct Registered {
    _regions: Vec<Registration>,
    /// Kept while the memory is registered: the landings the store writes through.
    _landings: Arc<dyn LandingFactory>,
}

impl Registered {
    /// Registers every store region of `landings` with `store`; on a failure, lets go of
    /// those already registered.
    pub(crate) fn new(
        store: Arc<dyn KvStore>,
        landings: Arc<dyn LandingFactory>,
    ) -> Result<Arc<Self>, KvLoadError> {
        let regions = landings
            .store_regions()
            .into_iter()
            .map(|region| Registration::new(&store, region))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                KvLoadError::config(kv_loader::Cause::with_source(
                    format!("registering landing memory: {e}"),
                    e,
                ))
            })?;
        Ok(Arc::new(Registered {
            _regions: regions,
            _landings: landings,
        }))
    }
}
