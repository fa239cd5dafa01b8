//! The replace path: an object a load found bad (wrong size, failed checksum) is discarded
//! with its checksum companion, so that the next save writes both again despite
//! first-write-wins, instead of every later hit failing and every save skipping it.

use std::time::Instant;

use kv_geometry::checksum_key;
use tracing::warn;

use crate::store::{StoreCalls, StoreError};

/// Discards `objects` and their checksum companions from the store (one call, bounded by
/// `deadline`). A key already gone is fine; any other failure is logged (the next load finds
/// the object bad again and retries). Returns how many objects (not companions) were
/// discarded.
pub(crate) fn discard_objects(calls: &StoreCalls, objects: &[&str], deadline: Instant) -> usize {
    if objects.is_empty() {
        return 0;
    }
    let companions: Vec<String> = objects.iter().map(|k| checksum_key(k)).collect();
    let keys: Vec<&str> = objects
        .iter()
        .copied()
        .chain(companions.iter().map(String::as_str))
        .collect();
    let results = calls.discard(&keys, deadline);
    let mut discarded = 0;
    for (i, (key, r)) in keys.iter().zip(results).enumerate() {
        match r {
            Ok(()) => discarded += usize::from(i < objects.len()),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => warn!(key, error = %e, "discarding a bad object failed"),
        }
    }
    warn!(
        objects = objects.len(),
        discarded, "bad objects discarded for the next save to rewrite"
    );
    discarded
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{no_hold, EmbeddedStore, KvStore, SourcePut};
    use kv_device::SaveSource;
    use std::sync::Arc;
    use std::time::Duration;

    fn put(calls: &StoreCalls, key: &str, bytes: &[u8]) {
        let p = SourcePut {
            key,
            parts: [SaveSource::from_bytes(Arc::new(bytes.to_vec()), 0..bytes.len()).unwrap()]
                .into_iter()
                .collect(),
        };
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        assert!(calls.put(&[p], no_hold(), soon)[0].is_ok());
    }

    #[test]
    fn objects_and_companions_go_and_missing_ones_are_fine() {
        let store = Arc::new(EmbeddedStore::new(1 << 20));
        let calls = StoreCalls::new(store.clone());
        put(&calls, "a_k", &[1; 8]);
        put(&calls, &checksum_key("a_k"), &[2; 8]);
        put(&calls, "b_k", &[3; 8]); // no companion: an object SGLang wrote
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        assert_eq!(
            discard_objects(&calls, &["a_k", "b_k", "gone_k"], soon()),
            2
        );
        let left = store.exists(&["a_k", "a_k_kvsum", "b_k"]);
        assert_eq!(left, vec![Ok(false), Ok(false), Ok(false)]);
        assert_eq!(discard_objects(&calls, &[], soon()), 0);
    }
}
