//! What an engine does about a [`KvLoadError`]: one answer per error, so the engine does
//! not infer it from prose.

use crate::KvLoadError;

/// What the engine must do after a load or save call failed. [`KvLoadError::action`] gives
/// it for an error found in a batch's outcome (`BatchOutcome::result`), a layer wait, or a
/// call refused up front.
///
/// Two rules sit outside the error itself: when `wait_batch` / [`LoadHandle::finish`]
/// returns `Err` (no outcome could be taken), the answer is always
/// [`ResetThenRecompute`](Self::ResetThenRecompute), whatever the error; and an error from a
/// layer wait settles nothing: take the batch's outcome first, the action applies then.
///
/// [`LoadHandle::finish`]: crate::LoadHandle::finish
///
/// ```
/// use kv_loader::{BatchId, EngineAction, KvLoadError};
/// let e = KvLoadError::Cancelled { batch: BatchId(4) };
/// assert_eq!(e.action(), EngineAction::Recompute);
/// let e = KvLoadError::Busy { capacity: 8, peers_fail: false };
/// assert_eq!(e.action(), EngineAction::RetryLater);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineAction {
    /// The batch is settled and its pages are not (all) in the pool: compute them as if
    /// there had been no hit, into the same slots. Layers before
    /// [`KvLoadError::layer`] may have landed, but a forward pass needs every layer of a
    /// token, so the engine recomputes the pages' every layer. No page of a failed load is
    /// whole: a batch lands layer by layer across all its pages, so a failure at any layer
    /// leaves every page without its later layers. Nothing else is needed: the loader stays
    /// usable.
    Recompute,
    /// The load may still be writing the batch's slots: call `reset()` on this rank (not a
    /// collective: a batch it cancels fails on every rank alike) before reusing them, then
    /// recompute.
    ResetThenRecompute,
    /// Nothing was started or changed: the same call may succeed later (take outcomes
    /// first for `Busy`; a lookup whose group is down tries to re-form it next time). For a
    /// load, recomputing now is always allowed instead.
    RetryLater,
    /// The call was wrong (plan, ticket, configuration, a closed loader): the same call
    /// fails again. Fix the input; the batch's pages, if any, are recomputed.
    FixInput,
    /// `reset`/`close` returned while store calls past their deadline (or device copies past
    /// the drain limit) may still write the slots of these batches
    /// ([`KvLoadError::SlotsHeld`]): keep those slots out of use (recompute into other slots)
    /// until each batch's outcome is handed out. A layer wait answers the same when its batch
    /// failed while such a call or copy is still out: take the batch's outcome (it comes once
    /// they end, and names what failed) before reusing the slots. A `start_load` refused
    /// for a slot of a batch in flight (`PlanError::SlotInFlight`) answers the same: that
    /// batch (named in the error) may still write the slot; its pages go into other slots.
    HoldSlots,
}

impl KvLoadError {
    /// What the engine must do about this error (see [`EngineAction`] for the one rule
    /// about `wait_batch` itself failing).
    ///
    /// | variant | action |
    /// |---|---|
    /// | `Store`, `PeerFailed`, `Collective`, `GroupDown` (a batch's, not refused), `BadObject`, `Internal`, `Cancelled`, `InvalidPlan` of an object of the wrong size (`PlanError::ObjectSize`: store data, discarded unless another writer's) or of a batch larger than the staging (`PlanError::LargerThanStaging`: nothing started), `Busy` refused in a TP group (`peers_fail`) | `Recompute` |
    /// | `Timeout`, `Device` | `ResetThenRecompute` |
    /// | `Busy` of one rank (not `peers_fail`), `GroupDown` (a lookup's, `batch: None`, not refused) | `RetryLater` |
    /// | `InvalidPlan` (any other reason), `StaleTicket`, `DuplicateBatch`, `Closed`, `Config`, `Geometry`, `GroupDown` (`refused`) | `FixInput` |
    /// | `SlotsHeld`, `InvalidPlan` of a slot of a batch in flight (`PlanError::SlotInFlight`) | `HoldSlots` |
    ///
    /// `Timeout` is a layer wait's deadline: the batch is still in flight. `Device` may
    /// leave copies in flight. `DuplicateBatch` leaves the batch in flight untouched: use a
    /// new id.
    pub fn action(&self) -> EngineAction {
        match self {
            KvLoadError::Store { .. }
            | KvLoadError::PeerFailed { .. }
            | KvLoadError::Collective { .. }
            | KvLoadError::BadObject { .. }
            | KvLoadError::Internal { .. }
            | KvLoadError::Cancelled { .. } => EngineAction::Recompute,
            // Bad store data, not a bad plan: the object was discarded and the next save
            // rewrites it, so the same plan later misses instead of failing again.
            KvLoadError::InvalidPlan {
                reason: crate::PlanError::ObjectSize { .. },
                ..
            } => EngineAction::Recompute,
            // Nothing was started: recomputing needs no reset.
            KvLoadError::InvalidPlan {
                reason: crate::PlanError::LargerThanStaging { .. },
                ..
            } => EngineAction::Recompute,
            // The named batch may still write the slot: recomputing into it would race it
            // (the engine reused the slot before that batch's outcome, say after an abort).
            KvLoadError::InvalidPlan {
                reason: crate::PlanError::SlotInFlight { .. },
                ..
            } => EngineAction::HoldSlots,
            KvLoadError::GroupDown { refused: true, .. } => EngineAction::FixInput,
            KvLoadError::GroupDown { batch: Some(_), .. } => EngineAction::Recompute,
            KvLoadError::Busy {
                peers_fail: true, ..
            } => EngineAction::Recompute,
            KvLoadError::GroupDown { batch: None, .. } | KvLoadError::Busy { .. } => {
                EngineAction::RetryLater
            }
            KvLoadError::Timeout { .. } | KvLoadError::Device(_) => {
                EngineAction::ResetThenRecompute
            }
            KvLoadError::InvalidPlan { .. }
            | KvLoadError::StaleTicket { .. }
            | KvLoadError::DuplicateBatch { .. }
            | KvLoadError::Closed
            | KvLoadError::Config(_)
            | KvLoadError::Geometry(_) => EngineAction::FixInput,
            KvLoadError::SlotsHeld { .. } => EngineAction::HoldSlots,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{BatchId, Cause, PlanError, StoreFailure};
    use std::time::Duration;

    #[test]
    fn every_variant_has_the_documented_action() {
        let b = BatchId(1);
        let cases = [
            (
                KvLoadError::Store {
                    batch: Some(b),
                    layer: Some(2),
                    pages: vec![0].into(),
                    kind: StoreFailure::NotFound,
                    detail: String::new().into(),
                },
                EngineAction::Recompute,
            ),
            (
                KvLoadError::Timeout {
                    batch: b,
                    layer: 0,
                    waited: Duration::ZERO,
                },
                EngineAction::ResetThenRecompute,
            ),
            (KvLoadError::Cancelled { batch: b }, EngineAction::Recompute),
            (
                KvLoadError::GroupDown {
                    batch: None,
                    missing: vec![2],
                    refused: false,
                    detail: Cause::new(""),
                },
                EngineAction::RetryLater,
            ),
            (
                KvLoadError::GroupDown {
                    batch: Some(b),
                    missing: vec![2],
                    refused: false,
                    detail: Cause::new(""),
                },
                EngineAction::Recompute,
            ),
            (
                KvLoadError::GroupDown {
                    batch: None,
                    missing: vec![],
                    refused: true,
                    detail: Cause::new("rank 1 runs another geometry"),
                },
                EngineAction::FixInput,
            ),
            (
                KvLoadError::GroupDown {
                    batch: Some(b),
                    missing: vec![],
                    refused: true,
                    detail: Cause::new("rank 1 runs another geometry"),
                },
                EngineAction::FixInput,
            ),
            (
                KvLoadError::InvalidPlan {
                    batch: b,
                    reason: PlanError::BadComponent(9),
                },
                EngineAction::FixInput,
            ),
            // An object of the wrong size in the store: discarded, the plan was fine.
            (
                KvLoadError::InvalidPlan {
                    batch: b,
                    reason: PlanError::ObjectSize {
                        key: "k".into(),
                        expected: 64,
                        actual: 32,
                    },
                },
                EngineAction::Recompute,
            ),
            // A batch larger than the staging: nothing started, no reset needed.
            (
                KvLoadError::InvalidPlan {
                    batch: b,
                    reason: PlanError::LargerThanStaging {
                        layer: 0,
                        need: 64,
                        stage: 32,
                    },
                },
                EngineAction::Recompute,
            ),
            (
                KvLoadError::Busy {
                    capacity: 1,
                    peers_fail: false,
                },
                EngineAction::RetryLater,
            ),
            (
                KvLoadError::Busy {
                    capacity: 1,
                    peers_fail: true,
                },
                EngineAction::Recompute,
            ),
            (KvLoadError::Closed, EngineAction::FixInput),
            (
                KvLoadError::internal(b, "a step out of order"),
                EngineAction::Recompute,
            ),
            (
                KvLoadError::config("a setting out of range"),
                EngineAction::FixInput,
            ),
            (
                KvLoadError::Device("x".into()),
                EngineAction::ResetThenRecompute,
            ),
            (
                KvLoadError::SlotsHeld {
                    batches: vec![b].into(),
                },
                EngineAction::HoldSlots,
            ),
            (
                KvLoadError::InvalidPlan {
                    batch: BatchId(2),
                    reason: PlanError::SlotInFlight {
                        slot: 3,
                        page: 0,
                        batch: b,
                    },
                },
                EngineAction::HoldSlots,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.action(), want, "{e}");
        }
    }
}
