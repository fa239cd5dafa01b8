//! The outcome of a batch, the same on every rank.

use std::time::Duration;

use crate::{BatchId, KvLoadError, ShareMode, TransferBytes};

/// What a loaded batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadStats {
    /// Pages loaded.
    pub pages: u32,
    /// Layers loaded.
    pub layers: u32,
    /// Bytes this rank read from the store.
    pub bytes_read: u64,
    /// Bytes that landed in this rank's pool.
    pub bytes_landed: u64,
    /// How replicated components were shared.
    pub mode: ShareMode,
    /// From `start_load` to the first layer ready.
    pub first_layer: Duration,
    /// From `start_load` until this rank was done with the batch: its last layer ready and,
    /// where it has them, the batch's closing status exchange and the end of its read session
    /// (a few ms past the last layer ready, unless one of those is slow).
    pub last_layer: Duration,
    /// Bytes this rank moved to land the batch, by direction (see [`TransferBytes`]).
    pub transfers: TransferBytes,
    /// The same, layer by layer (index = model layer; empty when the loader does not count
    /// per layer).
    pub layer_transfers: Vec<TransferBytes>,
    /// `Some(why)` when this rank loaded the batch alone, reading its own copy with no
    /// collective, because its TP group was down and the engine allowed that fallback (the
    /// linker's `group_fallback`); `None` for a batch loaded with the group (or by a loader
    /// without one).
    pub alone: Option<String>,
    /// Layers per store call of this rank's reads, in layer order (empty when the rank read
    /// nothing, or the loader does not group its reads).
    pub read_groups: Vec<u32>,
    /// Ranks whose logical plan for this batch differed from rank 0's: the batch then fell
    /// back to [`ShareMode::AllRanks`] (every rank read its own copy, so it still loaded).
    /// Empty when the ranks' plans agreed, or with no TP group. A non-empty list is an
    /// engine bug worth a metric: the ranks scheduled the batch differently.
    pub plans_differ: Vec<u32>,
}

/// A finished batch: loaded, or failed with the same error on every rank.
#[derive(Debug, Clone)]
pub struct BatchOutcome {
    /// The batch.
    pub batch: BatchId,
    /// Stats, or why it failed (the engine then recomputes the batch's pages).
    pub result: Result<LoadStats, KvLoadError>,
}

/// What a save did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Objects written.
    pub objects_written: u32,
    /// Objects skipped because the store already had them.
    pub objects_present: u32,
    /// Objects this rank does not own (replicated components on ranks other than 0).
    pub objects_not_owned: u32,
    /// Bytes written.
    pub bytes_written: u64,
    /// Plan page indices (in plan order) of which this rank wrote at least one object.
    pub pages_written: Vec<u32>,
    /// Plan page indices of which this rank wrote nothing: every object of the page it owns
    /// was already in the store, or it owns none (replicated components off rank 0).
    /// `pages_written` and `pages_skipped` are disjoint and together cover the plan.
    pub pages_skipped: Vec<u32>,
}

impl SaveReport {
    /// Fills `pages_skipped` as the plan pages `0..num_pages` not in `pages_written`, after
    /// sorting and de-duplicating `pages_written` and dropping from it any index past the plan
    /// (so that the two stay disjoint and cover exactly `0..num_pages`; a loader counts pages
    /// written as it goes, one object at a time, then calls this once).
    ///
    /// ```
    /// use kv_loader::SaveReport;
    /// let mut r = SaveReport { pages_written: vec![3, 1, 3], ..SaveReport::default() };
    /// r.settle_pages(5);
    /// assert_eq!((r.pages_written, r.pages_skipped), (vec![1, 3], vec![0, 2, 4]));
    /// ```
    pub fn settle_pages(&mut self, num_pages: usize) {
        let n = u32::try_from(num_pages).unwrap_or(u32::MAX);
        self.pages_written.retain(|&p| p < n);
        self.pages_written.sort_unstable();
        self.pages_written.dedup();
        let written = &self.pages_written;
        self.pages_skipped = (0..n)
            .filter(|p| written.binary_search(p).is_err())
            .collect();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn settled_pages_split_the_plan(
            n in 0usize..200,
            written in proptest::collection::vec(0u32..200, 0..300),
        ) {
            // Indices past the plan too (before, they stayed in `pages_written`).
            let mut r = SaveReport { pages_written: written.clone(), ..SaveReport::default() };
            let written: Vec<u32> = written.into_iter().filter(|&p| (p as usize) < n).collect();
            r.settle_pages(n);
            let mut all: Vec<u32> = r.pages_written.iter().chain(&r.pages_skipped).copied().collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..n as u32).collect::<Vec<_>>());
            prop_assert!(r.pages_written.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(written.iter().all(|p| r.pages_written.contains(p)));
        }
    }
}
