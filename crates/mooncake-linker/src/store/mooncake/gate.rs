//! The transfer gate of a [`MooncakeStore`](super::MooncakeStore): calls that move bytes
//! (reads, puts) hold it shared; unregistering memory holds it alone, so that no transfer is
//! in flight when a region is let go (mooncake-sys's `unregister_buffer` contract).

use std::time::Duration;

use parking_lot::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// How long an unregister waits for the store's transfers in flight to end before it gives
/// up (the region then stays registered, and its memory must be kept).
pub const UNREGISTER_WAIT: Duration = Duration::from_secs(5);

/// Shared by transfers, exclusive for unregistering.
#[derive(Debug, Default)]
pub(crate) struct TransferGate(RwLock<()>);

impl TransferGate {
    /// Held for the length of one call that moves bytes.
    pub(crate) fn transfer(&self) -> RwLockReadGuard<'_, ()> {
        self.0.read()
    }

    /// Held while a region is unregistered: no transfer is in flight meanwhile. `None` if
    /// transfers were still in flight after `wait`.
    pub(crate) fn quiet(&self, wait: Duration) -> Option<RwLockWriteGuard<'_, ()>> {
        self.0.try_write_for(wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::time::Instant;

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
}
