//! Outcome bookkeeping of one linker, in one place: the readiness counter and its tickets,
//! what each ready layer's wait hands back, finished batches not yet taken, and the count of
//! batches the load thread still has to finish.

use std::collections::HashMap;
use std::time::Instant;

use kv_loader::{BatchId, BatchOutcome, KvLoadError, LayerReady, LoadTicket};
use layerwise_counter::{CounterError, LayerCounter, Ticket, WaitOutcome};
use parking_lot::{Condvar, Mutex};

/// Batches of one linker from `start_load` to their outcome being taken.
pub(crate) struct Outcomes {
    counter: LayerCounter<KvLoadError>,
    /// Per batch, what each ready layer's wait hands back (device pools only).
    readies: Mutex<HashMap<BatchId, Vec<Option<LayerReady>>>>,
    /// Finished batches not yet taken, with their counter tickets (released when taken).
    done: Mutex<HashMap<BatchId, (Ticket, BatchOutcome)>>,
    done_cv: Condvar,
    /// Batches submitted and not yet finished by the load thread.
    pending: Mutex<usize>,
    idle: Condvar,
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
        }
    }

    /// A counter ticket for a new batch of `num_layers` layers, counted as pending.
    pub(crate) fn begin(&self, batch: BatchId, num_layers: u32) -> Result<Ticket, KvLoadError> {
        let t = self.counter.begin(num_layers).map_err(|e| match e {
            CounterError::Full { capacity } => KvLoadError::Busy { capacity },
            other => KvLoadError::Config(format!("{batch}: {other}")),
        })?;
        *self.pending.lock() += 1;
        Ok(t)
    }

    /// A batch that `begin` counted never reached the load thread.
    pub(crate) fn abandon(&self, ticket: Ticket) {
        let _ = self.counter.finish(ticket);
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
            let slots = r.entry(batch).or_default();
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
        self.done.lock().insert(outcome.batch, (ticket, outcome));
        self.done_cv.notify_all();
        self.finished();
    }

    /// Waits (until `deadline`) for layer `layer` of the batch; what the engine waits on.
    pub(crate) fn wait_layer(
        &self,
        ticket: &LoadTicket,
        layer: u32,
        deadline: Instant,
    ) -> Result<Option<LayerReady>, WaitFailure> {
        let r = self
            .counter
            .wait(ticket.counter, layer, deadline)
            .map_err(WaitFailure::Counter)?;
        match r {
            WaitOutcome::Ready => Ok(self
                .readies
                .lock()
                .get(&ticket.batch)
                .and_then(|v| v.get(layer as usize).cloned().flatten())),
            WaitOutcome::Failed(e) => Err(WaitFailure::Load(e)),
            WaitOutcome::TimedOut => Err(WaitFailure::TimedOut),
            WaitOutcome::Cancelled => Err(WaitFailure::Cancelled),
        }
    }

    /// Takes the outcome of `batch`, waiting until `deadline`; frees its counter slot.
    pub(crate) fn take(&self, batch: BatchId, deadline: Instant) -> Option<BatchOutcome> {
        let mut done = self.done.lock();
        let taken = loop {
            if let Some(t) = done.remove(&batch) {
                break Some(t);
            }
            if self.done_cv.wait_until(&mut done, deadline).timed_out() {
                break done.remove(&batch);
            }
        };
        drop(done);
        let (ticket, outcome) = taken?;
        self.forget(ticket, batch);
        Some(outcome)
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

    fn forget(&self, ticket: Ticket, batch: BatchId) {
        // Already stale after a reset; otherwise this frees the batch's counter slot.
        let _ = self.counter.finish(ticket);
        self.readies.lock().remove(&batch);
    }

    /// Cancels every batch in flight (waiters get `Cancelled`) and waits, until `deadline`,
    /// until the load thread has nothing pending. True when it is idle.
    pub(crate) fn cancel_all(&self, deadline: Instant) -> bool {
        self.counter.reset();
        let mut p = self.pending.lock();
        while *p > 0 {
            if self.idle.wait_until(&mut p, deadline).timed_out() {
                break;
            }
        }
        let idle = *p == 0;
        drop(p);
        if idle {
            self.readies.lock().clear();
        }
        idle
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
