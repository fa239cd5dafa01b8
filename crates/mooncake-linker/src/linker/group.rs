//! The TP group a linker shares replicated KV with, and the linker's live handles on it
//! ([`GroupLink`]), re-formed (data and control together) when either broke.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::{
    Collective, CollectiveError, GroupFormation, GroupHandles, InProcessCollective,
    InProcessFormation, InProcessGroup,
};
use kv_device::Device;
use kv_loader::{BatchId, Cause, KvLoadError};
use parking_lot::Mutex;

use super::handle_use::{Channel, HandleInUse, HandleUses, Replaced};
use crate::log_every::LogEvery;

/// One rank's handles on its TP group: `data` carries the per-layer exchanges of the load
/// thread, `control` the lookups of the engine's thread. Two handles, because the two
/// threads issue collectives independently and one handle's operations must stay in one
/// order on every rank (NCCL's rule: over NCCL these are two communicators). `formation`,
/// when given, makes fresh handles (both) after either broke (a rank died, a collective was
/// aborted): groups of threads ([`TpGroup::in_process`]), of processes
/// ([`TpGroup::from_rendezvous`]) and in-process NCCL groups (`NcclGroup::formation`) have
/// one.
#[derive(Clone)]
pub struct TpGroup {
    /// Used by the load thread only: gate, status words, the share of each layer.
    pub data: Arc<dyn Collective>,
    /// Used by `lookup` only: the minimum loadable prefix over the group.
    pub control: Arc<dyn Collective>,
    /// Re-forms both handles after either broke; without one, a broken group fails every
    /// later batch and lookup (`KvLoadError::GroupDown`).
    pub formation: Option<Arc<dyn GroupFormation>>,
}

impl std::fmt::Debug for TpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TpGroup")
            .field("rank", &self.data.rank())
            .field("size", &self.data.size())
            .field("formation", &self.formation.is_some())
            .finish()
    }
}

impl TpGroup {
    /// Handles for `size` ranks that are threads of this process, moving host memory (rank
    /// `r` gets element `r`).
    ///
    /// ```
    /// let groups = mooncake_linker::TpGroup::in_process(4);
    /// assert_eq!(groups.len(), 4);
    /// assert_eq!(groups[2].data.rank(), 2);
    /// ```
    pub fn in_process(size: u32) -> Vec<TpGroup> {
        let formation = InProcessFormation::host(size);
        Self::with_host_control(InProcessGroup::new(size), Arc::new(formation))
    }

    /// Handles for ranks that are threads of this process, rank `r` on `devices[r]` (ranks
    /// may share one device): the data handle shares layers in device memory, each rank with
    /// its own comm stream; lookups go through a host group.
    ///
    /// ```
    /// use kv_device::{CpuDevice, Device};
    /// use std::sync::Arc;
    /// let dev: Arc<dyn Device> = CpuDevice::new(0).unwrap();
    /// let groups = mooncake_linker::TpGroup::in_process_on_devices(vec![dev.clone(), dev]).unwrap();
    /// assert!(groups[1].data.memory().device);
    /// ```
    pub fn in_process_on_devices(
        devices: Vec<Arc<dyn Device>>,
    ) -> Result<Vec<TpGroup>, dedup_broadcast::CollectiveError> {
        let formation = InProcessFormation::on_devices(devices.clone());
        let data = InProcessGroup::on_devices(devices)?;
        Ok(Self::with_host_control(data, Arc::new(formation)))
    }

    /// Each of `data` (rank `r`'s data handle at `r`) with a control handle of a new
    /// in-process host group of the same size, both re-formed by `formation`.
    fn with_host_control(
        data: Vec<InProcessCollective>,
        formation: Arc<dyn GroupFormation>,
    ) -> Vec<TpGroup> {
        let control = InProcessGroup::new(data.len() as u32);
        data.into_iter()
            .zip(control)
            .map(|(data, control)| TpGroup {
                data: Arc::new(data),
                control: Arc::new(control),
                formation: Some(formation.clone()),
            })
            .collect()
    }

    /// Ranks in the group.
    pub fn size(&self) -> u32 {
        self.data.size()
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.data.rank()
    }
}

/// Why the group cannot be used now: broken, and not re-formed by the deadline.
#[derive(Debug, Clone)]
pub(crate) struct GroupDown {
    /// Ranks that did not come back (empty: refused, or no formation).
    pub(crate) missing: Vec<u32>,
    /// Refused as configured: trying again does not cure it.
    pub(crate) refused: bool,
    /// Why, with the formation's typed error where there is one.
    pub(crate) detail: Cause,
}

impl GroupDown {
    /// Down for `detail`, with no formation's error behind it.
    fn plain(detail: String) -> Self {
        GroupDown {
            missing: Vec::new(),
            refused: false,
            detail: Cause::new(detail),
        }
    }

    /// The typed error a batch (or, with `None`, a lookup) fails with.
    pub(crate) fn error(&self, batch: Option<BatchId>) -> KvLoadError {
        KvLoadError::GroupDown {
            batch,
            missing: self.missing.clone(),
            refused: self.refused,
            detail: self.detail.clone(),
        }
    }
}

impl std::fmt::Display for GroupDown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

/// A linker's live handles on its group, shared by the load thread (data) and lookups
/// (control). When either handle is broken, the first of them to need the group re-forms it
/// through the formation: both handles at once (one formation makes both), the old ones
/// aborted first so that peers still waiting on them fail at once, except one the other
/// thread is using now, which is aborted when that use ends ([`HandleUses`]). One
/// re-formation at a time in this process; a caller that waited for another's sees its
/// result.
pub(crate) struct GroupLink {
    rank: u32,
    current: Mutex<GroupHandles>,
    formation: Option<Arc<dyn GroupFormation>>,
    reforming: Mutex<()>,
    uses: Arc<HandleUses>,
    /// The refusal logged last at `error` (every batch and lookup re-forms while the group is
    /// refused).
    refusal_log: LogEvery,
    /// The group-down lines logged last at `warn` by a batch, and by a lookup, going alone
    /// (`GroupFallback::ReadAlone`): each of them does while the group is down (one each:
    /// lookups and batches alternate). Cleared when the group re-forms.
    pub(crate) down_batch_log: LogEvery,
    pub(crate) down_lookup_log: LogEvery,
    /// Set once this linker told the formation it left ([`leave`](Self::leave)).
    left: AtomicBool,
    /// Re-formations this link made that completed (`MetricsSnapshot::group_reforms`).
    reforms: AtomicU64,
    /// Held by a lookup across its collective on the control handle: calls on one handle
    /// must not overlap, and an engine may look up from several threads of one rank.
    lookup_turn: Mutex<()>,
}

impl GroupLink {
    /// This rank's turn on the control handle for one lookup, waited for until `by` (`None`
    /// past it: another lookup of this rank held it that long).
    pub(crate) fn lookup_turn(
        &self,
        by: std::time::Instant,
    ) -> Option<parking_lot::MutexGuard<'_, ()>> {
        self.lookup_turn.try_lock_until(by)
    }

    /// Logs a refusal of the group at `error`: once while the same one lasts, again every
    /// minute (and at `debug` in between).
    fn log_refusal(&self, epoch: u64, e: &CollectiveError) {
        if !self.refusal_log.due(&e.to_string()) {
            tracing::debug!(rank = self.rank, epoch, error = %e, "the group is still refused");
            return;
        }
        tracing::error!(
            rank = self.rank,
            epoch,
            error = %e,
            "the group was refused as configured: batches and lookups fail until a rank's \
             settings change (logged again every minute while it lasts)"
        );
    }

    /// The link of `group`, when this linker shares with other ranks.
    pub(crate) fn of(group: Option<&TpGroup>) -> Option<Arc<GroupLink>> {
        group.filter(|g| g.size() > 1).map(|g| {
            if let Some(f) = &g.formation {
                f.enter(g.rank());
            }
            Arc::new(GroupLink {
                rank: g.rank(),
                current: Mutex::new(GroupHandles {
                    data: g.data.clone(),
                    control: g.control.clone(),
                    epoch: 0,
                }),
                formation: g.formation.clone(),
                reforming: Mutex::new(()),
                uses: Arc::default(),
                refusal_log: LogEvery::default(),
                down_batch_log: LogEvery::default(),
                down_lookup_log: LogEvery::default(),
                left: AtomicBool::new(false),
                reforms: AtomicU64::new(0),
                lookup_turn: Mutex::new(()),
            })
        })
    }

    /// Re-formations this link made that completed.
    pub(crate) fn reforms(&self) -> u64 {
        self.reforms.load(Ordering::Relaxed)
    }

    /// This linker is done with the group (it closed; once). When it was the rank's last
    /// user the formation counts, the rank has left: its handles are aborted, so that peers
    /// waiting on them fail now, and fail each later formation at once, rather than each at
    /// its deadline.
    pub(crate) fn leave(&self) {
        if self.left.swap(true, Ordering::AcqRel) {
            return;
        }
        let Some(formation) = &self.formation else {
            return;
        };
        if formation.leave(self.rank) {
            let handles = self.current.lock().clone();
            tracing::info!(rank = self.rank, epoch = handles.epoch, "leaving the group");
            handles.abort(&format!(
                "rank {} left the group (its linker closed)",
                self.rank
            ));
        }
    }

    /// The handles to use now, with `channel`'s marked in use until the mark is dropped (a
    /// batch holds its data handle's mark to its end, a lookup its control handle's): see
    /// [`handles`](Self::handles).
    pub(crate) fn handles_for(
        &self,
        channel: Channel,
        deadline: Instant,
    ) -> Result<(GroupHandles, HandleInUse), GroupDown> {
        loop {
            let handles = self.handles(deadline)?;
            match self.uses.begin(&handles, channel) {
                Ok(in_use) => return Ok((handles, in_use)),
                // Replaced since `handles` read them (a re-formation on the other thread):
                // take them again, which waits for that re-formation.
                Err(Replaced) if Instant::now() < deadline => continue,
                Err(Replaced) => {
                    return Err(GroupDown::plain(format!(
                        "the group's handles of epoch {} were replaced and no new ones came by \
                         the deadline",
                        handles.epoch
                    )))
                }
            }
        }
    }

    /// The handles to use now: re-formed first when either is broken. A re-formation that
    /// does not complete by `deadline` (the formation may bound it sooner) fails: the caller
    /// fails its batch or lookup, and the next one tries again.
    fn handles(&self, deadline: Instant) -> Result<GroupHandles, GroupDown> {
        let seen = self.current.lock().clone();
        let Some(why) = seen.broken() else {
            return Ok(seen);
        };
        let Some(formation) = &self.formation else {
            return Err(GroupDown::plain(format!(
                "the group is broken ({why}) and has no formation"
            )));
        };
        let Some(_one) = self.reforming.try_lock_until(deadline) else {
            return Err(GroupDown::plain(format!(
                "the group is broken ({why}); another re-formation of rank {} is still running",
                self.rank
            )));
        };
        let now = self.current.lock().clone();
        let why = match now.broken() {
            None => return Ok(now),
            Some(w) => w,
        };
        self.uses
            .replace(&now, &format!("re-forming the group: {why}"));
        // Saturating: an epoch at the top (a peer's) makes the formation refuse, not panic.
        let epoch = now.epoch.saturating_add(1);
        match formation.reform(self.rank, epoch, deadline) {
            Ok(fresh) => {
                self.reforms.fetch_add(1, Ordering::Relaxed);
                tracing::info!(
                    rank = self.rank,
                    epoch = fresh.epoch,
                    why,
                    "group re-formed"
                );
                *self.current.lock() = fresh.clone();
                // The outage ended: the next one's lines go out at once.
                for log in [
                    &self.refusal_log,
                    &self.down_batch_log,
                    &self.down_lookup_log,
                ] {
                    log.clear();
                }
                Ok(fresh)
            }
            Err(e) => {
                let refused = e.is_refusal();
                if refused {
                    self.log_refusal(epoch, &e);
                }
                Err(GroupDown {
                    missing: match &e {
                        CollectiveError::Formation { missing, .. } => missing.clone(),
                        _ => Vec::new(),
                    },
                    refused,
                    detail: Cause::with_source(
                        format!("the group broke ({why}) and did not re-form: {e}"),
                        e,
                    ),
                })
            }
        }
    }
}

/// A link dropped without [`GroupLink::leave`] (its linker's build failed after it was made)
/// still leaves, so that the formation's count of the rank's users stays true.
impl Drop for GroupLink {
    fn drop(&mut self) {
        self.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// The lookup thread finds the control handle broken and re-forms while a batch holds the
    /// data handle: the data handle is left to the batch and aborted when it lets go.
    fn deadline() -> Instant {
        kv_loader::deadline_after(Duration::from_secs(5))
    }

    /// A batch takes the data handle, then a lookup finds the control handle broken and
    /// re-forms: the batch's handles and use, the new handles and the lookup's use.
    fn re_formed_during_a_batch(
        link: &GroupLink,
    ) -> (GroupHandles, HandleInUse, GroupHandles, HandleInUse) {
        let (old, batch) = link.handles_for(Channel::Data, deadline()).unwrap();
        old.control.abort("a lookup's collective failed");
        let (fresh, lookup) = link.handles_for(Channel::Control, deadline()).unwrap();
        (old, batch, fresh, lookup)
    }

    #[test]
    fn a_re_formation_leaves_the_data_handle_a_batch_holds_until_it_lets_go() {
        let groups = TpGroup::in_process(3);
        let link = GroupLink::of(Some(&groups[1])).unwrap();
        let (old, batch, fresh, lookup) = re_formed_during_a_batch(&link);
        assert!(fresh.epoch > old.epoch, "re-formed");
        assert!(old.data.broken().is_none(), "left to the batch");
        drop(lookup);
        drop(batch);
        assert!(old.data.broken().is_some(), "aborted once the batch let go");
        assert!(fresh.broken().is_none());
    }

    /// Before, a batch that panicked aborted the group's *current* data handle: after a
    /// re-formation during the batch that was the new formation, which every rank had just
    /// made, and every rank's next batch failed at its gate.
    #[test]
    fn a_batch_that_panics_aborts_the_handle_it_used_not_a_newer_one() {
        let groups = TpGroup::in_process(3);
        let link = GroupLink::of(Some(&groups[1])).unwrap();
        let (old, batch, fresh, lookup) = re_formed_during_a_batch(&link);
        drop(lookup);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _batch = batch;
            panic!("a store the engine supplied panicked");
        }));
        assert!(unwound.is_err());
        assert!(
            old.data.broken().is_some(),
            "the batch's own handle is aborted"
        );
        assert!(
            fresh.data.broken().is_none(),
            "the newer formation is left alone"
        );
        // With no re-formation, the handle the panicking batch used is the current one.
        let (now, batch) = link.handles_for(Channel::Data, deadline()).unwrap();
        assert_eq!(now.epoch, fresh.epoch);
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _batch = batch;
            panic!("again");
        }));
        assert!(now.data.broken().is_some());
    }

    /// A formation that refuses the group as configured.
    struct Refusing;

    impl GroupFormation for Refusing {
        fn reform(
            &self,
            _rank: u32,
            epoch: u64,
            _deadline: Instant,
        ) -> Result<GroupHandles, CollectiveError> {
            Err(CollectiveError::Formation {
                epoch,
                missing: Vec::new(),
                detail: "rank 1 runs another geometry".into(),
                cause: Some(dedup_broadcast::FormationFailure::new(
                    std::io::Error::other("rank 1 runs another geometry"),
                    true,
                )),
            })
        }
    }

    /// A group refused as configured fails batches and lookups as `GroupDown { refused }`,
    /// which the engine fixes rather than retries, with the formation's error as its source.
    #[test]
    fn a_refused_re_formation_is_a_group_down_to_fix_not_to_retry() {
        let mut group = TpGroup::in_process(2).swap_remove(1);
        group.formation = Some(Arc::new(Refusing));
        let link = GroupLink::of(Some(&group)).unwrap();
        group.data.abort("a peer died");
        let down = link
            .handles_for(
                Channel::Control,
                kv_loader::deadline_after(Duration::from_secs(5)),
            )
            .err()
            .expect("refused");
        for batch in [None, Some(BatchId(3))] {
            let e = down.error(batch);
            assert!(
                matches!(e, KvLoadError::GroupDown { refused: true, .. }),
                "{e}"
            );
            assert_eq!(e.action(), kv_loader::EngineAction::FixInput, "{e}");
            assert!(!e.is_retryable());
        }
        let KvLoadError::GroupDown { detail, .. } = down.error(None) else {
            unreachable!()
        };
        assert!(
            detail
                .downcast_ref::<CollectiveError>()
                .is_some_and(|c| c.is_refusal()),
            "{detail}"
        );
    }
}
