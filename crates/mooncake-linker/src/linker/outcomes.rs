//! Outcome bookkeeping of one linker, in one place: the readiness counter and its tickets,
//! what each ready layer's wait hands back, finished batches not yet taken, the batch ids in
//! flight and their slots (a second `start_load` of one, or of a plan landing in one of
//! their slots, is refused), the batches whose outcome waits for a store call that outlived
//! its deadline or device copies past the drain limit ([`HeldOutcome`]), and the count of batches the load thread still has to
//! finish.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use kv_loader::{BatchId, BatchOutcome, KvLoadError, LayerReady, LoadTicket, PlanError};
use layerwise_counter::{CounterError, LayerCounter, Ticket, WaitOutcome};
use parking_lot::{Condvar, Mutex};

/// One run's layer events: its ticket, and per layer what the layer's wait hands back.
type RunEvents = (Ticket, Vec<Option<LayerReady>>);

/// Batches of one linker from `start_load` to their outcome being taken.
pub(crate) struct Outcomes {
    counter: LayerCounter<KvLoadError>,
    /// Per batch, the run (its ticket) and what each ready layer's wait hands back (device
    /// pools only).
    readies: Mutex<HashMap<BatchId, RunEvents>>,
    /// Finished batches not yet taken, with their counter tickets (released when taken).
    done: Mutex<HashMap<BatchId, (Ticket, BatchOutcome)>>,
    done_cv: Condvar,
    /// Batches submitted and not yet finished by the load thread.
    pending: Mutex<usize>,
    idle: Condvar,
    /// Batches started and not yet taken (nor forgotten by a reset): their tickets and slots.
    in_flight: Mutex<InFlight>,
    /// Batches the load thread finished whose outcome waits for a store call that may still
    /// write their slots.
    held: Mutex<HashSet<BatchId>>,
    /// The batch the load thread runs now (from its start to its outcome's delivery): of the
    /// batches without an outcome, the only one that may write its slots; the others still
    /// queue, and a reset has made them stale (they never read).
    running: Mutex<Option<BatchId>>,
}

impl Outcomes {
    pub(crate) fn new(max_in_flight: u32) -> Self {
        Outcomes {
            counter: LayerCounter::with_capacity(max_in_flight.max(1)),
            readies: Mutex::new(HashMap::new()),
            done: Mutex::new(HashMap::new()),
            done_cv: Condvar::new(),
            pending: Mutex::new(0),
            idle: Condvar::new(),
            in_flight: Mutex::new(InFlight::default()),
            held: Mutex::new(HashSet::new()),
            running: Mutex::new(None),
        }
    }

    /// The load thread starts running `batch` (`Some`), or is done with it and its outcome is
    /// delivered (`None`).
    pub(crate) fn set_running(&self, batch: Option<BatchId>) {
        *self.running.lock() = batch;
    }

    /// A counter ticket for a new batch of `num_layers` layers landing in `slots`, counted as
    /// pending. Refused before anything is counted: a batch id already in flight
    /// ([`KvLoadError::DuplicateBatch`]), a slot of a batch in flight (its outcome not taken,
    /// unless a reset ended it failed: [`PlanError::SlotInFlight`]), and a batch past the
    /// counter's capacity ([`KvLoadError::Busy`]) once the counter slots of abandoned batches
    /// whose load is over are taken back ([`reclaim_abandoned`](Self::reclaim_abandoned)).
    pub(crate) fn begin(
        &self,
        batch: BatchId,
        num_layers: u32,
        slots: &[u32],
    ) -> Result<Ticket, KvLoadError> {
        match self.try_begin(batch, num_layers, slots) {
            Err(KvLoadError::Busy { .. }) if self.reclaim_abandoned() > 0 => {
                self.try_begin(batch, num_layers, slots)
            }
            started => started,
        }
    }

    fn try_begin(
        &self,
        batch: BatchId,
        num_layers: u32,
        slots: &[u32],
    ) -> Result<Ticket, KvLoadError> {
        let mut in_flight = self.in_flight.lock();
        if in_flight.runs.contains_key(&batch) {
            return Err(KvLoadError::DuplicateBatch { batch });
        }
        if let Some(reason) = in_flight.conflict(slots) {
            return Err(KvLoadError::InvalidPlan { batch, reason });
        }
        let t = self.counter.begin(num_layers).map_err(|e| match e {
            CounterError::Full { capacity } => KvLoadError::Busy {
                capacity,
                peers_fail: false,
            },
            other => KvLoadError::internal(batch, kv_loader::Cause::from_error(other)),
        })?;
        in_flight.insert(batch, t, slots);
        *self.pending.lock() += 1;
        Ok(t)
    }

    /// Takes back the counter slots (places among `max_in_flight`) of the batches the engine
    /// abandoned whose outcome is in (their loads are over), when a start finds the counter
    /// full: their tickets go stale (a wait on one answers `StaleTicket`; the engine said it
    /// will not read them), their outcomes stay to be taken (by batch and ticket), among the
    /// ended ones `trim_ended` bounds. How many it found (a concurrent `take` may have freed
    /// one first: the start is tried again all the same). Taken back only then, so a wait
    /// after an abandon (a `wait_batch` that timed out) still answers the batch's verdict
    /// while there is room. Before, such a slot stayed until the outcome was taken or a
    /// reset: after `max_in_flight` abandoned batches every start failed `Busy`, and the
    /// engine's ways out (`completed`, which takes live batches' outcomes too, or a reset,
    /// which cancels them) each broke live requests.
    fn reclaim_abandoned(&self) -> usize {
        let tickets: Vec<Ticket> = {
            // `done` before `in_flight`, as everywhere.
            let done = self.done.lock();
            let in_flight = self.in_flight.lock();
            in_flight
                .abandoned
                .iter()
                .filter_map(|b| {
                    let t = in_flight.ticket(*b)?;
                    let delivered = done.get(b).is_some_and(|(d, _)| *d == t);
                    (delivered && self.counter.ready_layers(t).is_ok()).then_some(t)
                })
                .collect()
        };
        let found = tickets.len();
        let taken = tickets
            .into_iter()
            .filter(|t| self.counter.finish(*t).is_ok())
            .count();
        if found > 0 {
            tracing::debug!(taken, "counter slots of abandoned batches taken back");
            self.trim_ended();
        }
        found
    }

    /// The engine will not read `ticket`'s run of `batch`: its slots are let go once the load
    /// thread is done with it (now, if its outcome is in), and its counter slot once a start
    /// needs it ([`reclaim_abandoned`](Self::reclaim_abandoned)); its outcome is kept to be
    /// taken.
    pub(crate) fn abandon(&self, batch: BatchId, ticket: Ticket) {
        // `done` before `in_flight`, as everywhere.
        let done = self.done.lock();
        let delivered = done.get(&batch).is_some_and(|(t, _)| *t == ticket);
        let mut in_flight = self.in_flight.lock();
        if in_flight.ticket(batch) != Some(ticket) {
            return;
        }
        if delivered {
            in_flight.free_slots(batch);
        }
        in_flight.abandoned.insert(batch);
    }

    /// Whether the engine abandoned `ticket`'s run of `batch`: its load stops at its next
    /// group of layers (nothing more is read for it).
    pub(crate) fn is_abandoned(&self, batch: BatchId, ticket: Ticket) -> bool {
        let in_flight = self.in_flight.lock();
        in_flight.ticket(batch) == Some(ticket) && in_flight.abandoned.contains(&batch)
    }

    /// A batch that `begin` counted never reached the load thread.
    pub(crate) fn never_started(&self, batch: BatchId, ticket: Ticket) {
        let _ = self.counter.finish(ticket);
        self.in_flight.lock().remove(batch, ticket);
        self.finished();
    }

    /// The load thread is done with a batch.
    fn finished(&self) {
        let mut p = self.pending.lock();
        *p = p.saturating_sub(1);
        self.idle.notify_all();
    }

    /// Layer `layer` of `batch` has landed: keep its ready signal, mark it in the counter.
    pub(crate) fn publish(
        &self,
        batch: BatchId,
        ticket: Ticket,
        layer: u32,
        ready: LayerReady,
        num_layers: u32,
    ) {
        if let LayerReady::Event(_) = &ready {
            let mut r = self.readies.lock();
            let (run, slots) = r.entry(batch).or_insert_with(|| (ticket, Vec::new()));
            if *run != ticket {
                if self.counter.ready_layers(*run).is_ok() {
                    // Another run of this id is live: this one is stale (a reset's), and its
                    // event must not stand for the live run's layer.
                    return;
                }
                *run = ticket;
                slots.clear();
            }
            slots.resize(num_layers as usize, None);
            slots[layer as usize] = Some(ready);
        }
        // A stale ticket here means the batch was reset; the next layer sees the new epoch.
        let _ = self.counter.complete(ticket, layer);
    }

    /// The load thread finished `batch`: fail its waiters on error, keep its outcome.
    pub(crate) fn finish(&self, ticket: Ticket, outcome: BatchOutcome) {
        if let Err(e) = &outcome.result {
            let _ = self.counter.fail(ticket, e.clone());
        }
        self.deliver(ticket, outcome);
        self.trim_ended();
        self.finished();
    }

    /// The load thread finished a batch whose outcome `hold` keeps until every store call
    /// that may still write its slots has returned: its waiters fail now (on error), the
    /// outcome is handed out when the last holder lets go.
    ///
    /// While such a call is still out, the waiters fail with
    /// [`KvLoadError::SlotsHeld`] (`HoldSlots`), not the batch's own error: that one says
    /// `Recompute`, which an engine would do into the very slots the late call still writes.
    /// The outcome, once handed out, carries the batch's own error.
    pub(crate) fn finish_held(
        &self,
        hold: Arc<HeldOutcome>,
        ticket: Ticket,
        outcome: BatchOutcome,
    ) {
        if let Err(e) = &outcome.result {
            // Holders only let go from here on: a count of one is final, more may be stale
            // by the time the waiters read it, which only holds the slots a little longer.
            let waiters = if Arc::strong_count(&hold) > 1 {
                tracing::warn!(
                    batch = %outcome.batch,
                    error = %e,
                    "the batch failed while a store call past its deadline (or a device copy past \
                     the drain limit) may still write its slots: its layer waiters are told the \
                     slots are held"
                );
                // Named in a `SlotsHeld` answer: its engine waits for its outcome.
                let mut in_flight = self.in_flight.lock();
                if in_flight.ticket(outcome.batch) == Some(ticket) {
                    in_flight.named.insert(outcome.batch);
                }
                drop(in_flight);
                KvLoadError::SlotsHeld {
                    batches: Arc::from([outcome.batch]),
                }
            } else {
                e.clone()
            };
            let _ = self.counter.fail(ticket, waiters);
        }
        let batch = outcome.batch;
        // Counted as held before this reference goes, so that a holder letting go at the same
        // time cannot leave it marked.
        self.held.lock().insert(batch);
        *hold.outcome.lock() = Some((ticket, outcome));
        if let Some(last) = Arc::into_inner(hold) {
            drop(last);
        } else {
            tracing::warn!(%batch, "the batch's outcome waits for a store call past its deadline or device copies past the drain limit");
        }
        self.finished();
    }

    fn deliver(&self, ticket: Ticket, outcome: BatchOutcome) {
        let mut done = self.done.lock();
        {
            // The load thread is done with it: an abandoned batch's slots go now.
            let mut in_flight = self.in_flight.lock();
            if in_flight.ticket(outcome.batch) == Some(ticket)
                && in_flight.abandoned.contains(&outcome.batch)
            {
                in_flight.free_slots(outcome.batch);
            }
        }
        done.insert(outcome.batch, (ticket, outcome));
        self.done_cv.notify_all();
    }

    /// The batches whose load may still write their slots, sorted: the one the load thread
    /// runs, its outcome not in yet, and those whose outcome waits for a store call past its
    /// deadline (held). Called after a reset made every queued batch stale: those never read,
    /// so their slots are not named (before, every batch without an outcome was, and an engine
    /// kept the slots of batches that never started out of use).
    pub(crate) fn still_loading(&self) -> Vec<BatchId> {
        // Read apart: a queued batch that starts after this is stale (it never reads).
        let running = *self.running.lock();
        // `held`, `done`, `in_flight`: the order of every other caller.
        let held = self.held.lock();
        let done = self.done.lock();
        let mut in_flight = self.in_flight.lock();
        let mut v: Vec<BatchId> = in_flight
            .runs
            .iter()
            .filter(|(b, (t, _))| {
                held.contains(b)
                    || (running == Some(**b)
                        && done.get(b).is_none_or(|(delivered, _)| delivered != t))
            })
            .map(|(b, _)| *b)
            .collect();
        v.sort();
        // Named in a `SlotsHeld` answer: its engine waits for its outcome.
        in_flight.named.extend(v.iter().copied());
        v
    }

    /// Batches whose outcome waits for a store call past its deadline (or, on a device pool,
    /// copies into their slots past the drain limit: `copies_held`).
    pub(crate) fn held(&self) -> Vec<BatchId> {
        let held = self.held.lock();
        let mut v: Vec<BatchId> = held.iter().copied().collect();
        v.sort();
        // Named in a `SlotsHeld` answer: its engine waits for its outcome (only a batch with
        // a run: one taken while its holder lets go is over).
        let mut in_flight = self.in_flight.lock();
        for b in &v {
            if in_flight.runs.contains_key(b) {
                in_flight.named.insert(*b);
            }
        }
        drop(in_flight);
        v
    }

    /// Waits (until `deadline`) for layer `layer` of the batch; what the engine waits on.
    /// With `events` (a device pool, whose layers are published with events), a layer found
    /// ready whose event is gone was forgotten in between (its batch taken, or a reset): the
    /// wait fails with the stale ticket rather than answer that no event is needed.
    pub(crate) fn wait_layer(
        &self,
        ticket: &LoadTicket,
        layer: u32,
        deadline: Instant,
        events: bool,
    ) -> Result<Option<LayerReady>, WaitFailure> {
        let r = self
            .counter
            .wait(ticket.counter, layer, deadline)
            .map_err(WaitFailure::Counter)?;
        match r {
            WaitOutcome::Ready => self.ready_of(ticket, layer, events),
            WaitOutcome::Failed(e) => Err(WaitFailure::Load(e)),
            WaitOutcome::TimedOut => Err(WaitFailure::TimedOut),
            WaitOutcome::Cancelled => Err(WaitFailure::Cancelled),
        }
    }

    /// What the engine gets for a layer the counter found ready: its event, if it was
    /// published with one. With `events`, an event gone since (the batch was forgotten in
    /// between) fails with the stale ticket: `forget` makes the ticket stale before it drops
    /// the events, so a layer published without one keeps a live ticket and a forgotten one
    /// does not.
    ///
    /// A ticket whose batch id names another run (a ticket built by hand, or one of a run
    /// since forgotten) is stale: it never gets the other run's event.
    fn ready_of(
        &self,
        ticket: &LoadTicket,
        layer: u32,
        events: bool,
    ) -> Result<Option<LayerReady>, WaitFailure> {
        let ready = match self.readies.lock().get(&ticket.batch) {
            Some((run, slots)) if *run == ticket.counter => {
                slots.get(layer as usize).cloned().flatten()
            }
            _ => None,
        };
        if ready.is_none() && events {
            self.counter
                .is_ready(ticket.counter, layer)
                .map_err(WaitFailure::Counter)?;
            // Not locked with `readies` (`cancel_all` takes `in_flight` first).
            if self.in_flight.lock().ticket(ticket.batch) != Some(ticket.counter) {
                return Err(WaitFailure::Counter(CounterError::StaleTicket {
                    ticket: ticket.counter,
                }));
            }
        }
        Ok(ready)
    }

    /// Takes the outcome of `ticket`'s run of its batch, waiting until `deadline`; frees its
    /// counter slot. `Ok(None)`: none came by the deadline. A ticket of an earlier run of the
    /// same batch id (its outcome taken, the id used again) is stale: it never takes the new
    /// run's outcome. So is a ticket whose outcome is already taken (by another waiter, or
    /// `completed`) or was forgotten by a reset: the batch is then neither finished nor in
    /// flight, and the wait fails at once instead of waiting out its deadline.
    pub(crate) fn take(
        &self,
        ticket: &LoadTicket,
        deadline: Instant,
    ) -> Result<Option<BatchOutcome>, CounterError> {
        let batch = ticket.batch;
        let stale = || CounterError::StaleTicket {
            ticket: ticket.counter,
        };
        // `in_flight` is taken under `done`'s lock here only, and nowhere the other way round.
        let mine = |done: &mut HashMap<BatchId, (Ticket, BatchOutcome)>| match done.get(&batch) {
            Some((t, _)) if *t == ticket.counter => Ok(done.remove(&batch)),
            Some(_) => Err(stale()),
            // Taken, forgotten by a reset, or the id started again by another run.
            None if self.in_flight.lock().ticket(batch) != Some(ticket.counter) => Err(stale()),
            None => Ok(None),
        };
        let mut done = self.done.lock();
        let taken = loop {
            if let Some(t) = mine(&mut done)? {
                break Some(t);
            }
            if self.done_cv.wait_until(&mut done, deadline).timed_out() {
                break mine(&mut done)?;
            }
        };
        drop(done);
        let Some((t, outcome)) = taken else {
            return Ok(None);
        };
        self.forget(t, batch);
        Ok(Some(outcome))
    }

    /// Takes every finished outcome, in batch order; frees their counter slots.
    pub(crate) fn drain(&self) -> Vec<BatchOutcome> {
        let taken: Vec<(Ticket, BatchOutcome)> = self.done.lock().drain().map(|(_, t)| t).collect();
        let mut out: Vec<BatchOutcome> = taken
            .into_iter()
            .map(|(ticket, o)| {
                self.forget(ticket, o.batch);
                o
            })
            .collect();
        out.sort_by_key(|o| o.batch);
        out
    }

    /// Ends `ticket`'s run of `batch`: its counter slot, its events, its id in flight. Only
    /// that run's: a reset may have forgotten it while its outcome was being taken, and the
    /// id started again since (the new run keeps its id and its events).
    fn forget(&self, ticket: Ticket, batch: BatchId) {
        // Already stale after a reset; otherwise this frees the batch's counter slot.
        let _ = self.counter.finish(ticket);
        {
            let mut readies = self.readies.lock();
            if readies.get(&batch).is_some_and(|(run, _)| *run == ticket) {
                readies.remove(&batch);
            }
        }
        self.in_flight.lock().remove(batch, ticket);
        // Another waiter for the same batch looks again, and finds its ticket spent.
        let _done = self.done.lock();
        self.done_cv.notify_all();
    }

    /// Cancels every batch in flight (waiters get `Cancelled`) and waits, until `deadline`,
    /// until the load thread has nothing pending. True when it is idle. `after_reset` runs once
    /// the counter is reset, before the wait.
    pub(crate) fn cancel_all(&self, deadline: Instant, after_reset: impl FnOnce()) -> bool {
        self.counter.reset();
        after_reset();
        let mut p = self.pending.lock();
        while *p > 0 {
            if self.idle.wait_until(&mut p, deadline).timed_out() {
                break;
            }
        }
        let idle = *p == 0;
        drop(p);
        if idle {
            // Every batch from before the reset is over (their tickets are stale): their ids
            // may be used again, except those whose slots a late store call may still write,
            // and those whose outcome is not taken yet (a run of the same id would otherwise
            // be handed that outcome, and its taking would forget the new run). A batch
            // started since the reset has a live ticket, and keeps its id and its layers'
            // events. `held` first: a held outcome is delivered into `done` before it leaves
            // `held`, so under `held`'s lock a batch is in one or the other.
            let held = self.held.lock();
            // `done` stays locked until the slots are freed: an outcome taken meanwhile and its
            // id started again would otherwise lose the new run's slots.
            let done = self.done.lock();
            let mut in_flight = self.in_flight.lock();
            in_flight.retain(|b, t| {
                held.contains(&b) || done.contains_key(&b) || self.counter.ready_layers(t).is_ok()
            });
            // A batch with a failed outcome (the reset cancelled it, it failed before, or it
            // started and failed since the reset found the load thread idle) is over, and its
            // pages are not to be used: its slots may go to the next batch before its outcome
            // is taken (an engine frees a cancelled request's blocks at once). One that had
            // loaded keeps them until taken: the engine may still read them.
            for (b, (t, o)) in done.iter() {
                if o.result.is_err() && in_flight.ticket(*b) == Some(*t) {
                    in_flight.free_slots(*b);
                }
            }
            drop(done);
            self.readies
                .lock()
                .retain(|b, (run, _)| in_flight.ticket(*b) == Some(*run));
        }
        if idle {
            self.trim_ended();
        }
        idle
    }

    /// Keeps at most the capacity's worth of outcomes of ended batches (a reset or close ended
    /// them, or their abandoned places were taken back) that no one has taken (`completed` or
    /// `wait_batch` on their tickets may still take them): past it, those of batches the
    /// engine abandoned go first, then the others, each the earliest started first, with
    /// their ids and their layers' events (logged at `warn`; at `debug` when all are
    /// abandoned ones).
    /// Never one a store call past its deadline still holds, nor one a `SlotsHeld` answer
    /// named: their engine waits for them. Before, an engine that abandoned its batches (a
    /// dropped `LoadHandle`, a timed-out wait) and reset after each kept every such outcome
    /// for good: a reset gives the counter's slots back, so nothing bounded them.
    fn trim_ended(&self) {
        let capacity = self.counter.capacity() as usize;
        // `held`, `done`, `in_flight`: the order of every other caller.
        let held = self.held.lock();
        let mut done = self.done.lock();
        // Every batch it could let go is in `done`: at most the capacity there, nothing to do
        // (the common case, on every batch's finish).
        if done.len() <= capacity {
            return;
        }
        let mut in_flight = self.in_flight.lock();
        let mut ended: Vec<(bool, u64, BatchId, Ticket)> = done
            .iter()
            .filter(|(b, (t, _))| {
                !held.contains(*b)
                    && !in_flight.named.contains(*b)
                    && self.counter.ready_layers(*t).is_err()
            })
            .map(|(b, (t, _))| (!in_flight.abandoned.contains(b), t.generation(), *b, *t))
            .collect();
        if ended.len() <= capacity {
            return;
        }
        // Abandoned first (`false` sorts first), then by start.
        ended.sort_unstable_by_key(|(kept_by_engine, started, _, _)| (*kept_by_engine, *started));
        ended.truncate(ended.len() - capacity);
        for (_, _, b, t) in &ended {
            done.remove(b);
            in_flight.remove(*b, *t);
        }
        drop(in_flight);
        drop(done);
        drop(held);
        let mut readies = self.readies.lock();
        for (_, _, b, t) in &ended {
            if readies.get(b).is_some_and(|(run, _)| run == t) {
                readies.remove(b);
            }
        }
        drop(readies);
        let batches: Vec<BatchId> = ended.iter().map(|(_, _, b, _)| *b).collect();
        // Abandoned batches' outcomes are the engine's to leave (a dropped `LoadHandle`).
        if ended.iter().all(|(kept_by_engine, ..)| !kept_by_engine) {
            tracing::debug!(
                ?batches,
                kept = capacity,
                "outcomes of abandoned batches never taken: the earliest are let go"
            );
            return;
        }
        tracing::warn!(
            ?batches,
            kept = capacity,
            "outcomes of batches a reset or close ended were never taken: the earliest are let \
             go (take outcomes with completed() or wait_batch after a reset)"
        );
    }
}

/// The batches in flight, their tickets and the slots they land in.
#[derive(Default)]
struct InFlight {
    /// Per batch: its run's ticket and its slots.
    runs: HashMap<BatchId, (Ticket, Box<[u32]>)>,
    /// Per slot of a batch in flight: that batch (a plan names a slot once).
    owners: HashMap<u32, BatchId>,
    /// Batches the engine abandoned: their slots go once their outcome is in, their counter
    /// slots when a start needs them ([`Outcomes::reclaim_abandoned`]), and no one waits for
    /// that outcome (it goes first when [`Outcomes::trim_ended`] trims).
    abandoned: HashSet<BatchId>,
    /// Batches a `SlotsHeld` answer named: their engine waits for their outcomes, which are
    /// never let go untaken.
    named: HashSet<BatchId>,
}

impl InFlight {
    /// The ticket of `batch`'s run in flight.
    fn ticket(&self, batch: BatchId) -> Option<Ticket> {
        self.runs.get(&batch).map(|(t, _)| *t)
    }

    /// The first of `slots` a batch in flight lands in.
    fn conflict(&self, slots: &[u32]) -> Option<PlanError> {
        slots.iter().enumerate().find_map(|(page, slot)| {
            self.owners.get(slot).map(|&batch| PlanError::SlotInFlight {
                slot: *slot,
                page,
                batch,
            })
        })
    }

    fn insert(&mut self, batch: BatchId, ticket: Ticket, slots: &[u32]) {
        // A new run of the id starts with no marks of an earlier one.
        self.forget_marks(batch);
        self.owners.extend(slots.iter().map(|s| (*s, batch)));
        self.runs.insert(batch, (ticket, slots.into()));
    }

    /// Ends `ticket`'s run of `batch` (only that run's), freeing its slots.
    fn remove(&mut self, batch: BatchId, ticket: Ticket) {
        if self.ticket(batch) != Some(ticket) {
            return;
        }
        if let Some((_, slots)) = self.runs.remove(&batch) {
            self.forget_marks(batch);
            self.free(batch, &slots);
        }
    }

    /// Frees `batch`'s slots, keeping its run (its id and ticket).
    fn free_slots(&mut self, batch: BatchId) {
        if let Some((_, slots)) = self.runs.get_mut(&batch) {
            let slots = std::mem::take(slots);
            self.free(batch, &slots);
        }
    }

    /// Keeps the runs `keep` says, freeing the others' slots.
    fn retain(&mut self, mut keep: impl FnMut(BatchId, Ticket) -> bool) {
        let mut gone: Vec<(BatchId, Box<[u32]>)> = Vec::new();
        self.runs.retain(|b, (t, slots)| {
            let kept = keep(*b, *t);
            if !kept {
                gone.push((*b, std::mem::take(slots)));
            }
            kept
        });
        for (batch, slots) in gone {
            self.forget_marks(batch);
            self.free(batch, &slots);
        }
    }

    /// `batch` leaves the sets that mark its run.
    fn forget_marks(&mut self, batch: BatchId) {
        self.abandoned.remove(&batch);
        self.named.remove(&batch);
    }

    fn free(&mut self, batch: BatchId, slots: &[u32]) {
        for s in slots {
            if self.owners.get(s) == Some(&batch) {
                self.owners.remove(s);
            }
        }
    }
}

/// Why a layer wait returned without the layer.
pub(crate) enum WaitFailure {
    /// The counter refused the ticket.
    Counter(CounterError),
    /// The batch failed.
    Load(KvLoadError),
    /// The deadline passed.
    TimedOut,
    /// The batch was reset.
    Cancelled,
}

/// A batch's outcome, kept back while a store call that may still write the batch's slots
/// runs (every such call holds a reference, through its memory hold) or, on a device pool,
/// while copies into them past the drain limit run (`copies_held`'s watcher holds one): the
/// last one to let go hands the outcome out. Until then the engine cannot take the outcome, so it does not
/// reuse the slots (its rule: never before the outcome is taken).
pub(crate) struct HeldOutcome {
    outcomes: Arc<Outcomes>,
    outcome: Mutex<Option<(Ticket, BatchOutcome)>>,
}

impl HeldOutcome {
    pub(crate) fn new(outcomes: Arc<Outcomes>) -> Arc<Self> {
        Arc::new(HeldOutcome {
            outcomes,
            outcome: Mutex::new(None),
        })
    }
}

impl Drop for HeldOutcome {
    fn drop(&mut self) {
        if let Some((ticket, outcome)) = self.outcome.lock().take() {
            let batch = outcome.batch;
            self.outcomes.deliver(ticket, outcome);
            if self.outcomes.held.lock().remove(&batch) {
                tracing::info!(%batch, "what could still write its slots has ended (store calls past their deadline, device copies): outcome handed out");
            }
            self.outcomes.trim_ended();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_loader::LoadStats;

    fn cancelled(batch: u64) -> BatchOutcome {
        BatchOutcome {
            batch: BatchId(batch),
            result: Err(KvLoadError::Cancelled {
                batch: BatchId(batch),
            }),
        }
    }

    #[test]
    fn a_duplicate_batch_is_refused_without_a_slot_and_the_first_keeps_its_outcome() {
        let o = Outcomes::new(2);
        let t = o.begin(BatchId(1), 4, &[]).unwrap();
        assert!(matches!(
            o.begin(BatchId(1), 4, &[]),
            Err(KvLoadError::DuplicateBatch { batch: BatchId(1) })
        ));
        // The refusal took no counter slot: another batch still fits.
        let t2 = o.begin(BatchId(2), 4, &[]).unwrap();
        o.finish(t, cancelled(1));
        o.finish(t2, cancelled(2));
        let deadline = kv_loader::deadline_after(std::time::Duration::from_secs(1));
        let first = ticket(1, t);
        assert_eq!(o.take(&first, deadline).unwrap().unwrap().batch, BatchId(1));
        // Taken: the id is free again, and so is the slot.
        let again = o.begin(BatchId(1), 4, &[]).unwrap();
        // The new run's outcome is its own: the first run's ticket cannot take it.
        o.finish(again, cancelled(1));
        assert!(matches!(
            o.take(&first, deadline),
            Err(CounterError::StaleTicket { .. })
        ));
        assert!(o.take(&ticket(1, again), deadline).unwrap().is_some());
        let _ = std::mem::size_of::<LoadStats>();
    }

    #[test]
    fn a_ticket_whose_outcome_is_taken_is_stale_at_once_for_every_other_waiter() {
        let o = Arc::new(Outcomes::new(2));
        let t = o.begin(BatchId(3), 4, &[]).unwrap();
        let long = kv_loader::deadline_after(std::time::Duration::from_secs(30));
        // A second waiter already waiting when the first takes the outcome.
        let waiting = {
            let o = o.clone();
            std::thread::spawn(move || {
                let t0 = Instant::now();
                (o.take(&ticket(3, t), long), t0.elapsed())
            })
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        o.finish(t, cancelled(3));
        let first = o.take(&ticket(3, t), long);
        let (second, waited) = waiting.join().unwrap();
        // One of the two took it; the other is told its ticket is spent, at once.
        let (got, spent) = match first {
            Ok(Some(_)) => (first, second),
            _ => (second, first),
        };
        assert!(matches!(got, Ok(Some(_))));
        assert!(matches!(spent, Err(CounterError::StaleTicket { .. })));
        assert!(waited < std::time::Duration::from_secs(5), "{waited:?}");
        // A later wait on the spent ticket (`completed` took it, say) fails at once too.
        let t0 = Instant::now();
        assert!(matches!(
            o.take(&ticket(3, t), long),
            Err(CounterError::StaleTicket { .. })
        ));
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        // The id started again and still running: the spent ticket is stale at once too.
        let again = o.begin(BatchId(3), 4, &[]).unwrap();
        let t0 = Instant::now();
        assert!(matches!(
            o.take(&ticket(3, t), long),
            Err(CounterError::StaleTicket { .. })
        ));
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        o.finish(again, cancelled(3));
        assert!(o.take(&ticket(3, again), long).unwrap().is_some());
    }

    fn ticket(batch: u64, counter: Ticket) -> LoadTicket {
        LoadTicket {
            batch: BatchId(batch),
            num_layers: 4,
            counter,
        }
    }

    #[test]
    fn a_held_outcome_comes_when_the_last_holder_lets_go() {
        let o = Arc::new(Outcomes::new(2));
        let t = o.begin(BatchId(7), 4, &[]).unwrap();
        let hold = HeldOutcome::new(o.clone());
        let late_call = hold.clone();
        o.finish_held(hold, t, cancelled(7));
        assert_eq!(o.held(), vec![BatchId(7)]);
        let soon = kv_loader::deadline_after(std::time::Duration::from_millis(10));
        assert!(o.take(&ticket(7, t), soon).unwrap().is_none(), "held back");
        // A reset keeps the held id in flight.
        assert!(o.cancel_all(soon, || {}));
        assert!(matches!(
            o.begin(BatchId(7), 4, &[]),
            Err(KvLoadError::DuplicateBatch { .. })
        ));
        drop(late_call);
        assert!(o.held().is_empty());
        assert!(o.take(&ticket(7, t), soon).unwrap().is_some());
    }

    #[derive(Debug)]
    struct PendingCopy;

    impl kv_loader::StreamWaitable for PendingCopy {
        fn wait_on_stream(&self, _stream: kv_loader::RawStream) -> Result<(), KvLoadError> {
            Ok(())
        }

        fn synchronize(&self) -> Result<(), KvLoadError> {
            Ok(())
        }
    }

    /// The window the stress test below aims at, made certain: the counter found the layer
    /// ready, then the batch was taken (its events dropped) before the event was looked up.
    #[test]
    fn a_ready_layer_whose_event_is_gone_is_a_stale_ticket_not_resident() {
        let o = Outcomes::new(2);
        let batch = BatchId(7);
        let counter = o.begin(batch, 2, &[]).unwrap();
        let t = LoadTicket {
            batch,
            num_layers: 2,
            counter,
        };
        o.publish(
            batch,
            counter,
            0,
            LayerReady::Event(Arc::new(PendingCopy)),
            2,
        );
        // Layer 1 lands resident (no event): a live ticket answers so.
        o.publish(batch, counter, 1, LayerReady::Resident, 2);
        assert!(matches!(
            o.ready_of(&t, 0, true),
            Ok(Some(LayerReady::Event(_)))
        ));
        assert!(matches!(o.ready_of(&t, 1, true), Ok(None)));
        o.finish(counter, outcome_ok(batch));
        assert_eq!(o.drain().len(), 1);
        assert!(
            matches!(o.ready_of(&t, 0, true), Err(WaitFailure::Counter(_))),
            "a forgotten layer's event was answered as not needed"
        );
        // Host pools have no events to lose: resident stays the answer.
        assert!(matches!(o.ready_of(&t, 0, false), Ok(None)));
    }

    /// Stress: the engine waits on layers published with events while another thread takes
    /// the finished batch (which drops its events). Each wait gets the layer's event or a stale
    /// ticket, never "ready, no event" (which a device pool answers as resident while its copy
    /// may still run).
    #[test]
    fn a_layer_published_with_an_event_is_never_answered_without_it() {
        let o = Outcomes::new(4);
        let deadline = || kv_loader::deadline_after(std::time::Duration::from_secs(5));
        for i in 0..3000u64 {
            let batch = BatchId(i);
            let counter = o.begin(batch, 2, &[]).unwrap();
            let t = LoadTicket {
                batch,
                num_layers: 2,
                counter,
            };
            for layer in 0..2 {
                o.publish(
                    batch,
                    counter,
                    layer,
                    LayerReady::Event(Arc::new(PendingCopy)),
                    2,
                );
            }
            std::thread::scope(|s| {
                s.spawn(|| {
                    o.finish(counter, outcome_ok(batch));
                    let _ = o.drain();
                });
                for layer in 0..2 {
                    match o.wait_layer(&t, layer, deadline(), true) {
                        Ok(Some(LayerReady::Event(_))) | Err(WaitFailure::Counter(_)) => {}
                        Ok(other) => panic!("batch {i}, layer {layer}: {other:?}"),
                        Err(_) => panic!("batch {i}, layer {layer}: another failure"),
                    }
                }
            });
        }
    }

    /// An abandoned batch whose outcome is in keeps its counter slot while there is room (a
    /// wait on it still answers), gives it back when a start finds the counter full (its
    /// ticket then stale), and its outcome is still taken by batch and ticket.
    #[test]
    fn an_abandoned_batchs_counter_slot_is_taken_back_only_when_a_start_needs_it() {
        let o = Outcomes::new(1);
        let soon = || kv_loader::deadline_after(std::time::Duration::from_millis(10));
        let t1 = o.begin(BatchId(1), 1, &[0]).unwrap();
        o.publish(BatchId(1), t1, 0, LayerReady::Resident, 1);
        o.finish(t1, outcome_ok(BatchId(1)));
        o.abandon(BatchId(1), t1);
        let waited = o.wait_layer(&ticket(1, t1), 0, soon(), false);
        assert!(waited.is_ok(), "still counted: the wait answers");
        let t2 = o.begin(BatchId(2), 1, &[1]).unwrap();
        assert!(
            o.wait_layer(&ticket(1, t1), 0, soon(), false).is_err(),
            "taken back: stale"
        );
        let taken = o.take(&ticket(1, t1), soon()).unwrap();
        assert!(taken.is_some_and(|out| out.result.is_ok()));
        assert!(
            matches!(o.begin(BatchId(3), 1, &[2]), Err(KvLoadError::Busy { .. })),
            "batch 2 is live: nothing to take back"
        );
        o.finish(t2, outcome_ok(BatchId(2)));
    }

    /// The race a review found, its steps made certain: a taker has the outcome of batch 5's
    /// first run out of `done` (not yet forgotten), a reset forgets the run, and the id starts
    /// again. Before, the taker's `forget` then removed the new run's id and events by batch id
    /// alone: its layer (published with an event) read as resident, a third start of the id
    /// was accepted beside it, and its `wait_batch` was stale at once.
    #[test]
    fn taking_an_outcome_a_reset_forgot_leaves_a_new_run_of_the_id_alone() {
        let o = Outcomes::new(4);
        let batch = BatchId(5);
        let first = o.begin(batch, 2, &[]).unwrap();
        o.publish(batch, first, 0, LayerReady::Event(Arc::new(PendingCopy)), 2);
        o.finish(first, outcome_ok(batch));
        // The taker's first half (`take`, or `drain`): out of `done`, not yet forgotten.
        let (t, _) = o.done.lock().remove(&batch).unwrap();
        let soon = kv_loader::deadline_after(std::time::Duration::from_millis(10));
        assert!(o.cancel_all(soon, || {}));
        let second = o.begin(batch, 2, &[]).unwrap();
        o.publish(
            batch,
            second,
            0,
            LayerReady::Event(Arc::new(PendingCopy)),
            2,
        );
        // The taker's second half.
        o.forget(t, batch);
        let live = LoadTicket {
            batch,
            num_layers: 2,
            counter: second,
        };
        assert!(
            matches!(o.ready_of(&live, 0, true), Ok(Some(LayerReady::Event(_)))),
            "the new run lost its layer's event"
        );
        assert!(matches!(
            o.begin(batch, 2, &[]),
            Err(KvLoadError::DuplicateBatch { .. })
        ));
        o.finish(second, outcome_ok(batch));
        assert!(o.take(&live, soon).unwrap().is_some());
    }

    /// A ticket built by hand with one run's counter ticket and another batch's id: before, its
    /// wait was handed the other batch's event (or "resident" where that batch had none).
    #[test]
    fn a_ticket_pairing_one_run_with_another_batch_gets_no_event() {
        let o = Outcomes::new(4);
        let (b1, b2) = (BatchId(1), BatchId(2));
        let t1 = o.begin(b1, 2, &[]).unwrap();
        let t2 = o.begin(b2, 2, &[]).unwrap();
        o.publish(b1, t1, 0, LayerReady::Event(Arc::new(PendingCopy)), 2);
        o.publish(b2, t2, 0, LayerReady::Event(Arc::new(PendingCopy)), 2);
        let mixed = LoadTicket {
            batch: b2,
            num_layers: 2,
            counter: t1,
        };
        assert!(matches!(
            o.ready_of(&mixed, 0, true),
            Err(WaitFailure::Counter(CounterError::StaleTicket { .. }))
        ));
        let own = LoadTicket {
            batch: b1,
            num_layers: 2,
            counter: t1,
        };
        assert!(matches!(
            o.ready_of(&own, 0, true),
            Ok(Some(LayerReady::Event(_)))
        ));
    }

    fn outcome_ok(batch: BatchId) -> BatchOutcome {
        BatchOutcome {
            batch,
            result: Ok(LoadStats {
                pages: 1,
                layers: 2,
                bytes_read: 0,
                bytes_landed: 0,
                mode: kv_loader::ShareMode::AllRanks,
                first_layer: std::time::Duration::ZERO,
                last_layer: std::time::Duration::ZERO,
                transfers: kv_loader::TransferBytes::default(),
                layer_transfers: Vec::new(),
                alone: None,
                read_groups: Vec::new(),
                plans_differ: Vec::new(),
            }),
        }
    }

    /// The slot and batch of a `SlotInFlight` refusal (`None`: not one).
    fn refused_slot(begun: Result<Ticket, KvLoadError>) -> Option<(u32, BatchId)> {
        match begun {
            Err(KvLoadError::InvalidPlan {
                reason: PlanError::SlotInFlight { slot, batch, .. },
                ..
            }) => Some((slot, batch)),
            _ => None,
        }
    }

    #[test]
    fn a_slot_goes_to_another_batch_once_its_batch_is_taken_abandoned_and_over_or_reset_failed() {
        let o = Outcomes::new(8);
        let soon = kv_loader::deadline_after(std::time::Duration::from_millis(10));
        // Loaded and not taken: its slots are refused; taken: free.
        let t1 = o.begin(BatchId(1), 4, &[0, 1]).unwrap();
        o.finish(t1, outcome_ok(BatchId(1)));
        assert_eq!(
            refused_slot(o.begin(BatchId(9), 4, &[3, 1])),
            Some((1, BatchId(1)))
        );
        assert!(o.take(&ticket(1, t1), soon).unwrap().is_some());
        let t9 = o.begin(BatchId(9), 4, &[1]).unwrap();
        // Abandoned while it loads: refused until the load is over, then free; its outcome
        // is still handed out.
        o.abandon(BatchId(9), t9);
        assert_eq!(
            refused_slot(o.begin(BatchId(10), 4, &[1])),
            Some((1, BatchId(9)))
        );
        o.finish(t9, outcome_ok(BatchId(9)));
        let t10 = o.begin(BatchId(10), 4, &[1]).unwrap();
        assert!(o.take(&ticket(9, t9), soon).unwrap().is_some());
        // Abandoned once its outcome is in: free at once. An abandon naming another run of
        // the id does nothing.
        o.finish(t10, outcome_ok(BatchId(10)));
        o.abandon(BatchId(10), t9);
        assert_eq!(
            refused_slot(o.begin(BatchId(11), 4, &[1])),
            Some((1, BatchId(10)))
        );
        o.abandon(BatchId(10), t10);
        let t11 = o.begin(BatchId(11), 4, &[1]).unwrap();
        // A reset lets a cancelled batch's slots go at once; a loaded one keeps its slots
        // until its outcome is taken.
        let t12 = o.begin(BatchId(12), 4, &[2]).unwrap();
        o.finish(t11, outcome_ok(BatchId(11)));
        o.finish(t12, cancelled(12));
        assert!(o.cancel_all(soon, || {}));
        assert_eq!(
            refused_slot(o.begin(BatchId(13), 4, &[1])),
            Some((1, BatchId(11)))
        );
        let t13 = o.begin(BatchId(13), 4, &[2]).unwrap();
        for (batch, t) in [(10, t10), (11, t11), (12, t12)] {
            assert!(
                o.take(&ticket(batch, t), soon).unwrap().is_some(),
                "batch {batch}"
            );
        }
        o.finish(t13, outcome_ok(BatchId(13)));
        assert!(o.take(&ticket(13, t13), soon).unwrap().is_some());
        assert!(o.in_flight.lock().owners.is_empty(), "every slot free");
    }

    /// The batch running without an outcome and the held ones are named; not one whose
    /// outcome is in, nor one still queued (it never read: a reset has made it stale).
    #[test]
    fn still_loading_names_the_running_batch_and_those_held_not_those_to_be_taken_or_queued() {
        let o = Arc::new(Outcomes::new(4));
        let loading = o.begin(BatchId(1), 4, &[0]).unwrap();
        let loaded = o.begin(BatchId(2), 4, &[1]).unwrap();
        o.finish(loaded, outcome_ok(BatchId(2)));
        let held = o.begin(BatchId(3), 4, &[2]).unwrap();
        let hold = HeldOutcome::new(o.clone());
        let late_call = hold.clone();
        o.finish_held(hold, held, cancelled(3));
        let queued = o.begin(BatchId(4), 4, &[3]).unwrap();
        o.set_running(Some(BatchId(1)));
        assert_eq!(o.still_loading(), [BatchId(1), BatchId(3)]);
        drop(late_call);
        o.finish(loading, cancelled(1));
        o.set_running(None);
        assert!(o.still_loading().is_empty());
        o.set_running(Some(BatchId(4)));
        assert_eq!(o.still_loading(), [BatchId(4)]);
        o.finish(queued, cancelled(4));
        assert!(o.still_loading().is_empty());
    }
}
