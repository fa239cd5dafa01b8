//! Randomized schedules on real threads: random layer counts, completion orders (with
//! duplicates), thread counts 2 to 8, failures, finishes, resets, slot recycling and
//! yields. Every wait has a deadline; invariants are checked after every answer.
//!
//! `STRESS_SCHEDULES=N` runs N schedules instead of the default.
#![cfg(not(kvlink_loom))]

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use layerwise_counter::{CounterError, LayerCounter, LayerHook, Ticket, WaitOutcome};

const DEFAULT_SCHEDULES: u32 = 5000;
/// A wait meant to end by an event, not by its deadline: reaching it means a hang.
const LONG: Duration = Duration::from_secs(5);

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u32) -> u32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % u64::from(n.max(1))) as u32
    }

    fn chance(&mut self, percent: u32) -> bool {
        self.below(100) < percent
    }

    fn maybe_yield(&mut self) {
        if self.chance(30) {
            thread::yield_now();
        }
    }
}

/// What the test knows about one batch, written before the counter is told.
struct Batch {
    layers: u32,
    completed: Vec<AtomicBool>,
    hook_calls: Arc<Mutex<Vec<(Ticket, u32)>>>,
    hooks_returned: Arc<AtomicU32>,
    has_hook: bool,
    released: AtomicBool,
    errors_sent: Mutex<Vec<u32>>,
    errors_seen: Mutex<Vec<u32>>,
}

impl Batch {
    fn begin(counter: &LayerCounter<u32>, layers: u32, has_hook: bool) -> (Arc<Self>, Ticket) {
        let hook_calls = Arc::new(Mutex::new(Vec::new()));
        let hooks_returned = Arc::new(AtomicU32::new(0));
        let batch = Arc::new(Self {
            layers,
            completed: (0..layers).map(|_| AtomicBool::new(false)).collect(),
            hook_calls: Arc::clone(&hook_calls),
            hooks_returned: Arc::clone(&hooks_returned),
            has_hook,
            released: AtomicBool::new(false),
            errors_sent: Mutex::new(Vec::new()),
            errors_seen: Mutex::new(Vec::new()),
        });
        let ticket = if has_hook {
            let hook: LayerHook = Arc::new(move |t, l| {
                hook_calls.lock().unwrap().push((t, l));
                thread::yield_now();
                hooks_returned.fetch_add(1, SeqCst);
            });
            counter.begin_with_hook(layers, hook)
        } else {
            counter.begin(layers)
        };
        (batch, ticket.expect("a free slot"))
    }

    fn prefix_completed(&self, n: u32) -> bool {
        self.completed[..n as usize].iter().all(|c| c.load(SeqCst))
    }

    fn complete(&self, counter: &LayerCounter<u32>, t: Ticket, layer: u32) -> bool {
        self.completed[layer as usize].store(true, SeqCst);
        match counter.complete(t, layer) {
            Ok(()) => true,
            Err(CounterError::StaleTicket { .. }) => {
                assert!(self.released.load(SeqCst), "stale before release");
                false
            }
            Err(e) => panic!("complete: {e}"),
        }
    }

    /// Checks one answer of `wait(t, layer, deadline)`; true if it ended the batch for us.
    fn check_wait(
        &self,
        r: Result<WaitOutcome<u32>, CounterError>,
        layer: u32,
        deadline: Instant,
        long: bool,
    ) -> bool {
        match r {
            Ok(WaitOutcome::Ready) => {
                assert!(self.prefix_completed(layer + 1), "Ready before complete");
                if self.has_hook {
                    assert!(
                        self.hooks_returned.load(SeqCst) > layer,
                        "Ready before the hook returned"
                    );
                }
                false
            }
            Ok(WaitOutcome::Failed(e)) => {
                assert!(
                    self.errors_sent.lock().unwrap().contains(&e),
                    "unsent error"
                );
                self.errors_seen.lock().unwrap().push(e);
                true
            }
            Ok(WaitOutcome::TimedOut) => {
                assert!(Instant::now() >= deadline, "timed out early");
                assert!(!long, "a wait that should have been woken hung");
                false
            }
            Ok(WaitOutcome::Cancelled) | Err(CounterError::StaleTicket { .. }) => {
                assert!(self.released.load(SeqCst), "cancelled/stale before release");
                true
            }
            Err(e) => panic!("wait: {e}"),
        }
    }

    fn check_readers(&self, counter: &LayerCounter<u32>, t: Ticket, layer: u32) {
        match counter.ready_layers(t) {
            Ok(n) => {
                assert!(n <= self.layers);
                assert!(
                    self.prefix_completed(n),
                    "ready_layers ahead of completions"
                );
                if self.has_hook {
                    assert!(self.hooks_returned.load(SeqCst) >= n, "ready before hook");
                }
            }
            Err(CounterError::StaleTicket { .. }) => assert!(self.released.load(SeqCst)),
            Err(e) => panic!("ready_layers: {e}"),
        }
        match counter.is_ready(t, layer) {
            Ok(true) => assert!(self.prefix_completed(layer + 1), "is_ready too early"),
            Ok(false) => {}
            Err(CounterError::StaleTicket { .. }) => assert!(self.released.load(SeqCst)),
            Err(e) => panic!("is_ready: {e}"),
        }
    }

    fn check_hooks(&self, t: Ticket, all_expected: bool) {
        let calls = self.hook_calls.lock().unwrap();
        let expected: Vec<_> = (0..calls.len() as u32).map(|l| (t, l)).collect();
        assert_eq!(*calls, expected, "hooks not once each in layer order");
        if self.has_hook && all_expected {
            assert_eq!(calls.len() as u32, self.layers, "missing hook calls");
        }
        let seen = self.errors_seen.lock().unwrap();
        assert!(
            seen.windows(2).all(|w| w[0] == w[1]),
            "different failures seen"
        );
    }
}

#[derive(Clone, Copy, Debug)]
enum Chaos {
    None,
    Fail,
    Finish,
    Reset,
}

fn schedule(seed: u64) {
    let mut rng = Rng(seed);
    let counter = Arc::new(LayerCounter::<u32>::with_capacity(1 + rng.below(2)));
    let layers = 1 + rng.below(12);
    let (batch, ticket) = Batch::begin(&counter, layers, rng.chance(70));
    let threads = 2 + rng.below(7);
    let chaos = match rng.below(6) {
        0 => Chaos::Fail,
        1 => Chaos::Finish,
        2 => Chaos::Reset,
        _ => Chaos::None,
    };
    let recycled: Mutex<Vec<(Arc<Batch>, Ticket)>> = Mutex::new(Vec::new());
    thread::scope(|s| {
        for i in 0..threads {
            let mut rng = Rng(seed ^ (u64::from(i) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let (counter, batch, recycled) = (&counter, &batch, &recycled);
            // Thread 0 completes every layer; the last thread may be the chaos one.
            let role = if i == 0 {
                0
            } else if i == threads - 1 && !matches!(chaos, Chaos::None) {
                2
            } else {
                rng.below(2)
            };
            s.spawn(move || match role {
                0 => {
                    let mut order: Vec<u32> = (0..layers).collect();
                    for j in (1..order.len()).rev() {
                        order.swap(j, rng.below(j as u32 + 1) as usize);
                    }
                    // Some duplicates, some from other completers.
                    for _ in 0..rng.below(3) {
                        order.push(rng.below(layers));
                    }
                    for l in order {
                        rng.maybe_yield();
                        if !batch.complete(counter, ticket, l) {
                            return;
                        }
                    }
                }
                1 => {
                    for _ in 0..1 + rng.below(4) {
                        let layer = rng.below(layers);
                        rng.maybe_yield();
                        batch.check_readers(counter, ticket, layer);
                        let long = rng.chance(50);
                        let deadline = Instant::now()
                            + if long {
                                LONG
                            } else {
                                Duration::from_micros(u64::from(rng.below(2000)))
                            };
                        let r = counter.wait(ticket, layer, deadline);
                        if batch.check_wait(r, layer, deadline, long) {
                            return;
                        }
                    }
                }
                _ => {
                    for _ in 0..rng.below(layers * 2) {
                        rng.maybe_yield();
                    }
                    match chaos {
                        Chaos::Fail => {
                            for e in [i, i + 100] {
                                batch.errors_sent.lock().unwrap().push(e);
                                counter.fail(ticket, e).expect("fail a live ticket");
                            }
                        }
                        Chaos::Finish | Chaos::Reset => {
                            batch.released.store(true, SeqCst);
                            if matches!(chaos, Chaos::Finish) {
                                counter.finish(ticket).expect("finish a live ticket");
                            } else {
                                counter.reset();
                            }
                            // Recycle the slot with a batch whose layers are all ready.
                            let (b, t) = Batch::begin(counter, layers, rng.chance(50));
                            for l in 0..layers {
                                assert!(b.complete(counter, t, l));
                            }
                            recycled.lock().unwrap().push((b, t));
                        }
                        Chaos::None => {}
                    }
                }
            });
        }
    });
    batch.check_hooks(ticket, matches!(chaos, Chaos::None));
    if matches!(chaos, Chaos::None) {
        assert_eq!(counter.ready_layers(ticket), Ok(layers));
        counter.finish(ticket).unwrap();
    }
    for (b, t) in recycled.into_inner().unwrap() {
        b.check_hooks(t, true);
        assert_eq!(counter.ready_layers(t), Ok(layers));
        counter.finish(t).unwrap();
    }
    if matches!(chaos, Chaos::Fail) {
        counter.finish(ticket).unwrap();
    }
    assert_eq!(counter.in_flight(), 0);
    assert_eq!(
        counter.ready_layers(ticket),
        Err(CounterError::StaleTicket { ticket })
    );
}

#[test]
fn randomized_schedules_keep_the_invariants() {
    let n = std::env::var("STRESS_SCHEDULES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_SCHEDULES);
    let start = Instant::now();
    for k in 0..n {
        let seed = 0x5eed_0000_0000_0001 ^ u64::from(k).wrapping_mul(0x2545_f491_4f6c_dd1d);
        let r = std::panic::catch_unwind(|| schedule(seed));
        assert!(
            r.is_ok(),
            "schedule {k} (seed {seed:#x}) broke an invariant"
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(120),
        "too slow: a hang?"
    );
}
