//! Slot claims of a pool: which page slots a landing is writing (through the store, or by
//! copies on a device stream) and which a save is reading, so that kvlink's own safe paths
//! never write a slot row while another of them reads or writes it. The engine's own slot copies
//! ([`KvPool::read_slot`](crate::KvPool::read_slot) / `write_slot`) are `unsafe` and keep
//! their own contract; these claims cover what kvlink does (a host pool's `write_slot` also
//! refuses a slot they hold), and [`SlotClaims::wait_free`] lets an engine wait for them.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::{DeviceError, KvPool, SharedEvent};

/// A slot claimed for writing (no reader, no other writer).
const WRITER: u32 = u32::MAX;

/// Per page slot of a pool: free, read by `n` saves, or written by one landing.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{HostKvPool, KvPool, SlotClaims};
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 4).unwrap());
/// let writing = SlotClaims::write(&pool, &[1, 2]).unwrap();
/// assert!(SlotClaims::read(&pool, 2).is_err(), "a landing writes slot 2");
/// assert!(SlotClaims::read(&pool, 3).is_ok());
/// drop(writing);
/// assert!(SlotClaims::read(&pool, 2).is_ok());
/// ```
#[derive(Debug)]
pub struct SlotClaims {
    states: Box<[AtomicU32]>,
    /// Write claims kept past their holder ([`WriteClaim::hold_until`]): released once their
    /// events have completed (never, for `None`), looked at by every claim and wait.
    held: Mutex<Vec<HeldUntil>>,
}

/// Slots claimed for writing until device work finishes.
struct HeldUntil {
    slots: Box<[u32]>,
    until: Option<Vec<SharedEvent>>,
}

impl std::fmt::Debug for HeldUntil {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldUntil")
            .field("slots", &self.slots)
            .field("events", &self.until.as_ref().map(Vec::len))
            .finish()
    }
}

impl HeldUntil {
    /// Every event completed (an event whose query fails never does).
    fn done(&self) -> bool {
        self.until
            .as_ref()
            .is_some_and(|events| events.iter().all(|e| matches!(e.is_complete(), Ok(true))))
    }
}

impl SlotClaims {
    /// Claims for `pages` page slots, all free.
    pub fn new(pages: u32) -> Self {
        SlotClaims {
            states: (0..pages).map(|_| AtomicU32::new(0)).collect(),
            held: Mutex::new(Vec::new()),
        }
    }

    /// Releases the held write claims whose work has finished.
    fn release_finished(&self) {
        // Released under the lock (a claim that finds the entry gone finds its slots free),
        // logged and dropped (their events destroyed) after it: claims of other slots do not
        // wait behind the log line or the events' destruction.
        let finished: Vec<HeldUntil> = {
            let mut held = self.held.lock();
            if held.is_empty() {
                return;
            }
            let (done, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut *held)
                .into_iter()
                .partition(HeldUntil::done);
            *held = waiting;
            for h in &done {
                for &slot in h.slots.iter() {
                    if let Some(state) = self.states.get(slot as usize) {
                        state.store(0, Ordering::Release);
                    }
                }
            }
            done
        };
        for h in finished {
            let slots = slot_list(&h.slots);
            tracing::info!(%slots, "slots held for unfinished device copies are free");
        }
    }

    /// Releases every slot held past its claim ([`WriteClaim::hold_until`]) at once, whatever
    /// its events say: for an engine that has made sure the work is over another way, where
    /// an event's query fails for good or no event tells the work's end. The slots it
    /// released.
    ///
    /// On CUDA "over" means a context-wide synchronization of the pool's device
    /// (`cuCtxSynchronize` on its primary context, or `cudaDeviceSynchronize`) that
    /// returned success: kvlink's copies run on its own non-blocking load stream, which
    /// synchronizing the engine's stream does not cover. A device that was reset
    /// (`cudaDeviceReset`) lost its primary context and the pool's memory with it: build a
    /// new pool rather than release the old one's slots.
    ///
    /// # Safety
    /// No copy the held slots wait for can still write them: kvlink's own landings and
    /// saves take them at once after this, and a copy still running would race them.
    pub unsafe fn release_held(&self) -> Vec<u32> {
        let mut released = Vec::new();
        // Reset under the lock, as `release_finished` does; the events dropped after it.
        let held = {
            let mut held = self.held.lock();
            for h in held.iter() {
                for &slot in h.slots.iter() {
                    if let Some(state) = self.states.get(slot as usize) {
                        state.store(0, Ordering::Release);
                        released.push(slot);
                    }
                }
            }
            std::mem::take(&mut *held)
        };
        drop(held);
        if !released.is_empty() {
            let slots = slot_list(&released);
            tracing::warn!(%slots, "slots held for device copies released by the engine");
        }
        released
    }

    /// Slots claimed past their claim's holder until device work finishes
    /// ([`WriteClaim::hold_until`]), that work not yet known finished.
    pub fn held_slots(&self) -> Vec<u32> {
        self.release_finished();
        self.held
            .lock()
            .iter()
            .flat_map(|h| h.slots.iter().copied())
            .collect()
    }

    fn of(pool: &Arc<dyn KvPool>) -> Result<&SlotClaims, DeviceError> {
        pool.slot_claims().ok_or(DeviceError::Unsupported(
            "this pool keeps no slot claims (HostKvPool and DeviceKvPool do)",
        ))
    }

    fn state(&self, slot: u32) -> Result<&AtomicU32, DeviceError> {
        // A plan error, not a conflict that passes: not `SlotBusy`, which a caller may retry.
        self.states
            .get(slot as usize)
            .ok_or(DeviceError::OutOfPool {
                component: u16::MAX,
                layer: u32::MAX,
                slot,
                reason: "slot past the pool",
            })
    }

    /// Claims every slot of `slots` of `pool` for writing, all or none: refused
    /// ([`DeviceError::SlotBusy`]) when a save reads one, another landing writes one, or one
    /// is named twice; [`DeviceError::OutOfPool`] for a slot past the pool. Released when the
    /// claim drops.
    pub fn write(pool: &Arc<dyn KvPool>, slots: &[u32]) -> Result<WriteClaim, DeviceError> {
        let claims = Self::of(pool)?;
        claims.release_finished();
        for (i, &slot) in slots.iter().enumerate() {
            let taken = claims.take_writer(slot, "a landing (or this one, named twice) writes it");
            if let Err(e) = taken {
                for &done in &slots[..i] {
                    claims.states[done as usize].store(0, Ordering::Release);
                }
                return Err(e);
            }
        }
        Ok(WriteClaim {
            pool: pool.clone(),
            slots: slots.into(),
        })
    }

    /// Claims `slot` of `pool` for reading (beside other readers): refused
    /// ([`DeviceError::SlotBusy`]) while a landing writes it. Released when the claim drops.
    pub fn read(pool: &Arc<dyn KvPool>, slot: u32) -> Result<ReadClaim, DeviceError> {
        let claims = Self::of(pool)?;
        claims.release_finished();
        claims.add_reader(slot)?;
        Ok(ReadClaim {
            pool: pool.clone(),
            slot,
        })
    }

    /// Claims every slot of `slots` of `pool` for reading (beside other readers), all or
    /// none: refused ([`DeviceError::SlotBusy`]) while a landing writes one of them. A slot
    /// named twice is read twice. Released when the claim drops.
    pub fn read_all(pool: &Arc<dyn KvPool>, slots: &[u32]) -> Result<ReadClaims, DeviceError> {
        let claims = Self::of(pool)?;
        claims.release_finished();
        for (i, &slot) in slots.iter().enumerate() {
            if let Err(e) = claims.add_reader(slot) {
                for &done in &slots[..i] {
                    claims.states[done as usize].fetch_sub(1, Ordering::Release);
                }
                return Err(e);
            }
        }
        Ok(ReadClaims {
            pool: pool.clone(),
            slots: slots.into(),
        })
    }

    /// Waits until no save reads and no landing writes any slot of `slots` of `pool`, or
    /// `deadline`: then [`DeviceError::SlotBusy`] naming a slot still claimed (a slot past the
    /// pool is [`DeviceError::OutOfPool`]; a pool that keeps no claims has none to wait for).
    ///
    /// An engine calls it before writing slots a failed save named: a put that outlived its
    /// deadline (`store_call_timeout`) may still read a host pool's slots in place, and keeps
    /// them claimed until it returns; a put the store gave up on while its transfer may still
    /// run keeps them for good. Checks only: a claim may start right after it returns, so
    /// the engine must not start a load or save of these slots meanwhile.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::{Duration, Instant};
    /// use kv_device::{HostKvPool, KvPool, SlotClaims};
    /// use kv_geometry::{KvGeometry, ModelKvSpec};
    /// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    /// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 4).unwrap());
    /// let soon = || Instant::now() + Duration::from_millis(20);
    /// let read = SlotClaims::read(&pool, 2).unwrap(); // as a save's source holds it
    /// assert!(SlotClaims::wait_free(pool.as_ref(), &[1, 2], soon()).is_err());
    /// drop(read);
    /// assert!(SlotClaims::wait_free(pool.as_ref(), &[1, 2], soon()).is_ok());
    /// ```
    pub fn wait_free(
        pool: &dyn KvPool,
        slots: &[u32],
        deadline: std::time::Instant,
    ) -> Result<(), DeviceError> {
        let Some(claims) = pool.slot_claims() else {
            return Ok(());
        };
        let mut pause = std::time::Duration::from_micros(200);
        loop {
            claims.release_finished();
            let mut busy = None;
            for &slot in slots {
                match claims.state(slot)?.load(Ordering::Acquire) {
                    0 => {}
                    WRITER => busy = busy.or(Some((slot, "a landing writes it"))),
                    _ => busy = busy.or(Some((slot, "a save still reads it"))),
                }
            }
            let Some((slot, reason)) = busy else {
                return Ok(());
            };
            let now = std::time::Instant::now();
            if now >= deadline {
                return Err(DeviceError::SlotBusy { slot, reason });
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(std::time::Duration::from_millis(10));
        }
    }

    /// Holds `slot` for the guard's life as a landing's claim does (for a copy of the pool's
    /// own): refused ([`DeviceError::SlotBusy`]) while a save reads it or a landing writes it.
    pub(crate) fn hold_write(&self, slot: u32) -> Result<HeldWrite<'_>, DeviceError> {
        self.release_finished();
        let state = self.take_writer(
            slot,
            "a landing, or another write_slot of the slot, writes it",
        )?;
        Ok(HeldWrite { state })
    }

    /// Makes `slot` written (free before): refused ([`DeviceError::SlotBusy`]) while a save
    /// reads it, or, saying `writer`, while a writer holds it. Its state, to release.
    fn take_writer(&self, slot: u32, writer: &'static str) -> Result<&AtomicU32, DeviceError> {
        let state = self.state(slot)?;
        state
            .compare_exchange(0, WRITER, Ordering::Acquire, Ordering::Relaxed)
            .map_err(|held| DeviceError::SlotBusy {
                slot,
                reason: if held == WRITER {
                    writer
                } else {
                    "a save reads it"
                },
            })?;
        Ok(state)
    }

    /// One more reader of `slot`, unless a landing writes it.
    fn add_reader(&self, slot: u32) -> Result<(), DeviceError> {
        let state = self.state(slot)?;
        let mut seen = state.load(Ordering::Relaxed);
        loop {
            if seen >= WRITER - 1 {
                return Err(DeviceError::SlotBusy {
                    slot,
                    reason: "a landing writes it",
                });
            }
            match state.compare_exchange_weak(seen, seen + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return Ok(()),
                Err(now) => seen = now,
            }
        }
    }
}

/// Slots a landing writes: no save reads them and no other landing writes them until this
/// drops (see [`SlotClaims::write`]).
#[must_use = "the claim lasts until it drops: dropped at once, it claims nothing"]
pub struct WriteClaim {
    pool: Arc<dyn KvPool>,
    slots: Box<[u32]>,
}

/// A slot held for one of the pool's own copies ([`SlotClaims::hold_write`]).
pub(crate) struct HeldWrite<'a> {
    state: &'a AtomicU32,
}

impl Drop for HeldWrite<'_> {
    fn drop(&mut self) {
        self.state.store(0, Ordering::Release);
    }
}

/// Calls `release` on the state of every slot of `slots` in `pool`'s claims.
fn release_each(pool: &Arc<dyn KvPool>, slots: &[u32], release: impl Fn(&AtomicU32)) {
    if let Some(claims) = pool.slot_claims() {
        slots
            .iter()
            .filter_map(|&slot| claims.states.get(slot as usize))
            .for_each(release);
    }
}

impl WriteClaim {
    /// Keeps these slots claimed after this claim is gone, until every event of `until` has
    /// completed (for good when `None`: work whose end no event tells): for copies into the
    /// slots that may still run after their batch failed. The pool's claims release them
    /// when a later claim, read or [`SlotClaims::wait_free`] finds the events complete;
    /// [`SlotClaims::held_slots`] lists them meanwhile.
    pub fn hold_until(mut self, until: Option<Vec<SharedEvent>>) {
        let slots = std::mem::take(&mut self.slots);
        if let Some(claims) = self.pool.slot_claims() {
            tracing::warn!(
                slots = %slot_list(&slots),
                events = until.as_ref().map(Vec::len),
                "slots stay claimed until copies queued into them have finished"
            );
            claims.held.lock().push(HeldUntil { slots, until });
        }
    }
}

impl Drop for WriteClaim {
    fn drop(&mut self) {
        release_each(&self.pool, &self.slots, |s| s.store(0, Ordering::Release));
    }
}

impl std::fmt::Debug for WriteClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteClaim")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// A slot a save reads: no landing writes it until this drops (see [`SlotClaims::read`]).
#[must_use = "the claim lasts until it drops: dropped at once, it claims nothing"]
pub struct ReadClaim {
    pool: Arc<dyn KvPool>,
    slot: u32,
}

impl Drop for ReadClaim {
    fn drop(&mut self) {
        release_each(&self.pool, &[self.slot], |s| {
            s.fetch_sub(1, Ordering::Release);
        });
    }
}

impl std::fmt::Debug for ReadClaim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadClaim")
            .field("slot", &self.slot)
            .finish_non_exhaustive()
    }
}

/// Slots a save reads: no landing writes them until this drops (see
/// [`SlotClaims::read_all`]).
#[must_use = "the claims last until they drop: dropped at once, they claim nothing"]
pub struct ReadClaims {
    pool: Arc<dyn KvPool>,
    slots: Box<[u32]>,
}

impl Drop for ReadClaims {
    fn drop(&mut self) {
        release_each(&self.pool, &self.slots, |s| {
            s.fetch_sub(1, Ordering::Release);
        });
    }
}

impl std::fmt::Debug for ReadClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadClaims")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// `slots` for a log line: the first 16 and how many in all (a batch may hold thousands).
pub(crate) fn slot_list(slots: &[u32]) -> String {
    const SHOWN: usize = 16;
    match slots.get(..SHOWN) {
        Some(first) if slots.len() > SHOWN => format!("{first:?}.. ({} slots)", slots.len()),
        _ => format!("{slots:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostKvPool;
    use kv_geometry::{KvGeometry, ModelKvSpec};

    /// A batch of thousands of slots logs 16 of them and the count, not one enormous line.
    #[test]
    fn a_slot_list_for_the_log_shows_sixteen_and_the_count() {
        assert_eq!(slot_list(&[3, 1]), "[3, 1]");
        let many: Vec<u32> = (0..4096).collect();
        let line = slot_list(&many);
        assert!(line.ends_with(".. (4096 slots)"), "{line}");
        assert!(
            line.starts_with("[0, 1, 2") && line.contains(", 15]"),
            "{line}"
        );
        assert!(!line.contains(", 16"), "{line}");
    }

    fn pool() -> Arc<dyn KvPool> {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        Arc::new(HostKvPool::new(g, 4).unwrap())
    }

    /// Slots held past their claim until device work ends: refused to readers and writers
    /// (and waited for) until the event completes; for good without an event.
    #[test]
    fn a_claim_held_until_events_is_released_once_they_complete() {
        let pool = pool();
        let done = Arc::new(crate::scripted_event::ScriptedEvent::new(Ok(false)));
        let ev: SharedEvent = done.clone();
        SlotClaims::write(&pool, &[1, 2])
            .unwrap()
            .hold_until(Some(vec![ev]));
        SlotClaims::write(&pool, &[3]).unwrap().hold_until(None);
        let claims = pool.slot_claims().unwrap();
        assert_eq!(claims.held_slots(), vec![1, 2, 3]);
        assert!(SlotClaims::read(&pool, 1).is_err());
        assert!(SlotClaims::write(&pool, &[2]).is_err());
        let soon = std::time::Instant::now() + std::time::Duration::from_millis(20);
        assert!(SlotClaims::wait_free(pool.as_ref(), &[1], soon).is_err());
        done.answer(Ok(true));
        let later = std::time::Instant::now() + std::time::Duration::from_secs(5);
        SlotClaims::wait_free(pool.as_ref(), &[1, 2], later).unwrap();
        assert!(SlotClaims::read(&pool, 1).is_ok());
        assert_eq!(claims.held_slots(), vec![3], "work whose end nothing tells");
        assert!(SlotClaims::read(&pool, 3).is_err());
        // SAFETY: no copy writes slot 3 (none was ever queued in this test).
        assert_eq!(unsafe { claims.release_held() }, vec![3]);
        assert!(claims.held_slots().is_empty());
        assert!(SlotClaims::read(&pool, 3).is_ok());
    }

    #[test]
    fn writers_exclude_everyone_and_readers_exclude_writers() {
        let p = pool();
        let w = SlotClaims::write(&p, &[0, 1]).unwrap();
        assert!(matches!(
            SlotClaims::write(&p, &[1, 2]),
            Err(DeviceError::SlotBusy { slot: 1, .. })
        ));
        // All or none: slot 2 was given back when slot 1 was refused.
        let r2 = SlotClaims::read(&p, 2).unwrap();
        let r2b = SlotClaims::read(&p, 2).unwrap();
        assert!(SlotClaims::write(&p, &[2]).is_err(), "read twice");
        drop((r2, r2b));
        assert!(SlotClaims::write(&p, &[2]).is_ok());
        drop(w);
        assert!(SlotClaims::write(&p, &[0, 1]).is_ok());
    }

    #[test]
    fn reading_many_slots_is_all_or_none() {
        let p = pool();
        let w = SlotClaims::write(&p, &[2]).unwrap();
        assert!(matches!(
            SlotClaims::read_all(&p, &[0, 1, 2]),
            Err(DeviceError::SlotBusy { slot: 2, .. })
        ));
        // Slots 0 and 1 were given back when slot 2 was refused.
        assert!(SlotClaims::write(&p, &[0, 1]).is_ok());
        drop(w);
        let r = SlotClaims::read_all(&p, &[1, 1, 3]).unwrap();
        assert!(SlotClaims::write(&p, &[1]).is_err());
        assert!(SlotClaims::write(&p, &[3]).is_err());
        assert!(SlotClaims::read(&p, 1).is_ok(), "readers share");
        drop(r);
        assert!(
            SlotClaims::write(&p, &[1, 3]).is_ok(),
            "slot 1 read twice, released twice"
        );
        assert!(SlotClaims::read_all(&p, &[9]).is_err());
    }

    #[test]
    fn a_slot_named_twice_or_past_the_pool_is_refused() {
        let p = pool();
        assert!(SlotClaims::write(&p, &[3, 3]).is_err());
        assert!(SlotClaims::write(&p, &[3]).is_ok(), "nothing kept");
        let past =
            |r: Result<(), DeviceError>| matches!(r, Err(DeviceError::OutOfPool { slot: 9, .. }));
        assert!(
            past(SlotClaims::write(&p, &[9]).map(drop)),
            "not busy: out of the pool"
        );
        assert!(past(SlotClaims::read(&p, 9).map(drop)));
        assert!(past(SlotClaims::read_all(&p, &[1, 9]).map(drop)));
        assert!(SlotClaims::write(&p, &[1]).is_ok(), "slot 1 given back");
    }
}
