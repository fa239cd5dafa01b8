//! A scriptable, recording `KvLoader` for engines' own tests (feature `mock`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kv_geometry::{page_hashes, KvGeometry, PageHash};
use layerwise_counter::LayerCounter;
use parking_lot::Mutex;

pub use crate::mock_event::MockLayerEvent;

use crate::{
    BatchId, BatchOutcome, BatchPlan, KvLoadError, KvLoader, LayerReady, LoadStats, LoadTicket,
    LookupHit, LookupRequest, SaveReport, ShareMode, StoreFailure,
};

/// One call the mock saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MockCall {
    /// `lookup` with this many tokens and skipped pages.
    Lookup {
        /// Tokens of the request.
        tokens: usize,
        /// Pages the engine already had.
        skip_pages: usize,
    },
    /// `lookup_pages` with this many page hashes and skipped pages.
    LookupPages {
        /// Page hashes of the request.
        pages: usize,
        /// Pages the engine already had.
        skip_pages: usize,
    },
    /// `start_load` of this batch with this many pages.
    StartLoad {
        /// The batch.
        batch: BatchId,
        /// Its pages.
        pages: usize,
    },
    /// `wait_layer`.
    WaitLayer {
        /// The batch.
        batch: BatchId,
        /// The layer.
        layer: u32,
    },
    /// `wait_batch`.
    WaitBatch {
        /// The batch.
        batch: BatchId,
    },
    /// `abandon` of this batch.
    Abandon {
        /// The batch.
        batch: BatchId,
    },
    /// `completed`.
    Completed,
    /// `save` of this batch with this many pages.
    Save {
        /// The batch.
        batch: BatchId,
        /// Its pages.
        pages: usize,
    },
    /// `save_after_stream` of this batch with this many pages (the stream is not kept: the
    /// mock's pools have none).
    SaveAfterStream {
        /// The batch.
        batch: BatchId,
        /// Its pages.
        pages: usize,
    },
    /// `reset`.
    Reset,
    /// `close`.
    Close,
}

/// The page size of [`MockScript::default`]: 64 tokens, the page size of the model specs
/// kvlink ships (`ModelKvSpec::deepseek_v3`, `glm52_dsa_fp8`). Use
/// [`MockScript::for_geometry`] to take your model's.
pub const MOCK_PAGE_SIZE: u32 = 64;

/// What the mock should do.
///
/// ```
/// use kv_loader::mock::{MockScript, MOCK_PAGE_SIZE};
/// use kv_loader::BatchId;
/// let mut script = MockScript::default();
/// assert_eq!(script.page_size, MOCK_PAGE_SIZE);
/// script.fail_at_layer.insert(BatchId(2), 5);
/// script.time_out.push(BatchId(3));
/// ```
#[derive(Debug, Clone)]
pub struct MockScript {
    /// Pages every lookup finds (capped by the request's whole pages); `None`: all of them.
    pub lookup_pages: Option<usize>,
    /// Batch → layer at which its load fails with a store transfer error.
    pub fail_at_layer: HashMap<BatchId, u32>,
    /// Batches whose layer waits time out, and whose `wait_batch` does too (no outcome comes
    /// until a reset cancels them: `completed` hands them over only then, cancelled).
    pub time_out: Vec<BatchId>,
    /// Batch → layer from which its layer waits time out while the batch itself loads (a
    /// rank whose wait deadline passed on a load that then ended well): its outcome is `Ok`.
    pub wait_time_out_from: HashMap<BatchId, u32>,
    /// Batches that hold a store call past its deadline (a hung store), as the linker's do:
    /// from their start the batch has failed while the call is out, so its layer waits answer
    /// [`KvLoadError::SlotsHeld`], `wait_batch` times out, `completed` skips it, and a `reset`
    /// or `close` answers `SlotsHeld` naming it, until [`MockKvLoader::release`] says the call
    /// returned; its outcome is then the batch's own store failure (a reset between does not
    /// make it `Cancelled`); after a `reset` or `close` its waits find the ticket ended
    /// ([`KvLoadError::StaleTicket`]). Their slots must stay out of use until then: a load
    /// started into one of them (or into a slot of any batch whose outcome is not taken) is
    /// refused, [`KvLoadError::InvalidPlan`] with
    /// [`PlanError::SlotInFlight`](crate::PlanError::SlotInFlight), as the linker's
    /// `start_load` refuses it.
    pub hold_slots: Vec<BatchId>,
    /// Tokens per page, used to hash lookups (0 makes every lookup a `Config` error).
    pub page_size: u32,
    /// Layer waits answer [`LayerReady::Event`] (a [`MockLayerEvent`]), as the linker does on
    /// a device pool, whose copies may still be queued when the layer is ready: an engine
    /// that reads the layer without waiting on the event shows in
    /// [`MockKvLoader::events_not_waited`]. Off: [`LayerReady::Resident`] (a host pool). The
    /// mock keeps every event it hands out (a test tool: one per layer wait).
    pub device_events: bool,
}

impl Default for MockScript {
    /// Every lookup finds every whole page, no failures, pages of [`MOCK_PAGE_SIZE`] tokens.
    fn default() -> Self {
        MockScript {
            lookup_pages: None,
            fail_at_layer: HashMap::new(),
            time_out: Vec::new(),
            wait_time_out_from: HashMap::new(),
            hold_slots: Vec::new(),
            page_size: MOCK_PAGE_SIZE,
            device_events: false,
        }
    }
}

impl MockScript {
    /// The default script with `geometry`'s page size.
    pub fn for_geometry(geometry: &KvGeometry) -> Self {
        MockScript {
            page_size: geometry.page_size(),
            ..MockScript::default()
        }
    }
}

#[derive(Default)]
struct MockState {
    calls: Vec<MockCall>,
    /// Every layer event handed out (`MockScript::device_events`).
    events: Vec<Arc<MockLayerEvent>>,
    live: HashMap<BatchId, (LoadTicket, u32)>,
    /// The slots of each batch whose outcome is not taken yet (a save of those of a batch
    /// still in flight is refused).
    slots: HashMap<BatchId, Vec<u32>>,
    /// Batches a reset cancelled whose outcomes are not taken yet (`Cancelled` when taken).
    cancelled: std::collections::HashSet<BatchId>,
    /// Batches whose store call has not returned (`hold_slots`, until
    /// [`MockKvLoader::release`]): no outcome yet, slots busy.
    held: std::collections::HashSet<BatchId>,
    /// Batches a reset or close ended whose outcomes are not taken yet: their tickets are
    /// ended for waits (`StaleTicket`), as the linker's counter reset ends them.
    ended: std::collections::HashSet<BatchId>,
    /// Batches the engine abandoned ([`KvLoader::abandon`], or a `wait_batch` that timed
    /// out) whose outcomes are not taken yet: their slots go to other batches once they are
    /// not in flight.
    abandoned: std::collections::HashSet<BatchId>,
    /// Batches a `SlotsHeld` answer named whose outcomes are not taken yet: their engine
    /// waits for them (never let go untaken).
    named: std::collections::HashSet<BatchId>,
    closed: bool,
}

/// A [`KvLoader`] that moves no bytes: it records every call and answers from a
/// [`MockScript`], so an engine can test its integration (wait order, failure → recompute)
/// with no store.
///
/// ```
/// use kv_loader::mock::{MockKvLoader, MockScript};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, LogicalPlan};
/// let mut script = MockScript { page_size: 4, ..Default::default() };
/// script.fail_at_layer.insert(BatchId(2), 1);
/// let mock = MockKvLoader::new(3, script);
/// let plan = |b| BatchPlan {
///     logical: LogicalPlan { batch: BatchId(b), requests: vec![], components: vec![] },
///     slots: vec![],
/// };
/// let ok = mock.start_load(plan(1)).unwrap();
/// assert!(mock.wait_layer(&ok, 2).is_ok());
/// let bad = mock.start_load(plan(2)).unwrap();
/// assert!(mock.wait_layer(&bad, 0).is_ok());
/// assert!(mock.wait_layer(&bad, 1).is_err());
/// assert!(mock.wait_batch(&bad).unwrap().result.is_err());
/// ```
pub struct MockKvLoader {
    num_layers: u32,
    script: MockScript,
    state: Mutex<MockState>,
    counter: LayerCounter<()>,
    /// The first `close`'s answer, held while it runs: a later or concurrent `close` returns
    /// it, as the linker's does.
    close_answer: Mutex<Option<Result<(), KvLoadError>>>,
    /// Runs in `start_load` between its first check and its state lock (a test of that
    /// window: a `close` there).
    #[cfg(test)]
    between_checks: Mutex<Option<BetweenChecks>>,
}

impl std::fmt::Debug for MockKvLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MockKvLoader")
            .field("num_layers", &self.num_layers)
            .field("script", &self.script)
            .finish_non_exhaustive()
    }
}

/// A test's step in `start_load`'s window (see `MockKvLoader::between_checks`).
#[cfg(test)]
type BetweenChecks = Box<dyn FnOnce(&MockKvLoader) + Send>;

impl MockKvLoader {
    /// A mock for a model of `num_layers` layers.
    pub fn new(num_layers: u32, script: MockScript) -> Self {
        MockKvLoader {
            num_layers,
            script,
            state: Mutex::new(MockState::default()),
            counter: LayerCounter::new(),
            close_answer: Mutex::new(None),
            #[cfg(test)]
            between_checks: Mutex::new(None),
        }
    }

    /// What `save` and `save_after_stream` do once recorded: the plan's checks, then a report
    /// of every page written.
    fn saved(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        let batch = plan.logical.batch;
        // The plan's checks that need no geometry (as the linker), and no slot of a load whose
        // outcome is not taken unless a reset ended that load (a held store call's stay busy):
        // the rule the docs give engines. Stricter than the linker, which lets a load's slots
        // go a little after its last layer whether or not its outcome was taken; it refuses a
        // busy slot as this does, a device error.
        if let Some(reason) = slot_problem(plan, true) {
            return Err(KvLoadError::InvalidPlan { batch, reason });
        }
        let busy = {
            let st = self.state.lock();
            // A batch a reset or close ended (cancelled in flight, or finished with its outcome
            // not taken) lets its slots go, and so does one abandoned whose load is over (as
            // for a load into them); a held store call's keep them.
            let holds = |b: &BatchId| {
                let abandoned = st.abandoned.contains(b) && !self.in_flight(&st, b);
                st.held.contains(b)
                    || !(abandoned || st.cancelled.contains(b) || st.ended.contains(b))
            };
            plan.slots.iter().copied().find(|slot| {
                st.slots
                    .iter()
                    .any(|(b, slots)| holds(b) && slots.contains(slot))
            })
        };
        if let Some(slot) = busy {
            return Err(KvLoadError::Device(crate::Cause::from(format!(
                "mock: page slot {slot} is busy: a load whose outcome is not taken holds it"
            ))));
        }
        let pages = plan.logical.num_pages();
        let objects = pages.saturating_mul(plan.logical.components.len());
        let mut report = SaveReport {
            objects_written: u32::try_from(objects).unwrap_or(u32::MAX),
            ..SaveReport::default()
        };
        if !plan.logical.components.is_empty() {
            report.pages_written = (0..u32::try_from(pages).unwrap_or(u32::MAX)).collect();
        }
        report.settle_pages(pages);
        Ok(report)
    }

    /// The store call held by `batch` (`MockScript::hold_slots`) returned: its outcome (the
    /// batch's store failure) can be taken from now on, and its slots may be reused once it
    /// is.
    pub fn release(&self, batch: BatchId) {
        let mut st = self.state.lock();
        st.held.remove(&batch);
        self.trim_ended(&mut st);
    }

    /// The layer events handed out ([`MockScript::device_events`]) that the engine never
    /// waited on, as (batch, layer): each is a layer it may have read before its bytes landed
    /// on a device pool.
    ///
    /// ```
    /// use kv_loader::mock::{MockKvLoader, MockScript};
    /// use kv_loader::{BatchId, BatchPlan, KvLoader, LayerReady, LogicalPlan};
    /// let mock = MockKvLoader::new(2, MockScript { device_events: true, ..Default::default() });
    /// let plan = BatchPlan {
    ///     logical: LogicalPlan { batch: BatchId(1), requests: vec![], components: vec![] },
    ///     slots: vec![],
    /// };
    /// let t = mock.start_load(plan).unwrap();
    /// let LayerReady::Event(ev) = mock.wait_layer(&t, 0).unwrap() else { panic!() };
    /// let _forgotten = mock.wait_layer(&t, 1).unwrap();
    /// ev.synchronize().unwrap();
    /// assert_eq!(mock.events_not_waited(), vec![(BatchId(1), 1)]);
    /// ```
    pub fn events_not_waited(&self) -> Vec<(BatchId, u32)> {
        // A layer waited for twice counts as waited when either of its events was.
        let mut waited = std::collections::BTreeMap::<(BatchId, u32), bool>::new();
        for e in &self.state.lock().events {
            *waited.entry((e.batch, e.layer)).or_default() |= e.waited();
        }
        waited
            .into_iter()
            .filter(|&(_, w)| !w)
            .map(|(layer, _)| layer)
            .collect()
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<MockCall> {
        self.state.lock().calls.clone()
    }

    fn record(&self, call: MockCall) -> Result<(), KvLoadError> {
        let mut s = self.state.lock();
        s.calls.push(call);
        if s.closed {
            return Err(KvLoadError::Closed);
        }
        Ok(())
    }

    /// Records a call that still answers after `close` (as the linker's: outcomes stay to be
    /// taken, and a second close answers as the first).
    fn record_open_or_closed(&self, call: MockCall) {
        self.state.lock().calls.push(call);
    }

    /// Whether `batch` is still loading: a time-out a reset has not cancelled, or a store call
    /// that has not returned (held).
    fn in_flight(&self, st: &MockState, batch: &BatchId) -> bool {
        st.held.contains(batch)
            || (self.script.time_out.contains(batch) && !st.cancelled.contains(batch))
    }

    /// Whether `batch`'s slots may go to other batches before its outcome is taken: the
    /// engine abandoned it and it is not in flight, or a reset or close ended it failed (as
    /// the linker lets them go); a held store call's batch keeps its slots.
    fn slots_let_go(&self, st: &MockState, batch: &BatchId) -> bool {
        if st.abandoned.contains(batch) && !self.in_flight(st, batch) {
            return true;
        }
        st.ended.contains(batch)
            && !st.held.contains(batch)
            && !self.script.hold_slots.contains(batch)
            && (st.cancelled.contains(batch)
                || self.script.fail_at_layer.contains_key(batch)
                || self.script.time_out.contains(batch))
    }

    /// Cancels every batch in flight (`reset`, `close`); the batches whose store call has not
    /// returned (their outcomes wait for `release`).
    fn cancel_in_flight(&self) -> Vec<BatchId> {
        let mut st = self.state.lock();
        let in_flight: Vec<BatchId> = st
            .live
            .keys()
            .copied()
            .filter(|b| self.in_flight(&st, b))
            .collect();
        st.cancelled.extend(in_flight);
        let live: Vec<BatchId> = st.live.keys().copied().collect();
        st.ended.extend(live);
        let held: Vec<BatchId> = st.held.iter().copied().collect();
        // Named in the `SlotsHeld` answer.
        st.named.extend(held.iter().copied());
        self.trim_ended(&mut st);
        held
    }

    /// As the linker: the counter slots of abandoned batches whose load is over (not held,
    /// not timing out) are taken back; their outcomes count among the ended ones. How many.
    fn reclaim_abandoned(&self, st: &mut MockState) -> usize {
        let over: Vec<LoadTicket> = st
            .abandoned
            .iter()
            .filter(|b| !self.in_flight(st, b) && !st.ended.contains(*b))
            .filter_map(|b| st.live.get(b).map(|(t, _)| *t))
            .collect();
        for t in &over {
            let _ = self.counter.finish(t.counter);
            st.ended.insert(t.batch);
        }
        if !over.is_empty() {
            self.trim_ended(st);
        }
        over.len()
    }

    /// As the linker: at most the capacity's worth of outcomes of batches a reset or close
    /// ended are kept untaken; past it, those of abandoned batches go first, then the others,
    /// each the earliest started first. Never one held (`hold_slots`) nor one a `SlotsHeld`
    /// answer named.
    fn trim_ended(&self, st: &mut MockState) {
        let capacity = self.counter.capacity() as usize;
        let mut ended: Vec<(bool, u64, BatchId)> = st
            .ended
            .iter()
            .copied()
            .filter(|b| !st.held.contains(b) && !st.named.contains(b))
            .map(|b| {
                let started = st.live.get(&b).map_or(0, |(t, _)| t.counter.generation());
                (!st.abandoned.contains(&b), started, b)
            })
            .collect();
        if ended.len() <= capacity {
            return;
        }
        ended.sort_unstable();
        ended.truncate(ended.len() - capacity);
        // As the linker: abandoned batches' outcomes are the engine's to leave.
        let all_abandoned = ended.iter().all(|(kept_by_engine, ..)| !kept_by_engine);
        let batches: Vec<BatchId> = ended.into_iter().map(|(_, _, b)| b).collect();
        for b in &batches {
            st.live.remove(b);
            st.slots.remove(b);
            st.ended.remove(b);
            st.cancelled.remove(b);
            st.abandoned.remove(b);
        }
        if all_abandoned {
            tracing::debug!(
                ?batches,
                kept = capacity,
                "mock: outcomes of abandoned batches never taken: the earliest are let go"
            );
            return;
        }
        tracing::warn!(
            ?batches,
            kept = capacity,
            "mock: outcomes of batches a reset or close ended were never taken: the earliest \
             are let go"
        );
    }

    fn live_ticket(&self, ticket: &LoadTicket) -> Result<(), KvLoadError> {
        let s = self.state.lock();
        match s.live.get(&ticket.batch) {
            Some((t, _)) if t == ticket => Ok(()),
            _ => Err(KvLoadError::StaleTicket {
                batch: ticket.batch,
            }),
        }
    }

    /// The failure of a batch whose store call was held (`hold_slots`): past its deadline.
    fn held_failure(&self, batch: BatchId) -> KvLoadError {
        KvLoadError::Store {
            batch: Some(batch),
            layer: Some(0),
            pages: Vec::new().into(),
            kind: StoreFailure::RpcTimeout,
            detail: "scripted store call held past its deadline (mock)".into(),
        }
    }

    fn failure(&self, batch: BatchId, layer: u32) -> KvLoadError {
        KvLoadError::Store {
            batch: Some(batch),
            layer: Some(layer),
            pages: Vec::new().into(),
            kind: StoreFailure::TransferFailed,
            detail: "scripted failure (mock)".into(),
        }
    }

    fn page_size(&self) -> Result<u32, KvLoadError> {
        match self.script.page_size {
            0 => Err(KvLoadError::Config(
                "mock: MockScript::page_size is 0 (use MockScript::default or for_geometry)".into(),
            )),
            ps => Ok(ps),
        }
    }

    fn hit(&self, all: &[PageHash], skip_pages: usize) -> LookupHit {
        let first = skip_pages.min(all.len());
        let avail = all.len() - first;
        let n = self.script.lookup_pages.map_or(avail, |p| p.min(avail));
        LookupHit {
            pages: all[first..first + n].to_vec(),
            first_page: first,
            tokens: n * self.script.page_size as usize,
        }
    }

    /// The outcome of a batch taken out of `live`; `cancelled`: a reset cancelled it (its
    /// marker taken under the same lock, so that a new batch of the same id started since
    /// cannot inherit it).
    fn outcome(&self, ticket: &LoadTicket, pages: u32, cancelled: bool) -> BatchOutcome {
        let b = ticket.batch;
        let result = if self.script.hold_slots.contains(&b) {
            // The batch failed on its store call; a reset does not change what it failed of.
            Err(self.held_failure(b))
        } else if cancelled {
            Err(KvLoadError::Cancelled { batch: b })
        } else if let Some(&l) = self.script.fail_at_layer.get(&b) {
            Err(self.failure(b, l))
        } else if self.script.time_out.contains(&b) {
            Err(KvLoadError::Timeout {
                batch: b,
                layer: 0,
                waited: Duration::ZERO,
            })
        } else {
            Ok(LoadStats {
                pages,
                layers: ticket.num_layers,
                bytes_read: 0,
                bytes_landed: 0,
                mode: ShareMode::AllRanks,
                first_layer: Duration::ZERO,
                last_layer: Duration::ZERO,
                transfers: Default::default(),
                layer_transfers: Vec::new(),
                alone: None,
                read_groups: Vec::new(),
                plans_differ: Vec::new(),
            })
        };
        BatchOutcome { batch: b, result }
    }
}

/// Why a plan is refused without a geometry: [`BatchPlan::check_shape`], or a slot twice.
fn slot_problem(plan: &BatchPlan, save: bool) -> Option<crate::PlanError> {
    if let Err(e) = plan.check_shape() {
        return Some(e);
    }
    let mut first = HashMap::with_capacity(plan.slots.len());
    let pages: Vec<_> = if save {
        plan.logical.pages().collect()
    } else {
        Vec::new()
    };
    for (page, &slot) in plan.slots.iter().enumerate() {
        if let Some(&f) = first.get(&slot) {
            // A save reads its slots: one named again for the same page is read twice.
            if save && pages.get(f).is_some() && pages.get(f) == pages.get(page) {
                continue;
            }
            return Some(crate::PlanError::DuplicateSlot {
                slot,
                first: f,
                second: page,
            });
        }
        first.insert(slot, page);
    }
    None
}

impl KvLoader for MockKvLoader {
    fn num_layers(&self) -> u32 {
        self.num_layers
    }

    fn lookup(&self, request: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
        self.record(MockCall::Lookup {
            tokens: request.tokens.len(),
            skip_pages: request.skip_pages,
        })?;
        let ps = self.page_size()?;
        let all = page_hashes(request.tokens, ps, None);
        Ok(self.hit(&all, request.skip_pages))
    }

    fn lookup_pages(
        &self,
        pages: &[PageHash],
        skip_pages: usize,
    ) -> Result<LookupHit, KvLoadError> {
        self.record(MockCall::LookupPages {
            pages: pages.len(),
            skip_pages,
        })?;
        self.page_size()?;
        Ok(self.hit(pages, skip_pages))
    }

    fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError> {
        let batch = plan.logical.batch;
        self.record(MockCall::StartLoad {
            batch,
            pages: plan.logical.num_pages(),
        })?;
        // The checks a plan needs no geometry for, as the Linker's `BatchPlan::validate` does.
        if let Some(reason) = slot_problem(&plan, false) {
            return Err(KvLoadError::InvalidPlan { batch, reason });
        }
        #[cfg(test)]
        if let Some(between) = self.between_checks.lock().take() {
            between(self);
        }
        let mut state = self.state.lock();
        if state.closed {
            // `close` ran since `record` checked (as the linker, which checks again).
            return Err(KvLoadError::Closed);
        }
        if state.live.contains_key(&batch) {
            return Err(KvLoadError::DuplicateBatch { batch });
        }
        // As the linker: a slot of a batch whose outcome is not taken (loading, held or done)
        // is refused, the rule `SlotsHeld` and the docs give engines; not one of a batch a
        // reset ended failed (its pages are not to be used).
        let taken_by = plan.slots.iter().enumerate().find_map(|(page, slot)| {
            state
                .slots
                .iter()
                .filter(|(b, _)| !self.slots_let_go(&state, b))
                .find(|(_, slots)| slots.contains(slot))
                .map(|(b, _)| crate::PlanError::SlotInFlight {
                    slot: *slot,
                    page,
                    batch: *b,
                })
        });
        if let Some(reason) = taken_by {
            return Err(KvLoadError::InvalidPlan { batch, reason });
        }
        let layers = self.num_layers.max(1);
        let counter = match self.counter.begin(layers) {
            // As the Linker: the counter slots of abandoned batches whose load is over are
            // taken back when a start needs them (their outcomes stay, among the ended ones).
            Err(layerwise_counter::CounterError::Full { .. })
                if self.reclaim_abandoned(&mut state) > 0 =>
            {
                self.counter.begin(layers)
            }
            started => started,
        }
        .map_err(|e| match e {
            // As the Linker: too many batches in flight is back-pressure, not a fault.
            layerwise_counter::CounterError::Full { capacity } => KvLoadError::Busy {
                capacity,
                peers_fail: false,
            },
            other => KvLoadError::internal(
                batch,
                crate::Cause::with_source(format!("mock: {other}"), other),
            ),
        })?;
        let ticket = LoadTicket {
            batch,
            num_layers: self.num_layers,
            counter,
        };
        let pages = u32::try_from(plan.logical.num_pages()).unwrap_or(u32::MAX);
        state.live.insert(batch, (ticket, pages));
        state.slots.insert(batch, plan.slots.clone());
        if self.script.hold_slots.contains(&batch) {
            state.held.insert(batch);
            // Its waits answer `SlotsHeld` (as the linker's, whose engine waits for the
            // outcome): never let go untaken.
            state.named.insert(batch);
        }
        Ok(ticket)
    }

    fn wait_layer(&self, ticket: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError> {
        // As the Linker: after `close` a ticket is stale (close ended its batch), not `Closed`.
        self.record_open_or_closed(MockCall::WaitLayer {
            batch: ticket.batch,
            layer,
        });
        self.live_ticket(ticket)?;
        let (ended, held) = {
            let st = self.state.lock();
            (
                // A cancelled batch is one of those a reset or close ended.
                st.ended.contains(&ticket.batch),
                st.held.contains(&ticket.batch),
            )
        };
        if ended {
            // As the Linker: a reset ends the batch's tickets (a thread already waiting then
            // hears `Cancelled`; the mock never blocks, so every wait after is this), a
            // held batch's too (its outcome still waits for the call).
            return Err(KvLoadError::StaleTicket {
                batch: ticket.batch,
            });
        }
        if held {
            // As the Linker: the batch failed while its store call is out; the slots stay
            // held until the call returns and the outcome is taken.
            return Err(KvLoadError::SlotsHeld {
                batches: vec![ticket.batch].into(),
            });
        }
        if self.script.hold_slots.contains(&ticket.batch) {
            // Released, outcome not taken: as the Linker's counter, which keeps the batch's
            // first failure (`SlotsHeld`) for every wait until the outcome is taken.
            return Err(KvLoadError::SlotsHeld {
                batches: vec![ticket.batch].into(),
            });
        }
        if layer >= self.num_layers {
            return Err(KvLoadError::InvalidPlan {
                batch: ticket.batch,
                reason: crate::PlanError::LayerOutOfRange {
                    layer,
                    num_layers: self.num_layers,
                },
            });
        }
        let late =
            matches!(self.script.wait_time_out_from.get(&ticket.batch), Some(&l) if layer >= l);
        if late || self.script.time_out.contains(&ticket.batch) {
            return Err(KvLoadError::Timeout {
                batch: ticket.batch,
                layer,
                waited: Duration::ZERO,
            });
        }
        match self.script.fail_at_layer.get(&ticket.batch) {
            Some(&l) if layer >= l => Err(self.failure(ticket.batch, l)),
            _ if self.script.device_events => {
                let ev = Arc::new(MockLayerEvent::new(ticket.batch, layer));
                self.state.lock().events.push(ev.clone());
                Ok(LayerReady::Event(ev))
            }
            _ => Ok(LayerReady::Resident),
        }
    }

    fn wait_batch(&self, ticket: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
        self.record_open_or_closed(MockCall::WaitBatch {
            batch: ticket.batch,
        });
        self.live_ticket(ticket)?;
        let in_flight = self.in_flight(&self.state.lock(), &ticket.batch);
        if in_flight {
            // As the Linker: no outcome came by the wait's deadline, so there is none to
            // return; the batch stays in flight (unsettled: the engine resets the loader,
            // and recomputes into the slots: abandoned).
            self.state.lock().abandoned.insert(ticket.batch);
            return Err(KvLoadError::Timeout {
                batch: ticket.batch,
                layer: ticket.num_layers.saturating_sub(1),
                waited: Duration::ZERO,
            });
        }
        // Checked and taken under one lock: of two threads taking the same outcome (two
        // waits, or a wait and `completed`), one gets it and the other a stale ticket.
        let (pages, cancelled) = {
            let mut st = self.state.lock();
            match st.live.get(&ticket.batch) {
                Some((t, _)) if t == ticket => {
                    st.slots.remove(&ticket.batch);
                    st.abandoned.remove(&ticket.batch);
                    st.named.remove(&ticket.batch);
                    st.ended.remove(&ticket.batch);
                    let cancelled = st.cancelled.remove(&ticket.batch);
                    let pages = st.live.remove(&ticket.batch).map_or(0, |(_, p)| p);
                    (pages, cancelled)
                }
                _ => {
                    return Err(KvLoadError::StaleTicket {
                        batch: ticket.batch,
                    })
                }
            }
        };
        let _ = self.counter.finish(ticket.counter);
        Ok(self.outcome(ticket, pages, cancelled))
    }

    /// As the linker (recorded as [`MockCall::Abandon`]).
    fn abandon(&self, ticket: &LoadTicket) {
        let mut st = self.state.lock();
        st.calls.push(MockCall::Abandon {
            batch: ticket.batch,
        });
        if st.live.get(&ticket.batch).is_some_and(|(t, _)| t == ticket) {
            st.abandoned.insert(ticket.batch);
        }
    }

    fn completed(&self) -> Vec<BatchOutcome> {
        self.record_open_or_closed(MockCall::Completed);
        // As the linker: a batch still in flight (a time-out not cancelled) or whose store call
        // has not returned (held) has no outcome yet.
        let live: Vec<(LoadTicket, u32, bool)> = {
            let mut st = self.state.lock();
            let ready: Vec<BatchId> = st
                .live
                .keys()
                .copied()
                .filter(|b| !self.in_flight(&st, b))
                .collect();
            let mut taken = Vec::with_capacity(ready.len());
            for b in &ready {
                st.slots.remove(b);
                st.abandoned.remove(b);
                st.named.remove(b);
                st.ended.remove(b);
                let cancelled = st.cancelled.remove(b);
                if let Some((t, p)) = st.live.remove(b) {
                    taken.push((t, p, cancelled));
                }
            }
            taken
        };
        for (t, ..) in &live {
            let _ = self.counter.finish(t.counter);
        }
        let mut out: Vec<BatchOutcome> = live
            .iter()
            .map(|(t, p, c)| self.outcome(t, *p, *c))
            .collect();
        out.sort_by_key(|o| o.batch);
        out
    }

    fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        self.record(MockCall::Save {
            batch: plan.logical.batch,
            pages: plan.logical.num_pages(),
        })?;
        self.saved(plan)
    }

    /// Recorded as its own call, so that an engine's test can tell it named its stream; saved
    /// as `save` is.
    fn save_after_stream(
        &self,
        plan: &BatchPlan,
        stream: crate::RawStream,
    ) -> Result<SaveReport, KvLoadError> {
        let _ = stream;
        self.record(MockCall::SaveAfterStream {
            batch: plan.logical.batch,
            pages: plan.logical.num_pages(),
        })?;
        self.saved(plan)
    }

    fn reset(&self) -> Result<(), KvLoadError> {
        self.record(MockCall::Reset)?;
        // As the Linker does: the batches in flight end cancelled; every outcome stays to be
        // taken (a finished batch's as it was), and the ids stay in use until then.
        let mut all_held = self.cancel_in_flight();
        self.counter.reset();
        if all_held.is_empty() {
            return Ok(());
        }
        all_held.sort();
        Err(KvLoadError::SlotsHeld {
            batches: all_held.into(),
        })
    }

    fn close(&self) -> Result<(), KvLoadError> {
        self.record_open_or_closed(MockCall::Close);
        // As the linker: a second close answers as the first did (`SlotsHeld` included); the
        // first cancels what is in flight, and every outcome stays to be taken
        // (`wait_batch`, `completed`) after it.
        let mut answer = self.close_answer.lock();
        if let Some(first) = answer.as_ref() {
            return first.clone();
        }
        self.state.lock().closed = true;
        let mut held = self.cancel_in_flight();
        let first = if held.is_empty() {
            Ok(())
        } else {
            held.sort();
            Err(KvLoadError::SlotsHeld {
                batches: held.into(),
            })
        };
        *answer = Some(first.clone());
        first
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_script_hashes_whole_pages_of_the_documented_size() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let tokens: Vec<u32> = (0..(MOCK_PAGE_SIZE * 3 + 5)).collect();
        let hit = mock
            .lookup(&LookupRequest {
                tokens: &tokens,
                skip_pages: 1,
            })
            .unwrap();
        assert_eq!(hit.pages.len(), 2);
        assert_eq!(hit.first_page, 1);
        assert_eq!(hit.tokens, 2 * MOCK_PAGE_SIZE as usize);
        assert_eq!(hit.pages, page_hashes(&tokens, MOCK_PAGE_SIZE, None)[1..]);
    }

    #[test]
    fn page_size_zero_is_a_config_error_not_one_page_per_token() {
        let script = MockScript {
            page_size: 0,
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let err = mock
            .lookup(&LookupRequest {
                tokens: &[1, 2, 3],
                skip_pages: 0,
            })
            .unwrap_err();
        assert!(matches!(err, KvLoadError::Config(_)), "{err}");
    }

    fn plan(batch: u64) -> BatchPlan {
        BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(batch),
                requests: vec![],
                components: vec![],
            },
            slots: vec![],
        }
    }

    /// A save naming the engine's stream is its own call (an engine's test can tell it used
    /// the ordered save) and saves as `save` does. A loader that keeps the trait's default
    /// refuses it (`Config`): it cannot order the save, and must not store pages the engine
    /// may not have written yet.
    #[test]
    fn a_save_after_the_engines_stream_is_recorded_and_the_default_refuses() {
        let mock = MockKvLoader::new(2, MockScript::default());
        // SAFETY: the mock never uses the handle.
        let stream = unsafe { crate::RawStream::from_raw(0x10) };
        let report = mock
            .save_after_stream(&one_page_plan(1, 3), stream)
            .unwrap();
        assert_eq!(report.objects_written, 1);
        assert_eq!(
            mock.calls(),
            vec![MockCall::SaveAfterStream {
                batch: BatchId(1),
                pages: 1
            }]
        );
        /// A loader of the trait's defaults, forwarding the rest to the mock.
        struct Plain(MockKvLoader);
        impl KvLoader for Plain {
            fn num_layers(&self) -> u32 {
                self.0.num_layers()
            }
            fn lookup(&self, r: &LookupRequest<'_>) -> Result<LookupHit, KvLoadError> {
                self.0.lookup(r)
            }
            fn lookup_pages(&self, p: &[PageHash], s: usize) -> Result<LookupHit, KvLoadError> {
                self.0.lookup_pages(p, s)
            }
            fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError> {
                self.0.start_load(plan)
            }
            fn wait_layer(&self, t: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError> {
                self.0.wait_layer(t, layer)
            }
            fn wait_batch(&self, t: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
                self.0.wait_batch(t)
            }
            fn completed(&self) -> Vec<BatchOutcome> {
                self.0.completed()
            }
            fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
                self.0.save(plan)
            }
            fn reset(&self) -> Result<(), KvLoadError> {
                self.0.reset()
            }
            fn close(&self) -> Result<(), KvLoadError> {
                self.0.close()
            }
        }
        let plain = Plain(MockKvLoader::new(2, MockScript::default()));
        let err = plain
            .save_after_stream(&one_page_plan(2, 4), stream)
            .unwrap_err();
        assert!(matches!(err, KvLoadError::Config(_)), "{err}");
        assert!(plain.0.calls().is_empty(), "nothing saved");
    }

    /// A plan of one page into `slot`.
    fn one_page_plan(batch: u64, slot: u32) -> BatchPlan {
        BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(batch),
                requests: vec![crate::RequestPages {
                    request: "r".into(),
                    pages: vec![PageHash([7; 32])],
                }],
                components: vec![kv_geometry::ComponentId(0)],
            },
            slots: vec![slot],
        }
    }

    #[test]
    fn of_threads_taking_one_outcome_at_once_exactly_one_gets_it() {
        for _ in 0..200 {
            let mock = MockKvLoader::new(2, MockScript::default());
            let t = mock.start_load(plan(1)).unwrap();
            let (a, b, c) = std::thread::scope(|s| {
                let a = s.spawn(|| mock.wait_batch(&t).is_ok());
                let b = s.spawn(|| mock.wait_batch(&t).is_ok());
                let c = s.spawn(|| mock.completed().len());
                (a.join().unwrap(), b.join().unwrap(), c.join().unwrap())
            });
            assert_eq!(usize::from(a) + usize::from(b) + c, 1, "{a} {b} {c}");
        }
    }

    #[test]
    fn a_batch_id_in_use_is_refused_and_a_layer_past_the_model_is_an_error() {
        let script = MockScript {
            time_out: vec![BatchId(2)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(3, script);
        let t = mock.start_load(plan(1)).unwrap();
        assert!(matches!(
            mock.start_load(plan(1)),
            Err(KvLoadError::DuplicateBatch { batch: BatchId(1) })
        ));
        assert!(matches!(
            mock.wait_layer(&t, 3),
            Err(KvLoadError::InvalidPlan {
                reason: crate::PlanError::LayerOutOfRange {
                    layer: 3,
                    num_layers: 3
                },
                ..
            })
        ));
        assert!(matches!(mock.wait_layer(&t, 2), Ok(LayerReady::Resident)));
        mock.wait_batch(&t).unwrap().result.unwrap();
        // Taken: the id is free again.
        let one = mock.start_load(plan(1)).unwrap();
        // A reset cancels a batch in flight (2, timing out); batch 1, which had loaded, keeps
        // its outcome. A later wait finds either ticket ended, as with the Linker (its counter
        // reset). Both outcomes stay to be taken, and their ids in use until then.
        let t = mock.start_load(plan(2)).unwrap();
        mock.reset().unwrap();
        assert!(matches!(
            mock.wait_layer(&t, 0),
            Err(KvLoadError::StaleTicket { batch: BatchId(2) })
        ));
        assert!(matches!(
            mock.wait_layer(&one, 0),
            Err(KvLoadError::StaleTicket { batch: BatchId(1) })
        ));
        assert!(matches!(
            mock.start_load(plan(1)),
            Err(KvLoadError::DuplicateBatch { batch: BatchId(1) })
        ));
        let taken = mock.completed();
        assert_eq!(taken.len(), 2);
        assert!(taken[0].result.is_ok(), "{:?}", taken[0]);
        assert!(matches!(
            taken[1].result,
            Err(KvLoadError::Cancelled { .. })
        ));
        let _ = mock.start_load(plan(1)).unwrap();
        assert!(
            mock.completed()[0].result.is_ok(),
            "a new run's own outcome"
        );
    }

    #[test]
    fn lookup_by_pages_answers_as_lookup_by_tokens() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let tokens: Vec<u32> = (0..(MOCK_PAGE_SIZE * 4)).collect();
        let by_tokens = mock
            .lookup(&LookupRequest {
                tokens: &tokens,
                skip_pages: 1,
            })
            .unwrap();
        let pages = page_hashes(&tokens, MOCK_PAGE_SIZE, None);
        assert_eq!(mock.lookup_pages(&pages, 1).unwrap(), by_tokens);
    }

    /// The mock answers as the Linker does where an engine's tests would otherwise take
    /// another branch: plans with a slot per page, no slot twice, and components (at least
    /// one, in increasing order), back-pressure as
    /// `Busy`, a batch that times out has no outcome to wait for.
    #[test]
    fn plans_back_pressure_and_time_outs_answer_as_the_linker_does() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let mut two_pages = plan(1);
        two_pages.logical.requests = vec![crate::RequestPages {
            request: crate::RequestId("r".into()),
            pages: vec![PageHash([1; 32]), PageHash([2; 32])],
        }];
        let refused = |p: &BatchPlan| match mock.start_load(p.clone()) {
            Err(KvLoadError::InvalidPlan { reason, .. }) => reason,
            other => panic!("{other:?}"),
        };
        assert!(matches!(
            refused(&two_pages),
            crate::PlanError::SlotCount { pages: 2, slots: 0 }
        ));
        two_pages.slots = vec![3, 4];
        assert_eq!(
            refused(&two_pages),
            crate::PlanError::NoComponents { pages: 2 }
        );
        two_pages.logical.components =
            vec![kv_geometry::ComponentId(1), kv_geometry::ComponentId(0)];
        assert_eq!(refused(&two_pages), crate::PlanError::BadComponent(0));
        two_pages.logical.components = vec![kv_geometry::ComponentId(0)];
        two_pages.slots = vec![3, 3];
        assert!(matches!(
            refused(&two_pages),
            crate::PlanError::DuplicateSlot {
                slot: 3,
                first: 0,
                second: 1
            }
        ));
        two_pages.slots = vec![3, 4];
        let _ = mock.start_load(two_pages).unwrap();
        for b in 2..=layerwise_counter::DEFAULT_CAPACITY as u64 {
            let _ = mock.start_load(plan(b)).unwrap();
        }
        assert!(matches!(
            mock.start_load(plan(1000)),
            Err(KvLoadError::Busy {
                capacity: layerwise_counter::DEFAULT_CAPACITY,
                peers_fail: false,
            })
        ));
        let mut script = MockScript::default();
        script.time_out.push(BatchId(7));
        let mock = MockKvLoader::new(2, script);
        let t = mock.start_load(plan(7)).unwrap();
        assert!(matches!(
            mock.wait_batch(&t),
            Err(KvLoadError::Timeout { .. })
        ));
        assert!(mock.completed().is_empty(), "no outcome while it hangs");
        mock.reset().unwrap();
        let after = mock.completed();
        assert!(
            matches!(after[0].result, Err(KvLoadError::Cancelled { .. })),
            "{after:?}"
        );
    }

    /// `rounds` times: a capacity's worth of batches from id `next` on, each abandoned, then
    /// a reset. The next id.
    fn abandoned_rounds(mock: &MockKvLoader, mut next: u64, rounds: usize) -> u64 {
        for _ in 0..rounds {
            for _ in 0..layerwise_counter::DEFAULT_CAPACITY {
                let t = mock.start_load(plan(next)).unwrap();
                mock.abandon(&t);
                next += 1;
            }
            mock.reset().unwrap();
        }
        next
    }

    /// As the linker: batches abandoned once over give their places back when a start needs
    /// them, without a reset; their outcomes are still handed out, the capacity's worth of
    /// the newest. Before, the capacity's worth of abandoned batches made every start `Busy`.
    #[test]
    fn abandoned_batches_give_their_places_back_without_a_reset() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let capacity = layerwise_counter::DEFAULT_CAPACITY as u64;
        for b in 1..=2 * capacity {
            let t = mock.start_load(plan(b)).unwrap();
            mock.abandon(&t);
        }
        let live = mock.start_load(plan(2 * capacity + 1)).unwrap();
        let kept: Vec<u64> = mock.completed().iter().map(|o| o.batch.0).collect();
        let newest: Vec<u64> = (capacity + 1..=2 * capacity + 1).collect();
        assert_eq!(kept, newest, "the newest abandoned ones, and the live one");
        assert!(mock.wait_batch(&live).is_err(), "taken by completed");
    }

    /// As the linker: at most the capacity's worth of outcomes a reset left untaken are kept
    /// (the newest); an engine that never takes them neither meets `Busy` nor keeps them
    /// without bound.
    #[test]
    fn outcomes_a_reset_leaves_untaken_are_kept_up_to_the_capacity() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let capacity = layerwise_counter::DEFAULT_CAPACITY as u64;
        let next = abandoned_rounds(&mock, 1, 3);
        let kept: Vec<u64> = mock.completed().iter().map(|o| o.batch.0).collect();
        let newest: Vec<u64> = (next - capacity..next).collect();
        assert_eq!(kept, newest);
        let t = mock.start_load(plan(next)).unwrap();
        assert!(mock.wait_batch(&t).unwrap().result.is_ok());
    }

    /// As the linker: a batch a `SlotsHeld` answer named is never let go untaken, and one the
    /// engine did not abandon goes only after every abandoned one.
    #[test]
    fn outcomes_the_engine_waits_for_outlast_abandoned_ones() {
        let mut script = MockScript::default();
        script.hold_slots.push(BatchId(2));
        let mock = MockKvLoader::new(2, script);
        let _held_on = mock.start_load(plan(1)).unwrap();
        let _slow = mock.start_load(plan(2)).unwrap();
        assert!(matches!(
            mock.reset(),
            Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(2)]
        ));
        mock.release(BatchId(2));
        let capacity = layerwise_counter::DEFAULT_CAPACITY as u64;
        let next = abandoned_rounds(&mock, 3, 2);
        let kept: Vec<u64> = mock.completed().iter().map(|o| o.batch.0).collect();
        // The capacity's worth, and the named batch beside them (it is not counted).
        assert_eq!(kept.len(), capacity as usize + 1);
        assert_eq!(
            kept[..2],
            [1, 2],
            "the held-on and the named first: {kept:?}"
        );
        assert_eq!(kept.last(), Some(&(next - 1)));
    }

    /// A save is checked as the linker checks it: a plan without one slot per page is
    /// `InvalidPlan`, and a slot of a load still in flight (a time-out) is refused (the load
    /// may still write it); once a reset cancelled it the save goes through.
    /// As the linker: a save may name a slot again for the same page (it reads the slot
    /// twice), not for another page; a load may not name a slot twice at all.
    #[test]
    fn a_save_may_name_a_slot_twice_for_the_same_page() {
        use crate::RequestPages;
        let plan = |b, pages: [u8; 2]| BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(b),
                requests: pages
                    .iter()
                    .map(|&p| RequestPages {
                        request: format!("r{p}").as_str().into(),
                        pages: vec![PageHash([p; 32])],
                    })
                    .collect(),
                components: vec![kv_geometry::ComponentId(0)],
            },
            slots: vec![4, 4],
        };
        let mock = MockKvLoader::new(2, MockScript::default());
        mock.save(&plan(1, [7, 7])).unwrap();
        let duplicate = |r| {
            matches!(
                r,
                Err(KvLoadError::InvalidPlan {
                    reason: crate::PlanError::DuplicateSlot { .. },
                    ..
                })
            )
        };
        assert!(duplicate(mock.save(&plan(2, [7, 8])).map(drop)));
        assert!(duplicate(mock.start_load(plan(3, [7, 7])).map(drop)));
    }

    #[test]
    fn a_save_is_refused_a_bad_plan_and_the_slots_of_a_load_in_flight() {
        use crate::RequestPages;
        let page = PageHash([7; 32]);
        let plan = |b, slots: Vec<u32>| BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(b),
                requests: vec![RequestPages {
                    request: "r".into(),
                    pages: vec![page],
                }],
                components: vec![kv_geometry::ComponentId(0)],
            },
            slots,
        };
        let script = MockScript {
            time_out: vec![BatchId(2)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        assert!(matches!(
            mock.save(&plan(1, vec![])),
            Err(KvLoadError::InvalidPlan { .. })
        ));
        let _ = mock.start_load(plan(2, vec![5])).unwrap();
        assert!(matches!(
            mock.save(&plan(3, vec![5])),
            Err(KvLoadError::Device(_))
        ));
        mock.save(&plan(4, vec![6])).unwrap();
        mock.reset().unwrap();
        mock.save(&plan(5, vec![5])).unwrap();
    }

    /// A batch holding a store call past its deadline: `reset` answers `SlotsHeld` naming it,
    /// and its outcome comes only once the call returned (`release`), as with the linker.
    #[test]
    fn a_held_store_call_makes_reset_answer_slots_held_until_it_returns() {
        let plan = |b| BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(b),
                requests: vec![],
                components: vec![],
            },
            slots: vec![],
        };
        let script = MockScript {
            time_out: vec![BatchId(7)],
            hold_slots: vec![BatchId(7)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let t = mock.start_load(plan(7)).unwrap();
        let other = mock.start_load(plan(8)).unwrap();
        match mock.reset() {
            Err(KvLoadError::SlotsHeld { batches }) => assert_eq!(&batches[..], [BatchId(7)]),
            other => panic!("{other:?}"),
        }
        assert!(mock.wait_batch(&t).is_err(), "held: no outcome");
        let first = mock.completed();
        assert_eq!(first.len(), 1, "only the batch not held: {first:?}");
        assert_eq!(first[0].batch, other.batch);
        mock.release(BatchId(7));
        let after = mock.completed();
        assert_eq!(after.len(), 1, "{after:?}");
        // The batch's own failure (its store call), as the linker hands it out: not
        // `Cancelled`, though a reset came between.
        assert!(matches!(
            after[0].result,
            Err(KvLoadError::Store {
                kind: StoreFailure::RpcTimeout,
                ..
            })
        ));
        mock.reset().unwrap();
    }

    /// After a reset (or close) a held batch's layer wait finds its ticket ended
    /// (`StaleTicket`), as the linker's counter reset ends it and as the docs say; it said
    /// `SlotsHeld`.
    #[test]
    fn a_reset_ends_a_held_batchs_ticket_for_waits() {
        for close in [false, true] {
            let script = MockScript {
                hold_slots: vec![BatchId(3)],
                ..MockScript::default()
            };
            let mock = MockKvLoader::new(2, script);
            let t = mock.start_load(plan(3)).unwrap();
            let ended = if close { mock.close() } else { mock.reset() };
            assert!(
                matches!(ended, Err(KvLoadError::SlotsHeld { .. })),
                "{ended:?}"
            );
            assert!(
                matches!(
                    mock.wait_layer(&t, 0),
                    Err(KvLoadError::StaleTicket { batch: BatchId(3) })
                ),
                "close {close}: {:?}",
                mock.wait_layer(&t, 0)
            );
        }
    }

    /// A second `close` (another shutdown path) answers as the first: `SlotsHeld` while a
    /// held store call may still write the slots, as the linker's. It answered `Ok`.
    #[test]
    fn a_second_close_answers_as_the_first() {
        let script = MockScript {
            hold_slots: vec![BatchId(1)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let _t = mock.start_load(one_page_plan(1, 0)).unwrap();
        for which in ["first", "second"] {
            let answer = mock.close();
            assert!(
                matches!(&answer, Err(KvLoadError::SlotsHeld { batches }) if batches[..] == [BatchId(1)]),
                "{which}: {answer:?}"
            );
        }
    }

    /// A load into a slot of a batch whose outcome is not taken (its store call held, timing
    /// out, or done) is refused at its start, naming the slot and the batch, as the linker
    /// refuses it; once the outcome is taken the slot loads again. Before, the mock failed
    /// such a load with `Device` only while the other's call was out, and loaded it over a
    /// finished batch's slots.
    #[test]
    fn a_load_into_a_slot_of_a_batch_in_flight_is_refused() {
        let script = MockScript {
            hold_slots: vec![BatchId(3)],
            time_out: vec![BatchId(4)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let _held = mock.start_load(one_page_plan(3, 4)).unwrap();
        let _late = mock.start_load(one_page_plan(4, 6)).unwrap();
        let done = mock.start_load(one_page_plan(9, 8)).unwrap();
        for (batch, slot, owner) in [(5, 4, 3), (6, 6, 4), (10, 8, 9)] {
            let refused = mock.start_load(one_page_plan(batch, slot));
            assert!(
                matches!(
                    &refused,
                    Err(KvLoadError::InvalidPlan {
                        reason: crate::PlanError::SlotInFlight { slot: s, page: 0, batch: b },
                        ..
                    }) if *s == slot && b.0 == owner
                ),
                "{refused:?}"
            );
        }
        // Another slot loads; once an outcome is taken, its slot loads again.
        let free = mock.start_load(one_page_plan(7, 5)).unwrap();
        assert!(mock.wait_batch(&free).unwrap().result.is_ok());
        assert!(mock.wait_batch(&done).unwrap().result.is_ok());
        let again = mock.start_load(one_page_plan(10, 8)).unwrap();
        assert!(mock.wait_batch(&again).unwrap().result.is_ok());
        mock.release(BatchId(3));
        assert_eq!(mock.completed().len(), 1);
        let again = mock.start_load(one_page_plan(8, 4)).unwrap();
        assert!(mock.wait_batch(&again).unwrap().result.is_ok());
    }

    /// After a reset, a cancelled batch's slots go to the next batch before its outcome is
    /// taken; a batch that had loaded keeps its slots until then (as the linker).
    #[test]
    fn a_reset_frees_the_slots_of_the_batches_it_cancelled() {
        let script = MockScript {
            time_out: vec![BatchId(2)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let loaded = mock.start_load(one_page_plan(1, 0)).unwrap();
        let cancelled = mock.start_load(one_page_plan(2, 3)).unwrap();
        mock.reset().unwrap();
        let next = mock.start_load(one_page_plan(3, 3)).unwrap();
        assert!(matches!(
            mock.start_load(one_page_plan(4, 0)),
            Err(KvLoadError::InvalidPlan {
                reason: crate::PlanError::SlotInFlight { slot: 0, .. },
                ..
            })
        ));
        assert!(mock.wait_batch(&next).unwrap().result.is_ok());
        assert!(mock.wait_batch(&cancelled).unwrap().result.is_err());
        assert!(mock.wait_batch(&loaded).unwrap().result.is_ok());
    }

    /// A `close` after a start's first check and before its state lock (the window, entered
    /// through the test hook) refuses the start: no batch is left live after `close`
    /// returned. Before, the start went on and its batch loaded.
    #[test]
    fn a_close_between_a_starts_checks_refuses_it() {
        let mock = MockKvLoader::new(2, MockScript::default());
        *mock.between_checks.lock() = Some(Box::new(|m: &MockKvLoader| {
            m.close().unwrap();
        }));
        assert!(matches!(mock.start_load(plan(1)), Err(KvLoadError::Closed)));
    }

    /// The save report's object count saturates instead of wrapping.
    #[test]
    fn a_save_reports_objects_without_wrapping() {
        let components: Vec<kv_geometry::ComponentId> =
            (0..=u16::MAX).map(kv_geometry::ComponentId).collect();
        let plan = BatchPlan {
            logical: crate::LogicalPlan {
                batch: BatchId(1),
                requests: vec![crate::RequestPages {
                    request: "r".into(),
                    pages: (0..65_536u64)
                        .map(|i| {
                            let mut h = [0; 32];
                            h[..8].copy_from_slice(&i.to_le_bytes());
                            PageHash(h)
                        })
                        .collect(),
                }],
                components,
            },
            slots: (0..65_536).collect(),
        };
        let mock = MockKvLoader::new(2, MockScript::default());
        let report = mock.save(&plan).unwrap();
        assert_eq!(report.objects_written, u32::MAX);
    }

    #[test]
    fn a_wait_past_its_deadline_on_a_load_that_ends_well() {
        let mut script = MockScript::default();
        script.wait_time_out_from.insert(BatchId(4), 1);
        let mock = MockKvLoader::new(3, script);
        let t = mock.start_load(plan(4)).unwrap();
        assert!(mock.wait_layer(&t, 0).is_ok());
        for layer in [1, 2] {
            assert!(matches!(
                mock.wait_layer(&t, layer),
                Err(KvLoadError::Timeout { layer: l, .. }) if l == layer
            ));
        }
        assert!(mock.wait_batch(&t).unwrap().result.is_ok());
    }

    /// A batch holding a store call (`hold_slots`) is in flight from its start, as with the
    /// linker: its waits answer `SlotsHeld`, `wait_batch` times out and a save of its slots is
    /// refused; once the call returned (`release`) its outcome is its store failure, taken
    /// once; a later reset does not hold it again. Before, such a batch loaded at once, and a
    /// reset after its release held it again.
    #[test]
    fn a_held_store_call_is_in_flight_from_its_start_until_released() {
        let script = MockScript {
            hold_slots: vec![BatchId(3)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let slotted = |b| one_page_plan(b, 4);
        let t = mock.start_load(slotted(3)).unwrap();
        assert!(matches!(
            mock.wait_layer(&t, 0),
            Err(KvLoadError::SlotsHeld { .. })
        ));
        assert!(matches!(
            mock.wait_batch(&t),
            Err(KvLoadError::Timeout { .. })
        ));
        assert!(mock.completed().is_empty());
        assert!(matches!(
            mock.save(&slotted(9)),
            Err(KvLoadError::Device(_))
        ));
        mock.release(BatchId(3));
        // Released, outcome not taken: waits still fail (as the linker's counter keeps the
        // batch's first failure); before, they answered the layer loaded.
        assert!(matches!(
            mock.wait_layer(&t, 0),
            Err(KvLoadError::SlotsHeld { .. })
        ));
        mock.reset().unwrap();
        assert!(matches!(
            mock.wait_batch(&t).unwrap().result,
            Err(KvLoadError::Store { .. })
        ));
    }

    /// After `close`, as with the linker: a second close answers as the first (here `Ok`),
    /// and outcomes not taken (a loaded batch's, a cancelled one's) are still handed out.
    /// Before, the second close failed `Closed` and the outcomes were dropped.
    #[test]
    fn outcomes_stay_to_be_taken_after_close_and_a_second_close_answers_again() {
        let script = MockScript {
            time_out: vec![BatchId(2)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let loaded = mock.start_load(plan(1)).unwrap();
        let _ = mock.start_load(plan(2)).unwrap();
        mock.close().unwrap();
        mock.close().unwrap();
        assert!(matches!(mock.start_load(plan(3)), Err(KvLoadError::Closed)));
        assert!(mock.wait_batch(&loaded).unwrap().result.is_ok());
        let rest = mock.completed();
        assert_eq!(rest.len(), 1, "{rest:?}");
        assert!(matches!(rest[0].result, Err(KvLoadError::Cancelled { .. })));
    }

    /// A save of slots whose load's outcome is not taken is refused (the docs ask for the
    /// outcome first; the linker holds the slots until a little after the last layer), then
    /// goes through once it is taken. Before, the mock let it through at once.
    #[test]
    fn a_save_waits_for_the_outcome_of_the_load_into_its_slots() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let slotted = |b| one_page_plan(b, 5);
        let t = mock.start_load(slotted(1)).unwrap();
        mock.wait_layer(&t, 1).unwrap();
        assert!(matches!(
            mock.save(&slotted(2)),
            Err(KvLoadError::Device(_))
        ));
        mock.wait_batch(&t).unwrap().result.unwrap();
        mock.save(&slotted(2)).unwrap();
    }

    /// A reset ends every batch, finished ones whose outcome is not taken too: their slots
    /// go, as the linker's do (a held store call's stay busy). Before, only batches still in
    /// flight at the reset let their slots go: an engine's test took a branch (save refused)
    /// the linker never takes.
    #[test]
    fn a_reset_lets_the_slots_of_a_finished_batch_go_unless_a_store_call_holds_them() {
        let script = MockScript {
            hold_slots: vec![BatchId(3)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let _ = mock.start_load(one_page_plan(1, 5)).unwrap();
        let _ = mock.start_load(one_page_plan(3, 6)).unwrap();
        assert!(
            mock.save(&one_page_plan(2, 5)).is_err(),
            "outcome not taken"
        );
        assert!(matches!(mock.reset(), Err(KvLoadError::SlotsHeld { .. })));
        mock.save(&one_page_plan(2, 5)).unwrap();
        assert!(
            matches!(mock.save(&one_page_plan(4, 6)), Err(KvLoadError::Device(_))),
            "a held store call keeps its slots"
        );
    }

    /// As the Linker: after `close`, a layer wait on a ticket of before is `StaleTicket` (close
    /// ended its batch), and the batch's outcome is still handed out. Before, the mock answered
    /// `Closed` (`FixInput`), an action the engine never gets in production.
    #[test]
    fn a_layer_wait_after_close_is_a_stale_ticket_as_the_linkers() {
        let mock = MockKvLoader::new(2, MockScript::default());
        let t = mock.start_load(one_page_plan(1, 5)).unwrap();
        mock.close().unwrap();
        assert!(matches!(
            mock.wait_layer(&t, 0),
            Err(KvLoadError::StaleTicket { batch: BatchId(1) })
        ));
        // It had loaded before the close (the mock loads at once): its outcome says so.
        let out = mock.wait_batch(&t).unwrap();
        assert!(out.result.is_ok(), "{out:?}");
    }

    /// A cancelled batch's marker is taken with its outcome, under one lock. Before, `completed`
    /// let the batch go from `live` and read the marker afterwards: a new batch of the same id
    /// started in between inherited it (it answered `Cancelled`, never reset) and the old one
    /// ended `Timeout`, not `Cancelled`. Stress test: the window is a few instructions wide.
    #[test]
    fn a_new_batch_of_a_cancelled_batchs_id_does_not_inherit_its_cancellation() {
        for round in 0..2_000 {
            let script = MockScript {
                time_out: vec![BatchId(1)],
                ..MockScript::default()
            };
            let mock = MockKvLoader::new(2, script);
            let _ = mock.start_load(one_page_plan(1, 5)).unwrap();
            mock.reset().unwrap();
            std::thread::scope(|s| {
                let old = s.spawn(|| mock.completed());
                // The same id again, as soon as the old batch is out of `live`.
                let t = loop {
                    match mock.start_load(one_page_plan(1, 6)) {
                        Ok(t) => break t,
                        Err(KvLoadError::DuplicateBatch { .. }) => std::hint::spin_loop(),
                        Err(e) => panic!("round {round}: {e:?}"),
                    }
                };
                // The new batch times out (the script), never reset: still in flight.
                let new = mock.wait_batch(&t);
                assert!(
                    matches!(new, Err(KvLoadError::Timeout { .. })),
                    "round {round}: the new batch answered {new:?}"
                );
                let old = old.join().unwrap();
                assert!(
                    matches!(
                        old.as_slice(),
                        [BatchOutcome {
                            result: Err(KvLoadError::Cancelled { .. }),
                            ..
                        }]
                    ),
                    "round {round}: the reset batch ended {old:?}"
                );
            });
        }
    }
}
