//! One batch on one rank, before its layers move: the gate every rank meets (in step, the
//! plans compared, the mode agreed), the keys, how each layer splits into own and shared rows,
//! the landing, the read session and the checksums. Then the
//! [`LayerPipeline`](super::pipeline::LayerPipeline) runs it.
//!
//! **Ranks never drift.** Every batch this rank's engine started, loaded or refused, meets the
//! group at the gate: a batch refused at `start_load` (`Busy`, a duplicate id, an invalid plan)
//! or cancelled by `reset` before it ran still gates and exchanges a failed status word for
//! layer 0, so every rank issues the same collectives for it and every rank fails it. The gate
//! word carries the batch id and the number of gates held on the handle; ranks that meet at
//! different batches catch up (the rank behind fails its batch, or with `ReadAlone` loads it
//! alone where every rank ahead did; the rank ahead gates its batch again), and ranks whose collectives no longer line up at all abort the group, which every
//! rank re-forms at its next batch (sequence numbers from 0 again).

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dedup_broadcast::{Collective, StagingLayout};
use kv_device::{BatchShape, LayerLanding};
use kv_loader::{BatchId, BatchPlan, KvLoadError, LoadStats, LoadTicket, ShareMode};
use tracing::{debug, info_span, warn};

use super::checksum_cache::ChecksumCache;
use super::gate::{GateMiss, Gates};
use super::group::GroupDown;
use super::group_time::BatchSample;
use super::handle_use::Channel;
use super::outcomes::HeldOutcome;
use super::pipeline::LayerPipeline;
use super::reader::{store_failure, ComponentKeys, LayerReader, WrongSizeAction};
use super::regions::Registered;
use super::session::PinnedKeys;
use super::wrong_sized::WrongSized;
use super::{GroupFallback, Inner};
use crate::store::Hold;

/// A batch handed to the load thread.
pub(crate) struct BatchJob {
    pub(crate) plan: BatchPlan,
    /// `None` for a batch this rank refused at `start_load`: it still meets the group.
    pub(crate) ticket: Option<LoadTicket>,
    /// Why this rank refused the batch.
    pub(crate) refusal: Option<KvLoadError>,
    pub(crate) epoch: u64,
    pub(crate) started: Instant,
}

/// What a hung store call of a batch keeps alive until it returns: the landing (its staging
/// lease, its pool), the registered regions, and, when the store writes pool slots, the
/// batch's outcome (so the engine cannot reuse the slots before).
struct BatchMemory {
    _landing: Option<Arc<dyn LayerLanding>>,
    _registered: Option<Arc<Registered>>,
    _outcome: Option<Arc<HeldOutcome>>,
}

/// How a batch's components split on this rank once the ranks agreed on its mode.
pub(crate) struct BatchLayers {
    pub(crate) mode: ShareMode,
    pub(crate) rank: u32,
    pub(crate) pages: usize,
    /// Read by this rank for itself (sharded ones; all of them in `AllRanks`).
    pub(crate) own: Vec<ComponentKeys>,
    /// Replicated components the ranks share.
    pub(crate) shared: Vec<ComponentKeys>,
    /// Per layer, where the shared rows sit while they travel (none when nothing is shared).
    pub(crate) layouts: Vec<Option<StagingLayout>>,
}

impl BatchLayers {
    /// The plan pages of shared components this rank reads.
    pub(crate) fn my_pages(&self) -> Range<usize> {
        self.layouts
            .iter()
            .flatten()
            .next()
            .map_or(0..0, |l| l.share(self.rank))
    }

    /// The split, as the landing needs it.
    pub(crate) fn shape(&self) -> BatchShape {
        BatchShape {
            own: self.own.iter().map(|c| c.layout.id).collect(),
            shared: self.shared.iter().map(|c| c.layout.id).collect(),
            share_bytes: if self.shared.is_empty() {
                Vec::new()
            } else {
                self.layouts
                    .iter()
                    .map(|l| l.as_ref().map_or(0, StagingLayout::len))
                    .collect()
            },
        }
    }

    /// Bytes this rank reads from the store for layer `layer`: its own components on every
    /// page, and its share of the replicated ones.
    pub(crate) fn read_bytes(&self, layer: u32) -> u64 {
        let on = |c: &&ComponentKeys| c.layout.position(layer).is_some();
        let own: u64 = self
            .own
            .iter()
            .filter(on)
            .map(|c| c.layout.page_layer_bytes * self.pages as u64)
            .sum();
        let mine = self.my_pages().len() as u64;
        let shared: u64 = self
            .shared
            .iter()
            .filter(on)
            .map(|c| c.layout.page_layer_bytes * mine)
            .sum();
        own + shared
    }

    /// Bytes of layer `layer` in this rank's pool once it lands (every planned component).
    pub(crate) fn layer_bytes(&self, layer: u32) -> u64 {
        self.own
            .iter()
            .chain(&self.shared)
            .filter(|c| c.layout.position(layer).is_some())
            .map(|c| c.layout.page_layer_bytes * self.pages as u64)
            .sum()
    }
}

pub(crate) fn collective_failure(batch: BatchId, e: impl Into<kv_loader::Cause>) -> KvLoadError {
    KvLoadError::Collective {
        batch: Some(batch),
        detail: e.into(),
    }
}

/// Whether a batch's failure may be its share mode's doing (its collectives, its device work,
/// its reads' timing and load on the store), not the engine's (a reset, a refusal, a slot
/// held) nor the data's (an object missing or bad): only such failures count against the
/// mode in `Auto`. In a group the failure is the first failing rank's, its kind first in
/// `PeerFailed`'s detail.
fn mode_may_have_failed(e: &KvLoadError) -> bool {
    matches!(
        e.cause_kind(),
        "collective"
            | "device"
            | "timeout"
            | "store_transfer"
            | "store_lease"
            | "store_rpc_timeout"
            | "store_short_read"
            | "malformed_status"
            | "layer_mismatch"
            | "out_of_step"
    )
}

/// With the group down (`down`: why, the typed error this batch would fail with), a batch
/// this rank is behind on that a rank ahead did not load alone (at the last gate judged: the
/// ranks ahead gave up waiting for this rank before it caught up) fails here too rather than
/// load alone: the error, of `down`'s kind (`GroupDown` found before the gate, never
/// `refused`; `Collective` when the gate broke), whose words say why and whose cause keeps
/// `down`'s. `None` when
/// every rank ahead loaded it alone, or none was past it (then this rank loads it alone).
fn failed_ahead(gates: &Gates, batch: BatchId, down: &KvLoadError) -> Option<KvLoadError> {
    // The record was taken at an earlier gate of this rank: it tells of the batches after.
    if batch.0 <= gates.ahead_at || gates.ahead.settled_alone(batch.0) != Some(false) {
        return None;
    }
    let latest = gates
        .ahead
        .ranks
        .iter()
        .map(|(at, _)| *at)
        .max()
        .unwrap_or(batch.0);
    warn!(%batch, latest, down = %down, "the group is down and a rank ahead did not load this batch alone: failing it");
    let why = format!(
        "a rank ahead (at batch {latest}) did not load this batch alone; this batch is skipped \
         to catch up"
    );
    Some(match down {
        // Not `refused`, whatever the formation was: the batch is skipped to stay with the
        // group, not for the engine's input (a refusal would tell the engine to fix it).
        KvLoadError::GroupDown {
            missing, detail, ..
        } => KvLoadError::GroupDown {
            batch: Some(batch),
            missing: missing.clone(),
            refused: false,
            detail: detail.clone().context(format!("{why} (the group is down)")),
        },
        other => collective_failure(
            batch,
            kv_loader::Cause::with_source(
                format!("the group is down ({other}) and {why}"),
                other.clone(),
            ),
        ),
    })
}

impl Inner {
    /// A reset since `job` started, or the engine abandoned it (`abandon`, a dropped
    /// `LoadHandle`, a `wait_batch` that timed out): still queued it does not read, running
    /// its reads stop at the next group, and it fails `Cancelled` (in a group, on every rank
    /// alike, as one a reset cancels). Before, an abandoned batch read and landed every layer,
    /// holding up the batches queued behind it.
    pub(crate) fn cancelled(&self, job: &BatchJob) -> bool {
        self.epoch.load(std::sync::atomic::Ordering::Acquire) != job.epoch
            || job
                .ticket
                .as_ref()
                .is_some_and(|t| self.outcomes.is_abandoned(t.batch, t.counter))
    }

    /// The keys of every planned component, in plan page order.
    pub(crate) fn component_keys(
        &self,
        plan: &BatchPlan,
    ) -> Result<Vec<ComponentKeys>, KvLoadError> {
        let mut out = Vec::with_capacity(plan.logical.components.len());
        for id in &plan.logical.components {
            let layout = self.geometry.component(*id)?.clone();
            let keys = plan
                .logical
                .pages()
                .map(|p| self.keys.object_key(p, &layout))
                .collect();
            out.push(ComponentKeys { layout, keys });
        }
        Ok(out)
    }

    pub(crate) fn collective_deadline(&self) -> Instant {
        kv_loader::deadline_after(self.config.collective_timeout)
    }

    /// Runs one batch on this rank: the gate (every rank, even for a batch refused or
    /// cancelled here), then its layers. `held` keeps the outcome back while a store call
    /// that may still write the slots runs. A batch loaded with the group leaves its time for
    /// the next gate (`Auto` records the group's time there); any other leaves none.
    pub(crate) fn run_batch(
        &self,
        gates: &mut Gates,
        job: &BatchJob,
        held: Option<&Arc<HeldOutcome>>,
    ) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        // Inside the load loop's `batch_job` span, which names the batch and the rank.
        let span = info_span!(
            "load_batch",
            pages = job.plan.logical.num_pages(),
            epoch = tracing::field::Empty
        );
        let _enter = span.enter();
        debug!(%batch, queued = ?job.started.elapsed(), "batch starts");
        // A batch id may be started again once its outcome was taken: nothing its earlier
        // run found (all its checks are over) explains what this run finds.
        self.wrong_sized.forget(batch);
        let cancelled = self.cancelled(job);
        let refusal = job
            .refusal
            .clone()
            .or_else(|| cancelled.then_some(KvLoadError::Cancelled { batch }));
        let handles = match &self.group {
            // The data handle stays marked in use to the batch's end (its verdict is the last
            // exchange): a re-formation on the lookup thread then leaves it to this batch.
            Some(link) => match link.handles_for(Channel::Data, self.collective_deadline()) {
                Ok(h) => Ok(h),
                Err(down) => match self.config.group_fallback {
                    GroupFallback::Fail => return Err(down.error(Some(batch))),
                    GroupFallback::ReadAlone => Err(Some(down)),
                },
            },
            // A rank alone has nobody to keep in step with.
            None => Err(None),
        };
        let (handles, _in_use) = match handles {
            Ok(h) => h,
            Err(alone) => return self.run_alone(gates, job, refusal, alone, held),
        };
        span.record("epoch", handles.epoch);
        let coll = handles.data.as_ref();
        let gated = match self.gate(gates, handles.epoch, coll, job) {
            Ok(g) => g,
            // "Down" is each rank's own finding: a peer that found the group down loads
            // alone and never gates, so this rank's gate fails and breaks the handle. With
            // `ReadAlone` this rank then loads alone too, so every rank ends the batch loaded
            // (alone) rather than some loaded and some failed. The gate took the previous
            // batch's time; this batch leaves none.
            Err(GateMiss::Failed(e)) if self.reads_alone_after(coll, refusal.as_ref()) => {
                if let Some(failed) = failed_ahead(gates, batch, &e) {
                    return Err(failed);
                }
                warn!(%batch, error = %e, "the gate failed and the group broke: loading alone");
                let mut stats = self.load_batch(None, job, ShareMode::AllRanks, 0, held)?;
                stats.alone = Some(format!("the group broke at the gate: {e}"));
                return Ok(stats);
            }
            // The group went on past this batch without this rank, every rank ahead having
            // loaded it alone (a peer that found the group down, loaded alone, then met this
            // rank again at its next batch): with `ReadAlone` this rank loads it alone too
            // rather than fail a batch its peers loaded. Where a rank ahead failed it (or
            // loaded it with others), this rank fails it too.
            Err(GateMiss::Behind {
                error: e,
                settled_alone: true,
            }) if self.reads_alone_behind(refusal.as_ref()) => {
                warn!(%batch, error = %e, "the group is past this batch: loading alone");
                let mut stats = self.load_batch(None, job, ShareMode::AllRanks, 0, held)?;
                stats.alone = Some(format!("the group went on past this batch: {e}"));
                return Ok(stats);
            }
            Err(GateMiss::Behind { error: e, .. } | GateMiss::Failed(e)) => return Err(e),
        };
        if let Some(e) = refusal {
            return self.refuse(coll, batch, gated.tag(), e);
        }
        // Auto's sample runs from here: the time in the queue and the wait at the gate for a
        // peer that called `start_load` later depend on the engine, not on the mode.
        let in_step = Instant::now();
        let loaded = self.load_batch(Some(coll), job, gated.mode, gated.tag(), held);
        if gated.plans_differ.is_empty() {
            leave_sample(gates, (handles.epoch, gated.count), &loaded, in_step);
        } else {
            // Each rank loaded its own plan (`AllRanks` forced, not proposed): the ranks'
            // bytes differ, and the slowest rank's time over this rank's bytes says nothing
            // of the mode.
            gates.pending.clear();
        }
        // A failure that may be the mode's own (every rank fails a batch alike, with the
        // first failing rank's kind, so every rank records it alike); not in a batch whose
        // plans differed (its mode was forced).
        match &loaded {
            Err(e) if mode_may_have_failed(e) && gated.plans_differ.is_empty() => {
                self.auto.observe_failure(gated.mode)
            }
            Ok(_) if gated.plans_differ.is_empty() => self.auto.observe_loaded(gated.mode),
            _ => {}
        }
        let mut stats = loaded?;
        stats.plans_differ = gated.plans_differ;
        Ok(stats)
    }

    /// A batch this rank runs without the group: no gate, so whatever it does it leaves no
    /// time for the group. Refused here, or loaded alone; `down` says why the group is down
    /// (`None` for a rank alone, which has nobody to keep in step with).
    fn run_alone(
        &self,
        gates: &mut Gates,
        job: &BatchJob,
        refusal: Option<KvLoadError>,
        down: Option<GroupDown>,
        held: Option<&Arc<HeldOutcome>>,
    ) -> Result<LoadStats, KvLoadError> {
        gates.pending.clear();
        if let Some(e) = refusal {
            return Err(e);
        }
        let Some(down) = down else {
            return self.load_batch(None, job, ShareMode::AllRanks, 0, held);
        };
        let batch = job.plan.logical.batch;
        if let Some(failed) = failed_ahead(gates, batch, &down.error(Some(batch))) {
            return Err(failed);
        }
        if self
            .group
            .as_ref()
            .is_none_or(|g| g.down_batch_log.due("loading alone"))
        {
            warn!(
                %batch,
                reason = %down,
                "loading alone: the TP group is down (logged once a minute while it lasts)"
            );
        } else {
            debug!(%batch, reason = %down, "loading alone: the TP group is down");
        }
        let mut stats = self.load_batch(None, job, ShareMode::AllRanks, 0, held)?;
        stats.alone = Some(down.to_string());
        Ok(stats)
    }

    /// After a failed gate: the engine configured reading alone, this rank did not refuse
    /// the batch, and the group's handle is now broken (a gate that only found this rank
    /// behind leaves it whole: the catch-up protocol goes on).
    fn reads_alone_after(&self, coll: &dyn Collective, refusal: Option<&KvLoadError>) -> bool {
        self.reads_alone_behind(refusal) && coll.broken().is_some()
    }

    /// After a gate that found the group at a later batch: the engine configured reading
    /// alone and this rank did not refuse the batch.
    fn reads_alone_behind(&self, refusal: Option<&KvLoadError>) -> bool {
        matches!(self.config.group_fallback, GroupFallback::ReadAlone) && refusal.is_none()
    }

    /// How the batch's layers split, in `mode`. A layout that cannot be built becomes this
    /// rank's failure (every rank still exchanges every layer).
    fn layers(
        &self,
        components: Vec<ComponentKeys>,
        mode: ShareMode,
        rank: u32,
        size: u32,
        pages: usize,
    ) -> (BatchLayers, Option<KvLoadError>) {
        let (shared, own): (Vec<ComponentKeys>, Vec<ComponentKeys>) = components
            .into_iter()
            .partition(|c| c.layout.replicated && mode.shares());
        let num_layers = self.geometry.num_layers();
        let layouts: Result<Vec<Option<StagingLayout>>, _> = (0..num_layers)
            .map(|l| {
                if shared.is_empty() {
                    return Ok(None);
                }
                StagingLayout::new(mode, l, shared.iter().map(|c| &c.layout), pages, size).map(Some)
            })
            .collect();
        let (layouts, error) = match layouts {
            Ok(l) => (l, None),
            Err(e) => (
                vec![None; num_layers as usize],
                Some(KvLoadError::config(kv_loader::Cause::with_source(
                    format!("staging: {e}"),
                    e,
                ))),
            ),
        };
        let layers = BatchLayers {
            mode,
            rank,
            pages,
            own,
            shared,
            layouts,
        };
        (layers, error)
    }

    /// Loads every layer of `job` into the pool, marking each ready as it lands.
    fn load_batch(
        &self,
        coll: Option<&dyn Collective>,
        job: &BatchJob,
        mode: ShareMode,
        tag: u8,
        held: Option<&Arc<HeldOutcome>>,
    ) -> Result<LoadStats, KvLoadError> {
        let batch = job.plan.logical.batch;
        let pages = job.plan.logical.num_pages();
        // Past the gate (or loading alone): the peers, if any, start waiting for layer 0 from
        // about now.
        let opened = std::time::Instant::now();
        let (rank, size) = coll.map_or((0, 1), |c| (c.rank(), c.size()));
        // After the gate every rank must issue the batch's per-layer exchanges: from here on a
        // local failure is this rank's status, never an early return.
        let (components, keys_error) = match self.component_keys(&job.plan) {
            Ok(c) => (c, None),
            Err(e) => (Vec::new(), Some(e)),
        };
        let (layers, layout_error) = self.layers(components, mode, rank, size, pages);
        let slots: Arc<[u32]> = job.plan.slots.clone().into();
        let (landing, stages, landing_error) = match self.landings.begin(slots, layers.shape()) {
            Ok(mut l) => {
                let stages = l.take_stages();
                // Layer 0 is read alone while the next group needs a stage of its own: a ring
                // of one would fail layer 1 ("no landing to read into"). A model of one layer
                // needs one.
                let needed = 2.min(self.geometry.num_layers() as usize);
                let few = (stages.len() < needed).then_some(kv_device::DeviceError::InvalidStage(
                    "the landing lent fewer than two stages; a batch needs at least two",
                ));
                (Some(Arc::<dyn LayerLanding>::from(l)), stages, few)
            }
            Err(e) => (None, Vec::new(), Some(e)),
        };
        debug!(%batch, rank, since_start = ?job.started.elapsed(), "landing ready");
        let memory: Hold = Arc::new(BatchMemory {
            _landing: landing.clone(),
            _registered: self.registered.lock().clone(),
            _outcome: held.cloned(),
        });
        let prep = match keys_error.or(layout_error) {
            Some(e) => Err(e),
            None => self.prepare(batch, landing_error.as_ref()),
        };
        let sums = std::sync::OnceLock::new();
        let Some(counter) = job.ticket.map(|t| t.counter) else {
            return Err(KvLoadError::internal(
                batch,
                "a refused batch has no ticket",
            ));
        };
        let pipeline = LayerPipeline {
            inner: self,
            job,
            opened,
            counter,
            coll,
            layers: &layers,
            landing: landing.as_deref(),
            memory: &memory,
            sums: &sums,
            tag,
        };
        // No layer is landed after the run, returned or unwound: a landing whose slots only its
        // own copies write lets them go then (those already queued come before any later work
        // on the slots), though a read past its deadline may keep the landing alive.
        let finishing = FinishOnDrop(landing.as_deref());
        let run = pipeline.run(prep, stages);
        // A failed run's copies are waited for while the landing still claims the slots (a
        // settle that times out keeps them claimed until the copies end): no save takes them
        // in between. A run that loaded every layer waited for them before its verdict.
        let run = run.map_err(|e| settle_failed(batch, landing.as_deref(), e));
        drop(finishing);
        let run = run?;
        // With a group, `Auto` records the group's time of this batch at the next gate.
        let last_layer = job.started.elapsed();
        let layer_transfers = landing.as_ref().map(|l| l.transfers()).unwrap_or_default();
        Ok(LoadStats {
            pages: pages as u32,
            layers: self.geometry.num_layers(),
            bytes_read: run.bytes_read,
            bytes_landed: run.landed,
            mode,
            first_layer: run.first_layer,
            last_layer,
            read_groups: run.read_groups,
            transfers: layer_transfers.iter().copied().sum(),
            layer_transfers,
            alone: None,
            plans_differ: Vec::new(),
        })
    }

    /// Whether this rank can read the batch at all: the landing was made (any failure here,
    /// in building the layouts, in the pins or in the preflight is this rank's status from
    /// layer 0). The reader pins the objects ([`pin`](Self::pin)) once it has started the
    /// preflight, so the checksum companions' read does not wait for the pin.
    fn prepare(
        &self,
        batch: BatchId,
        landing_error: Option<&kv_device::DeviceError>,
    ) -> Result<(), KvLoadError> {
        match landing_error {
            // Nothing was started: the batch is refused as larger than the staging, which an
            // engine recomputes without a reset (a `Device` failure asks for one).
            Some(&kv_device::DeviceError::StageTooSmall { layer, need, stage }) => {
                Err(KvLoadError::InvalidPlan {
                    batch,
                    reason: kv_loader::PlanError::LargerThanStaging { layer, need, stage },
                })
            }
            Some(e) => Err(KvLoadError::Device(kv_loader::Cause::with_source(
                format!("{batch}: landing: {e}"),
                e.clone(),
            ))),
            None => Ok(()),
        }
    }

    /// Pins the objects this rank reads for `layers` (one read session, renewed while the load
    /// runs): takes over the session a lookup started for them where it covers them
    /// (`pins_ahead`), else starts one, unless the batch was `cancelled` meanwhile (a `reset`
    /// takes the lookups' pins out, ending a wait for one: no session is started then).
    pub(crate) fn pin<'s>(
        &'s self,
        layers: &BatchLayers,
        batch: BatchId,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<PinnedKeys<'s>, KvLoadError> {
        let my_pages = layers.my_pages();
        let t0 = std::time::Instant::now();
        let read_keys: Vec<&str> = layers
            .own
            .iter()
            .flat_map(|c| c.keys.iter().map(String::as_str))
            .chain(
                layers
                    .shared
                    .iter()
                    .flat_map(|c| c.keys[my_pages.clone()].iter().map(String::as_str)),
            )
            .collect();
        if let Some(pins) = self.take_lookup_pins(&read_keys, layers.rank, batch) {
            return Ok(pins);
        }
        if cancelled() {
            return Err(KvLoadError::Cancelled { batch });
        }
        let pins = PinnedKeys::start(
            &self.calls,
            &read_keys,
            self.config.lease_renewal,
            self.config.store_call_timeout,
        )
        .map_err(|e| {
            // A key the session could not start over (absent: evicted since the lookup) names
            // its plan page, as a read of it would.
            let page = match &e {
                crate::store::StoreError::NotFound { key } => layers
                    .own
                    .iter()
                    .chain(&layers.shared)
                    .find_map(|c| c.keys.iter().position(|k| k == key)),
                _ => None,
            };
            let pages = page.map_or_else(Vec::new, |p| vec![p as u32]);
            store_failure(batch, None, pages, &e)
        })?;
        tracing::debug!(
            %batch,
            rank = layers.rank,
            pin = ?t0.elapsed(),
            keys = read_keys.len(),
            "prepared"
        );
        Ok(pins)
    }

    /// The session a lookup started over `read_keys` (`pins_ahead`), taken over for `batch`
    /// where one covers them, once in if it is still under way (waited for with a bound).
    fn take_lookup_pins(
        &self,
        read_keys: &[&str],
        rank: u32,
        batch: BatchId,
    ) -> Option<PinnedKeys<'_>> {
        // As long as a load waits for a read ahead of its companions (the exchange loop's wait
        // for the reader allows for it): a pin under way is one master call, which the load's
        // own start would wait for anyway on a store that makes session calls one at a time.
        let wait_until = kv_loader::deadline_after(super::prefetch::read_ahead_wait(
            self.config.store_call_timeout,
        ));
        let held = self.pins_ahead.take_covering(read_keys, wait_until)?;
        self.metrics.pins_ahead_taken();
        tracing::debug!(%batch, rank, age = ?held.started.elapsed(), keys = read_keys.len(),
                        "prepared: took the pins of the lookup");
        Some(PinnedKeys::adopt(
            &self.calls,
            (held.session, read_keys),
            held.started,
            self.config.lease_renewal,
            self.config.store_call_timeout,
        ))
    }
}

impl BatchLayers {
    /// Checks that every object this rank reads holds exactly the bytes the geometry expects
    /// (a wrong one is discarded so the next save writes it again, where `on_wrong` says so).
    pub(crate) fn verify_sizes(
        &self,
        reader: &LayerReader<'_>,
        known: (&ChecksumCache, &WrongSized),
        on_wrong: WrongSizeAction,
    ) -> Result<(), KvLoadError> {
        reader.verify_sizes(&self.own, 0..self.pages, known, on_wrong)?;
        reader.verify_sizes(&self.shared, self.my_pages(), known, on_wrong)
    }
}

/// What a batch loaded with the group leaves for the next gate (`Auto` records the group's
/// time there): its time from `in_step`, where the ranks were in step, for the handle's
/// `(epoch, gate)`. A batch too small to measure leaves none: it must not count as one in
/// flight either, or Auto would wait for a time that never comes. Nor does a failed one (its
/// time says nothing, and must not travel later).
fn leave_sample(
    gates: &mut Gates,
    (epoch, gate): (u64, u64),
    loaded: &Result<LoadStats, KvLoadError>,
    in_step: Instant,
) {
    match loaded {
        Ok(stats) if super::auto::AutoMode::measures(stats.bytes_landed) => gates.pending.record(
            epoch,
            gate,
            BatchSample {
                mode: stats.mode,
                landed: stats.bytes_landed,
                took: in_step.elapsed(),
            },
        ),
        _ => gates.pending.clear(),
    }
}

/// How long a batch that failed on the device waits for its next copy into the slots to
/// finish before it takes the device as stalled ([`settle_failed`]).
const DEVICE_FAILED_IDLE: Duration = Duration::from_secs(1);

/// A failed batch's error once the copies its landing queued into the slots have finished
/// (bounded, [`LayerLanding::settle`]): its outcome tells the engine to recompute into those
/// slots, on a stream nothing orders after them. The landing's drop drains the same work, but a
/// read past its deadline may keep the landing alive past the outcome. Copies that did not
/// finish in time make the error a device failure (`ResetThenRecompute`: the slots may still
/// be written), unless it was one already.
fn settle_failed(
    batch: BatchId,
    landing: Option<&dyn LayerLanding>,
    e: KvLoadError,
) -> KvLoadError {
    let Some(landing) = landing else {
        return e;
    };
    // Also for a batch that failed `Device` already: its copies of earlier layers may still
    // be queued while a read past its deadline keeps the landing (and its drain) alive, and a
    // reset does not wait for them. While they keep finishing (a busy device) as long as
    // any batch's; but on a device that stopped making progress the drain limit would only
    // delay the engine's reset (the slots stay claimed until the copies end all the same). A
    // settle that times out poisons the stages, so the drop does not wait the limit out again.
    let settled = if matches!(e, KvLoadError::Device(_)) {
        landing.settle_unless_stalled(DEVICE_FAILED_IDLE)
    } else {
        landing.settle()
    };
    match settled {
        Ok(()) => e,
        // A settle of this landing timed out already (the one before the verdict, which said
        // so at `error`): its copies are known unfinished; one line per cause is enough.
        Err(kv_device::DeviceError::Poisoned(why))
            if why == kv_device::EARLIER_SETTLE_TIMED_OUT
                && matches!(e, KvLoadError::Device(_)) =>
        {
            tracing::debug!(%batch, error = %e, "its copies into the slots are still unfinished");
            e
        }
        Err(d) if matches!(e, KvLoadError::Device(_)) => {
            tracing::error!(%batch, error = %e, device = %d,
                "the batch failed on the device and copies it queued into its slots did not \
                 finish in time");
            e
        }
        Err(d) => {
            tracing::error!(%batch, error = %e, device = %d,
                "the batch failed and copies it queued into its slots did not finish in time");
            KvLoadError::Device(kv_loader::Cause::from_error(d).context(format!(
                "{batch}: failed ({e}), and copies queued into its slots did not finish"
            )))
        }
    }
}

/// Finishes its landing ([`LayerLanding::finish`]) when dropped, also while unwinding from a
/// panic in the batch's run (which the load thread catches before it goes on).
struct FinishOnDrop<'l>(Option<&'l dyn LayerLanding>);

impl Drop for FinishOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.0 {
            if !std::thread::panicking() {
                l.finish();
                return;
            }
            // Unwinding: its copies are waited for here (before the slots' claim goes), as a
            // failed run's are; copies that did not finish make the panicked batch a device
            // failure ([`take_unsettled`]). A second panic (in a landing the engine supplied)
            // would abort: both calls are caught.
            let settled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.settle()))
                .unwrap_or(Err(kv_device::DeviceError::Poisoned(
                    "the landing panicked while its copies were waited for",
                )));
            if let Err(e) = settled {
                tracing::error!(error = %e,
                    "a panicked batch's copies into its slots did not finish in time");
                UNSETTLED.with(|u| u.set(Some(e)));
            }
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| l.finish())).is_err() {
                tracing::error!("a panicked batch's landing panicked again as it finished");
            }
        }
    }
}

thread_local! {
    /// On the load thread: why the copies of the batch that just panicked did not finish, set
    /// while it unwound ([`FinishOnDrop`]), taken when its outcome is made.
    static UNSETTLED: std::cell::Cell<Option<kv_device::DeviceError>> =
        const { std::cell::Cell::new(None) };
}

/// Why the copies of the batch that just panicked on this thread did not finish in time, if
/// they did not (taken: the next batch starts clear).
pub(crate) fn take_unsettled() -> Option<kv_device::DeviceError> {
    UNSETTLED.with(|u| u.take())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's reset or refusal, a missing object, or a bad one is not the mode's failure;
    /// a collective's, a device's, a transfer's or a lease's may be (in a group, the first
    /// failing rank's kind, as `PeerFailed` carries it, with its own words after on that rank).
    #[test]
    fn only_failures_a_mode_may_cause_count_against_it() {
        let peer = |detail: &str| KvLoadError::PeerFailed {
            batch: BatchId(1),
            rank: 2,
            layer: 0,
            detail: detail.into(),
        };
        for kind in [
            "cancelled",
            "busy",
            "duplicate_batch",
            "invalid_plan",
            "store_not_found",
        ] {
            assert!(!mode_may_have_failed(&peer(kind)), "{kind}");
        }
        assert!(!mode_may_have_failed(&peer(
            "cancelled: batch 1: cancelled"
        )));
        assert!(!mode_may_have_failed(&KvLoadError::Cancelled {
            batch: BatchId(1)
        }));
        for kind in ["collective", "store_lease", "timeout", "out_of_step"] {
            assert!(mode_may_have_failed(&peer(kind)), "{kind}");
        }
        assert!(mode_may_have_failed(&peer(
            "store_transfer: `k`: transfer failed"
        )));
        assert!(mode_may_have_failed(&collective_failure(
            BatchId(1),
            "gate"
        )));
    }

    /// Gates whose last judged gate (at batch 3) saw a rank at batch 10 that loaded batch 5
    /// alone and failed batch 6.
    fn behind_at_3() -> Gates {
        let mut record = dedup_broadcast::AloneLoads::default();
        record.settled(5, true);
        record.settled(6, false);
        Gates {
            ahead: dedup_broadcast::RanksAhead {
                ranks: vec![(10, record)],
            },
            ahead_at: 3,
            ..Gates::default()
        }
    }

    /// A batch a rank ahead failed fails with the kind the group's state gave (`GroupDown`
    /// found before the gate keeps its ranks, its words and its typed cause); one it loaded
    /// alone, or one the record was taken at or before, does not fail.
    #[test]
    fn a_batch_a_rank_ahead_failed_fails_keeping_why_the_group_is_down() {
        #[derive(Debug, thiserror::Error)]
        #[error("the formation's own error")]
        struct Formation;
        let gates = behind_at_3();
        // A formation refused (a restarted peer of another version): still not the engine's
        // input to fix, for a batch skipped to stay with the group.
        let down = KvLoadError::GroupDown {
            batch: Some(BatchId(6)),
            missing: vec![2],
            refused: true,
            detail: kv_loader::Cause::with_source("rank 2 is not back", Formation),
        };
        assert!(
            failed_ahead(&gates, BatchId(5), &down).is_none(),
            "loaded alone ahead"
        );
        assert!(
            failed_ahead(&gates, BatchId(3), &down).is_none(),
            "the gate's own batch"
        );
        assert!(
            failed_ahead(&gates, BatchId(11), &down).is_none(),
            "no rank past it"
        );
        match failed_ahead(&gates, BatchId(6), &down) {
            Some(KvLoadError::GroupDown {
                batch,
                missing,
                refused,
                detail,
            }) => {
                assert_eq!(
                    (batch, missing, refused),
                    (Some(BatchId(6)), vec![2], false)
                );
                assert!(detail.detail().contains("rank 2 is not back"), "{detail}");
                assert!(detail.detail().contains("skipped to catch up"), "{detail}");
                assert!(detail.downcast_ref::<Formation>().is_some(), "{detail:?}");
            }
            other => panic!("{other:?}"),
        }
        // The gate broke: a collective failure whose source is the gate's.
        let gate = collective_failure(BatchId(6), "gate: timed out");
        match failed_ahead(&gates, BatchId(6), &gate) {
            Some(e @ KvLoadError::Collective { .. }) => {
                let source = std::error::Error::source(&e)
                    .and_then(std::error::Error::source)
                    .and_then(|s| s.downcast_ref::<KvLoadError>());
                assert_eq!(
                    source.map(|s| s.to_string()),
                    Some(gate.to_string()),
                    "{e:?}"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}
