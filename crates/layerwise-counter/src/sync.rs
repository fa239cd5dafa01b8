//! Synchronisation primitives: std atomics and parking_lot normally, loom's under
//! `--cfg kvlink_loom` so that `tests/loom.rs` can explore the interleavings.
//!
//! The wrappers give both the same small API: `Mutex::lock` returns the guard directly,
//! `Condvar::wait_until` takes the guard by value and gives it back.

pub(crate) use imp::{AtomicU32, AtomicU64, Condvar, Mutex, MutexGuard};
pub(crate) use std::sync::atomic::Ordering;

#[cfg(not(kvlink_loom))]
mod imp {
    use std::time::Instant;

    pub(crate) use parking_lot::MutexGuard;
    pub(crate) use std::sync::atomic::{AtomicU32, AtomicU64};

    /// A parking_lot mutex.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(parking_lot::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(parking_lot::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock()
        }
    }

    /// A parking_lot condition variable.
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(parking_lot::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(parking_lot::Condvar::new())
        }

        /// Waits for a notification or the deadline; may wake spuriously.
        pub(crate) fn wait_until<'a, T>(
            &self,
            mut guard: MutexGuard<'a, T>,
            deadline: Instant,
        ) -> MutexGuard<'a, T> {
            // Whether it timed out is re-derived by the caller from the clock.
            let _ = self.0.wait_until(&mut guard, deadline);
            guard
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}

#[cfg(kvlink_loom)]
mod imp {
    use std::time::Instant;

    pub(crate) use loom::sync::atomic::{AtomicU32, AtomicU64};
    pub(crate) use loom::sync::MutexGuard;

    /// A loom mutex (poisoning ignored: only a panicking test poisons it).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Self(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }
    }

    /// A loom condition variable. Loom does not model time, so the deadline is ignored
    /// and the wait ends only on a notification: a lost wake-up shows up as a deadlock.
    #[derive(Debug)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Self(loom::sync::Condvar::new())
        }

        pub(crate) fn wait_until<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
            _deadline: Instant,
        ) -> MutexGuard<'a, T> {
            self.0.wait(guard).unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }
}
