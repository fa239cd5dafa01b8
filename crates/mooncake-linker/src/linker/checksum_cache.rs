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
//! about 0.7 KB), the oldest entry out first.

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
    by_key: HashMap<String, Arc<ObjectChecksums>>,
    /// Keys in insertion order (a key removed early stays here until it reaches the front).
    order: VecDeque<String>,
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
        self.entries.lock().by_key.get(key).cloned()
    }

    /// Keeps `sums` for the object `key` (replacing what was kept), dropping the oldest entries
    /// beyond the capacity.
    pub(crate) fn insert(&self, key: &str, sums: ObjectChecksums) {
        if self.capacity == 0 {
            return;
        }
        let mut e = self.entries.lock();
        if e.by_key.insert(key.to_owned(), Arc::new(sums)).is_none() {
            e.order.push_back(key.to_owned());
        }
        while e.by_key.len() > self.capacity {
            let Some(oldest) = e.order.pop_front() else {
                break;
            };
            e.by_key.remove(&oldest);
        }
        // Keys removed early leave their place in `order`: trim it when it grows past twice
        // the entries, so it stays bounded too.
        if e.order.len() > 2 * self.capacity.max(1) {
            let Entries { by_key, order } = &mut *e;
            order.retain(|k| by_key.contains_key(k));
        }
    }

    /// Forgets the object `key` (found bad, or its checksums stale).
    pub(crate) fn remove(&self, key: &str) {
        self.entries.lock().by_key.remove(key);
    }

    /// Entries kept.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.lock().by_key.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(v: u64) -> ObjectChecksums {
        ObjectChecksums {
            layer_bytes: 8,
            sums: vec![v],
        }
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
    fn capacity_zero_keeps_nothing() {
        let c = ChecksumCache::new(0);
        c.insert("a", sums(1));
        assert!(c.get("a").is_none());
    }
}
