//! Which of the group's handles a batch or a lookup is using now, so that a re-formation on
//! the other thread replaces a handle in use without aborting it under its user.
//!
//! A collective's last exchange (a batch's verdict, a lookup's agreement) can end `Ok` on one
//! rank and `Err` on another when one rank's handle is aborted in the middle of it: the ranks
//! that already had every word succeed, the aborted one fails. The linker's two threads each
//! re-form the group when they find a handle broken, and the re-formation aborts the old
//! handles so that peers waiting on them fail at once. A handle that is not broken and that
//! the other thread is using is therefore *retired* instead: it stays as it is, and is
//! aborted when its last use ends (peers still waiting on it then fail at once, as before).

use std::collections::HashMap;
use std::sync::Arc;

use dedup_broadcast::{Collective, GroupHandles};
use parking_lot::Mutex;

/// One of the two handles of a formation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Channel {
    /// The load thread's handle.
    Data,
    /// The lookups' handle.
    Control,
}

impl Channel {
    fn of(self, handles: &GroupHandles) -> &Arc<dyn Collective> {
        match self {
            Channel::Data => &handles.data,
            Channel::Control => &handles.control,
        }
    }
}

/// Uses of each (channel, epoch) handle, and the handles replaced while in use.
#[derive(Default)]
pub(crate) struct HandleUses {
    state: Mutex<UseState>,
}

#[derive(Default)]
struct UseState {
    users: HashMap<(Channel, u64), usize>,
    retired: Vec<(Channel, u64, Arc<dyn Collective>)>,
    /// The newest epoch a re-formation has replaced (both its handles, aborted or retired): no
    /// new use may begin on it or an older one. Without this, a use begun between the
    /// replacement's decision and its abort (the abort runs outside the lock) would be
    /// aborted under its user. Epochs only grow, so one number says it.
    replaced_through: Option<u64>,
}

/// The handle asked for was replaced by a re-formation: take the group's handles again.
#[derive(Debug)]
pub(crate) struct Replaced;

impl HandleUses {
    /// Marks `channel`'s handle of `handles` as used until the returned mark is dropped; a
    /// handle already broken is not marked (nothing would wait to abort it). A handle a
    /// re-formation has replaced is refused ([`Replaced`]): the caller takes the new one.
    pub(crate) fn begin(
        self: &Arc<Self>,
        handles: &GroupHandles,
        channel: Channel,
    ) -> Result<HandleInUse, Replaced> {
        let mut s = self.state.lock();
        if s.replaced_through.is_some_and(|e| handles.epoch <= e) {
            return Err(Replaced);
        }
        if channel.of(handles).broken().is_some() {
            return Ok(HandleInUse {
                uses: None,
                handle: None,
            });
        }
        *s.users.entry((channel, handles.epoch)).or_default() += 1;
        Ok(HandleInUse {
            uses: Some((self.clone(), channel, handles.epoch)),
            handle: Some(channel.of(handles).clone()),
        })
    }

    /// Aborts the handles of `old` (a formation being replaced) with `cause`, except a handle
    /// not broken and in use now: that one is retired, to be aborted when its last use ends.
    pub(crate) fn replace(&self, old: &GroupHandles, cause: &str) {
        for channel in [Channel::Data, Channel::Control] {
            let handle = channel.of(old);
            let busy = {
                let mut s = self.state.lock();
                s.replaced_through = s.replaced_through.max(Some(old.epoch));
                let busy = handle.broken().is_none()
                    && s.users.get(&(channel, old.epoch)).is_some_and(|n| *n > 0);
                if busy {
                    s.retired.push((channel, old.epoch, handle.clone()));
                }
                busy
            };
            if busy {
                tracing::info!(
                    ?channel,
                    epoch = old.epoch,
                    cause,
                    "a handle in use is replaced: it is aborted when that use ends"
                );
            } else {
                handle.abort(cause);
            }
        }
    }

    fn end(&self, channel: Channel, epoch: u64) {
        let ended = {
            let mut s = self.state.lock();
            let Some(n) = s.users.get_mut(&(channel, epoch)) else {
                return;
            };
            *n -= 1;
            if *n > 0 {
                return;
            }
            s.users.remove(&(channel, epoch));
            let (ended, kept) = std::mem::take(&mut s.retired)
                .into_iter()
                .partition(|(c, e, _)| *c == channel && *e == epoch);
            s.retired = kept;
            ended
        };
        for (channel, epoch, handle) in ended {
            tracing::debug!(
                ?channel,
                epoch,
                "a replaced handle's last use ended: aborting it"
            );
            handle.abort("the group was re-formed while this handle was in use");
        }
    }
}

/// A use of one handle (a batch's data handle, a lookup's control handle); ends when dropped.
/// A use that ends in a panic (its user unwinding) aborts the handle it used: the run may
/// have left its collectives out of step, and peers still waiting on them fail at once. Only
/// that handle: a newer formation is the peers' too, and aborting it would fail their next
/// batch as well.
pub(crate) struct HandleInUse {
    uses: Option<(Arc<HandleUses>, Channel, u64)>,
    handle: Option<Arc<dyn Collective>>,
}

impl Drop for HandleInUse {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(handle) = self.handle.take() {
                handle.abort("its user panicked: its collectives may be out of step");
            }
        }
        if let Some((uses, channel, epoch)) = self.uses.take() {
            uses.end(channel, epoch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dedup_broadcast::InProcessGroup;
    use std::time::{Duration, Instant};

    fn formation(epoch: u64) -> Vec<GroupHandles> {
        InProcessGroup::new(3)
            .into_iter()
            .zip(InProcessGroup::new(3))
            .map(|(d, c)| GroupHandles {
                data: Arc::new(d),
                control: Arc::new(c),
                epoch,
            })
            .collect()
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(10)
    }

    #[test]
    fn a_handle_not_in_use_is_aborted_at_once() {
        let uses = Arc::new(HandleUses::default());
        let old = formation(0);
        uses.replace(&old[1], "re-forming");
        assert!(old[1].data.broken().is_some());
        assert!(old[1].control.broken().is_some());
    }

    #[test]
    fn a_handle_in_use_is_aborted_when_its_use_ends() {
        let uses = Arc::new(HandleUses::default());
        let old = formation(0);
        let batch = uses.begin(&old[1], Channel::Data).unwrap();
        uses.replace(&old[1], "re-forming");
        assert!(
            old[1].control.broken().is_some(),
            "the control handle was idle"
        );
        assert!(old[1].data.broken().is_none(), "kept for the batch on it");
        drop(batch);
        assert!(
            old[1].data.broken().is_some(),
            "aborted once the batch ended"
        );
    }

    /// The review's sequence: ranks 0 and 2 and rank 1's load thread are in a batch's last
    /// exchange when rank 1's lookup thread re-forms the group. Before, the re-formation
    /// aborted rank 1's data handle under it: rank 0 could end `Ok` and ranks 1 and 2 `Err`.
    #[test]
    fn a_re_formation_on_one_thread_leaves_the_last_exchange_of_a_batch_whole() {
        let uses = Arc::new(HandleUses::default());
        let old = formation(0);
        let batch = uses.begin(&old[1], Channel::Data).unwrap();
        let results: Vec<_> = std::thread::scope(|s| {
            let gathers: Vec<_> = [0usize, 1]
                .into_iter()
                .map(|r| {
                    let h = old[r].data.clone();
                    s.spawn(move || h.all_gather_u64(r as u64, far()))
                })
                .collect();
            std::thread::sleep(Duration::from_millis(50));
            uses.replace(&old[1], "control handle broke (lookup thread re-forms)");
            std::thread::sleep(Duration::from_millis(20));
            let h = old[2].data.clone();
            let last = s.spawn(move || h.all_gather_u64(2, far()));
            let mut r: Vec<_> = gathers.into_iter().map(|g| g.join().unwrap()).collect();
            r.push(last.join().unwrap());
            r
        });
        for (rank, r) in results.iter().enumerate() {
            assert_eq!(r.as_ref().ok(), Some(&vec![0, 1, 2]), "rank {rank}: {r:?}");
        }
        drop(batch);
        assert!(old[1].data.broken().is_some());
    }

    /// A use asked for once a re-formation has decided on a handle (its abort may still be on
    /// its way, outside the lock) is refused: begun in that gap, it would be aborted under its
    /// user. The caller takes the new handles instead.
    #[test]
    fn no_use_begins_on_a_handle_a_re_formation_replaced() {
        let uses = Arc::new(HandleUses::default());
        let old = formation(4);
        uses.replace(&old[1], "re-forming");
        assert!(uses.begin(&old[1], Channel::Control).is_err());
        assert!(uses.begin(&old[1], Channel::Data).is_err());
        // Another epoch's handles are not affected.
        let fresh = formation(5);
        assert!(uses.begin(&fresh[1], Channel::Control).is_ok());
    }
}
