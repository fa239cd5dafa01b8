//! Re-forming a group after an abort: at a batch boundary, a rank whose handles are
//! [broken](crate::Collective::broken) asks the group's formation for fresh ones.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::{Collective, CollectiveError, InProcessGroup};

/// One rank's handles of one formation of a TP group: `data` for the load thread's
/// per-layer exchanges, `control` for lookups (two handles, because the two threads issue
/// collectives independently and each handle's operations must keep one order on every
/// rank; over NCCL, two communicators).
#[derive(Clone)]
pub struct GroupHandles {
    /// The load thread's handle.
    pub data: Arc<dyn Collective>,
    /// The lookups' handle.
    pub control: Arc<dyn Collective>,
    /// Which formation made them (grows each time the group re-forms).
    pub epoch: u64,
}

impl std::fmt::Debug for GroupHandles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupHandles")
            .field("rank", &self.data.rank())
            .field("size", &self.data.size())
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl GroupHandles {
    /// Why either handle is broken (the data handle's reason first), `None` when both work.
    pub fn broken(&self) -> Option<String> {
        self.data
            .broken()
            .map(|w| format!("data handle: {w}"))
            .or_else(|| {
                self.control
                    .broken()
                    .map(|w| format!("control handle: {w}"))
            })
    }

    /// Aborts both handles (a no-op on a handle already broken), so that peers still
    /// waiting on either fail now rather than at their deadline.
    pub fn abort(&self, cause: &str) {
        self.data.abort(cause);
        self.control.abort(cause);
    }
}

/// Makes new handles of one TP group (new communicators, a new epoch) after the old ones were
/// aborted: both the data and the control handle, from one formation.
///
/// Every rank asks once per broken epoch, for the epoch after the one of the handles it
/// replaces (the group first built is epoch 0 for in-process groups; a rendezvous numbers its
/// own). A formation across processes meets the other ranks (a rendezvous) and may fail by
/// `deadline` (a rank is not back, or was refused): the caller then fails its batch or
/// lookup and asks again at the next one. Once the ranks have met, connecting the new handles
/// has a bound of its own, which may end past `deadline` (a rank that gave up connecting would
/// fail the formation for all); each implementation states it.
pub trait GroupFormation: Send + Sync {
    /// Rank `rank`'s handles of the formation after the one of epoch `epoch - 1`. The
    /// returned [`GroupHandles::epoch`] is at least `epoch`.
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<GroupHandles, CollectiveError>;

    /// Rank `rank` has one more user of its handles (a linker built on them). Formations
    /// that know when a rank leaves count them; the default does nothing.
    fn enter(&self, rank: u32) {
        let _ = rank;
    }

    /// A user of rank `rank`'s handles is done with them for good (its linker closed).
    /// `true` when it was the rank's last one: the rank has left the group, and the caller
    /// aborts its handles, so that its peers fail at once rather than at their deadline. A
    /// formation that answers `true` must then not form the group without that rank as if it
    /// were there (it fails the formation, naming the rank missing) until the rank enters or
    /// re-forms again. The default answers `false`: nothing is aborted, and the peers of a
    /// rank that left meet its absence as a formation across processes does (its sockets
    /// close when its process ends; its rendezvous seat stays empty).
    fn leave(&self, rank: u32) -> bool {
        let _ = rank;
        false
    }
}

/// Builds every rank's `(data, control)` handles of one in-process group, rank `r` at index
/// `r`.
type Build = dyn Fn() -> Result<Vec<(Arc<dyn Collective>, Arc<dyn Collective>)>, CollectiveError>
    + Send
    + Sync;

mod seats;
use seats::{aborted, Epochs, HeldEpochs, Seat};

/// Who uses each rank's handles ([`GroupFormation::enter`], [`GroupFormation::leave`]).
#[derive(Debug, Default)]
struct Members {
    /// Per rank, the users of its handles (linkers) not yet closed.
    users: HashMap<u32, u32>,
    /// Ranks whose last user left, and that have not entered or re-formed since.
    left: BTreeSet<u32>,
}

/// The formation of a group whose ranks are threads of this process: the first rank to ask for
/// an epoch builds every rank's handles at once (with `build`), each rank takes its own. A rank
/// that lags joins the newest epoch its peers built, or builds the next one when that group
/// was aborted already (its peers gave up on it). A rank waits for another only while that one
/// is building (an NCCL group's set-up, up to its init timeout), and then at most until its
/// own deadline. A rank whose last linker closed ([`GroupFormation::leave`]) has left: the
/// group is not formed without it (the formation fails at once, naming it missing) until it
/// enters or re-forms again; its peers then fail their batches at once, or read alone. Taken
/// handles are kept weakly: a rank that asks again for an epoch whose handles it still holds
/// gets those (a second linker of the rank), and an epoch whose handles were all dropped (or
/// the asking rank's) is over, so that a new set of linkers on the same groups forms the next.
///
/// ```
/// use std::time::{Duration, Instant};
/// use dedup_broadcast::{Collective, GroupFormation, InProcessFormation};
/// let f = InProcessFormation::host(2);
/// let soon = kv_loader::deadline_after(Duration::from_secs(1));
/// let (a, b) = (f.reform(0, 1, soon).unwrap(), f.reform(1, 1, soon).unwrap());
/// assert_eq!((a.data.rank(), b.control.rank(), a.data.size(), b.epoch), (0, 1, 2, 1));
/// ```
pub struct InProcessFormation {
    size: u32,
    build: Box<Build>,
    epochs: Mutex<Epochs>,
    members: Mutex<Members>,
}

impl std::fmt::Debug for InProcessFormation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessFormation").finish_non_exhaustive()
    }
}

impl InProcessFormation {
    /// Handles built by `build`, which returns one `(data, control)` pair per rank, rank `r`
    /// at index `r`.
    pub fn new(
        size: u32,
        build: impl Fn() -> Result<Vec<(Arc<dyn Collective>, Arc<dyn Collective>)>, CollectiveError>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        InProcessFormation {
            size,
            build: Box::new(build),
            epochs: Mutex::new(HashMap::new()),
            members: Mutex::new(Members::default()),
        }
    }

    /// Fresh [`InProcessGroup::new`] groups of `size` ranks (host memory), one for data and
    /// one for control.
    pub fn host(size: u32) -> Self {
        Self::new(size, move || {
            Ok(InProcessGroup::new(size)
                .into_iter()
                .zip(InProcessGroup::new(size))
                .map(|(d, c)| {
                    (
                        Arc::new(d) as Arc<dyn Collective>,
                        Arc::new(c) as Arc<dyn Collective>,
                    )
                })
                .collect())
        })
    }

    /// Fresh [`InProcessGroup::on_devices`] groups over `devices` for data, host groups for
    /// control.
    pub fn on_devices(devices: Vec<Arc<dyn kv_device::Device>>) -> Self {
        let size = devices.len() as u32;
        Self::new(size, move || {
            Ok(InProcessGroup::on_devices(devices.clone())?
                .into_iter()
                .zip(InProcessGroup::new(size))
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

impl GroupFormation for InProcessFormation {
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<GroupHandles, CollectiveError> {
        if rank >= self.size {
            return Err(CollectiveError::Backend(format!(
                "rank {rank} of a group of {}",
                self.size
            )));
        }
        let left = {
            let mut members = self.members.lock();
            // A rank asking is there, whatever it said before.
            members.left.remove(&rank);
            members.left.iter().copied().collect::<Vec<u32>>()
        };
        if !left.is_empty() {
            return Err(CollectiveError::Formation {
                epoch,
                detail: format!(
                    "rank(s) {left:?} left the group (their linkers closed): it is not formed \
                     without them"
                ),
                missing: left,
                cause: None,
            });
        }
        // Stale epochs' handles taken out below: declared before the lock's guard, so dropped
        // after it (an NCCL handle's drop joins its comm thread, up to seconds: the other
        // ranks' `reform` must not wait for that).
        let mut stale = Vec::new();
        // Taken handles upgraded under the lock (to ask whether they broke): dropped after it
        // as well, since a holder may drop its own meanwhile and leave ours the last.
        let mut upgraded = Vec::new();
        // Another rank may be building the group (an NCCL group's set-up takes up to its
        // init timeout): wait for it until `deadline` only; the caller asks again later.
        let Some(epochs) = self.epochs.try_lock_until(deadline) else {
            return Err(CollectiveError::Formation {
                epoch,
                missing: Vec::new(),
                detail: "another rank was still building the group at this rank's deadline".into(),
                cause: None,
            });
        };
        // Let go (on every path) aborting the open seats of ranks that left meanwhile.
        let mut epochs = HeldEpochs::new(self, epochs);
        // A rank that lags joins the newest formation its peers already made (one built for an
        // older epoch would hold this rank alone: the others have moved past it), unless that
        // group was aborted since (its ranks gave up on this one): its first collective would
        // fail at once. A fresh formation follows it, which those ranks join next.
        let newest = epochs
            .keys()
            .copied()
            .filter(|&e| e >= epoch)
            .max()
            .unwrap_or(epoch);
        let mut epoch = match epochs.get(&newest) {
            Some(seats) if aborted(seats, &mut upgraded) => newest.saturating_add(1),
            _ => newest,
        };
        // This rank took its seat there and every user of it dropped it since (its linker
        // closed and a new one asks): its peers see it gone, and re-form next.
        if epochs
            .get(&epoch)
            .and_then(|seats| seats.get(rank as usize))
            .is_some_and(Seat::lost)
        {
            epoch = epoch.saturating_add(1);
        }
        if !epochs.contains_key(&epoch) {
            let handles = (self.build)().map_err(|e| match e {
                // Already a formation's error (a refusal keeps saying so).
                e @ CollectiveError::Formation { .. } => e,
                e => CollectiveError::Formation {
                    epoch,
                    // The ranks a timed-out build names (whose start never answered).
                    missing: match &e {
                        CollectiveError::Timeout { missing, .. } => missing.clone(),
                        _ => Vec::new(),
                    },
                    detail: format!("building the group failed: {e}"),
                    cause: Some(crate::FormationFailure::new(e, false)),
                },
            })?;
            let built: Vec<Seat> = handles
                .into_iter()
                .map(|(data, control)| {
                    Seat::Open(GroupHandles {
                        data,
                        control,
                        epoch,
                    })
                })
                .collect();
            if built.len() != self.size as usize {
                let detail = format!("built {} handles for {} ranks", built.len(), self.size);
                // Dropped after the lock, as stale ones are (an NCCL handle's drop is slow).
                stale.push(built);
                return Err(CollectiveError::Formation {
                    epoch,
                    missing: Vec::new(),
                    detail,
                    cause: None,
                });
            }
            // Older epochs are stale: a rank that asks for this one will not need them. (An
            // epoch whose handles were all taken stays until then: a rank that asks for it
            // again gets the handles it holds, not a new group.)
            let older: Vec<u64> = epochs.keys().copied().filter(|&e| e <= epoch).collect();
            stale.extend(older.iter().filter_map(|e| epochs.remove(e)));
            epochs.insert(epoch, built);
        }
        let seats = epochs
            .get_mut(&epoch)
            .ok_or_else(|| CollectiveError::Backend(format!("epoch {epoch} vanished")))?;
        let seat = seats
            .get_mut(rank as usize)
            .ok_or_else(|| CollectiveError::Backend(format!("no seat for rank {rank}")))?;
        let handles = match &*seat {
            Seat::Open(h) => h.clone(),
            // Asked again while its handles live (a second linker of the rank, built on the
            // handles the group started with): the same handles, not a group of its own.
            taken => taken.held(epoch, &mut upgraded).ok_or_else(|| {
                CollectiveError::Backend(format!("rank {rank}'s handles of epoch {epoch} are gone"))
            })?,
        };
        *seat = Seat::Taken {
            data: Arc::downgrade(&handles.data),
            control: Arc::downgrade(&handles.control),
        };
        // A rank that left since the check above (while this rank built the group, or waited
        // for the lock) has its open seat aborted as `epochs` is let go.
        drop(epochs);
        tracing::info!(rank, epoch, "group re-formed");
        Ok(handles)
    }

    fn enter(&self, rank: u32) {
        let mut members = self.members.lock();
        *members.users.entry(rank).or_default() += 1;
        members.left.remove(&rank);
    }

    fn leave(&self, rank: u32) -> bool {
        let mut members = self.members.lock();
        let Some(users) = members.users.get_mut(&rank).filter(|n| **n > 0) else {
            // Never entered: not a user this formation counted.
            return false;
        };
        *users -= 1;
        if *users > 0 {
            return false;
        }
        members.left.insert(rank);
        drop(members);
        tracing::info!(rank, "rank left the group: its last linker closed");
        // Its seats not taken yet (its peers re-formed, and it never came): aborted, so that
        // the peers that took theirs fail at once, as the lock is let go. Not waited for while
        // a rank holds it (a build: up to an NCCL init timeout): that rank lets it go the same
        // way, and aborts them then.
        if let Some(epochs) = self.epochs.try_lock() {
            drop(HeldEpochs::new(self, epochs));
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Weak;
    use std::time::Duration;

    /// A handle whose drop takes a while (as an NCCL handle's joins its comm thread).
    /// Its rank, the group's size, and a count of drops begun (shared by a test's handles).
    struct SlowToDrop(u32, u32, Arc<std::sync::atomic::AtomicU32>);

    // SAFETY: it moves no memory: its one operation fails, the others keep the defaults
    // (`Unsupported`).
    unsafe impl Collective for SlowToDrop {
        fn rank(&self) -> u32 {
            self.0
        }

        fn size(&self) -> u32 {
            self.1
        }

        fn all_gather_bytes(
            &self,
            _value: &[u8],
            _deadline: Instant,
        ) -> Result<Vec<Vec<u8>>, CollectiveError> {
            Err(CollectiveError::Backend("a test handle".into()))
        }
    }

    impl Drop for SlowToDrop {
        fn drop(&mut self) {
            self.2.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// A formation of 2 ranks whose build gives `built` pairs of [`SlowToDrop`] handles,
    /// counting their drops in `drops`.
    fn slow_to_drop_formation(
        built: u32,
        drops: Arc<std::sync::atomic::AtomicU32>,
    ) -> InProcessFormation {
        InProcessFormation::new(2, move || {
            Ok((0..built)
                .map(|r| {
                    (
                        Arc::new(SlowToDrop(r, 2, drops.clone())) as Arc<dyn Collective>,
                        Arc::new(SlowToDrop(r, 2, drops.clone())) as Arc<dyn Collective>,
                    )
                })
                .collect())
        })
    }

    /// A stale epoch's handles a rank never took are dropped after the formation's lock is
    /// let go: a peer asking for the new epoch meanwhile gets it at once. Before, it waited
    /// for every stale handle's drop (an NCCL handle's: up to seconds each) and could fail at
    /// its deadline.
    #[test]
    fn stale_handles_drop_outside_the_formations_lock() {
        let dropping = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let formation = slow_to_drop_formation(2, dropping.clone());
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        // Epoch 1: rank 1 never takes its handles.
        drop(formation.reform(0, 1, soon()).unwrap());
        // Those were rank 0's own handles: count the stale ones' drops only.
        dropping.store(0, std::sync::atomic::Ordering::SeqCst);
        std::thread::scope(|s| {
            // Rank 0 moves to epoch 2, dropping rank 1's stale handles (1 s).
            let r0 = s.spawn(|| formation.reform(0, 2, soon()).map(|h| h.epoch));
            // Rank 0 has built epoch 2 once it drops the stale handles (it took them under
            // the lock): wait for that, not for a guess at the scheduler.
            let waiting = Instant::now();
            while dropping.load(std::sync::atomic::Ordering::SeqCst) == 0 {
                assert!(
                    waiting.elapsed() < Duration::from_secs(10),
                    "rank 0 never built"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            let t0 = Instant::now();
            let r1 = formation.reform(1, 2, kv_loader::deadline_after(Duration::from_millis(400)));
            assert_eq!(r1.as_ref().map(|h| h.epoch).ok(), Some(2), "{:?}", r1.err());
            assert!(
                t0.elapsed() < Duration::from_millis(500),
                "{:?}",
                t0.elapsed()
            );
            drop(r1);
            assert_eq!(r0.join().unwrap().ok(), Some(2));
        });
    }

    /// A build that gives the wrong number of handles fails the formation (`Formation`, it
    /// was `Backend`) and drops them after the lock: a peer asking meanwhile is not held up.
    /// Before, the drop ran under the lock and the peer failed "still building".
    #[test]
    fn a_wrong_sized_build_drops_its_handles_outside_the_lock() {
        let formation = slow_to_drop_formation(1, Arc::new(std::sync::atomic::AtomicU32::new(0)));
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        std::thread::scope(|s| {
            let r0 = s.spawn(|| formation.reform(0, 1, soon()).map(|h| h.epoch));
            std::thread::sleep(Duration::from_millis(100));
            let r1 = formation.reform(1, 1, kv_loader::deadline_after(Duration::from_millis(400)));
            match r1 {
                Err(CollectiveError::Formation { detail, .. }) => {
                    assert!(detail.contains("built 1 handles"), "{detail}")
                }
                other => panic!("{:?}", other.map(|h| h.epoch)),
            }
            let r0 = r0.join().unwrap();
            assert!(
                matches!(&r0, Err(CollectiveError::Formation { detail, .. }) if detail.contains("built 1")),
                "{r0:?}"
            );
        });
    }

    /// A rank that lags does not join a group its peers already aborted: it gets a fresh
    /// epoch, which they join next. Before, it took the aborted group's handles and its first
    /// collective failed at once (with `ReadAlone`, its batch then loaded alone whatever its
    /// peers had done with it).
    #[test]
    fn a_rank_that_lags_skips_an_aborted_formation() {
        let formation = InProcessFormation::host(2);
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        // Rank 1 formed epoch 1 alone and gave up on it (its gate timed out).
        let one = formation.reform(1, 1, soon()).unwrap();
        one.data.abort("rank 0 never came");
        let zero = formation.reform(0, 1, soon()).unwrap();
        assert_eq!(zero.epoch, 2);
        assert!(zero.data.broken().is_none() && zero.control.broken().is_none());
        let one = formation.reform(1, 2, soon()).unwrap();
        assert_eq!(one.epoch, 2);
        let d = kv_loader::deadline_after(Duration::from_secs(5));
        std::thread::scope(|s| {
            let a = s.spawn(|| zero.data.all_gather_bytes(&[0], d));
            let b = one.data.all_gather_bytes(&[1], d).unwrap();
            assert_eq!(a.join().unwrap().unwrap(), b);
        });
        // A group still whole is joined as before.
        let other = InProcessFormation::host(2);
        assert_eq!(other.reform(1, 1, soon()).unwrap().epoch, 1);
        assert_eq!(other.reform(0, 1, soon()).unwrap().epoch, 1);
    }

    /// A rank whose last user left is missing from every formation until it enters again;
    /// one user of two leaving is not the rank leaving.
    #[test]
    fn a_rank_whose_last_user_left_is_missing_until_it_enters_again() {
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let f = InProcessFormation::host(3);
        for rank in 0..3 {
            f.enter(rank);
        }
        f.enter(1);
        assert!(!f.leave(1), "rank 1 has another user");
        assert!(f.reform(0, 1, soon()).is_ok());
        assert!(f.leave(1), "rank 1's last user");
        assert!(!f.leave(1), "not counted twice");
        assert!(!f.leave(7), "a rank never entered");
        match f.reform(2, 2, soon()) {
            Err(CollectiveError::Formation { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("{other:?}"),
        }
        f.enter(1);
        assert_eq!(f.reform(2, 2, soon()).unwrap().epoch, 2);
        assert_eq!(f.reform(1, 2, soon()).unwrap().epoch, 2);
    }

    /// A rank asking again for an epoch whose handles it holds gets the same ones; once every
    /// handle of an epoch was dropped, asking for it forms the next; and a rank's own handles
    /// dropped make its next ask form the next epoch too. Before, each of these was "rank r
    /// already took epoch e", for good.
    #[test]
    fn taken_handles_are_handed_again_while_held_and_a_dropped_epoch_is_over() {
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let f = InProcessFormation::host(2);
        let a0 = f.reform(0, 1, soon()).unwrap();
        let a1 = f.reform(1, 1, soon()).unwrap();
        let again = f.reform(0, 1, soon()).unwrap();
        assert_eq!(again.epoch, 1);
        assert!(
            Arc::ptr_eq(&again.data, &a0.data),
            "the held handles, not a new group"
        );
        drop((a0, a1, again));
        let b0 = f.reform(0, 1, soon()).unwrap();
        let b1 = f.reform(1, 1, soon()).unwrap();
        assert_eq!(
            (b0.epoch, b1.epoch),
            (2, 2),
            "every handle of epoch 1 was dropped"
        );
        drop(b0);
        let c0 = f.reform(0, 2, soon()).unwrap();
        assert_eq!(c0.epoch, 3, "rank 0's own handles of epoch 2 were dropped");
        assert_eq!(f.reform(1, 3, soon()).unwrap().epoch, 3);
        drop(b1);
    }

    /// What [`Gated`] handles share: a gate in `broken` and where their drops ran.
    #[derive(Default)]
    struct GateProbe {
        /// (armed, entered, released).
        state: parking_lot::Mutex<(bool, bool, bool)>,
        moved: parking_lot::Condvar,
        formation: std::sync::OnceLock<Weak<InProcessFormation>>,
        /// Drops of rank 0's data handle that ran while the formation's lock was held.
        dropped_under_lock: std::sync::atomic::AtomicU32,
        /// Drops of rank 0's data handle.
        dropped: std::sync::atomic::AtomicU32,
    }

    /// A handle whose `broken` waits at the probe's gate while armed (rank 0's data handle
    /// only), and whose drop records whether it ran under the formation's lock.
    struct Gated(u32, Arc<GateProbe>, bool);

    // SAFETY: it moves no memory: its one operation fails, the others keep the defaults.
    unsafe impl Collective for Gated {
        fn rank(&self) -> u32 {
            self.0
        }

        fn size(&self) -> u32 {
            2
        }

        fn all_gather_bytes(
            &self,
            _value: &[u8],
            _deadline: Instant,
        ) -> Result<Vec<Vec<u8>>, CollectiveError> {
            Err(CollectiveError::Backend("a test handle".into()))
        }

        fn broken(&self) -> Option<String> {
            if !self.2 {
                return None;
            }
            let mut state = self.1.state.lock();
            if state.0 {
                state.0 = false;
                state.1 = true;
                self.1.moved.notify_all();
                let until = Instant::now() + Duration::from_secs(10);
                while !state.2 && !self.1.moved.wait_until(&mut state, until).timed_out() {}
            }
            None
        }
    }

    impl Drop for Gated {
        fn drop(&mut self) {
            use std::sync::atomic::Ordering::SeqCst;
            if !self.2 {
                return;
            }
            self.1.dropped.fetch_add(1, SeqCst);
            let formation = self.1.formation.get().and_then(Weak::upgrade);
            if formation.is_some_and(|f| f.epochs.is_locked()) {
                self.1.dropped_under_lock.fetch_add(1, SeqCst);
            }
        }
    }

    /// A taken handle the formation upgraded under its lock to ask whether it broke, whose
    /// holder dropped it meanwhile, is dropped after the lock (its drop may join a comm
    /// thread). Before, it was dropped under the lock, holding up every rank's `reform`.
    #[test]
    fn a_handle_upgraded_to_ask_is_dropped_after_the_lock() {
        use std::sync::atomic::Ordering::SeqCst;
        let probe = Arc::new(GateProbe::default());
        let built = probe.clone();
        let f = Arc::new(InProcessFormation::new(2, move || {
            Ok((0..2)
                .map(|r| {
                    (
                        Arc::new(Gated(r, built.clone(), r == 0)) as Arc<dyn Collective>,
                        Arc::new(Gated(r, built.clone(), false)) as Arc<dyn Collective>,
                    )
                })
                .collect())
        }));
        probe.formation.set(Arc::downgrade(&f)).ok();
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let zero = f.reform(0, 1, soon()).unwrap();
        let one = f.reform(1, 1, soon()).unwrap();
        probe.state.lock().0 = true;
        std::thread::scope(|s| {
            // Rank 1 asks again for epoch 1: the formation asks rank 0's handles whether the
            // group broke, and waits in `broken` at the gate.
            let again = s.spawn(|| f.reform(1, 1, soon()).map(|h| h.epoch));
            let mut state = probe.state.lock();
            let until = Instant::now() + Duration::from_secs(10);
            while !state.1 && !probe.moved.wait_until(&mut state, until).timed_out() {}
            assert!(state.1, "the formation never asked rank 0's handle");
            // Meanwhile rank 0's linker drops its handles: the formation's are the last.
            drop(zero);
            state.2 = true;
            probe.moved.notify_all();
            drop(state);
            assert_eq!(again.join().unwrap().ok(), Some(1));
        });
        assert_eq!(
            probe.dropped.load(SeqCst),
            1,
            "rank 0's data handle was dropped"
        );
        assert_eq!(probe.dropped_under_lock.load(SeqCst), 0);
        drop(one);
    }

    /// A build that timed out on some ranks' starts fails the formation naming them missing
    /// (the linker's `GroupDown` passes them on). Before, `missing` was empty.
    #[test]
    fn a_timed_out_build_names_the_ranks_missing() {
        let f = InProcessFormation::new(3, || {
            Err(CollectiveError::Timeout {
                op: "init",
                seq: 0,
                missing: vec![2],
            })
        });
        match f.reform(0, 1, kv_loader::deadline_after(Duration::from_secs(5))) {
            Err(CollectiveError::Formation { missing, .. }) => assert_eq!(missing, vec![2]),
            other => panic!("{other:?}"),
        }
    }

    /// A rank that leaves while another rank holds the formation's lock (building a group, or
    /// joining an epoch where the leaving rank's seat is open) has its open seats aborted as
    /// that rank lets the lock go: the peers that took theirs fail at once. Before, `leave`
    /// found the lock held and aborted nothing, and its peers waited their whole deadline on a
    /// rank that was gone.
    #[test]
    fn a_rank_that_leaves_while_the_lock_is_held_has_its_seats_aborted_as_it_is_let_go() {
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let f = InProcessFormation::host(3);
        for rank in 0..3 {
            f.enter(rank);
        }
        // Rank 2 builds epoch 1 and takes its seat; ranks 0 and 1 have not yet.
        let two = f.reform(2, 1, soon()).unwrap();
        let held = HeldEpochs::new(&f, f.epochs.lock());
        assert!(f.leave(1), "rank 1's last user");
        assert!(
            two.broken().is_none(),
            "nothing aborted while the lock is held"
        );
        drop(held);
        assert!(two.broken().is_some(), "rank 2's group lost rank 1");
        match f.reform(0, 1, soon()) {
            Err(CollectiveError::Formation { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("{:?}", other.map(|h| h.epoch)),
        }
    }

    /// An open seat whose control handle broke (a lookup's group aborted) still has its data
    /// handle aborted when its rank leaves: the two break apart. A look at the pair's
    /// `broken` (either handle) skipped the seat, and the data group's peers waited.
    #[test]
    fn a_seat_broken_on_one_handle_has_the_other_aborted_when_its_rank_leaves() {
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let f = InProcessFormation::host(3);
        for rank in 0..3 {
            f.enter(rank);
        }
        let two = f.reform(2, 1, soon()).unwrap();
        match f.epochs.lock().get(&1).and_then(|seats| seats.get(1)) {
            Some(Seat::Open(h)) => h.control.abort("test: a lookup's group gave up"),
            _ => panic!("rank 1's seat of epoch 1 is not open"),
        }
        assert!(two.data.broken().is_none() && two.control.broken().is_some());
        assert!(f.leave(1));
        assert!(
            two.data.broken().is_some(),
            "rank 2's data group lost rank 1"
        );
    }

    /// A rank that leaves aborts its seat nobody took: its peers that took theirs fail at
    /// once instead of waiting for it.
    #[test]
    fn leaving_aborts_the_seat_the_rank_never_took() {
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let f = InProcessFormation::host(2);
        f.enter(0);
        f.enter(1);
        let peer = f.reform(0, 1, soon()).unwrap();
        assert!(peer.broken().is_none());
        assert!(f.leave(1));
        assert!(
            peer.broken().is_some(),
            "the group of rank 1's open seat was aborted"
        );
    }
}
