//! Typed errors a server can act on: which batch, which layer, which pages, retryable or not.

use std::sync::Arc;
use std::time::Duration;

use kv_geometry::GeometryError;

use crate::{BatchId, Cause};

/// Why a plan was refused before any I/O.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// The plan has a different number of slots than pages.
    #[error("{slots} slots for {pages} pages")]
    SlotCount {
        /// Pages in the logical plan.
        pages: usize,
        /// Slots given.
        slots: usize,
    },
    /// A token row that does not start a page.
    #[error("token row {row} is not a multiple of the page size {page_size}")]
    Misaligned {
        /// The row.
        row: u64,
        /// Page size.
        page_size: u32,
    },
    /// A token row whose page number does not fit a slot number (`u32`).
    #[error("token row {row} is page {}, past the largest slot number", row / u64::from((*page_size).max(1)))]
    RowOutOfRange {
        /// The row.
        row: u64,
        /// Page size.
        page_size: u32,
    },
    /// A page size of zero: no token row starts a page.
    #[error("the page size is zero")]
    ZeroPageSize,
    /// Two pages of the plan land in the same slot.
    #[error("slot {slot} is used by pages {first} and {second} of the plan")]
    DuplicateSlot {
        /// The slot.
        slot: u32,
        /// First plan page using it.
        first: usize,
        /// Second plan page using it.
        second: usize,
    },
    /// A slot past the end of the pool.
    #[error("slot {slot} (page {page} of the plan) is outside a pool of {pool_pages} pages")]
    SlotOutOfPool {
        /// The slot.
        slot: u32,
        /// Plan page.
        page: usize,
        /// Pages in the pool.
        pool_pages: u32,
    },
    /// A component id the geometry does not have, or listed twice (or out of order).
    #[error("component #{0} is unknown or repeated")]
    BadComponent(u16),
    /// A plan with pages and no component: it would move nothing, and its slots would read as
    /// loaded. [`BatchPlan::all_components`](crate::BatchPlan::all_components) names every
    /// component of a geometry.
    #[error("{pages} pages and no component to load")]
    NoComponents {
        /// Pages in the plan.
        pages: usize,
    },
    /// A slot that a batch in flight (started, its outcome not taken yet) lands in too: the
    /// two would write each other's pages, and the engine read the later batch's KV for the
    /// earlier one. Take the other batch's outcome first.
    #[error(
        "slot {slot} (page {page} of the plan) belongs to batch {batch}, in flight (its \
         outcome not taken yet)"
    )]
    SlotInFlight {
        /// The slot.
        slot: u32,
        /// Plan page.
        page: usize,
        /// The batch in flight that lands in it.
        batch: crate::BatchId,
    },
    /// A layer past the model.
    #[error("layer {layer} is out of range for {num_layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers of the model.
        num_layers: u32,
    },
    /// The store holds an object whose size does not match the geometry.
    #[error("object `{key}` holds {actual} bytes, the geometry expects {expected}")]
    ObjectSize {
        /// The key.
        key: String,
        /// Bytes expected.
        expected: u64,
        /// Bytes found.
        actual: u64,
    },
    /// A layer of the batch needs more staging than a stage holds: the loader's staging was
    /// sized for fewer pages (nothing was started; recompute, and cap later hits at what the
    /// staging holds).
    #[error("layer {layer} needs {need} bytes of staging, a stage holds {stage}")]
    LargerThanStaging {
        /// The first layer that does not fit.
        layer: u32,
        /// Its bytes.
        need: u64,
        /// A stage's bytes.
        stage: u64,
    },
}

/// The kind of a store failure, as the linker saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreFailure {
    /// The object is not in the store.
    NotFound,
    /// The store has no room.
    NoSpace,
    /// The data transfer failed.
    TransferFailed,
    /// A lease ran out or could not be taken.
    Lease,
    /// An RPC to the store timed out.
    RpcTimeout,
    /// The store refused an argument.
    InvalidArgument,
    /// The store cannot be reached.
    Unavailable,
    /// Fewer bytes came back than asked for.
    ShortRead,
    /// Anything else, with the store's code in the detail.
    Other,
}

impl StoreFailure {
    /// Whether trying again later may succeed.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            StoreFailure::TransferFailed
                | StoreFailure::Lease
                | StoreFailure::RpcTimeout
                | StoreFailure::Unavailable
                | StoreFailure::NoSpace
                | StoreFailure::ShortRead
        )
    }
}

/// Everything that can go wrong loading or saving KV. Cheap to clone (every rank and every
/// waiter of a failed batch gets a copy). Non-exhaustive, as [`PlanError`] is: new failure
/// kinds may come; match the cases you handle with a `_` arm, and let
/// [`action`](KvLoadError::action) say what to do about the rest.
///
/// ```
/// use kv_loader::{BatchId, KvLoadError, StoreFailure};
/// let e = KvLoadError::Store {
///     batch: Some(BatchId(7)),
///     layer: Some(12),
///     pages: vec![3, 4].into(),
///     kind: StoreFailure::RpcTimeout,
///     detail: "key glm_ab.._k: rpc timeout".into(),
/// };
/// assert!(e.is_retryable());
/// assert_eq!(e.batch(), Some(BatchId(7)));
/// assert!(e.to_string().contains("layer 12"));
/// ```
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum KvLoadError {
    /// The plan was refused before any I/O.
    #[error("{batch}: invalid plan: {reason}")]
    InvalidPlan {
        /// The batch.
        batch: BatchId,
        /// Why.
        reason: PlanError,
    },
    /// A store operation failed.
    #[error("{}store failure ({kind:?}){}{}: {detail}", batch.map(|b| format!("{b}: ")).unwrap_or_default(), layer.map(|l| format!(" at layer {l}")).unwrap_or_default(), pages_suffix(pages))]
    Store {
        /// The batch, if the failure belongs to one.
        batch: Option<BatchId>,
        /// The layer being read, if any.
        layer: Option<u32>,
        /// Plan page indices involved.
        pages: Arc<[u32]>,
        /// What kind of failure.
        kind: StoreFailure,
        /// The store's words, with the key; the store's typed error is its source where
        /// there is one (`Cause::downcast_ref`).
        #[source]
        detail: Cause,
    },
    /// A wait reached its deadline.
    #[error("{batch}: layer {layer} not ready after {waited:?}")]
    Timeout {
        /// The batch.
        batch: BatchId,
        /// The layer waited for.
        layer: u32,
        /// How long.
        waited: Duration,
    },
    /// The batch was cancelled by `reset` or `close`.
    #[error("{batch}: cancelled")]
    Cancelled {
        /// The batch.
        batch: BatchId,
    },
    /// A TP rank failed this batch; every rank reports the same failure (the first: lowest
    /// layer, then lowest rank). On the rank that failed (`rank` is its own), `detail` also
    /// carries its own error's words.
    #[error("{batch}: rank {rank} failed at layer {layer}: {detail}")]
    PeerFailed {
        /// The batch.
        batch: BatchId,
        /// The rank that failed first.
        rank: u32,
        /// The layer where it failed.
        layer: u32,
        /// What that rank said.
        detail: String,
    },
    /// A collective operation among the TP ranks failed or timed out.
    #[error("{}collective failure: {detail}", batch.map(|b| format!("{b}: ")).unwrap_or_default())]
    Collective {
        /// The batch, if any.
        batch: Option<BatchId>,
        /// What happened; the collective's typed error is its source where there is one
        /// (`Cause::downcast_ref`).
        #[source]
        detail: Cause,
    },
    /// The TP group is down: it broke (a rank died, a collective was aborted) and could not
    /// be re-formed in time (`missing`: the ranks that are not back; empty when the group has
    /// no formation or a rank was refused, as `detail` says). Nothing was read or moved. The
    /// action says what to do: a batch's pages are recomputed (`Recompute`), a lookup's
    /// answer is retried later (`RetryLater`), and a later batch or lookup tries to re-form
    /// the group again; a refused group is `FixInput`.
    /// `refused`: the group was refused as configured (the ranks differ in world size,
    /// geometry, version or group settings, or a rank was claimed twice), which trying again
    /// does not cure until a rank's settings change.
    #[error("{}TP group unavailable{}{}: {detail}", batch.map(|b| format!("{b}: ")).unwrap_or_default(), if missing.is_empty() { String::new() } else { format!(" (ranks {missing:?} not back)") }, if *refused { " (refused as configured)" } else { "" })]
    GroupDown {
        /// The batch, if the failure belongs to one (`None`: a lookup).
        batch: Option<BatchId>,
        /// Ranks that did not come back in time.
        missing: Vec<u32>,
        /// Whether the formation was refused as configured.
        refused: bool,
        /// Why the group is down and why it could not re-form; the formation's typed error
        /// is its source where there is one (`Cause::downcast_ref`).
        #[source]
        detail: Cause,
    },
    /// A device (copy, event, allocation) failure; the device backend's typed error is its
    /// source where there is one (`Cause::downcast_ref`).
    #[error("device failure: {0}")]
    Device(#[source] Cause),
    /// The ticket belongs to a batch whose outcome was taken (`wait_batch`, `completed`), or
    /// one a `reset` or `close` ended. A batch that finished and whose outcome is not taken yet
    /// still answers its layer waits.
    #[error("stale ticket for {batch}")]
    StaleTicket {
        /// The batch the ticket named.
        batch: BatchId,
    },
    /// Too many batches in flight: take outcomes (`wait_batch`/`completed`) first.
    #[error("{capacity} batches already in flight{}", if *peers_fail { " (refused in a TP group: every rank fails this batch)" } else { "" })]
    Busy {
        /// Batches the loader tracks at once.
        capacity: u32,
        /// The refusal goes to this rank's TP peers (a loader in a group tells its peers, so
        /// that none waits for this rank's part): they fail the batch too (unless the group is
        /// down and they load alone, `ReadAlone`), so it is to be recomputed, not started
        /// again ([`EngineAction::Recompute`]; a start of it again would find the peers past
        /// it).
        ///
        /// [`EngineAction::Recompute`]: crate::EngineAction::Recompute
        peers_fail: bool,
    },
    /// The loader is closed.
    #[error("the loader is closed")]
    Closed,
    /// Bad geometry or configuration.
    #[error("geometry: {0}")]
    Geometry(#[from] GeometryError),
    /// Bad configuration or set-up of the loader (what it was given, or what it could not set
    /// up with it: registering memory with the store, starting its threads); the typed error
    /// behind it is the source where there is one (`Cause::downcast_ref`).
    #[error("configuration: {0}")]
    Config(#[source] Cause),
    /// A batch failed inside the loader: one of its own steps out of order, a helper thread
    /// that could not start or panicked. Nothing the engine gave was wrong; the batch's pages
    /// are recomputed. The typed error behind it is the source where there is one.
    #[error("{}internal failure: {cause}", batch.map(|b| format!("{b}: ")).unwrap_or_default())]
    Internal {
        /// The batch, when one failed.
        batch: Option<BatchId>,
        /// What failed.
        #[source]
        cause: Cause,
    },
    /// `start_load` of a batch id that is already in flight on this rank (started, its
    /// outcome not yet taken): refused before anything was counted; the batch in flight is
    /// untouched.
    #[error("{batch} is already in flight: take its outcome before starting it again")]
    DuplicateBatch {
        /// The batch.
        batch: BatchId,
    },
    /// An object failed verification before its bytes were reported loaded (its checksum
    /// companion does not match a layer's bytes, or the companion is malformed). The object
    /// and its companion were discarded, so the next save writes them again.
    #[error("{batch}: object `{key}`{} failed verification: {detail}", layer.map(|l| format!(" layer {l}")).unwrap_or_default())]
    BadObject {
        /// The batch.
        batch: BatchId,
        /// The object's key.
        key: String,
        /// The layer whose bytes failed, when one did.
        layer: Option<u32>,
        /// What did not match.
        detail: String,
    },
    /// `reset` or `close` returned while store calls that outlived their deadline, or device
    /// copies a failed batch queued that outlived the landing's drain limit, may still write
    /// these batches' slots: keep those slots out of use until each batch's outcome is handed
    /// out (`wait_batch`/`completed`), which happens when its last such call or copy ends.
    /// A layer wait answers the same, on this rank alone (its peers get the batch's error),
    /// when the batch failed while such a call or copy is still out; the outcome carries the
    /// batch's own error.
    #[error("store calls past their deadline or unfinished device copies may still write the slots of {batches:?}; their outcomes come when those end")]
    SlotsHeld {
        /// The batches whose slots are held.
        batches: Arc<[BatchId]>,
    },
}

/// Whether a peer's error of kind `kind` ([`KvLoadError::kind_name`], or a group's code name
/// such as `out_of_step`) may pass when tried again, as [`KvLoadError::is_retryable`] answers
/// for that kind on the failing rank. A peer's `busy` is a refusal its peers fail too
/// (`peers_fail`): not retryable. A kind that does not say (`group_down`, whose flag is not
/// in the name; a group's own codes; one unknown to this build) counts as retryable.
fn kind_is_retryable(kind: &str) -> bool {
    !matches!(
        kind,
        "busy"
            | "invalid_plan"
            | "store_not_found"
            | "store_invalid_argument"
            | "store_other"
            | "stale_ticket"
            | "closed"
            | "geometry"
            | "config"
            | "duplicate_batch"
            | "bad_object"
            | "slots_held"
            | "internal"
            | "device"
    )
}

fn pages_suffix(pages: &[u32]) -> String {
    match pages.len() {
        0 => String::new(),
        1..=8 => format!(" (plan pages {pages:?})"),
        n => format!(" ({n} plan pages from {})", pages[0]),
    }
}

impl KvLoadError {
    /// Whether the same load may succeed if tried again (the engine may also recompute).
    /// A [`PeerFailed`](KvLoadError::PeerFailed) answers as the failing rank's own error
    /// would (its kind leads `detail`): an object missing from the store is not retryable in a
    /// TP group either. A [`Busy`](KvLoadError::Busy) refusal the peers fail too is not: they
    /// are past the batch.
    pub fn is_retryable(&self) -> bool {
        match self {
            KvLoadError::Store { kind, .. } => kind.is_retryable(),
            KvLoadError::GroupDown { refused, .. } => !refused,
            KvLoadError::Busy { peers_fail, .. } => !peers_fail,
            KvLoadError::PeerFailed { .. } => kind_is_retryable(self.cause_kind()),
            KvLoadError::Timeout { .. }
            | KvLoadError::Collective { .. }
            | KvLoadError::Cancelled { .. } => true,
            _ => false,
        }
    }

    /// The kind of what failed: [`kind_name`](Self::kind_name), except for a
    /// [`PeerFailed`](KvLoadError::PeerFailed), the failing rank's own kind that leads its
    /// `detail` (`store_not_found`, `cancelled`, ...; a group's own codes such as
    /// `out_of_step` too).
    ///
    /// ```
    /// use kv_loader::{BatchId, KvLoadError};
    /// let e = KvLoadError::PeerFailed {
    ///     batch: BatchId(3),
    ///     rank: 1,
    ///     layer: 0,
    ///     detail: "store_not_found: batch 3: `k`: not found".into(),
    /// };
    /// assert_eq!((e.kind_name(), e.cause_kind()), ("peer_failed", "store_not_found"));
    /// ```
    pub fn cause_kind(&self) -> &str {
        match self {
            KvLoadError::PeerFailed { detail, .. } => {
                detail.split(':').next().unwrap_or_default().trim()
            }
            e => e.kind_name(),
        }
    }

    /// A [`Config`](KvLoadError::Config) error: `cause`'s words, and its typed error where it
    /// has one.
    pub fn config(cause: impl Into<Cause>) -> Self {
        KvLoadError::Config(cause.into())
    }

    /// An [`Internal`](KvLoadError::Internal) failure of `batch`.
    pub fn internal(batch: impl Into<Option<BatchId>>, cause: impl Into<Cause>) -> Self {
        KvLoadError::Internal {
            batch: batch.into(),
            cause: cause.into(),
        }
    }

    /// The batch the error belongs to, if any.
    pub fn batch(&self) -> Option<BatchId> {
        match self {
            KvLoadError::InvalidPlan { batch, .. }
            | KvLoadError::Timeout { batch, .. }
            | KvLoadError::Cancelled { batch }
            | KvLoadError::PeerFailed { batch, .. }
            | KvLoadError::StaleTicket { batch }
            | KvLoadError::DuplicateBatch { batch }
            | KvLoadError::BadObject { batch, .. } => Some(*batch),
            KvLoadError::Store { batch, .. }
            | KvLoadError::Collective { batch, .. }
            | KvLoadError::GroupDown { batch, .. }
            | KvLoadError::Internal { batch, .. } => *batch,
            _ => None,
        }
    }

    /// The layer the error happened at, if any.
    pub fn layer(&self) -> Option<u32> {
        match self {
            KvLoadError::Store { layer, .. } => *layer,
            KvLoadError::Timeout { layer, .. } | KvLoadError::PeerFailed { layer, .. } => {
                Some(*layer)
            }
            KvLoadError::BadObject { layer, .. } => *layer,
            _ => None,
        }
    }

    /// Plan page indices involved, where known (empty: the whole batch).
    pub fn pages(&self) -> &[u32] {
        match self {
            KvLoadError::Store { pages, .. } => pages,
            _ => &[],
        }
    }

    /// A short name of the error's kind, for metrics labels.
    pub fn kind_name(&self) -> &'static str {
        match self {
            KvLoadError::InvalidPlan { .. } => "invalid_plan",
            KvLoadError::Store { kind, .. } => match kind {
                StoreFailure::NotFound => "store_not_found",
                StoreFailure::NoSpace => "store_no_space",
                StoreFailure::TransferFailed => "store_transfer",
                StoreFailure::Lease => "store_lease",
                StoreFailure::RpcTimeout => "store_rpc_timeout",
                StoreFailure::InvalidArgument => "store_invalid_argument",
                StoreFailure::Unavailable => "store_unavailable",
                StoreFailure::ShortRead => "store_short_read",
                StoreFailure::Other => "store_other",
            },
            KvLoadError::Timeout { .. } => "timeout",
            KvLoadError::Cancelled { .. } => "cancelled",
            KvLoadError::PeerFailed { .. } => "peer_failed",
            KvLoadError::Collective { .. } => "collective",
            KvLoadError::GroupDown { .. } => "group_down",
            KvLoadError::Device(_) => "device",
            KvLoadError::StaleTicket { .. } => "stale_ticket",
            KvLoadError::Busy { .. } => "busy",
            KvLoadError::Closed => "closed",
            KvLoadError::Geometry(_) => "geometry",
            KvLoadError::Config(_) => "config",
            KvLoadError::DuplicateBatch { .. } => "duplicate_batch",
            KvLoadError::BadObject { .. } => "bad_object",
            KvLoadError::SlotsHeld { .. } => "slots_held",
            KvLoadError::Internal { .. } => "internal",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// A rank's failure reported to its TP peers (`PeerFailed`, its kind leading `detail`) is
    /// retryable exactly when the rank's own error is. Before, every `PeerFailed` was: an
    /// object missing from the store was "retryable" in a TP group and not on one rank.
    #[test]
    fn a_peers_failure_is_retryable_as_the_failing_ranks_own_error() {
        use std::time::Duration;
        let b = BatchId(3);
        let store = |kind| KvLoadError::Store {
            batch: Some(b),
            layer: Some(1),
            pages: vec![0].into(),
            kind,
            detail: String::new().into(),
        };
        let own = [
            store(StoreFailure::NotFound),
            store(StoreFailure::NoSpace),
            store(StoreFailure::TransferFailed),
            store(StoreFailure::Lease),
            store(StoreFailure::RpcTimeout),
            store(StoreFailure::InvalidArgument),
            store(StoreFailure::Unavailable),
            store(StoreFailure::ShortRead),
            store(StoreFailure::Other),
            KvLoadError::Timeout {
                batch: b,
                layer: 0,
                waited: Duration::ZERO,
            },
            KvLoadError::Cancelled { batch: b },
            KvLoadError::Collective {
                batch: Some(b),
                detail: Cause::new("a peer's socket closed"),
            },
            KvLoadError::Device(Cause::new("copy failed")),
            KvLoadError::StaleTicket { batch: b },
            // In a group a rank's refusal is one its peers fail too.
            KvLoadError::Busy {
                capacity: 4,
                peers_fail: true,
            },
            KvLoadError::Closed,
            KvLoadError::config("bad"),
            KvLoadError::DuplicateBatch { batch: b },
            KvLoadError::BadObject {
                batch: b,
                key: "k".into(),
                layer: Some(2),
                detail: "checksum".into(),
            },
            KvLoadError::SlotsHeld {
                batches: vec![b].into(),
            },
            KvLoadError::internal(b, "a step out of order"),
            KvLoadError::InvalidPlan {
                batch: b,
                reason: crate::PlanError::BadComponent(9),
            },
        ];
        for e in &own {
            let kind = e.kind_name();
            for detail in [kind.to_string(), format!("{kind}: {e}")] {
                let peer = KvLoadError::PeerFailed {
                    batch: b,
                    rank: 2,
                    layer: 1,
                    detail,
                };
                assert_eq!(peer.is_retryable(), e.is_retryable(), "{kind}");
            }
        }
        assert!(!own[0].is_retryable(), "an object not found");
        // A refusal its peers fail too: they are past the batch. One alone may pass later.
        let alone = KvLoadError::Busy {
            capacity: 4,
            peers_fail: false,
        };
        assert!(alone.is_retryable());
        // The group's own codes (the ranks out of step) may pass on a later batch.
        let out_of_step = KvLoadError::PeerFailed {
            batch: b,
            rank: 0,
            layer: 0,
            detail: "out_of_step".into(),
        };
        assert!(out_of_step.is_retryable());
    }

    #[test]
    fn config_and_internal_keep_their_typed_source() {
        let io = std::io::Error::new(std::io::ErrorKind::WouldBlock, "no threads left");
        let e = KvLoadError::config(Cause::with_source("spawning the load thread", io));
        let source = e.source().and_then(|s| s.source()).expect("the io error");
        assert!(source.downcast_ref::<std::io::Error>().is_some(), "{e}");
        assert_eq!(e.kind_name(), "config");

        let i = KvLoadError::internal(BatchId(7), "the reader stopped before layer 3");
        assert_eq!(i.batch(), Some(BatchId(7)));
        assert_eq!(i.kind_name(), "internal");
        assert_eq!(
            i.to_string(),
            "batch 7: internal failure: the reader stopped before layer 3"
        );
        assert_eq!(
            KvLoadError::internal(None, "x").to_string(),
            "internal failure: x"
        );
    }
}
