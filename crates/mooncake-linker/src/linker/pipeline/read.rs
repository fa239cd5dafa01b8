//! The reader thread's part of a batch: the preflight beside the first reads, the pins, then
//! per group of layers one store call into the stages, the preflight's verdicts due, and the
//! layers handed over in order (see the [pipeline](super) docs for the protocol and its bounds).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_device::{LayerLanding, LayerStage, ShareSide, StageLoan};
use kv_loader::{KvLoadError, StoreFailure};
use tracing::debug;

use super::{
    after, alone_verdicts_bound, companions_bound, peers_wait_bound, Abandon, LayerPipeline,
    ReadLayer, ReadRun,
};
use crate::linker::handoff::{Handoff, Wait};
use crate::linker::landed::LandedSums;
use crate::linker::preflight::{Check, PreflightChecks};
use crate::linker::reader::{
    store_failure, GroupRead, GroupReads, LayerReader, OwnRows, ReadPart, RowTarget, ShareArea,
    WrongSizeAction,
};
use crate::linker::session::PinnedKeys;
use crate::linker::verify::BatchChecksums;

/// The reader thread's state across its groups.
struct Reading<'p> {
    /// Why this rank's batch failed, once it has: every later layer carries it.
    failure: Option<KvLoadError>,
    /// The batch's objects, pinned for its reads.
    pins: Option<PinnedKeys<'p>>,
    run: ReadRun,
}

impl LayerPipeline<'_> {
    /// The reader thread: takes a free stage for each layer of its next group, reads the group
    /// in one store call, hands its layers over in order. Returns the bytes read and the
    /// groups.
    ///
    /// The batch's preflight runs on helper threads while the first groups are read (see
    /// [`preflight`](crate::linker::preflight)): the checksum companions (read whole, beside
    /// the pin), whose verdict the first group waits for (no layer arrives before its
    /// checksums), and the object sizes, whose verdict the first group also waits for unless
    /// every object has a companion (then the sizes are taken as soon as they are in, at the
    /// latest before the last group). So no batch with a wrong-sized object completes, no
    /// unchecked byte of one is published, and the first layer waits for the slower of its
    /// read and the companions rather than their sum.
    pub(super) fn read_loop(
        &self,
        prep: Result<(), KvLoadError>,
        ring: usize,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
    ) -> ReadRun {
        let batch = self.job.plan.logical.batch;
        let mut reading = Reading {
            failure: prep.err(),
            pins: None,
            run: ReadRun::default(),
        };
        let c = &self.inner.config;
        // Longer than one step of the exchange loop can take with each of its phases just
        // under its own bound (its check's store calls, the status exchange, the share step
        // and its event: about 4 x `collective_timeout` on a device pool), so that the reader
        // never gives up on a stage the loop is still entitled to hold (that failed the batch
        // as `Internal` on every rank). A rank alone has no collectives, but its check's store
        // calls are bounded by `store_call_timeout` each (up to four, after a wait for a read
        // ahead), not by a share of `collective_timeout`: the larger of the two counts. The
        // loop's end (`ExchangeDone`) ends this wait anyway.
        let wait = c.layer_read_timeout.saturating_add(
            c.collective_timeout
                .max(c.store_call_timeout)
                .saturating_mul(5),
        );
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
                reading.failure.is_none(),
                groups.len() > 1,
            );
            // Declared after the checks, so dropped (and the flag set) before they are joined:
            // a size check that has not started its queries then skips them.
            let _abandon = Abandon(&abandoned);
            // A pin that found an object gone may have lost the race with the preflight's
            // discard of it (its companion was bad): the first group's verdicts are then
            // waited for as after a failed read, and say more (`BadObject`, naming the key).
            let mut pin_not_found = false;
            if reading.failure.is_none() {
                match self.inner.pin(self.layers, batch, &|| self.cancelled()) {
                    Ok(p) => reading.pins = Some(p),
                    Err(e) => {
                        pin_not_found = matches!(
                            &e,
                            KvLoadError::Store {
                                kind: StoreFailure::NotFound,
                                ..
                            }
                        );
                        reading.failure = Some(e);
                    }
                }
            }
            for (index, group) in groups.iter().cloned().enumerate() {
                // The exchange loop hands a stage back after each layer (bounded), or leaves.
                let Some(mut stages) = free_stages(h, group.len(), wait, reading.pins.as_mut())
                else {
                    return;
                };
                if reading.failure.is_none() && self.cancelled() {
                    reading.failure = Some(KvLoadError::Cancelled { batch });
                }
                // Until when this group's preflight verdicts may be waited for: none once the
                // batch has failed (nothing more is read or published).
                let earlier = reading.failure.is_some() && !(index == 0 && pin_not_found);
                let by = if earlier {
                    Instant::now()
                } else {
                    self.verdict_bound(if index == 0 {
                        self.opened
                    } else {
                        Instant::now()
                    })
                };
                let (read_failed, landed) = self.read_into(&mut reading, &mut stages, &group);
                // The preflight's verdicts due before this group is handed over. Their failure
                // replaces this group's read failure (a wrong-sized object says more than a
                // short read of it), never an earlier one (an earlier group's, the pins' but an
                // object the pin found gone, a cancellation): the batch has failed then, and
                // nothing is waited for.
                // A pin that found an object gone counts as the first group's failed read:
                // its verdicts are taken if they come in by the bound (they may say more,
                // naming a bad object), else the pin's `NotFound` stands (a late check must
                // not turn it into a timeout).
                let read_failed = read_failed || (index == 0 && pin_not_found);
                match checks.due(index, groups.len(), read_failed, by) {
                    Err(e) if !earlier => {
                        // Debug: the batch's failure carries it, and is logged once a minute
                        // per kind (`log_failed`); a store down fails every batch alike.
                        debug!(%batch, error = %e, "preflight (object sizes, checksums)");
                        reading.failure = Some(e);
                    }
                    Err(e) => {
                        debug!(%batch, error = %e, "preflight verdict after the batch failed")
                    }
                    Ok(()) => {}
                }
                if reading.failure.is_some() {
                    // No verdict is waited for any more: checks not yet under way need not run.
                    abandoned.store(true, Ordering::Release);
                }
                let failure = reading.failure.as_ref();
                if !hand_over(h, group, stages, failure, landed, wait) {
                    return;
                }
            }
        });
        reading.run
    }

    /// Reads `group` into `stages` unless the batch has failed on this rank; a failed read
    /// becomes the batch's failure. Returns whether this read failed, and the checksums the
    /// store took of the rows as they landed.
    fn read_into(
        &self,
        reading: &mut Reading<'_>,
        stages: &mut [Option<LayerStage>],
        group: &std::ops::Range<u32>,
    ) -> (bool, Vec<LandedSums>) {
        let batch = self.job.plan.logical.batch;
        if reading.failure.is_some() {
            return (false, Vec::new());
        }
        let open: Option<Vec<&mut LayerStage>> = stages.iter_mut().map(Option::as_mut).collect();
        let read = match (self.landing, open, reading.pins.as_mut()) {
            (Some(l), Some(mut st), Some(p)) => self.read_group(p, l, &mut st, group.clone()),
            _ => Err(KvLoadError::internal(batch, "no landing to read into")),
        };
        match read {
            Ok(read) => {
                reading.run.bytes += read.bytes;
                // Groups of store calls: none for a rank that read nothing.
                if read.called {
                    reading.run.groups.push(group.len() as u32);
                }
                (false, read.landed)
            }
            Err(e) => {
                // Debug: the batch's failure carries it (logged once a minute per kind).
                debug!(%batch, layers = ?group, error = %e, "read failed");
                reading.failure = Some(e);
                (true, Vec::new())
            }
        }
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
        if self.coll.is_none() {
            let own = after(self.opened, alone_verdicts_bound(c.store_call_timeout));
            return own.max(after(from, c.store_call_timeout.saturating_mul(2)));
        }
        peers_wait_bound(from, c.collective_timeout)
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
            let on_wrong = WrongSizeAction::under(&self.inner.config.namespace);
            let r = self.layers.verify_sizes(&fresh, known, on_wrong);
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
        let name = |what: &str| format!("kvlink-{what}-r{}", self.inner.geometry.tp_rank());
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
        let planned = self.plan_reads(&reader, landing, &loans, &group)?;
        // The store's checksums of the rows as they land, wherever a layer's check will want
        // them: checks on, and the companions not known yet or some object has one.
        let hash = inner.config.verify_checksums
            && inner.config.checksums_as_landed
            && self.sums.get().is_none_or(BatchChecksums::has_companions);
        let asked = planned.expected_bytes();
        let read = reader.read(planned, loans, group.clone(), hash);
        let took = t0.elapsed();
        // A call that ran into its deadline, returned past it, or answered "RPC timeout" is a
        // failure: it does not count among the reads that landed, nor in Auto's measure. The
        // read-cost fit takes it as a censored sample (`observe_failed`: four times its
        // predicted time, 4^n for the n-th call in a row that ran into the limit, within the
        // limit): a store grown slow still teaches the plan within a few calls, one hung call
        // does not skew the fit for hundreds of calls after it, and a store's early "RPC
        // timeout" (nothing read) is not taken for its bytes read in no time.
        let limit = inner.config.layer_read_timeout;
        // Ran into the limit (the linker's own deadline, or past it), not an early answer.
        let timed_out = |took: Duration| {
            let ran_long = took >= limit.mul_f64(0.9);
            let call = (group.len() as u32, asked);
            inner
                .reads
                .observe_failed(layers.mode, call, limit, ran_long);
        };
        let read = read.inspect_err(|e| {
            inner.metrics.layer_read_failed(took);
            if matches!(
                e,
                KvLoadError::Store {
                    kind: StoreFailure::RpcTimeout,
                    ..
                }
            ) {
                timed_out(took);
            }
        })?;
        let n = read.bytes;
        if !read.called {
            // Nothing of this group is this rank's to read: no store call to count or time.
            return Ok(read);
        }
        tracing::debug!(%batch, rank = layers.rank, layers = ?group, bytes = n, ?took, "group read");
        if took > limit {
            inner.metrics.layer_read_failed(took);
            timed_out(took);
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
        // Counted as each call lands (with the call's time), not when the batch ends: a scrape
        // during a long batch saw no bytes then a spike, and a reader that panicked lost them.
        inner.metrics.read(n);
        inner.metrics.layer_read(group.len() as u32, took);
        inner
            .reads
            .observe(layers.mode, group.len() as u32, n, took);
        inner.auto.observe_store_read(n, took);
        Ok(read)
    }

    /// What `reader` reads for `group` into the stages lent as `loans`: this rank's own
    /// components (every page) into its rows, and its pages of the replicated ones into its
    /// rows on a host pool or the share area on a device. A layer without a share layout (none
    /// was built) leaves the part short of targets: planning then fails the group.
    fn plan_reads(
        &self,
        reader: &LayerReader<'_>,
        landing: &dyn LayerLanding,
        loans: &[StageLoan],
        group: &std::ops::Range<u32>,
    ) -> Result<GroupReads<'_>, KvLoadError> {
        let layers = self.layers;
        let own: Vec<OwnRows<'_>> = loans.iter().map(|loan| OwnRows { landing, loan }).collect();
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
        reader.plan(&parts, group.clone())
    }
}

/// A free stage for each of `layers` layers, each waited for at most `wait`; `None` once the
/// exchange loop has left (or did not hand one back in time).
/// The shortest slice a wait for stages is cut into to renew the read session (a zero
/// renewal period must not spin).
const MIN_RENEWAL_SLICE: Duration = Duration::from_millis(50);

/// Takes a free stage for each of `layers` layers, each within `wait` (`None`: the exchange
/// loop left or a wait ran out).
///
/// The batch's read session (`pins`) is renewed while it waits, when due: a wait for stages
/// may outlast the store's read lease (a slow peer holds the exchange loop), and the objects
/// still to be read would be evictable meanwhile. A renewal that fails here is left to the
/// next read's own renewal to report (and is not tried again in this wait).
fn free_stages(
    h: &Handoff<Option<LayerStage>, ReadLayer>,
    layers: usize,
    wait: Duration,
    mut pins: Option<&mut PinnedKeys<'_>>,
) -> Option<Vec<Option<LayerStage>>> {
    let mut stages = Vec::with_capacity(layers);
    for _ in 0..layers {
        let deadline = kv_loader::deadline_after(wait);
        let stage = loop {
            let slice = pins
                .as_ref()
                .map_or(wait, |p| p.until_due().max(MIN_RENEWAL_SLICE));
            let by = deadline.min(kv_loader::deadline_after(slice));
            match h.free_stage(by) {
                Wait::Got(stage) => break stage,
                Wait::Closed => return None,
                Wait::TimedOut if Instant::now() >= deadline => {
                    h.reader_stopped(
                        "its wait for a free stage ran out (the exchange loop gave none back in \
                         time)"
                            .into(),
                    );
                    return None;
                }
                Wait::TimedOut => {
                    if let Some(p) = pins.as_deref_mut() {
                        if let Err(e) = p.renew_if_due() {
                            // Not tried again in this wait: each try is a store call, and the
                            // stage may come back meanwhile.
                            tracing::debug!(error = %e, "renewing the read session while waiting for a stage failed");
                            pins = None;
                        }
                    }
                }
            }
        };
        stages.push(stage);
    }
    Some(stages)
}

/// Hands `group`'s layers over in order, each with its stage, the batch's failure if it has
/// one, and its landed checksums. False once the exchange loop has left (or did not take a
/// layer within `wait`).
fn hand_over(
    h: &Handoff<Option<LayerStage>, ReadLayer>,
    group: std::ops::Range<u32>,
    stages: Vec<Option<LayerStage>>,
    failure: Option<&KvLoadError>,
    landed: Vec<LandedSums>,
    wait: Duration,
) -> bool {
    let mut landed = landed.into_iter();
    for (layer, stage) in group.zip(stages) {
        let msg = ReadLayer {
            layer,
            stage,
            error: failure.cloned(),
            landed: landed.next(),
        };
        if h.hand_over(msg, kv_loader::deadline_after(wait)).is_err() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::linker::session::faulty_store_holding;
    use crate::store::{Fault, FaultCall, FaultRule, KvStore, Stall, StoreCalls};

    /// A reader waiting for a free stage renews its read session when due: the wait may
    /// outlast the store's read lease. Before, only a read renewed it (here: none in 600 ms at
    /// a 100 ms period).
    #[test]
    fn a_wait_for_stages_renews_the_read_session() {
        let faulty = faulty_store_holding("k");
        let starts = Stall::new();
        starts.release();
        faulty.inject_on(
            FaultCall::Session,
            FaultRule::default(),
            Fault::Stall(starts.clone()),
        );
        let store: Arc<dyn KvStore> = faulty;
        let calls = StoreCalls::new(store);
        let every = Duration::from_millis(100);
        let mut pins = PinnedKeys::start(&calls, &["k"], every, Duration::from_secs(5)).unwrap();
        let h: Handoff<Option<LayerStage>, ReadLayer> = Handoff::new([], 2);
        let got = std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(600));
                h.give_back(None);
            });
            free_stages(&h, 1, Duration::from_secs(10), Some(&mut pins))
        });
        assert_eq!(got.map(|v| v.len()), Some(1));
        assert!(starts.hits() >= 4, "{} session starts", starts.hits());
        assert_eq!(
            h.why_reader_stopped(),
            None,
            "the wait went on and got its stage"
        );
    }

    /// A wait for stages that gives up says why, for the exchange loop's error.
    #[test]
    fn a_wait_for_stages_that_gives_up_says_why() {
        let h: Handoff<Option<LayerStage>, ReadLayer> = Handoff::new([], 2);
        assert!(free_stages(&h, 1, Duration::from_millis(20), None).is_none());
        let why = h.why_reader_stopped().unwrap_or_default();
        assert!(why.contains("free stage ran out"), "{why}");
    }
}
