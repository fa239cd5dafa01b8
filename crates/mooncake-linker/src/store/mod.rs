//! Stores the linker reads from and writes to: the [`KvStore`] trait, the in-process
//! [`EmbeddedStore`], and Mooncake.

/// The [`KvStore`] methods a decorator hands to its `inner` store unchanged: everything but
/// `name` and the two reads, which decorators exist to change. Only the test doubles use it.
#[cfg_attr(not(any(test, feature = "testing")), allow(unused_macros))]
macro_rules! forward_to_inner {
    () => {
        fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
            self.inner.exists(keys)
        }

        fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
            self.inner.object_size(keys)
        }

        unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.inner.put(puts) }
        }

        fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            self.inner.remove(keys)
        }

        fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            self.inner.discard(keys)
        }

        unsafe fn register(&self, region: MemoryRegion) -> Result<(), StoreError> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.inner.register(region) }
        }

        fn unregister(&self, region: MemoryRegion) -> Result<(), StoreError> {
            self.inner.unregister(region)
        }

        fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
            self.inner.start_session(keys)
        }

        fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
            self.inner.end_session(session)
        }

        fn health(&self) -> Result<(), StoreError> {
            self.inner.health()
        }
    };
}

mod bounded;
mod checked;
mod embedded;
mod error;
#[cfg(any(test, feature = "testing"))]
mod faulty;
mod kv_store;
pub mod mooncake;
mod registration;
#[cfg(target_os = "linux")]
mod served;
#[cfg(any(test, feature = "testing"))]
mod simulated;
mod source_puts;
mod target_reads;

pub use checked::checked_results;
pub use embedded::EmbeddedStore;

pub use bounded::{no_hold, Hold, StoreCalls, MAX_WORKERS};
pub use error::StoreError;
/// Test doubles (feature `testing`): a store that injects faults, and one throttled like a
/// remote link.
#[cfg(any(test, feature = "testing"))]
pub use faulty::{Fault, FaultCall, FaultRule, FaultyStore, Stall, STALL_LIMIT};
pub use kv_store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangedGet, ReadRange, ReadSession,
};
pub use registration::Registration;
#[cfg(target_os = "linux")]
pub use served::{ServeAt, SocketStore, StoreServer, DEFAULT_REQUEST_TIMEOUT, STORE_ATTRIBUTE};
#[cfg(any(test, feature = "testing"))]
pub use simulated::{SimulatedLink, SimulatedRemoteStore};
pub use source_puts::SourcePut;
pub use target_reads::{TargetRange, TargetRead};
