//! Counters a server can export.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

/// Upper bounds (µs) of the read-call latency histogram buckets; the last is +∞.
pub const LAYER_LATENCY_BUCKETS_US: [u64; 12] = [
    100,
    250,
    500,
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    u64::MAX,
];

/// Live counters of one linker (atomics; cheap to update on the load path).
#[derive(Debug, Default)]
pub struct LinkerMetrics {
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    pages_hit: AtomicU64,
    pages_looked_up: AtomicU64,
    batches_loaded: AtomicU64,
    batches_failed: AtomicU64,
    layer_reads: AtomicU64,
    layer_read_calls: AtomicU64,
    layer_read_us: AtomicU64,
    layer_hist: [AtomicU64; 12],
    failed_read_calls: AtomicU64,
    failed_read_us: AtomicU64,
    ranges_checksummed: AtomicU64,
    ranges_checksummed_as_landed: AtomicU64,
    ranges_length_only: AtomicU64,
    bad_objects: AtomicU64,
    companions_kept: AtomicU64,
    companions_prefetched: AtomicU64,
    read_ahead_waits: AtomicU64,
    pins_ahead: AtomicU64,
    pins_ahead_taken: AtomicU64,
    kept_checksums_stale: AtomicU64,
    companions_reread: AtomicU64,
    batches_alone: AtomicU64,
    companions_unsupported: AtomicU64,
    batches_plans_differ: AtomicU64,
    lookups_alone: AtomicU64,
    saves: AtomicU64,
    saves_failed: AtomicU64,
    failures: Mutex<BTreeMap<&'static str, u64>>,
    own_failures: Mutex<BTreeMap<&'static str, u64>>,
}

/// A copy of the counters ([`LinkerMetrics::snapshot`] says how they hang together).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Bytes of KV layers read from the store for loads, counted as each store call lands
    /// (checksum companions and objects read again to check them are not counted).
    pub bytes_read: u64,
    /// Bytes of KV objects written to the store by saves (checksum companions not counted).
    pub bytes_written: u64,
    /// Pages found by lookups.
    pub pages_hit: u64,
    /// Pages asked about by lookups, failed lookups too (with no page found): the hit
    /// ratio falls while the store or the group is down.
    pub pages_looked_up: u64,
    /// Batches loaded whole.
    pub batches_loaded: u64,
    /// Batches failed.
    pub batches_failed: u64,
    /// Layers read (a store call that read a group of `k` layers counts `k`).
    pub layer_reads: u64,
    /// Reads of a group of layers that read them: one per group, however many store calls it
    /// made (with `LinkerConfig::read_parallelism` above 1, a group's ranges are split over
    /// up to that many store calls at once, counted here as one).
    pub layer_read_calls: u64,
    /// Total time of those group reads, each from its start to its last store call's end.
    pub layer_read_time: Duration,
    /// Group reads per latency bucket (see [`LAYER_LATENCY_BUCKETS_US`]): one entry per
    /// group, of however many layers and store calls.
    pub layer_read_histogram: [u64; 12],
    /// Group reads of layers that failed (an error, a transfer given up, a deadline, also one
    /// refused or out of time before any store call was made): not in the three figures
    /// above, which time the group reads that read their layers.
    pub failed_read_calls: u64,
    /// Total time of the failed group reads, from their start to their error.
    pub failed_read_time: Duration,
    /// (object, layer) ranges loaded and verified against the checksums written with the
    /// object.
    pub ranges_checksummed: u64,
    /// Of `ranges_checksummed`, those checked against the checksum the store took as their
    /// bytes landed (a read staged through the store's own memory), not read again.
    pub ranges_checksummed_as_landed: u64,
    /// (object, layer) ranges loaded and verified by their length only (objects without
    /// checksums, e.g. written by SGLang): a weaker check.
    pub ranges_length_only: u64,
    /// Objects that failed verification (and were discarded for the next save to rewrite).
    pub bad_objects: u64,
    /// Checksum companions a load took from those the linker kept
    /// (`LinkerConfig::checksum_cache_entries`: from an earlier load, a save, or read ahead
    /// at a lookup) instead of reading them itself.
    pub companions_kept: u64,
    /// Checksum companions read ahead, when a lookup found their objects, and kept.
    pub companions_prefetched: u64,
    /// Loads that waited for companions still being read ahead (instead of reading them),
    /// counted when the wait starts.
    pub read_ahead_waits: u64,
    /// Read sessions started at a lookup for the load to come
    /// (`LinkerConfig::pin_at_lookup`), counted as they start (also those no load took:
    /// `pins_ahead - pins_ahead_taken` is the master calls made for nothing).
    pub pins_ahead: u64,
    /// Loads that took over the read session their lookup started instead of starting one.
    pub pins_ahead_taken: u64,
    /// (object, layer) ranges that failed against kept checksums and were checked again
    /// against their companion read afresh (their object written again since).
    pub kept_checksums_stale: u64,
    /// (object, layer) ranges that failed against the companion this batch read and were
    /// checked again against one read afresh: that read may have come before the batch's pin
    /// took, and the object been written again (other bytes, its own companion) in between.
    pub companions_reread: u64,
    /// Times a checksum companion was found to be a newer kvlink writer's (another format
    /// version; by a load, a recheck or a save's read-back): a load then checks its object by
    /// length only (its ranges in `ranges_length_only`) and leaves the pair in the store.
    /// Non-zero in a rolling upgrade: this server is the older one.
    pub companions_unsupported: u64,
    /// Batches this rank loaded alone, reading its own copy with no collective, because its
    /// TP group was down (`GroupFallback::ReadAlone`; `LoadStats::alone`). Each is a batch
    /// the group did not share: a figure that grows is a group that stays down.
    pub batches_alone: u64,
    /// Batches loaded `AllRanks` because the ranks' plans or key spaces differed
    /// (`LoadStats::plans_differ`): ranks scheduled or configured apart.
    pub batches_plans_differ: u64,
    /// Lookups this rank answered alone (its own hit, no error) because its TP group was
    /// down (`GroupFallback::ReadAlone`).
    pub lookups_alone: u64,
    /// Re-formations of the TP group this rank took part in and saw complete (filled by
    /// `Linker::metrics`; zero without a group): each follows a broken group (a rank died, a
    /// collective was aborted).
    pub group_reforms: u64,
    /// Saves that returned (successful or not), and of them those that failed (their
    /// `SaveReport` never reached the engine; the pages not written stay missing until a
    /// later save). A plan the save refused (`InvalidPlan`: the engine's bug) counts as
    /// failed; a save on a closed linker (`Closed`) is not counted.
    pub saves: u64,
    /// See `saves`.
    pub saves_failed: u64,
    /// Store calls that did not return by their deadline, the landing memory's
    /// registrations and unregistrations included (filled by `Linker::metrics`).
    pub overdue_calls: u64,
    /// Staging buffers of the staging pool this linker's landings lease from, held back now
    /// because device work or a store read may still use them (a device pool's staging; zero
    /// on a host pool), filled by `Linker::metrics` (linkers sharing one staging pool report
    /// the same figure): each is one fewer buffer for loads and saves. One that stays is held
    /// for good (its work's end is unknown), and once every buffer is, each batch fails at
    /// once for want of one; the logs name the work that holds each. Counting first gives
    /// back the buffers whose work has ended (a query of each one's events, on the thread that
    /// asks for the metrics).
    pub staging_quarantined: u64,
    /// Of `staging_quarantined`, the buffers held for good, and the staging buffers there
    /// are in all (filled by `Linker::metrics`; zero on a host pool): alert when the first
    /// reaches the second, since every batch then fails at once (rebuild the pool).
    pub staging_held_for_good: u64,
    /// See `staging_held_for_good`.
    pub staging_capacity: u64,
    /// Memory kept for good in this process (every store, linker and NCCL group of it): how
    /// many times memory was kept (one store call whose transfer the store gave up on may keep
    /// several buffers, each counted; so is a host buffer left to a silent NCCL comm thread,
    /// and an aborted communicator's scratch) and the bytes they may still use, never freed
    /// (filled by `Linker::metrics`: the store's `kept_for_good` and dedup-broadcast's
    /// `memory_kept`). A figure that keeps growing is a store that keeps stalling past its
    /// client's transfer timeout, or comm threads that keep going silent. Process-wide: every
    /// linker of the process (ranks as threads) reports the same figure; export it once.
    pub kept_for_good: crate::store::KeptForGood,
    /// Failed batch outcomes by kind (`KvLoadError::kind_name`). In a TP group every rank's
    /// outcome of a batch a rank failed while loading is `peer_failed`; what failed is in
    /// `own_failures` of the rank it was. A batch a rank cancelled (a reset, a close) or
    /// refused at `start_load` (`busy`, `duplicate_batch`, `closed`) counts under that kind
    /// on every rank that started it, as on a rank alone (the refusing rank's engine has the
    /// refusal as `start_load`'s error; a batch refused there is not counted on that rank).
    pub failures: BTreeMap<&'static str, u64>,
    /// This rank's own failures while loading a batch's layers (a read, a verification, an
    /// upload, a share step), by kind, alone or in a group: at most one per batch. A
    /// cancellation is not one.
    pub own_failures: BTreeMap<&'static str, u64>,
}

impl LinkerMetrics {
    pub(crate) fn read(&self, bytes: u64) {
        self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
    }

    pub(crate) fn written(&self, bytes: u64) {
        self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
    }

    /// `pages_hit` after `pages_looked_up`, `Release`: a snapshot that sees the hits sees
    /// the pages asked about ([`snapshot`](Self::snapshot)).
    pub(crate) fn lookup(&self, asked: u64, hit: u64) {
        self.pages_looked_up.fetch_add(asked, Ordering::Relaxed);
        self.pages_hit.fetch_add(hit, Ordering::Release);
    }

    /// A group read (one or more store calls) read `layers` layers in `took`.
    pub(crate) fn layer_read(&self, layers: u32, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.layer_reads
            .fetch_add(u64::from(layers), Ordering::Relaxed);
        self.layer_read_calls.fetch_add(1, Ordering::Relaxed);
        self.layer_read_us.fetch_add(us, Ordering::Relaxed);
        let b = LAYER_LATENCY_BUCKETS_US
            .iter()
            .position(|&ub| us <= ub)
            .unwrap_or(LAYER_LATENCY_BUCKETS_US.len() - 1);
        self.layer_hist[b].fetch_add(1, Ordering::Relaxed);
    }

    /// A store call of layers failed after `took`.
    pub(crate) fn layer_read_failed(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        self.failed_read_calls.fetch_add(1, Ordering::Relaxed);
        self.failed_read_us.fetch_add(us, Ordering::Relaxed);
    }

    pub(crate) fn batch(&self, ok: bool) {
        let c = if ok {
            &self.batches_loaded
        } else {
            &self.batches_failed
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn verified(&self, checksummed: u64, length_only: u64) {
        self.ranges_checksummed
            .fetch_add(checksummed, Ordering::Relaxed);
        self.ranges_length_only
            .fetch_add(length_only, Ordering::Relaxed);
    }

    /// After [`verified`](Self::verified) counted them among the ranges checksummed:
    /// `Release`, so a snapshot that sees these sees those ([`snapshot`](Self::snapshot)).
    pub(crate) fn checksummed_as_landed(&self, n: u64) {
        self.ranges_checksummed_as_landed
            .fetch_add(n, Ordering::Release);
    }

    pub(crate) fn companions_kept(&self, n: u64) {
        self.companions_kept.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn companions_prefetched(&self, n: u64) {
        self.companions_prefetched.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn read_ahead_wait(&self) {
        self.read_ahead_waits.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn pins_ahead(&self) {
        self.pins_ahead.fetch_add(1, Ordering::Relaxed);
    }

    /// After the pin's [`pins_ahead`](Self::pins_ahead) (which the pin's hand-over orders
    /// before this): `Release`, so a snapshot that sees this sees that.
    pub(crate) fn pins_ahead_taken(&self) {
        self.pins_ahead_taken.fetch_add(1, Ordering::Release);
    }

    pub(crate) fn kept_checksums_stale(&self, n: u64) {
        self.kept_checksums_stale.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn companions_reread(&self, n: u64) {
        self.companions_reread.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn bad_object(&self) {
        self.bad_objects.fetch_add(1, Ordering::Relaxed);
    }

    /// A batch loaded: counted by how it was shared.
    pub(crate) fn loaded_how(&self, stats: &kv_loader::LoadStats) {
        if stats.alone.is_some() {
            self.batches_alone.fetch_add(1, Ordering::Relaxed);
        }
        if !stats.plans_differ.is_empty() {
            self.batches_plans_differ.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn companion_unsupported(&self) {
        self.companions_unsupported.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn lookup_alone(&self) {
        self.lookups_alone.fetch_add(1, Ordering::Relaxed);
    }

    /// A save returned; `failed` when with an error. `saves` first, then `saves_failed`
    /// with `Release`: a snapshot that sees a failure sees its save
    /// ([`snapshot`](Self::snapshot)).
    pub(crate) fn saved(&self, failed: bool) {
        self.saves.fetch_add(1, Ordering::Relaxed);
        if failed {
            self.saves_failed.fetch_add(1, Ordering::Release);
        }
    }

    pub(crate) fn failure(&self, kind: &'static str) {
        *self.failures.lock().entry(kind).or_default() += 1;
    }

    pub(crate) fn own_failure(&self, kind: &'static str) {
        *self.own_failures.lock().entry(kind).or_default() += 1;
    }

    /// The counters now, each read on its own while the linker runs: counters that move
    /// together may be one update apart. Five pairs keep their order (an exporter subtracts
    /// or divides them): `ranges_checksummed_as_landed` never exceeds `ranges_checksummed`,
    /// the `failures` never add up to more than `batches_failed`, `pins_ahead_taken` never
    /// exceeds `pins_ahead`, `pages_hit` never exceeds `pages_looked_up`, and `saves_failed`
    /// never exceeds `saves`; each is read before the counter it is part of.
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut hist = [0; 12];
        for (h, a) in hist.iter_mut().zip(&self.layer_hist) {
            *h = a.load(Ordering::Relaxed);
        }
        // Before the counters they are part of (see above); `failures` is counted under its
        // lock after `batches_failed`, whose increment the lock then shows this thread.
        let as_landed = self.ranges_checksummed_as_landed.load(Ordering::Acquire);
        let failures = self.failures.lock().clone();
        let taken = self.pins_ahead_taken.load(Ordering::Acquire);
        let hit = self.pages_hit.load(Ordering::Acquire);
        let saves_failed = self.saves_failed.load(Ordering::Acquire);
        MetricsSnapshot {
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            bytes_written: self.bytes_written.load(Ordering::Relaxed),
            pages_hit: hit,
            pages_looked_up: self.pages_looked_up.load(Ordering::Relaxed),
            batches_loaded: self.batches_loaded.load(Ordering::Relaxed),
            batches_failed: self.batches_failed.load(Ordering::Relaxed),
            layer_reads: self.layer_reads.load(Ordering::Relaxed),
            layer_read_calls: self.layer_read_calls.load(Ordering::Relaxed),
            layer_read_time: Duration::from_micros(self.layer_read_us.load(Ordering::Relaxed)),
            layer_read_histogram: hist,
            failed_read_calls: self.failed_read_calls.load(Ordering::Relaxed),
            failed_read_time: Duration::from_micros(self.failed_read_us.load(Ordering::Relaxed)),
            ranges_checksummed: self.ranges_checksummed.load(Ordering::Relaxed),
            ranges_checksummed_as_landed: as_landed,
            ranges_length_only: self.ranges_length_only.load(Ordering::Relaxed),
            bad_objects: self.bad_objects.load(Ordering::Relaxed),
            companions_kept: self.companions_kept.load(Ordering::Relaxed),
            companions_prefetched: self.companions_prefetched.load(Ordering::Relaxed),
            read_ahead_waits: self.read_ahead_waits.load(Ordering::Relaxed),
            pins_ahead: self.pins_ahead.load(Ordering::Relaxed),
            pins_ahead_taken: taken,
            kept_checksums_stale: self.kept_checksums_stale.load(Ordering::Relaxed),
            companions_reread: self.companions_reread.load(Ordering::Relaxed),
            companions_unsupported: self.companions_unsupported.load(Ordering::Relaxed),
            batches_alone: self.batches_alone.load(Ordering::Relaxed),
            batches_plans_differ: self.batches_plans_differ.load(Ordering::Relaxed),
            lookups_alone: self.lookups_alone.load(Ordering::Relaxed),
            group_reforms: 0,
            saves: self.saves.load(Ordering::Relaxed),
            saves_failed,
            overdue_calls: 0,
            staging_quarantined: 0,
            staging_held_for_good: 0,
            staging_capacity: 0,
            kept_for_good: crate::store::KeptForGood::default(),
            failures,
            own_failures: self.own_failures.lock().clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Snapshots taken while a batch's counters move keep the two ordered pairs in order.
    /// Before, `ranges_checksummed` was read before `ranges_checksummed_as_landed` (and
    /// `batches_failed` before `failures`): a snapshot between the two could show more
    /// ranges checksummed as landed than checksummed, and an exporter's difference wrapped.
    #[test]
    fn snapshots_keep_the_ordered_pairs_in_order_while_counters_move() {
        let m = LinkerMetrics::default();
        std::thread::scope(|s| {
            // Ends by itself (a failed assertion below must not leave the scope waiting).
            let writer = s.spawn(|| {
                let t0 = std::time::Instant::now();
                while t0.elapsed() < Duration::from_millis(300) {
                    m.verified(3, 0);
                    m.checksummed_as_landed(3);
                    m.batch(false);
                    m.failure("store_transfer");
                    m.pins_ahead();
                    m.pins_ahead_taken();
                    m.lookup(4, 4);
                    m.saved(true);
                }
            });
            let mut seen = 0;
            while !writer.is_finished() {
                let snap = m.snapshot();
                assert!(
                    snap.ranges_checksummed_as_landed <= snap.ranges_checksummed,
                    "{snap:?}"
                );
                let failed: u64 = snap.failures.values().sum();
                assert!(failed <= snap.batches_failed, "{snap:?}");
                assert!(snap.pins_ahead_taken <= snap.pins_ahead, "{snap:?}");
                assert!(snap.pages_hit <= snap.pages_looked_up, "{snap:?}");
                assert!(snap.saves_failed <= snap.saves, "{snap:?}");
                seen += 1;
            }
            assert!(seen > 10, "{seen} snapshots");
        });
    }
}
