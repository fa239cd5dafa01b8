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

/// Nothing loaded, in [`ShareMode::AllRanks`] (every rank reads its own copy, the mode of a
/// rank alone): for a [`KvLoader`](crate::KvLoader) of another crate to fill in the fields it
/// knows, `LoadStats { pages, layers, ..LoadStats::default() }`, and keep building when a
/// field is added.
impl Default for LoadStats {
    fn default() -> Self {
        LoadStats {
            pages: 0,
            layers: 0,
            bytes_read: 0,
            bytes_landed: 0,
            mode: ShareMode::AllRanks,
            first_layer: Duration::ZERO,
            last_layer: Duration::ZERO,
            transfers: TransferBytes::default(),
            layer_transfers: Vec::new(),
            alone: None,
            read_groups: Vec::new(),
            plans_differ: Vec::new(),
        }
    }
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
    /// `pages_written`, `pages_skipped` and `pages_not_saved` are disjoint and together cover
    /// the plan.
    pub pages_skipped: Vec<u32>,
    /// Objects this rank wrote and then discarded again, because their pair with their
    /// checksum companion could not be confirmed (a racing writer's companion beside them, or
    /// theirs lost): the store lacks them, unless the store refused the discard (logged; the
    /// object then stays, checked by length alone where its companion is gone). Not counted in
    /// `objects_written`.
    pub objects_discarded: u32,
    /// Plan page indices with an object discarded so (`objects_discarded`): the store lacks
    /// the page whole, and a later save writes it again. Taken out of `pages_written`.
    pub pages_not_saved: Vec<u32>,
}

impl SaveReport {
    /// Fills `pages_skipped` as the plan pages `0..num_pages` neither written nor not saved,
    /// after sorting and de-duplicating `pages_written` and `pages_not_saved`, dropping from
    /// them any index past the plan, and from `pages_written` the pages not saved (so that
    /// the three stay disjoint and cover exactly `0..num_pages`; a loader counts pages as it
    /// goes, one object at a time, then calls this once).
    ///
    /// ```
    /// use kv_loader::SaveReport;
    /// let mut r = SaveReport {
    ///     pages_written: vec![3, 1, 3, 2],
    ///     pages_not_saved: vec![2],
    ///     ..SaveReport::default()
    /// };
    /// r.settle_pages(5);
    /// assert_eq!((r.pages_written, r.pages_skipped), (vec![1, 3], vec![0, 4]));
    /// assert_eq!(r.pages_not_saved, vec![2]);
    /// ```
    pub fn settle_pages(&mut self, num_pages: usize) {
        let n = u32::try_from(num_pages).unwrap_or(u32::MAX);
        for pages in [&mut self.pages_written, &mut self.pages_not_saved] {
            pages.retain(|&p| p < n);
            pages.sort_unstable();
            pages.dedup();
        }
        let not_saved = &self.pages_not_saved;
        self.pages_written
            .retain(|p| not_saved.binary_search(p).is_err());
        let written = &self.pages_written;
        self.pages_skipped = (0..n)
            .filter(|p| written.binary_search(p).is_err() && not_saved.binary_search(p).is_err())
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
            not_saved in proptest::collection::vec(0u32..200, 0..20),
        ) {
            // Indices past the plan too (before, they stayed in `pages_written`).
            let mut r = SaveReport {
                pages_written: written.clone(),
                pages_not_saved: not_saved.clone(),
                ..SaveReport::default()
            };
            let in_plan = |p: &u32| (*p as usize) < n;
            let not_saved: Vec<u32> = not_saved.into_iter().filter(in_plan).collect();
            let written: Vec<u32> = written
                .into_iter()
                .filter(|p| in_plan(p) && !not_saved.contains(p))
                .collect();
            r.settle_pages(n);
            let mut all: Vec<u32> = r
                .pages_written
                .iter()
                .chain(&r.pages_skipped)
                .chain(&r.pages_not_saved)
                .copied()
                .collect();
            all.sort_unstable();
            prop_assert_eq!(all, (0..n as u32).collect::<Vec<_>>());
            prop_assert!(r.pages_written.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(r.pages_not_saved.windows(2).all(|w| w[0] < w[1]));
            prop_assert!(written.iter().all(|p| r.pages_written.contains(p)));
            prop_assert!(not_saved.iter().all(|p| r.pages_not_saved.contains(p)));
        }
    }

    /// A loader of another crate fills in what it knows and leaves the rest at nothing.
    #[test]
    fn default_stats_are_nothing_loaded_by_every_rank() {
        let s = LoadStats {
            pages: 3,
            layers: 61,
            ..LoadStats::default()
        };
        assert_eq!((s.pages, s.layers, s.bytes_read), (3, 61, 0));
        assert_eq!(s.mode, ShareMode::AllRanks);
        assert!(s.alone.is_none() && s.layer_transfers.is_empty() && s.plans_differ.is_empty());
    }
}
