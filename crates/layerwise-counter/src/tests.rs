//! Behaviour tests of [`LayerCounter`] on real threads.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use crate::{CounterError, LayerCounter, LayerHook, Ticket, WaitOutcome, MAX_LAYERS};

type Counter = LayerCounter<String>;

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Returns once `n` threads are blocked in a wait of `c` (a fixed sleep let a waiter that
/// started late, on a loaded machine, reach its wait after the release: stale, not
/// cancelled).
fn until_waiting(c: &Counter, n: u32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while c.waiting() < n {
        assert!(Instant::now() < deadline, "{} of {n} waiting", c.waiting());
        thread::sleep(Duration::from_millis(1));
    }
}

/// A small xorshift generator: the tests need varied orders, not good randomness.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % u64::from(n)) as u32
    }

    fn shuffled(&mut self, n: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i as u32 + 1) as usize);
        }
        v
    }
}

/// A hook that records the layers it was called for.
type Calls = Arc<Mutex<Vec<(Ticket, u32)>>>;

fn recording_hook() -> (LayerHook, Calls) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let c = Arc::clone(&calls);
    let hook: LayerHook = Arc::new(move |t, l| c.lock().unwrap().push((t, l)));
    (hook, calls)
}

#[test]
fn in_order_completions() {
    let c = Counter::new();
    let t = c.begin(4).unwrap();
    assert_eq!(c.ready_layers(t), Ok(0));
    for l in 0..4 {
        assert_eq!(c.is_ready(t, l), Ok(false));
        c.complete(t, l).unwrap();
        assert_eq!(c.is_ready(t, l), Ok(true));
        assert_eq!(c.ready_layers(t), Ok(l + 1));
        assert_eq!(c.wait(t, l, Instant::now()), Ok(WaitOutcome::Ready));
    }
    c.finish(t).unwrap();
}

#[test]
fn out_of_order_completions_follow_the_prefix() {
    let c = Counter::new();
    let t = c.begin(4).unwrap();
    for l in [3, 1, 2] {
        c.complete(t, l).unwrap();
        assert_eq!(c.ready_layers(t), Ok(0));
    }
    assert_eq!(c.is_ready(t, 3), Ok(false));
    assert_eq!(c.wait(t, 1, Instant::now()), Ok(WaitOutcome::TimedOut));
    c.complete(t, 3).unwrap(); // idempotent
    assert_eq!(c.ready_layers(t), Ok(0));
    c.complete(t, 0).unwrap();
    assert_eq!(c.ready_layers(t), Ok(4));
    assert_eq!(c.wait(t, 3, Instant::now()), Ok(WaitOutcome::Ready));
}

#[test]
fn waiter_is_woken_by_a_completion_on_another_thread() {
    let c = Arc::new(Counter::new());
    let t = c.begin(2).unwrap();
    let waiter = {
        let c = Arc::clone(&c);
        thread::spawn(move || c.wait(t, 1, soon()))
    };
    until_waiting(&c, 1);
    c.complete(t, 1).unwrap();
    thread::sleep(Duration::from_millis(20));
    assert!(
        !waiter.is_finished(),
        "layer 1 is not ready until layer 0 is"
    );
    c.complete(t, 0).unwrap();
    assert_eq!(waiter.join().unwrap(), Ok(WaitOutcome::Ready));
}

#[test]
fn hook_runs_once_per_layer_in_order_under_concurrent_completers() {
    const LAYERS: u32 = 200;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for round in 0..10 {
        let c = Arc::new(Counter::new());
        let (hook, calls) = recording_hook();
        let early = Arc::new(AtomicBool::new(false));
        let counter_for_hook = Arc::downgrade(&c);
        let early_flag = Arc::clone(&early);
        let checking_hook: LayerHook = Arc::new(move |t, l| {
            // The prefix is published after the hook: the layer is not ready yet.
            if let Some(c) = counter_for_hook.upgrade() {
                if c.is_ready(t, l) != Ok(false) {
                    early_flag.store(true, Ordering::SeqCst);
                }
            }
            hook(t, l);
        });
        let t = c.begin_with_hook(LAYERS, checking_hook).unwrap();
        let threads = 2 + round % 7;
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let c = Arc::clone(&c);
                let order = rng.shuffled(LAYERS);
                thread::spawn(move || {
                    for l in order {
                        c.complete(t, l).unwrap();
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        let calls = calls.lock().unwrap().clone();
        let expected: Vec<_> = (0..LAYERS).map(|l| (t, l)).collect();
        assert_eq!(calls, expected, "round {round}: once each, in order");
        assert!(
            !early.load(Ordering::SeqCst),
            "a layer was ready before its hook"
        );
        assert_eq!(c.ready_layers(t), Ok(LAYERS));
    }
}

#[test]
fn ready_means_the_hook_has_returned() {
    const LAYERS: u32 = 64;
    let c = Arc::new(Counter::new());
    let hooks_done = Arc::new(AtomicU32::new(0));
    let h = Arc::clone(&hooks_done);
    let hook: LayerHook = Arc::new(move |_, l| {
        thread::yield_now();
        h.store(l + 1, Ordering::SeqCst);
    });
    let t = c.begin_with_hook(LAYERS, hook).unwrap();
    let waiters: Vec<_> = (0..4)
        .map(|i| {
            let c = Arc::clone(&c);
            let hooks_done = Arc::clone(&hooks_done);
            thread::spawn(move || {
                for l in (i..LAYERS).step_by(4) {
                    assert_eq!(c.wait(t, l, soon()), Ok(WaitOutcome::Ready));
                    assert!(hooks_done.load(Ordering::SeqCst) > l);
                }
            })
        })
        .collect();
    let mut rng = Rng(7);
    for l in rng.shuffled(LAYERS) {
        c.complete(t, l).unwrap();
    }
    for w in waiters {
        w.join().unwrap();
    }
}

#[test]
fn hook_may_call_back_into_the_counter() {
    let c = Arc::new(Counter::new());
    let weak = Arc::downgrade(&c);
    let calls = Arc::new(Mutex::new(Vec::new()));
    let rec = Arc::clone(&calls);
    let hook: LayerHook = Arc::new(move |t, l| {
        rec.lock().unwrap().push(l);
        if let Some(c) = weak.upgrade() {
            // Completing the next layer from inside the hook must not deadlock.
            let _ = c.complete(t, l + 1);
            let _ = c.ready_layers(t);
        }
    });
    let t = c.begin_with_hook(5, hook).unwrap();
    c.complete(t, 0).unwrap();
    assert_eq!(*calls.lock().unwrap(), vec![0, 1, 2, 3, 4]);
    assert_eq!(c.ready_layers(t), Ok(5));
}

#[test]
fn failure_wakes_all_waiters_with_the_first_error() {
    let c = Arc::new(Counter::new());
    let (hook, calls) = recording_hook();
    let t = c.begin_with_hook(4, hook).unwrap();
    c.complete(t, 0).unwrap();
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let c = Arc::clone(&c);
            thread::spawn(move || c.wait(t, 2, soon()))
        })
        .collect();
    until_waiting(&c, 4);
    c.fail(t, "boom".to_owned()).unwrap();
    c.fail(t, "second".to_owned()).unwrap();
    for w in waiters {
        assert_eq!(
            w.join().unwrap(),
            Ok(WaitOutcome::Failed("boom".to_owned()))
        );
    }
    // Ready stays ready; the rest fails; completions and hooks stop.
    assert_eq!(c.wait(t, 0, soon()), Ok(WaitOutcome::Ready));
    c.complete(t, 1).unwrap();
    assert_eq!(c.ready_layers(t), Ok(1));
    assert_eq!(
        c.wait(t, 1, soon()),
        Ok(WaitOutcome::Failed("boom".to_owned()))
    );
    assert_eq!(calls.lock().unwrap().len(), 1);
}

#[test]
fn wait_times_out_at_the_deadline() {
    let c = Counter::new();
    let t = c.begin(2).unwrap();
    let start = Instant::now();
    let deadline = start + Duration::from_millis(50);
    assert_eq!(c.wait(t, 0, deadline), Ok(WaitOutcome::TimedOut));
    assert!(Instant::now() >= deadline);
    assert!(start.elapsed() < Duration::from_secs(5));
    // A deadline in the past still answers ready layers.
    c.complete(t, 0).unwrap();
    assert_eq!(c.wait(t, 0, start), Ok(WaitOutcome::Ready));
}

#[test]
fn reset_cancels_waiters_and_makes_tickets_stale() {
    let c = Arc::new(Counter::with_capacity(4));
    let a = c.begin(3).unwrap();
    let b = c.begin(3).unwrap();
    c.complete(a, 0).unwrap();
    let waiters: Vec<_> = [(a, 1), (a, 2), (b, 0)]
        .into_iter()
        .map(|(t, l)| {
            let c = Arc::clone(&c);
            thread::spawn(move || c.wait(t, l, soon()))
        })
        .collect();
    until_waiting(&c, 3);
    c.reset();
    for w in waiters {
        assert_eq!(w.join().unwrap(), Ok(WaitOutcome::Cancelled));
    }
    assert_eq!(c.in_flight(), 0);
    for t in [a, b] {
        let stale = CounterError::StaleTicket { ticket: t };
        assert_eq!(c.wait(t, 0, soon()), Err(stale));
        assert_eq!(c.complete(t, 1), Err(stale));
        assert_eq!(c.is_ready(t, 0), Err(stale));
        assert_eq!(c.finish(t), Err(stale));
    }
    // Usable again, with all slots.
    let ts: Vec<_> = (0..4).map(|_| c.begin(1).unwrap()).collect();
    assert!(ts.iter().all(|t| *t != a && *t != b));
    assert_eq!(c.in_flight(), 4);
}

#[test]
fn finish_while_waiting_cancels() {
    let c = Arc::new(Counter::new());
    let t = c.begin(1).unwrap();
    let w = {
        let c = Arc::clone(&c);
        thread::spawn(move || c.wait(t, 0, soon()))
    };
    until_waiting(&c, 1);
    c.finish(t).unwrap();
    assert_eq!(w.join().unwrap(), Ok(WaitOutcome::Cancelled));
}

#[test]
fn stale_ticket_after_finish() {
    let c = Counter::new();
    let t = c.begin(2).unwrap();
    c.complete(t, 0).unwrap();
    c.finish(t).unwrap();
    let stale = CounterError::StaleTicket { ticket: t };
    assert_eq!(c.wait(t, 0, soon()), Err(stale));
    assert_eq!(c.is_ready(t, 0), Err(stale));
    assert_eq!(c.ready_layers(t), Err(stale));
    assert_eq!(c.complete(t, 1), Err(stale));
    assert_eq!(c.fail(t, "x".into()), Err(stale));
    assert_eq!(c.finish(t), Err(stale));
    // A ticket for a slot the table does not have.
    let alien = Ticket::new(1000, 1);
    assert_eq!(
        c.wait(alien, 0, soon()),
        Err(CounterError::StaleTicket { ticket: alien })
    );
}

/// A ticket of another counter is stale here, though the same slot of both counters holds a
/// batch: generations are never shared between counters.
#[test]
fn a_ticket_of_another_counter_is_stale() {
    let a = Counter::with_capacity(1);
    let b = Counter::with_capacity(1);
    let ta = a.begin(2).unwrap();
    let tb = b.begin(2).unwrap();
    assert_eq!(ta.slot(), tb.slot());
    let stale = Err(CounterError::StaleTicket { ticket: ta });
    assert_eq!(b.complete(ta, 0), stale);
    assert_eq!(b.fail(ta, "x".into()), stale);
    assert_eq!(b.finish(ta), stale);
    assert_eq!(b.is_ready(tb, 0), Ok(false), "b's batch untouched");
    assert_eq!(a.complete(ta, 0), Ok(()));
}

#[test]
fn slot_reuse_gives_a_new_generation_and_old_tickets_stay_stale() {
    let c = Counter::with_capacity(1);
    let t1 = c.begin(1).unwrap();
    c.finish(t1).unwrap();
    let t2 = c.begin(1).unwrap();
    assert_eq!(t1.slot(), t2.slot());
    assert!(t2.generation() > t1.generation());
    c.complete(t2, 0).unwrap();
    assert_eq!(c.is_ready(t2, 0), Ok(true));
    assert_eq!(
        c.is_ready(t1, 0),
        Err(CounterError::StaleTicket { ticket: t1 })
    );
    assert_eq!(
        c.wait(t1, 0, soon()),
        Err(CounterError::StaleTicket { ticket: t1 })
    );
    c.reset();
    let t3 = c.begin(1).unwrap();
    assert!(t3.generation() > t2.generation());
    assert_eq!(c.is_ready(t3, 0), Ok(false), "the new batch starts empty");
}

#[test]
fn capacity_full() {
    let c = Counter::with_capacity(2);
    assert_eq!(c.capacity(), 2);
    let a = c.begin(1).unwrap();
    let _b = c.begin(1).unwrap();
    assert_eq!(c.begin(1), Err(CounterError::Full { capacity: 2 }));
    assert_eq!(c.in_flight(), 2);
    c.finish(a).unwrap();
    assert_eq!(c.in_flight(), 1);
    assert!(c.begin(1).is_ok());
    let none = Counter::with_capacity(0);
    assert_eq!(none.begin(1), Err(CounterError::Full { capacity: 0 }));
    assert_eq!(Counter::default().capacity(), 64);
}

#[test]
fn layer_out_of_range_and_bad_layer_counts() {
    let c = Counter::new();
    let t = c.begin(3).unwrap();
    let oor = CounterError::LayerOutOfRange {
        ticket: t,
        layer: 3,
        num_layers: 3,
    };
    assert_eq!(c.complete(t, 3), Err(oor));
    assert_eq!(c.is_ready(t, 3), Err(oor));
    assert_eq!(c.wait(t, 3, soon()), Err(oor));
    assert_eq!(c.begin(0), Err(CounterError::ZeroLayers));
    assert_eq!(
        c.begin(MAX_LAYERS + 1),
        Err(CounterError::TooManyLayers {
            num_layers: MAX_LAYERS + 1,
            max: MAX_LAYERS
        })
    );
    assert!(c.begin(MAX_LAYERS).is_ok());
    assert_eq!(c.in_flight(), 2);
}

#[test]
fn a_panicking_hook_propagates_and_no_layer_from_it_on_is_ever_ready() {
    let c = Counter::new();
    let calls = Arc::new(AtomicU32::new(0));
    let n = Arc::clone(&calls);
    let hook: LayerHook = Arc::new(move |_, l| {
        n.fetch_add(1, Ordering::SeqCst);
        assert_ne!(l, 1, "hook fails on layer 1");
    });
    let t = c.begin_with_hook(4, hook).unwrap();
    c.complete(t, 1).unwrap();
    let r = catch_unwind(AssertUnwindSafe(|| c.complete(t, 0)));
    assert!(r.is_err());
    // Layer 0's hook returned; layer 1's panicked: it is not ready, nor is any later one.
    assert_eq!(c.ready_layers(t), Ok(1));
    c.complete(t, 2).unwrap();
    c.complete(t, 3).unwrap();
    assert_eq!(c.ready_layers(t), Ok(1));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    let soon = Instant::now() + Duration::from_millis(50);
    assert!(matches!(c.wait(t, 1, soon), Ok(WaitOutcome::TimedOut)));
    // The caller fails the batch: the waiters of those layers get it.
    c.fail(t, "hook panicked".into()).unwrap();
    assert!(matches!(c.wait(t, 3, soon), Ok(WaitOutcome::Failed(_))));
    assert!(matches!(c.wait(t, 0, soon), Ok(WaitOutcome::Ready)));
}

#[test]
fn counter_is_send_sync_and_debug() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<LayerCounter<String>>();
    assert_send_sync::<LayerCounter<Arc<dyn std::error::Error + Send + Sync>>>();
    let c = Counter::with_capacity(3);
    let _t = c.begin(1).unwrap();
    assert_eq!(
        format!("{c:?}"),
        "LayerCounter { capacity: 3, in_flight: 1 }"
    );
    assert_eq!(
        CounterError::Full { capacity: 3 }.to_string(),
        "layer counter full: 3 batches in flight"
    );
}
