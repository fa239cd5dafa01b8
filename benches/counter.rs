//! layerwise-counter benches: the ready-path wait (design §6: "well under a microsecond")
//! and the complete→wake latency across threads.
//!
//! `cargo bench --bench counter`

use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use divan::{black_box, Bencher};
use layerwise_counter::{LayerCounter, Ticket, WaitOutcome};

fn main() {
    divan::main();
}

fn far() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(3600))
}

/// `wait` on a layer that is already ready: the lock-free fast path.
#[divan::bench]
fn wait_ready_layer(bencher: Bencher) {
    let counter = LayerCounter::<()>::new();
    let ticket = counter.begin(78).unwrap();
    for l in 0..78 {
        counter.complete(ticket, l).unwrap();
    }
    let deadline = far();
    bencher.bench_local(|| counter.wait(black_box(ticket), black_box(40), black_box(deadline)));
}

/// `is_ready` on a ready layer (same fast path, plus the range check).
#[divan::bench]
fn is_ready_layer(bencher: Bencher) {
    let counter = LayerCounter::<()>::new();
    let ticket = counter.begin(78).unwrap();
    for l in 0..78 {
        counter.complete(ticket, l).unwrap();
    }
    bencher.bench_local(|| counter.is_ready(black_box(ticket), black_box(40)));
}

/// A whole batch on one thread: begin, complete 78 layers (GLM-5.2), finish.
#[divan::bench]
fn begin_complete78_finish(bencher: Bencher) {
    let counter = LayerCounter::<()>::new();
    bencher.bench_local(|| {
        let ticket = counter.begin(78).unwrap();
        for l in 0..78 {
            counter.complete(ticket, l).unwrap();
        }
        counter.finish(ticket).unwrap();
    });
}

/// Round trip across two threads: this thread completes layer `l` of `ping` and waits for
/// layer `l` of `pong`; the responder waits for `ping` `l` (usually parked on the condvar)
/// and completes `pong` `l`. One iteration = two complete→wake hand-offs.
#[divan::bench(sample_count = 200, sample_size = 50)]
fn complete_wake_round_trip(bencher: Bencher) {
    const LAYERS: u32 = 4096;
    let counter = Arc::new(LayerCounter::<()>::with_capacity(4));
    let (tx, rx) = mpsc::channel::<(Ticket, Ticket)>();
    let responder = {
        let counter = Arc::clone(&counter);
        thread::spawn(move || {
            let deadline = far();
            while let Ok((ping, pong)) = rx.recv() {
                for l in 0..LAYERS {
                    if counter.wait(ping, l, deadline) != Ok(WaitOutcome::Ready) {
                        return;
                    }
                    counter.complete(pong, l).unwrap();
                }
            }
        })
    };
    let new_pair = || {
        (
            counter.begin(LAYERS).unwrap(),
            counter.begin(LAYERS).unwrap(),
        )
    };
    let mut pair = new_pair();
    tx.send(pair).unwrap();
    let mut next = 0;
    let deadline = far();
    bencher.bench_local(|| {
        if next == LAYERS {
            // The responder is done with this pair: it completed pong's last layer.
            counter.finish(pair.0).unwrap();
            counter.finish(pair.1).unwrap();
            pair = new_pair();
            tx.send(pair).unwrap();
            next = 0;
        }
        counter.complete(pair.0, next).unwrap();
        let r = counter.wait(pair.1, next, deadline);
        next += 1;
        r
    });
    drop(tx);
    counter.reset(); // cancels the responder's wait, if it is in one
    responder.join().unwrap();
}

/// Baseline for `complete_wake_round_trip`: the same two-thread ping-pong on a bare std
/// `Mutex<u64>` + `Condvar` pair per direction, i.e. the cost of the OS wake-ups alone.
#[divan::bench(sample_count = 200, sample_size = 50)]
fn baseline_condvar_round_trip(bencher: Bencher) {
    use std::sync::{Condvar, Mutex};
    type Flag = (Mutex<u64>, Condvar);
    let ping: Arc<Flag> = Arc::default();
    let pong: Arc<Flag> = Arc::default();
    let responder = {
        let (ping, pong) = (Arc::clone(&ping), Arc::clone(&pong));
        thread::spawn(move || {
            let mut seen = 0;
            loop {
                let mut v = ping.0.lock().unwrap();
                while *v == seen {
                    v = ping.1.wait(v).unwrap();
                }
                seen = *v;
                drop(v);
                if seen == u64::MAX {
                    return;
                }
                *pong.0.lock().unwrap() = seen;
                pong.1.notify_all();
            }
        })
    };
    let mut n = 0u64;
    bencher.bench_local(|| {
        n += 1;
        *ping.0.lock().unwrap() = n;
        ping.1.notify_all();
        let mut v = pong.0.lock().unwrap();
        while *v != n {
            v = pong.1.wait(v).unwrap();
        }
    });
    *ping.0.lock().unwrap() = u64::MAX;
    ping.1.notify_all();
    responder.join().unwrap();
}
