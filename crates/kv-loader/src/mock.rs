//! A scriptable, recording `KvLoader` for engines' own tests (feature `mock`).

use std::collections::HashMap;
use std::time::Duration;

use kv_geometry::page_hashes;
use layerwise_counter::LayerCounter;
use parking_lot::Mutex;

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
    /// `completed`.
    Completed,
    /// `save` of this batch with this many pages.
    Save {
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

/// What the mock should do.
#[derive(Debug, Clone, Default)]
pub struct MockScript {
    /// Pages every lookup finds (capped by the request's whole pages); `None`: all of them.
    pub lookup_pages: Option<usize>,
    /// Batch → layer at which its load fails with a store transfer error.
    pub fail_at_layer: HashMap<u64, u32>,
    /// Batches whose layer waits time out.
    pub time_out: Vec<u64>,
    /// Page size used to hash lookups.
    pub page_size: u32,
}

#[derive(Default)]
struct MockState {
    calls: Vec<MockCall>,
    live: HashMap<u64, LoadTicket>,
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
/// script.fail_at_layer.insert(2, 1);
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
}

impl MockKvLoader {
    /// A mock for a model of `num_layers` layers.
    pub fn new(num_layers: u32, script: MockScript) -> Self {
        MockKvLoader {
            num_layers,
            script,
            state: Mutex::new(MockState::default()),
            counter: LayerCounter::new(),
        }
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

    fn live_ticket(&self, ticket: &LoadTicket) -> Result<(), KvLoadError> {
        let s = self.state.lock();
        match s.live.get(&ticket.batch.0) {
            Some(t) if t == ticket => Ok(()),
            _ => Err(KvLoadError::StaleTicket {
                batch: ticket.batch,
            }),
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

    fn outcome(&self, ticket: &LoadTicket) -> BatchOutcome {
        let b = ticket.batch;
        let result = if let Some(&l) = self.script.fail_at_layer.get(&b.0) {
            Err(self.failure(b, l))
        } else if self.script.time_out.contains(&b.0) {
            Err(KvLoadError::Timeout {
                batch: b,
                layer: 0,
                waited: Duration::ZERO,
            })
        } else {
            Ok(LoadStats {
                pages: 0,
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
            })
        };
        BatchOutcome { batch: b, result }
    }
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
        let ps = self.script.page_size.max(1);
        let all = page_hashes(request.tokens, ps, None);
        let first = request.skip_pages.min(all.len());
        let avail = all.len() - first;
        let n = self.script.lookup_pages.map_or(avail, |p| p.min(avail));
        Ok(LookupHit {
            pages: all[first..first + n].to_vec(),
            first_page: first,
            tokens: n * ps as usize,
        })
    }

    fn start_load(&self, plan: BatchPlan) -> Result<LoadTicket, KvLoadError> {
        let batch = plan.logical.batch;
        self.record(MockCall::StartLoad {
            batch,
            pages: plan.logical.num_pages(),
        })?;
        let counter = self
            .counter
            .begin(self.num_layers.max(1))
            .map_err(|e| KvLoadError::Config(format!("mock: {e}")))?;
        let ticket = LoadTicket {
            batch,
            num_layers: self.num_layers,
            counter,
        };
        self.state.lock().live.insert(batch.0, ticket);
        Ok(ticket)
    }

    fn wait_layer(&self, ticket: &LoadTicket, layer: u32) -> Result<LayerReady, KvLoadError> {
        self.record(MockCall::WaitLayer {
            batch: ticket.batch,
            layer,
        })?;
        self.live_ticket(ticket)?;
        if self.script.time_out.contains(&ticket.batch.0) {
            return Err(KvLoadError::Timeout {
                batch: ticket.batch,
                layer,
                waited: Duration::ZERO,
            });
        }
        match self.script.fail_at_layer.get(&ticket.batch.0) {
            Some(&l) if layer >= l => Err(self.failure(ticket.batch, l)),
            _ => Ok(LayerReady::Resident),
        }
    }

    fn wait_batch(&self, ticket: &LoadTicket) -> Result<BatchOutcome, KvLoadError> {
        self.record(MockCall::WaitBatch {
            batch: ticket.batch,
        })?;
        self.live_ticket(ticket)?;
        self.state.lock().live.remove(&ticket.batch.0);
        let _ = self.counter.finish(ticket.counter);
        Ok(self.outcome(ticket))
    }

    fn completed(&self) -> Vec<BatchOutcome> {
        if self.record(MockCall::Completed).is_err() {
            return Vec::new();
        }
        let live: Vec<LoadTicket> = self.state.lock().live.drain().map(|(_, t)| t).collect();
        for t in &live {
            let _ = self.counter.finish(t.counter);
        }
        let mut out: Vec<BatchOutcome> = live.iter().map(|t| self.outcome(t)).collect();
        out.sort_by_key(|o| o.batch);
        out
    }

    fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        self.record(MockCall::Save {
            batch: plan.logical.batch,
            pages: plan.logical.num_pages(),
        })?;
        Ok(SaveReport {
            objects_written: (plan.logical.num_pages() * plan.logical.components.len()) as u32,
            ..SaveReport::default()
        })
    }

    fn reset(&self) -> Result<(), KvLoadError> {
        self.record(MockCall::Reset)?;
        self.state.lock().live.clear();
        self.counter.reset();
        Ok(())
    }

    fn close(&self) -> Result<(), KvLoadError> {
        self.record(MockCall::Close)?;
        let mut s = self.state.lock();
        s.live.clear();
        s.closed = true;
        Ok(())
    }
}
