//! The copies a staged landing queued into its batch's slots, by the events recorded after
//! them: what a failed batch waits for before its outcome tells the engine to recompute into
//! those slots ([`LayerLanding::settle`](crate::LayerLanding::settle)).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use parking_lot::Mutex;

use crate::{DeviceError, SharedEvent};

/// The ends of one landing's copies into its slots.
#[derive(Default)]
pub(crate) struct SlotCopies {
    /// One event per `land` or `scatter`, recorded on the load stream after its copies.
    ends: Mutex<Vec<SharedEvent>>,
    /// Copies were queued whose end no event tells (recording it failed).
    unknown: AtomicBool,
}

impl SlotCopies {
    /// Copies into the slots end before `end`.
    pub(crate) fn ended_by(&self, end: SharedEvent) {
        self.ends.lock().push(end);
    }

    /// Copies into the slots may have been queued and no event tells their end.
    pub(crate) fn end_unknown(&self) {
        self.unknown.store(true, Ordering::Release);
    }

    /// Waits until every copy queued into the slots has ended, at most until `deadline`.
    /// Changes nothing (a stage's fences and poison stay the landing's concern); the events
    /// are waited for outside the lock.
    pub(crate) fn wait(&self, deadline: Instant) -> Result<(), DeviceError> {
        if self.unknown.load(Ordering::Acquire) {
            return Err(DeviceError::Poisoned(
                "copies into the slots were queued with no event to tell their end",
            ));
        }
        let ends = self.ends.lock().clone();
        let started = Instant::now();
        for end in &ends {
            if !end.wait_until(deadline)? {
                return Err(DeviceError::Timeout {
                    what: "the batch's copies into its slots",
                    waited: started.elapsed(),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuDevice, Device};
    use std::time::Duration;

    #[test]
    fn waits_for_every_copy_and_says_when_one_outlasts_the_deadline() {
        let dev = CpuDevice::new(0).unwrap();
        let stream = dev.load_stream();
        let copies = SlotCopies::default();
        copies
            .wait(kv_loader::deadline_after(Duration::ZERO))
            .expect("nothing queued: nothing to wait for");
        copies.ended_by(stream.record().unwrap());
        copies
            .wait(kv_loader::deadline_after(Duration::from_secs(5)))
            .expect("an idle stream's event completes");
        dev.stall_for(Duration::from_millis(500));
        copies.ended_by(stream.record().unwrap());
        let e = copies
            .wait(kv_loader::deadline_after(Duration::from_millis(50)))
            .unwrap_err();
        assert!(matches!(e, DeviceError::Timeout { .. }), "{e:?}");
        copies
            .wait(kv_loader::deadline_after(Duration::from_secs(5)))
            .expect("the stall ends");
        copies.end_unknown();
        let e = copies
            .wait(kv_loader::deadline_after(Duration::from_secs(5)))
            .unwrap_err();
        assert!(matches!(e, DeviceError::Poisoned(_)), "{e:?}");
    }
}
