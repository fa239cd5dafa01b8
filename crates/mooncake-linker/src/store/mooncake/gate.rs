//! The transfer gate of a [`MooncakeStore`](super::MooncakeStore): calls that move bytes
//! (reads, puts) hold it shared; unregistering memory holds it alone, so that no transfer is
//! in flight when a region is let go (mooncake-sys's `unregister_buffer` contract).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::store::StoreError;

/// How long an unregister waits for the store's transfers in flight to end before it gives
/// up (the region then stays registered, and its memory must be kept).
pub const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

/// How long a call that moves bytes waits for the gate: an unregister holds it alone only for
/// the second half of its wait and its wheel call, so this much says that call hangs (a
/// metadata service that does not answer). The call then fails (`Unavailable`) rather than
/// park its store-call worker until the unregister returns.
pub const TRANSFER_WAIT: Duration = Duration::from_secs(10);

/// Shared by transfers, exclusive for unregistering; closed to unregistering for good once a
/// transfer was given up on.
#[derive(Debug, Default)]
pub(crate) struct TransferGate {
    lock: RwLock<()>,
    /// A transfer was given up on while it may still run (`StoreError::Abandoned`): no region
    /// is let go from then on.
    abandoned: AtomicBool,
}

/// Why a call that moves bytes did not run: an unregister held the gate (`key`: the call's
/// first key).
pub(crate) fn gate_held(key: &str) -> StoreError {
    StoreError::Unavailable {
        detail: format!(
            "`{key}`: not moved: a memory unregistration held the store's transfers for \
             {TRANSFER_WAIT:?} (its wheel call hangs)"
        )
        .into(),
    }
}

impl TransferGate {
    /// Held for the length of one call that moves bytes; `None` when an unregister held the
    /// gate for [`TRANSFER_WAIT`].
    pub(crate) fn transfer(&self) -> Option<RwLockReadGuard<'_, ()>> {
        self.lock.try_read_for(TRANSFER_WAIT)
    }

    /// Ends a call (`guard`) whose client gave up on a transfer that may still run: no region
    /// is unregistered from now on, since that transfer may still use any of them.
    pub(crate) fn abandon(&self, guard: RwLockReadGuard<'_, ()>) {
        self.abandoned.store(true, Ordering::Release);
        drop(guard);
    }

    /// Held while a region is unregistered: no transfer is in flight meanwhile. `None` if
    /// transfers were still in flight after `wait`, or at once when one was given up on.
    ///
    /// It yields to transfers for the first half of `wait`: until then it takes the gate only
    /// in a gap between transfers and never makes a new one wait (a waiting writer of the lock
    /// parks every new transfer of the store behind the one in flight). In the second half it
    /// waits as a writer, so that transfers that always overlap cannot keep it out, and new
    /// ones wait for it at most that long.
    pub(crate) fn quiet(&self, wait: Duration) -> Option<RwLockWriteGuard<'_, ()>> {
        let deadline = kv_loader::deadline_after(wait);
        // (`deadline_after` caps a huge wait: so may this.)
        let prefer_from = deadline.checked_sub(wait / 2).unwrap_or_else(Instant::now);
        let mut pause = Duration::from_micros(100);
        let quiet = loop {
            if self.abandoned.load(Ordering::Acquire) {
                return None;
            }
            if let Some(quiet) = self.lock.try_write() {
                break quiet;
            }
            let now = Instant::now();
            if now >= prefer_from {
                break self.lock.try_write_until(deadline)?;
            }
            std::thread::sleep(pause.min(prefer_from - now));
            pause = (pause * 2).min(Duration::from_millis(5));
        };
        // A call that ended abandoned set the flag before it let go of its guard.
        (!self.abandoned.load(Ordering::Acquire)).then_some(quiet)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Instant;

    /// Before, a wait past what `deadline_after` caps (100 years) overflowed `Instant`.
    #[test]
    fn quiet_takes_any_wait() {
        let gate = TransferGate::default();
        assert!(gate.quiet(Duration::MAX).is_some());
    }

    #[test]
    fn quiet_waits_for_transfers_in_flight_and_gives_up_in_bounded_time() {
        let gate = TransferGate::default();
        // No transfer: quiet at once.
        assert!(gate.quiet(Duration::ZERO).is_some());
        std::thread::scope(|s| {
            let (held, release) = (mpsc::channel(), mpsc::channel::<()>());
            let gate = &gate;
            s.spawn(move || {
                let _t = gate.transfer();
                held.0.send(()).unwrap();
                let _ = release.1.recv();
            });
            held.1.recv().unwrap();
            // A transfer in flight: quiet gives up after its wait, not before, not much later.
            let t0 = Instant::now();
            assert!(gate.quiet(Duration::from_millis(50)).is_none());
            let waited = t0.elapsed();
            assert!(waited >= Duration::from_millis(50), "{waited:?}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
            // Once it ends, quiet succeeds.
            release.0.send(()).unwrap();
            assert!(gate.quiet(Duration::from_secs(10)).is_some());
        });
    }

    /// Before, a waiting unregister was a waiting writer of the lock: every new transfer of
    /// the store parked behind it until the transfer in flight ended or the 5 s ran out.
    #[test]
    fn an_unregister_waiting_for_a_transfer_does_not_park_new_transfers() {
        let gate = TransferGate::default();
        std::thread::scope(|s| {
            let (held, release) = (mpsc::channel(), mpsc::channel::<()>());
            let gate = &gate;
            s.spawn(move || {
                let _t = gate.transfer();
                held.0.send(()).unwrap();
                let _ = release.1.recv();
            });
            held.1.recv().unwrap();
            let (started, got) = (mpsc::channel(), mpsc::channel());
            s.spawn(move || {
                started.0.send(()).unwrap();
                got.0
                    .send(gate.quiet(Duration::from_secs(20)).is_some())
                    .unwrap();
            });
            started.1.recv().unwrap();
            std::thread::sleep(Duration::from_millis(100));
            // The unregister is waiting; a new transfer goes ahead at once.
            let t0 = Instant::now();
            let second = gate.transfer();
            let took = t0.elapsed();
            assert!(took < Duration::from_secs(2), "parked for {took:?}");
            assert!(got.1.try_recv().is_err(), "not quiet while transfers run");
            drop(second);
            release.0.send(()).unwrap();
            // Both ended: the unregister gets its quiet, long before its 20 s.
            assert_eq!(got.1.recv_timeout(Duration::from_secs(10)), Ok(true));
        });
    }

    #[test]
    fn a_gate_with_an_abandoned_transfer_refuses_unregistering_at_once() {
        let gate = TransferGate::default();
        gate.abandon(gate.transfer().unwrap());
        let t0 = Instant::now();
        assert!(gate.quiet(Duration::from_secs(5)).is_none());
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // Transfers still go through.
        drop(gate.transfer());
    }
}
