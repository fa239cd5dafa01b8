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
            std::thread::sleep(max.mul_f64((self.rng % 1024) as f64 / 1023.0));
        }
    }

    fn step(&mut self, work: Work) {
        match work {
            Work::Signal(ev) => match &self.failed {
                None => ev.complete(),
                Some(why) => ev.fail(why),
            },
            _ if self.failed.is_some() => {}
            Work::Wait(ev) => self.wait(&*ev),
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
