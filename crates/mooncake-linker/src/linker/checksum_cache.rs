//! The checksum companions this linker has read, kept so that a later load of the same objects
//! does not read them again.
//!
//! Before a load may publish layer 0 it needs the companion of every object it reads (one
//! small whole-object read each: on the pinned wheel's TCP path about 20 µs per key, so 20 ms
//! for a 32K-token prefix, on the same client as layer 0's own read). A prefix loaded again
//! (a shared system prompt, a conversation's next turn after the engine dropped its own copy)
//! has the same objects: their checksums are known. An entry can be stale only if its object
//! was evicted and written again with other bytes; a layer that fails against a cached
//! checksum is therefore checked again against its companion read afresh before its object is
//! called bad (see `verify`), and a bad object's entry is dropped.
//!
//! Bounded by entries (`LinkerConfig::checksum_cache_entries`; a GLM-5.2 companion decodes to
//! about 0.7 KB, its key about 0.1 KB), the oldest entry (by its last insertion) out first.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kv_geometry::ObjectChecksums;
use parking_lot::Mutex;

/// Decoded companions by object key, at most `capacity` of them.
#[derive(Debug)]
pub(crate) struct ChecksumCache {
    capacity: usize,
    entries: Mutex<Entries>,
}

#[derive(Debug, Default)]
struct Entries {
    /// Each key's checksums and the generation they were inserted at.
    by_key: HashMap<String, (Arc<ObjectChecksums>, u64)>,
    /// (key, generation) in insertion order; a pair whose generation is no longer its key's
    /// (removed, or inserted again since) is skipped.
    order: VecDeque<(String, u64)>,
    next: u64,
}

impl ChecksumCache {
    /// A cache of at most `capacity` entries (0: keeps nothing).
    pub(crate) fn new(capacity: usize) -> Self {
        ChecksumCache {
            capacity,
            entries: Mutex::new(Entries::default()),
        }
    }

    /// The checksums kept for the object `key`.
    pub(crate) fn get(&self, key: &str) -> Option<Arc<ObjectChecksums>> {
        self.entries.lock().by_key.get(key).map(|(s, _)| s.clone())
    }

    /// Keeps `sums` for the object `key` (replacing what was kept), dropping the oldest entries
    /// beyond the capacity.
    pub(crate) fn insert(&self, key: &str, sums: Arc<ObjectChecksums>) {
        if self.capacity == 0 {
            return;
        }
        let mut e = self.entries.lock();
        let generation = e.next;
        e.next += 1;
        e.by_key.insert(key.to_owned(), (sums, generation));
        e.order.push_back((key.to_owned(), generation));
        while e.by_key.len() > self.capacity {
            let Some((oldest, g)) = e.order.pop_front() else {
                break;
            };
            if e.by_key.get(&oldest).is_some_and(|(_, now)| *now == g) {
                e.by_key.remove(&oldest);
            }
        }
        // Pairs of keys removed or inserted again since stay in `order`: trim them when it
        // grows past twice the capacity, so it stays bounded too.
        if e.order.len() > self.capacity.saturating_mul(2) {
            let Entries { by_key, order, .. } = &mut *e;
            order.retain(|(k, g)| by_key.get(k).is_some_and(|(_, now)| now == g));
        }
    }

    /// Forgets every entry.
    pub(crate) fn clear(&self) {
        let mut e = self.entries.lock();
        e.by_key.clear();
        e.order.clear();
    }

    /// Forgets the object `key` (found bad, or its checksums stale).
    pub(crate) fn remove(&self, key: &str) {
        self.entries.lock().by_key.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl ChecksumCache {
        /// Entries kept.
        fn len(&self) -> usize {
            self.entries.lock().by_key.len()
        }
    }

    fn sums(v: u64) -> Arc<ObjectChecksums> {
        Arc::new(ObjectChecksums {
            layer_bytes: 8,
            sums: vec![v],
        })
    }

    #[test]
    fn keeps_at_most_its_capacity_oldest_out_first() {
        let c = ChecksumCache::new(2);
        c.insert("a", sums(1));
        c.insert("b", sums(2));
        c.insert("c", sums(3));
        assert_eq!(c.len(), 2);
        assert!(c.get("a").is_none());
        assert_eq!(c.get("b").unwrap().sums, vec![2]);
        assert_eq!(c.get("c").unwrap().sums, vec![3]);
        // Replacing keeps one entry and the new value.
        c.insert("c", sums(4));
        assert_eq!((c.len(), c.get("c").unwrap().sums.clone()), (2, vec![4]));
    }

    #[test]
    fn removed_keys_do_not_grow_the_order_without_bound() {
        let c = ChecksumCache::new(3);
        for i in 0..1000 {
            let k = format!("k{i}");
            c.insert(&k, sums(i));
            c.remove(&k);
        }
        assert_eq!(c.len(), 0);
        assert!(c.entries.lock().order.len() <= 7);
        c.insert("x", sums(9));
        assert_eq!(c.get("x").unwrap().sums, vec![9]);
    }

    #[test]
    fn a_key_inserted_again_is_the_newest_and_the_order_stays_bounded() {
        let c = ChecksumCache::new(2);
        c.insert("a", sums(1));
        c.insert("b", sums(2));
        for i in 0..1000 {
            c.remove("a");
            c.insert("a", sums(i));
        }
        assert!(c.entries.lock().order.len() <= 5);
        // "a" is now newer than "b": "b" goes first.
        c.insert("c", sums(3));
        assert!(c.get("b").is_none());
        assert_eq!(c.get("a").unwrap().sums, vec![999]);
        assert!(c.get("c").is_some());
    }

    #[test]
    fn capacity_zero_keeps_nothing() {
        let c = ChecksumCache::new(0);
        c.insert("a", sums(1));
        assert!(c.get("a").is_none());
    }

    #[test]
    fn a_capacity_meant_as_unbounded_takes_entries_without_overflow() {
        let c = ChecksumCache::new(usize::MAX);
        c.insert("a", sums(1));
        c.insert("b", sums(2));
        assert_eq!(c.len(), 2);
    }
}
