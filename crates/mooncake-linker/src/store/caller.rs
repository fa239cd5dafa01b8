//! Whether anyone still waits for the store call running on this thread.
//!
//! [`StoreCalls`](super::StoreCalls) runs each call on a worker and gives it up at its
//! deadline. A store whose call waits for a lock that another of its calls holds across a
//! master or transfer-engine call (which may hang: a master that does not answer) can stop
//! waiting once no one waits for its answer: nothing is lost (the caller already has its
//! `Overdue`), and the worker goes back to the pool instead of staying parked behind the hung
//! holder until every store call fails for want of one. Which waits are "hung" and which are
//! only slow (a registration pins about a second per GB over RDMA) is the caller's bound to
//! say, not a fixed one here.
//!
//! A call sent without a caller waiting for it (cleanup past its deadline: a discard or a
//! session end; a registration left to its worker) counts as given up from the start: it
//! takes a lock that is free, and does not wait for one that is held (a session end then
//! leaves its keys to the holder). A call made outside [`StoreCalls`] (a test, a server
//! thread) has no caller: its waits are unbounded, as a plain lock's.

use std::cell::RefCell;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Mutex, MutexGuard};

/// How often a wait looks whether its caller gave up.
const LOOK_EVERY: Duration = Duration::from_millis(10);

/// A caller's side of one store call: whether it has given up on the call.
pub(super) trait Awaited: Send + Sync {
    /// True once the caller stopped waiting at its deadline (for good).
    fn given_up(&self) -> bool;
}

thread_local! {
    static CALLER: RefCell<Option<Arc<dyn Awaited>>> = const { RefCell::new(None) };
}

/// The caller of the store call running on this thread, while this lives.
pub(super) struct CallerScope {
    outer: Option<Arc<dyn Awaited>>,
}

/// Names `caller` as the one waiting for the store call this thread runs next, until the
/// returned scope drops (on every path, an unwinding call's too).
pub(super) fn enter(caller: Arc<dyn Awaited>) -> CallerScope {
    CallerScope {
        outer: CALLER.with(|c| c.borrow_mut().replace(caller)),
    }
}

impl Drop for CallerScope {
    fn drop(&mut self) {
        let outer = self.outer.take();
        CALLER.with(|c| *c.borrow_mut() = outer);
    }
}

/// True when the store call running on this thread has a caller, and it has given up.
pub(crate) fn caller_gave_up() -> bool {
    CALLER.with(|c| c.borrow().as_ref().is_some_and(|a| a.given_up()))
}

/// Takes `lock` once it is free, or `None` as soon as this thread's caller has given up (see
/// the module docs); with no caller, waits as long as it takes.
pub(crate) fn lock_while_awaited<T: ?Sized>(lock: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    if let Some(held) = lock.try_lock() {
        return Some(held);
    }
    loop {
        if caller_gave_up() {
            return None;
        }
        if let Some(held) = lock.try_lock_for(LOOK_EVERY) {
            return Some(held);
        }
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A caller a test gives up by hand.
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    /// A caller that gives up when told.
    #[derive(Default)]
    pub(crate) struct TestCaller(AtomicBool);

    impl TestCaller {
        /// Gives up on the call.
        pub(crate) fn give_up(&self) {
            self.0.store(true, Ordering::Release);
        }
    }

    impl super::Awaited for TestCaller {
        fn given_up(&self) -> bool {
            self.0.load(Ordering::Acquire)
        }
    }

    /// Runs `f` as a store call `caller` waits for.
    pub(crate) fn as_call_of<R>(caller: &Arc<TestCaller>, f: impl FnOnce() -> R) -> R {
        let _scope = super::enter(caller.clone());
        f()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::testing::{as_call_of, TestCaller};
    use super::*;

    /// A wait behind a held lock ends (`None`) soon after its caller gives up, and takes the
    /// lock when it is let go first.
    #[test]
    fn a_wait_ends_when_its_caller_gives_up() {
        let lock = Mutex::new(());
        let caller = Arc::new(TestCaller::default());
        std::thread::scope(|s| {
            let held = lock.lock();
            let waiter = s.spawn(|| {
                as_call_of(&caller, || {
                    let t0 = Instant::now();
                    (lock_while_awaited(&lock).is_some(), t0.elapsed())
                })
            });
            std::thread::sleep(Duration::from_millis(100));
            let waited_while_awaited = !waiter.is_finished();
            caller.give_up();
            // Let go after 5 s whatever happens, so that a wait that does not end fails
            // the test instead of hanging it.
            let until = Instant::now() + Duration::from_secs(5);
            while !waiter.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            drop(held);
            let (took, waited) = waiter.join().unwrap();
            assert!(waited_while_awaited, "waits while its caller waits");
            assert!(!took, "gave up with its caller");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
        });
        let again = Arc::new(TestCaller::default());
        assert!(as_call_of(&again, || lock_while_awaited(&lock).is_some()));
    }

    /// Without a caller (a call made outside the bounded workers) the wait is a plain lock's:
    /// it lasts until the holder lets go; and a scope names its caller only while it lives.
    #[test]
    fn without_a_caller_the_wait_lasts() {
        let lock = Mutex::new(());
        let gone = Arc::new(TestCaller::default());
        gone.give_up();
        as_call_of(&gone, || assert!(caller_gave_up()));
        assert!(!caller_gave_up(), "the scope's caller left with it");
        let held = lock.lock();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| lock_while_awaited(&lock).is_some());
            std::thread::sleep(Duration::from_millis(100));
            assert!(!waiter.is_finished());
            drop(held);
            assert!(waiter.join().unwrap());
        });
    }
}
