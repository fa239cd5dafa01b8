//! The mock's layer events: what a device pool's loader hands back for a layer whose copies
//! may still be queued, so that an engine tested on the mock must wait on them as it must on
//! the linker's.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::{BatchId, KvLoadError, RawStream, StreamWaitable};

/// A layer's event from [`MockKvLoader`](crate::mock::MockKvLoader) with
/// [`MockScript::device_events`](crate::mock::MockScript::device_events): it records whether
/// the engine waited on it (on a stream, or by synchronizing), which
/// [`MockKvLoader::events_not_waited`](crate::mock::MockKvLoader::events_not_waited) reports.
#[derive(Debug)]
pub struct MockLayerEvent {
    /// The batch.
    pub batch: BatchId,
    /// The layer.
    pub layer: u32,
    waited: AtomicBool,
}

impl MockLayerEvent {
    pub(crate) fn new(batch: BatchId, layer: u32) -> Self {
        MockLayerEvent {
            batch,
            layer,
            waited: AtomicBool::new(false),
        }
    }

    /// Whether the engine waited on it.
    pub fn waited(&self) -> bool {
        self.waited.load(Ordering::Acquire)
    }
}

impl StreamWaitable for MockLayerEvent {
    fn wait_on_stream(&self, _stream: RawStream) -> Result<(), KvLoadError> {
        self.waited.store(true, Ordering::Release);
        Ok(())
    }

    fn synchronize(&self) -> Result<(), KvLoadError> {
        self.waited.store(true, Ordering::Release);
        Ok(())
    }
}
