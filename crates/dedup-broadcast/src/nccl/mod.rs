//! [`Collective`] over NCCL (feature `nccl`, through cudarc loaded at run time).
//!
//! **Threads.** A `ncclComm_t` is not `Send`, so each rank's communicator lives on a
//! dedicated *comm thread* that creates it, runs every operation of the rank in order, and
//! destroys it. The [`NcclCollective`] handle sends each request over a channel and waits for
//! the reply; the handle is `Send + Sync` and can be used from any thread (calls on one handle
//! are serialised, as the trait requires).
//!
//! **Streams.** Collectives run on the comm thread's own non-blocking *comm stream*, never on
//! the engine's compute stream or the load stream. The [`Collective`] methods complete before
//! they return (the comm thread waits for the operation's event), so their buffers may be
//! reused at once, as the trait says. [`NcclCollective::broadcast_async`] instead orders the
//! broadcast after an event of another stream (e.g. the load stream's copy into device
//! staging) and returns its completion event, which the load stream waits on before the
//! scatter ([`StagedLanding::land_from_device`]): no CPU thread blocks on the device.
//!
//! **Host buffers.** NCCL moves device memory; host [`Buffer`]s (the small exchanges,
//! `all_gather_u64`, status words) go through a device scratch buffer of the comm thread.
//!
//! **Deadlines and aborts.** The communicator is created *non-blocking*
//! (`ncclConfig_t.blocking = 0`), so no NCCL call blocks the comm thread: it polls
//! `ncclCommGetAsyncError` and the operation's event until the request's deadline. When an
//! operation cannot finish by then (a rank never issued it) or NCCL reports an error, the
//! comm thread calls **`ncclCommAbort`**, which also stops NCCL kernels still waiting for the
//! missing peer, waits (bounded by [`NcclConfig::abort_grace`]) for the comm stream to drain,
//! and replies [`CollectiveError::Timeout`] (or `Backend`). The abort is done by the comm
//! thread itself because NCCL calls on one communicator must not race. From then on every
//! operation of that rank fails at once with [`CollectiveError::Aborted`]; a rank whose peer
//! aborted also fails by its own deadline, so every rank of the group ends the batch with an
//! error and none hangs. Recovering means building a new group (a new unique id).
//! The caller waits for the reply at most `deadline + abort_grace`; should the comm thread not
//! answer by then (a driver that hangs inside `ncclCommAbort`), the handle is marked
//! unusable and the call returns `Timeout` (its buffers may then still be referenced by the
//! device: the caller should not free them).
//!
//! What NCCL cannot tell: which rank is missing (`Timeout::missing` is empty), nor a length
//! or root that differs between ranks (a mismatch shows as a timeout or garbage, not as
//! `SizeMismatch`): the plan gate and the status exchange keep ranks in step.
//!
//! [`StagedLanding::land_from_device`]: kv_device::cuda::StagedLanding::land_from_device

mod error;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use kv_device::cuda::{cuda_device_count, CudaLayerEvent};
use parking_lot::Mutex;

pub use error::nccl_result_name;
use worker::{Op, Reply, Request, Setup, Worker};

use crate::{Buffer, Collective, CollectiveError};

/// Settings of an NCCL group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclConfig {
    /// How long communicator creation may wait for every rank.
    pub init_timeout: Duration,
    /// Extra time past an operation's deadline for the abort to finish (and, on the handle,
    /// for the comm thread's reply).
    pub abort_grace: Duration,
    /// Create the communicator non-blocking (deadlines can abort it). `false` uses blocking
    /// `ncclCommInitRank` (a stuck operation then cannot be aborted before it is enqueued).
    pub non_blocking: bool,
    /// Time every NCCL call with CUDA events ([`NcclCollective::last_device_ms`]).
    pub timing: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            init_timeout: Duration::from_secs(60),
            abort_grace: Duration::from_secs(10),
            non_blocking: true,
            timing: false,
        }
    }
}

/// Checks that the NCCL library can be loaded (without a call that could panic) and returns
/// its version code (e.g. 22803 for 2.28.3).
pub fn nccl_version() -> Result<i32, CollectiveError> {
    cuda_device_count().map_err(|e| CollectiveError::Backend(e.to_string()))?;
    // SAFETY: only tries to dlopen the candidate names of libnccl.
    if !unsafe { sys::is_culib_present() } {
        return Err(CollectiveError::Backend(
            "NCCL unavailable: libnccl.so is not on the library path".into(),
        ));
    }
    cudarc::nccl::result::get_nccl_version()
        .map_err(|e| CollectiveError::Backend(format!("ncclGetVersion: {}", nccl_result_name(e.0))))
}

/// A fresh NCCL unique id (`ncclGetUniqueId`), to ship to every rank of a new group out of
/// band (ranks in other processes: [`NcclCollective::join`]).
pub fn nccl_unique_id() -> Result<[u8; 128], CollectiveError> {
    nccl_version()?;
    let id = cudarc::nccl::result::get_uniqueid().map_err(|e| {
        CollectiveError::Backend(format!("ncclGetUniqueId: {}", nccl_result_name(e.0)))
    })?;
    Ok(id.internal.map(|c| c as u8))
}

/// Constructors of NCCL groups.
pub struct NcclGroup;

impl NcclGroup {
    /// One handle per entry of `ordinals` (rank `r` on GPU `ordinals[r]`), all in this
    /// process, sharing one fresh unique id; communicators are created concurrently on their
    /// comm threads. The GPUs must be distinct (NCCL refuses two ranks on one GPU).
    pub fn new_in_process(ordinals: &[u32]) -> Result<Vec<NcclCollective>, CollectiveError> {
        Self::new_in_process_with(ordinals, NcclConfig::default())
    }

    /// [`new_in_process`](Self::new_in_process) with explicit settings.
    pub fn new_in_process_with(
        ordinals: &[u32],
        config: NcclConfig,
    ) -> Result<Vec<NcclCollective>, CollectiveError> {
        if ordinals.is_empty() {
            return Err(CollectiveError::Backend(
                "an NCCL group needs a rank".into(),
            ));
        }
        let mut seen = ordinals.to_vec();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != ordinals.len() {
            return Err(CollectiveError::Backend(format!(
                "two ranks on one GPU ({ordinals:?}): NCCL needs one GPU per rank"
            )));
        }
        let id = nccl_unique_id()?;
        let size = ordinals.len() as u32;
        let deadline = kv_loader::deadline_after(config.init_timeout);
        let pending: Vec<_> = ordinals
            .iter()
            .enumerate()
            .map(|(rank, &ordinal)| {
                NcclCollective::spawn(id, rank as u32, size, ordinal, config, deadline)
            })
            .collect::<Result<_, _>>()?;
        pending.into_iter().map(|p| p.ready()).collect()
    }
}

/// A comm thread being started.
struct Pending {
    handle: NcclCollective,
    ready: mpsc::Receiver<Result<(), CollectiveError>>,
    deadline: Instant,
}

impl Pending {
    fn ready(self) -> Result<NcclCollective, CollectiveError> {
        let wait = self
            .deadline
            .saturating_duration_since(Instant::now())
            .saturating_add(self.handle.grace);
        match self.ready.recv_timeout(wait) {
            Ok(Ok(())) => Ok(self.handle),
            Ok(Err(e)) => Err(e),
            Err(_) => {
                self.handle.unusable.store(true, Ordering::Release);
                Err(CollectiveError::Timeout {
                    op: "init",
                    seq: 0,
                    missing: Vec::new(),
                })
            }
        }
    }
}

/// One rank of an NCCL group: a [`Collective`] whose communicator lives on its own comm
/// thread (see the module docs for streams, deadlines and aborts).
pub struct NcclCollective {
    rank: u32,
    size: u32,
    ordinal: u32,
    grace: Duration,
    tx: Mutex<Option<mpsc::Sender<Request>>>,
    seq: AtomicU64,
    last_ms: AtomicU64,
    unusable: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    done: Mutex<Option<mpsc::Receiver<()>>>,
}

impl std::fmt::Debug for NcclCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclCollective")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("ordinal", &self.ordinal)
            .finish()
    }
}

impl NcclCollective {
    /// Rank `rank` of a group of `size` on GPU `ordinal`, joining the group of `unique_id`
    /// (from [`nccl_unique_id`] on one rank, shipped to the others): for ranks in different
    /// processes. Blocks until every rank joined or `config.init_timeout` passed.
    pub fn join(
        unique_id: [u8; 128],
        rank: u32,
        size: u32,
        ordinal: u32,
        config: NcclConfig,
    ) -> Result<Self, CollectiveError> {
        nccl_version()?;
        let deadline = kv_loader::deadline_after(config.init_timeout);
        Self::spawn(unique_id, rank, size, ordinal, config, deadline)?.ready()
    }

    fn spawn(
        unique_id: [u8; 128],
        rank: u32,
        size: u32,
        ordinal: u32,
        config: NcclConfig,
        deadline: Instant,
    ) -> Result<Pending, CollectiveError> {
        if rank >= size {
            return Err(CollectiveError::Backend(format!(
                "rank {rank} of a group of {size}"
            )));
        }
        let id = sys::ncclUniqueId {
            internal: unique_id.map(|b| b as std::ffi::c_char),
        };
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::sync_channel(1);
        let (done_tx, done_rx) = mpsc::sync_channel::<()>(1);
        let setup = Setup {
            rank,
            size,
            ordinal,
            id,
            config,
            init_deadline: deadline,
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-nccl-r{rank}"))
            .spawn(move || {
                match Worker::start(&setup) {
                    Ok(w) => {
                        let _ = ready_tx.send(Ok(()));
                        w.serve(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
                let _ = done_tx.send(());
            })
            .map_err(|e| CollectiveError::Backend(format!("spawning the comm thread: {e}")))?;
        Ok(Pending {
            handle: NcclCollective {
                rank,
                size,
                ordinal,
                grace: config.abort_grace,
                tx: Mutex::new(Some(tx)),
                seq: AtomicU64::new(0),
                last_ms: AtomicU64::new(f64::NAN.to_bits()),
                unusable: Arc::new(AtomicBool::new(false)),
                thread: Mutex::new(Some(thread)),
                done: Mutex::new(Some(done_rx)),
            },
            ready: ready_rx,
            deadline,
        })
    }

    /// The GPU of this rank.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// With [`NcclConfig::timing`], the device time of the last operation's NCCL call in
    /// milliseconds (NaN when unknown).
    pub fn last_device_ms(&self) -> f64 {
        f64::from_bits(self.last_ms.load(Ordering::Acquire))
    }

    fn call(&self, op: Op, deadline: Instant) -> Result<Reply, CollectiveError> {
        let name = op.name();
        let tx = self.tx.lock();
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        if self.unusable.load(Ordering::Acquire) {
            return Err(CollectiveError::Aborted {
                op: name,
                seq,
                missing: Vec::new(),
                cause: "the comm thread stopped answering earlier".into(),
            });
        }
        let Some(sender) = tx.as_ref() else {
            return Err(CollectiveError::RankGone {
                op: name,
                seq,
                gone: vec![self.rank],
            });
        };
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        sender
            .send(Request {
                seq,
                op,
                deadline,
                reply: reply_tx,
            })
            .map_err(|_| {
                CollectiveError::Backend(format!("rank {}: the comm thread has ended", self.rank))
            })?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .saturating_add(self.grace);
        match reply_rx.recv_timeout(wait) {
            Ok(Ok(reply)) => {
                if let Reply::Done { device_ms } = &reply {
                    let ms = device_ms.map_or(f64::NAN, f64::from);
                    self.last_ms.store(ms.to_bits(), Ordering::Release);
                }
                Ok(reply)
            }
            Ok(Err(e)) => Err(e),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.unusable.store(true, Ordering::Release);
                Err(CollectiveError::Timeout {
                    op: name,
                    seq,
                    missing: Vec::new(),
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(CollectiveError::Backend(format!(
                "rank {}: the comm thread ended during {name} #{seq}",
                self.rank
            ))),
        }
    }

    /// Enqueues an in-place broadcast of the device buffer `buf` from `root` on the comm
    /// stream, after `after` (an event of another stream, e.g. the copy into device staging),
    /// and returns at once with the broadcast's completion event (the load stream waits on
    /// it before scattering; a host waits with [`CudaLayerEvent::wait_until`]). Only the
    /// enqueue is bounded by `deadline`: a caller whose wait on the event times out calls
    /// [`abort`](Self::abort).
    ///
    /// # Safety
    /// `buf` is device memory of this rank's GPU, valid for reads (root) or writes (others)
    /// of `buf.len` bytes and untouched by other work from the moment `after` completes until
    /// the returned event completes; it stays allocated until then.
    pub unsafe fn broadcast_async(
        &self,
        buf: Buffer,
        root: u32,
        after: Option<Arc<CudaLayerEvent>>,
        deadline: Instant,
    ) -> Result<Arc<CudaLayerEvent>, CollectiveError> {
        match self.call(Op::BroadcastAsync { buf, root, after }, deadline)? {
            Reply::Event(ev) => Ok(ev),
            Reply::Done { .. } => Err(CollectiveError::Backend(
                "broadcast_async: the comm thread returned no event".into(),
            )),
        }
    }

    /// Enqueues an all-gather of device buffers on the comm stream after `after` and returns
    /// at once with its completion event (the `SplitAllGather` share of a layer: every rank's
    /// rows land in `recv` in rank order). Deadline and abort as for
    /// [`broadcast_async`](Self::broadcast_async).
    ///
    /// # Safety
    /// `send` (`n` bytes) and `recv` (`size() * n` bytes) are device memory of this rank's GPU,
    /// valid and untouched by other work from `after` until the returned event completes;
    /// `send` is disjoint from `recv` or exactly this rank's slot of it.
    pub unsafe fn all_gather_async(
        &self,
        send: Buffer,
        recv: Buffer,
        after: Option<Arc<CudaLayerEvent>>,
        deadline: Instant,
    ) -> Result<Arc<CudaLayerEvent>, CollectiveError> {
        match self.call(Op::AllGatherAsync { send, recv, after }, deadline)? {
            Reply::Event(ev) => Ok(ev),
            Reply::Done { .. } => Err(CollectiveError::Backend(
                "all_gather_async: the comm thread returned no event".into(),
            )),
        }
    }

    /// Aborts the communicator (`ncclCommAbort` on the comm thread): every operation in flight
    /// ends, every later one fails with [`CollectiveError::Aborted`].
    pub fn abort(&self, cause: &str) -> Result<(), CollectiveError> {
        let deadline = Instant::now();
        self.call(
            Op::Abort {
                cause: cause.to_string(),
            },
            deadline,
        )
        .map(|_| ())
    }
}

impl Collective for NcclCollective {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    unsafe fn broadcast(
        &self,
        buf: Buffer,
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.call(Op::Broadcast { buf, root }, deadline).map(|_| ())
    }

    unsafe fn all_gather(
        &self,
        send: Buffer,
        recv: Buffer,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.call(Op::AllGather { send, recv }, deadline)
            .map(|_| ())
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        let all = self.all_gather_bytes(&value.to_le_bytes(), deadline)?;
        Ok(crate::collective::u64_words(&all))
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let n = value.len();
        let mut recv = vec![0u8; n * self.size as usize];
        let send = Buffer::of_slice(value);
        let r = Buffer::host(recv.as_mut_ptr() as usize, recv.len());
        // SAFETY: `value` is borrowed and `recv` owned by this call, both host memory valid
        // for the whole call (the comm thread finishes with them before replying, and the
        // call waits for the reply or marks the handle unusable), and they are disjoint.
        unsafe { self.all_gather(send, r, deadline)? };
        if n == 0 {
            return Ok(vec![Vec::new(); self.size as usize]);
        }
        Ok(recv.chunks(n).map(<[u8]>::to_vec).collect())
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        // Closing the channel ends the comm thread's loop; it finalizes (or aborts) the
        // communicator. Wait for that, bounded: a thread stuck in the driver is left behind.
        drop(self.tx.lock().take());
        let done = self.done.lock().take();
        let finished = done.is_some_and(|d| d.recv_timeout(self.grace * 2).is_ok());
        if let Some(t) = self.thread.lock().take() {
            if finished {
                let _ = t.join();
            } else {
                tracing::error!(
                    rank = self.rank,
                    "NCCL comm thread did not finish; leaving it"
                );
            }
        }
    }
}
