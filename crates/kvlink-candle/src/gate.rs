//! The per-layer wait in front of a loaded prefix.

use std::sync::{Arc, OnceLock};

use kv_loader::{KvLoadError, KvLoader, LoadHandle, LoadStats, LoadTicket, RawStream};

use crate::CandleKvError;

/// Waits, through a [`LoadHandle`] (the batch's waits and outcome over the
/// [`KvLoader`] trait object), for each layer of one batch in flight before an attention
/// layer reads it.
///
/// Readiness is the loader's: a layer waited on again asks its counter again (one atomic
/// load once ready); the gate keeps no copy. A failed wait is kept: every later
/// [`wait`](Self::wait) returns the same [`CandleKvError::Load`] without calling the loader
/// again. [`finish`](Self::finish) takes the batch outcome (call it once per started batch,
/// even after a failure, so the loader can forget the batch).
///
/// With [`LayerReady::Event`](kv_loader::LayerReady::Event) (device pools), the gate blocks
/// on the event on the host, or, if built [`on_stream`](Self::on_stream), makes that compute
/// stream wait instead.
pub struct LayerGate {
    inner: Option<Inner>,
}

struct Inner {
    load: LoadHandle,
    failure: OnceLock<(u32, KvLoadError)>,
    stream: Option<RawStream>,
}

impl std::fmt::Debug for LayerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            None => f.write_str("LayerGate(open)"),
            Some(i) => f
                .debug_struct("LayerGate")
                .field("batch", &i.load.batch())
                .field("failed_at", &i.failure.get().map(|f| f.0))
                .finish(),
        }
    }
}

impl LayerGate {
    /// A gate with nothing loading: every wait returns at once.
    pub fn open() -> Self {
        LayerGate { inner: None }
    }

    /// A gate on the batch `ticket` that `loader.start_load` returned.
    pub fn new(loader: Arc<dyn KvLoader>, ticket: LoadTicket) -> Self {
        Self::from_handle(LoadHandle::from_ticket(loader, ticket))
    }

    /// A gate on the batch `load` owns (e.g. from [`LoadHandle::start`]).
    pub fn from_handle(load: LoadHandle) -> Self {
        LayerGate {
            inner: Some(Inner {
                load,
                failure: OnceLock::new(),
                stream: None,
            }),
        }
    }

    /// Device layers (`LayerReady::Event`) make `stream` wait instead of blocking the host.
    pub fn on_stream(mut self, stream: RawStream) -> Self {
        if let Some(i) = &mut self.inner {
            i.stream = Some(stream);
        }
        self
    }

    /// True while a batch is attached (not [`open`](Self::open), not finished).
    pub fn is_loading(&self) -> bool {
        self.inner.is_some()
    }

    /// The batch's ticket, if one is attached.
    pub fn ticket(&self) -> Option<&LoadTicket> {
        self.inner.as_ref().map(|i| i.load.ticket())
    }

    /// Returns once layer `layer` of the batch is readable (or at once for an open gate).
    /// A failed load gives [`CandleKvError::Load`]: recompute the prefix, into the same slots
    /// once [`finish`](Self::finish) has taken the outcome (a `Load` whose source is
    /// `SlotsHeld` means a store call may still write them until then).
    pub fn wait(&self, layer: u32) -> Result<(), CandleKvError> {
        let Some(i) = &self.inner else {
            return Ok(());
        };
        if layer >= i.load.num_layers() {
            return Err(CandleKvError::LayerOutOfRange {
                layer,
                num_layers: i.load.num_layers(),
            });
        }
        if let Some((l, e)) = i.failure.get() {
            return Err(CandleKvError::Load {
                layer: Some(*l),
                source: e.clone(),
            });
        }
        i.load.wait_layer_on(layer, i.stream).map_err(|e| {
            tracing::debug!(batch = %i.load.batch(), layer, error = %e, "layer wait failed");
            let (l, e) = i.failure.get_or_init(|| (layer, e));
            CandleKvError::Load {
                layer: Some(*l),
                source: e.clone(),
            }
        })
    }

    /// Takes the batch's outcome (waiting, bounded by the loader, for it to finish) and
    /// detaches the batch; the gate is open afterwards. `Ok(None)`: nothing was loading.
    /// `Err(Load)`: the prefix is not in the pool; the batch's own failure is the same verdict
    /// on every TP rank. `Err(WaitFailed)`: a failure only this rank's wait saw (a layer wait
    /// past its deadline on a batch that then loaded) is this rank's alone: ranks that must
    /// agree compare their verdicts themselves; the load has ended (no reset needed). `Err(Unsettled)`: no outcome could be taken; reset the loader before reusing the
    /// slots.
    pub fn finish(&mut self) -> Result<Option<LoadStats>, CandleKvError> {
        let Some(i) = self.inner.take() else {
            return Ok(None);
        };
        let failed_layer = i.failure.get().map(|f| f.0);
        let outcome = i
            .load
            .finish()
            .map_err(|source| CandleKvError::Unsettled { source })?;
        match outcome.result {
            Ok(stats) => {
                if let Some((layer, source)) = i.failure.into_inner() {
                    // A wait failed but the batch loaded: the engine gave the layer up, so
                    // the prefix is failed here, but nothing of the load runs any more.
                    return Err(CandleKvError::WaitFailed { layer, source });
                }
                Ok(Some(stats))
            }
            Err(source) => Err(CandleKvError::Load {
                layer: failed_layer,
                source,
            }),
        }
    }
}
