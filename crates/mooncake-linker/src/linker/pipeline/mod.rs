//! The layer pipeline of one batch on one rank: a reader thread reads the next group of layers
//! from the store (one store call; the groups are planned per batch, see
//! [`ReadGranularity`](super::ReadGranularity)) and hands its layers over in order as the call
//! returns, while the exchange loop (the load thread) agrees on each layer with the other
//! ranks, shares its replicated rows ([`ShareStep`](super::share::ShareStep), one per mode),
//! lands it and publishes it. The batch's ring of [`LayerStage`]s (one per layer in flight)
//! circulates between them through a [`Handoff`] (free stages to the reader, read layers to
//! the exchange loop; loom-checked): the reader takes one per layer of its next group.
//!
//! Every rank issues the same collectives whatever happens (design rule: failure symmetry):
//! one status exchange per layer, then that layer's collective when every rank is ok; a
//! failure of this rank's own share step is reported in the next status word, and after the
//! last layer one more exchange (the verdict) carries the last layer's. A failed status stops
//! every rank at the same layer; a failed collective fails the batch on every rank and aborts
//! the group (every rank re-forms it at its next batch), and so do status words that are out
//! of step (another layer, another batch's tag).
//!
//! Before its status word, the exchange loop verifies what this rank read for the layer
//! (`verify`: checksums, or lengths), while the reader reads the next layer.
//!
//! **Every wait is bounded.** Each store call waits at most `layer_read_timeout` (a call still
//! running then fails its group of layers; the batch's memory hold keeps what it writes until it
//! returns), a stage is reopened after a bounded wait for its device work, the reader waits
//! for each free stage at most `layer_read_timeout + 5 × max(collective_timeout,
//! store_call_timeout)` (longer than one exchange-loop step may take, which also ends it), it
//! waits for the
//! preflight's verdicts until four fifths of `collective_timeout` after the group's read
//! started (the batch's gate, for the first group; a rank alone: six store calls and a
//! quarter after the batch's start, or for a later group two store calls after its read's
//! start if that is later), before its first read it waits for a pin a lookup has under way
//! a quarter of `store_call_timeout` at most, and the exchange loop waits for the reader at
//! most `max(layer_read_timeout, collective_timeout) + collective_timeout + 2.25 ×
//! store_call_timeout` (and at least seven store calls and a quarter) per layer; in a TP group
//! at most nine tenths of `collective_timeout` after the batch's gate (layer 0) or the end of
//! the previous layer's status exchange, since a pin or a session renewal, a stage's opening
//! and a read may each keep within their own bounds but together outlast what the peers
//! wait. Once the batch has failed, a size check that has not started its queries skips them.
//! A preflight check still running when its verdict is no longer waited for is joined when the
//! reader ends (its store calls are bounded: the companions' read and, for one that does not
//! fit, its size query, its object's size query and the discard; the sizes). So the reader
//! thread always ends, and the scope's join of it is bounded by those waits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dedup_broadcast::Collective;
use kv_device::{LayerLanding, LayerStage};
use kv_loader::{KvLoadError, ShareMode};
use layerwise_counter::Ticket;

use super::batch::{BatchJob, BatchLayers};
use super::granularity::CallLimits;
use super::handoff::Handoff;
use super::landed::LandedSums;
use super::verify::BatchChecksums;
use super::Inner;
use crate::store::Hold;

mod exchange;
mod read;

/// What the reader hands over for one layer.
struct ReadLayer {
    layer: u32,
    stage: Option<LayerStage>,
    /// Why this rank's read of the layer (or an earlier one) failed.
    error: Option<KvLoadError>,
    /// The checksums the store took of the layer's rows as they landed, if it took any.
    landed: Option<LandedSums>,
}

/// What the reader thread did.
#[derive(Default)]
struct ReadRun {
    bytes: u64,
    /// Layers per store call, in order.
    groups: Vec<u32>,
}

/// Tells the hand-off the reader left when dropped (also while unwinding).
struct ReaderDone<'h>(&'h Handoff<Option<LayerStage>, ReadLayer>);

impl Drop for ReaderDone<'_> {
    fn drop(&mut self) {
        self.0.reader_done();
    }
}

/// Tells the hand-off the exchange loop left when dropped, also while unwinding: the reader's
/// waits for free stages and for room to hand a layer over then end at once, so the scope's
/// join of the reader (which runs before a panic goes on) does not wait out their bounds.
struct ExchangeDone<'h>(&'h Handoff<Option<LayerStage>, ReadLayer>);

impl Drop for ExchangeDone<'_> {
    fn drop(&mut self) {
        drop(self.0.exchange_done());
    }
}

/// What a finished pipeline did.
pub(crate) struct PipelineRun {
    pub(crate) bytes_read: u64,
    /// Layers per store call of this rank's reads, in order.
    pub(crate) read_groups: Vec<u32>,
    /// Bytes of the layers landed in this rank's pool.
    pub(crate) landed: u64,
    /// From `start_load` to the first layer published.
    pub(crate) first_layer: Duration,
}

/// One batch's layers on one rank (see the module docs).
pub(crate) struct LayerPipeline<'a> {
    pub(crate) inner: &'a Inner,
    pub(crate) job: &'a BatchJob,
    /// When the batch passed its gate, or started alone (the peers' wait for layer 0, if
    /// there are peers, starts about then).
    pub(crate) opened: Instant,
    /// The batch's counter ticket (what publishing a layer marks).
    pub(crate) counter: Ticket,
    pub(crate) coll: Option<&'a dyn Collective>,
    pub(crate) layers: &'a BatchLayers,
    /// The batch's landing (absent when it could not be made: every layer then fails here).
    pub(crate) landing: Option<&'a dyn LayerLanding>,
    /// What a store call past its deadline keeps alive until it returns.
    pub(crate) memory: &'a Hold,
    /// The checksums of what this rank reads: set by the reader's helper beside the first
    /// group's read, before any layer is handed over.
    pub(crate) sums: &'a OnceLock<BatchChecksums>,
    /// The batch's status-word tag.
    pub(crate) tag: u8,
}

impl LayerPipeline<'_> {
    /// Runs the batch: `prep` says why this rank cannot read, if it cannot; `stages` the
    /// landing's ring of stages (empty when there is no landing).
    pub(crate) fn run(
        &self,
        prep: Result<(), KvLoadError>,
        stages: Vec<LayerStage>,
    ) -> Result<PipelineRun, KvLoadError> {
        // Without a landing every layer fails; two empty stages keep the layers moving.
        let ring = stages.len().max(2);
        let mut stages = stages.into_iter();
        // A whole group may wait for the exchange loop: the reader hands a group's layers over
        // as its call returns and starts the next group's read at once (only free stages hold
        // it back). With room for one layer it sat in the hand-off until the loop had taken all
        // but one layer of the group, so reads and share steps took turns instead of
        // overlapping (Rank0Broadcast, TP 8: rank 0 waited for reads half its time).
        let handoff: Handoff<Option<LayerStage>, ReadLayer> =
            Handoff::new((0..ring).map(|_| stages.next()), ring);
        let h = &handoff;
        // The batch's span (batch, rank, epoch) on the reader's lines too: the store's own
        // lines (an overdue call, a failed read) then say which batch they were for.
        let span = tracing::Span::current();
        std::thread::scope(|s| {
            let reader = std::thread::Builder::new()
                .name(format!("kvlink-read-r{}", self.inner.geometry.tp_rank()))
                .spawn_scoped(s, move || {
                    let _span = span.enter();
                    // The exchange loop learns at once that the reader left, even if it
                    // panicked.
                    let _done = ReaderDone(h);
                    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        self.read_loop(prep, ring, h)
                    }));
                    read.unwrap_or_else(|payload| {
                        let why = format!(
                            "it panicked: {}",
                            kv_loader::Cause::from_panic(payload.as_ref())
                        );
                        tracing::error!(batch = %self.job.plan.logical.batch, why,
                            "the batch's reader panicked; the batch fails");
                        h.reader_stopped(why);
                        ReadRun::default()
                    })
                });
            let reader = match reader {
                Ok(r) => r,
                Err(e) => {
                    // Nothing was read: every exchange of the batch still happens, failed. In
                    // a group the verdict of those exchanges is this rank's outcome, as it is
                    // every peer's; alone, the spawn's error is.
                    tracing::error!(batch = %self.job.plan.logical.batch, error = %e,
                        "no reader thread: the batch fails");
                    // The peers read why from this rank's status words.
                    h.reader_stopped(format!("no reader thread could be started: {e}"));
                    h.reader_done();
                    let exchanged = self.exchange_loop(h);
                    let alone = KvLoadError::internal(
                        self.job.plan.logical.batch,
                        kv_loader::Cause::with_source(format!("spawning a reader: {e}"), e),
                    );
                    return Err(match exchanged {
                        Err(verdict) if self.coll.is_some() => verdict,
                        _ => alone,
                    });
                }
            };
            let exchanged = {
                let _left = ExchangeDone(h);
                self.exchange_loop(h)
            };
            // Bounded: every wait of the reader is (see the module docs), and the exchange loop
            // has left, which ends the reader's waits on the hand-off at once.
            let read = reader.join().unwrap_or_default();
            exchanged.map(|(landed, first_layer)| PipelineRun {
                bytes_read: read.bytes,
                read_groups: read.groups,
                landed,
                first_layer,
            })
        })
    }

    /// See [`Inner::cancelled`].
    fn cancelled(&self) -> bool {
        self.inner.cancelled(self.job)
    }

    /// The layer groups this rank reads, one store call each (see [`ReadGranularity`]):
    /// planned from the bytes it reads per layer in this batch's mode, at most `ring - 1`
    /// layers per group (the rest of the ring is the layer the exchange loop holds).
    ///
    /// [`ReadGranularity`]: super::ReadGranularity
    fn plan_groups(&self, ring: usize) -> Vec<std::ops::Range<u32>> {
        let layers = self.layers;
        let bytes: Vec<u64> = (0..self.inner.geometry.num_layers())
            .map(|l| layers.read_bytes(l))
            .collect();
        let c = &self.inner.config;
        let readers = readers_at_once(
            self.coll.map(|c| c.size()),
            layers.mode,
            !layers.own.is_empty(),
            self.inner.geometry.tp_size(),
        );
        let limits = CallLimits {
            time: c.layer_read_timeout / 4,
            bytes: c.read_bytes_in_flight / readers,
        };
        self.inner
            .reads
            .plan(&bytes, ring, limits, layers.mode, readers)
    }
}

/// How many ranks read the store at the same time in a batch, sharing its bytes in flight: the
/// group's size (`group`), rank 0 alone in `Rank0Broadcast` unless every rank also reads
/// components of its own (`own`: sharded ones, never shared), and with no group (no sharing,
/// or loading alone while the group is down) every rank of the TP size, which do the same.
/// Every rank computes the same (the split is the same on all).
fn readers_at_once(group: Option<u32>, mode: ShareMode, own: bool, tp_size: u32) -> u64 {
    match (group, mode) {
        (Some(_), ShareMode::Rank0Broadcast) if !own => 1,
        (Some(size), _) => u64::from(size.max(1)),
        (None, _) => u64::from(tp_size.max(1)),
    }
}

/// Sets its flag when dropped: the reader's preflight checks are no longer waited for.
struct Abandon<'a>(&'a AtomicBool);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Store calls the companions' check makes at most: their read, then for a companion that does
/// not fit, its own size query (a refusal that may mean "too long"), its object's size query
/// and the discard of both.
const COMPANION_CHECK_CALLS: u32 = 4;

/// The latest this rank may still answer for a layer when its TP peers started waiting for its
/// status word at about `from`: they wait `collective_timeout`, so four fifths of it leaves the
/// rest for the exchange itself, and the peers then read this rank's failure instead of timing
/// out and re-forming the group.
fn peers_wait_bound(from: Instant, collective_timeout: Duration) -> Instant {
    after(from, collective_timeout.mul_f64(0.8))
}

/// The latest the exchange loop waits for the reader's layer in a TP group: nine tenths of
/// `collective_timeout` after `from`, the earliest the peers may have begun waiting for its
/// status word (the batch's gate for layer 0, else the end of the previous layer's status
/// exchange). The peers wait at least that long; the reader hands a late preflight failure
/// over by four fifths ([`peers_wait_bound`]), so that failure, not this bound's, is what a
/// rank reports when the preflight is what ran late.
fn reader_bound(from: Instant, collective_timeout: Duration) -> Instant {
    after(from, collective_timeout.mul_f64(0.9))
}

/// The latest a layer's check may end its store calls in a TP group: nineteen twentieths of
/// `collective_timeout` after `from` (as for [`reader_bound`]), leaving the rest for the
/// status exchange itself. A discard given up then is retried by the next load that finds the
/// object bad.
fn check_bound(from: Instant, collective_timeout: Duration) -> Instant {
    after(from, collective_timeout.mul_f64(0.95))
}

/// `at + d`, or `d` from now where that cannot be represented.
fn after(at: Instant, d: Duration) -> Instant {
    at.checked_add(d)
        .unwrap_or_else(|| kv_loader::deadline_after(d))
}

/// Longest the companions' check may take, each of its store calls bounded by
/// `store_call_timeout`: before them, a wait for companions read ahead at lookup.
fn companions_bound(store_call_timeout: Duration) -> Duration {
    store_call_timeout
        .saturating_mul(COMPANION_CHECK_CALLS)
        .saturating_add(super::prefetch::read_ahead_wait(store_call_timeout))
}

/// Longest a rank alone waits for the preflight's verdicts, from the batch's start: the
/// companions' check, then the sizes' (its queries and the discard of a wrong-sized object
/// share one deadline: one store call), and one store call as slack.
fn alone_verdicts_bound(store_call_timeout: Duration) -> Duration {
    companions_bound(store_call_timeout).saturating_add(store_call_timeout.saturating_mul(2))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rank 0 reads alone in `Rank0Broadcast` only when no rank reads components of its own:
    /// with sharded components beside (every rank reads its shard at the same time), the
    /// group's ranks share the bytes in flight, as in the other modes. Before, such a batch
    /// at TP 8 could have up to 8 x `read_bytes_in_flight` in flight.
    #[test]
    fn ranks_reading_at_once_count_every_rank_that_reads() {
        use ShareMode::*;
        assert_eq!(readers_at_once(Some(8), Rank0Broadcast, false, 8), 1);
        assert_eq!(readers_at_once(Some(8), Rank0Broadcast, true, 8), 8);
        for mode in [AllRanks, SplitAllGather] {
            assert_eq!(readers_at_once(Some(4), mode, false, 4), 4);
            assert_eq!(readers_at_once(Some(4), mode, true, 4), 4);
        }
        assert_eq!(readers_at_once(None, Rank0Broadcast, false, 8), 8);
        assert_eq!(readers_at_once(None, AllRanks, true, 0), 1);
    }
}
