//! The seats of an in-process formation's epochs, and the lock over them: each rank's handles
//! of an epoch (open until taken, then held weakly), and the guard that aborts the open seats
//! of ranks that left whenever the lock is let go.

use std::collections::HashMap;
use std::sync::{Arc, Weak};

use super::{GroupHandles, InProcessFormation, Members};
use crate::Collective;

/// One rank's seat in one epoch's group.
pub(super) enum Seat {
    /// Built, not taken yet.
    Open(GroupHandles),
    /// Taken: the handles, weakly (only the rank's linkers keep them alive, so that a rank
    /// that drops them is seen gone by its peers).
    Taken {
        data: Weak<dyn Collective>,
        control: Weak<dyn Collective>,
    },
}

impl Seat {
    /// The taken handles, while they live. A handle upgraded alone (its pair was gone) goes
    /// into `upgraded`, for the caller to drop after its lock: it may be that handle's last
    /// reference, whose drop may join a comm thread.
    pub(super) fn held(
        &self,
        epoch: u64,
        upgraded: &mut Vec<Arc<dyn Collective>>,
    ) -> Option<GroupHandles> {
        match self {
            Seat::Open(_) => None,
            Seat::Taken { data, control } => {
                let data = data.upgrade()?;
                let Some(control) = control.upgrade() else {
                    upgraded.push(data);
                    return None;
                };
                Some(GroupHandles {
                    data,
                    control,
                    epoch,
                })
            }
        }
    }

    /// Taken, and dropped since by every user of the rank (counted, not upgraded: an upgrade
    /// dropped here could be a handle's last, whose drop may join a comm thread under the lock).
    pub(super) fn lost(&self) -> bool {
        match self {
            Seat::Open(_) => false,
            Seat::Taken { data, control } => {
                data.strong_count() == 0 || control.strong_count() == 0
            }
        }
    }
}

/// Per epoch, every rank's seat.
pub(super) type Epochs = HashMap<u64, Vec<Seat>>;

/// The formation's epochs, held. When let go, every open seat of a rank that left is aborted,
/// after the lock (an NCCL abort may wait for its comm thread), so that the peers that took
/// their seats fail at once. A rank's `leave` does not wait for the lock: whoever holds it
/// then aborts that rank's seats as it lets go, and the members lock, held from the look at
/// who left until the epochs are let go, keeps a `leave` from slipping in between.
// The fields drop in this order after `drop`: the epochs' lock, the members', then the aborts.
pub(super) struct HeldEpochs<'f> {
    epochs: parking_lot::MutexGuard<'f, Epochs>,
    members: Option<parking_lot::MutexGuard<'f, Members>>,
    aborts: AbortOnDrop,
    formation: &'f InProcessFormation,
}

impl<'f> HeldEpochs<'f> {
    pub(super) fn new(
        formation: &'f InProcessFormation,
        epochs: parking_lot::MutexGuard<'f, Epochs>,
    ) -> Self {
        HeldEpochs {
            epochs,
            members: None,
            aborts: AbortOnDrop(Vec::new()),
            formation,
        }
    }
}

impl std::ops::Deref for HeldEpochs<'_> {
    type Target = Epochs;

    fn deref(&self) -> &Epochs {
        &self.epochs
    }
}

impl std::ops::DerefMut for HeldEpochs<'_> {
    fn deref_mut(&mut self) -> &mut Epochs {
        &mut self.epochs
    }
}

impl Drop for HeldEpochs<'_> {
    fn drop(&mut self) {
        let members = self.formation.members.lock();
        let epochs = &self.epochs;
        self.aborts.0 = members
            .left
            .iter()
            .flat_map(|&r| {
                epochs
                    .values()
                    .filter_map(move |seats| match seats.get(r as usize) {
                        // Either handle still working (data and control break apart): `abort`
                        // is a no-op on the one already broken.
                        Some(Seat::Open(h))
                            if h.data.broken().is_none() || h.control.broken().is_none() =>
                        {
                            Some((r, h.clone()))
                        }
                        _ => None,
                    })
            })
            .collect();
        // Let go with the epochs (the field order), before the aborts.
        self.members = Some(members);
    }
}

/// Open seats of ranks that left, aborted when dropped (after the locks).
pub(super) struct AbortOnDrop(Vec<(u32, GroupHandles)>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        for (r, h) in self.0.drain(..) {
            h.abort(&format!("rank {r} left the group (its linkers closed)"));
        }
    }
}

/// Whether the group of an epoch is over: aborted (as any of its handles still alive tells),
/// or every handle of it dropped. Taken handles it upgrades to ask go into `upgraded`, for the
/// caller to drop after its lock (a holder that drops its own meanwhile leaves ours the last).
pub(super) fn aborted(seats: &[Seat], upgraded: &mut Vec<Arc<dyn Collective>>) -> bool {
    let mut alive = 0;
    for seat in seats {
        let broken = match seat {
            Seat::Open(h) => h.broken(),
            taken => match taken.held(0, upgraded) {
                Some(h) => {
                    let broken = h.broken();
                    upgraded.extend([h.data, h.control]);
                    broken
                }
                None => continue,
            },
        };
        if broken.is_some() {
            return true;
        }
        alive += 1;
    }
    alive == 0
}
