//! Registering memory with a store without `unsafe` at the call site: the region
//! ([`StoreRegion`]) keeps its memory allocated, and a [`Registration`] keeps the region until
//! the store has let go of it, or for good when it will not.

use std::sync::Arc;

use kv_device::StoreRegion;

use super::{KvStore, MemoryRegion, StoreError};

/// A region registered with a store. Dropping it (or [`release`](Registration::release))
/// unregisters it; when the store refuses (a transfer still in flight), the region is kept
/// for the rest of the process (its memory is never freed under the store).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::StoreRegion;
/// use mooncake_linker::store::{EmbeddedStore, KvStore, Registration};
/// let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
/// let buf: Arc<Vec<u8>> = Arc::new(vec![0; 4096]);
/// // SAFETY: `buf`'s bytes stay allocated while `buf` (the owner) lives.
/// let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
/// let reg = Registration::new(&store, region).unwrap();
/// reg.release().unwrap();
/// ```
pub struct Registration {
    store: Arc<dyn KvStore>,
    region: Option<StoreRegion>,
}

fn raw(region: &StoreRegion) -> MemoryRegion {
    MemoryRegion {
        addr: region.addr(),
        len: region.len(),
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("store", &self.store.name())
            .field("region", &self.region)
            .finish()
    }
}

impl Registration {
    /// Registers `region` with `store`.
    pub fn new(store: &Arc<dyn KvStore>, region: StoreRegion) -> Result<Self, StoreError> {
        // SAFETY: `region` keeps its memory allocated while it lives (its constructor's
        // contract). The registration keeps both the region and the store until `unregister`
        // returned `Ok`, and leaks the region when it did not, so the memory stays allocated
        // as long as the store may use it.
        unsafe { store.register(raw(&region)) }?;
        Ok(Registration {
            store: store.clone(),
            region: Some(region),
        })
    }

    /// The region.
    pub fn region(&self) -> Option<&StoreRegion> {
        self.region.as_ref()
    }

    /// Unregisters the region. On `Err` the region stays registered, and its memory
    /// allocated for the rest of the process.
    pub fn release(mut self) -> Result<(), StoreError> {
        self.let_go()
    }

    fn let_go(&mut self) -> Result<(), StoreError> {
        let Some(region) = self.region.take() else {
            return Ok(());
        };
        match self.store.unregister(raw(&region)) {
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::error!(error = %e, bytes = region.len(), "memory stays registered with the store: kept, never freed");
                std::mem::forget(region);
                Err(e)
            }
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EmbeddedStore;

    #[test]
    fn a_registration_keeps_its_memory_until_released() {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
        // SAFETY: `buf`'s bytes stay allocated while `buf` lives.
        let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
        let reg = Registration::new(&store, region).unwrap();
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the registration holds the owner"
        );
        reg.release().unwrap();
        assert_eq!(Arc::strong_count(&buf), 1, "released: the owner is let go");
    }
}
