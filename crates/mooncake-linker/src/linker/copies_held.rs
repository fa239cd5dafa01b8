//! A failed batch's outcome held back while device copies into its slots may still run.
//!
//! On a device pool the slots are written by copies the landing queues (uploads, scatters).
//! A batch that fails waits for them up to the landing's drain limit; copies that did not
//! finish by then keep the slots claimed in the pool ([`SlotClaims`]) until they do. The
//! outcome says to recompute into those slots, and the engine's kernels do not look at
//! claims: the outcome is held ([`HeldOutcome`], as for a store call past its deadline on a
//! host pool) until the pool no longer holds any of the batch's slots. Meanwhile its layer
//! waiters and a reset answer `SlotsHeld` naming the batch. One thread of the linker's looks
//! after every such hold, while there is one.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kv_device::{KvPool, SlotClaims};
use parking_lot::Mutex;

use super::outcomes::{HeldOutcome, Outcomes};

/// First pause between two looks at the pool's held slots.
const FIRST_LOOK: Duration = Duration::from_millis(2);
/// Longest pause between two looks (a device that stopped making progress is looked at this
/// often until its copies end, or the engine releases the slots).
const LAST_LOOK: Duration = Duration::from_millis(200);

/// The holds of failed batches whose slots the pool holds for unfinished copies, each let go
/// (handing its outcome out) once none of its slots is held any more.
#[derive(Default)]
pub(crate) struct CopiesWatch {
    state: Mutex<Watched>,
}

#[derive(Default)]
struct Watched {
    /// Each hold with its batch's slots.
    holds: Vec<(Arc<[u32]>, Arc<HeldOutcome>)>,
    /// A thread looks after `holds` (it ends once they are gone).
    watching: bool,
}

impl CopiesWatch {
    /// The hold of a failed batch into `slots` of `pool` while the pool holds any of them
    /// for unfinished copies (`None` when it holds none, or keeps no claims). Only their
    /// end, or the engine's `SlotClaims::release_held`, frees slots held for copies no event
    /// tells the end of: until then the watch keeps the hold (and the pool). Without a
    /// thread to watch, the load thread watches until every hold is let go.
    ///
    /// (The pool's held slots are every batch's: a batch refused because another's copies
    /// hold its slots is held until those end too, which its engine needs before writing
    /// them.)
    pub(crate) fn hold(
        self: &Arc<Self>,
        pool: &Arc<dyn KvPool>,
        slots: &[u32],
        outcomes: &Arc<Outcomes>,
    ) -> Option<Arc<HeldOutcome>> {
        let claims = pool.slot_claims()?;
        if !any_held(&held_set(claims), slots) {
            return None;
        }
        let hold = HeldOutcome::new(outcomes.clone());
        let mut state = self.state.lock();
        state.holds.push((slots.into(), hold.clone()));
        if std::mem::replace(&mut state.watching, true) {
            return Some(hold);
        }
        drop(state);
        let (watch, watched) = (self.clone(), pool.clone());
        let spawned = std::thread::Builder::new()
            .name("kvlink-copies-held".into())
            .spawn(move || watch.watch(&watched));
        if let Err(e) = spawned {
            tracing::error!(error = %e,
                "no thread to hold failed batches' outcomes while copies into their slots \
                 run: the load thread waits for them");
            self.watch(pool);
        }
        Some(hold)
    }

    /// Looks at `pool`'s held slots until no hold is left, letting each go once none of its
    /// slots is held.
    fn watch(&self, pool: &Arc<dyn KvPool>) {
        let mut pause = FIRST_LOOK;
        loop {
            let mut state = self.state.lock();
            // Looked at under the lock: a hold added meanwhile is judged by a look taken after
            // its slots were held (one judged by an earlier look would go at once).
            let held = pool.slot_claims().map(held_set).unwrap_or_default();
            let (waiting, free): (Vec<_>, Vec<_>) = std::mem::take(&mut state.holds)
                .into_iter()
                .partition(|(slots, _)| any_held(&held, slots));
            state.holds = waiting;
            let done = state.holds.is_empty();
            state.watching = !done;
            drop(state);
            // Let go outside the lock: the last reference hands the outcome out.
            if !free.is_empty() {
                pause = FIRST_LOOK;
            }
            drop(free);
            if done {
                return;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(LAST_LOOK);
        }
    }
}

/// The slots `claims` holds for unfinished copies.
fn held_set(claims: &SlotClaims) -> HashSet<u32> {
    claims.held_slots().into_iter().collect()
}

/// Whether any of `slots` is in `held`.
fn any_held(held: &HashSet<u32>, slots: &[u32]) -> bool {
    !held.is_empty() && slots.iter().any(|s| held.contains(s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_device::HostKvPool;
    use kv_geometry::{KvGeometry, ModelKvSpec};
    use std::time::Instant;

    /// Two failed batches whose slots the pool holds for good (no event tells their
    /// copies' end) are held by one watch; an engine's `release_held` lets both go, and
    /// the watch ends. A batch whose slots are not held gets no hold.
    #[test]
    fn one_watch_holds_every_batch_until_its_slots_are_free() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 8).unwrap());
        let outcomes = Arc::new(Outcomes::new(4));
        let watch = Arc::new(CopiesWatch::default());
        assert!(
            watch.hold(&pool, &[1, 2], &outcomes).is_none(),
            "nothing held"
        );
        SlotClaims::write(&pool, &[1, 2]).unwrap().hold_until(None);
        SlotClaims::write(&pool, &[5]).unwrap().hold_until(None);
        let a = watch.hold(&pool, &[1, 2], &outcomes).unwrap();
        let b = watch.hold(&pool, &[4, 5], &outcomes).unwrap();
        assert!(
            watch.hold(&pool, &[6], &outcomes).is_none(),
            "slot 6 is free"
        );
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(watch.state.lock().holds.len(), 2);
        assert_eq!((Arc::strong_count(&a), Arc::strong_count(&b)), (2, 2));
        // SAFETY: nothing writes these slots (no copy was ever queued into them).
        let released = unsafe { pool.slot_claims().unwrap().release_held() };
        assert_eq!(released.len(), 3);
        let by = Instant::now() + Duration::from_secs(10);
        while Arc::strong_count(&a) > 1 || Arc::strong_count(&b) > 1 {
            assert!(Instant::now() < by, "the holds were not let go");
            std::thread::sleep(Duration::from_millis(5));
        }
        let by = Instant::now() + Duration::from_secs(10);
        while watch.state.lock().watching {
            assert!(Instant::now() < by, "the watch did not end");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
