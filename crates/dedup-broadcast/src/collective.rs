//! The [`Collective`] trait: a TP group's collective operations over raw memory regions.
//!
//! Every rank of the group issues the same operations, in the same order (NCCL's rule). The
//! n-th operation a rank issues is matched with the n-th operation of every other rank; each
//! rank numbers its operations (its *sequence number*, starting at 0), and errors carry it.

use std::time::Instant;

use kv_device::{DeviceRegion, HostRow, SharedEvent};

/// Why a collective operation did not complete.
///
/// Every variant names the operation (`op`) and the sequence number (`seq`) of the rank that
/// reports it. Implementations that can decide an operation's fate for the whole group (the
/// in-process one does) give every rank that takes part the same variant, with one exception:
/// a broadcast's receivers that had already copied out of the root when the round was given
/// up (the root's deadline and copy grace passed) returned `Ok` beside the others' failure.
/// Callers that act on a result alone settle it (the `*_settled` gathers, or a status
/// exchange after the data).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollectiveError {
    /// A participant's deadline passed before every rank had arrived; `missing` are the ranks
    /// that had not arrived by then.
    #[error("{op} #{seq}: timed out waiting for ranks {missing:?}")]
    Timeout {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Ranks that had not issued it.
        missing: Vec<u32>,
    },
    /// The operation was given up, `cause` says why: the group gave it up before this rank
    /// issued it (this rank arrived late, after another rank's deadline or a failure), or the
    /// handle was aborted or broken before or while it ran (an NCCL communicator aborted, a
    /// socket group's handle broken). `missing` are the ranks known not to have arrived when
    /// it was given up (empty where the transport cannot tell).
    #[error("{op} #{seq}: given up ({cause}); missing ranks {missing:?}")]
    Aborted {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Ranks that had not arrived when it was given up.
        missing: Vec<u32>,
        /// Why the group gave it up.
        cause: String,
    },
    /// A rank's handle was dropped (its thread ended) before it issued this operation.
    #[error("{op} #{seq}: ranks {gone:?} have left the group")]
    RankGone {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// Ranks that left.
        gone: Vec<u32>,
    },
    /// A rank issued the same operation with a different length than the first rank to arrive.
    #[error("{op} #{seq}: rank {rank} gave {got} bytes, rank {first} gave {expected}")]
    SizeMismatch {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The rank whose length differs.
        rank: u32,
        /// Length of the first rank to arrive.
        expected: usize,
        /// Length of `rank`.
        got: usize,
        /// The first rank to arrive.
        first: u32,
    },
    /// Ranks issued different operations (or a different root) at the same sequence number:
    /// the group's sequences have diverged.
    #[error("{op} #{seq}: rank {rank} issued {detail}")]
    Mismatch {
        /// The operation (as the first rank to arrive issued it).
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The rank that differs.
        rank: u32,
        /// What it issued instead.
        detail: String,
    },
    /// A rank passed arguments the operation cannot take (lengths, root, residence, overlap).
    /// Refused before this rank touched any memory. What its peers see depends on the group:
    /// over NCCL the refusal is this rank's alone (peers that issued the operation fail it by
    /// their deadline; a refusal the handle finds leaves its sequence number as it was, one
    /// its comm thread finds, such as a root out of range or a region on another GPU, counts
    /// the operation); the socket group breaks the handle, so peers fail at once; an
    /// in-process group counts the operation (the sequence number advances) and fails its
    /// round on every rank at once. A caller that goes on after a refusal its peers may not
    /// share must [`abort`](Collective::abort) the group first (the linker aborts on every
    /// failed step), or its next operation may pair with the peers' refused one.
    #[error("{op} #{seq}: rank {rank}: {reason}")]
    InvalidArgument {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// The rank with the bad arguments.
        rank: u32,
        /// What is wrong.
        reason: String,
    },
    /// The transport failed (e.g. an NCCL error).
    #[error("collective backend: {0}")]
    Backend(String),
    /// A socket to a peer failed with an error other than a hang-up (a group of processes);
    /// the socket's error is the source.
    #[error("{op} #{seq}: rank {rank}: socket to rank {peer}: {source}")]
    Socket {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// This rank.
        rank: u32,
        /// The peer at the other end.
        peer: u32,
        /// The socket's error.
        #[source]
        source: SocketError,
    },
    /// This rank's wait on the sockets to its peers (`poll`) failed (a group of processes):
    /// its own failure, no peer's. The wait's error is the source.
    #[error("{op} #{seq}: rank {rank}: waiting on the sockets to its peers: {source}")]
    Wait {
        /// The operation.
        op: &'static str,
        /// Its sequence number.
        seq: u64,
        /// This rank.
        rank: u32,
        /// The wait's error.
        #[source]
        source: SocketError,
    },
    /// A device call the collective depends on failed (its stream, an event, a copy); the
    /// device's error is the source.
    #[error("collective backend: {what}: {source}")]
    Device {
        /// What the collective was doing.
        what: &'static str,
        /// The device's error.
        #[source]
        source: kv_device::DeviceError,
    },
    /// This implementation does not offer the operation (e.g. device operations on a group
    /// that moves host memory only). Nothing was issued: the sequence number did not advance.
    #[error("{op}: not supported by this collective ({detail})")]
    Unsupported {
        /// The operation.
        op: &'static str,
        /// Why, or what the implementation moves instead.
        detail: String,
    },
    /// The group could not be re-formed ([`GroupFormation`](crate::GroupFormation)): ranks
    /// that did not come by the deadline (`missing`), or a refusal or failure (`detail`).
    /// The formation's typed error is the source where it gave one
    /// ([`is_refusal`](Self::is_refusal) tells a refusal from a missing rank).
    #[error("re-forming the group (epoch {epoch}){}: {detail}", if missing.is_empty() { String::new() } else { format!(", ranks {missing:?} missing") })]
    Formation {
        /// The epoch asked for.
        epoch: u64,
        /// Ranks that did not come (empty when the formation failed otherwise).
        missing: Vec<u32>,
        /// What happened.
        detail: String,
        /// The formation's error, where it gave one.
        #[source]
        cause: Option<FormationFailure>,
    },
}

impl CollectiveError {
    /// True for a formation refused as configured (by rendezvous: rank 0 found another world
    /// size, geometry, version or group setting, or a rank claimed twice): trying again
    /// without changing a rank's settings fails the same way.
    ///
    /// ```
    /// use dedup_broadcast::{CollectiveError, FormationFailure};
    /// let refused = CollectiveError::Formation {
    ///     epoch: 2,
    ///     missing: vec![],
    ///     detail: "rank 1 joined the group twice".into(),
    ///     cause: Some(FormationFailure::new(std::io::Error::other("twice"), true)),
    /// };
    /// assert!(refused.is_refusal());
    /// let late = CollectiveError::Formation {
    ///     epoch: 2,
    ///     missing: vec![3],
    ///     detail: "timed out".into(),
    ///     cause: None,
    /// };
    /// assert!(!late.is_refusal());
    /// ```
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            CollectiveError::Formation {
                cause: Some(c),
                ..
            } if c.is_refusal()
        )
    }

    /// The operation's sequence number, where the error names one.
    pub fn seq(&self) -> Option<u64> {
        match self {
            CollectiveError::Timeout { seq, .. }
            | CollectiveError::Aborted { seq, .. }
            | CollectiveError::RankGone { seq, .. }
            | CollectiveError::SizeMismatch { seq, .. }
            | CollectiveError::Mismatch { seq, .. }
            | CollectiveError::InvalidArgument { seq, .. }
            | CollectiveError::Socket { seq, .. }
            | CollectiveError::Wait { seq, .. } => Some(*seq),
            CollectiveError::Backend(_)
            | CollectiveError::Device { .. }
            | CollectiveError::Unsupported { .. }
            | CollectiveError::Formation { .. } => None,
        }
    }
}

/// A socket's `io::Error`, shared so that a [`CollectiveError`] stays `Clone`; two are equal
/// when their kind and text are.
///
/// ```
/// use std::io;
/// use dedup_broadcast::SocketError;
/// let e = SocketError::from(io::Error::new(io::ErrorKind::BrokenPipe, "peer reset"));
/// assert_eq!(e.io().kind(), io::ErrorKind::BrokenPipe);
/// assert_eq!(e.clone(), e);
/// ```
#[derive(Debug, Clone)]
pub struct SocketError(std::sync::Arc<std::io::Error>);

impl SocketError {
    /// The socket's error.
    pub fn io(&self) -> &std::io::Error {
        &self.0
    }
}

impl From<std::io::Error> for SocketError {
    fn from(e: std::io::Error) -> Self {
        SocketError(std::sync::Arc::new(e))
    }
}

impl std::fmt::Display for SocketError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Transparent, as thiserror's `#[error(transparent)]`: the display is the `io::Error`'s,
/// so the source is the `io::Error`'s own (a chain walker prints the socket's error once;
/// [`io`](SocketError::io) gives the `io::Error` itself).
impl std::error::Error for SocketError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

impl PartialEq for SocketError {
    fn eq(&self, other: &Self) -> bool {
        self.0.kind() == other.0.kind() && self.0.to_string() == other.0.to_string()
    }
}

impl Eq for SocketError {}

/// Why a formation failed, inside a [`CollectiveError::Formation`]: the formation's typed
/// error (a [`RendezvousError`] for [`RendezvousFormation`]; `error().downcast_ref` finds it)
/// and whether it is a refusal, which trying again without changing a rank's settings does
/// not cure. Shared so that a [`CollectiveError`] stays `Clone`; two are equal when their
/// text and refusal are.
///
/// [`RendezvousError`]: crate::RendezvousError
/// [`RendezvousFormation`]: crate::RendezvousFormation
///
/// ```
/// use dedup_broadcast::FormationFailure;
/// let f = FormationFailure::new(std::io::Error::other("rank 0 unreachable"), false);
/// assert!(!f.is_refusal());
/// assert!(f.error().downcast_ref::<std::io::Error>().is_some());
/// assert_eq!(f.clone(), f);
/// ```
#[derive(Debug, Clone)]
pub struct FormationFailure {
    error: std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>,
    refusal: bool,
}

impl FormationFailure {
    /// `error`, a refusal or not.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static, refusal: bool) -> Self {
        FormationFailure {
            error: std::sync::Arc::new(error),
            refusal,
        }
    }

    /// The formation's error.
    pub fn error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.error
    }

    /// True when the group was refused as configured.
    pub fn is_refusal(&self) -> bool {
        self.refusal
    }
}

#[cfg(target_os = "linux")]
impl From<crate::RendezvousError> for FormationFailure {
    fn from(e: crate::RendezvousError) -> Self {
        let refusal = e.is_refusal();
        FormationFailure::new(e, refusal)
    }
}

impl std::fmt::Display for FormationFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

/// Transparent, as thiserror's `#[error(transparent)]`: the display is the formation's
/// error's, so the source is that error's own ([`error`](FormationFailure::error) gives the
/// error itself).
impl std::error::Error for FormationFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error.source()
    }
}

impl PartialEq for FormationFailure {
    fn eq(&self, other: &Self) -> bool {
        self.refusal == other.refusal && self.error.to_string() == other.error.to_string()
    }
}

impl Eq for FormationFailure {}

impl From<CollectiveError> for kv_loader::KvLoadError {
    fn from(e: CollectiveError) -> Self {
        kv_loader::KvLoadError::Collective {
            batch: None,
            detail: kv_loader::Cause::from_error(e),
        }
    }
}

/// The word of the confirming round of the default settled gathers
/// ([`Collective::all_gather_u64_settled`]): what it carries is not looked at, only that
/// every rank took part.
const SETTLED: u64 = 0x5e77_1ed0;

/// The collective operations of one rank of a TP group.
///
/// **Ordering.** Every rank issues the same operations with matching arguments (same kind,
/// same root, same lengths) in the same order; the n-th call on one rank's handle meets the
/// n-th call on every other's. Calls on one handle must not overlap in time.
///
/// **Deadlines.** No call waits past its `deadline` for a rank that has not arrived: it
/// returns [`CollectiveError::Timeout`] naming the missing ranks. (It may still wait,
/// briefly, for peers that are in the middle of copying from or to its memory: that wait is
/// bounded by the copy, not by another rank's progress.)
///
/// **Memory (the `unsafe` methods).** The caller guarantees, for the whole call (and, for the
/// device operations, until the returned event completes): every region or row is valid for
/// reads (what is sent) or writes (what receives) of its length, in the memory it names, and
/// stays allocated; nothing else touches a receiving region nor writes a sending one; the
/// regions of different ranks do not overlap one another (each rank has its own). The safe
/// wrappers ([`share_rows`](crate::share_rows), [`share_stage`](crate::share_stage),
/// [`broadcast_slice`], ...) get these guarantees from the typed handles they take.
///
/// On `Ok`, host rows hold the result and may be reused at once; device regions are done
/// once the returned event completes. On `Err`, receiving memory holds unspecified bytes
/// (never used as data: the operation failed on every rank that got the error).
///
/// # Safety
/// Implementing it: the safe wrappers free or reuse memory on an implementation's word, so
/// an implementation promises:
/// - a host operation (`*_rows`) touches no row once it has returned or unwound;
/// - a device operation's returned event completes only after every access of the operation
///   to its region, on every stream and thread (it is the region's only fence);
/// - a device operation that fails with work of it possibly still in flight on the region
///   says so: [`may_leave_work`](Collective::may_leave_work) answers `true` for that error
///   (the default answers `true` whenever [`broken`](Collective::broken) does, so a handle
///   that may leave work behind must report itself broken, or override `may_leave_work`).
///
/// A decorator that forwards the device operations to another handle forwards `broken` (and
/// `may_leave_work` where the inner one overrides it), and returns the inner event or one that
/// completes after it.
pub unsafe trait Collective: Send + Sync {
    /// This rank, `0..size()`.
    fn rank(&self) -> u32;

    /// Ranks in the group.
    fn size(&self) -> u32;

    /// Every rank gets every rank's `value`, in rank order. By default an
    /// [`all_gather_bytes`](Collective::all_gather_bytes) of its 8 little-endian bytes; a
    /// collective that tells this operation apart from a byte gather overrides it.
    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        let all = self.all_gather_bytes(&value.to_le_bytes(), deadline)?;
        Ok(u64_words(&all))
    }

    /// [`all_gather_u64`](Collective::all_gather_u64) for a verdict that no later operation
    /// settles (a batch's last status word): `Ok` on one rank means every rank received
    /// every value, so that a rank that gave up (its deadline passed) before confirming fails
    /// the others too rather than leaving them with `Ok`. (A rank that gives up after it
    /// confirmed, while waiting for the others' confirmations, still fails alone: one
    /// message's time.)
    ///
    /// By default the gather, then a second gather that confirms it: a rank takes part in the
    /// second only once it has every value of the first, so a rank that gave up in the first
    /// leaves every other rank's second to fail by its deadline. A plain gather is not enough
    /// where a rank's value can land on its peers before the rank itself has the others' (NCCL:
    /// a rank that sent its share and then timed out leaves a late peer with the whole
    /// result). A collective whose operation's fate is decided once for every rank (the
    /// in-process group) overrides this with its plain gather; the socket group, with its own
    /// completion round. A wrapper of a collective should forward this method (else it gets
    /// the default's two rounds: still settled, one round slower).
    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        let all = self.all_gather_u64(value, deadline)?;
        self.all_gather_u64(SETTLED, deadline)?;
        Ok(all)
    }

    /// [`all_gather_bytes`](Collective::all_gather_bytes) for a decision the ranks act on
    /// apart before any later operation could bring them in step (a batch's gate: whether
    /// they load together): settled as
    /// [`all_gather_u64_settled`](Collective::all_gather_u64_settled) is, by default with the
    /// same confirming second gather. A wrapper should forward it.
    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let all = self.all_gather_bytes(value, deadline)?;
        self.all_gather_u64(SETTLED, deadline)?;
        Ok(all)
    }

    /// Every rank gets every rank's `value` (the same length on every rank), in rank order.
    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError>;

    /// The minimum of every rank's `value` (lookups: the loadable prefix; verdicts).
    fn all_reduce_min_u64(&self, value: u64, deadline: Instant) -> Result<u64, CollectiveError> {
        let all = self.all_gather_u64(value, deadline)?;
        Ok(all.into_iter().min().unwrap_or(value))
    }

    /// Which data operations this collective moves: host rows, device regions, or both.
    fn memory(&self) -> MemorySupport {
        MemorySupport {
            host: true,
            device: false,
        }
    }

    /// The GPU (its ordinal) this handle's device operations run on, for a collective bound
    /// to one GPU (NCCL; an in-process group's rank on its device), so that a linker can
    /// refuse a pool on another GPU at build instead of failing every share; `None` (the
    /// default) when it is bound to none or does not say. A wrapper should forward it.
    fn device_ordinal(&self) -> Option<u32> {
        None
    }

    /// **Host rows, broadcast.** `rows` are the same count with the same lengths on every
    /// rank (a layer's replicated rows in plan order); root's rows are read, every other
    /// rank's rows receive root's row `i` into its row `i`. Completes before it returns.
    ///
    /// # Safety
    /// The trait's memory rules, per row: on the root every row is valid for reads and not
    /// written by anyone during the call; elsewhere every row is valid for writes and touched
    /// by nothing else during the call. Rows of one rank do not overlap one another.
    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let _ = (rows, root, deadline);
        Err(CollectiveError::Unsupported {
            op: "broadcast_rows",
            detail: "host rows are not implemented by this collective".into(),
        })
    }

    /// **Host rows, all-gather in place.** `rows` are the same count with the same lengths on
    /// every rank; rank `r` owns rows `counts[..r].sum() .. counts[..=r].sum()` and holds
    /// their bytes already; on return every rank's rows hold every owner's bytes.
    /// `counts.len() == size()` and `counts` sum to `rows.len()` (the same on every rank).
    ///
    /// # Safety
    /// As for [`broadcast_rows`](Collective::broadcast_rows): this rank's own rows are read,
    /// every other row is written; no row is touched by anything else during the call.
    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let _ = (rows, counts, deadline);
        Err(CollectiveError::Unsupported {
            op: "all_gather_rows",
            detail: "host rows are not implemented by this collective".into(),
        })
    }

    /// **Device region, broadcast, event-ordered.** Enqueues, on this rank's comm stream
    /// and after `after` (an event of another stream: the copy that filled the root's
    /// region, or whatever last used a receiver's), a broadcast of root's `region` into
    /// every other rank's `region` (same length everywhere), and returns at once with the
    /// event that completes when this rank's part is done (receivers: the bytes are in;
    /// root: its region is no longer read). The call itself (matching with the other ranks,
    /// enqueueing) is bounded by `deadline`; the returned event may still never complete (a
    /// peer that never issues its part): the caller waits on it with a deadline and then
    /// calls [`abort`](Collective::abort).
    ///
    /// # Safety
    /// `region` is device memory of this rank's device, valid for reads (root) or writes
    /// (others) of `region.len` bytes, and nothing else touches it from the moment `after`
    /// completes until the returned event completes, and it stays allocated until then. On
    /// `Err` the region is free again once the call returns only while
    /// [`broken`](Collective::broken) is `None`: an error with the handle broken (an abort, a
    /// comm thread that stopped answering) may leave work queued on it, so the region must
    /// be taken as in use for good (never reused nor freed).
    unsafe fn broadcast_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        root: u32,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let _ = (region, after, root, deadline);
        Err(CollectiveError::Unsupported {
            op: "broadcast_device",
            detail: "this collective moves host memory only".into(),
        })
    }

    /// **Device region, all-gather in place, event-ordered.** `region` holds `size()` chunks
    /// of `region.len / size()` bytes; this rank's chunk `rank()` is filled (after `after`);
    /// when the returned event completes every chunk holds its owner's bytes. Deadline and
    /// event as for [`broadcast_device`](Collective::broadcast_device).
    ///
    /// # Safety
    /// As for [`broadcast_device`](Collective::broadcast_device); `region.len` is a multiple
    /// of `size()`, the same on every rank.
    unsafe fn all_gather_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let _ = (region, after, deadline);
        Err(CollectiveError::Unsupported {
            op: "all_gather_device",
            detail: "this collective moves host memory only".into(),
        })
    }

    /// Gives up every operation of this rank in flight, because a wait on one of them passed
    /// its deadline (e.g. a device event that never completed). NCCL aborts its communicator;
    /// the group is then [`broken`](Collective::broken) until it is re-formed. Implementations
    /// whose operations cannot be left in flight do nothing.
    fn abort(&self, cause: &str) {
        let _ = cause;
    }

    /// `Some(why)` once this handle can no longer run operations (aborted, a peer process
    /// gone for good): the group must be re-formed before the next batch shares.
    fn broken(&self) -> Option<String> {
        None
    }

    /// Whether a device operation ([`broadcast_device`](Self::broadcast_device),
    /// [`all_gather_device`](Self::all_gather_device)) that failed with `error` may have left
    /// work in flight on its region: then the region must never be reused or freed (a stage is
    /// poisoned). The default says so whenever the handle is [`broken`](Self::broken) after the
    /// failure, as one whose failure may leave work behind is. An implementation that knows
    /// nothing was enqueued (a round that failed before it committed), or that the work it
    /// enqueued has ended (NCCL's once its abort drained the comm stream), answers `false`, so
    /// that a failed share does not cost the caller its staging for good.
    fn may_leave_work(&self, error: &CollectiveError) -> bool {
        let _ = error;
        self.broken().is_some()
    }
}

/// Which memory a [`Collective`]'s data operations move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySupport {
    /// Host rows ([`Collective::broadcast_rows`], [`Collective::all_gather_rows`]).
    pub host: bool,
    /// Device regions ([`Collective::broadcast_device`], [`Collective::all_gather_device`]).
    pub device: bool,
}

/// A broadcast of a host slice: the root sends `buf`, every other rank receives into it
/// ([`Collective::broadcast_rows`] of one row).
///
/// Safe: the exclusive borrow makes `buf` this call's alone.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{broadcast_slice, InProcessGroup};
/// let ranks = InProcessGroup::new(1);
/// let mut buf = *b"hello";
/// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
/// broadcast_slice(&ranks[0], &mut buf, 0, deadline).unwrap();
/// assert_eq!(&buf, b"hello");
/// ```
pub fn broadcast_slice(
    coll: &dyn Collective,
    buf: &mut [u8],
    root: u32,
    deadline: Instant,
) -> Result<(), CollectiveError> {
    let row = HostRow {
        addr: buf.as_mut_ptr() as usize,
        len: buf.len(),
    };
    // SAFETY: `buf` is exclusively borrowed for the whole call, so it is valid for reads and
    // writes of its length and nothing else touches it; another rank's `&mut` slice cannot
    // alias it.
    unsafe { coll.broadcast_rows(&[row], root, deadline) }
}

/// An all-gather of host slices: `recv` (`size() * send.len()` bytes) gets every rank's `send`
/// in rank order. `send` is copied into this rank's chunk of `recv` first, then
/// [`all_gather_in_place`] runs.
pub fn all_gather_slices(
    coll: &dyn Collective,
    send: &[u8],
    recv: &mut [u8],
    deadline: Instant,
) -> Result<(), CollectiveError> {
    let size = coll.size() as usize;
    if send.len().checked_mul(size) != Some(recv.len()) {
        let whole = HostRow {
            addr: recv.as_mut_ptr() as usize,
            len: recv.len(),
        };
        // SAFETY: `recv` is exclusively borrowed; counts of 0 never sum to one row, so every
        // implementation refuses the call before touching memory (the peers' side of the
        // refusal is as `InvalidArgument` says; no memory is touched on any rank).
        return unsafe { coll.all_gather_rows(&[whole], &vec![0; size], deadline) };
    }
    let at = coll.rank() as usize * send.len();
    if let Some(mine) = recv.get_mut(at..at + send.len()) {
        mine.copy_from_slice(send);
    }
    all_gather_in_place(coll, recv, deadline)
}

/// In-place all-gather of a host slice: with `n = buf.len() / size()`, this rank's chunk
/// `buf[rank*n..(rank+1)*n]` holds its part; on return `buf` holds every rank's
/// ([`Collective::all_gather_rows`] of one row per rank). A `buf` that does not split into
/// `size()` equal chunks is refused by the collective (on every rank alike).
pub fn all_gather_in_place(
    coll: &dyn Collective,
    buf: &mut [u8],
    deadline: Instant,
) -> Result<(), CollectiveError> {
    let size = coll.size().max(1) as usize;
    let chunk = buf.len() / size;
    let base = buf.as_mut_ptr() as usize;
    let whole = chunk * size == buf.len();
    let rows: Vec<HostRow> = if whole {
        (0..size)
            .map(|r| HostRow {
                addr: base + r * chunk,
                len: chunk,
            })
            .collect()
    } else {
        vec![HostRow {
            addr: base,
            len: buf.len(),
        }]
    };
    let counts = vec![1usize; size];
    // SAFETY: every row lies inside `buf`, which is exclusively borrowed for the call (valid,
    // untouched by anything else, host memory); rows of one chunk each do not overlap. A
    // shape that does not split into `size` chunks is refused before any copy (the counts do
    // not sum to the rows).
    unsafe { coll.all_gather_rows(&rows, &counts, deadline) }
}

/// True when per-rank `counts` add up to exactly `rows` (without overflowing: counts are
/// the caller's input).
pub(crate) fn counts_cover(counts: &[usize], rows: usize) -> bool {
    counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)) == Some(rows)
}

/// Little-endian `u64`s from gathered 8-byte values (a shorter value is zero-padded), in rank
/// order: how `all_gather_u64` implementations decode what they gathered as bytes.
pub(crate) fn u64_words(all: &[Vec<u8>]) -> Vec<u64> {
    all.iter()
        .map(|v| {
            let mut w = [0u8; 8];
            let k = v.len().min(8);
            w[..k].copy_from_slice(&v[..k]);
            u64::from_le_bytes(w)
        })
        .collect()
}

#[cfg(test)]
mod error_tests {
    use super::*;

    #[test]
    fn a_device_failure_keeps_the_device_error_as_its_source() {
        let device = kv_device::DeviceError::Poisoned("share area");
        let e = CollectiveError::Device {
            what: "comm stream",
            source: device.clone(),
        };
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(
            source.downcast_ref::<kv_device::DeviceError>(),
            Some(&device)
        );
        assert!(e.to_string().contains("comm stream"), "{e}");
        assert_eq!(e.seq(), None);
    }

    #[test]
    fn a_socket_failure_keeps_the_io_error_as_its_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let e = CollectiveError::Socket {
            op: "broadcast_rows",
            seq: 7,
            rank: 1,
            peer: 2,
            source: io.into(),
        };
        let source = std::error::Error::source(&e).expect("a source");
        let socket = source.downcast_ref::<SocketError>().expect("a SocketError");
        assert_eq!(socket.io().kind(), std::io::ErrorKind::ConnectionReset);
        assert_eq!(e.seq(), Some(7));
        assert_eq!(e.clone(), e);
        assert_eq!(
            e.to_string(),
            "broadcast_rows #7: rank 1: socket to rank 2: reset by peer"
        );
        // A chain walker prints the socket's error once: the wrapper is transparent.
        let texts = chain(&e);
        assert_eq!(
            texts.iter().filter(|t| t.contains("reset by peer")).count(),
            2,
            "the operation's line and the socket's: {texts:?}"
        );
    }

    /// Every level's text of `e` and its sources.
    fn chain(e: &dyn std::error::Error) -> Vec<String> {
        std::iter::successors(Some(e), |e| e.source())
            .map(ToString::to_string)
            .collect()
    }

    /// Before, `FormationFailure` displayed its error and gave it as its source too, so a
    /// chain walker printed the formation's error twice below the `Formation` line.
    #[test]
    fn a_formation_failure_is_transparent() {
        let io = std::io::Error::other("rank 0 unreachable");
        let e = CollectiveError::Formation {
            epoch: 3,
            missing: vec![],
            detail: "rendezvous failed".into(),
            cause: Some(FormationFailure::new(io, false)),
        };
        let texts = chain(&e);
        assert_eq!(texts.len(), 2, "{texts:?}");
        assert_eq!(texts[1], "rank 0 unreachable");
        let Some(CollectiveError::Formation { cause: Some(f), .. }) = Some(&e) else {
            unreachable!()
        };
        assert!(f.error().downcast_ref::<std::io::Error>().is_some());
    }
}
