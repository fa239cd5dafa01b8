//! Loom models of the counter's races. Run with
//! `RUSTFLAGS="--cfg kvlink_loom" cargo test -p layerwise-counter --test loom --release`.
//!
//! Loom has no clock: waits end only on a notification (a lost wake-up is reported as a
//! deadlock), and deadlines are far in the future. Hook records use a std mutex whose
//! critical sections contain no loom operation.
#![cfg(kvlink_loom)]

use std::sync::{Arc as StdArc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use layerwise_counter::{CounterError, LayerCounter, LayerHook, WaitOutcome};
use loom::sync::Arc;
use loom::thread;

fn far() -> Instant {
    Instant::now() + Duration::from_secs(3600)
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

fn recording_hook() -> (LayerHook, StdArc<StdMutex<Vec<u32>>>) {
    let calls = StdArc::new(StdMutex::new(Vec::new()));
    let c = StdArc::clone(&calls);
    let hook: LayerHook = StdArc::new(move |_, l| c.lock().unwrap().push(l));
    (hook, calls)
}

/// Two threads complete two layers in opposite orders while a third waits for the last
/// layer: the hook runs once per layer, in order, before the waiter sees Ready.
#[test]
fn racing_completers_hook_once_in_order_and_wake_the_waiter() {
    model(|| {
        let c = Arc::new(LayerCounter::<u32>::with_capacity(1));
        let (hook, calls) = recording_hook();
        let t = c.begin_with_hook(2, hook).unwrap();
        let completers: Vec<_> = [[1, 0], [0, 1]]
            .into_iter()
            .map(|order| {
                let c = Arc::clone(&c);
                thread::spawn(move || {
                    for l in order {
                        c.complete(t, l).unwrap();
                    }
                })
            })
            .collect();
        assert_eq!(c.wait(t, 1, far()), Ok(WaitOutcome::Ready));
        assert_eq!(*calls.lock().unwrap(), vec![0, 1], "hook done before Ready");
        for h in completers {
            h.join().unwrap();
        }
        assert_eq!(*calls.lock().unwrap(), vec![0, 1]);
    });
}

/// A completion races a failure while a thread waits: the waiter ends (no lost wake-up)
/// with Ready only if the layer's hook ran, and otherwise with the failure.
#[test]
fn failure_races_completion() {
    model(|| {
        let c = Arc::new(LayerCounter::<u32>::with_capacity(1));
        let (hook, calls) = recording_hook();
        let t = c.begin_with_hook(1, hook).unwrap();
        let completer = {
            let c = Arc::clone(&c);
            thread::spawn(move || c.complete(t, 0).unwrap())
        };
        let failer = {
            let c = Arc::clone(&c);
            thread::spawn(move || c.fail(t, 7).unwrap())
        };
        match c.wait(t, 0, far()) {
            Ok(WaitOutcome::Ready) => assert_eq!(*calls.lock().unwrap(), vec![0]),
            Ok(WaitOutcome::Failed(7)) => {}
            other => panic!("unexpected {other:?}"),
        }
        completer.join().unwrap();
        failer.join().unwrap();
        assert!(calls.lock().unwrap().len() <= 1);
    });
}

/// A reset races a waiter and a completer: the waiter never hangs; it sees Ready, or
/// Cancelled, or the stale ticket.
#[test]
fn reset_races_wait() {
    model(|| {
        let c = Arc::new(LayerCounter::<u32>::with_capacity(1));
        let t = c.begin(1).unwrap();
        let resetter = {
            let c = Arc::clone(&c);
            thread::spawn(move || c.reset())
        };
        let completer = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                let r = c.complete(t, 0);
                assert!(matches!(r, Ok(()) | Err(CounterError::StaleTicket { .. })));
            })
        };
        let r = c.wait(t, 0, far());
        assert!(
            matches!(
                r,
                Ok(WaitOutcome::Ready | WaitOutcome::Cancelled)
                    | Err(CounterError::StaleTicket { .. })
            ),
            "{r:?}"
        );
        resetter.join().unwrap();
        completer.join().unwrap();
        assert_eq!(c.in_flight(), 0);
    });
}

/// The lock-free readers on an old ticket while its slot is recycled for a batch whose
/// layer is ready: never a wrong `true`/`Ready` (the seqlock generation re-check).
#[test]
fn recycled_slot_never_answers_an_old_ticket() {
    model(|| {
        let c = Arc::new(LayerCounter::<u32>::with_capacity(1));
        let old = c.begin(2).unwrap();
        let recycler = {
            let c = Arc::clone(&c);
            thread::spawn(move || {
                c.finish(old).unwrap();
                let new = c.begin(1).unwrap();
                c.complete(new, 0).unwrap();
                new
            })
        };
        let r = c.is_ready(old, 0);
        assert!(
            matches!(r, Ok(false) | Err(CounterError::StaleTicket { .. })),
            "{r:?}"
        );
        let r = c.ready_layers(old);
        assert!(
            matches!(r, Ok(0) | Err(CounterError::StaleTicket { .. })),
            "{r:?}"
        );
        // Layer 1 exists for the old batch only: never LayerOutOfRange from the new one.
        let r = c.is_ready(old, 1);
        assert!(
            matches!(r, Ok(false) | Err(CounterError::StaleTicket { .. })),
            "{r:?}"
        );
        let new = recycler.join().unwrap();
        assert_eq!(c.is_ready(new, 0), Ok(true));
        assert_eq!(
            c.is_ready(old, 0),
            Err(CounterError::StaleTicket { ticket: old })
        );
    });
}
