//! The per-layer wait in front of a loaded prefix.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use kv_loader::{KvLoadError, KvLoader, LayerReady, LoadStats, LoadTicket, RawStream};

use crate::CandleKvError;

/// Waits, through the [`KvLoader`] trait object, for each layer of one batch in flight
/// before an attention layer reads it; remembers what it saw so a layer is waited on once
/// and a failure is reported the same way to every later reader.
///
/// A layer that is ready costs one atomic load. A failed wait is kept: every later
/// [`wait`](Self::wait) returns [`CandleKvError::Load`] without calling the loader again.
/// [`finish`](Self::finish) takes the batch outcome (call it once per started batch, even
/// after a failure, so the loader can forget the batch).
///
/// With [`LayerReady::Event`] (device pools), the gate blocks on the event on the host, or,
/// if built [`on_stream`](Self::on_stream), makes that compute stream wait instead.
pub struct LayerGate {
    inner: Option<Inner>,
}

struct Inner {
    loader: Arc<dyn KvLoader>,
    ticket: LoadTicket,
    ready: Box<[AtomicBool]>,
    failure: OnceLock<(u32, KvLoadError)>,
    stream: Option<RawStream>,
}

impl std::fmt::Debug for LayerGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            None => f.write_str("LayerGate(open)"),
            Some(i) => f
                .debug_struct("LayerGate")
                .field("batch", &i.ticket.batch)
                .field(
                    "ready",
                    &i.ready.iter().filter(|r| r.load(Ordering::Acquire)).count(),
                )
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
        let ready = (0..ticket.num_layers)
            .map(|_| AtomicBool::new(false))
            .collect();
        LayerGate {
            inner: Some(Inner {
                loader,
                ticket,
                ready,
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
        self.inner.as_ref().map(|i| &i.ticket)
    }

    /// Returns once layer `layer` of the batch is readable (or at once for an open gate).
    /// A failed load gives [`CandleKvError::Load`]: recompute the prefix.
    pub fn wait(&self, layer: u32) -> Result<(), CandleKvError> {
        let Some(i) = &self.inner else {
            return Ok(());
        };
        let Some(flag) = i.ready.get(layer as usize) else {
            return Err(CandleKvError::LayerOutOfRange {
                layer,
                num_layers: i.ticket.num_layers,
            });
        };
        if flag.load(Ordering::Acquire) {
            return Ok(());
        }
        if let Some((l, e)) = i.failure.get() {
            return Err(CandleKvError::Load {
                layer: Some(*l),
                source: e.clone(),
            });
        }
        let waited = i.loader.wait_layer(&i.ticket, layer).and_then(|r| match r {
            LayerReady::Resident => Ok(()),
            LayerReady::Event(ev) => match i.stream {
                Some(s) => ev.wait_on_stream(s),
                None => ev.synchronize(),
            },
        });
        match waited {
            Ok(()) => {
                flag.store(true, Ordering::Release);
                Ok(())
            }
            Err(e) => {
                tracing::debug!(batch = %i.ticket.batch, layer, error = %e, "layer wait failed");
                let (l, e) = i.failure.get_or_init(|| (layer, e));
                Err(CandleKvError::Load {
                    layer: Some(*l),
                    source: e.clone(),
                })
            }
        }
    }

    /// Takes the batch's outcome (waiting, bounded by the loader, for it to finish) and
    /// detaches the batch; the gate is open afterwards. `Ok(None)`: nothing was loading.
    /// `Err(Load)`: the prefix is not in the pool (the same verdict on every TP rank).
    /// `Err(Unsettled)`: no outcome could be taken; reset the loader before reusing the
    /// slots.
    pub fn finish(&mut self) -> Result<Option<LoadStats>, CandleKvError> {
        let Some(i) = self.inner.take() else {
            return Ok(None);
        };
        let failed_layer = i.failure.get().map(|f| f.0);
        let outcome = i
            .loader
            .wait_batch(&i.ticket)
            .map_err(|source| CandleKvError::Unsettled { source })?;
        match outcome.result {
            Ok(stats) => {
                if let Some((l, e)) = i.failure.into_inner() {
                    // A wait failed but the batch claims success: trust the failure.
                    return Err(CandleKvError::Load {
                        layer: Some(l),
                        source: e,
                    });
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
