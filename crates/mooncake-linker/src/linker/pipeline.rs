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
//! for each free stage at most `layer_read_timeout + 2 × collective_timeout`, it waits for the
//! preflight's verdicts until four fifths of `collective_timeout` after the group's read
//! started (the batch's gate, for the first group; a rank alone: six store calls and a
//! quarter after the batch's start, or for a later group two store calls after its read's
//! start if that is later), before its first read it waits for a pin a lookup has under way
//! a quarter of `store_call_timeout` at most, and the exchange loop waits for the reader at
//! most `max(layer_read_timeout, collective_timeout) + collective_timeout + 2.25 ×
//! store_call_timeout` (and at least seven store calls and a quarter) per layer. Once the batch has failed, a size check
//! that has not started its queries skips them. A preflight check still running
//! when its verdict is no longer waited for is joined when the reader ends (its store calls
//! are bounded: the companions' read and, for one that does not fit, its size query, its
//! object's size query and the discard; the sizes). So the reader thread always ends, and the
//! scope's join of it is bounded by those waits.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use dedup_broadcast::{Collective, GroupStatus, LayerStatus};
use kv_device::{LayerLanding, LayerStage, ShareSide};
use kv_loader::{KvLoadError, ShareMode, StoreFailure};
use layerwise_counter::Ticket;
use tracing::{debug, warn};

use super::batch::{collective_failure, BatchJob, BatchLayers};
use super::granularity::CallLimits;
use super::handoff::{Handoff, Wait};
use super::landed::LandedSums;
use super::preflight::{Check, PreflightChecks};
use super::reader::{
    store_failure, GroupRead, LayerReader, OwnRows, ReadPart, RowTarget, ShareArea,
};
use super::session::PinnedKeys;
use super::share::{step_for, LayerCx, StepError};
use super::verify::{BatchChecksums, LayerCheck};
use super::Inner;
use crate::store::Hold;

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
        std::thread::scope(|s| {
            let reader = std::thread::Builder::new()
                .name(format!("kvlink-read-r{}", self.inner.geometry.tp_rank))
                .spawn_scoped(s, move || {
                    // The exchange loop learns at once that the reader left, even if it
                    // panicked.
                    let _done = ReaderDone(h);
                    self.read_loop(prep, ring, h)
                });
            let reader = match reader {
                Ok(r) => r,
                Err(e) => {
                    // Nothing was read: every exchange of the batch still happens, failed.
                    h.reader_done();
                    let _ = self.exchange_loop(h);
                    return Err(KvLoadError::internal(
                        self.job.plan.logical.batch,
                        kv_loader::Cause::with_source(format!("spawning a reader: {e}"), e),
                    ));
                }
            };
            let exchanged = self.exchange_loop(h);
            // Bounded: every wait of the reader is (see the module docs), and the exchange loop
            // has left, which ends the reader's waits on the hand-off at once.
            let read = reader.join().unwrap_or_default();
            self.inner.metrics.read(read.bytes);
            exchanged.map(|(landed, first_layer)| PipelineRun {
                bytes_read: read.bytes,
                read_groups: read.groups,
                landed,
                first_layer,
            })
        })
    }

    fn cancelled(&self) -> bool {
        self.inner.epoch.load(Ordering::Acquire) != self.job.epoch
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
        // The ranks of the group that read at the same time in this mode share the store's
        // bytes in flight (rank 0 alone in Rank0Broadcast).
        let readers = match (self.coll, layers.mode) {
            (None, _) | (_, ShareMode::Rank0Broadcast) => 1,
            (Some(coll), _) => u64::from(coll.size().max(1)),
        };
        let limits = CallLimits {
            time: c.layer_read_timeout / 4,
            bytes: c.read_bytes_in_flight / readers,
        };
        self.inner
            .reads
            .plan(&bytes, ring, limits, layers.mode, readers)
    }

    /// The reader thread: takes a free stage for each layer of its next group, reads the group
    /// in one store call, hands its layers over in order. Returns the bytes read and the
    /// groups.
    ///
    /// The batch's preflight runs on helper threads while the first groups are read (see
    /// [`preflight`](super::preflight)): the checksum companions (read whole, beside the pin), whose
    /// verdict the first group waits for (no layer arrives before its checksums), and the
    /// object sizes, whose verdict the first group also waits for unless every object has a
    /// companion (then the sizes are taken as soon as they are in, at the latest before the
    /// last group). So no batch with a wrong-sized object completes, no unchecked byte of one
    /// is published, and the first layer waits for the slower of its read and the companions
    /// rather than their sum.
    fn read_loop(
        &self,
        prep: Result<(), KvLoadError>,
        ring: usize,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
    ) -> ReadRun {
        let batch = self.job.plan.logical.batch;
        let mut failure = prep.err();
        let mut pins: Option<PinnedKeys<'_>> = None;
        let mut run = ReadRun::default();
        let c = &self.inner.config;
        let wait = c
            .layer_read_timeout
            .saturating_add(c.collective_timeout.saturating_mul(2));
        let reader = LayerReader {
            calls: &self.inner.calls,
            batch,
            parallelism: c.read_parallelism,
            hold: self.memory,
            deadline: kv_loader::deadline_after(c.store_call_timeout),
        };
        let covered = AtomicBool::new(false);
        let abandoned = AtomicBool::new(false);
        let groups = self.plan_groups(ring);
        std::thread::scope(|s| {
            // The preflight first, then the pins: the companions' read needs no session, so
            // it runs beside the pin as well as beside the first group's read.
            let mut checks = self.preflight(
                s,
                &reader,
                &covered,
                &abandoned,
                failure.is_none(),
                groups.len() > 1,
            );
            // Declared after the checks, so dropped (and the flag set) before they are joined:
            // a size check that has not started its queries then skips them.
            let _abandon = Abandon(&abandoned);
            if failure.is_none() {
                match self.inner.pin(self.layers, batch, &|| self.cancelled()) {
                    Ok(p) => pins = Some(p),
                    Err(e) => failure = Some(e),
                }
            }
            for (index, group) in groups.iter().cloned().enumerate() {
                let mut stages = Vec::with_capacity(group.len());
                for _ in group.clone() {
                    // The exchange loop hands a stage back after each layer (bounded), or
                    // leaves.
                    let Wait::Got(stage) = h.free_stage(kv_loader::deadline_after(wait)) else {
                        return;
                    };
                    stages.push(stage);
                }
                if failure.is_none() && self.cancelled() {
                    failure = Some(KvLoadError::Cancelled { batch });
                }
                // Until when this group's preflight verdicts may be waited for: none once the
                // batch has failed (nothing more is read or published).
                let earlier = failure.is_some();
                let by = match failure {
                    Some(_) => Instant::now(),
                    None => self.verdict_bound(if index == 0 {
                        self.opened
                    } else {
                        Instant::now()
                    }),
                };
                let mut read_failed = false;
                let mut landed = Vec::new();
                if failure.is_none() {
                    let open: Option<Vec<&mut LayerStage>> =
                        stages.iter_mut().map(Option::as_mut).collect();
                    let read = match (self.landing, open, pins.as_mut()) {
                        (Some(l), Some(mut st), Some(p)) => {
                            self.read_group(p, l, &mut st, group.clone())
                        }
                        _ => Err(KvLoadError::internal(batch, "no landing to read into")),
                    };
                    match read {
                        Ok(read) => {
                            run.bytes += read.bytes;
                            // Groups of store calls: none for a rank that read nothing.
                            if read.called {
                                run.groups.push(group.len() as u32);
                            }
                            landed = read.landed;
                        }
                        Err(e) => {
                            warn!(%batch, layers = ?group, error = %e, "read failed");
                            failure = Some(e);
                            read_failed = true;
                        }
                    }
                }
                // The preflight's verdicts due before this group is handed over. Their failure
                // replaces this group's read failure (a wrong-sized object says more than a
                // short read of it), never an earlier one (an earlier group's, the pins', a
                // cancellation): the batch has failed then, and nothing is waited for.
                match checks.due(index, groups.len(), read_failed, by) {
                    Err(e) if !earlier => {
                        warn!(%batch, error = %e, "preflight (object sizes, checksums)");
                        failure = Some(e);
                    }
                    Err(e) => {
                        debug!(%batch, error = %e, "preflight verdict after the batch failed")
                    }
                    Ok(()) => {}
                }
                if failure.is_some() {
                    // No verdict is waited for any more: checks not yet under way need not run.
                    abandoned.store(true, Ordering::Release);
                }
                let mut landed = landed.into_iter();
                for (layer, stage) in group.zip(stages) {
                    let msg = ReadLayer {
                        layer,
                        stage,
                        error: failure.clone(),
                        landed: landed.next(),
                    };
                    if h.hand_over(msg, kv_loader::deadline_after(wait)).is_err() {
                        return;
                    }
                }
            }
        });
        run
    }

    /// The latest a group whose read starts at `from` may wait for the preflight's verdicts:
    /// the TP peers wait for its first layer's status word for `collective_timeout` from about
    /// then at the earliest (for the first group, from the batch's gate), so the reader hands
    /// the group over with four fifths of that spent at most, leaving the rest for the status
    /// exchange itself; the peers then read this rank's verdict instead of timing out and
    /// re-forming the group. A rank alone has no peers waiting: its checks are bounded by
    /// their own store calls only ([`alone_verdicts_bound`] from the batch's start), and for
    /// a later group also by two store calls from its read's start: where every object has a
    /// companion the sizes start only once the first group is read, which may end after that
    /// bound, and then take one store call (two, with one as slack).
    fn verdict_bound(&self, from: Instant) -> Instant {
        let c = &self.inner.config;
        let after = |at: Instant, d: Duration| {
            at.checked_add(d)
                .unwrap_or_else(|| kv_loader::deadline_after(d))
        };
        if self.coll.is_none() {
            let own = after(self.opened, alone_verdicts_bound(c.store_call_timeout));
            return own.max(after(from, c.store_call_timeout.saturating_mul(2)));
        }
        after(from, c.collective_timeout.mul_f64(0.8))
    }

    /// Starts the preflight's checks (none when `run` is false): the checksum companions (read
    /// whole in one call, set in `self.sums`; `covered` says whether every object has one)
    /// and the object sizes (when `verify_object_sizes`; after the first group's read where
    /// every object has a companion and a later group can take their verdict, `after_first`).
    fn preflight<'scope>(
        &'scope self,
        s: &'scope std::thread::Scope<'scope, '_>,
        reader: &'scope LayerReader<'_>,
        covered: &'scope AtomicBool,
        abandoned: &'scope AtomicBool,
        run: bool,
        after_first: bool,
    ) -> PreflightChecks<'scope> {
        let batch = self.job.plan.logical.batch;
        let rank = self.layers.rank;
        // The sizes start once the companions are read: a companion that does not fit checks
        // (and discards) its object itself, and two checks discarding the same object at once
        // would each see the other's discard as a missing object.
        let (companions_read, read) = std::sync::mpsc::channel::<()>();
        let companions_limit = companions_bound(self.inner.config.store_call_timeout);
        let store_call_timeout = self.inner.config.store_call_timeout;
        // Where every object has a companion the sizes need not hold layer 0 back: they start
        // once the first group is read too, so that their queries (one per object) do not slow
        // that read. Not when the first group is the last: its hand-over needs their verdict,
        // so they run beside its read.
        let (first_read, group_read) = std::sync::mpsc::channel::<()>();
        let first_read_limit = self.inner.config.layer_read_timeout;
        let sizes = move |on_thread: bool| {
            let _ = read.recv_timeout(companions_limit);
            // Inline (no thread could be started), the first group is read only after this
            // returns: waiting for it would stall layer 0 for `layer_read_timeout`.
            if on_thread && after_first && covered.load(Ordering::Acquire) {
                let _ = group_read.recv_timeout(first_read_limit);
            }
            // The batch failed meanwhile (its verdict will not be taken): no queries.
            if abandoned.load(Ordering::Acquire) {
                return Ok(());
            }
            let t0 = Instant::now();
            // Its own deadline: the companions' calls may have used up the reader's.
            let fresh = LayerReader {
                deadline: kv_loader::deadline_after(store_call_timeout),
                ..*reader
            };
            let known = (&self.inner.checksums, &self.inner.wrong_sized);
            let r = self.layers.verify_sizes(&fresh, known);
            tracing::debug!(%batch, rank, took = ?t0.elapsed(), "preflight sizes");
            r
        };
        let sums = move |_on_thread: bool| {
            // Dropped when this returns or unwinds: the sizes start then.
            let _read = companions_read;
            let t0 = Instant::now();
            let mut plan = self.inner.wanted_companions(self.layers);
            if let Err(e) = self.inner.read_companions(self.layers, batch, &mut plan) {
                // The batch fails with this: the sizes (started once this returns) need not
                // query anything.
                abandoned.store(true, Ordering::Release);
                return Err(e);
            }
            covered.store(plan.covers_every_object(), Ordering::Release);
            let _ = self.sums.set(plan.into_sums());
            tracing::debug!(%batch, rank, took = ?t0.elapsed(), "preflight companions");
            Ok(())
        };
        let name = |what: &str| format!("kvlink-{what}-r{}", self.inner.geometry.tp_rank);
        // The companions first: a size check run inline (no thread to be had) waits for them.
        let companions = if run {
            Check::spawn(s, name("sums"), batch, "checksum companion", sums)
        } else {
            Check::passed(batch, "checksum companion")
        };
        let sizes = if run && self.inner.config.verify_object_sizes {
            Check::spawn(s, name("size"), batch, "object size", sizes)
        } else {
            Check::passed(batch, "object size")
        };
        PreflightChecks {
            companions,
            sizes,
            covered,
            first_read: Some(first_read),
        }
    }

    /// Reads layers `group` on this rank in one store call, layer `group.start + i` into
    /// `stages[i]`: its own components (every page), and its share of the replicated ones (its
    /// slots on a host pool, the share area on a device).
    fn read_group(
        &self,
        pins: &mut PinnedKeys<'_>,
        landing: &dyn LayerLanding,
        stages: &mut [&mut LayerStage],
        group: std::ops::Range<u32>,
    ) -> Result<GroupRead, KvLoadError> {
        let (inner, layers) = (self.inner, self.layers);
        let batch = self.job.plan.logical.batch;
        let deadline = kv_loader::deadline_after(inner.config.collective_timeout);
        for (stage, layer) in stages.iter_mut().zip(group.clone()) {
            landing.open(stage, layer, deadline)?;
        }
        pins.renew_if_due()
            .map_err(|e| store_failure(batch, Some(group.start), Vec::new(), &e))?;
        // Each layer's stage is lent to the read: the targets are minted in the loans, and
        // the loans go into the store call (which owns them until it returns).
        let loans = stages
            .iter_mut()
            .map(|stage| landing.lend(stage))
            .collect::<Result<Vec<_>, _>>()?;
        let t0 = Instant::now();
        let reader = LayerReader {
            calls: &inner.calls,
            batch,
            parallelism: inner.config.read_parallelism,
            hold: self.memory,
            deadline: kv_loader::deadline_after(inner.config.layer_read_timeout),
        };
        let planned = {
            let own: Vec<OwnRows<'_>> =
                loans.iter().map(|loan| OwnRows { landing, loan }).collect();
            // A layer without a share layout (none was built) leaves the part short of
            // targets: `plan` then fails the group.
            let share: Vec<ShareArea<'_>> = match landing.share() {
                ShareSide::Device(share) if !layers.shared.is_empty() => loans
                    .iter()
                    .zip(group.clone())
                    .map(|(loan, l)| {
                        layers.layouts[l as usize].as_ref().map(|layout| ShareArea {
                            share,
                            loan,
                            layout,
                        })
                    })
                    .collect::<Option<Vec<_>>>()
                    .unwrap_or_default(),
                _ => Vec::new(),
            };
            let mut parts = vec![ReadPart {
                shared: false,
                components: &layers.own,
                pages: 0..layers.pages,
                targets: own.iter().map(|t| t as &dyn RowTarget).collect(),
            }];
            if !layers.shared.is_empty() {
                let targets: Vec<&dyn RowTarget> = match landing.share() {
                    ShareSide::Host(_) => own.iter().map(|t| t as &dyn RowTarget).collect(),
                    ShareSide::Device(_) => share.iter().map(|t| t as &dyn RowTarget).collect(),
                };
                parts.push(ReadPart {
                    shared: true,
                    components: &layers.shared,
                    pages: layers.my_pages(),
                    targets,
                });
            }
            reader.plan(&parts, group.clone())?
        };
        // The store's checksums of the rows as they land, wherever a layer's check will want
        // them: checks on, and the companions not known yet or some object has one.
        let hash = inner.config.verify_checksums
            && inner.config.checksums_as_landed
            && self.sums.get().is_none_or(BatchChecksums::has_companions);
        let read = reader.read(planned, loans, group.clone(), hash)?;
        let (n, took) = (read.bytes, t0.elapsed());
        if !read.called {
            // Nothing of this group is this rank's to read: no store call to count or time.
            return Ok(read);
        }
        tracing::debug!(%batch, rank = layers.rank, layers = ?group, bytes = n, ?took, "group read");
        inner.metrics.layer_read(group.len() as u32, took);
        inner
            .reads
            .observe(layers.mode, group.len() as u32, n, took);
        inner.auto.observe_store_read(n, took);
        if took > inner.config.layer_read_timeout {
            return Err(KvLoadError::Store {
                batch: Some(batch),
                layer: Some(group.start),
                pages: (0..layers.pages as u32).collect::<Vec<_>>().into(),
                kind: StoreFailure::RpcTimeout,
                detail: format!(
                    "reading layers {group:?} took {took:?}, over the limit of {:?}",
                    inner.config.layer_read_timeout
                )
                .into(),
            });
        }
        Ok(read)
    }

    /// One status word for `layer`: exchanged with the group, or recorded alone.
    fn exchange(
        &self,
        status: &mut GroupStatus,
        layer: u32,
        mine: LayerStatus,
    ) -> Result<(), KvLoadError> {
        let batch = self.job.plan.logical.batch;
        match self.coll {
            Some(c) => {
                let deadline = kv_loader::deadline_after(self.inner.config.collective_timeout);
                status
                    .exchange_tagged(c, layer, mine, self.tag, deadline)
                    .map(drop)
                    .map_err(|e| collective_failure(batch, kv_loader::Cause::from_error(e)))
            }
            None => {
                status.record(layer, &[mine]);
                Ok(())
            }
        }
    }

    /// The layer `layer` message from the reader (bounded); one without a stage, carrying this
    /// rank's error, where none came in time or the reader sent another layer or left.
    fn receive(&self, h: &Handoff<Option<LayerStage>, ReadLayer>, layer: u32) -> ReadLayer {
        let batch = self.job.plan.logical.batch;
        let c = &self.inner.config;
        // Before the first group the reader pins the objects (a wait for a lookup's pin under
        // way, a quarter of a store call at most, then one store call) and opens the
        // landing's stages; before a group's read it may renew the read session (one store
        // call); then the read itself (`layer_read_timeout`); the preflight's verdicts are
        // waited for until four fifths of `collective_timeout` after the read's start (the
        // gate, for the first group), or, alone, `alone_verdicts_bound` after the batch's
        // start. One store call more as slack.
        let limit = c
            .layer_read_timeout
            .max(c.collective_timeout)
            .saturating_add(c.collective_timeout)
            .saturating_add(c.store_call_timeout.saturating_mul(2))
            .saturating_add(super::prefetch::read_ahead_wait(c.store_call_timeout))
            .max(alone_verdicts_bound(c.store_call_timeout).saturating_add(c.store_call_timeout));
        let error = match h.next_layer(kv_loader::deadline_after(limit)) {
            Wait::Got(m) if m.layer == layer => return m,
            Wait::Got(m) => KvLoadError::internal(
                batch,
                format!("the reader sent layer {} for layer {layer}", m.layer),
            ),
            Wait::TimedOut => KvLoadError::Store {
                batch: Some(batch),
                layer: Some(layer),
                pages: Vec::new().into(),
                kind: StoreFailure::RpcTimeout,
                detail: format!("the reader did not finish layer {layer} within {limit:?}").into(),
            },
            Wait::Closed => {
                KvLoadError::internal(batch, format!("the reader stopped before layer {layer}"))
            }
        };
        ReadLayer {
            layer,
            stage: None,
            error: Some(error),
            landed: None,
        }
    }

    /// The load thread's part: per layer, the status exchange, then the share step, landing and
    /// publishing; then the verdict. Returns (bytes landed, time to the first layer).
    fn exchange_loop(
        &self,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
    ) -> Result<(u64, Duration), KvLoadError> {
        let (inner, job, layers) = (self.inner, self.job, self.layers);
        let batch = job.plan.logical.batch;
        let num_layers = inner.geometry.num_layers();
        let step = step_for(layers.mode);
        tracing::debug!(%batch, rank = layers.rank, mode = ?step.mode(), "exchange loop");
        let mut status = GroupStatus::default();
        // This rank's failure of the previous layer's share step, to report next.
        let mut carried: Option<KvLoadError> = None;
        // This rank's first failure (what a rank alone reports).
        let mut own: Option<KvLoadError> = None;
        let mut fatal: Option<KvLoadError> = None;
        let (mut landed, mut first_layer) = (0u64, Duration::ZERO);
        // Time in the share steps (collective, scatter, land), for the read plan.
        let mut share_time = Duration::ZERO;
        let mut every_layer = true;
        for layer in 0..num_layers {
            let waited_at = Instant::now();
            let ReadLayer {
                stage,
                error: read_error,
                landed: landed_sums,
                ..
            } = self.receive(h, layer);
            let verify_at = Instant::now();
            // What this rank read for the layer is verified before it says "ok" for it.
            let verified = match (&read_error, &stage, self.landing) {
                (None, Some(st), Some(l)) => match self.sums.get() {
                    Some(sums) => LayerCheck {
                        inner,
                        batch,
                        layers,
                        sums,
                    }
                    .run(l, st, layer, landed_sums.as_ref())
                    .err(),
                    None => Some(KvLoadError::internal(
                        batch,
                        format!("layer {layer} arrived before its checksums were read"),
                    )),
                },
                // Said in this layer's status word, so that every rank stops here together
                // (never after an ok word, which would skip this layer's collective).
                (None, None, _) | (None, _, None) => Some(KvLoadError::internal(
                    batch,
                    format!("layer {layer} has no stage or no landing"),
                )),
                _ => None,
            };
            let mine = carried.take().or(read_error).or(verified);
            if let Some(e) = &mine {
                own.get_or_insert_with(|| e.clone());
            }
            let word = mine
                .as_ref()
                .map_or(LayerStatus::Ok, LayerStatus::from_error);
            let exchange_at = Instant::now();
            if let Err(e) = self.exchange(&mut status, layer, word) {
                fatal = Some(e);
            }
            if fatal.is_some() || !status.is_ok() {
                every_layer = false;
                break;
            }
            let (Some(landing), Some(mut stage)) = (self.landing, stage) else {
                fatal = Some(KvLoadError::internal(
                    batch,
                    format!("layer {layer} has no stage"),
                ));
                every_layer = false;
                break;
            };
            let cx = LayerCx {
                coll: self.coll,
                landing,
                layout: layers.layouts[layer as usize].as_ref(),
                rank: layers.rank,
                batch,
                collective_timeout: inner.config.collective_timeout,
                auto: &inner.auto,
            };
            let shared_at = Instant::now();
            let ran = cx.run(step, &mut stage);
            let shared = shared_at.elapsed();
            share_time += shared;
            tracing::trace!(
                %batch,
                rank = layers.rank,
                layer,
                read_wait = ?(verify_at - waited_at),
                verify = ?(exchange_at - verify_at),
                status = ?(shared_at - exchange_at),
                share = ?shared,
                "layer steps"
            );
            match ran {
                Ok(ready) => {
                    inner
                        .outcomes
                        .publish(batch, self.counter, layer, ready, num_layers);
                    landed += layers.layer_bytes(layer);
                    if layer == 0 {
                        first_layer = job.started.elapsed();
                    }
                }
                Err(StepError::Local(e)) => {
                    warn!(%batch, layer, error = %e, "share step failed on this rank");
                    carried = Some(e);
                }
                Err(StepError::Fatal(e)) => {
                    fatal = Some(e);
                    every_layer = false;
                    break;
                }
            }
            h.give_back(Some(stage));
        }
        // The reader's waits end at once; what is left in the hand-off goes with it.
        drop(h.exchange_done());
        if every_layer && num_layers > 0 {
            // What the next batch's read plan overlaps its reads with, beside the compute.
            inner
                .reads
                .observe_share(layers.mode, share_time / num_layers);
        }
        if every_layer {
            // The verdict: a failure in the last layer's share step reaches every rank too.
            if let Some(e) = &carried {
                own.get_or_insert_with(|| e.clone());
            }
            let word = carried
                .as_ref()
                .map_or(LayerStatus::Ok, LayerStatus::from_error);
            if let Err(e) = self.exchange(&mut status, num_layers, word) {
                fatal = Some(e);
            }
        }
        if let Some(e) = fatal {
            // A collective failed (or a share step's wait ran out): the ranks may no longer be
            // in step on this handle; every rank re-forms the group at its next batch.
            if let Some(c) = self.coll {
                c.abort(&e.to_string());
                warn!(%batch, error = %e, "data group aborted: every rank re-forms it at its next batch");
            }
            return Err(e);
        }
        if status.out_of_step {
            if let Some(c) = self.coll {
                inner.group_failed(c, batch, "status words out of step".into());
            }
        }
        if !status.is_ok() {
            // One rank alone: its own error says most. A group: every rank reports the same.
            return Err(match (self.coll, own) {
                (None, Some(e)) => e,
                _ => status
                    .to_error(batch)
                    .unwrap_or(KvLoadError::Cancelled { batch }),
            });
        }
        Ok((landed, first_layer))
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
