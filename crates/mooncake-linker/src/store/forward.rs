//! [`forward_store_calls!`](crate::forward_store_calls): the calls a [`KvStore`] decorator
//! hands to its inner store unchanged.
//!
//! [`KvStore`]: crate::store::KvStore

/// Writes the [`KvStore`](crate::store::KvStore) methods a decorator passes to the store in
/// one of its fields unchanged, so that the decorator spells out only the calls it exists to
/// change (and `name`).
///
/// `forward_store_calls!(inner => exists, put, health)` writes `exists`, `put` and `health`,
/// each calling the same method of `self.inner` with the same arguments (the `unsafe` ones
/// with the caller's own promise). Any of the trait's methods but `name` may be listed; a
/// method left out keeps the trait's default where it has one (`get_ranges_checksummed`)
/// and must otherwise be written by hand.
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use mooncake_linker::forward_store_calls;
/// use mooncake_linker::store::{EmbeddedStore, KvStore, ReadSession, StoreError};
///
/// /// Counts the read sessions started through it.
/// struct Sessions {
///     inner: EmbeddedStore,
///     started: AtomicU64,
/// }
///
/// // SAFETY: every call reaches the embedded store, whose results come back unchanged.
/// unsafe impl KvStore for Sessions {
///     forward_store_calls!(inner => exists, object_size, get_into, get_ranges, put, remove,
///         discard, register, unregister, end_session, health);
///
///     fn name(&self) -> &str {
///         "sessions"
///     }
///
///     fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
///         self.started.fetch_add(1, Ordering::Relaxed);
///         self.inner.start_session(keys)
///     }
/// }
/// # let s = Sessions { inner: EmbeddedStore::new(1 << 10), started: AtomicU64::new(0) };
/// # assert_eq!(s.exists(&["k"]).len(), 1);
/// ```
#[macro_export]
macro_rules! forward_store_calls {
    ($field:ident => $($call:ident),+ $(,)?) => {
        $($crate::forward_store_calls!(@one $field $call);)+
    };
    (@one $field:ident exists) => {
        fn exists(&self, keys: &[&str]) -> Vec<Result<bool, $crate::store::StoreError>> {
            self.$field.exists(keys)
        }
    };
    (@one $field:ident object_size) => {
        fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, $crate::store::StoreError>> {
            self.$field.object_size(keys)
        }
    };
    (@one $field:ident get_into) => {
        unsafe fn get_into(
            &self,
            gets: &[$crate::store::ObjectGet<'_>],
        ) -> Vec<Result<u64, $crate::store::StoreError>> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.$field.get_into(gets) }
        }
    };
    (@one $field:ident get_ranges) => {
        unsafe fn get_ranges(
            &self,
            gets: &[$crate::store::RangedGet<'_>],
        ) -> Vec<Result<u64, $crate::store::StoreError>> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.$field.get_ranges(gets) }
        }
    };
    (@one $field:ident get_ranges_checksummed) => {
        unsafe fn get_ranges_checksummed(
            &self,
            gets: &[$crate::store::RangedGet<'_>],
            sums: &mut [$crate::store::RangeChecksums],
        ) -> Vec<Result<u64, $crate::store::StoreError>> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.$field.get_ranges_checksummed(gets, sums) }
        }
    };
    (@one $field:ident put) => {
        unsafe fn put(
            &self,
            puts: &[$crate::store::ObjectPut<'_>],
        ) -> Vec<Result<$crate::store::PutOutcome, $crate::store::StoreError>> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.$field.put(puts) }
        }
    };
    (@one $field:ident remove) => {
        fn remove(&self, keys: &[&str]) -> Vec<Result<(), $crate::store::StoreError>> {
            self.$field.remove(keys)
        }
    };
    (@one $field:ident discard) => {
        fn discard(&self, keys: &[&str]) -> Vec<Result<(), $crate::store::StoreError>> {
            self.$field.discard(keys)
        }
    };
    (@one $field:ident register) => {
        unsafe fn register(
            &self,
            region: $crate::store::MemoryRegion,
        ) -> Result<(), $crate::store::StoreError> {
            // SAFETY: forwarded with the caller's own promise.
            unsafe { self.$field.register(region) }
        }
    };
    (@one $field:ident unregister) => {
        fn unregister(
            &self,
            region: $crate::store::MemoryRegion,
        ) -> Result<(), $crate::store::StoreError> {
            self.$field.unregister(region)
        }
    };
    (@one $field:ident start_session) => {
        fn start_session(
            &self,
            keys: &[&str],
        ) -> Result<$crate::store::ReadSession, $crate::store::StoreError> {
            self.$field.start_session(keys)
        }
    };
    (@one $field:ident end_session) => {
        fn end_session(
            &self,
            session: &$crate::store::ReadSession,
        ) -> Result<(), $crate::store::StoreError> {
            self.$field.end_session(session)
        }
    };
    (@one $field:ident health) => {
        fn health(&self) -> Result<(), $crate::store::StoreError> {
            self.$field.health()
        }
    };
}
