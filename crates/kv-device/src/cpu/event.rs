//! Events of the CPU device.

use std::any::Any;
use std::fmt;
use std::time::{Duration, Instant};

use kv_loader::{KvLoadError, RawStream, StreamWaitable};
use parking_lot::{Condvar, Mutex};

use crate::{DeviceError, DeviceEvent};

#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    Pending,
    Done,
    Failed(String),
}

/// An event of a [`CpuDevice`](super::CpuDevice) stream: completes when the stream's worker
/// reaches it, or fails (with the reason) when the stream had stopped before.
pub struct CpuEvent {
    state: Mutex<State>,
    cv: Condvar,
    /// Longest [`StreamWaitable`] waits block (the device's wait limit).
    limit: Duration,
}

impl fmt::Debug for CpuEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuEvent")
            .field("state", &*self.state.lock())
            .finish()
    }
}

impl CpuEvent {
    pub(crate) fn new(limit: Duration) -> Self {
        CpuEvent {
            state: Mutex::new(State::Pending),
            cv: Condvar::new(),
            limit,
        }
    }

    fn settle(&self, s: State) {
        let mut st = self.state.lock();
        if *st == State::Pending {
            *st = s;
        }
        self.cv.notify_all();
    }

    pub(crate) fn complete(&self) {
        self.settle(State::Done);
    }

    pub(crate) fn fail(&self, why: &str) {
        self.settle(State::Failed(why.to_string()));
    }
}

impl DeviceEvent for CpuEvent {
    fn is_complete(&self) -> Result<bool, DeviceError> {
        match &*self.state.lock() {
            State::Pending => Ok(false),
            State::Done => Ok(true),
            State::Failed(why) => Err(DeviceError::Driver(why.clone())),
        }
    }

    fn wait_until(&self, deadline: Instant) -> Result<bool, DeviceError> {
        let mut st = self.state.lock();
        loop {
            match &*st {
                State::Done => return Ok(true),
                State::Failed(why) => return Err(DeviceError::Driver(why.clone())),
                State::Pending => {
                    if self.cv.wait_until(&mut st, deadline).timed_out() {
                        // The state may have changed at the deadline itself: a failure then is
                        // a failure, not a wait that ran out.
                        return match &*st {
                            State::Done => Ok(true),
                            State::Failed(why) => Err(DeviceError::Driver(why.clone())),
                            State::Pending => Ok(false),
                        };
                    }
                }
            }
        }
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl StreamWaitable for CpuEvent {
    /// A CPU engine has no device stream: this blocks the calling thread until the layer is in
    /// (bounded by the device's wait limit), like [`synchronize`](StreamWaitable::synchronize).
    fn wait_on_stream(&self, _stream: RawStream) -> Result<(), KvLoadError> {
        self.synchronize()
    }

    fn synchronize(&self) -> Result<(), KvLoadError> {
        match self.wait_until(kv_loader::deadline_after(self.limit)) {
            Ok(true) => Ok(()),
            Ok(false) => Err(DeviceError::Timeout {
                what: "layer event (CPU device)",
                waited: self.limit,
            }
            .into()),
            Err(e) => Err(e.into()),
        }
    }
}
