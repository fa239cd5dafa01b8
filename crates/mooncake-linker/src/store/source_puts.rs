//! Store writes from typed sources: the safe way to put objects. [`StoreCalls::put`] takes
//! [`SaveSource`]s (minted by kv-device: bytes the put shares, or host pool rows), holds them
//! until the store returns (past its deadline if it hangs), and only then makes the `unsafe`
//! [`KvStore::put`](super::KvStore::put) call.

use std::time::Instant;

use kv_device::SaveSource;
use smallvec::SmallVec;

use super::{Hold, ObjectPut, PutOutcome, StoreCalls, StoreError};

/// A write of one object, gathered from typed sources in order.
#[derive(Debug, Clone)]
pub struct SourcePut<'k> {
    /// The object's key.
    pub key: &'k str,
    /// Source pieces; the object is their concatenation.
    pub parts: SmallVec<[SaveSource; 4]>,
}

impl SourcePut<'_> {
    /// Bytes of the object.
    pub fn len(&self) -> u64 {
        self.parts.iter().map(|p| p.len() as u64).sum()
    }

    /// True for an empty object.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl StoreCalls {
    /// [`KvStore::put`](super::KvStore::put), bounded: per key, what the put did, or
    /// [`StoreError::Overdue`] at `deadline` while the call goes on. The call holds every
    /// source (and `hold`: anything else to keep until it returns, e.g. the registration of
    /// the memory it reads) until the store returns.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use kv_device::SaveSource;
    /// use mooncake_linker::store::{no_hold, EmbeddedStore, PutOutcome, SourcePut, StoreCalls};
    /// let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
    /// let bytes = Arc::new(vec![7u8; 64]);
    /// let put = SourcePut {
    ///     key: "k",
    ///     parts: [SaveSource::from_bytes(bytes, 0..64).unwrap()].into_iter().collect(),
    /// };
    /// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
    /// assert_eq!(calls.put(&[put], no_hold(), deadline), vec![Ok(PutOutcome::Written)]);
    /// ```
    pub fn put(
        &self,
        puts: &[SourcePut<'_>],
        hold: Hold,
        deadline: Instant,
    ) -> Vec<Result<PutOutcome, StoreError>> {
        let keys: Vec<String> = puts.iter().map(|p| p.key.to_owned()).collect();
        let parts: Vec<SmallVec<[SaveSource; 4]>> = puts.iter().map(|p| p.parts.clone()).collect();
        self.per_key("put", keys, deadline, move |s, k| {
            let puts: Vec<ObjectPut<'_>> = k
                .iter()
                .zip(&parts)
                .map(|(key, parts)| ObjectPut {
                    key,
                    parts: parts
                        .iter()
                        .map(|p| (p.addr() as *const u8, p.len()))
                        .collect(),
                })
                .collect();
            // SAFETY: every part is a `SaveSource` this closure owns until the call has
            // returned: its bytes stay allocated meanwhile, and nothing writes them (a source's
            // own bytes are never written again; the engine does not write a pool slot while a
            // save of it is in progress).
            let r = unsafe { s.put(&puts) };
            if r.iter()
                .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
            {
                // The store gave up on a transfer that may still read these sources: kept for
                // good.
                std::mem::forget(parts);
                std::mem::forget(hold);
            } else {
                drop(parts);
                drop(hold);
            }
            r
        })
    }
}
