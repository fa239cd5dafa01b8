//! The per-layer wait in front of a loaded prefix.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use kv_loader::{
    KvLoadError, KvLoader, LayerReady, LoadHandle, LoadStats, LoadTicket, RawStream, StreamWaitable,
};

use crate::CandleKvError;

/// Waits, through a [`LoadHandle`] (the batch's waits and outcome over the
/// [`KvLoader`] trait object), for each layer of one batch in flight before an attention
/// layer reads it.
///
/// Readiness is the loader's: a layer waited on again asks its counter again (one atomic
/// load once ready). The gate remembers which layers a wait found ready (with their device
/// events) for when a reset ends the ticket before `finish`: a wait that meets the ended
/// ticket on such a layer takes the outcome as `finish` would and answers its verdict (a
/// loaded batch's layers a wait saw stay ready; a failed one's slots may be another batch's
/// by now). A layer no wait saw before the reset fails its wait (`StaleTicket`), and `finish`
/// then answers `WaitFailed`: the batch's pages are recomputed.
/// A failed wait is kept: every later [`wait`](Self::wait) returns the same
/// [`CandleKvError::Load`] without calling the loader again, until a clone's `finish` took
/// the outcome (waits then answer its verdict).
/// [`finish`](Self::finish) takes the batch outcome (call it once per started batch,
/// even after a failure, so the loader can forget the batch).
///
/// **One batch, several sequences.** A plan may carry several requests: clone the gate into
/// each sequence's [`PagedLatentCache`](crate::PagedLatentCache). The clones share the batch:
/// a failed wait seen through one is seen through all, and the first
/// [`finish`](Self::finish) takes the outcome while the others get the same verdict (their
/// own `finish` does not ask the loader again). Take a gated batch's outcome through the gate,
/// not through `KvLoader::completed`: an outcome taken there is gone, and the gate's `finish`
/// then finds no outcome to take (`Unsettled`). The last clone dropped without `finish` (an
/// aborted request's cache) takes the outcome as it goes, waiting as `finish` would (bounded
/// by the loader) and logging the verdict, so the load is not left writing slots the engine
/// may hand out again.
///
/// With [`LayerReady::Event`](kv_loader::LayerReady::Event) (device pools), the gate blocks
/// on the event on the host, or, if built [`on_stream`](Self::on_stream), makes that compute
/// stream wait instead (per clone: each may name its own stream).
///
/// ```
/// use std::sync::Arc;
/// use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
/// use kv_loader::mock::{MockKvLoader, MockScript};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, LookupRequest, RequestPages};
/// use kvlink_candle::LayerGate;
///
/// let spec = ModelKvSpec::new("tiny", 3, 4, vec![ComponentSpec::new(
///     "k", RowUnit::Token, ElementType::Bytes, 8)]).unwrap();
/// let geometry = KvGeometry::new(spec, 1, 0).unwrap();
/// let script = MockScript { page_size: 4, ..Default::default() };
/// let loader: Arc<dyn KvLoader> = Arc::new(MockKvLoader::new(3, script));
/// // Two sequences of one batch, each with the 2 cached pages of its own prompt.
/// let mut requests = Vec::new();
/// for (name, first) in [("a", 0u32), ("b", 100)] {
///     let tokens: Vec<u32> = (first..first + 9).collect();
///     let hit = loader.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
///     requests.push(RequestPages { request: name.into(), pages: hit.pages });
/// }
/// let plan = BatchPlan::all_components(&geometry, BatchId(7), requests, vec![0, 1, 2, 3]);
/// let gate = LayerGate::new(loader.clone(), loader.start_load(plan).unwrap());
/// // One clone per sequence (each in its own cache); they share the batch.
/// let (mut a, mut b) = (gate.clone(), gate);
/// for layer in 0..3 {
///     a.wait(layer).unwrap(); // before attention on `layer` reads sequence a's rows
///     b.wait(layer).unwrap();
/// }
/// // The first finish takes the outcome; the other clone gets the same verdict.
/// assert!(a.finish().unwrap().is_some());
/// assert!(b.finish().unwrap().is_some());
/// ```
#[must_use = "a gate must be finished to take the load's outcome"]
pub struct LayerGate {
    inner: Option<Arc<Inner>>,
    stream: Option<RawStream>,
    /// This gate's own `finish` kept a verdict (one whose loader panicked did not): a second
    /// one has no statistics left to hand out (`Ok(None)` after a load) and answers a
    /// failure's verdict again, while waits keep answering the verdict.
    finished: bool,
}

/// A clone shares the batch; it has not finished (its own `finish` gives the verdict, even
/// when this gate's `finish` ran already).
impl Clone for LayerGate {
    fn clone(&self) -> Self {
        LayerGate {
            inner: self.inner.clone(),
            stream: self.stream,
            finished: false,
        }
    }
}

/// What every clone of one gate shares: the batch, its first failed wait, and its outcome
/// once one clone took it.
struct Inner {
    loader: Arc<dyn KvLoader>,
    ticket: LoadTicket,
    /// The batch's handle, taken (and finished) by the first `finish`.
    load: Mutex<Option<LoadHandle>>,
    failure: OnceLock<(u32, KvLoadError)>,
    /// The verdict of `finish`, taken once (under the lock: a second clone waits for the
    /// first to take it rather than ask the loader again).
    outcome: Mutex<Option<Result<Option<LoadStats>, Verdict>>>,
    /// Each layer's device event, asked of the loader just before the outcome is taken (the
    /// loader forgets them with the ticket): a clone's wait after the verdict waits on its
    /// layer's event, since the copies may still be queued on the load stream.
    events: OnceLock<Vec<Option<Arc<dyn StreamWaitable>>>>,
    /// The layers a wait found ready, each with its device event (`None`: resident): a
    /// reset may end the ticket before `finish` asks again, and a landed layer stays landed.
    seen: Mutex<HashMap<u32, Option<Arc<dyn StreamWaitable>>>>,
}

/// A failed verdict, kept to hand to every clone.
#[derive(Clone)]
enum Verdict {
    Load(Option<u32>, KvLoadError),
    WaitFailed(u32, KvLoadError),
    Unsettled(KvLoadError),
}

impl Verdict {
    fn error(self) -> CandleKvError {
        match self {
            Verdict::Load(layer, source) => CandleKvError::Load { layer, source },
            Verdict::WaitFailed(layer, source) => CandleKvError::WaitFailed { layer, source },
            Verdict::Unsettled(source) => CandleKvError::Unsettled { source },
        }
    }
}

impl std::fmt::Debug for LayerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            None => f.write_str("LayerGate(open)"),
            Some(i) => f
                .debug_struct("LayerGate")
                .field("batch", &i.ticket.batch)
                .field("failed_at", &i.failure.get().map(|f| f.0))
                .finish(),
        }
    }
}

impl LayerGate {
    /// A gate with nothing loading: every wait returns at once.
    pub fn open() -> Self {
        LayerGate {
            inner: None,
            stream: None,
            finished: false,
        }
    }

    /// A gate on the batch `ticket` that `loader.start_load` returned.
    pub fn new(loader: Arc<dyn KvLoader>, ticket: LoadTicket) -> Self {
        Self::from_handle(LoadHandle::from_ticket(loader, ticket))
    }

    /// A gate on the batch `load` owns (e.g. from [`LoadHandle::start`]).
    pub fn from_handle(load: LoadHandle) -> Self {
        LayerGate {
            inner: Some(Arc::new(Inner {
                loader: load.loader().clone(),
                ticket: *load.ticket(),
                load: Mutex::new(Some(load)),
                failure: OnceLock::new(),
                outcome: Mutex::new(None),
                events: OnceLock::new(),
                seen: Mutex::new(HashMap::new()),
            })),
            stream: None,
            finished: false,
        }
    }

    /// Device layers (`LayerReady::Event`) make `stream` wait instead of blocking the host.
    pub fn on_stream(mut self, stream: RawStream) -> Self {
        if self.inner.is_some() {
            self.stream = Some(stream);
        }
        self
    }

    /// True while a batch is attached (not [`open`](Self::open)) and no clone's
    /// [`finish`](Self::finish) has taken its outcome yet.
    pub fn is_loading(&self) -> bool {
        self.inner.as_ref().is_some_and(|i| i.taken().is_none())
    }

    /// The layers of the attached batch (`None` for an open gate).
    pub(crate) fn num_layers(&self) -> Option<u32> {
        self.inner.as_ref().map(|i| i.num_layers())
    }

    /// The batch's ticket, if one is attached.
    pub fn ticket(&self) -> Option<&LoadTicket> {
        self.inner.as_ref().map(|i| &i.ticket)
    }

    /// Returns once layer `layer` of the batch is readable (or at once for an open gate).
    /// A failed load gives [`CandleKvError::Load`]: recompute the prefix, into the same slots
    /// once [`finish`](Self::finish) has taken the outcome (a `Load` whose source is
    /// `SlotsHeld` means a store call may still write them until then). Once a clone's
    /// `finish` took the outcome (this gate's own included), every wait answers with its
    /// verdict: `Ok` when loaded (device layers still wait on their events), else the error
    /// `finish` gave (also `WaitFailed` or `Unsettled`).
    pub fn wait(&self, layer: u32) -> Result<(), CandleKvError> {
        self.wait_on(layer, self.stream)
    }

    /// [`wait`](Self::wait) that blocks the host on a device layer's event whatever stream
    /// the gate was built with: for reads and writes of the slots made by host-side copies.
    pub(crate) fn wait_on_host(&self, layer: u32) -> Result<(), CandleKvError> {
        self.wait_on(layer, None)
    }

    /// [`wait`](Self::wait), a device layer's event handed to `stream` (`None`: the host
    /// blocks on it).
    fn wait_on(&self, layer: u32, stream: Option<RawStream>) -> Result<(), CandleKvError> {
        let Some(i) = &self.inner else {
            return Ok(());
        };
        let num_layers = i.num_layers();
        if layer >= num_layers {
            return Err(CandleKvError::LayerOutOfRange { layer, num_layers });
        }
        if let Some(taken) = i.taken() {
            // Another clone took the outcome: the loader has forgotten the ticket, and the
            // verdict says it all (loaded: every layer is landed or has its event), also over
            // a failed wait seen before it (a `WaitFailed` verdict: the load has ended, no
            // reset).
            return taken.and_then(|()| i.replay(layer, stream));
        }
        if let Some((l, e)) = i.failure.get() {
            return Err(CandleKvError::Load {
                layer: Some(*l),
                source: e.clone(),
            });
        }
        let Err(e) = i.wait_layer_on(layer, stream) else {
            return Ok(());
        };
        // Another clone may have taken the outcome meanwhile (its `finish` holds the lock
        // while it does, so this waits for it): then the wait failed on the forgotten ticket,
        // and the verdict answers instead of a failure recorded for every clone.
        let mut outcome = i.outcome.lock().unwrap_or_else(|p| p.into_inner());
        if outcome.is_none()
            && matches!(e, KvLoadError::StaleTicket { .. })
            && i.seen(layer).is_some()
        {
            // A reset ended the ticket after a wait saw this layer ready: the load is over,
            // and only its outcome says whether the layer stands (a failed batch's slots may
            // be another batch's by now). Taken here, as `finish` takes it.
            outcome.get_or_insert_with(|| i.take_outcome(false));
        }
        if let Some(v) = outcome.as_ref() {
            let verdict = v.clone().map(drop).map_err(Verdict::error);
            drop(outcome);
            return verdict.and_then(|()| i.replay(layer, stream));
        }
        tracing::debug!(batch = %i.ticket.batch, layer, error = %e, "layer wait failed");
        let (l, e) = i.failure.get_or_init(|| (layer, e));
        Err(CandleKvError::Load {
            layer: Some(*l),
            source: e.clone(),
        })
    }

    /// Takes the batch's outcome (waiting, bounded by the loader, for it to finish). The gate keeps
    /// the verdict: every later [`wait`](Self::wait) answers with it (a failed load's layers never
    /// read as ready); a second `finish` of this gate returns `Ok(None)` after a load, and the same
    /// error again after a failure (a gate finished and then attached to a cache still tells the
    /// cache the load failed). `Ok(None)`: nothing was loading, or this gate finished a load
    /// before. `Err(Load)`: the prefix is not in the pool; the batch's own failure is the same
    /// verdict on every TP rank. `Err(WaitFailed)`: a failure only this rank's wait saw (a layer
    /// wait past its deadline on a batch that then loaded) is this rank's alone: ranks that must
    /// agree compare their verdicts themselves; the load has ended (no reset needed).
    /// `Err(Unsettled)`: no outcome could be taken; reset the loader before reusing the slots.
    /// Clones of the gate get the verdict the first of them took; before taking it, each layer is
    /// waited for (no host block on device events: they are kept, and a clone's later wait waits on
    /// its layer's event, as before the verdict).
    pub fn finish(&mut self) -> Result<Option<LoadStats>, CandleKvError> {
        let Some(i) = self.inner.as_ref() else {
            return Ok(None);
        };
        if self.finished {
            // The verdict was taken (by this gate): a failure stays one.
            return match i.taken() {
                Some(Err(e)) => Err(e),
                _ => Ok(None),
            };
        }
        // A clone that panicked while taking the outcome left none: this one takes it. This
        // gate counts as finished only once a verdict is kept (after a panic here, its next
        // `finish` takes the outcome again rather than answering `Ok(None)`).
        let mut taken = i.outcome.lock().unwrap_or_else(|p| p.into_inner());
        let verdict = taken.get_or_insert_with(|| i.take_outcome(false)).clone();
        drop(taken);
        self.finished = true;
        verdict.map_err(Verdict::error)
    }
}

/// The last clone dropped without [`LayerGate::finish`] (a request aborted mid-prefill, a
/// cache dropped unfinished): the batch is abandoned first (no clone will read it: kvlink's
/// linker stops its load at the next group of layers, so once the batch runs the wait below
/// is about one store call; a batch still queued waits for those ahead of it), then the
/// outcome is taken here, waiting as `finish` does (bounded by the loader), so that the load
/// is not left writing slots the engine hands to another sequence once the cache is gone,
/// nor its batch id and counter slot held until someone drains `KvLoader::completed` (which a
/// gated batch's engine does not).
impl Drop for Inner {
    fn drop(&mut self) {
        let outcome = self.outcome.get_mut().unwrap_or_else(|p| p.into_inner());
        if outcome.is_some() {
            return;
        }
        let batch = self.ticket.batch;
        self.loader.abandon(&self.ticket);
        match self.take_outcome(true).map_err(Verdict::error) {
            // Debug: an aborted request drops its cache this way, routinely.
            Ok(_) => {
                tracing::debug!(%batch, "layer gate dropped unfinished: its outcome taken on drop (the batch loaded)")
            }
            // The load may still write the slots (no outcome, or one whose error says so).
            Err(e) if e.needs_reset() => {
                tracing::error!(%batch, error = %e, "layer gate dropped unfinished: the load may still write its slots; keep them out of use until the loader frees them (a reset, or for SlotsHeld the store call's return)")
            }
            // Debug: kvlink's linker logs the batch's failure itself (once a minute per kind).
            Err(e) => {
                tracing::debug!(%batch, error = %e, "layer gate dropped unfinished: its outcome taken on drop (the batch failed; its slots are free)")
            }
        }
    }
}

impl Inner {
    /// Layers of the batch: the ticket's, at most the loader's (a ticket's fields are public:
    /// one built by hand must not size the event list past the model).
    fn num_layers(&self) -> u32 {
        self.ticket.num_layers.min(self.loader.num_layers())
    }

    /// The verdict a clone's `finish` took, as a layer wait's answer (`None`: not taken).
    fn taken(&self) -> Option<Result<(), CandleKvError>> {
        let outcome = self.outcome.lock().unwrap_or_else(|p| p.into_inner());
        outcome
            .as_ref()
            .map(|v| v.clone().map(drop).map_err(Verdict::error))
    }

    /// [`LoadHandle::wait_layer_on`], without the handle (another clone may be taking it for
    /// the outcome meanwhile).
    fn wait_layer_on(&self, layer: u32, stream: Option<RawStream>) -> Result<(), KvLoadError> {
        match (self.ready_event(layer)?, stream) {
            (None, _) => Ok(()),
            (Some(ev), Some(s)) => ev.wait_on_stream(s),
            (Some(ev), None) => ev.synchronize(),
        }
    }

    /// After the verdict: layer `layer`'s device event (kept before the outcome was taken),
    /// waited on as a wait before it would; a layer without one is resident.
    fn replay(&self, layer: u32, stream: Option<RawStream>) -> Result<(), CandleKvError> {
        let event = self
            .events
            .get()
            .and_then(|e| e.get(layer as usize)?.clone());
        let Some(ev) = event else {
            return Ok(());
        };
        match stream {
            Some(s) => ev.wait_on_stream(s),
            None => ev.synchronize(),
        }
        .map_err(|source| CandleKvError::Load {
            layer: Some(layer),
            source,
        })
    }

    /// The loader's answer for layer `layer`: its device event (`None`: resident), kept as
    /// seen.
    fn ready_event(&self, layer: u32) -> Result<Option<Arc<dyn StreamWaitable>>, KvLoadError> {
        let event = match self.loader.wait_layer(&self.ticket, layer)? {
            LayerReady::Resident => None,
            LayerReady::Event(ev) => Some(ev),
        };
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(layer, event.clone());
        Ok(event)
    }

    /// Whether a wait saw layer `layer` ready, and its device event (`Some(None)`: resident).
    fn seen(&self, layer: u32) -> Option<Option<Arc<dyn StreamWaitable>>> {
        let seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.get(&layer).cloned()
    }

    /// Each layer's event, asked of the loader before the outcome is taken (the batch has
    /// ended or is about to: `finish` waits for it anyway), last layer first: once it is
    /// ready the others answer at once, and the loader's compute meter (which times the gaps
    /// between waits on consecutive layers) sees no back-to-back pair to take for compute.
    /// Stops at the first wait that fails (a layer a wait saw ready before a reset ended the
    /// ticket answers what was seen), which it returns: no event is kept then, and a batch
    /// that loads anyway is failed on this rank (`WaitFailed`), since a clone's later wait
    /// could not wait on the events it missed.
    fn keep_events(&self) -> Option<(u32, KvLoadError)> {
        let n = self.num_layers();
        let mut events = vec![None; n as usize];
        let mut missed = None;
        if self.failure.get().is_none() {
            for layer in (0..n).rev() {
                // A layer a wait saw ready before a reset ended the ticket: what was seen
                // (read after the failed call: another clone's wait may have seen it meanwhile).
                let ready = match self.ready_event(layer) {
                    Err(e @ KvLoadError::StaleTicket { .. }) => self.seen(layer).ok_or(e),
                    other => other,
                };
                match ready {
                    Ok(event) => events[layer as usize] = event,
                    Err(e) => {
                        missed = Some((layer, e));
                        events.clear();
                        break;
                    }
                }
            }
        }
        let _ = self.events.set(events);
        missed
    }

    /// Asks the loader for the batch's outcome (once per batch: `finish` keeps it); first
    /// each layer's event (`keep_events`) unless `dropping` (no clone is left to wait).
    fn take_outcome(&self, dropping: bool) -> Result<Option<LoadStats>, Verdict> {
        let missed = if dropping { None } else { self.keep_events() };
        let failed_layer = self.failure.get().map(|f| f.0);
        let handle = self.load.lock().unwrap_or_else(|p| p.into_inner()).take();
        let outcome = match handle {
            Some(h) => h.finish(),
            None => self.loader.wait_batch(&self.ticket),
        }
        .map_err(Verdict::Unsettled)?;
        match outcome.result {
            Ok(stats) => match self.failure.get().cloned().or(missed) {
                // A wait failed but the batch loaded: the engine gave the layer up, so the
                // prefix is failed here, but nothing of the load runs any more.
                Some((layer, source)) => Err(Verdict::WaitFailed(layer, source)),
                None => Ok(Some(stats)),
            },
            Err(source) => Err(Verdict::Load(failed_layer, source)),
        }
    }
}
