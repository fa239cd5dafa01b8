//! Which batches a rank loaded alone (without its group), as its batch gate word carries it,
//! and what a rank behind the group learns from the words of the ranks ahead.
//!
//! A rank that finds the group down may load a batch alone (`GroupFallback::ReadAlone`); when
//! it meets the group again, a peer still at that batch must end it the same way: load it
//! alone where every rank ahead did, fail it otherwise. The record says so by batch id, in
//! runs: batches loaded alone one after another are one run, whatever gaps the engine leaves
//! between its batch ids (a batch settled otherwise, refused or failed, ends a run). It keeps
//! the last [`ALONE_RUNS`] runs, and besides them a mask of the last 64 batch ids (as the
//! record was before it had runs): a batch whose run dropped out is told by the mask while it
//! is among the last 64 ids, and not told of after.

use std::ops::RangeInclusive;

/// Runs of batches loaded alone one record keeps.
pub const ALONE_RUNS: usize = 16;

/// Bytes of a record on the wire: the runs' span (first and last batch, 16 bytes), a flag and
/// the number of runs (8 bytes, the rest zero), the record's origin and the mask of the last
/// 64 ids (16 bytes), then each run's first and last batch; integers little-endian.
pub(crate) const ALONE_WIRE: usize = 40 + 16 * ALONE_RUNS;

/// Which of a rank's settled batches it loaded alone. The runs tell of the batch ids from the
/// first settled to the last (the first moves up as old runs drop out): a batch in that span
/// was loaded alone when a run covers it, and settled otherwise (loaded with the group,
/// failed, refused, cancelled) when none does. Below that span, the mask of the last 64 ids
/// tells, back to the record's origin (its first batch since it started, or started again).
/// Ids the rank never ran read as the run around them says, or as not loaded alone (a rank
/// is asked only of batches it ran).
///
/// ```
/// use dedup_broadcast::AloneLoads;
/// let mut a = AloneLoads::default();
/// assert_eq!(a.loaded_alone(7), None); // nothing settled: nothing told
/// a.settled(7, true);
/// a.settled(100, true); // the engine's ids jump: 7 stays told
/// a.settled(200, false); // refused: 7 and 100 stay loaded alone
/// assert_eq!(a.loaded_alone(7), Some(true));
/// assert_eq!(a.loaded_alone(100), Some(true));
/// assert_eq!(a.loaded_alone(200), Some(false));
/// assert_eq!(a.loaded_alone(6), None);
/// assert_eq!(a.loaded_alone(201), None);
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AloneLoads {
    /// The first and last batch ids the runs tell of (`None`: nothing settled yet).
    told: Option<(u64, u64)>,
    /// The first batch settled since the record started: nothing before it is told.
    origin: u64,
    /// Bit `k`: batch `last - k` was loaded alone (clear for ids before `origin`).
    mask: u64,
    /// Runs of batches loaded alone, oldest first, disjoint, inside `told`; `runs[len..]` are
    /// zero.
    runs: [(u64, u64); ALONE_RUNS],
    len: usize,
}

impl AloneLoads {
    /// Batch `batch` is settled, loaded alone or not. Batch ids increase; an id not above the
    /// last (an id run again, or ids started again) replaces what the record said of it and
    /// of every later id (and an id at or below the record's origin starts it anew).
    pub fn settled(&mut self, batch: u64, alone: bool) {
        if let Some((_, last)) = self.told {
            if batch <= self.origin {
                *self = AloneLoads::default();
            } else if batch <= last {
                self.forget_from(batch);
            }
        }
        let previous = self.told.map(|(_, last)| last);
        // `batch` is above `previous` here: the mask moves on by the ids between.
        let kept = match previous.map(|p| batch - p) {
            Some(shift) if shift < 64 => self.mask << shift,
            _ => 0,
        };
        self.mask = kept | u64::from(alone);
        if self.told.is_none() {
            self.origin = batch;
        }
        self.told = Some((self.told.map_or(batch, |(first, _)| first), batch));
        if !alone {
            return;
        }
        match self.runs[..self.len].last_mut() {
            Some(run) if Some(run.1) == previous => run.1 = batch,
            _ => self.push((batch, batch)),
        }
    }

    /// Whether this rank loaded batch `batch` alone; `None` when the record does not tell
    /// (before its origin, after its last batch, below the runs and 64 ids or more before
    /// the last, or nothing settled).
    pub fn loaded_alone(&self, batch: u64) -> Option<bool> {
        let (first, last) = self.told?;
        if batch > last || batch < self.origin {
            return None;
        }
        if batch >= first {
            return Some(
                self.runs[..self.len]
                    .iter()
                    .any(|&(a, b)| (a..=b).contains(&batch)),
            );
        }
        let k = last - batch;
        (k < 64).then(|| self.mask >> k & 1 == 1)
    }

    /// The batch ids the runs tell of (`None`: nothing settled yet); the mask tells of the
    /// last 64 ids, back to the record's origin.
    pub fn told(&self) -> Option<RangeInclusive<u64>> {
        self.told.map(|(first, last)| first..=last)
    }

    /// The runs of batches loaded alone, oldest first.
    pub fn runs(&self) -> impl Iterator<Item = RangeInclusive<u64>> + '_ {
        self.runs[..self.len].iter().map(|&(a, b)| a..=b)
    }

    /// Drops what the record says of `batch` and later ids (`batch` is above the origin).
    fn forget_from(&mut self, batch: u64) {
        let kept = self.runs[..self.len]
            .iter()
            .take_while(|(a, _)| *a < batch)
            .count();
        for run in &mut self.runs[..kept] {
            run.1 = run.1.min(batch - 1);
        }
        self.runs[kept..].fill((0, 0));
        self.len = kept;
        if let Some((first, last)) = &mut self.told {
            // Bits 0 ..= last - batch are the ids dropped.
            let dropped = *last - batch + 1;
            self.mask = if dropped < 64 {
                self.mask >> dropped
            } else {
                0
            };
            *first = (*first).min(batch);
            *last = batch - 1;
        }
    }

    /// Adds a run, dropping the oldest when the record is full (the record then tells of
    /// the batches after the dropped run only).
    fn push(&mut self, run: (u64, u64)) {
        if self.len == ALONE_RUNS {
            let dropped = self.runs[0];
            self.runs.copy_within(1.., 0);
            self.len -= 1;
            self.runs[self.len] = (0, 0);
            if let Some((first, _)) = &mut self.told {
                *first = dropped.1 + 1;
            }
        }
        self.runs[self.len] = run;
        self.len += 1;
    }

    /// The wire bytes (see [`ALONE_WIRE`]).
    pub(crate) fn encode(&self) -> [u8; ALONE_WIRE] {
        let mut w = [0u8; ALONE_WIRE];
        let (first, last) = self.told.unwrap_or((0, 0));
        w[..8].copy_from_slice(&first.to_le_bytes());
        w[8..16].copy_from_slice(&last.to_le_bytes());
        w[16] = u8::from(self.told.is_some());
        w[17] = self.len as u8;
        w[24..32].copy_from_slice(&self.origin.to_le_bytes());
        w[32..40].copy_from_slice(&self.mask.to_le_bytes());
        for (i, (a, b)) in self.runs.iter().enumerate() {
            let at = 40 + 16 * i;
            w[at..at + 8].copy_from_slice(&a.to_le_bytes());
            w[at + 8..at + 16].copy_from_slice(&b.to_le_bytes());
        }
        w
    }

    /// The record of `bytes`, or `None` when they are not one a rank could have sent (the
    /// decoding of every record's encoding is that record, and nothing else decodes).
    pub(crate) fn decode(bytes: &[u8]) -> Option<AloneLoads> {
        if bytes.len() != ALONE_WIRE || bytes[18..24].iter().any(|&b| b != 0) {
            return None;
        }
        let u = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let len = usize::from(bytes[17]);
        let told = match bytes[16] {
            0 => None,
            1 => Some((u(0), u(8))),
            _ => return None,
        };
        if len > ALONE_RUNS {
            return None;
        }
        let mut record = AloneLoads {
            told,
            origin: u(24),
            mask: u(32),
            len,
            ..AloneLoads::default()
        };
        for (i, run) in record.runs.iter_mut().enumerate() {
            *run = (u(40 + 16 * i), u(48 + 16 * i));
        }
        (record.encode()[..] == *bytes && record.well_formed()).then_some(record)
    }

    /// Runs in order, disjoint and inside the span told of, which starts at or after the
    /// origin; no mask bit before the origin; nothing told, nothing else.
    fn well_formed(&self) -> bool {
        let Some((first, last)) = self.told else {
            return self.len == 0 && self.origin == 0 && self.mask == 0;
        };
        let span = last.saturating_sub(self.origin);
        if self.origin > first || (span < 63 && self.mask >> (span + 1) != 0) {
            return false;
        }
        let mut floor = first;
        for &(a, b) in &self.runs[..self.len] {
            if a < floor || a > b || b > last {
                return false;
            }
            floor = b.saturating_add(1);
        }
        first <= last && self.runs[self.len..].iter().all(|&r| r == (0, 0))
    }
}

/// What the ranks at a later batch than this rank's said at a gate: each one's batch and
/// its record of batches loaded alone. A rank behind keeps it past the gate: should the group
/// then break before it catches up (the ranks ahead gave up waiting for it), it still settles
/// each batch it is behind on as they did, failing a batch a rank ahead did not load alone.
///
/// ```
/// use dedup_broadcast::{AloneLoads, RanksAhead};
/// let mut loaded = AloneLoads::default();
/// loaded.settled(4, true);
/// loaded.settled(5, false);
/// let ahead = RanksAhead { ranks: vec![(6, loaded)] };
/// assert_eq!(ahead.settled_alone(4), Some(true));
/// assert_eq!(ahead.settled_alone(5), Some(false));
/// assert_eq!(ahead.settled_alone(6), None); // no rank was past batch 6
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RanksAhead {
    /// Each rank ahead's batch at the gate and its record of batches loaded alone.
    pub ranks: Vec<(u64, AloneLoads)>,
}

impl RanksAhead {
    /// Whether every rank that was past `batch` loaded it alone, counting the ranks whose
    /// record tells of it (a rank that started again since, or whose record dropped it, does
    /// not count; when none tells, the batch was not loaded alone as far as the group
    /// knows). `None` when no rank was past it (those ranks had not settled it yet).
    pub fn settled_alone(&self, batch: u64) -> Option<bool> {
        let mut past = self.ranks.iter().filter(|(at, _)| *at > batch).peekable();
        past.peek()?;
        let mut told = false;
        for (_, record) in past {
            match record.loaded_alone(batch) {
                Some(false) => return Some(false),
                Some(true) => told = true,
                None => {}
            }
        }
        Some(told)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn record(settles: &[(u64, bool)]) -> AloneLoads {
        let mut a = AloneLoads::default();
        settles.iter().for_each(|&(b, alone)| a.settled(b, alone));
        a
    }

    #[test]
    fn gaps_in_batch_ids_keep_what_was_loaded_alone() {
        let a = record(&[(1, true), (100, true), (200, false)]);
        assert_eq!(a.loaded_alone(1), Some(true));
        assert_eq!(a.loaded_alone(100), Some(true));
        assert_eq!(a.loaded_alone(200), Some(false));
        assert_eq!(a.runs().collect::<Vec<_>>(), [1..=100]);
    }

    #[test]
    fn seventy_batches_alone_are_one_run() {
        let settles: Vec<_> = (1..=70).map(|b| (b, true)).collect();
        let a = record(&settles);
        assert!((1..=70).all(|b| a.loaded_alone(b) == Some(true)));
        assert_eq!(a.runs().count(), 1);
    }

    #[test]
    fn the_oldest_run_drops_out_and_is_no_longer_told() {
        // More runs than a record keeps, 100 ids apart: batches 100k alone, 100k + 1 not.
        let outages = ALONE_RUNS as u64 + 1;
        let settles: Vec<_> = (1..=outages)
            .flat_map(|k| [(100 * k, true), (100 * k + 1, false)])
            .collect();
        let a = record(&settles);
        assert_eq!(a.runs().count(), ALONE_RUNS);
        assert_eq!(a.told(), Some(101..=100 * outages + 1));
        assert_eq!(a.loaded_alone(100), None, "dropped out, and past the mask");
        assert_eq!(a.loaded_alone(101), Some(false));
        assert_eq!(a.loaded_alone(200), Some(true));
        assert_eq!(a.loaded_alone(100 * outages), Some(true));
    }

    /// Runs cut short by batches settled otherwise (an engine that refuses every other batch
    /// while the group is down) use up the runs: the mask of the last 64 ids still tells of
    /// the batches whose run dropped out. Before the mask was kept beside the runs, batch 1
    /// read as not told, and a rank behind failed it while this rank had loaded it.
    #[test]
    fn runs_cut_short_leave_the_last_64_ids_to_the_mask() {
        let pairs = ALONE_RUNS as u64 + 1;
        let settles: Vec<_> = (0..pairs)
            .flat_map(|k| [(2 * k + 1, true), (2 * k + 2, false)])
            .collect();
        let a = record(&settles);
        assert_eq!(a.told(), Some(2..=2 * pairs), "the first run dropped out");
        assert_eq!(a.loaded_alone(1), Some(true));
        assert_eq!(a.loaded_alone(2), Some(false));
        assert_eq!(a.loaded_alone(3), Some(true));
        assert_eq!(a.loaded_alone(0), None, "before the origin");
    }

    #[test]
    fn an_id_run_again_replaces_what_was_said_of_it_and_later_ids() {
        let mut a = record(&[(5, true), (6, true), (7, true)]);
        a.settled(6, false);
        assert_eq!(a.loaded_alone(5), Some(true));
        assert_eq!(a.loaded_alone(6), Some(false));
        assert_eq!(a.loaded_alone(7), None, "not settled since");
        a.settled(7, true);
        assert_eq!(a.runs().collect::<Vec<_>>(), [5..=5, 7..=7]);
        // Ids started again below the first told: a new record.
        a.settled(2, true);
        assert_eq!(a.told(), Some(2..=2));
        assert_eq!(a.loaded_alone(5), None);
    }

    #[test]
    fn a_rank_that_does_not_tell_of_a_batch_does_not_count() {
        let loaded = record(&[(3, true), (4, true)]);
        let restarted = record(&[(9, false)]);
        let ahead = RanksAhead {
            ranks: vec![(10, restarted), (10, loaded)],
        };
        assert_eq!(ahead.settled_alone(3), Some(true));
        // Only the restarted rank is past: nothing told, so not loaded alone.
        let only = RanksAhead {
            ranks: vec![(10, restarted)],
        };
        assert_eq!(only.settled_alone(3), Some(false));
        let failed = RanksAhead {
            ranks: vec![(10, record(&[(3, false)])), (10, loaded)],
        };
        assert_eq!(failed.settled_alone(3), Some(false));
    }

    #[test]
    fn words_that_are_not_a_record_do_not_decode() {
        let good = record(&[(5, true), (7, false), (9, true)]).encode();
        assert!(AloneLoads::decode(&good).is_some());
        let mut bad_flag = good;
        bad_flag[16] = 2;
        let mut too_many = good;
        too_many[17] = ALONE_RUNS as u8 + 1;
        let mut out_of_order = good;
        // Runs (9, 9) and (9, 9): not disjoint.
        out_of_order[40..48].copy_from_slice(&9u64.to_le_bytes());
        out_of_order[48..56].copy_from_slice(&9u64.to_le_bytes());
        let mut reserved = good;
        reserved[20] = 1;
        // A mask bit for an id before the origin (5): bit 5 is batch 4.
        let mut before_origin = good;
        before_origin[32] |= 1 << 5;
        let mut origin_past_runs = good;
        origin_past_runs[24..32].copy_from_slice(&6u64.to_le_bytes());
        for (what, bytes) in [
            ("flag", bad_flag),
            ("runs", too_many),
            ("order", out_of_order),
            ("reserved", reserved),
            ("mask", before_origin),
            ("origin", origin_past_runs),
        ] {
            assert_eq!(AloneLoads::decode(&bytes), None, "{what}");
        }
        assert_eq!(AloneLoads::decode(&good[1..]), None, "length");
    }

    proptest! {
        /// Every record settles into one that round-trips on the wire and tells the truth of
        /// every id it tells of (the last settle of an id, or the earlier ones it kept).
        #[test]
        fn records_round_trip_and_tell_the_last_settle(
            settles in prop::collection::vec((0u64..60, any::<bool>()), 0..80),
        ) {
            let a = record(&settles);
            prop_assert_eq!(AloneLoads::decode(&a.encode()), Some(a));
            // What a plain map of every settle says, ids run again replacing later ones.
            let mut truth: Vec<(u64, bool)> = Vec::new();
            for &(b, alone) in &settles {
                truth.retain(|&(t, _)| t < b);
                truth.push((b, alone));
            }
            let first = a.told().map_or(u64::MAX, |t| *t.start());
            for (b, alone) in truth {
                match a.loaded_alone(b) {
                    // What it tells is the truth...
                    Some(told) => prop_assert_eq!(told, alone, "batch {}", b),
                    // ... and it tells of every id the runs span (below them: before the
                    // record started again, or 64 ids back and more).
                    None => prop_assert!(b < first, "batch {} untold", b),
                }
            }
            prop_assert_eq!(a.told().map(|t| *t.end()), settles.last().map(|s| s.0));
        }
    }
}
