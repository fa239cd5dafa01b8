//! The replace path: an object a load found bad (wrong size, failed checksum) is discarded
//! with its checksum companion, so that the next save writes both again despite
//! first-write-wins, instead of every later hit failing and every save skipping it. (A
//! wrong-sized object without a companion under a namespace other writers may share is left
//! in place: another writer's geometry may differ; see `reader::WrongSizeAction`.)

use std::time::Instant;

use kv_geometry::checksum_key;
use tracing::warn;

use crate::store::{objects_then_companions, StoreCalls};

/// Discards `objects` and then their checksum companions from the store (bounded by
/// `deadline`). A companion goes only once its object is gone (discarded now, or already
/// absent): an object left in place without its companion would pass later loads on its length
/// alone, and a save would skip it (first write wins). A key already gone is fine; any other
/// failure is logged (the next load finds the object bad again and retries). Returns how many
/// objects (not companions) were discarded.
pub(crate) fn discard_objects(calls: &StoreCalls, objects: &[&str], deadline: Instant) -> usize {
    if objects.is_empty() {
        return 0;
    }
    let companions: Vec<String> = objects.iter().map(|k| checksum_key(k)).collect();
    let companions: Vec<&str> = companions.iter().map(String::as_str).collect();
    let discarded =
        objects_then_companions(|keys| calls.discard(keys, deadline), objects, &companions);
    // How many went: a failure, or a discard sent past its deadline (not waited for), was
    // logged where it happened.
    warn!(
        objects = objects.len(),
        discarded, "bad objects found; `discarded` of them removed for the next save to rewrite"
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

    #[test]
    fn an_object_that_could_not_be_discarded_keeps_its_companion() {
        use crate::store::{Fault, FaultCall, FaultRule, FaultyStore, StoreError};
        let store = Arc::new(EmbeddedStore::new(1 << 20));
        let faulty = Arc::new(FaultyStore::new(store.clone()));
        let calls = StoreCalls::new(faulty.clone());
        put(&calls, "a_k", &[1; 8]);
        put(&calls, &checksum_key("a_k"), &[2; 8]);
        faulty.inject_on(
            FaultCall::Discard,
            FaultRule {
                key_contains: Some("a_k".into()),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Error(StoreError::RpcTimeout { key: "a_k".into() }),
        );
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        assert_eq!(discard_objects(&calls, &["a_k"], soon), 0);
        // The object stayed, so its checksums stay with it: a later load still finds it bad
        // rather than passing it on its length alone.
        assert_eq!(
            store.exists(&["a_k", "a_k_kvsum"]),
            vec![Ok(true), Ok(true)]
        );
    }
}
