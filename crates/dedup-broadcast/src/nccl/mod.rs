//! [`Collective`] over NCCL (feature `nccl`, through cudarc loaded at run time).
//!
//! **Threads.** A `ncclComm_t` is not `Send`, so each rank's communicator lives on a
//! dedicated *comm thread* that creates it, runs every operation of the rank in order, and
//! destroys it. The [`NcclCollective`] handle sends each request over a channel and waits for
//! the reply; the handle is `Send + Sync` and can be used from any thread (calls on one handle
//! are serialised, as the trait requires).
//!
//! **Streams.** Collectives run on the comm thread's own non-blocking *comm stream*, never on
//! the engine's compute stream or the load stream. The device operations
//! ([`Collective::broadcast_device`], [`Collective::all_gather_device`]) order the collective
//! after an event of another stream (the load stream's upload into device staging) and return
//! its completion event at once; the load stream waits on it before the scatter, so no CPU
//! thread blocks on the device. The host operations complete before they return (the comm
//! thread waits for the operation's event), so their memory may be reused at once.
//!
//! **Host memory.** NCCL moves device memory; host rows ([`Collective::broadcast_rows`],
//! [`Collective::all_gather_rows`]) and the small exchanges (`all_gather_u64`, status words)
//! are gathered into one host buffer, moved through a device scratch buffer of the comm thread,
//! and scattered back: host pools work over NCCL too, with two copies over PCIe per rank.
//!
//! **Deadlines and aborts.** The communicator is created *non-blocking* (`ncclConfig_t.blocking =
//! 0`; a start with `NCCL_COMM_BLOCKING=1` in the environment, which NCCL takes over the config, is
//! refused), so no NCCL call blocks the comm thread: it polls `ncclCommGetAsyncError` and the
//! operation's event until the request's deadline. When an operation cannot finish by then (a rank
//! never issued it) or NCCL reports an error, the comm thread calls **`ncclCommAbort`**, which also
//! stops NCCL kernels still waiting for the missing peer, waits (bounded by
//! [`NcclConfig::abort_grace`]) for the comm stream to drain, and replies
//! [`CollectiveError::Timeout`] (or `Backend`). The abort is done by the comm thread itself because
//! NCCL calls on one communicator must not race. An [`abort`](Collective::abort) from another
//! thread is a request the comm thread checks at every poll, so it also ends an operation already
//! in flight (which returns [`CollectiveError::Aborted`]) rather than waiting for that operation's
//! deadline. From then on every operation of that rank fails at once with
//! [`CollectiveError::Aborted`]. A rank whose peer aborted fails by its own deadline, none hangs;
//! one operation of it may still complete, where the peer's share had landed before the abort (seen
//! on two H200s over NVLink), and its next exchange with the aborted peer fails. So one
//! collective's return does not decide a batch on every rank alike: the linker's status words and
//! verdict do, and the verdict and a batch's gate go through the settled gathers, which here are
//! the trait's default (the gather, then a confirming second gather: a peer that timed out after
//! its share landed never takes part in the second). Recovering means building a new group (a new
//! unique id). The caller waits for the reply at most `deadline + 2 × abort_grace`; should the comm
//! thread not answer by then (a driver that hangs inside `ncclCommAbort`), the handle is marked
//! unusable and the call returns `Timeout` (its buffers may then still be referenced by the device:
//! the caller should not free them).
//!
//! What NCCL cannot tell: which rank is missing from an operation (`Timeout::missing` is
//! empty; an in-process group's start names the ranks whose start never answered), nor a length
//! or root that differs between ranks (a mismatch shows as a timeout or garbage, not as
//! `SizeMismatch`): the plan gate and the status exchange keep ranks in step. An empty
//! operation (no bytes) still meets the peers: NCCL discards an empty collective at once,
//! without waiting for anyone, so the comm thread moves one byte of its scratch instead.
//!
//! **Re-forming.** An aborted handle is [`broken`](Collective::broken); so are its peers of the
//! same [`NcclGroup::new_in_process`] group once one of them is aborted (they share a flag).
//! [`NcclGroup::formation`] makes fresh groups (new unique ids, new communicators for data
//! and control) for the next batch; ranks that are processes re-form at their rendezvous
//! (`RendezvousFormation::nccl`: rank 0 makes the new ids and ships them).

mod error;
#[cfg(test)]
mod tests;
mod worker;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cudarc::nccl::sys;
use kv_device::cuda::cuda_device_count;
use kv_device::{DeviceRegion, HostRow, SharedEvent};
use parking_lot::Mutex;

pub use error::nccl_result_name;
use worker::{AbortRequest, Op, Reply, Request, Setup, Span, Worker};

use crate::{Collective, CollectiveError, InProcessFormation, MemorySupport};

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

impl NcclConfig {
    /// Refuses settings no group can run with: a zero `init_timeout` (every start would time
    /// out at once) or a zero `abort_grace` (the handle would stop waiting for the comm
    /// thread's reply the moment an operation's deadline passed, and count every timeout as
    /// a silent thread: its buffers leaked, its thread never joined).
    pub fn check(&self) -> Result<(), CollectiveError> {
        for (name, value) in [
            ("init_timeout", self.init_timeout),
            ("abort_grace", self.abort_grace),
        ] {
            if value.is_zero() {
                return Err(CollectiveError::Backend(format!(
                    "NcclConfig::{name} is zero: no NCCL group can run with it"
                )));
            }
        }
        Ok(())
    }
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

/// The oldest NCCL this crate drives (2.17): the non-blocking communicator's config is laid
/// out as 2.17 has it, and the calls it makes (`ncclCommInitRankConfig`, `ncclCommFinalize`,
/// `ncclGetLastError`) are missing from older libraries, where calling them would panic.
pub const MIN_NCCL_VERSION: i32 = 21_700;

/// Checks that the NCCL library can be loaded (without a call that could panic) and is at
/// least [`MIN_NCCL_VERSION`], and returns its version code (e.g. 22803 for 2.28.3).
pub fn nccl_version() -> Result<i32, CollectiveError> {
    cuda_device_count().map_err(|source| CollectiveError::Device {
        what: "CUDA availability",
        source,
    })?;
    if !kv_device::cuda::CudaLibrary::Nccl.loadable() {
        return Err(CollectiveError::Backend(
            "NCCL unavailable: libnccl.so is not on the library path".into(),
        ));
    }
    let version = cudarc::nccl::result::get_nccl_version().map_err(|e| {
        CollectiveError::Backend(format!("ncclGetVersion: {}", nccl_result_name(e.0)))
    })?;
    if version < MIN_NCCL_VERSION {
        return Err(CollectiveError::Backend(format!(
            "NCCL {version} is older than {MIN_NCCL_VERSION} (2.17), the oldest this crate \
             drives: install a newer libnccl"
        )));
    }
    Ok(version)
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
#[derive(Debug)]
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
        Self::new_in_process_by(
            ordinals,
            config,
            kv_loader::deadline_after(config.init_timeout),
        )
    }

    /// [`new_in_process_with`](Self::new_in_process_with), its start bounded by `deadline`
    /// as well as `config.init_timeout` (two groups formed within one bound, say). The
    /// answer may come up to twice `abort_grace` past the bound, as for any operation.
    pub fn new_in_process_by(
        ordinals: &[u32],
        config: NcclConfig,
        deadline: Instant,
    ) -> Result<Vec<NcclCollective>, CollectiveError> {
        config.check()?;
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
        let deadline = deadline.min(kv_loader::deadline_after(config.init_timeout));
        let group = Arc::new(Mutex::new(None));
        let mut pending = Vec::with_capacity(ordinals.len());
        for (rank, &ordinal) in ordinals.iter().enumerate() {
            let spawned = NcclCollective::spawn(
                id,
                rank as u32,
                size,
                ordinal,
                config,
                deadline,
                group.clone(),
            );
            match spawned {
                Ok(p) => pending.push(p),
                Err(e) => {
                    // The ranks started would wait for this one until the deadline.
                    give_up(pending.iter().map(|p| &p.handle), GIVE_UP);
                    return Err(e);
                }
            }
        }
        let mut ranks = start_all(pending)?;
        for r in &mut ranks {
            r.peers_in_process = size > 1;
        }
        Ok(ranks)
    }

    /// The formation of in-process groups on `ordinals`: each epoch two fresh
    /// [`new_in_process_with`](Self::new_in_process_with) groups (new unique ids, new
    /// communicators), one for data and one for control, built by the first rank that asks.
    pub fn formation(ordinals: Vec<u32>, config: NcclConfig) -> InProcessFormation {
        let size = ordinals.len() as u32;
        InProcessFormation::new(size, move || {
            // Both groups within one init timeout, as a group of processes forms its two.
            let deadline = kv_loader::deadline_after(config.init_timeout);
            let data = Self::new_in_process_by(&ordinals, config, deadline)?;
            let control = match Self::new_in_process_by(&ordinals, config, deadline) {
                Ok(control) => control,
                Err(e) => {
                    // The data group formed: it aborts rather than finalizes, all together.
                    give_up(&data, "the group's control communicator failed to start");
                    return Err(e);
                }
            };
            Ok(data
                .into_iter()
                .zip(control)
                .map(|(d, c)| {
                    (
                        Arc::new(d) as Arc<dyn Collective>,
                        Arc::new(c) as Arc<dyn Collective>,
                    )
                })
                .collect())
        })
    }
}

/// Why the other ranks of an in-process group give up their start.
const GIVE_UP: &str = "another rank of the group failed to start";

/// Waits for every rank of an in-process group to start, taking the ranks' answers in the
/// order they come. The first rank that fails (or a start still unanswered at the deadline)
/// makes the others give up at once: their initialisation would otherwise wait for it until
/// `init_timeout`, and each drop then for its comm thread. Those that formed abort instead of
/// finalizing with a missing peer. The error is the first failed rank's own.
fn start_all(pending: Vec<Pending>) -> Result<Vec<NcclCollective>, CollectiveError> {
    let until = pending
        .iter()
        .map(|p| kv_loader::deadline_from(p.deadline, p.handle.reply_slack()))
        .max()
        .unwrap_or_else(Instant::now);
    let mut answers: Vec<Option<Result<(), CollectiveError>>> =
        pending.iter().map(|_| None).collect();
    let failed = loop {
        for (p, a) in pending.iter().zip(answers.iter_mut()) {
            if a.is_none() {
                match p.ready.try_recv() {
                    Ok(r) => *a = Some(r),
                    Err(mpsc::TryRecvError::Empty) => {}
                    Err(mpsc::TryRecvError::Disconnected) => {
                        *a = Some(Err(CollectiveError::Backend(format!(
                            "rank {}: the comm thread ended while starting",
                            p.handle.rank
                        ))))
                    }
                }
            }
        }
        let first_failed = pending.iter().zip(&answers).find_map(|(p, a)| match a {
            Some(Err(e)) => Some((p.handle.rank, p.handle.ordinal, e)),
            _ => None,
        });
        if let Some((rank, ordinal, e)) = first_failed {
            tracing::warn!(rank, ordinal, error = %e, "a rank's NCCL communicator failed to start");
            break Some(e.clone());
        }
        if answers.iter().all(Option::is_some) {
            break None;
        }
        if Instant::now() >= until {
            // The ranks whose start never answered: an operator drains their GPUs.
            let missing: Vec<u32> = pending
                .iter()
                .zip(&answers)
                .filter(|(_, a)| a.is_none())
                .map(|(p, _)| p.handle.rank)
                .collect();
            tracing::warn!(?missing, "ranks' NCCL communicators did not start in time");
            break Some(CollectiveError::Timeout {
                op: "init",
                seq: 0,
                missing,
            });
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let Some(e) = failed else {
        return Ok(pending.into_iter().map(|p| p.handle).collect());
    };
    for p in &pending {
        p.handle.interrupt.ask(GIVE_UP);
    }
    // The ranks still starting give up now, all together: one bound for all of them, not one
    // after another (a comm thread that does not answer is left, its handle unusable). Then
    // every comm thread ends (an asked-for abort replaces the finalize), together too.
    // Past `until` the ranks still unanswered already had their deadline and their comm
    // thread's own abort grace: they are left at once, not waited for again (which put the
    // answer up to twice `abort_grace` more past the documented bound).
    let late = Instant::now() >= until;
    let slack = pending.iter().map(|p| p.handle.reply_slack()).max();
    let bound = kv_loader::deadline_after(slack.unwrap_or_default());
    for (p, a) in pending.iter().zip(&answers) {
        if a.is_none()
            && (late
                || p.ready
                    .recv_timeout(bound.saturating_duration_since(Instant::now()))
                    .is_err())
        {
            p.handle.unusable.store(true, Ordering::Release);
        }
    }
    close_all(&pending.iter().map(|p| &p.handle).collect::<Vec<_>>());
    Err(e)
}

/// Asks every handle of `handles` to give up (its comm thread aborts rather than finalizes:
/// its group will not be used), then ends their comm threads together ([`close_all`]).
fn give_up<'h>(handles: impl IntoIterator<Item = &'h NcclCollective>, cause: &str) {
    let handles: Vec<&NcclCollective> = handles.into_iter().collect();
    for h in &handles {
        h.interrupt.ask(cause);
    }
    close_all(&handles);
}

/// Ends the comm threads of `handles` together: every channel closed first, then each thread
/// waited for against one bound (three times the largest `abort_grace`; none for a handle whose
/// thread is known silent), so that `n` handles take one grace, not `n`, and no thread waits
/// for a peer whose own end has not been asked for yet.
fn close_all(handles: &[&NcclCollective]) {
    for h in handles {
        h.hang_up();
    }
    let slack = handles.iter().map(|h| h.shutdown_slack()).max();
    let bound = kv_loader::deadline_after(slack.unwrap_or_default());
    for h in handles {
        let _ = h.close(bound);
    }
}

/// A call that failed: its error, and whether the comm thread may still use the operation's
/// memory (the request went out, and no reply came).
struct CallFailure {
    error: CollectiveError,
    unanswered: bool,
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
            .saturating_add(self.handle.reply_slack());
        match self.ready.recv_timeout(wait) {
            Ok(Ok(())) => Ok(self.handle),
            Ok(Err(e)) => Err(e),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.handle.unusable.store(true, Ordering::Release);
                // A comm thread that answers late aborts its communicator rather than keep
                // one its caller gave up on.
                self.handle
                    .interrupt
                    .ask("its start was not confirmed in time");
                Err(CollectiveError::Timeout {
                    op: "init",
                    seq: 0,
                    missing: Vec::new(),
                })
            }
            // As `start_all` says it: not a peer's lateness, so not a timeout.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                self.handle.unusable.store(true, Ordering::Release);
                Err(CollectiveError::Backend(format!(
                    "rank {}: the comm thread ended while starting",
                    self.handle.rank
                )))
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
    /// A second sender of the same channel, for [`abort`](Collective::abort): `tx`'s lock is
    /// held for a whole operation, and an abort must not wait for the operation it ends.
    abort_tx: Mutex<Option<mpsc::Sender<Request>>>,
    /// Where [`abort`](Collective::abort) asks the comm thread to abort, seen while it waits.
    interrupt: Arc<AbortRequest>,
    seq: AtomicU64,
    last_ms: AtomicU64,
    unusable: Arc<AtomicBool>,
    /// The comm thread is ending, not stuck (it dropped its side of a call: a panic under an
    /// operation): `close` waits for its end within its bound, rather than at once as for a
    /// thread that stopped answering.
    ending: AtomicBool,
    /// Set by the comm thread when it aborts its communicator.
    aborted: Arc<Mutex<Option<String>>>,
    /// Shared by the handles of one in-process group: set when any of them is aborted.
    group: Arc<Mutex<Option<String>>>,
    /// Set by the comm thread once its abort drained the comm stream: no operation of this
    /// handle can still touch the device ([`may_leave_work`](Collective::may_leave_work)).
    quiet: Arc<AtomicBool>,
    /// Its peers are handles of this process (`new_in_process` of more than one GPU): NCCL's
    /// P2P transport may then let a peer's kernel write into this rank's buffer directly,
    /// which this rank's drain does not cover.
    peers_in_process: bool,
    thread: Mutex<Option<JoinHandle<()>>>,
    done: Mutex<Option<mpsc::Receiver<()>>>,
    /// Bytes of host buffers leaked to a silent comm thread.
    leaked: AtomicU64,
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
    /// processes, one rank per process. Blocks until every rank joined or
    /// `config.init_timeout` passed. Ranks that are threads of one process use
    /// [`NcclGroup::new_in_process`]: a handle joined here takes its peers for other
    /// processes, and after a failed share whose abort drained its comm stream it lets the
    /// stage be reused ([`may_leave_work`](Collective::may_leave_work) `false`), which a
    /// peer kernel of the same process (NCCL's P2P direct mode) may still write.
    pub fn join(
        unique_id: [u8; 128],
        rank: u32,
        size: u32,
        ordinal: u32,
        config: NcclConfig,
    ) -> Result<Self, CollectiveError> {
        let deadline = kv_loader::deadline_after(config.init_timeout);
        Self::join_by((unique_id, rank, size), ordinal, config, deadline)
    }

    /// [`join`](Self::join) bounded by `deadline` as well as `config.init_timeout` (a group
    /// re-formed within a caller's bound): `(unique_id, rank, size)` as there. The handle's
    /// reply may come up to twice `abort_grace` past the bound, as for any operation.
    pub fn join_by(
        (unique_id, rank, size): ([u8; 128], u32, u32),
        ordinal: u32,
        config: NcclConfig,
        deadline: Instant,
    ) -> Result<Self, CollectiveError> {
        config.check()?;
        nccl_version()?;
        let deadline = deadline.min(kv_loader::deadline_after(config.init_timeout));
        let group = Arc::new(Mutex::new(None));
        Self::spawn(unique_id, rank, size, ordinal, config, deadline, group)?.ready()
    }

    fn spawn(
        unique_id: [u8; 128],
        rank: u32,
        size: u32,
        ordinal: u32,
        config: NcclConfig,
        deadline: Instant,
        group: Arc<Mutex<Option<String>>>,
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
        let aborted = Arc::new(Mutex::new(None));
        let interrupt = Arc::new(AbortRequest::default());
        let quiet = Arc::new(AtomicBool::new(false));
        let setup = Setup {
            rank,
            size,
            ordinal,
            id,
            config,
            init_deadline: deadline,
            broken: aborted.clone(),
            interrupt: interrupt.clone(),
            group: group.clone(),
            quiet: quiet.clone(),
        };
        let thread = std::thread::Builder::new()
            .name(format!("kvlink-nccl-r{rank}"))
            .spawn(move || {
                run_comm_thread(rank, done_tx, || match Worker::start(&setup) {
                    Ok(w) => {
                        let _ = ready_tx.send(Ok(()));
                        w.serve(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                })
            })
            .map_err(|e| CollectiveError::Backend(format!("spawning the comm thread: {e}")))?;
        Ok(Pending {
            handle: NcclCollective {
                rank,
                size,
                ordinal,
                grace: config.abort_grace,
                abort_tx: Mutex::new(Some(tx.clone())),
                tx: Mutex::new(Some(tx)),
                interrupt,
                seq: AtomicU64::new(0),
                last_ms: AtomicU64::new(f64::NAN.to_bits()),
                unusable: Arc::new(AtomicBool::new(false)),
                ending: AtomicBool::new(false),
                aborted,
                group,
                quiet,
                peers_in_process: false,
                thread: Mutex::new(Some(thread)),
                done: Mutex::new(Some(done_rx)),
                leaked: AtomicU64::new(0),
            },
            ready: ready_rx,
            deadline,
        })
    }

    /// How long past a request's deadline the handle waits for the comm thread's reply: the
    /// thread's own timeout path takes `ncclCommAbort` and then up to `abort_grace` for the
    /// comm stream to drain, so a reply within twice the grace is still an answer, not a
    /// silent thread.
    fn reply_slack(&self) -> Duration {
        self.grace.saturating_mul(2)
    }

    /// How long a closing handle waits for its comm thread to end: the thread's shutdown
    /// drains and finalizes within one `abort_grace`, and one that runs out of it aborts
    /// (`ncclCommAbort`) and waits up to another grace for the comm stream to drain; a third
    /// covers the abort itself. Waited less, a thread that was still ending was left running
    /// (logged at `error`), its scratch and stream with it.
    fn shutdown_slack(&self) -> Duration {
        self.grace.saturating_mul(3)
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
        self.send_call(op, deadline).map_err(|f| f.error)
    }

    /// [`call`](Self::call), saying on failure whether the comm thread may still use the
    /// operation's memory (the request went out and no reply came).
    fn send_call(&self, op: Op, deadline: Instant) -> Result<Reply, CallFailure> {
        let unsent = |error| CallFailure {
            error,
            unanswered: false,
        };
        let name = op.name();
        // Calls on one handle are serialised: a call that cannot take its turn by its
        // deadline (another thread's call still running) times out, as its peers would, and
        // the handle is aborted: this rank skipped an operation its peers issued, so its next
        // one would pair with theirs (as the socket group breaks its handle).
        let Some(tx) = self.tx.try_lock_until(deadline) else {
            self.abort(&format!(
                "{name} could not start by its deadline: another operation held the handle"
            ));
            return Err(unsent(CollectiveError::Timeout {
                op: name,
                // The number it would have had (the operation holding the handle has its own).
                seq: self.seq.load(Ordering::Acquire),
                missing: Vec::new(),
            }));
        };
        let seq = self.seq.fetch_add(1, Ordering::AcqRel);
        if self.unusable.load(Ordering::Acquire) {
            return Err(unsent(CollectiveError::Aborted {
                op: name,
                seq,
                missing: Vec::new(),
                cause: "the comm thread stopped answering earlier".into(),
            }));
        }
        let Some(sender) = tx.as_ref() else {
            return Err(unsent(CollectiveError::RankGone {
                op: name,
                seq,
                gone: vec![self.rank],
            }));
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
                // No operation can run any more: the handle is broken, so the group re-forms.
                self.ending.store(true, Ordering::Release);
                self.unusable.store(true, Ordering::Release);
                unsent(CollectiveError::Backend(format!(
                    "rank {}: the comm thread has ended",
                    self.rank
                )))
            })?;
        let wait = deadline
            .saturating_duration_since(Instant::now())
            .saturating_add(self.reply_slack());
        match reply_rx.recv_timeout(wait) {
            Ok(Ok(reply)) => {
                if let Reply::Done { device_ms } = &reply {
                    let ms = device_ms.map_or(f64::NAN, f64::from);
                    self.last_ms.store(ms.to_bits(), Ordering::Release);
                }
                Ok(reply)
            }
            // The comm thread answered: it is done with the operation's memory.
            Ok(Err(e)) => Err(unsent(e)),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                self.unusable.store(true, Ordering::Release);
                // The caller gave up: a comm thread that comes back aborts the communicator
                // (its peers have moved on) rather than keep it and finalize it with them.
                self.interrupt
                    .ask(&format!("{name} #{seq} was not answered in time"));
                Err(CallFailure {
                    error: CollectiveError::Timeout {
                        op: name,
                        seq,
                        missing: Vec::new(),
                    },
                    unanswered: true,
                })
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // The comm thread died mid-operation (a panic under it): its operation's end is
                // unknown and nothing more runs; broken, so the group re-forms.
                self.ending.store(true, Ordering::Release);
                self.unusable.store(true, Ordering::Release);
                Err(CallFailure {
                    error: CollectiveError::Backend(format!(
                        "rank {}: the comm thread ended during {name} #{seq}",
                        self.rank
                    )),
                    unanswered: true,
                })
            }
        }
    }

    /// A host operation over `buf` (which the comm thread reads and writes through the
    /// scratch): `buf` back once the operation is done. When the request went out and the
    /// comm thread did not answer in time it may still use `buf`, which is then leaked rather
    /// than freed (counted in [`leaked_host_bytes`](Self::leaked_host_bytes)); a request that
    /// never went out frees it.
    fn host_call(
        &self,
        mut buf: Vec<u8>,
        op: impl FnOnce(usize) -> Op,
        deadline: Instant,
    ) -> Result<Vec<u8>, CollectiveError> {
        // The comm thread writes the result through this address.
        let addr = buf.as_mut_ptr() as usize;
        match self.send_call(op(addr), deadline) {
            Ok(_) => Ok(buf),
            Err(f) => {
                if f.unanswered {
                    tracing::error!(
                        rank = self.rank,
                        bytes = buf.len(),
                        "NCCL comm thread silent; leaking a host buffer it may still use"
                    );
                    self.leaked
                        .fetch_add(buf.capacity() as u64, Ordering::Relaxed);
                    crate::kept::count_kept(buf.capacity() as u64);
                    std::mem::forget(buf);
                }
                Err(f.error)
            }
        }
    }

    /// Bytes of host buffers left to a comm thread that did not answer (it may still use
    /// them): leaked, never freed, for the life of the process.
    pub fn leaked_host_bytes(&self) -> u64 {
        self.leaked.load(Ordering::Relaxed)
    }

    /// A zeroed host buffer of `len` bytes for `op`'s rows; refused (`InvalidArgument`) when
    /// the allocator cannot give it, where `vec!` would abort the process (a layer's rows of
    /// a multi-million-token batch are gigabytes). The peers, already in the operation, time
    /// out in it and the group is re-formed, as for any refusal only this rank makes.
    fn host_buffer(&self, op: &'static str, len: usize) -> Result<Vec<u8>, CollectiveError> {
        kv_device::zeroed_bytes(len).ok_or_else(|| {
            self.invalid(
                op,
                format!("a host buffer of {len} bytes for the rows could not be allocated"),
            )
        })
    }

    fn invalid(&self, op: &'static str, reason: String) -> CollectiveError {
        CollectiveError::InvalidArgument {
            op,
            seq: self.seq.load(Ordering::Acquire),
            rank: self.rank,
            reason,
        }
    }
}

/// The ranges of `counts` over the rows, and the bytes of each.
fn owner_ranges(rows: &[HostRow], counts: &[usize]) -> Vec<(std::ops::Range<usize>, usize)> {
    let mut start = 0;
    counts
        .iter()
        .map(|&n| {
            let r = start..start + n;
            start += n;
            let bytes = rows[r.clone()].iter().map(|x| x.len).sum();
            (r, bytes)
        })
        .collect()
}

/// Copies `rows` one after another into `buf` from `at` on.
///
/// # Safety
/// Every row is valid for reads of its length; `buf[at..]` holds them all.
unsafe fn gather_into(rows: &[HostRow], buf: &mut [u8], at: usize) {
    let mut off = at;
    for r in rows {
        // SAFETY: the caller's promise; `buf` is ours and large enough.
        unsafe {
            std::ptr::copy_nonoverlapping(r.addr as *const u8, buf[off..].as_mut_ptr(), r.len)
        };
        off += r.len;
    }
}

/// Copies `buf` from `at` on into `rows`, one after another.
///
/// # Safety
/// Every row is valid for writes of its length and touched by nothing else; `buf[at..]` holds
/// them all.
unsafe fn scatter_from(buf: &[u8], at: usize, rows: &[HostRow]) {
    let mut off = at;
    for r in rows {
        // SAFETY: the caller's promise; `buf` is ours and large enough.
        unsafe { std::ptr::copy_nonoverlapping(buf[off..].as_ptr(), r.addr as *mut u8, r.len) };
        off += r.len;
    }
}

// SAFETY: every operation runs on the comm thread on the comm stream; host buffers are
// staged through the worker's own pinned and device memory and copied back before the reply
// (a reply that does not come leaks the buffer instead of returning it); a device
// operation's event is recorded on the comm stream after the NCCL call; every error after an
// enqueue aborts the communicator, so `broken` answers `true` for it, and `may_leave_work`
// does unless that abort drained the comm stream (on the comm thread, before its reply; no
// operation runs after an abort), which ends this rank's work on its region, and the
// group's peers are other processes (`peers_in_process` false: `join`'s contract, one rank
// per process), whose kernels write NCCL's own buffers, not this rank's region.
unsafe impl Collective for NcclCollective {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let (n, size) = (value.len(), self.size as usize);
        let mut buf = vec![0u8; n * size];
        let at = self.rank as usize * n;
        buf[at..at + n].copy_from_slice(value);
        let buf = self.host_call(
            buf,
            |addr| Op::AllGather {
                send: Span::host(addr + at, n),
                recv: Span::host(addr, n * size),
            },
            deadline,
        )?;
        if n == 0 {
            return Ok(vec![Vec::new(); size]);
        }
        Ok(buf.chunks(n).map(<[u8]>::to_vec).collect())
    }

    fn memory(&self) -> MemorySupport {
        MemorySupport {
            host: true,
            device: true,
        }
    }

    fn device_ordinal(&self) -> Option<u32> {
        Some(self.ordinal)
    }

    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let total: usize = rows.iter().map(|r| r.len).sum();
        let mut buf = self.host_buffer("broadcast_rows", total)?;
        if self.rank == root {
            // SAFETY: the root's rows are valid for reads (the caller's promise).
            unsafe { gather_into(rows, &mut buf, 0) };
        }
        let buf = self.host_call(
            buf,
            |addr| Op::Broadcast {
                buf: Span::host(addr, total),
                root,
            },
            deadline,
        )?;
        if self.rank != root {
            // SAFETY: a receiver's rows are valid for writes, touched by nothing else.
            unsafe { scatter_from(&buf, 0, rows) };
        }
        Ok(())
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let op = "all_gather_rows";
        if counts.len() != self.size as usize
            || !crate::collective::counts_cover(counts, rows.len())
        {
            return Err(self.invalid(op, format!("counts {counts:?} for {} rows", rows.len())));
        }
        // NCCL gathers equal chunks: each rank's rows, padded to the largest rank's bytes.
        let owners = owner_ranges(rows, counts);
        let chunk = owners.iter().map(|(_, b)| *b).max().unwrap_or(0);
        let size = self.size as usize;
        let me = self.rank as usize;
        let mut buf = self.host_buffer(op, chunk.saturating_mul(size))?;
        // SAFETY: this rank's rows are valid for reads (the caller's promise).
        unsafe { gather_into(&rows[owners[me].0.clone()], &mut buf, me * chunk) };
        let buf = self.host_call(
            buf,
            |addr| Op::AllGather {
                send: Span::host(addr + me * chunk, chunk),
                recv: Span::host(addr, chunk * size),
            },
            deadline,
        )?;
        for (peer, (range, _)) in owners.iter().enumerate() {
            if peer != me {
                // SAFETY: other owners' rows of this rank are valid for writes, untouched by
                // anything else (the caller's promise).
                unsafe { scatter_from(&buf, peer * chunk, &rows[range.clone()]) };
            }
        }
        Ok(())
    }

    unsafe fn broadcast_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        root: u32,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let buf = Span::device(region.ordinal, region.addr, region.len);
        match self.call(Op::BroadcastAsync { buf, root, after }, deadline)? {
            Reply::Event(ev) => Ok(ev),
            Reply::Done { .. } => Err(CollectiveError::Backend(
                "broadcast_device: the comm thread returned no event".into(),
            )),
        }
    }

    unsafe fn all_gather_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let size = self.size as usize;
        if !region.len.is_multiple_of(size) {
            return Err(self.invalid(
                "all_gather_device",
                format!("{} bytes do not split into {size} chunks", region.len),
            ));
        }
        let chunk = region.len / size;
        let own = region
            .addr
            .checked_add(region.len as u64)
            .and_then(|_| region.addr.checked_add((self.rank as usize * chunk) as u64));
        let Some(own) = own else {
            return Err(self.invalid(
                "all_gather_device",
                format!(
                    "a region at {:#x} of {} bytes wraps around",
                    region.addr, region.len
                ),
            ));
        };
        let send = Span::device(region.ordinal, own, chunk);
        let recv = Span::device(region.ordinal, region.addr, region.len);
        match self.call(Op::AllGatherAsync { send, recv, after }, deadline)? {
            Reply::Event(ev) => Ok(ev),
            Reply::Done { .. } => Err(CollectiveError::Backend(
                "all_gather_device: the comm thread returned no event".into(),
            )),
        }
    }

    /// Aborts the communicator (`ncclCommAbort` on the comm thread): every operation in flight
    /// ends, every later one fails with [`CollectiveError::Aborted`]; the handles of the same
    /// in-process group become [`broken`](Collective::broken) too.
    ///
    /// Callable from any thread, also while another thread waits in an operation of this
    /// handle: the comm thread sees the request while it waits, aborts, and that operation
    /// returns `Aborted` at once. This call returns once the comm thread has aborted, or after
    /// at most twice [`NcclConfig::abort_grace`] (the comm thread's bounded drain wait, for the
    /// operation in flight and for this request).
    fn abort(&self, cause: &str) {
        self.group
            .lock()
            .get_or_insert_with(|| format!("rank {}: {cause}", self.rank));
        self.interrupt.ask(cause);
        if self.unusable.load(Ordering::Acquire) {
            // The comm thread stopped answering earlier: no wait for a reply it will not give.
            return;
        }
        // Queued as well, for a comm thread that is idle (waiting for its next request).
        let Some(sender) = self.abort_tx.lock().clone() else {
            return;
        };
        let (reply_tx, reply_rx) = mpsc::sync_channel(1);
        let request = Request {
            // Not an operation of the group: it takes no sequence number (the rank's next
            // operation keeps the number its peers give theirs).
            seq: self.seq.load(Ordering::Acquire),
            op: Op::Abort {
                cause: cause.to_string(),
            },
            deadline: Instant::now(),
            reply: reply_tx,
        };
        if sender.send(request).is_err() {
            // The comm thread has ended: nothing of it runs any more.
            return;
        }
        if reply_rx.recv_timeout(self.reply_slack()).is_err() {
            // Unusable as well as broken: a later abort, operation or close does not wait
            // for a reply again from a comm thread that gave none (each waited twice
            // `abort_grace` more).
            self.unusable.store(true, Ordering::Release);
            tracing::warn!(
                rank = self.rank,
                cause,
                "the comm thread did not confirm the abort in time; the handle stays broken and unusable"
            );
        }
    }

    fn broken(&self) -> Option<String> {
        if let Some(why) = self.aborted.lock().clone() {
            return Some(why);
        }
        if let Some(why) = self.group.lock().clone() {
            return Some(why);
        }
        self.unusable
            .load(Ordering::Acquire)
            .then(|| "the comm thread stopped answering".to_string())
    }

    /// `true` while the handle is broken and its comm thread has not drained the comm stream
    /// after aborting the communicator: a failed device operation's region may still be in
    /// NCCL's hands. Once the abort drained, nothing of the handle runs on the device any
    /// more, so a stage it failed on can be reused (before, every failed share over NCCL lost
    /// its staging buffer for good, and a rank whose buffers were all lost failed every batch).
    /// Ranks in different processes only (one per GPU, as an engine runs them; `join`): peers
    /// write into NCCL's own buffers there, not into this rank's region. With peers in this
    /// process (`new_in_process` of more than one GPU), a peer's kernel may write into the
    /// region directly (NCCL's P2P direct mode) after this rank's drain: still `true` then.
    fn may_leave_work(&self, error: &CollectiveError) -> bool {
        let _ = error;
        self.broken().is_some() && (self.peers_in_process || !self.quiet.load(Ordering::Acquire))
    }
}

impl NcclCollective {
    /// Closes the channels to the comm thread: its loop ends, and it finalizes (or aborts) the
    /// communicator.
    fn hang_up(&self) {
        drop(self.tx.lock().take());
        drop(self.abort_tx.lock().take());
    }

    /// Ends the comm thread: hangs up, then waits for the thread until `bound` (not at all
    /// when it is known silent) and joins it; a thread stuck in the driver is left behind.
    /// Once closed, a second call does nothing. True when this call joined the thread.
    fn close(&self, bound: Instant) -> bool {
        self.hang_up();
        let Some(t) = self.thread.lock().take() else {
            return false;
        };
        // A thread that stopped answering is not waited for; one that is ending (it may still
        // be unwinding when its call saw it go) is, within the bound.
        let stuck = self.unusable.load(Ordering::Acquire) && !self.ending.load(Ordering::Acquire);
        let bound = if stuck { Instant::now() } else { bound };
        let done = self.done.lock().take();
        // The thread sends on `done` as it ends; a closed channel also means it ended.
        let finished = done.is_some_and(|d| {
            !matches!(
                d.recv_timeout(bound.saturating_duration_since(Instant::now())),
                Err(mpsc::RecvTimeoutError::Timeout)
            )
        });
        if finished {
            let _ = t.join();
        } else {
            tracing::error!(
                rank = self.rank,
                "NCCL comm thread did not finish; leaving it"
            );
        }
        finished
    }
}

/// Runs a comm thread's `body`, then reports the thread's end on `done`. A panic under an
/// operation is caught and answered by `serve` itself; one elsewhere in `body` (starting,
/// shutting down) is a defect too: it is logged; the worker's drop has aborted the
/// communicator as it unwound; a request in flight gets no reply (its caller reads "ended
/// during"); and the end is still reported, so the handle joins the thread instead of
/// leaving it.
fn run_comm_thread(rank: u32, done: mpsc::SyncSender<()>, body: impl FnOnce()) {
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body));
    if let Err(payload) = served {
        tracing::error!(
            rank,
            panic = %kv_loader::Cause::from_panic(payload.as_ref()),
            "the NCCL comm thread panicked; its communicator was aborted"
        );
    }
    let _ = done.send(());
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        let _ = self.close(kv_loader::deadline_after(self.shutdown_slack()));
    }
}
