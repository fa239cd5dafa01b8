//! A failed batch's outcome held back while device copies into its slots may still run.
//!
//! On a device pool the slots are written by copies the landing queues (uploads, scatters).
//! A batch that fails waits for them up to the landing's drain limit; copies that did not
//! finish by then keep the slots claimed in the pool ([`SlotClaims`]) until they do. The
//! outcome says to recompute into those slots, and the engine's kernels do not look at
//! claims: the outcome is held ([`HeldOutcome`], as for a store call past its deadline on a
//! host pool) until the pool no longer holds any of the batch's slots. Meanwhile its layer
//! waiters and a reset answer `SlotsHeld` naming the batch.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use kv_device::{KvPool, SlotClaims};

use super::outcomes::{HeldOutcome, Outcomes};

/// First pause between two looks at the pool's held slots.
const FIRST_LOOK: Duration = Duration::from_millis(2);
/// Longest pause between two looks (a device that stopped making progress is looked at this
/// often until its copies end, or the engine releases the slots).
const LAST_LOOK: Duration = Duration::from_millis(200);

/// The hold of a failed batch into `slots` of `pool` while the pool holds any of them for
/// unfinished copies (`None` when it holds none, or keeps no claims): a thread lets go of
/// its reference once they are free, which hands the outcome out. Only their end, or the
/// engine's `SlotClaims::release_held`, frees slots held for copies no event tells the end of:
/// until then the thread looks on (and keeps the pool). Without a thread to watch, the load
/// thread waits for them itself before the outcome goes out (`None`).
///
/// (The pool's held slots are every batch's: a batch refused because another's copies hold
/// its slots is held until those end too, which is what its engine needs before writing them.)
pub(crate) fn hold_while_copies_run(
    pool: &Arc<dyn KvPool>,
    slots: &[u32],
    outcomes: &Arc<Outcomes>,
) -> Option<Arc<HeldOutcome>> {
    let claims = pool.slot_claims()?;
    if !any_held(claims, slots) {
        return None;
    }
    let hold = HeldOutcome::new(outcomes.clone());
    let watch = hold.clone();
    let slots: Arc<[u32]> = slots.into();
    let (watched_pool, watched_slots) = (pool.clone(), slots.clone());
    let spawned = std::thread::Builder::new()
        .name("kvlink-copies-held".into())
        .spawn(move || {
            wait_while_held(&watched_pool, &watched_slots);
            drop(watch);
        });
    match spawned {
        Ok(_) => Some(hold),
        Err(e) => {
            tracing::error!(error = %e, slots = slots.len(),
                "no thread to hold a failed batch's outcome while copies into its slots run: \
                 the load thread waits for them");
            wait_while_held(pool, &slots);
            None
        }
    }
}

/// Returns once `pool` holds none of `slots` for unfinished copies.
fn wait_while_held(pool: &Arc<dyn KvPool>, slots: &[u32]) {
    let mut pause = FIRST_LOOK;
    while pool.slot_claims().is_some_and(|c| any_held(c, slots)) {
        std::thread::sleep(pause);
        pause = (pause * 2).min(LAST_LOOK);
    }
}

/// Whether `claims` holds any of `slots` for unfinished copies.
fn any_held(claims: &SlotClaims, slots: &[u32]) -> bool {
    let held: HashSet<u32> = claims.held_slots().into_iter().collect();
    !held.is_empty() && slots.iter().any(|s| held.contains(s))
}
