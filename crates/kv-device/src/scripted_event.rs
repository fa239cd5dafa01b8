//! Tests: a device event whose answers the test sets (done, not yet, or a device fault).

use std::any::Any;
use std::time::Instant;

use kv_loader::{KvLoadError, RawStream, StreamWaitable};
use parking_lot::Mutex;

use crate::{DeviceError, DeviceEvent};

/// An event whose next answers the test sets: `Ok(done)`, or `Err` for a device that faulted.
#[derive(Debug)]
pub(crate) struct ScriptedEvent(Mutex<Result<bool, String>>);

impl ScriptedEvent {
    /// An event answering `answer` until told otherwise.
    pub(crate) fn new(answer: Result<bool, String>) -> Self {
        ScriptedEvent(Mutex::new(answer))
    }

    /// Its answers from now on.
    pub(crate) fn answer(&self, answer: Result<bool, String>) {
        *self.0.lock() = answer;
    }
}

impl StreamWaitable for ScriptedEvent {
    fn wait_on_stream(&self, _: RawStream) -> Result<(), KvLoadError> {
        Ok(())
    }
    fn synchronize(&self) -> Result<(), KvLoadError> {
        Ok(())
    }
}

impl DeviceEvent for ScriptedEvent {
    fn is_complete(&self) -> Result<bool, DeviceError> {
        self.0.lock().clone().map_err(DeviceError::Driver)
    }
    fn wait_until(&self, _: Instant) -> Result<bool, DeviceError> {
        self.is_complete()
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}
