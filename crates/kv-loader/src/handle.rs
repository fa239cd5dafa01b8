//! A batch in flight as one value: its layer waits and its outcome, like a `JoinHandle`.

use std::fmt;
use std::sync::Arc;

use crate::{
    BatchId, BatchOutcome, BatchPlan, KvLoadError, KvLoader, LayerReady, LoadTicket, RawStream,
};

/// One batch in flight on one rank: owns the batch's layer waits ([`wait_layer`]) and its
/// outcome ([`finish`]), the way a `JoinHandle` owns a thread's result. It pairs the loader
/// (an `Arc<dyn KvLoader>`, so [`KvLoader`] stays object-safe) with the batch's ticket.
///
/// Readiness lives in the loader's layer counter; the handle keeps no copy of it, so a
/// layer waited on twice asks the counter twice (one atomic load once it is ready).
///
/// Take the outcome with [`finish`] (or the loader's `completed`). For a request aborted or
/// preempted mid-load, [`abort`] stops the load and takes its outcome: once it returns `Ok`,
/// nothing of the load writes the batch's slots, and they may go back to the free list. A
/// handle dropped unfinished abandons the batch ([`KvLoader::abandon`]: kvlink's linker stops
/// its load at the next group of layers; its slots may go to another batch's load once the
/// load is over, and its place among those in flight when a start needs it), leaves its
/// outcome to [`KvLoader::completed`] (kvlink's loaders let the oldest such outcomes go once
/// more than their capacity wait), and logs that it did, at `warn`. After a drop, the load
/// may still be writing the slots for a while: do not write them yourself (your own kernels
/// do not look at kvlink's claims) before the batch's outcome comes through `completed`.
///
/// [`wait_layer`]: LoadHandle::wait_layer
/// [`finish`]: LoadHandle::finish
/// [`abort`]: LoadHandle::abort
///
/// ```
/// # #[cfg(feature = "mock")] {
/// use std::sync::Arc;
/// use kv_loader::mock::{MockKvLoader, MockScript};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, LoadHandle, LogicalPlan};
/// let loader: Arc<dyn KvLoader> = Arc::new(MockKvLoader::new(3, MockScript::default()));
/// let plan = BatchPlan {
///     logical: LogicalPlan { batch: BatchId(1), requests: vec![], components: vec![] },
///     slots: vec![],
/// };
/// let load = LoadHandle::start(loader, plan).unwrap();
/// for layer in 0..load.num_layers() {
///     load.wait_layer(layer).unwrap(); // before attention on `layer`
/// }
/// let outcome = load.finish().unwrap();
/// assert!(outcome.result.is_ok());
/// # }
/// ```
#[must_use = "finish it (or take its outcome): a dropped handle leaves its outcome in the loader"]
pub struct LoadHandle {
    loader: Arc<dyn KvLoader>,
    ticket: LoadTicket,
    finished: bool,
}

impl fmt::Debug for LoadHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LoadHandle")
            .field("ticket", &self.ticket)
            .finish_non_exhaustive()
    }
}

impl LoadHandle {
    /// Starts loading `plan` ([`KvLoader::start_load`]) and returns its handle. In a TP
    /// group this is collective: every rank starts the same batches in the same order.
    pub fn start(loader: Arc<dyn KvLoader>, plan: BatchPlan) -> Result<Self, KvLoadError> {
        let ticket = loader.start_load(plan)?;
        Ok(Self::from_ticket(loader, ticket))
    }

    /// The handle of a batch already started on `loader` with `ticket`.
    pub fn from_ticket(loader: Arc<dyn KvLoader>, ticket: LoadTicket) -> Self {
        LoadHandle {
            loader,
            ticket,
            finished: false,
        }
    }

    /// The batch.
    pub fn batch(&self) -> BatchId {
        self.ticket.batch
    }

    /// The batch's ticket (for calls on the loader itself).
    pub fn ticket(&self) -> &LoadTicket {
        &self.ticket
    }

    /// Layers the batch loads.
    pub fn num_layers(&self) -> u32 {
        self.ticket.num_layers
    }

    /// The loader the batch runs on.
    pub fn loader(&self) -> &Arc<dyn KvLoader> {
        &self.loader
    }

    /// Waits (bounded) for layer `layer`: [`LayerReady::Resident`] once its bytes are in the
    /// pool, or the layer's event for a compute stream (device pools).
    pub fn wait_layer(&self, layer: u32) -> Result<LayerReady, KvLoadError> {
        self.loader.wait_layer(&self.ticket, layer)
    }

    /// Like [`wait_layer`](Self::wait_layer), then settles the answer: a device layer's
    /// event is made a wait of `stream` (no host block); with no stream the calling thread
    /// blocks until the layer is resident.
    pub fn wait_layer_on(&self, layer: u32, stream: Option<RawStream>) -> Result<(), KvLoadError> {
        match self.wait_layer(layer)? {
            LayerReady::Resident => Ok(()),
            LayerReady::Event(ev) => match stream {
                Some(s) => ev.wait_on_stream(s),
                None => ev.synchronize(),
            },
        }
    }

    /// Waits (bounded) for the batch to finish and takes its outcome, consuming the handle.
    ///
    /// `Ok(outcome)`: the batch is settled; `outcome.result` is its stats or why it failed
    /// (then recompute its pages: [`KvLoadError::action`]). `Err(e)`: no outcome could be
    /// taken (the deadline passed, or the ticket is stale: its outcome was taken elsewhere,
    /// e.g. through `completed`) and the load may still write its
    /// slots: [`EngineAction::ResetThenRecompute`](crate::EngineAction::ResetThenRecompute)
    /// whatever `e` is.
    pub fn finish(mut self) -> Result<BatchOutcome, KvLoadError> {
        self.finished = true;
        self.loader.wait_batch(&self.ticket)
    }

    /// Abandons the batch ([`KvLoader::abandon`]: its request was aborted or preempted; the
    /// load stops at its next group of layers), then waits (bounded) for its outcome and
    /// takes it, consuming the handle: an engine frees the batch's slots on `Ok`, whatever
    /// the outcome says (most often `Cancelled`; the pages are not read), since nothing of the
    /// load writes them any more. `Err(e)`: as [`finish`](Self::finish), the load may still
    /// write the slots (keep them out of use, and reset:
    /// [`EngineAction::ResetThenRecompute`](crate::EngineAction::ResetThenRecompute)). In a
    /// TP group every rank aborts its own handle of the batch; a rank that aborts fails the
    /// batch on every rank.
    pub fn abort(mut self) -> Result<BatchOutcome, KvLoadError> {
        self.finished = true;
        self.loader.abandon(&self.ticket);
        tracing::debug!(batch = %self.ticket.batch, "load aborted: waiting for its outcome");
        self.loader.wait_batch(&self.ticket)
    }
}

impl Drop for LoadHandle {
    fn drop(&mut self) {
        if !self.finished {
            // Its load stops; its slots go once it is over, its place when a start needs it.
            self.loader.abandon(&self.ticket);
            tracing::warn!(
                batch = %self.ticket.batch,
                "load handle dropped unfinished: the batch is abandoned (its load stops, its \
                 slots are let go once it is over); its outcome is left to completed()"
            );
        }
    }
}

#[cfg(all(test, feature = "mock"))]
mod tests {
    use super::*;
    use crate::mock::{MockCall, MockKvLoader, MockScript};
    use crate::LogicalPlan;

    fn plan(b: u64) -> BatchPlan {
        BatchPlan {
            logical: LogicalPlan {
                batch: BatchId(b),
                requests: vec![],
                components: vec![],
            },
            slots: vec![],
        }
    }

    #[test]
    fn the_handle_waits_and_finishes_through_the_loader() {
        let mut script = MockScript::default();
        script.fail_at_layer.insert(BatchId(2), 1);
        let mock = Arc::new(MockKvLoader::new(3, script));
        let loader: Arc<dyn KvLoader> = mock.clone();

        let ok = LoadHandle::start(loader.clone(), plan(1)).unwrap();
        assert_eq!((ok.batch(), ok.num_layers()), (BatchId(1), 3));
        ok.wait_layer_on(2, None).unwrap();
        assert!(ok.finish().unwrap().result.is_ok());

        let bad = LoadHandle::start(loader, plan(2)).unwrap();
        assert!(bad.wait_layer(0).is_ok());
        let e = bad.wait_layer(1).unwrap_err();
        assert_eq!(e.layer(), Some(1));
        assert!(bad.finish().unwrap().result.is_err());

        let waits = mock
            .calls()
            .into_iter()
            .filter(|c| matches!(c, MockCall::WaitBatch { .. }))
            .count();
        assert_eq!(waits, 2, "each finish takes its batch's outcome once");
    }

    /// An aborted handle abandons its batch and takes its outcome: nothing is left to
    /// `completed`, and the slot is free for the next batch at once.
    #[test]
    fn an_aborted_handle_abandons_its_batch_and_takes_its_outcome() {
        let mock = Arc::new(MockKvLoader::new(2, MockScript::default()));
        let h = LoadHandle::start(mock.clone(), plan(6)).unwrap();
        let outcome = h.abort().unwrap();
        assert_eq!(outcome.batch, BatchId(6));
        assert!(mock.completed().is_empty());
        let calls = mock.calls();
        let abandoned = calls
            .iter()
            .position(|c| matches!(c, MockCall::Abandon { batch } if *batch == BatchId(6)));
        let waited = calls
            .iter()
            .position(|c| matches!(c, MockCall::WaitBatch { batch } if *batch == BatchId(6)));
        assert!(abandoned.is_some() && abandoned < waited, "{calls:?}");
    }

    #[test]
    fn a_dropped_handle_leaves_its_outcome_to_completed() {
        let mock = Arc::new(MockKvLoader::new(2, MockScript::default()));
        let h = LoadHandle::start(mock.clone(), plan(5)).unwrap();
        drop(h);
        let done = mock.completed();
        assert_eq!(done.len(), 1);
        assert_eq!(done[0].batch, BatchId(5));
    }

    /// A handle dropped unfinished abandons its batch: the batch's slot goes to the next
    /// batch at once (the mock's load is over), and its outcome is still handed out by
    /// `completed`. While the handle lives, the slot is refused (`SlotInFlight`).
    #[test]
    fn a_dropped_handle_lets_its_slots_go_and_leaves_its_outcome() {
        let one_page = |b: u64| BatchPlan {
            logical: LogicalPlan {
                batch: BatchId(b),
                requests: vec![crate::RequestPages {
                    request: "r".into(),
                    pages: vec![kv_geometry::PageHash([7; 32])],
                }],
                components: vec![kv_geometry::ComponentId(0)],
            },
            slots: vec![5],
        };
        let loader: Arc<dyn KvLoader> = Arc::new(MockKvLoader::new(3, MockScript::default()));
        let first = LoadHandle::start(loader.clone(), one_page(1)).unwrap();
        assert!(matches!(
            LoadHandle::start(loader.clone(), one_page(2)),
            Err(KvLoadError::InvalidPlan {
                reason: crate::PlanError::SlotInFlight { slot: 5, .. },
                ..
            })
        ));
        drop(first);
        let second = LoadHandle::start(loader.clone(), one_page(3)).unwrap();
        assert!(second.finish().unwrap().result.is_ok());
        // The recompute's save of the slot goes through too (the mock refused it).
        loader.save(&one_page(4)).unwrap();
        let left: Vec<BatchId> = loader.completed().iter().map(|o| o.batch).collect();
        assert_eq!(left, [BatchId(1)]);
    }
}
