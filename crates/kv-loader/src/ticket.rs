//! Tickets and what a layer wait hands back.

use std::fmt;
use std::sync::Arc;

use crate::{BatchId, KvLoadError};

/// A batch in flight on one rank, as `start_load` returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "take the batch's outcome (wait_batch, completed) or abandon it: its slots stay in use until then"]
pub struct LoadTicket {
    /// The batch.
    pub batch: BatchId,
    /// Layers the batch loads (all of the model's).
    pub num_layers: u32,
    /// The readiness counter's ticket (generation-checked).
    pub counter: layerwise_counter::Ticket,
}

/// A raw device stream handle (e.g. a `CUstream` cast to `usize`) of the engine's compute
/// stream, vouched for by whoever made it.
///
/// A backend hands it to its driver as a stream ([`StreamWaitable::wait_on_stream`]), so an
/// arbitrary integer must not become one: the only way in is the `unsafe`
/// [`from_raw`](Self::from_raw), whose caller promises it is a live stream.
///
/// ```
/// use kv_loader::RawStream;
/// // SAFETY: for this example only; the handle is never given to a driver.
/// let s = unsafe { RawStream::from_raw(0xabc) };
/// assert_eq!(s.as_raw(), 0xabc);
/// ```
///
/// ```compile_fail
/// let s = kv_loader::RawStream(0xabc); // the field is private: use `from_raw`
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStream(usize);

impl RawStream {
    /// Wraps a raw stream handle.
    ///
    /// # Safety
    /// `raw` is a live stream of the backend whose events will be waited on with it, or
    /// recorded on it (for CUDA: a `CUstream` of a context of this process, or 0 for the
    /// legacy default stream), and it stays live for as long as this value (or a copy) may
    /// be passed to kvlink: [`StreamWaitable::wait_on_stream`],
    /// [`KvLoader::save_after_stream`](crate::KvLoader::save_after_stream) (a device's
    /// `record_on`).
    ///
    /// CUDA's default stream handles (0, 1 legacy, 2 per-thread) name a stream of whichever
    /// context is current on the calling thread: kvlink refuses them (`Config` for a wait,
    /// `Unsupported` from a device's `record_on`) on a
    /// thread whose current context is not kvlink's device's, where the wait or event would
    /// not order the engine's work on that device. Prefer the engine's stream itself.
    pub const unsafe fn from_raw(raw: usize) -> Self {
        RawStream(raw)
    }

    /// The handle, as given to [`from_raw`](Self::from_raw).
    pub const fn as_raw(self) -> usize {
        self.0
    }
}

/// Something a device stream can wait on (e.g. a CUDA event recorded after a layer's copies).
pub trait StreamWaitable: Send + Sync + fmt::Debug {
    /// Makes `stream` wait for the layer without blocking the calling thread. Safe: a
    /// [`RawStream`] carries its maker's promise that it is a live stream.
    fn wait_on_stream(&self, stream: RawStream) -> Result<(), KvLoadError>;
    /// Blocks the calling thread until the layer is resident.
    fn synchronize(&self) -> Result<(), KvLoadError>;
}

/// What a layer wait hands back.
#[derive(Debug, Clone)]
pub enum LayerReady {
    /// The layer's bytes are in this rank's pool now (host pools, or a device copy already
    /// synchronized).
    Resident,
    /// The layer's copies are enqueued on a device stream; make the compute stream wait on
    /// this before reading the layer.
    Event(Arc<dyn StreamWaitable>),
}
