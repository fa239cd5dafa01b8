//! Store writes from typed sources: the safe way to put objects. [`StoreCalls::put`] takes
//! [`SaveSource`]s (minted by kv-device: bytes the put shares, or host pool rows), holds them
//! until the store returns (past its deadline if it hangs), and only then makes the `unsafe`
//! [`KvStore::put`](super::KvStore::put) call.

use std::time::Instant;

use kv_device::SaveSource;
use smallvec::SmallVec;

use super::{Hold, KvStore, ObjectPut, PutOutcome, StoreCalls, StoreError};

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
        self.per_key_then(
            "put",
            keys,
            deadline,
            move |s, k| {
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
                // own bytes are never written again; a pool slot's source holds the slot's read
                // claim, which kvlink's landings and `write_slot` respect, and the engine's own
                // writes wait for, by the pool's contract: `SlotClaims::wait_free`).
                let r = unsafe { s.put(&puts) };
                if r.iter()
                    .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
                {
                    // The store gave up on a transfer that may still read these sources: kept for
                    // good.
                    let bytes = parts.iter().flatten().map(|p| p.len() as u64).sum();
                    super::keep_for_good(bytes, "a put's sources");
                    std::mem::forget(parts);
                    std::mem::forget(hold);
                } else {
                    drop(parts);
                    drop(hold);
                }
                r
            },
            discard_late_writes,
        )
    }
}

/// A put that returned after its caller gave up: the caller reported the save failed (its
/// host slots stayed claimed meanwhile; an engine that wrote them all the same raced the put).
/// What it wrote is discarded, so no object the engine was told failed, torn or not, stays
/// under first write wins: the objects first, then the checksum companions, each only once
/// its object is gone (discarded now, already absent, or not written by this put): an object
/// left without its companion would pass later loads on its length alone.
fn discard_late_writes(
    store: &dyn KvStore,
    keys: &[&str],
    results: Vec<Result<PutOutcome, StoreError>>,
) {
    let written: Vec<&str> = keys
        .iter()
        .zip(&results)
        .filter(|(_, r)| matches!(r, Ok(PutOutcome::Written)))
        .map(|(k, _)| *k)
        .collect();
    if written.is_empty() {
        return;
    }
    tracing::warn!(
        keys = written.len(),
        "a put returned after its deadline: what it wrote is discarded"
    );
    let (companions, objects): (Vec<&str>, Vec<&str>) = written
        .into_iter()
        .partition(|k| k.ends_with(kv_geometry::CHECKSUM_KEY_SUFFIX));
    // A companion written beside another writer's object goes too: it is this put's.
    super::objects_then_companions(|k| store.discard(k), &objects, &companions);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::store::{no_hold, EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, Stall};

    /// Counts the discards that reach the store.
    struct Discards {
        inner: EmbeddedStore,
        seen: AtomicU64,
    }

    // SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
    // writes reach the inner store, whose results it returns as they are or fails before it
    // (touching nothing); it starts no thread that touches caller memory.
    unsafe impl KvStore for Discards {
        crate::forward_store_calls!(inner => exists, object_size, get_into, get_ranges, put,
            remove, register, unregister, start_session, end_session, health);

        fn name(&self) -> &str {
            "discards"
        }

        fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            self.seen.fetch_add(keys.len() as u64, Ordering::Relaxed);
            self.inner.discard(keys)
        }
    }

    /// A put held past its deadline fails for its caller; when it returns, what it wrote is
    /// discarded (its sources may have been written again meanwhile), not left as a torn
    /// object that first write wins would keep.
    #[test]
    fn a_put_that_returns_after_its_deadline_leaves_nothing_written() {
        let inner = Arc::new(Discards {
            inner: EmbeddedStore::new(1 << 20),
            seen: AtomicU64::new(0),
        });
        let faulty = Arc::new(FaultyStore::new(inner.clone()));
        let stall = Stall::new();
        faulty.inject_on(
            FaultCall::Put,
            FaultRule::default(),
            Fault::Stall(stall.clone()),
        );
        let calls = StoreCalls::new(faulty);
        let put = SourcePut {
            key: "late",
            parts: [SaveSource::from_bytes(Arc::new(vec![9u8; 64]), 0..64).unwrap()]
                .into_iter()
                .collect(),
        };
        let soon = kv_loader::deadline_after(Duration::from_millis(50));
        assert!(calls.put(&[put], no_hold(), soon)[0].is_err());
        stall.release();
        // The late put writes, then its hook discards it: wait (bounded) for the discard.
        let limit = std::time::Instant::now() + Duration::from_secs(10);
        while inner.seen.load(Ordering::Relaxed) == 0 && std::time::Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(
            inner.seen.load(Ordering::Relaxed),
            1,
            "the late write was discarded"
        );
        assert_eq!(inner.exists(&["late"]), vec![Ok(false)]);
    }

    /// What a late put wrote goes objects first, then companions whose object is gone: a
    /// companion whose object's discard failed stays with it (the object would otherwise pass
    /// by length alone), one written beside another writer's object goes.
    #[test]
    fn a_late_puts_companion_goes_only_once_its_object_is_gone() {
        use kv_geometry::checksum_key;
        let inner = Arc::new(EmbeddedStore::new(1 << 20));
        let faulty = FaultyStore::new(inner.clone());
        let (c1, c2, c3) = (
            checksum_key("obj1"),
            checksum_key("obj2"),
            checksum_key("obj3"),
        );
        let all = [
            "obj1",
            c1.as_str(),
            "obj2",
            c2.as_str(),
            "obj3",
            c3.as_str(),
        ];
        for k in all {
            let bytes = [1u8; 8];
            // SAFETY: `bytes` lives across the call.
            let r = unsafe {
                inner.put(&[crate::store::ObjectPut {
                    key: k,
                    parts: [(bytes.as_ptr(), bytes.len())].into_iter().collect(),
                }])
            };
            assert_eq!(r, vec![Ok(PutOutcome::Written)]);
        }
        faulty.inject_on(
            FaultCall::Discard,
            FaultRule {
                key_contains: Some("obj1".into()),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Error(StoreError::Unavailable {
                detail: "injected".into(),
            }),
        );
        // obj3 was another writer's: only its companion is this put's.
        let keys = all;
        let results = keys
            .iter()
            .map(|k| {
                Ok(if *k == "obj3" {
                    PutOutcome::AlreadyPresent
                } else {
                    PutOutcome::Written
                })
            })
            .collect();
        discard_late_writes(&faulty, &keys, results);
        assert_eq!(
            inner.exists(&all),
            [true, true, false, false, true, false].map(Ok).to_vec()
        );
    }
}
