//! Pins taken at lookup (`LinkerConfig::pin_at_lookup`): a lookup that found pages starts the
//! read session its load will read under; the load takes it over where it covers every key it
//! reads, and every pin is ended: by the load that took it, the next lookup that pins other
//! keys, `reset` or `close`, whatever failed or came late.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::tp::{self, Path, RankBuild};
use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{KvLoader, ShareMode};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore, ReadSession, Stall,
    StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

/// Counts the read sessions started and ended through it, and how many sessions hold each key.
struct Sessions {
    inner: Arc<dyn KvStore>,
    state: Mutex<SessionLog>,
}

#[derive(Default)]
struct SessionLog {
    started: u32,
    ended: u32,
    open: HashMap<String, i64>,
}

impl Sessions {
    fn over(inner: Arc<dyn KvStore>) -> Arc<Self> {
        Arc::new(Sessions {
            inner,
            state: Mutex::new(SessionLog::default()),
        })
    }

    /// Sessions started (successfully) and ended so far.
    fn counts(&self) -> (u32, u32) {
        let s = self.state.lock().unwrap();
        (s.started, s.ended)
    }

    /// The keys some session holds now.
    fn pinned(&self) -> Vec<String> {
        let s = self.state.lock().unwrap();
        let mut keys: Vec<String> = s
            .open
            .iter()
            .filter(|(_, &n)| n != 0)
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort();
        keys
    }
}

impl KvStore for Sessions {
    kvlink::mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into, get_ranges, put, remove,
        discard, register, unregister, health);

    fn name(&self) -> &str {
        "sessions"
    }

    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        let session = self.inner.start_session(keys)?;
        let mut s = self.state.lock().unwrap();
        s.started += 1;
        for k in keys {
            *s.open.entry((*k).to_owned()).or_default() += 1;
        }
        Ok(session)
    }

    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        let mut s = self.state.lock().unwrap();
        s.ended += 1;
        for k in &session.keys {
            *s.open.entry(k.clone()).or_default() -= 1;
        }
        drop(s);
        self.inner.end_session(session)
    }
}

/// Each rank's session log, by rank.
type RankLogs = Arc<Mutex<Vec<(u32, Arc<Sessions>)>>>;

fn config() -> LinkerConfig {
    LinkerConfig {
        namespace: "pins".into(),
        ..LinkerConfig::default()
    }
}

/// Waits (10 s at most) until `done` holds; false if it never did.
fn eventually(done: impl Fn() -> bool) -> bool {
    let limit = Instant::now() + Duration::from_secs(10);
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
    move |s| {
        let f = Arc::new(FaultyStore::new(s));
        f.inject_on(
            FaultCall::Session,
            FaultRule {
                times: Some(1),
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

    fn lookup_pinned(&self, pages: &[PageHash], pins_before: u64) {
        let hit = self.linker.lookup_pages(pages, 0).unwrap();
        assert_eq!(hit.pages.len(), pages.len());
        assert!(
            eventually(|| self.linker.metrics().pins_ahead > pins_before),
            "the lookup pinned"
        );
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

/// A load of other pages pins for itself and leaves the lookup's pins; the next lookup that
/// pins other keys ends them, and `close` ends the last.
#[test]
fn pins_of_other_pages_stay_until_the_next_lookup_ends_them() {
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
    assert_eq!(r.sessions.pinned(), r.keys_of(&r.pages));
    // A lookup of the same pages while they are held and fresh pins nothing again.
    r.linker.lookup_pages(&r.pages, 0).unwrap();
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
    let m = r.linker.metrics();
    assert_eq!((m.pins_ahead, m.pins_ahead_taken), (0, 0), "{m:?}");
    assert_eq!(r.sessions.counts(), (1, 1), "the load's own session");
    assert!(r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
}

/// A load that comes while its lookup's pin is still under way does not wait for it: it pins
/// for itself, and the late pin is ended once it is in.
#[test]
fn a_load_beside_a_pin_under_way_pins_for_itself_and_the_late_pin_is_ended() {
    let held = Stall::new();
    let r = rank(65, 3, config(), first_session(Fault::Stall(held.clone())));
    r.linker.lookup_pages(&r.pages, 0).unwrap();
    assert!(
        eventually(|| held.hits() == 1),
        "the pin at lookup is under way"
    );
    let t0 = Instant::now();
    r.load(&r.pages, 1, &[4, 2, 0]);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the load did not wait for the pin"
    );
    assert_eq!(r.linker.metrics().pins_ahead_taken, 0);
    held.release();
    assert!(
        eventually(|| r.sessions.counts() == (2, 2)),
        "the late pin was ended: {:?}",
        r.sessions.counts()
    );
    assert!(r.sessions.pinned().is_empty());
    r.linker.close().unwrap();
    assert_eq!(r.sessions.counts(), (2, 2));
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
    let m = r.linker.metrics();
    assert_eq!((m.pins_ahead, m.pins_ahead_taken), (0, 0), "{m:?}");
    assert_eq!(r.sessions.counts(), (1, 1));
    r.linker.close().unwrap();
}

/// TP 3 in `SplitAllGather`: each rank's lookup pins its own share of the replicated pages
/// and every page of its sharded component, and each rank's load takes those pins; a rank's
/// pins never cover another rank's share.
#[test]
fn each_rank_of_a_group_pins_its_own_share_and_takes_it() {
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
    let cfg = tp::config(ShareMode::SplitAllGather);
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
    let (ranks, pages) =
        tp::tp_ranks_built(&tp::mixed_spec(), 3, store, 6, &cfg, Path::Host, &build);
    let log_of = |rank: u32| {
        logs.lock()
            .unwrap()
            .iter()
            .find(|(r, _)| *r == rank)
            .map(|(_, l)| l.clone())
            .unwrap()
    };
    std::thread::scope(|s| {
        for r in &ranks {
            s.spawn(|| assert_eq!(r.linker.lookup_pages(&pages, 0).unwrap().pages.len(), 6));
        }
    });
    let mut pinned = Vec::new();
    for (rank, r) in ranks.iter().enumerate() {
        assert!(
            eventually(|| r.linker.metrics().pins_ahead == 1),
            "rank {rank} pinned"
        );
        let keys = log_of(rank as u32).pinned();
        assert!(!keys.is_empty());
        pinned.push(keys);
    }
    tp::run_ok(&ranks, 1, &pages, "split, pinned at lookup");
    for (rank, r) in ranks.iter().enumerate() {
        let m = r.linker.metrics();
        assert_eq!(m.pins_ahead_taken, 1, "rank {rank}: {m:?}");
        let log = log_of(rank as u32);
        assert_eq!(
            log.counts(),
            (1, 1),
            "rank {rank} started no session of its own"
        );
        assert!(log.pinned().is_empty());
    }
    // The replicated pages are split: no two ranks pinned the same replicated object.
    for a in 0..3 {
        for b in a + 1..3 {
            let shared: Vec<&String> = pinned[a].iter().filter(|k| pinned[b].contains(k)).collect();
            assert!(
                shared.is_empty(),
                "ranks {a} and {b} both pinned {shared:?}"
            );
        }
    }
    for r in &ranks {
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
