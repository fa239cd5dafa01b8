//! A stream of the CPU device: a worker thread that runs its queue in order.

use std::fmt;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::device::{Control, CpuOp};
use super::event::CpuEvent;
use crate::{DeviceError, DeviceEvent, RowCopy, SharedEvent, Stream, Transfer};

enum Work {
    Transfer(Transfer),
    Rows(RowCopy),
    Signal(Arc<CpuEvent>),
    Wait(SharedEvent),
}

/// `share` (0 to 1) of `max`, at most `max`: `Duration::mul_f64` panics where the product
/// rounds past `Duration::MAX` (a `max_op_delay` near it, `share` 1).
fn fraction_of(max: Duration, share: f64) -> Duration {
    Duration::try_from_secs_f64(max.as_secs_f64() * share).map_or(max, |d| d.min(max))
}

impl Work {
    fn op(&self) -> (CpuOp, u64) {
        match self {
            Work::Transfer(t @ Transfer::ToDevice { .. }) => (CpuOp::ToDevice, t.len() as u64),
            Work::Transfer(t @ Transfer::ToHost { .. }) => (CpuOp::ToHost, t.len() as u64),
            Work::Transfer(t @ Transfer::OnDevice { .. }) => (CpuOp::OnDevice, t.len() as u64),
            Work::Rows(r) => (CpuOp::Rows, u64::from(r.n_rows) * r.row_bytes),
            Work::Signal(_) => (CpuOp::Record, 0),
            Work::Wait(_) => (CpuOp::Wait, 0),
        }
    }
}

/// One stream: the sending end of its worker's queue.
pub(crate) struct CpuStream {
    id: u32,
    control: Arc<Control>,
    tx: Mutex<Option<mpsc::Sender<Work>>>,
    done: Mutex<Option<mpsc::Receiver<()>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl fmt::Debug for CpuStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuStream").field("id", &self.id).finish()
    }
}

impl CpuStream {
    pub(crate) fn spawn(id: u32, control: Arc<Control>) -> Result<Arc<Self>, DeviceError> {
        let (tx, rx) = mpsc::channel::<Work>();
        let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
        let worker = Worker {
            id,
            control: control.clone(),
            failed: None,
            rng: 0x9e37_79b9_7f4a_7c15 ^ (u64::from(id) << 32 | u64::from(control.ordinal)),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-cpu-dev{}-s{id}", control.ordinal))
            .spawn(move || {
                worker.run(rx);
                let _ = done_tx.send(());
            })
            .map_err(|e| DeviceError::Driver(format!("spawning a CPU stream's thread: {e}")))?;
        Ok(Arc::new(CpuStream {
            id,
            control,
            tx: Mutex::new(Some(tx)),
            done: Mutex::new(Some(done_rx)),
            thread: Mutex::new(Some(thread)),
        }))
    }

    fn enqueue(&self, work: Work) -> Result<(), DeviceError> {
        self.control.check_fault(work.op().0)?;
        let tx = self.tx.lock();
        let sent = tx.as_ref().is_some_and(|tx| tx.send(work).is_ok());
        if sent {
            Ok(())
        } else {
            Err(DeviceError::Driver(format!(
                "CPU stream {} has stopped",
                self.id
            )))
        }
    }
}

// SAFETY: the worker runs the queue in order (one thread, one FIFO channel); a `Signal`
// completes its event only after every earlier item has run (or was skipped without touching
// memory, once the stream failed or was cancelled); a `Wait` blocks every later item until the
// event completes, and fails the stream (skipping the rest) when it does not.
unsafe impl Stream for CpuStream {
    unsafe fn transfer(&self, t: Transfer) -> Result<(), DeviceError> {
        self.enqueue(Work::Transfer(t))
    }

    unsafe fn copy_rows(&self, c: RowCopy) -> Result<(), DeviceError> {
        self.enqueue(Work::Rows(c))
    }

    fn record(&self) -> Result<SharedEvent, DeviceError> {
        let ev = Arc::new(CpuEvent::new(self.control.config.wait_limit));
        self.enqueue(Work::Signal(ev.clone()))?;
        Ok(ev)
    }

    fn wait(&self, event: &SharedEvent) -> Result<(), DeviceError> {
        if !event.as_any().is::<CpuEvent>() {
            return Err(DeviceError::ForeignEvent(format!(
                "CPU stream {} cannot wait on {event:?}",
                self.id
            )));
        }
        self.enqueue(Work::Wait(event.clone()))
    }
}

impl Drop for CpuStream {
    fn drop(&mut self) {
        // As a CUDA stream destroyed with work pending: the work queued so far still runs (its
        // events complete as usual), then the worker ends. Wait a moment for that, and leave
        // the worker to finish on its own when the queue holds more (e.g. a wait on a stalled
        // device, bounded by the wait limit).
        drop(self.tx.lock().take());
        let finished = self
            .done
            .lock()
            .take()
            .is_some_and(|d| d.recv_timeout(Duration::from_millis(200)).is_ok());
        if let Some(t) = self.thread.lock().take() {
            if finished {
                let _ = t.join();
            } else {
                tracing::debug!(
                    stream = self.id,
                    "CPU stream dropped with work queued; it finishes on its own"
                );
            }
        }
    }
}

struct Worker {
    id: u32,
    control: Arc<Control>,
    /// Set when a wait failed: later work is skipped, later events fail with it.
    failed: Option<String>,
    rng: u64,
}

impl Worker {
    fn run(mut self, rx: mpsc::Receiver<Work>) {
        while let Ok(work) = rx.recv() {
            let (op, bytes) = work.op();
            self.control.starting(op);
            self.hold();
            let started = Instant::now();
            self.step(work);
            self.control.traced(self.id, op, bytes, started);
        }
    }

    /// Waits out a stall of the device and this operation's random delay.
    fn hold(&mut self) {
        while let Some(left) = self.control.stalled_for() {
            std::thread::sleep(left.min(Duration::from_millis(5)));
        }
        let max = self.control.config.max_op_delay;
        if !max.is_zero() {
            self.rng ^= self.rng << 13;
            self.rng ^= self.rng >> 7;
            self.rng ^= self.rng << 17;
            std::thread::sleep(fraction_of(max, (self.rng % 1024) as f64 / 1023.0));
        }
    }

    fn step(&mut self, work: Work) {
        match work {
            Work::Signal(ev) => match &self.failed {
                None => ev.complete(),
                Some(why) => ev.fail(why),
            },
            _ if self.failed.is_some() => {}
            // On the CPU event itself (`wait` checked there is one): a wrapper whose `as_any`
            // names it could answer its own waits early, and the stream must hold for the
            // event the driver would wait on, as a CUDA stream waits on the `CUevent`.
            Work::Wait(ev) => match ev.as_any().downcast_ref::<CpuEvent>() {
                Some(cpu) => self.wait(cpu),
                None => self.wait(&*ev),
            },
            // SAFETY: the enqueuer promised (Stream::transfer) that both ranges are valid and
            // untouched by anything else until an event recorded after this copy completes,
            // which cannot happen before this runs.
            Work::Transfer(t) => unsafe { run_transfer(t) },
            // SAFETY: as above (Stream::copy_rows): rows and index arrays are valid.
            Work::Rows(r) => unsafe { run_rows(r) },
        }
    }

    fn wait(&mut self, ev: &dyn DeviceEvent) {
        let limit = self.control.config.wait_limit;
        let deadline = kv_loader::deadline_after(limit);
        loop {
            let slice = kv_loader::deadline_after(Duration::from_millis(20)).min(deadline);
            match ev.wait_until(slice) {
                Ok(true) => return,
                Ok(false) if Instant::now() < deadline => {}
                Ok(false) => {
                    self.failed = Some(format!(
                        "CPU stream {} gave up waiting for an event after {limit:?}",
                        self.id
                    ));
                    return;
                }
                Err(e) => {
                    self.failed = Some(format!(
                        "CPU stream {} waited on a failed event: {e}",
                        self.id
                    ));
                    return;
                }
            }
        }
    }
}

/// # Safety
/// As [`Stream::transfer`]: both ranges valid, not overlapping, untouched by others.
unsafe fn run_transfer(t: Transfer) {
    let (dst, src, len) = match t {
        Transfer::ToDevice { dst, src, len } => (dst as usize, src, len),
        Transfer::ToHost { dst, src, len } => (dst, src as usize, len),
        Transfer::OnDevice { dst, src, len } => (dst as usize, src as usize, len),
    };
    if len == 0 || dst == src {
        return;
    }
    // SAFETY: the caller's promise; CPU device addresses are host addresses.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
}

/// # Safety
/// As [`Stream::copy_rows`].
unsafe fn run_rows(c: RowCopy) {
    let row = c.row_bytes as usize;
    let index = |table: u64, r: usize| -> usize {
        if table == 0 {
            r
        } else {
            // SAFETY: the caller promised `table` holds `n_rows` u32 (r < n_rows).
            unsafe { std::ptr::read_unaligned((table as usize as *const u32).add(r)) as usize }
        }
    };
    for r in 0..c.n_rows as usize {
        let src = c.src as usize + index(c.src_rows, r) * row;
        let dst = c.dst as usize + index(c.dst_rows, r) * row;
        // SAFETY: the caller promised every named row lies in its buffer, destination rows
        // are distinct and overlap no source row.
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, row) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event that answers its own waits at once but names an incomplete CPU event as
    /// what it is (`as_any`), as a wrapper may.
    #[derive(Debug)]
    struct EarlyWrapper(CpuEvent);

    impl kv_loader::StreamWaitable for EarlyWrapper {
        fn wait_on_stream(&self, _: kv_loader::RawStream) -> Result<(), kv_loader::KvLoadError> {
            Ok(())
        }
        fn synchronize(&self) -> Result<(), kv_loader::KvLoadError> {
            Ok(())
        }
    }

    impl DeviceEvent for EarlyWrapper {
        fn is_complete(&self) -> Result<bool, DeviceError> {
            Ok(true)
        }

        fn wait_until(&self, _deadline: Instant) -> Result<bool, DeviceError> {
            Ok(true)
        }

        fn as_any(&self) -> &dyn std::any::Any {
            &self.0
        }
    }

    /// A stream waits for the CPU event a wrapper names, not for the wrapper's own answer.
    #[test]
    fn a_stream_waits_on_the_cpu_event_a_wrapper_names() {
        let device = crate::CpuDevice::new(0).unwrap();
        let stream = crate::Device::new_stream(&*device).unwrap();
        let wrapper: SharedEvent = Arc::new(EarlyWrapper(CpuEvent::new(Duration::from_secs(5))));
        stream.wait(&wrapper).unwrap();
        let after = stream.record().unwrap();
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            !after.is_complete().unwrap(),
            "work after the wait ran before the CPU event completed"
        );
        wrapper
            .as_any()
            .downcast_ref::<CpuEvent>()
            .unwrap()
            .complete();
        assert!(after
            .wait_until(kv_loader::deadline_after(Duration::from_secs(5)))
            .unwrap());
    }

    /// A share of a delay near `Duration::MAX` saturates at it instead of panicking.
    #[test]
    fn a_share_of_the_longest_delay_is_at_most_it() {
        assert_eq!(fraction_of(Duration::MAX, 1.0), Duration::MAX);
        assert_eq!(
            fraction_of(Duration::from_secs(2), 0.5),
            Duration::from_secs(1)
        );
        assert_eq!(fraction_of(Duration::from_secs(2), 0.0), Duration::ZERO);
    }
}
