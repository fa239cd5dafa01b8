//! The typed handles a landing lends out for one layer's collective ([`HostRows`],
//! [`DeviceStage`]), and the bookkeeping behind them (fences, byte counters).

use std::marker::PhantomData;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_loader::TransferBytes;
use parking_lot::Mutex;

use super::LayerStage;
use crate::{DeviceError, DeviceRegion, HostRow, SharedEvent};

/// Bytes moved per model layer.
#[derive(Debug)]
pub(crate) struct TransferLog(Mutex<Vec<TransferBytes>>);

impl TransferLog {
    pub(crate) fn new(layers: u32) -> Self {
        TransferLog(Mutex::new(vec![TransferBytes::default(); layers as usize]))
    }

    pub(crate) fn add(&self, layer: u32, f: impl FnOnce(&mut TransferBytes)) {
        if let Some(t) = self.0.lock().get_mut(layer as usize) {
            f(t);
        }
    }

    pub(crate) fn all(&self) -> Vec<TransferBytes> {
        self.0.lock().clone()
    }
}

/// The events that must complete before a stage of staging is reused or released, and whether it
/// is poisoned (some of them may never complete).
#[derive(Debug, Default)]
pub(crate) struct Fences {
    events: Mutex<Vec<SharedEvent>>,
    poisoned: AtomicBool,
    /// Poisoned by work that has no fence here (an aborted collective): its end is unknown.
    unfenced: AtomicBool,
}

impl Fences {
    pub(crate) fn push(&self, ev: SharedEvent) {
        self.events.lock().push(ev);
    }

    pub(crate) fn poison(&self) {
        self.poisoned.store(true, Ordering::Release);
    }

    /// Poisoned by work whose end no fence tells.
    pub(crate) fn poison_unfenced(&self) {
        self.unfenced.store(true, Ordering::Release);
        self.poison();
    }

    pub(crate) fn is_unfenced(&self) -> bool {
        self.unfenced.load(Ordering::Acquire)
    }

    pub(crate) fn is_poisoned(&self) -> bool {
        self.poisoned.load(Ordering::Acquire)
    }

    /// True when some fence has not completed yet; the device's error when asking one
    /// failed (a device fault, not work still queued).
    pub(crate) fn busy(&self) -> Result<bool, DeviceError> {
        for e in self.events.lock().iter() {
            if !e.is_complete()? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Waits for every fence until `deadline`; clears them when all completed. A fence that
    /// does not complete in time, or fails, poisons the stage.
    pub(crate) fn drain(&self, deadline: Instant, what: &'static str) -> Result<(), DeviceError> {
        self.drain_while(deadline, None, what)
    }

    /// [`drain`](Self::drain), and with `idle` giving up once no fence has completed for
    /// `idle` (each completion restarts it): a device that keeps finishing the work is
    /// waited for until `deadline`, one that stopped for `idle` only.
    pub(crate) fn drain_while(
        &self,
        deadline: Instant,
        idle: Option<Duration>,
        what: &'static str,
    ) -> Result<(), DeviceError> {
        if self.is_poisoned() {
            return Err(DeviceError::Poisoned(what));
        }
        let mut events = self.events.lock();
        if let Err(e) = wait_in_order(&events, deadline, idle, what) {
            self.poison();
            return Err(e);
        }
        events.clear();
        Ok(())
    }

    /// The fences now (left in place), whether or not some work has none here.
    pub(crate) fn recorded(&self) -> Vec<SharedEvent> {
        self.events.lock().clone()
    }

    /// Makes `stream` wait (device-side) for every fence of the stage: work it queues next
    /// then runs after every earlier use of the stage, on any stream (a collective's).
    pub(crate) fn order_after(&self, stream: &dyn crate::Stream) -> Result<(), DeviceError> {
        for ev in self.events.lock().iter() {
            stream.wait(ev)?;
        }
        Ok(())
    }

    /// The fences (left in place), or `None` when some work has no fence here (its end is
    /// unknown).
    pub(crate) fn known(&self) -> Option<Vec<SharedEvent>> {
        (!self.is_unfenced()).then(|| self.events.lock().clone())
    }

    /// The fences, for a release that must wait for them elsewhere.
    pub(crate) fn take(&self) -> Vec<SharedEvent> {
        std::mem::take(&mut *self.events.lock())
    }
}

/// Waits for `events` in order until `deadline`, and with `idle` only while one completed
/// within the last `idle` (the window restarts at each completion; it starts at the call,
/// so work queued before the first event counts against it).
pub(crate) fn wait_in_order(
    events: &[SharedEvent],
    deadline: Instant,
    idle: Option<Duration>,
    what: &'static str,
) -> Result<(), DeviceError> {
    let started = Instant::now();
    for ev in events {
        let by = idle.map_or(deadline, |i| deadline.min(kv_loader::deadline_after(i)));
        if !ev.wait_until(by)? {
            return Err(DeviceError::Timeout {
                what,
                waited: started.elapsed(),
            });
        }
    }
    Ok(())
}

/// Rows of host memory lent for one collective: pool slots of one layer of a batch, in the
/// order a host collective moves them. While it lives, nothing else touches these rows (it
/// borrows the batch's stage of that layer exclusively; the engine does not touch slots of a
/// batch in flight). Only kv-device makes them.
#[derive(Debug)]
pub struct HostRows<'a> {
    rows: Vec<HostRow>,
    layer: u32,
    log: &'a TransferLog,
    _stage: PhantomData<&'a mut LayerStage>,
}

impl<'a> HostRows<'a> {
    /// # Safety
    /// Every row is host memory valid for reads and writes of its length for `'a`, rows do not
    /// overlap one another, and nothing else reads or writes them while the result lives.
    pub(crate) unsafe fn new(
        rows: Vec<HostRow>,
        layer: u32,
        log: &'a TransferLog,
        _stage: &'a mut LayerStage,
    ) -> Self {
        HostRows {
            rows,
            layer,
            log,
            _stage: PhantomData,
        }
    }

    /// The rows, in order. Valid for reads and writes, and this holder's alone, while `self`
    /// lives.
    pub fn rows(&self) -> &[HostRow] {
        &self.rows
    }

    /// Bytes of all rows.
    pub fn bytes(&self) -> u64 {
        self.rows.iter().map(|r| r.len as u64).sum()
    }

    /// The layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Counts what a collective moved into (`received`) and out of (`sent`) these rows.
    pub fn count_collective(&mut self, received: u64, sent: u64) {
        // Saturating: the counts are the caller's, and a counter must not panic on them.
        self.log.add(self.layer, |t| {
            t.collective_received = t.collective_received.saturating_add(received);
            t.collective_sent = t.collective_sent.saturating_add(sent);
        });
    }
}

/// The share area of one layer's staging in device memory, lent for one collective: its
/// region, the event after which it holds this rank's part ([`after`](Self::after)), and the
/// stage's fences: every event pushed with [`fence`](Self::fence) must complete before the
/// stage is reused or its memory released. Only kv-device makes them.
///
/// It vouches that the region is device memory of the landing's device, valid for reads and
/// writes until every fence completes, and that nothing else touches it from `after` until
/// the fences pushed complete (the stage is borrowed exclusively; the landing reuses a stage
/// only after its fences).
#[derive(Debug)]
pub struct DeviceStage<'a> {
    region: DeviceRegion,
    after: Option<SharedEvent>,
    layer: u32,
    fences: &'a Fences,
    log: &'a TransferLog,
    _stage: PhantomData<&'a mut LayerStage>,
}

impl<'a> DeviceStage<'a> {
    /// # Safety
    /// `region` is device memory valid until every event pushed on `fences` completes, never
    /// freed nor reused before (the owner drains `fences` first, or never frees it), and
    /// touched by nothing else from `after` on while the result lives.
    pub(crate) unsafe fn new(
        region: DeviceRegion,
        after: Option<SharedEvent>,
        layer: u32,
        fences: &'a Fences,
        log: &'a TransferLog,
        _stage: &'a mut LayerStage,
    ) -> Self {
        DeviceStage {
            region,
            after,
            layer,
            fences,
            log,
            _stage: PhantomData,
        }
    }

    /// The share area in device memory.
    pub fn region(&self) -> DeviceRegion {
        self.region
    }

    /// The event after which the region holds this rank's part (its upload).
    pub fn after(&self) -> Option<SharedEvent> {
        self.after.clone()
    }

    /// The layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// `event` must complete before the stage is reused or released (a collective's
    /// completion event, which may still write the region).
    pub fn fence(&mut self, event: SharedEvent) {
        self.fences.push(event);
    }

    /// Work on the region may never finish, and no fence tells when it does (a collective that
    /// failed after it may have started, on a group now aborted): the stage is never reused nor
    /// freed.
    pub fn poison(&mut self) {
        self.fences.poison_unfenced();
    }

    /// Counts what a collective moved into (`received`) and out of (`sent`) the region.
    pub fn count_collective(&mut self, received: u64, sent: u64) {
        // Saturating: the counts are the caller's, and a counter must not panic on them.
        self.log.add(self.layer, |t| {
            t.collective_received = t.collective_received.saturating_add(received);
            t.collective_sent = t.collective_sent.saturating_add(sent);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scripted_event::ScriptedEvent;
    use std::sync::Arc;

    /// Before, a fence that could not be asked counted as work still queued: a stage lent
    /// then was refused as "queued since it was opened", hiding the device's fault.
    #[test]
    fn a_fence_that_cannot_be_asked_is_its_error_not_busy() {
        let f = Fences::default();
        assert!(!f.busy().unwrap());
        f.push(Arc::new(ScriptedEvent::new(Err(
            "test: the device faulted".into(),
        ))));
        assert_eq!(
            f.busy(),
            Err(DeviceError::Driver("test: the device faulted".into()))
        );
    }
}
