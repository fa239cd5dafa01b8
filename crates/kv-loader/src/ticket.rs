//! Tickets and what a layer wait hands back.

use std::fmt;
use std::sync::Arc;

use crate::{BatchId, KvLoadError};

/// A batch in flight on one rank, as `start_load` returned it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoadTicket {
    /// The batch.
    pub batch: BatchId,
    /// Layers the batch loads (all of the model's).
    pub num_layers: u32,
    /// The readiness counter's ticket (generation-checked).
    pub counter: layerwise_counter::Ticket,
}

/// A raw device stream handle (e.g. a `CUstream`) of the engine's compute stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawStream(pub usize);

/// Something a device stream can wait on (e.g. a CUDA event recorded after a layer's copies).
pub trait StreamWaitable: Send + Sync + fmt::Debug {
    /// Makes `stream` wait for the layer without blocking the calling thread.
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
