//! Pins taken at lookup (`LinkerConfig::pin_at_lookup`): a lookup that found pages starts the
//! read session its load will read under; the load takes it over where it covers every key it
//! reads. The pins of several lookups wait for their loads (four at most), and every pin is
//! ended: by the load that took it, a later lookup's pins that cover it, the bound, `reset` or
//! `close`, whatever failed or came late.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::sessions::Sessions;
use common::tp::{self, Path, RankBuild};
use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{KvLoader, ShareMode};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore, Stall, StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

/// Each rank's session log, by rank.
type RankLogs = Arc<Mutex<Vec<(u32, Arc<Sessions>)>>>;

fn config() -> LinkerConfig {
    LinkerConfig {
        namespace: "pins".into(),
        ..LinkerConfig::default()
    }
}

/// Waits (10 s at most) until `done` holds; false if it never did.
fn eventually(done: impl FnMut() -> bool) -> bool {
    eventually_within(Duration::from_secs(10), done)
}

/// Waits (`limit` at most) until `done` holds; false if it never did.
fn eventually_within(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let limit = Instant::now() + limit;
    while !done() {
        if Instant::now() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    true
}

/// A store wrapper whose first `start_session` (the lookup's pin) meets `fault`.
fn first_session(fault: Fault) -> impl Fn(Arc<dyn KvStore>) -> Arc<dyn KvStore> {
    first_sessions(1, fault)
}

/// A store wrapper whose first `times` calls of `start_session` meet `fault`.
fn first_sessions(times: u32, fault: Fault) -> impl Fn(Arc<dyn KvStore>) -> Arc<dyn KvStore> {
    move |s| {
        let f = Arc::new(FaultyStore::new(s));
        f.inject_on(
            FaultCall::Session,
            FaultRule {
                times: Some(times),
                ..FaultRule::default()
            },
            fault.clone(),
        );
        f
    }
}

/// A prefix of `n` pages saved to a fresh embedded store, and a rank alone's linker over it
/// through `wrap` (a fault wrapper, say) and a session log.
struct Rank {
    linker: Linker,
    pool: Arc<HostKvPool>,
    sessions: Arc<Sessions>,
    pages: Vec<PageHash>,
}

fn rank(
    seed: u32,
    n: usize,
    cfg: LinkerConfig,
    wrap: impl Fn(Arc<dyn KvStore>) -> Arc<dyn KvStore>,
) -> Rank {
    let spec = small_spec();
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
    let tokens = prompt(seed, n, spec.page_size);
    let pages = save_prefix(&spec, store.clone(), &tokens, &config());
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let sessions = Sessions::over(wrap(store));
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g, sessions.clone(), pool.clone(), cfg).unwrap();
    Rank {
        linker,
        pool,
        sessions,
        pages,
    }
}

impl Rank {
    /// The object keys a load of `pages` reads (every component of a rank alone).
    fn keys_of(&self, pages: &[PageHash]) -> Vec<String> {
        let plan = load_plan(
            self.linker.geometry(),
            0,
            pages,
            (0..pages.len() as u32).collect(),
        );
        let mut keys: Vec<String> = self
            .linker
            .object_keys(&plan)
            .unwrap()
            .into_iter()
            .flatten()
            .collect();
        keys.sort();
        keys
    }

    /// Looks the prefix up (as batch 0) and waits until its pin's session start is held at
    /// the store by `held`: the pin is under way.
    fn look_up_with_pin_held(&self, held: &Stall) {
        self.linker.lookup_pages(&self.pages, 0).unwrap();
        assert!(
            eventually(|| held.hits() == 1),
            "the pin at lookup is under way"
        );
    }

    /// Loads `pages` as batch `batch` into `slots`: it succeeds and every byte is in place.
    fn load(&self, pages: &[PageHash], batch: u64, slots: &[u32]) {
        let g = self.linker.geometry();
        let t = self
            .linker
            .start_load(load_plan(g, batch, pages, slots.to_vec()))
            .unwrap();
        wait_all(&self.linker, &t).unwrap();
        self.linker.wait_batch(&t).unwrap().result.unwrap();
        pool_matches(&self.pool, pages, slots, g.num_layers()).unwrap();
    }

    /// Checks the pins taken at lookup and taken over (`pins`), the sessions started and
    /// ended (`sessions`), and that none is left open.
    fn check_all_ended(&self, pins: (u64, u64), sessions: (u32, u32), what: &str) {
        let m = self.linker.metrics();
        assert_eq!((m.pins_ahead, m.pins_ahead_taken), pins, "{what}: {m:?}");
        assert_eq!(self.sessions.counts(), sessions, "{what}");
        assert!(self.sessions.pinned().is_empty(), "{what}");
    }

    /// Looks `pages` up until a lookup's pin is in (checked after each lookup for 50 ms).
    fn lookup_pinned(&self, pages: &[PageHash], pins_before: u64) {
        let pinned = eventually(|| {
            let hit = self.linker.lookup_pages(pages, 0).unwrap();
            assert_eq!(hit.pages.len(), pages.len());
            eventually_within(Duration::from_millis(50), || {
                self.linker.metrics().pins_ahead > pins_before
            })
        });
        assert!(pinned, "the lookup pinned");
    }
}

/// A lookup pins exactly what its load reads; the load takes that session over (it starts
/// none) and ends it when done.
#[test]
fn a_lookup_pins_what_its_load_reads_and_the_load_takes_the_pins() {
    let r = rank(61, 4, config(), |s| s);
    r.lookup_pinned(&r.pages, 0);
    assert_eq!(r.sessions.counts(), (1, 0));
    assert_eq!(
        r.sessions.pinned(),
        r.keys_of(&r.pages),
        "every key the load reads, once"
    );
    r.load(&r.pages, 1, &[3, 1, 6, 0]);
    assert_eq!(r.sessions.read(), r.keys_of(&r.pages), "what it read");
    let m = r.linker.metrics();
    assert_eq!((m.pins_ahead, m.pins_ahead_taken), (1, 1), "{m:?}");
    assert_eq!(
        r.sessions.counts(),
        (1, 1),
        "the load started no session of its own"
    );
    assert!(
        r.sessions.pinned().is_empty(),
        "the load ended the pins it took"
    );
    r.linker.close().unwrap();
}

/// A load of other pages pins for itself and leaves the lookup's pins; a lookup of more pages
/// replaces them once its own are in (their keys stay pinned throughout), and `close` ends
/// the last.
#[test]
fn pins_of_other_pages_stay_until_a_lookup_of_more_pages_replaces_them() {
    let r = rank(62, 4, config(), |s| s);
    r.lookup_pinned(&r.pages[..2], 0);
    let first = r.keys_of(&r.pages[..2]);
    r.load(&r.pages, 1, &[3, 1, 6, 0]);
    assert_eq!(r.linker.metrics().pins_ahead_taken, 0);
    assert_eq!(
        r.sessions.counts(),
        (2, 1),
        "the load pinned and unpinned for itself"
    );
    assert_eq!(
        r.sessions.pinned(),
        first,
        "the lookup's pins are still held"
    );
    r.lookup_pinned(&r.pages, 1);
    assert!(
        eventually(|| r.sessions.counts() == (3, 2)),
        "the pins before were ended"
    );
    assert_eq!(
        r.sessions.order(),
        "ssese",
        "ended after the new ones started"
    );
    assert!(
        !r.sessions.let_go_of_any(&first),
        "the first pages stayed pinned throughout"
    );
    assert_eq!(r.sessions.pinned(), r.keys_of(&r.pages));
    // Lookups of the same pages while they are held and fresh pin nothing again. (Several,
    // spaced past the last read ahead's end, so that the later ones are judged by what is
    // held rather than by a pin still under way.)
    for _ in 0..5 {
        r.linker.lookup_pages(&r.pages, 0).unwrap();
        std::thread::sleep(Duration::from_millis(40));
    }
    r.linker.close().unwrap();
    assert_eq!(r.linker.metrics().pins_ahead, 2);
    assert_eq!(r.sessions.counts(), (3, 3));
    assert!(r.sessions.pinned().is_empty(), "close ended the pins held");
}

/// `reset` ends the pins a lookup took, as `close` does.
#[test]
fn reset_and_close_end_the_pins_held() {
    let r = rank(63, 3, config(), |s| s);
    r.lookup_pinned(&r.pages, 0);
    r.linker.reset().unwrap();
    assert!(r.sessions.pinned().is_empty(), "reset ended them");
    r.lookup_pinned(&r.pages, 1);
    assert!(!r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
    assert!(r.sessions.pinned().is_empty(), "close ended them");
    assert_eq!(r.sessions.counts(), (2, 2));
}

/// A pin at lookup that fails costs nothing but the call: the load pins for itself.
#[test]
fn a_failed_pin_at_lookup_leaves_the_load_to_pin_for_itself() {
    let fault = Fault::Error(StoreError::Unavailable {
        detail: "injected".into(),
    });
    let r = rank(64, 3, config(), first_session(fault));
    r.linker.lookup_pages(&r.pages, 0).unwrap();
    // The read ahead ends (its companions kept) with no pin held.
    let objects = 3 * r.linker.geometry().components().len() as u64;
    assert!(eventually(
        || r.linker.metrics().companions_prefetched == objects
    ));
    r.load(&r.pages, 1, &[2, 0, 5]);
    r.check_all_ended((0, 0), (1, 1), "the load's own session");
    r.linker.close().unwrap();
}

/// A load that comes while its lookup's pin is still under way waits for it a quarter of
/// `store_call_timeout` at most: past that it pins for itself, and the late pin is ended once
/// it is in.
#[test]
fn a_load_beside_a_pin_stalled_past_its_wait_pins_for_itself_and_the_late_pin_is_ended() {
    let held = Stall::new();
    let cfg = LinkerConfig {
        store_call_timeout: Duration::from_secs(2),
        ..config()
    };
    let r = rank(65, 3, cfg, first_session(Fault::Stall(held.clone())));
    r.look_up_with_pin_held(&held);
    let t0 = Instant::now();
    r.load(&r.pages, 1, &[4, 2, 0]);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(5),
        "the load waited its 0.5 s for the pin, then pinned for itself: {took:?}"
    );
    assert_eq!(r.linker.metrics().pins_ahead_taken, 0);
    held.release();
    assert!(
        eventually(|| r.sessions.counts() == (2, 2)),
        "the late pin was ended: {:?}",
        r.sessions.counts()
    );
    // Counted as started though no load took it (before, only a wanted pin counted, so
    // `pins_ahead - pins_ahead_taken` hid the master calls made for nothing).
    let m = r.linker.metrics();
    assert_eq!((m.pins_ahead, m.pins_ahead_taken), (1, 0), "{m:?}");
    assert!(r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
    assert_eq!(r.sessions.counts(), (2, 2));
}

/// A load right after its lookup, while the lookup's pin is still at the store, waits for that
/// pin and takes it over once it is in: one session start, not two.
#[test]
fn a_load_right_after_its_lookup_takes_the_pin_under_way_once_it_is_in() {
    let held = Stall::new();
    let r = rank(68, 3, config(), first_session(Fault::Stall(held.clone())));
    r.look_up_with_pin_held(&held);
    // Timed from before the releasing thread starts: the pin cannot come in sooner than its
    // 200 ms sleep.
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            // The load is waiting by now (its wait is 5 s); the pin's call goes on.
            std::thread::sleep(Duration::from_millis(200));
            held.release();
        });
        r.load(&r.pages, 1, &[4, 2, 0]);
        assert!(
            t0.elapsed() >= Duration::from_millis(200),
            "it waited for the pin"
        );
    });
    assert_eq!(r.linker.metrics().pins_ahead_taken, 1);
    r.check_all_ended((1, 1), (1, 1), "the lookup's session, taken over");
    r.linker.close().unwrap();
}

/// A `reset` while a load waits for its lookup's pin stalled at the store does not wait out
/// that load's bound: the pins are taken out first, and the cancelled load goes on at once
/// without starting a session of its own (the store's session calls stall too).
#[test]
fn a_reset_does_not_wait_for_a_load_waiting_for_a_stalled_pin() {
    let held = Stall::new();
    // Reset waits 1 s at most for the load thread (and as long for the stalled read ahead):
    // far less than the load's 5 s wait for the pin, or a stalled start of its own.
    let cfg = LinkerConfig {
        wait_deadline: Duration::from_secs(1),
        ..config()
    };
    let r = rank(73, 3, cfg, first_sessions(2, Fault::Stall(held.clone())));
    r.look_up_with_pin_held(&held);
    let g = r.linker.geometry();
    let t = r
        .linker
        .start_load(load_plan(g, 1, &r.pages, vec![0, 1, 2]))
        .unwrap();
    // The load is waiting for the pin by now (its bound is a quarter of the 20 s store call).
    std::thread::sleep(Duration::from_millis(200));
    let t0 = Instant::now();
    let reset = r.linker.reset();
    let took = t0.elapsed();
    assert!(
        reset.is_ok(),
        "the load thread went on (no slots held): {reset:?}"
    );
    assert!(took < Duration::from_secs(3), "reset took {took:?}");
    let _ = r.linker.wait_batch(&t);
    held.release();
    r.linker.close().unwrap();
    assert!(
        eventually(|| r.sessions.counts().0 == r.sessions.counts().1),
        "every session ended: {:?}",
        r.sessions.counts()
    );
    assert!(r.sessions.pinned().is_empty());
}

/// A store whose `end_session` hangs holds `reset` to its `wait_deadline`: the pins held are
/// ended under that one bound (the rest are left to the store's lease), not one store-call
/// timeout each.
#[test]
fn a_reset_with_ending_pins_stalled_returns_within_its_wait_deadline() {
    let held = Stall::new();
    let faulty: Arc<Mutex<Option<Arc<FaultyStore>>>> = Arc::default();
    let cfg = LinkerConfig {
        wait_deadline: Duration::from_secs(1),
        store_call_timeout: Duration::from_secs(3),
        ..config()
    };
    let slot = faulty.clone();
    let r = rank(79, 4, cfg, move |s| {
        let f = Arc::new(FaultyStore::new(s));
        *slot.lock().unwrap() = Some(f.clone());
        f
    });
    let (a, b) = r.pages.split_at(2);
    r.lookup_pinned(a, 0);
    r.lookup_pinned(b, 1);
    let f = faulty.lock().unwrap().clone().unwrap();
    f.inject_on(
        FaultCall::EndSession,
        FaultRule::default(),
        Fault::Stall(held.clone()),
    );
    let t0 = Instant::now();
    let reset = r.linker.reset();
    let took = t0.elapsed();
    held.release();
    assert!(reset.is_ok(), "{reset:?}");
    // Two pins at 3 s each took 6 s before; now the 1 s bound (slack for a loaded CI host).
    assert!(took < Duration::from_millis(2500), "reset took {took:?}");
    assert!(held.hits() >= 1, "an end stalled");
    f.clear();
    r.linker.close().unwrap();
}

/// Pins whose end fails (a store that refuses `end_session`) hold their objects only until
/// the embedded store's lease is over: then a put that needs their room evicts them. Before,
/// the embedded store had no lease, and pins the linker could not end (it says "left to the
/// store's lease") held their objects for the store's life: once they filled it, every save
/// failed `NoSpace`.
#[test]
fn pins_whose_end_fails_give_their_room_back_at_the_stores_lease() {
    // Long beside a close and a put, so that the pins are seen holding on a loaded machine.
    let lease = Duration::from_secs(6);
    let spec = small_spec();
    let tokens = prompt(81, 3, spec.page_size);
    // A store that holds exactly the prefix: any other object needs the room of the pinned.
    let sizing = Arc::new(EmbeddedStore::new(1 << 24));
    save_prefix(&spec, sizing.clone(), &tokens, &config());
    let store = Arc::new(EmbeddedStore::new(sizing.used_bytes()).with_lease(Some(lease)));
    let pages = save_prefix(&spec, store.clone(), &tokens, &config());
    assert_eq!(store.used_bytes(), store.capacity());
    let faulty = Arc::new(FaultyStore::new(store.clone()));
    faulty.inject_on(
        FaultCall::EndSession,
        FaultRule::default(),
        Fault::Error(StoreError::RpcTimeout {
            key: "test: the end of a session fails".into(),
        }),
    );
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g, faulty.clone(), pool, config()).unwrap();
    let pinned = eventually(|| {
        linker.lookup_pages(&pages, 0).unwrap();
        eventually_within(Duration::from_millis(50), || {
            linker.metrics().pins_ahead > 0
        })
    });
    let t_pinned = Instant::now();
    assert!(pinned, "the lookup pinned");
    // `close` tries to end the pins; the store refuses.
    linker.close().unwrap();
    // Half the store: more than its unpinned objects (the checksum companions) free.
    let other = vec![7u8; store.capacity() as usize / 2];
    let put = || {
        let p = kvlink::mooncake_linker::store::ObjectPut {
            key: "other",
            parts: [(other.as_ptr(), other.len())].into_iter().collect(),
        };
        // SAFETY: `other` is a live vector, read-only for the call.
        unsafe { store.put(&[p]) }.remove(0)
    };
    let refused = put();
    let within = t_pinned.elapsed();
    assert!(
        within < lease / 2,
        "the put came {within:?} after the pins, near their lease: their hold was not seen"
    );
    assert!(
        matches!(refused, Err(StoreError::NoSpace { .. })),
        "pinned within the lease: {refused:?}"
    );
    std::thread::sleep(lease.saturating_sub(t_pinned.elapsed()) + Duration::from_millis(200));
    assert!(put().is_ok(), "the pins went at the lease");
    assert!(store.used_bytes() <= store.capacity());
}

/// Pins taken longer than `lease_renewal` before the load are renewed before its first read,
/// as a load's own session would be; the old and the renewed session are both ended.
#[test]
fn pins_older_than_the_renewal_period_are_renewed_before_the_first_read() {
    let cfg = LinkerConfig {
        lease_renewal: Duration::from_millis(50),
        ..config()
    };
    let r = rank(66, 3, cfg, |s| s);
    r.lookup_pinned(&r.pages, 0);
    std::thread::sleep(Duration::from_millis(120));
    r.load(&r.pages, 1, &[1, 2, 3]);
    assert_eq!(r.linker.metrics().pins_ahead_taken, 1);
    let (started, ended) = r.sessions.counts();
    assert!(
        started >= 2,
        "renewed before the first read: {started} sessions"
    );
    assert!(
        r.sessions.order().starts_with("sse"),
        "the renewal started before the lookup's session ended: {}",
        r.sessions.order()
    );
    assert_eq!(started, ended);
    assert!(r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
}

/// A load that takes over a lookup's pins covering more pages than it reads renews only its
/// own keys: a renewal over the lookup's other pages (one of them refused by the store now,
/// as a key evicted since) would fail the load for a key it does not read.
#[test]
fn an_adopted_wider_pin_is_renewed_over_the_loads_own_keys() {
    let cfg = LinkerConfig {
        lease_renewal: Duration::from_millis(50),
        ..config()
    };
    let faults: Arc<Mutex<Option<Arc<FaultyStore>>>> = Arc::default();
    let slot = faults.clone();
    let r = rank(67, 3, cfg, move |s| {
        let f = Arc::new(FaultyStore::new(s));
        *slot.lock().unwrap() = Some(f.clone());
        f
    });
    r.lookup_pinned(&r.pages, 0);
    let unread = r.keys_of(&r.pages[2..]);
    let f = faults.lock().unwrap().clone().unwrap();
    f.inject_on(
        FaultCall::Session,
        FaultRule {
            key_contains: Some(unread[0].clone()),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::NotFound {
            key: unread[0].clone(),
        }),
    );
    std::thread::sleep(Duration::from_millis(120));
    r.load(&r.pages[..2], 1, &[1, 2]);
    assert_eq!(
        r.linker.metrics().pins_ahead_taken,
        1,
        "the wider pin was taken"
    );
    let (started, ended) = r.sessions.counts();
    assert!(started >= 2, "renewed: {started} sessions");
    assert_eq!(started, ended);
    assert!(r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
}

/// Pins off: a lookup pins nothing, and the load pins for itself.
#[test]
fn with_pin_at_lookup_off_the_load_pins_for_itself() {
    let cfg = LinkerConfig {
        pin_at_lookup: false,
        ..config()
    };
    let r = rank(67, 3, cfg, |s| s);
    r.linker.lookup_pages(&r.pages, 0).unwrap();
    r.load(&r.pages, 1, &[1, 2, 3]);
    r.check_all_ended((0, 0), (1, 1), "the load's own session");
    r.linker.close().unwrap();
}

/// Two requests looked up before either loads: each load takes its own lookup's pins.
#[test]
fn two_lookups_ahead_of_their_loads_each_keep_their_pins() {
    let r = rank(69, 4, config(), |s| s);
    let (a, b) = r.pages.split_at(2);
    r.lookup_pinned(a, 0);
    r.lookup_pinned(b, 1);
    let mut both = [r.keys_of(a), r.keys_of(b)].concat();
    both.sort();
    assert_eq!(r.sessions.pinned(), both);
    r.load(a, 1, &[5, 2]);
    r.load(b, 2, &[0, 7]);
    r.check_all_ended((2, 2), (2, 2), "no load pinned for itself");
    r.linker.close().unwrap();
}

/// Three requests looked up in a burst, while the first one's companions are still being read
/// ahead (one read ahead at a time): each lookup pins, the later ones on threads of their
/// own, and each load takes its own lookup's pins.
#[test]
fn lookups_in_a_burst_each_pin_for_their_loads() {
    let slow_companions = |s: Arc<dyn KvStore>| -> Arc<dyn KvStore> {
        let f = Arc::new(FaultyStore::new(s));
        f.inject_on(
            FaultCall::ReadWhole,
            FaultRule::default(),
            Fault::Delay(Duration::from_millis(100)),
        );
        f
    };
    let r = rank(72, 6, config(), slow_companions);
    let requests: Vec<&[PageHash]> = r.pages.chunks(2).collect();
    for pages in &requests {
        r.linker.lookup_pages(pages, 0).unwrap();
    }
    assert!(
        eventually(|| r.linker.metrics().pins_ahead == 3),
        "every lookup pinned: {:?}",
        r.linker.metrics()
    );
    for (i, pages) in requests.iter().enumerate() {
        let first = 2 * i as u32;
        r.load(pages, i as u64 + 1, &[first, first + 1]);
    }
    r.check_all_ended((3, 3), (3, 3), "each load took its lookup's pins");
    r.linker.close().unwrap();
}

/// Four lookups' pins wait for their loads; a fifth's end the oldest.
#[test]
fn pins_past_four_lookups_end_the_oldest() {
    let r = rank(70, 5, config(), |s| s);
    for (i, page) in r.pages.chunks(1).enumerate() {
        r.lookup_pinned(page, i as u64);
    }
    assert!(eventually(|| r.sessions.counts() == (5, 1)));
    assert_eq!(r.sessions.pinned(), {
        let mut k: Vec<String> = r.pages[1..].iter().flat_map(|p| r.keys_of(&[*p])).collect();
        k.sort();
        k
    });
    r.linker.close().unwrap();
    assert_eq!(r.sessions.counts(), (5, 5));
    assert!(r.sessions.pinned().is_empty());
}

/// A pin stalled at its store call past `reset` (or `close`), which wait for it only so long:
/// once it comes back it is ended, never left held.
#[test]
fn a_pin_stalled_past_reset_or_close_is_ended_when_it_comes_back() {
    for close in [false, true] {
        let held = Stall::new();
        let cfg = LinkerConfig {
            wait_deadline: Duration::from_millis(200),
            ..config()
        };
        let r = rank(71, 3, cfg, first_session(Fault::Stall(held.clone())));
        r.linker.lookup_pages(&r.pages, 0).unwrap();
        assert!(eventually(|| held.hits() == 1), "the pin is under way");
        if close {
            r.linker.close().unwrap();
        } else {
            r.linker.reset().unwrap();
        }
        held.release();
        assert!(
            eventually(|| r.sessions.counts() == (1, 1)),
            "close {close}: the late pin was ended: {:?}",
            r.sessions.counts()
        );
        assert!(r.sessions.pinned().is_empty());
        if !close {
            // After the reset a load pins for itself.
            r.load(&r.pages, 1, &[0, 1, 2]);
            assert_eq!(r.linker.metrics().pins_ahead_taken, 0);
            r.linker.close().unwrap();
            assert_eq!(r.sessions.counts(), (2, 2));
        }
    }
}

/// TP 3 ranks over one store, each through its own session log.
fn group(mode: ModeChoice) -> (Vec<tp::TpRank>, Vec<PageHash>, Vec<Arc<Sessions>>) {
    let logs: RankLogs = Arc::default();
    let keep = logs.clone();
    let wrap = move |rank: u32, s: Arc<dyn KvStore>| -> Arc<dyn KvStore> {
        let log = Sessions::over(s);
        keep.lock().unwrap().push((rank, log.clone()));
        log
    };
    let build = RankBuild {
        store: &wrap,
        ..RankBuild::default()
    };
    let cfg = LinkerConfig {
        mode,
        ..tp::config(ShareMode::AllRanks)
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
    let (ranks, pages) =
        tp::tp_ranks_built(&tp::mixed_spec(), 3, store, 6, &cfg, Path::Host, &build);
    let mut logs = std::mem::take(&mut *logs.lock().unwrap());
    logs.sort_by_key(|(rank, _)| *rank);
    (ranks, pages, logs.into_iter().map(|(_, l)| l).collect())
}

/// TP 3 in a fixed mode: each rank's lookup pins exactly what its load then reads (every
/// page of its sharded component, and its share of the replicated ones), and each rank's
/// load takes those pins.
fn each_rank_pins_what_it_reads(mode: ShareMode) -> Vec<Vec<String>> {
    let (ranks, pages, logs) = group(ModeChoice::Fixed(mode));
    std::thread::scope(|s| {
        for r in &ranks {
            s.spawn(|| assert_eq!(r.linker.lookup_pages(&pages, 0).unwrap().pages.len(), 6));
        }
    });
    let mut pinned = Vec::new();
    for (rank, r) in ranks.iter().enumerate() {
        assert!(
            eventually(|| r.linker.metrics().pins_ahead == 1),
            "{mode:?}: rank {rank} pinned"
        );
        pinned.push(logs[rank].pinned());
    }
    tp::run_ok(&ranks, 1, &pages, "pinned at lookup");
    for (rank, r) in ranks.iter().enumerate() {
        let m = r.linker.metrics();
        assert_eq!(m.pins_ahead_taken, 1, "{mode:?}: rank {rank}: {m:?}");
        let log = &logs[rank];
        assert_eq!(
            log.read(),
            pinned[rank],
            "{mode:?}: rank {rank} pinned what it read"
        );
        assert_eq!(
            log.counts(),
            (1, 1),
            "{mode:?}: rank {rank} started no session of its own"
        );
        assert!(log.pinned().is_empty());
    }
    for r in &ranks {
        r.linker.close().unwrap();
    }
    pinned
}

/// In `SplitAllGather` no two ranks pin the same object (the replicated pages are split, the
/// sharded component is each rank's own).
#[test]
fn in_split_each_rank_pins_its_own_share_and_takes_it() {
    let pinned = each_rank_pins_what_it_reads(ShareMode::SplitAllGather);
    for a in 0..3 {
        for b in a + 1..3 {
            let shared: Vec<&String> = pinned[a].iter().filter(|k| pinned[b].contains(k)).collect();
            assert!(
                shared.is_empty(),
                "ranks {a} and {b} both pinned {shared:?}"
            );
        }
    }
}

/// In `Rank0Broadcast` rank 0 pins every replicated object, the others their sharded ones
/// alone.
#[test]
fn in_rank0_broadcast_rank_0_pins_the_replicated_pages() {
    let pinned = each_rank_pins_what_it_reads(ShareMode::Rank0Broadcast);
    assert!(pinned[0].len() > pinned[1].len(), "{pinned:?}");
    assert_eq!(pinned[1].len(), pinned[2].len());
}

/// `Auto` before it keeps a mode: a rank's replicated reads are not known at the lookup, so
/// it pins nothing (the sharded companions are still read ahead) and the load pins for
/// itself.
#[test]
fn auto_before_it_keeps_a_mode_pins_nothing_at_lookup() {
    let (ranks, pages, logs) = group(ModeChoice::Auto);
    // A group's lookup is collective.
    std::thread::scope(|s| {
        for r in &ranks {
            s.spawn(|| r.linker.lookup_pages(&pages, 0).unwrap());
        }
    });
    for r in &ranks {
        // Its sharded component's companion of each page.
        assert!(eventually(
            || r.linker.metrics().companions_prefetched == pages.len() as u64
        ));
        assert_eq!(r.linker.metrics().pins_ahead, 0);
    }
    tp::run_ok(&ranks, 1, &pages, "auto, nothing pinned at lookup");
    for (rank, r) in ranks.iter().enumerate() {
        assert_eq!(r.linker.metrics().pins_ahead_taken, 0);
        assert_eq!(logs[rank].counts(), (1, 1), "rank {rank} pinned for itself");
        r.linker.close().unwrap();
    }
}

/// Stress: lookups (of the whole prefix and of part of it, one or two in a row), loads right
/// after them or after a pause, and resets, in every order: every load is right, and once
/// closed, every session started has been ended and nothing stays pinned.
#[test]
fn lookups_loads_and_resets_back_to_back_leave_nothing_pinned() {
    let cfg = LinkerConfig {
        lease_renewal: Duration::from_millis(3),
        ..config()
    };
    let r = rank(68, 4, cfg, |s| s);
    for i in 0..60u64 {
        if i % 4 != 3 {
            r.linker.forget_kept_checksums();
        }
        let part = if i % 3 == 0 {
            &r.pages[1..]
        } else {
            &r.pages[..]
        };
        r.linker.lookup_pages(part, 0).unwrap();
        if i % 5 == 0 {
            r.linker.lookup_pages(&r.pages, 0).unwrap();
        }
        if i % 2 == 1 {
            std::thread::sleep(Duration::from_millis(i % 7));
        }
        let slots = if i % 2 == 0 {
            [0, 1, 2, 3]
        } else {
            [5, 3, 7, 6]
        };
        r.load(&r.pages, 1 + i, &slots);
        if i % 11 == 10 {
            r.linker.reset().unwrap();
        }
    }
    r.linker.close().unwrap();
    let m = r.linker.metrics();
    assert_eq!(m.batches_loaded, 60, "{m:?}");
    assert!(
        m.pins_ahead_taken > 0,
        "some loads took their lookup's pins: {m:?}"
    );
    let (started, ended) = r.sessions.counts();
    assert_eq!(started, ended, "{m:?}");
    assert!(r.sessions.pinned().is_empty());
}
