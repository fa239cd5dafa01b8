//! The objects a batch found at the wrong size and discarded, so that another check of the
//! same batch that then finds such an object gone says why (its size), not `NotFound`.
//!
//! Two checks of one batch may ask for an object's size at once: the preflight's, and the
//! check of a layer whose kept checksums failed (its companion absent, its size checked before
//! it is called bad). Whichever asks second finds the object already discarded by the first.
//! Without this record, the batch's error then depends on which came first (CI saw it): a
//! wrong size (`InvalidPlan`, the engine's `FixInput`) or a store failure (`NotFound`,
//! `Recompute`).

use std::collections::VecDeque;

use kv_loader::{BatchId, KvLoadError};
use parking_lot::Mutex;

/// Most records kept (the newest; a batch's race is over long before 32 more are found).
const KEPT: usize = 32;

/// Wrong-sized objects discarded, by batch and key (the newest [`KEPT`]).
#[derive(Debug, Default)]
pub(crate) struct WrongSized {
    entries: Mutex<VecDeque<(BatchId, String, KvLoadError)>>,
}

impl WrongSized {
    /// Batch `batch` found object `key` at the wrong size (`error`) and is about to discard it.
    pub(crate) fn record(&self, batch: BatchId, key: &str, error: &KvLoadError) {
        let mut e = self.entries.lock();
        if e.len() >= KEPT {
            e.pop_front();
        }
        e.push_back((batch, key.to_owned(), error.clone()));
    }

    /// Forgets what batch `batch` recorded: called as a batch starts, since the engine may
    /// start a batch id again once its outcome was taken (its checks are all over by then).
    pub(crate) fn forget(&self, batch: BatchId) {
        self.entries.lock().retain(|(b, _, _)| *b != batch);
    }

    /// Why batch `batch` discarded object `key`, if it did for its size.
    pub(crate) fn of(&self, batch: BatchId, key: &str) -> Option<KvLoadError> {
        let e = self.entries.lock();
        e.iter()
            .rev()
            .find(|(b, k, _)| *b == batch && k == key)
            .map(|(_, _, error)| error.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_answers_its_own_batch_and_key_only_and_the_oldest_go_first() {
        let w = WrongSized::default();
        let err = |b: u64| KvLoadError::config(format!("batch {b}"));
        w.record(BatchId(1), "k", &err(1));
        assert!(w.of(BatchId(1), "k").is_some());
        assert!(w.of(BatchId(2), "k").is_none(), "another batch");
        assert!(w.of(BatchId(1), "other").is_none(), "another key");
        // The same id started again: what its earlier run recorded is gone.
        w.forget(BatchId(1));
        assert!(w.of(BatchId(1), "k").is_none());
        w.record(BatchId(1), "k", &err(1));
        for b in 2..=(KEPT as u64) {
            w.record(BatchId(b), "k", &err(b));
        }
        assert!(w.of(BatchId(1), "k").is_some(), "still among the newest");
        w.record(BatchId(99), "k", &err(99));
        assert!(w.of(BatchId(1), "k").is_none(), "the oldest went");
        assert_eq!(w.entries.lock().len(), KEPT);
    }
}
