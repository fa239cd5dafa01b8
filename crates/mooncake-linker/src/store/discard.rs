//! Discarding objects with their checksum companions: objects first, and a companion of one of
//! those objects only once its object is gone. A failing discard thus leaves an object with
//! its companion (later loads keep checking it) or a companion without its object; for the
//! objects it discards, this function never leaves one without its companion, which would
//! pass later loads on its length alone while a save skipped it (first write wins). A
//! companion passed without its object goes whatever that object's state: a caller passes
//! one when it means to drop it (a companion written beside another writer's object).
//!
//! It does not order itself against a save of the same key running beside it: such a save may
//! write the object again between the two discards, and that object then stands without its
//! companion.

use kv_geometry::checksum_key;
use tracing::warn;

use super::{checked_results, StoreError};

/// Discards `objects` with `discard`, then every key of `companions` but those of objects of
/// `objects` whose discard failed (those stay with their objects; a companion of an object not
/// in `objects` goes whatever that object's state). A key already gone is fine; any other
/// failure is logged. `discard` is the store's
/// call (bounded or not); a result list of the wrong length counts as failures. Returns how
/// many objects were discarded.
pub(crate) fn objects_then_companions(
    discard: impl Fn(&[&str]) -> Vec<Result<(), StoreError>>,
    objects: &[&str],
    companions: &[&str],
) -> usize {
    let mut discarded = 0;
    let mut staying = std::collections::HashSet::new();
    // One line per kind: a failed call fails every key alike (a store down).
    let mut first_failure: Option<(&str, StoreError)> = None;
    if !objects.is_empty() {
        for (key, r) in objects
            .iter()
            .zip(checked_results(objects, discard(objects)))
        {
            match r {
                Ok(()) => discarded += 1,
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => {
                    first_failure.get_or_insert((key, e));
                    staying.insert(checksum_key(key));
                }
            }
        }
    }
    if let Some((key, e)) = first_failure.take() {
        warn!(objects = staying.len(), first = key, error = %e,
            "objects could not be discarded: they stay, and so do their companions");
    }
    let companions: Vec<&str> = companions
        .iter()
        .copied()
        .filter(|c| !staying.contains(*c))
        .collect();
    if !companions.is_empty() {
        let mut failed = 0usize;
        for (key, r) in companions
            .iter()
            .zip(checked_results(&companions, discard(&companions)))
        {
            match r {
                Ok(()) | Err(StoreError::NotFound { .. }) => {}
                Err(e) => {
                    failed += 1;
                    first_failure.get_or_insert((key, e));
                }
            }
        }
        if let Some((key, e)) = first_failure {
            warn!(companions = failed, first = key, error = %e,
                "checksum companions could not be discarded");
        }
    }
    discarded
}
