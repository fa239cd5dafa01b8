//! The thread that owns one rank's NCCL communicator (a `ncclComm_t` is not `Send`): it
//! creates the communicator, runs the requests of the rank's [`NcclCollective`] handle in
//! order on a dedicated comm stream, enforces each request's deadline, aborts the
//! communicator when an operation cannot finish, and tears it down when the handle goes.
//!
//! [`NcclCollective`]: super::NcclCollective

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{sys as cu, CudaEvent, CudaStream};
use cudarc::nccl::sys;
use kv_device::cuda::{CudaDevice, CudaLayerEvent, DeviceBuffer, PinnedBuffer};
use kv_device::{Residence, SharedEvent};

use super::error::nccl_error;
use super::NcclConfig;
use crate::CollectiveError;

/// A region an operation of the comm thread moves: host memory (through the device scratch)
/// or device memory of one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) addr: usize,
    pub(crate) len: usize,
    pub(crate) residence: Residence,
}

impl Span {
    pub(crate) fn host(addr: usize, len: usize) -> Self {
        Span {
            addr,
            len,
            residence: Residence::Host,
        }
    }

    pub(crate) fn device(ordinal: u32, addr: u64, len: usize) -> Self {
        Span {
            addr: addr as usize,
            len,
            residence: Residence::Device { ordinal },
        }
    }

    fn end(&self) -> usize {
        self.addr.saturating_add(self.len)
    }

    fn overlaps(&self, other: &Span) -> bool {
        self.len > 0 && other.len > 0 && self.addr < other.end() && other.addr < self.end()
    }
}

/// What a rank asks its comm thread to do.
pub(crate) enum Op {
    /// A broadcast completed before the reply (host spans go through the scratch).
    Broadcast { buf: Span, root: u32 },
    /// An all-gather completed before the reply (host spans go through the scratch).
    AllGather { send: Span, recv: Span },
    /// A device broadcast enqueued after `after`; the reply is its completion event.
    BroadcastAsync {
        buf: Span,
        root: u32,
        after: Option<SharedEvent>,
    },
    /// A device all-gather enqueued after `after`; the reply is its completion event.
    AllGatherAsync {
        send: Span,
        recv: Span,
        after: Option<SharedEvent>,
    },
    /// Abort the communicator (every later operation fails).
    Abort { cause: String },
}

impl Op {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Op::Broadcast { .. } => "broadcast",
            Op::AllGather { .. } => "all_gather",
            Op::BroadcastAsync { .. } => "broadcast_device",
            Op::AllGatherAsync { .. } => "all_gather_device",
            Op::Abort { .. } => "abort",
        }
    }
}

/// What a completed request gives back.
pub(crate) enum Reply {
    /// Done; with timing on, the device time of the NCCL call.
    Done { device_ms: Option<f32> },
    /// Enqueued; the event completes with the operation.
    Event(Arc<CudaLayerEvent>),
}

pub(crate) struct Request {
    pub(crate) seq: u64,
    pub(crate) op: Op,
    pub(crate) deadline: Instant,
    pub(crate) reply: mpsc::SyncSender<Result<Reply, CollectiveError>>,
}

/// An abort the handle asked for, from any thread. The comm thread looks at it while it waits
/// for an operation (every poll), not only between requests, so an abort ends an operation
/// already in flight at once instead of after that operation's deadline.
#[derive(Debug, Default)]
pub(crate) struct AbortRequest {
    asked: AtomicBool,
    cause: parking_lot::Mutex<Option<String>>,
}

impl AbortRequest {
    /// Asks for the abort (the first cause is kept).
    pub(crate) fn ask(&self, cause: &str) {
        self.cause.lock().get_or_insert_with(|| cause.to_string());
        self.asked.store(true, Ordering::Release);
    }

    /// The cause, once an abort was asked for.
    pub(crate) fn asked(&self) -> Option<String> {
        if !self.asked.load(Ordering::Acquire) {
            return None;
        }
        Some(self.cause.lock().clone().unwrap_or_default())
    }
}

/// Who this thread is.
pub(crate) struct Setup {
    pub(crate) rank: u32,
    pub(crate) size: u32,
    pub(crate) ordinal: u32,
    pub(crate) id: sys::ncclUniqueId,
    pub(crate) config: NcclConfig,
    pub(crate) init_deadline: Instant,
    /// Where the worker says that its communicator was aborted (the handle's `broken`).
    pub(crate) broken: Arc<parking_lot::Mutex<Option<String>>>,
    /// Where the handle asks for an abort.
    pub(crate) interrupt: Arc<AbortRequest>,
    /// The flag the handles of one in-process group share: set with `broken`, so that the
    /// peers of a communicator this thread aborted by itself (a timeout, an NCCL error, a
    /// panic) stop issuing operations their group can no longer complete.
    pub(crate) group: Arc<parking_lot::Mutex<Option<String>>>,
    /// Where the worker says that its communicator was aborted and its comm stream drained
    /// after the abort: no operation of this handle can still touch the device (see
    /// [`Worker::abort_comm`]).
    pub(crate) quiet: Arc<AtomicBool>,
}

/// `ncclConfig_t` as NCCL 2.17 laid it out. NCCL reads the leading `size` field and copies
/// only `min(size, its own sizeof)` bytes, then applies defaults for every field newer than
/// `version` (NCCL's documented backward compatibility), so this prefix works with the 2.28
/// library on the H200 machine as with later ones, whatever bindings cudarc was built with.
#[repr(C)]
struct NcclConfigV217 {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;

/// The smallest scratch and pinned stage (bytes): both are allocated at this size when the
/// comm thread starts, and grown (to a power of two) only by an operation larger than them.
const MIN_BUFFER: usize = 1 << 16;

impl NcclConfigV217 {
    fn non_blocking() -> Self {
        NcclConfigV217 {
            size: std::mem::size_of::<Self>(),
            magic: 0xcafe_beef,
            version: 21_700,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
            min_ctas: NCCL_CONFIG_UNDEF_INT,
            max_ctas: NCCL_CONFIG_UNDEF_INT,
            net_name: std::ptr::null(),
            split_share: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

/// Why an operation failed inside the worker.
enum Fail {
    /// The deadline passed with the operation not finished.
    Deadline,
    /// Anything else, already as the error to report.
    Error(CollectiveError),
    /// The handle asked for an abort while the operation was in flight (the cause).
    Interrupted(String),
}

pub(crate) struct Worker {
    rank: u32,
    size: u32,
    ordinal: u32,
    device: Arc<CudaDevice>,
    stream: Arc<CudaStream>,
    comm: sys::ncclComm_t,
    non_blocking: bool,
    timing: bool,
    grace: Duration,
    scratch: Option<DeviceBuffer>,
    /// Pinned host memory that a host span's bytes are copied through on their way to the
    /// scratch (an asynchronous copy on the comm stream needs pinned memory of ours).
    host_stage: Option<PinnedBuffer>,
    /// Scratch and stages outgrown by a larger host operation, kept until the worker ends:
    /// freeing them mid-run (`cuMemFree`, `cuMemFreeHost`) synchronizes the device, which
    /// in an in-process group can wait behind a peer's kernel that waits for this rank.
    /// Power-of-two growth keeps them under the current buffer's size in all.
    retired: Retired,
    /// Recorded after the last work enqueued on the comm stream.
    last: Option<Arc<CudaLayerEvent>>,
    /// Set once the communicator was aborted; every later operation fails with it.
    aborted: Option<String>,
    /// The handle's view of `aborted`.
    broken: Arc<parking_lot::Mutex<Option<String>>>,
    /// An abort the handle asked for.
    interrupt: Arc<AbortRequest>,
    /// The in-process group's shared flag (see [`Setup::group`]).
    group: Arc<parking_lot::Mutex<Option<String>>>,
    /// The handle's view of a drained abort (`Setup::quiet`).
    quiet: Arc<AtomicBool>,
}

/// Buffers a worker outgrew (see `Worker::retired`).
#[derive(Default)]
struct Retired {
    scratch: Vec<DeviceBuffer>,
    stages: Vec<PinnedBuffer>,
}

/// A failed driver call of the worker, keeping the driver's error as the source.
fn driver(call: &'static str, source: cudarc::driver::DriverError) -> CollectiveError {
    cerr(kv_device::DeviceError::Cuda { call, source })
}

fn cerr(source: kv_device::DeviceError) -> CollectiveError {
    CollectiveError::Device {
        what: "NCCL worker",
        source,
    }
}

/// Fault injection (feature `failpoints`): "nccl-buffers" set to `return(why)` fails the
/// allocation of a starting rank's scratch, before it joins its communicator.
fn injected_buffer_failure() -> Result<(), CollectiveError> {
    #[cfg(feature = "failpoints")]
    fail::fail_point!("nccl-buffers", |why: Option<String>| Err(
        CollectiveError::Backend(format!(
            "allocating the scratch: injected failure ({})",
            why.unwrap_or_default()
        ))
    ));
    Ok(())
}

impl Worker {
    /// Opens the device, the comm stream and the communicator (waiting for every rank up to
    /// `init_deadline`).
    pub(crate) fn start(s: &Setup) -> Result<Worker, CollectiveError> {
        let device = CudaDevice::new(s.ordinal).map_err(cerr)?;
        device.bind().map_err(cerr)?;
        // kvlink's handle (cudarc's event tracking off): a new stream in it does not
        // synchronize the context the engine shares.
        // SAFETY: no `CudaSlice` is made through it or the comm stream: the worker's memory is
        // raw (`DeviceBuffer`, `PinnedBuffer`, the landing's staging), ordered by events.
        let stream = unsafe { device.untracked_context() }
            .new_stream()
            .map_err(|e| driver("cuStreamCreate (comm stream)", e))?;
        let mut w = Worker {
            rank: s.rank,
            size: s.size,
            ordinal: s.ordinal,
            device,
            stream,
            comm: std::ptr::null_mut(),
            non_blocking: s.config.non_blocking,
            timing: s.config.timing,
            grace: s.config.abort_grace,
            scratch: None,
            host_stage: None,
            retired: Retired::default(),
            last: None,
            aborted: None,
            broken: s.broken.clone(),
            interrupt: s.interrupt.clone(),
            group: s.group.clone(),
            quiet: s.quiet.clone(),
        };
        // The scratch and the stage of the small operations (a gate's words, a lookup's
        // hits) are allocated before this rank joins the communicator. A rank that cannot
        // allocate them then never joins: its peers' initialisation fails at its deadline
        // with this rank's, and no rank's join returns `Ok` for a group that cannot work.
        // (Allocated after the join, a failure here left the peers formed, to fail their
        // first batch instead.) Allocated inside the first operation, after the peers may
        // have launched theirs, the driver could order the allocation after their kernels
        // on this GPU (the two communicators of a rank share it), which wait for this rank.
        let buffers = injected_buffer_failure()
            .and_then(|()| w.scratch(MIN_BUFFER))
            .and_then(|_| match w.stage(MIN_BUFFER) {
                Ok(_) => Ok(()),
                Err(Fail::Error(e)) => Err(e),
                Err(Fail::Deadline | Fail::Interrupted(_)) => Err(CollectiveError::Backend(
                    "allocating the pinned stage ended without an error".into(),
                )),
            });
        if let Err(e) = buffers {
            w.abort_comm("allocating the scratch failed");
            return Err(e);
        }
        w.init_comm(s)?;
        Ok(w)
    }

    fn init_comm(&mut self, s: &Setup) -> Result<(), CollectiveError> {
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        if self.non_blocking && env_forces_blocking() {
            // NCCL takes the variable over the config: its init would block until every rank
            // joined, past every deadline and give-up request of this mode.
            return Err(CollectiveError::Backend(
                "NCCL_COMM_BLOCKING=1 in the environment makes NCCL's calls blocking, which \
                 the non-blocking mode's deadlines cannot bound: unset it, or choose \
                 NcclConfig { non_blocking: false, .. }"
                    .into(),
            ));
        }
        if self.non_blocking {
            let mut cfg = NcclConfigV217::non_blocking();
            // SAFETY: `comm` is a valid out-pointer; `cfg` is a properly initialised config
            // prefix whose `size` field tells NCCL how many bytes to read (see
            // NcclConfigV217); it outlives the call (NCCL copies it). The device is current.
            let r = unsafe {
                sys::ncclCommInitRankConfig(
                    &mut comm,
                    s.size as c_int,
                    s.id,
                    s.rank as c_int,
                    (&mut cfg as *mut NcclConfigV217).cast::<sys::ncclConfig_t>(),
                )
            };
            self.comm = comm;
            match r {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
                e => {
                    let err = nccl_error("ncclCommInitRankConfig", e, comm);
                    self.abort_comm("initialisation failed");
                    return Err(err);
                }
            }
            match self.settle("ncclCommInitRankConfig", s.init_deadline) {
                Ok(()) => Ok(()),
                Err(Fail::Deadline) => {
                    self.abort_comm("initialisation timed out");
                    Err(CollectiveError::Timeout {
                        op: "init",
                        seq: 0,
                        missing: Vec::new(),
                    })
                }
                Err(Fail::Error(e)) => {
                    self.abort_comm("initialisation failed");
                    Err(e)
                }
                Err(Fail::Interrupted(cause)) => {
                    self.abort_comm(&cause);
                    Err(CollectiveError::Aborted {
                        op: "init",
                        seq: 0,
                        missing: Vec::new(),
                        cause,
                    })
                }
            }
        } else {
            // SAFETY: `comm` is a valid out-pointer; blocking init returns when every rank
            // joined (no deadline: this mode is the documented fallback).
            let r =
                unsafe { sys::ncclCommInitRank(&mut comm, s.size as c_int, s.id, s.rank as c_int) };
            // NCCL frees the communicator of a failed start and returns null today; should a
            // version hand one back, it is aborted here as the non-blocking branch does.
            self.comm = comm;
            if r != sys::ncclResult_t::ncclSuccess {
                let err = nccl_error("ncclCommInitRank", r, comm);
                self.abort_comm("initialisation failed");
                return Err(err);
            }
            Ok(())
        }
    }

    /// Waits until the communicator has no NCCL call in progress (non-blocking mode).
    fn settle(&self, call: &'static str, deadline: Instant) -> Result<(), Fail> {
        if !self.non_blocking {
            return Ok(());
        }
        let mut spins = 0u32;
        loop {
            let mut state = sys::ncclResult_t::ncclInProgress;
            // SAFETY: `comm` is our live communicator; `state` a valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess {
                return Err(Fail::Error(nccl_error(
                    "ncclCommGetAsyncError",
                    r,
                    self.comm,
                )));
            }
            match state {
                sys::ncclResult_t::ncclSuccess => return Ok(()),
                sys::ncclResult_t::ncclInProgress => {}
                e => return Err(Fail::Error(nccl_error(call, e, self.comm))),
            }
            self.check_interrupt()?;
            if Instant::now() >= deadline {
                return Err(Fail::Deadline);
            }
            spins = spins.saturating_add(1);
            if spins < 128 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }

    /// `Fail::Interrupted` once the handle asked for an abort.
    fn check_interrupt(&self) -> Result<(), Fail> {
        match self.interrupt.asked() {
            Some(cause) => Err(Fail::Interrupted(cause)),
            None => Ok(()),
        }
    }

    /// Checks the result of an enqueue call, then settles it.
    fn enqueued(
        &self,
        call: &'static str,
        r: sys::ncclResult_t,
        deadline: Instant,
    ) -> Result<(), Fail> {
        match r {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            sys::ncclResult_t::ncclInProgress => self.settle(call, deadline),
            e => Err(Fail::Error(nccl_error(call, e, self.comm))),
        }
    }

    /// Waits for `ev` up to `deadline`, watching the communicator for asynchronous errors
    /// (a peer that failed) while waiting.
    fn complete(&self, ev: &CudaLayerEvent, deadline: Instant) -> Result<(), Fail> {
        let mut spins = 0u32;
        loop {
            if ev.is_complete().map_err(|e| Fail::Error(cerr(e)))? {
                return Ok(());
            }
            let mut state = sys::ncclResult_t::ncclSuccess;
            // SAFETY: live communicator, valid out-pointer.
            let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if r != sys::ncclResult_t::ncclSuccess {
                // The query itself failed: the communicator cannot be watched, so the wait
                // fails now rather than at its deadline.
                return Err(Fail::Error(nccl_error(
                    "ncclCommGetAsyncError",
                    r,
                    self.comm,
                )));
            }
            if state != sys::ncclResult_t::ncclSuccess && state != sys::ncclResult_t::ncclInProgress
            {
                return Err(Fail::Error(nccl_error(
                    "asynchronous NCCL error",
                    state,
                    self.comm,
                )));
            }
            self.check_interrupt()?;
            if Instant::now() >= deadline {
                return Err(Fail::Deadline);
            }
            spins = spins.saturating_add(1);
            if spins < 64 {
                std::hint::spin_loop();
            } else if spins < 256 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(20));
            }
        }
    }

    /// Aborts the communicator (ncclCommAbort also stops NCCL kernels still waiting for a
    /// peer), then waits a bounded time for the comm stream to drain.
    fn abort_comm(&mut self, cause: &str) {
        for flag in [&self.broken, &self.group] {
            flag.lock()
                .get_or_insert_with(|| format!("rank {}: {cause}", self.rank));
        }
        if self.comm.is_null() {
            self.aborted.get_or_insert_with(|| cause.to_string());
            return;
        }
        tracing::warn!(rank = self.rank, cause, "aborting the NCCL communicator");
        // SAFETY: `comm` is our live communicator; it is aborted once and nulled.
        let r = unsafe { sys::ncclCommAbort(self.comm) };
        if r != sys::ncclResult_t::ncclSuccess {
            tracing::warn!(rank = self.rank, code = ?r, "ncclCommAbort failed");
        }
        self.comm = std::ptr::null_mut();
        self.aborted.get_or_insert_with(|| cause.to_string());
        let drained = CudaLayerEvent::record_on(&self.stream, u32::MAX)
            .and_then(|ev| ev.wait_until(kv_loader::deadline_after(self.grace)));
        if matches!(drained, Ok(true)) {
            // Every operation ran on the comm stream, which is now idle, and none runs after
            // an abort: the regions of operations that failed are free of NCCL's work (told
            // before the failed operation's reply, which follows this call).
            self.quiet.store(true, Ordering::Release);
        } else {
            let bytes = self.scratch.as_ref().map_or(0, DeviceBuffer::len)
                + self.host_stage.as_ref().map_or(0, PinnedBuffer::len)
                + self
                    .retired
                    .scratch
                    .iter()
                    .map(DeviceBuffer::len)
                    .sum::<usize>()
                + self
                    .retired
                    .stages
                    .iter()
                    .map(PinnedBuffer::len)
                    .sum::<usize>();
            tracing::error!(
                rank = self.rank,
                bytes,
                "comm stream not known to be idle after ncclCommAbort; its buffers may still be in use: leaking the scratch"
            );
            crate::kept::count_kept(bytes as u64);
            std::mem::forget(self.scratch.take());
            std::mem::forget(self.host_stage.take());
            std::mem::forget(std::mem::take(&mut self.retired));
        }
        self.last = None;
    }

    /// A device scratch buffer of at least `len` bytes (for host buffers).
    fn scratch(&mut self, len: usize) -> Result<u64, CollectiveError> {
        if self.scratch.as_ref().is_none_or(|b| b.len() < len) {
            if let Some(old) = self.scratch.take() {
                self.retired.scratch.push(old);
            }
            let cap = len.max(MIN_BUFFER).next_power_of_two();
            self.scratch = Some(
                DeviceBuffer::alloc(self.device.context(), cap, "NCCL host-op scratch")
                    .map_err(cerr)?,
            );
        }
        Ok(self.scratch.as_ref().map_or(0, |b| b.ptr()))
    }

    fn invalid(&self, op: &'static str, seq: u64, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op,
            seq,
            rank: self.rank,
            reason,
        }
    }

    /// `Some(is_host)` for a buffer this rank can move, or the error.
    fn residence(&self, op: &'static str, seq: u64, b: &Span) -> Result<bool, CollectiveError> {
        match b.residence {
            Residence::Host => Ok(true),
            Residence::Device { ordinal } if ordinal == self.ordinal => Ok(false),
            Residence::Device { ordinal } => Err(self.invalid(
                op,
                seq,
                format!(
                    "buffer on GPU {ordinal}, but this rank's communicator is on GPU {}",
                    self.ordinal
                ),
            )),
        }
    }

    fn stream(&self) -> sys::cudaStream_t {
        self.stream.cu_stream() as sys::cudaStream_t
    }

    fn timer(&self) -> Option<(CudaEvent, CudaEvent)> {
        if !self.timing {
            return None;
        }
        // SAFETY: events only (timing the comm stream): no `CudaSlice`.
        let ctx = unsafe { self.device.untracked_context() };
        let flags = Some(cu::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(flags).ok()?;
        let end = ctx.new_event(flags).ok()?;
        start.record(&self.stream).ok()?;
        Some((start, end))
    }

    /// Waits for the previous asynchronous operation (so host copies never block on it).
    fn drain_last(&mut self, deadline: Instant) -> Result<(), Fail> {
        if let Some(ev) = self.last.take() {
            self.complete(&ev, deadline)?;
        }
        Ok(())
    }

    fn record(&mut self, tag: u32) -> Result<Arc<CudaLayerEvent>, Fail> {
        let ev = CudaLayerEvent::record_on(&self.stream, tag).map_err(|e| Fail::Error(cerr(e)))?;
        self.last = Some(ev.clone());
        Ok(ev)
    }

    /// Copies the caller's host bytes to the device scratch `dst`, ordered on the comm stream
    /// before the NCCL operation that reads them. The bytes go through our pinned stage: a
    /// synchronous `cuMemcpyHtoD` runs on the legacy default stream, which the non-blocking
    /// comm stream is not ordered after (and from pageable memory it returns before the DMA
    /// has landed); an asynchronous copy straight from the caller's memory could still read
    /// it after a timed-out call returned. The caller's bytes are read by this thread only.
    fn h2d(&mut self, dst: u64, src: usize, len: usize) -> Result<(), Fail> {
        if len == 0 {
            return Ok(());
        }
        let stage = self.stage(len)?;
        // SAFETY: `src` is the caller's host buffer valid for reads of `len` bytes for the
        // call (Collective's memory rules); `stage` is our pinned buffer of at least `len`
        // bytes, which no copy still reads (every earlier operation's copy on the comm stream
        // completed: `drain_last` ran before this, or the comm was aborted and drained, or its
        // stage leaked).
        unsafe { std::ptr::copy_nonoverlapping(src as *const u8, stage as *mut u8, len) };
        // SAFETY: `stage` holds `len` bytes that stay ours and unchanged until the next
        // operation, which first waits for this one; `dst` is our scratch of at least `len`
        // bytes. The copy is ordered on the comm stream before the NCCL call.
        unsafe {
            cu::cuMemcpyHtoDAsync_v2(dst, stage as *const c_void, len, self.stream.cu_stream())
        }
        .result()
        .map_err(|e| Fail::Error(driver("cuMemcpyHtoDAsync", e)))
    }

    /// Our pinned stage, grown to hold at least `len` bytes; its address. Only called with no
    /// copy on the comm stream still using the stage (see [`h2d`](Self::h2d)).
    fn stage(&mut self, len: usize) -> Result<usize, Fail> {
        if self.host_stage.as_ref().is_none_or(|b| b.len() < len) {
            if let Some(old) = self.host_stage.take() {
                self.retired.stages.push(old);
            }
            let cap = len.max(MIN_BUFFER).next_power_of_two();
            self.host_stage = Some(
                PinnedBuffer::zeroed(self.device.context(), cap, "NCCL host-op stage")
                    .map_err(|e| Fail::Error(cerr(e)))?,
            );
        }
        Ok(self.host_stage.as_ref().map_or(0, |b| b.addr()))
    }

    /// Copies `len` result bytes of operation `seq` from the device scratch `src` to the
    /// caller's host buffer `dst`, bounded by `deadline`. The bytes come through our pinned
    /// stage on the comm stream: a synchronous `cuMemcpyDtoH` runs on the legacy default
    /// stream, which waits for every blocking stream of the context, so an engine's long kernel
    /// (or a stream waiting on a layer event) would hold it with no deadline and no way to
    /// abort it. The caller's buffer is written here, on the CPU, only once the copy has
    /// completed. The stage is pinned memory the size of the largest result so far (for a
    /// host all-gather, every rank's part), kept for the handle's life; growing it allocates
    /// pinned memory, which the driver may order after work on the context.
    fn d2h(
        &mut self,
        (dst, src, len): (usize, u64, usize),
        seq: u64,
        deadline: Instant,
    ) -> Result<(), Fail> {
        if len == 0 {
            return Ok(());
        }
        let stage = self.stage(len)?;
        // SAFETY: `src` is our scratch holding the result (the NCCL operation completed),
        // valid for `len` bytes; `stage` is our pinned buffer of at least `len` bytes, which
        // no other copy uses (every earlier copy on the comm stream completed: the NCCL
        // operation's event, recorded after them, did). The stage stays ours until this copy
        // completes: if the wait below fails, the operation fails and the communicator is
        // aborted, which drains the comm stream or leaks the stage (`abort_comm`).
        unsafe {
            cu::cuMemcpyDtoHAsync_v2(stage as *mut c_void, src, len, self.stream.cu_stream())
        }
        .result()
        .map_err(|e| Fail::Error(driver("cuMemcpyDtoHAsync", e)))?;
        let ev = self.record(seq as u32)?;
        self.complete(&ev, deadline)?;
        self.last = None;
        // SAFETY: the copy into `stage` completed; `dst` is the caller's host buffer valid
        // for writes of `len` bytes for the call (Collective's memory rules), read or written
        // by this thread only, and distinct from our stage.
        unsafe { std::ptr::copy_nonoverlapping(stage as *const u8, dst as *mut u8, len) };
        Ok(())
    }

    fn run(&mut self, op: Op, seq: u64, deadline: Instant) -> Result<Reply, Fail> {
        let name = op.name();
        if let Op::Abort { cause } = op {
            self.abort_comm(&cause);
            return Ok(Reply::Done { device_ms: None });
        }
        // An abort asked for while this thread was idle, or between the handle's request and
        // its `Op::Abort`: done before anything else runs.
        if self.aborted.is_none() {
            if let Some(cause) = self.interrupt.asked() {
                self.abort_comm(&cause);
            }
        }
        if let Some(cause) = &self.aborted {
            return Err(Fail::Error(CollectiveError::Aborted {
                op: name,
                seq,
                missing: Vec::new(),
                cause: format!("the NCCL communicator was aborted earlier: {cause}"),
            }));
        }
        self.device.bind().map_err(|e| Fail::Error(cerr(e)))?;
        // Fault injection (feature `failpoints`): "nccl-comm-op" set to `panic` makes the comm
        // thread panic here, as a defect under an operation would.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("nccl-comm-op");
        match op {
            Op::Broadcast { buf, root } => self.broadcast(name, seq, buf, root, deadline),
            Op::AllGather { send, recv } => self.all_gather(name, seq, send, recv, deadline),
            Op::BroadcastAsync { buf, root, after } => {
                self.broadcast_async(name, seq, buf, root, after, deadline)
            }
            Op::AllGatherAsync { send, recv, after } => {
                self.all_gather_async(name, seq, send, recv, after, deadline)
            }
            Op::Abort { .. } => Ok(Reply::Done { device_ms: None }),
        }
    }

    fn check_root(&self, op: &'static str, seq: u64, root: u32) -> Result<(), Fail> {
        if root >= self.size {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                format!("root {root} is not a rank of a group of {}", self.size),
            )));
        }
        Ok(())
    }

    fn broadcast(
        &mut self,
        op: &'static str,
        seq: u64,
        buf: Span,
        root: u32,
        deadline: Instant,
    ) -> Result<Reply, Fail> {
        self.check_root(op, seq, root)?;
        let host = self.residence(op, seq, &buf).map_err(Fail::Error)?;
        self.drain_last(deadline)?;
        let (ptr, count) = if buf.len == 0 {
            // NCCL discards an empty collective without meeting any peer: one byte of
            // scratch moves instead, so a rank alone still waits for its peers.
            (self.scratch(1).map_err(Fail::Error)?, 1)
        } else if host {
            let s = self.scratch(buf.len).map_err(Fail::Error)?;
            if self.rank == root {
                self.h2d(s, buf.addr, buf.len)?;
            }
            (s, buf.len)
        } else {
            (buf.addr as u64, buf.len)
        };
        let timer = self.timer();
        // SAFETY: `ptr` is device memory of this rank's GPU valid for `count` bytes (the
        // caller's device buffer under the Collective memory contract, or our scratch of at
        // least 64 KiB); the broadcast is in place (NCCL allows sendbuff == recvbuff); the
        // comm and stream are ours and live.
        let r = unsafe {
            sys::ncclBroadcast(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                root as c_int,
                self.comm,
                self.stream(),
            )
        };
        self.enqueued("ncclBroadcast", r, deadline)?;
        if let Some((_, end)) = &timer {
            let _ = end.record(&self.stream);
        }
        let ev = self.record(seq as u32)?;
        self.complete(&ev, deadline)?;
        self.last = None;
        if host && self.rank != root && buf.len > 0 {
            self.d2h((buf.addr, ptr, buf.len), seq, deadline)?;
        }
        Ok(Reply::Done {
            device_ms: timer.and_then(|(s, e)| s.elapsed_ms(&e).ok()),
        })
    }

    fn all_gather(
        &mut self,
        op: &'static str,
        seq: u64,
        send: Span,
        recv: Span,
        deadline: Instant,
    ) -> Result<Reply, Fail> {
        let n = send.len;
        let size = self.size as usize;
        if n.checked_mul(size) != Some(recv.len) {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                format!("recv holds {} bytes, not {size} × {n}", recv.len),
            )));
        }
        let send_host = self.residence(op, seq, &send).map_err(Fail::Error)?;
        let recv_host = self.residence(op, seq, &recv).map_err(Fail::Error)?;
        if send_host != recv_host {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                "send and recv must both be host or both device memory".into(),
            )));
        }
        let in_place = recv.addr.checked_add(self.rank as usize * n) == Some(send.addr);
        if send.overlaps(&recv) && !in_place {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                "send overlaps recv without being this rank's slot of it".into(),
            )));
        }
        self.drain_last(deadline)?;
        let (sptr, rptr, count) = if n == 0 {
            // As in `broadcast`: one byte per rank of scratch, so that the ranks meet.
            let s = self.scratch(size).map_err(Fail::Error)?;
            (s + self.rank as u64, s, 1)
        } else if send_host {
            let s = self.scratch(recv.len).map_err(Fail::Error)?;
            let mine = s + (self.rank as usize * n) as u64;
            self.h2d(mine, send.addr, n)?;
            (mine, s, n)
        } else {
            (send.addr as u64, recv.addr as u64, n)
        };
        let timer = self.timer();
        // SAFETY: `sptr` holds `count` readable bytes and `rptr` `size * count` writable bytes
        // of this rank's GPU (the caller's device buffers under the Collective contract, or
        // our scratch of at least 64 KiB, in place at this rank's slot as NCCL allows); comm
        // and stream are ours.
        let r = unsafe {
            sys::ncclAllGather(
                sptr as *const c_void,
                rptr as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                self.stream(),
            )
        };
        self.enqueued("ncclAllGather", r, deadline)?;
        if let Some((_, end)) = &timer {
            let _ = end.record(&self.stream);
        }
        let ev = self.record(seq as u32)?;
        self.complete(&ev, deadline)?;
        self.last = None;
        if recv_host && n > 0 {
            self.d2h((recv.addr, rptr, recv.len), seq, deadline)?;
        }
        Ok(Reply::Done {
            device_ms: timer.and_then(|(s, e)| s.elapsed_ms(&e).ok()),
        })
    }

    fn broadcast_async(
        &mut self,
        op: &'static str,
        seq: u64,
        buf: Span,
        root: u32,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<Reply, Fail> {
        self.check_root(op, seq, root)?;
        if self.residence(op, seq, &buf).map_err(Fail::Error)? {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                "an asynchronous broadcast moves device memory only".into(),
            )));
        }
        if let Some(ev) = &after {
            self.wait_after(op, seq, ev)?;
        }
        // An empty region moves one byte of scratch, as in `broadcast`. The scratch stays
        // until a host operation replaces it, and every host operation drains this one first.
        let (ptr, count) = if buf.len == 0 {
            (self.scratch(1).map_err(Fail::Error)?, 1)
        } else {
            (buf.addr as u64, buf.len)
        };
        // SAFETY: `ptr` is device memory of this rank's GPU valid for `count` bytes until
        // the returned event completes (the caller's contract for broadcast_device, or our
        // scratch, freed only after a drain of this operation); in place; comm and stream are
        // ours.
        let r = unsafe {
            sys::ncclBroadcast(
                ptr as *const c_void,
                ptr as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                root as c_int,
                self.comm,
                self.stream(),
            )
        };
        self.enqueued("ncclBroadcast", r, deadline)?;
        Ok(Reply::Event(self.record(seq as u32)?))
    }

    fn all_gather_async(
        &mut self,
        op: &'static str,
        seq: u64,
        send: Span,
        recv: Span,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<Reply, Fail> {
        let n = send.len;
        if n.checked_mul(self.size as usize) != Some(recv.len) {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                format!("recv holds {} bytes, not {} × {n}", recv.len, self.size),
            )));
        }
        let send_host = self.residence(op, seq, &send).map_err(Fail::Error)?;
        let recv_host = self.residence(op, seq, &recv).map_err(Fail::Error)?;
        if send_host || recv_host {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                "an asynchronous all-gather moves device memory only".into(),
            )));
        }
        let in_place = recv.addr.checked_add(self.rank as usize * n) == Some(send.addr);
        if send.overlaps(&recv) && !in_place {
            return Err(Fail::Error(self.invalid(
                op,
                seq,
                "send overlaps recv without being this rank's slot of it".into(),
            )));
        }
        if let Some(ev) = &after {
            self.wait_after(op, seq, ev)?;
        }
        // Empty: one byte per rank of scratch, as in `broadcast_async`.
        let (sptr, rptr, count) = if n == 0 {
            let s = self.scratch(self.size as usize).map_err(Fail::Error)?;
            (s + u64::from(self.rank), s, 1)
        } else {
            (send.addr as u64, recv.addr as u64, n)
        };
        // SAFETY: `sptr` (count bytes) and `rptr` (size × count bytes) are device memory of
        // this rank's GPU, valid and untouched by other work until the returned event
        // completes (the caller's contract for all_gather_device, or our scratch of at least
        // 64 KiB, freed only after a drain of this operation); in place or disjoint
        // (checked); comm and stream are ours.
        let r = unsafe {
            sys::ncclAllGather(
                sptr as *const c_void,
                rptr as *mut c_void,
                count,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                self.stream(),
            )
        };
        self.enqueued("ncclAllGather", r, deadline)?;
        Ok(Reply::Event(self.record(seq as u32)?))
    }

    /// Makes the comm stream wait for `ev` (a CUDA event; anything else is refused).
    fn wait_after(&self, op: &'static str, seq: u64, ev: &SharedEvent) -> Result<(), Fail> {
        match ev.as_any().downcast_ref::<CudaLayerEvent>() {
            Some(ev) => ev.wait_on(&self.stream).map_err(|e| Fail::Error(cerr(e))),
            None => Err(Fail::Error(self.invalid(
                op,
                seq,
                format!("`after` is not a CUDA event: {ev:?}"),
            ))),
        }
    }

    /// Serves requests until the handle is dropped, then tears the communicator down.
    pub(crate) fn serve(mut self, rx: mpsc::Receiver<Request>) {
        while let Ok(req) = rx.recv() {
            let name = req.op.name();
            // A panic under the operation (a defect) aborts the communicator here, before the
            // caller hears of it, and is answered like any failure: the handle then names the
            // panic (`broken`), its later calls fail at once, and its close joins this thread.
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                self.run(req.op, req.seq, req.deadline)
            }));
            let ran = ran.unwrap_or_else(|payload| {
                let what = kv_loader::Cause::from_panic(payload.as_ref());
                let cause = format!(
                    "the comm thread panicked during {name} #{}: {what}",
                    req.seq
                );
                tracing::error!(rank = self.rank, cause, "aborting the NCCL communicator");
                self.abort_comm(&cause);
                Err(Fail::Error(CollectiveError::Backend(format!(
                    "rank {}: {cause}; the communicator was aborted",
                    self.rank
                ))))
            });
            let result = match ran {
                Ok(r) => Ok(r),
                Err(Fail::Error(e)) => {
                    // A refused argument (`InvalidArgument`) issued nothing and leaves the
                    // communicator as it was; the caller decides (see `Collective`'s docs: a
                    // caller that goes on after a refusal its peers did not share aborts the
                    // group, as the linker does for every failed step). Anything else aborts.
                    if !matches!(e, CollectiveError::InvalidArgument { .. }) {
                        self.abort_comm(&format!("{name} #{} failed: {e}", req.seq));
                    }
                    Err(e)
                }
                Err(Fail::Deadline) => {
                    self.abort_comm(&format!("{name} #{} timed out", req.seq));
                    Err(CollectiveError::Timeout {
                        op: name,
                        seq: req.seq,
                        missing: Vec::new(),
                    })
                }
                Err(Fail::Interrupted(cause)) => {
                    tracing::warn!(
                        rank = self.rank,
                        op = name,
                        seq = req.seq,
                        cause,
                        "abort asked for with the operation in flight: it ends now"
                    );
                    self.abort_comm(&cause);
                    Err(CollectiveError::Aborted {
                        op: name,
                        seq: req.seq,
                        missing: Vec::new(),
                        cause: format!("aborted in flight: {cause}"),
                    })
                }
            };
            let _ = req.reply.send(result);
        }
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if self.comm.is_null() {
            return;
        }
        let _ = self.device.bind();
        if let Some(cause) = self.interrupt.asked() {
            // Asked for and not yet done (the request came after the last operation): a
            // communicator whose group gave up is aborted, not finalized with its peers.
            self.abort_comm(&cause);
            return;
        }
        let deadline = kv_loader::deadline_after(self.grace);
        if self.drain_last(deadline).is_err() {
            self.abort_comm("closing with an operation still in flight");
            return;
        }
        // SAFETY: live communicator with no operation in flight (drained above).
        let r = unsafe { sys::ncclCommFinalize(self.comm) };
        let finalized = match r {
            sys::ncclResult_t::ncclSuccess => true,
            sys::ncclResult_t::ncclInProgress => self.settle("ncclCommFinalize", deadline).is_ok(),
            _ => false,
        };
        if !finalized {
            self.abort_comm("ncclCommFinalize did not complete");
            return;
        }
        // SAFETY: finalized communicator, destroyed once and nulled.
        let r = unsafe { sys::ncclCommDestroy(self.comm) };
        if r != sys::ncclResult_t::ncclSuccess {
            tracing::warn!(rank = self.rank, code = ?r, "ncclCommDestroy failed");
        }
        self.comm = std::ptr::null_mut();
    }
}

/// A comm thread that unwinds (a panic outside an operation, which `serve` catches itself: in
/// `start` or `shutdown`) still ends its communicator: it is aborted (this rank's kernels end;
/// a peer waiting on this rank fails by its own deadline, as with any aborted peer), and the
/// handle's `broken()` gives the cause. After `shutdown` the communicator is null and this
/// does nothing.
impl Drop for Worker {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return;
        }
        let cause = if std::thread::panicking() {
            "the comm thread panicked"
        } else {
            "the comm thread ended without closing its communicator"
        };
        tracing::error!(rank = self.rank, cause, "aborting the NCCL communicator");
        let _ = self.device.bind();
        self.abort_comm(cause);
    }
}

/// `NCCL_COMM_BLOCKING` set to a true value: NCCL's `envConfigOverride` then makes every
/// communicator blocking whatever its config asks. NCCL reads the value with `strtol` (base
/// 0), so `01`, `0x1` and `+1` count as 1 too, into an `int` (so `4294967297` is 1 as
/// well; a value past 64 bits is refused there, as 0 is here). (A value from `/etc/nccl.conf` or
/// `NCCL_CONF_FILE` is not seen here: NCCL's init then blocks, bounded only by the caller's
/// wait for the comm thread, which leaves that thread behind.)
fn env_forces_blocking() -> bool {
    std::env::var("NCCL_COMM_BLOCKING").is_ok_and(|v| strtol_base0(&v) as i32 == 1)
}

/// The number C's `strtol(s, NULL, 0)` reads from `s`: leading blanks, a sign, then `0x`
/// (hex), `0` (octal) or decimal digits, up to the first other character; 0 when none (and
/// when the number does not fit 64 bits).
fn strtol_base0(s: &str) -> i64 {
    // C's `isspace`, not Unicode's white space.
    let s = s.trim_start_matches([' ', '\t', '\n', '\u{0b}', '\u{0c}', '\r']);
    let (negative, s) = match s.as_bytes().first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let (radix, digits) = if let Some(hex) = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        (16, hex)
    } else if s.len() > 1 && s.starts_with('0') {
        (8, &s[1..])
    } else {
        (10, s)
    };
    let end = digits
        .find(|c: char| !c.is_digit(radix))
        .unwrap_or(digits.len());
    let value = i64::from_str_radix(&digits[..end], radix).unwrap_or(0);
    if negative {
        -value
    } else {
        value
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `NCCL_COMM_BLOCKING=01` (or `0x1`, `+1`) forced blocking mode past the check, which
    /// matched the text "1" only.
    #[test]
    fn blocking_values_read_as_nccl_reads_them() {
        for (v, n) in [
            ("1", 1),
            ("01", 1),
            ("0x1", 1),
            ("+1", 1),
            (" 1", 1),
            ("1abc", 1),
            ("0", 0),
            ("", 0),
            ("true", 0),
            ("-1", -1),
            ("010", 8),
            ("0x", 0),
            ("\u{a0}1", 0),
            ("\u{0b}1", 1),
            ("4294967297", 4294967297),
        ] {
            assert_eq!(strtol_base0(v), n, "{v:?}");
        }
        // NCCL keeps the value in an `int`.
        assert_eq!(strtol_base0("4294967297") as i32, 1);
        assert_eq!(strtol_base0("0x100000001") as i32, 1);
    }

    #[test]
    fn an_abort_request_is_seen_from_another_thread_with_its_first_cause() {
        let req = Arc::new(AbortRequest::default());
        assert_eq!(req.asked(), None);
        let asker = req.clone();
        std::thread::spawn(move || {
            asker.ask("lookup found the group broken");
            asker.ask("a later cause");
        })
        .join()
        .unwrap();
        assert_eq!(
            req.asked().as_deref(),
            Some("lookup found the group broken")
        );
    }
}
