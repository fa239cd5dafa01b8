//! Read-session pins taken when a prefix is looked up, for its load to take over.
//!
//! A load reads its objects under a read session (lease pins, see `session`), and starting one is a
//! master call (about 4 ms on the GPU host for a 32K-token GLM-5.2 prefix) on the first layer's
//! path. A lookup that found pages therefore also starts the session its load will read under: the
//! pin is begun on the lookup's thread (so a load right after finds it under way) and its session
//! started on a thread beside the companions' read ahead (see `prefetch`), or on one of its own
//! while another lookup's read ahead runs; the load takes it over when it covers every key the load
//! reads, and renews it as its own before its first read if it is older than
//! `LinkerConfig::lease_renewal` (so a late load is as safe as one that pinned for itself),
//! over the keys it reads alone (a wider pin's other keys go when the old session ends).
//! SGLang's later linker likewise pins between the match and the load.
//!
//! Only where this rank's reads are known at the lookup (a rank alone; a fixed mode, or the
//! one `Auto` keeps): the same keys the load pins (every page of its own components, its
//! share of the replicated ones, reckoned on the looked-up pages as the batch's plan pages).
//!
//! The pins of the last [`KEPT`] lookups that took any are held, so that lookups of several
//! requests ahead of their loads each find theirs. Each is ended by the load that takes it
//! (as its own session, on its drop), or else: once a later lookup's pins cover all its keys,
//! once [`KEPT`] later lookups have pinned, by `reset`, or by `close`; the store's lease also
//! lets pins go on its own (Mooncake's default is 10 s, the embedded store's a minute), so an
//! unused pin costs two master
//! calls and holds its objects that long at most. A load that finds a pin of its keys still
//! under way waits for it to come in and takes it (a load's own session start would wait
//! for that pin's master call anyway: the Mooncake store makes session calls one at a time),
//! for as long as it waits for a read ahead of its companions at most (a quarter of
//! `store_call_timeout`, on the reader thread before its first read: the exchange loop's
//! wait for the reader allows for it); past that, or if the pin fails, it pins for itself,
//! and a late pin is ended by the thread that took it. A pin that a load gave up, or that
//! `reset` or `close` took, before its thread started its session is not started; a lookup
//! from before a `reset` or `close` pins nothing. A pin under way is a [`PinUnderWay`]
//! guard: a thread that unwinds before its session is in leaves no entry behind.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::store::ReadSession;

/// How many lookups' pins are held at most, waiting for their loads.
pub(crate) const KEPT: usize = 4;

/// The pins held ahead of loads.
#[derive(Debug, Default)]
pub(crate) struct PinsAhead {
    state: Mutex<Pins>,
    /// Notified when a pin under way comes in or goes (finished, abandoned, or taken by
    /// `reset` or `close`): what a load waiting for one waits on.
    changed: Condvar,
}

#[derive(Debug, Default)]
struct Pins {
    /// Bumped by [`PinsAhead::take_all`] (`reset`, `close`): a lookup from before pins
    /// nothing.
    epoch: u64,
    /// The last pin's id.
    last_id: u64,
    /// Oldest first.
    entries: VecDeque<Entry>,
}

#[derive(Debug)]
struct Entry {
    /// Which pin this is (its [`PinUnderWay`]'s).
    id: u64,
    keys: HashSet<String>,
    pin: Pin,
}

#[derive(Debug)]
enum Pin {
    /// The session is being started; nobody has asked for it yet.
    Starting,
    Held {
        session: ReadSession,
        started: Instant,
    },
}

impl Entry {
    fn covers<'k>(&self, mut keys: impl Iterator<Item = &'k str>) -> bool {
        keys.all(|k| self.keys.contains(k))
    }
}

/// A session started at a lookup, and when.
#[derive(Debug)]
pub(crate) struct HeldPins {
    pub(crate) session: ReadSession,
    pub(crate) started: Instant,
}

/// A pin under way, from [`PinsAhead::begin`] until its session is in
/// ([`finish`](Self::finish)) or its start failed ([`abandon`](Self::abandon)). Dropped
/// without either (its thread unwound), it is abandoned: a panic cannot leave an entry that
/// marks its keys as pinned for good, so that no later lookup would pin them. (A session
/// started before such a panic is let go by the store's lease.)
#[derive(Debug)]
#[must_use = "a pin under way is abandoned when dropped"]
pub(crate) struct PinUnderWay {
    pins: Arc<PinsAhead>,
    id: u64,
    /// Neither finished nor abandoned yet.
    open: bool,
}

impl PinUnderWay {
    /// Whether its session is still wanted: no load of its keys gave it up, and no `reset` or
    /// `close` took it (its thread then starts no session).
    pub(crate) fn wanted(&self) -> bool {
        self.pins
            .state
            .lock()
            .entries
            .iter()
            .any(|e| e.id == self.id && matches!(e.pin, Pin::Starting))
    }

    /// The session is in: see [`Finished`].
    pub(crate) fn finish(mut self, session: ReadSession, started: Instant) -> Finished {
        self.open = false;
        self.pins.finish(self.id, session, started)
    }

    /// The session could not be started: the pin holds nothing.
    pub(crate) fn abandon(self) {
        // Drop abandons it.
    }
}

impl Drop for PinUnderWay {
    fn drop(&mut self) {
        if self.open {
            self.pins.abandon(self.id);
        }
    }
}

/// What a finished pin leaves its thread to end.
#[derive(Debug, Default)]
pub(crate) struct Finished {
    /// The new session, when no longer wanted (a load of its keys came first and pinned for
    /// itself, or `reset` or `close` came meanwhile).
    pub(crate) unwanted: Option<ReadSession>,
    /// Sessions held before that the new one replaces: covered by it, or past [`KEPT`].
    pub(crate) replaced: Vec<ReadSession>,
}

impl PinsAhead {
    /// The current epoch, taken at a lookup and handed to [`begin`](Self::begin).
    pub(crate) fn epoch(&self) -> u64 {
        self.state.lock().epoch
    }

    /// True if pins held and taken less than `fresh_for` ago, or a pin under way, cover
    /// `keys`: a lookup then need not pin again.
    pub(crate) fn hold_fresh(&self, keys: &[String], fresh_for: Duration) -> bool {
        self.state.lock().entries.iter().any(|e| {
            let fresh = match &e.pin {
                Pin::Starting => true,
                Pin::Held { started, session } => {
                    started.elapsed() < super::session::period(fresh_for, Some(session))
                }
            };
            fresh && e.covers(keys.iter().map(String::as_str))
        })
    }

    /// A lookup made in `epoch` pins `keys`: from now on a load of them finds this pin under
    /// way (and waits for it, [`take_covering`](Self::take_covering)), and a lookup of them
    /// pins nothing again ([`hold_fresh`](Self::hold_fresh)). Returns the pin under way, for
    /// a thread to start its session and finish it, or abandon it; `None` if the linker was
    /// reset or closed since `epoch` (nothing is pinned).
    pub(crate) fn begin(self: &Arc<Self>, epoch: u64, keys: &[String]) -> Option<PinUnderWay> {
        let mut st = self.state.lock();
        if st.epoch != epoch {
            return None;
        }
        st.last_id += 1;
        let id = st.last_id;
        st.entries.push_back(Entry {
            id,
            keys: keys.iter().cloned().collect(),
            pin: Pin::Starting,
        });
        Some(PinUnderWay {
            pins: Arc::clone(self),
            id,
            open: true,
        })
    }

    /// Pin `id`'s session is in: held for a load if still wanted, replacing the pins its
    /// keys cover and the oldest past [`KEPT`]; handed back to be ended if not.
    fn finish(&self, id: u64, session: ReadSession, started: Instant) -> Finished {
        let mut st = self.state.lock();
        let pos = st
            .entries
            .iter()
            .position(|e| e.id == id && matches!(e.pin, Pin::Starting));
        let Some(mut entry) = pos.and_then(|pos| st.entries.remove(pos)) else {
            return Finished {
                unwanted: Some(session),
                replaced: Vec::new(),
            };
        };
        entry.pin = Pin::Held { session, started };
        let mut replaced = Vec::new();
        let mut kept = VecDeque::with_capacity(st.entries.len() + 1);
        for e in st.entries.drain(..) {
            match e.pin {
                Pin::Held { session, .. } if entry.covers(e.keys.iter().map(String::as_str)) => {
                    replaced.push(session)
                }
                _ => kept.push_back(e),
            }
        }
        kept.push_back(entry);
        // The oldest held pins past the bound. Pins under way do not count (they are their
        // threads'), so the new one, the newest held, is never among them.
        let held = |k: &VecDeque<Entry>| {
            k.iter()
                .filter(|e| matches!(e.pin, Pin::Held { .. }))
                .count()
        };
        while held(&kept) > KEPT {
            let Some(oldest) = kept.iter().position(|e| matches!(e.pin, Pin::Held { .. })) else {
                break;
            };
            if let Some(Entry {
                pin: Pin::Held { session, .. },
                ..
            }) = kept.remove(oldest)
            {
                replaced.push(session);
            }
        }
        st.entries = kept;
        self.changed.notify_all();
        Finished {
            unwanted: None,
            replaced,
        }
    }

    /// Pin `id` failed: it holds nothing.
    fn abandon(&self, id: u64) {
        self.state.lock().entries.retain(|e| e.id != id);
        self.changed.notify_all();
    }

    /// What a load of `keys` finds: the newest pins held that cover every key (taken out);
    /// where none is held but a pin of these keys is under way, the same once it comes in,
    /// waiting until `wait_until` at most; none otherwise, and none for no keys. Pins of other
    /// keys stay for their loads; a pin of these keys still under way at `wait_until` (or one
    /// that failed) is given up (its thread ends it once in), and the load pins for itself.
    pub(crate) fn take_covering(&self, keys: &[&str], wait_until: Instant) -> Option<HeldPins> {
        if keys.is_empty() {
            return None;
        }
        let mut st = self.state.lock();
        let covering = |e: &Entry| e.covers(keys.iter().copied());
        let mut timed_out = false;
        loop {
            let held = st
                .entries
                .iter()
                .rposition(|e| matches!(e.pin, Pin::Held { .. }) && covering(e));
            if let Some(pos) = held {
                return match st.entries.remove(pos).map(|e| e.pin) {
                    Some(Pin::Held { session, started }) => Some(HeldPins { session, started }),
                    _ => None,
                };
            }
            let under_way = st
                .entries
                .iter()
                .any(|e| matches!(e.pin, Pin::Starting) && covering(e));
            // After the bound, the pins are looked at once more (one may have come in just
            // then) before a pin still under way is given up.
            if !under_way || timed_out {
                break;
            }
            timed_out = self.changed.wait_until(&mut st, wait_until).timed_out();
        }
        st.entries
            .retain(|e| !(matches!(e.pin, Pin::Starting) && covering(e)));
        // Another load waiting for a pin given up here goes on at once.
        self.changed.notify_all();
        None
    }

    /// Empties the pins (`reset`, `close`) and starts a new epoch: returns the sessions held,
    /// for the caller to end. A pin still under way is ended by its thread; one not begun yet
    /// is not started.
    pub(crate) fn take_all(&self) -> Vec<ReadSession> {
        let mut st = self.state.lock();
        st.epoch += 1;
        let held = st
            .entries
            .drain(..)
            .filter_map(|e| match e.pin {
                Pin::Held { session, .. } => Some(session),
                Pin::Starting => None,
            })
            .collect();
        self.changed.notify_all();
        held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(keys: &[&str]) -> ReadSession {
        ReadSession {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            lease: None,
            token: 0,
        }
    }

    fn keys(keys: &[&str]) -> Vec<String> {
        keys.iter().map(|k| (*k).to_owned()).collect()
    }

    fn pins() -> Arc<PinsAhead> {
        Arc::new(PinsAhead::default())
    }

    /// Pins `keys` as a lookup's thread would, start to finish.
    fn pin(p: &Arc<PinsAhead>, k: &[&str]) -> Finished {
        p.begin(p.epoch(), &keys(k))
            .expect("same epoch")
            .finish(session(k), Instant::now())
    }

    #[test]
    fn a_load_takes_pins_that_cover_its_keys_and_leaves_others() {
        let p = pins();
        let f = pin(&p, &["a", "b", "c"]);
        assert!(f.unwanted.is_none() && f.replaced.is_empty());
        assert!(p.hold_fresh(&keys(&["a", "c"]), Duration::from_secs(1)));
        assert!(!p.hold_fresh(&keys(&["a"]), Duration::ZERO), "not fresh");
        assert!(!p.hold_fresh(&keys(&["d"]), Duration::from_secs(1)));
        // Keys it does not cover, or none: the pins stay.
        assert!(p.take_covering(&["a", "d"], Instant::now()).is_none());
        assert!(p.take_covering(&[], Instant::now()).is_none());
        let h = p
            .take_covering(&["c", "a"], Instant::now())
            .expect("covered");
        assert_eq!(h.session.keys, ["a", "b", "c"]);
        assert!(
            p.take_covering(&["a"], Instant::now()).is_none(),
            "taken once"
        );
    }

    #[test]
    fn two_lookups_ahead_of_their_loads_each_keep_their_pins() {
        let p = pins();
        pin(&p, &["a1", "a2"]);
        pin(&p, &["b1", "b2"]);
        assert_eq!(
            p.take_covering(&["a1", "a2"], Instant::now())
                .unwrap()
                .session
                .keys,
            ["a1", "a2"]
        );
        assert_eq!(
            p.take_covering(&["b2"], Instant::now())
                .unwrap()
                .session
                .keys,
            ["b1", "b2"]
        );
        assert!(p.take_all().is_empty());
    }

    #[test]
    fn pins_covered_by_later_ones_or_past_the_bound_are_replaced() {
        let p = pins();
        pin(&p, &["a"]);
        // A later pin of a superset replaces it, once in.
        let f = pin(&p, &["a", "b"]);
        assert_eq!(f.replaced.len(), 1);
        assert_eq!(f.replaced[0].keys, ["a"]);
        // KEPT more of other keys: the oldest (a, b) goes with the last.
        for g in 0..KEPT as u64 {
            let f = pin(&p, &[&format!("k{g}")]);
            let last = g + 1 == KEPT as u64;
            assert_eq!(f.replaced.len(), usize::from(last), "pin {g}");
            if last {
                assert_eq!(f.replaced[0].keys, ["a", "b"]);
            }
        }
        assert!(p.take_covering(&["a"], Instant::now()).is_none());
        assert_eq!(p.take_all().len(), KEPT);
    }

    #[test]
    fn a_load_gives_up_only_a_pin_under_way_of_its_own_keys() {
        let p = pins();
        let a = p.begin(0, &keys(&["a"])).unwrap();
        // A load of other keys leaves it.
        assert!(p.take_covering(&["b"], Instant::now()).is_none());
        assert!(p.hold_fresh(&keys(&["a"]), Duration::ZERO), "under way");
        let f = a.finish(session(&["a"]), Instant::now());
        assert!(f.unwanted.is_none());
        // A load of its keys gives it up: it is handed back once in.
        let c = p.begin(0, &keys(&["c"])).unwrap();
        assert!(p.take_covering(&["c"], Instant::now()).is_none());
        assert!(c.finish(session(&["c"]), Instant::now()).unwanted.is_some());
        assert!(p.take_covering(&["a"], Instant::now()).is_some());
    }

    #[test]
    fn a_load_waits_for_its_pin_under_way_and_takes_it_once_in() {
        let p = pins();
        let a = p.begin(0, &keys(&["a", "b"])).unwrap();
        // From before the spawn: a waiter thread that starts late still waited for the pin.
        let t0 = Instant::now();
        std::thread::scope(|s| {
            let waiting = s.spawn(|| {
                let got = p.take_covering(&["a"], Instant::now() + Duration::from_secs(10));
                (got, t0.elapsed())
            });
            std::thread::sleep(Duration::from_millis(50));
            assert!(a
                .finish(session(&["a", "b"]), Instant::now())
                .unwanted
                .is_none());
            let (got, waited) = waiting.join().unwrap();
            assert_eq!(got.expect("taken once in").session.keys, ["a", "b"]);
            assert!(waited >= Duration::from_millis(40), "{waited:?}");
            assert!(
                waited < Duration::from_secs(5),
                "woken, not timed out: {waited:?}"
            );
        });
        assert!(p.take_all().is_empty(), "taken out");
    }

    #[test]
    fn a_pin_under_way_past_the_bound_is_given_up_and_handed_back_once_in() {
        let p = pins();
        let a = p.begin(0, &keys(&["a"])).unwrap();
        let t0 = Instant::now();
        assert!(p
            .take_covering(&["a"], Instant::now() + Duration::from_millis(30))
            .is_none());
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(
            !p.hold_fresh(&keys(&["a"]), Duration::from_secs(1)),
            "given up"
        );
        assert!(a.finish(session(&["a"]), Instant::now()).unwanted.is_some());
        assert!(p.take_all().is_empty());
    }

    #[test]
    fn a_load_waiting_for_a_pin_that_fails_or_is_reset_goes_on_at_once() {
        let p = pins();
        for reset in [false, true] {
            let a = p.begin(p.epoch(), &keys(&["a"])).unwrap();
            std::thread::scope(|s| {
                let waiting = s.spawn(|| {
                    let t0 = Instant::now();
                    let got = p.take_covering(&["a"], Instant::now() + Duration::from_secs(10));
                    (got.is_some(), t0.elapsed())
                });
                std::thread::sleep(Duration::from_millis(20));
                if reset {
                    assert!(p.take_all().is_empty());
                } else {
                    a.abandon();
                }
                let (got, waited) = waiting.join().unwrap();
                assert!(!got, "reset {reset}");
                assert!(waited < Duration::from_secs(5), "reset {reset}: {waited:?}");
            });
        }
    }

    #[test]
    fn a_pin_that_comes_in_beside_more_than_kept_under_way_is_held() {
        let p = pins();
        let mut under_way: Vec<PinUnderWay> = (0..=KEPT)
            .map(|i| p.begin(0, &keys(&[&format!("k{i}")])).unwrap())
            .collect();
        // The first to come in, with KEPT more still under way: held, not replaced by itself.
        let first = under_way.remove(0);
        let f = first.finish(session(&["k0"]), Instant::now());
        assert!(f.unwanted.is_none() && f.replaced.is_empty(), "{f:?}");
        // The rest come in: at most KEPT held, the oldest replaced.
        let mut replaced = Vec::new();
        for (i, u) in under_way.into_iter().enumerate() {
            let k = format!("k{}", i + 1);
            let f = u.finish(session(&[k.as_str()]), Instant::now());
            assert!(f.unwanted.is_none());
            replaced.extend(f.replaced.into_iter().map(|s| s.keys));
        }
        assert_eq!(replaced, [["k0"]]);
        assert!(p.take_covering(&["k1"], Instant::now()).is_some());
        assert_eq!(p.take_all().len(), KEPT - 1);
    }

    #[test]
    fn a_pin_is_wanted_until_a_load_gives_it_up_or_a_reset_takes_it() {
        let p = pins();
        let a = p.begin(0, &keys(&["a"])).unwrap();
        assert!(a.wanted());
        assert!(
            p.take_covering(&["a"], Instant::now()).is_none(),
            "given up at once"
        );
        assert!(!a.wanted(), "its thread starts no session");
        let b = p.begin(0, &keys(&["b"])).unwrap();
        assert!(p.take_all().is_empty());
        assert!(!b.wanted());
    }

    #[test]
    fn a_failed_pin_leaves_nothing_behind() {
        let p = pins();
        p.begin(0, &keys(&["a"])).unwrap().abandon();
        assert!(
            !p.hold_fresh(&keys(&["a"]), Duration::from_secs(1)),
            "the next lookup pins again"
        );
        assert!(p.take_all().is_empty());
    }

    #[test]
    fn a_pin_whose_thread_unwinds_leaves_nothing_behind() {
        let p = pins();
        let held = pin(&p, &["b"]);
        assert!(held.unwanted.is_none());
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _under_way = p.begin(0, &keys(&["a"])).unwrap();
            panic!("injected: the pin's thread unwinds before its session is in");
        }));
        assert!(unwound.is_err());
        assert!(
            !p.hold_fresh(&keys(&["a"]), Duration::from_secs(1)),
            "the next lookup pins again"
        );
        // The pin held before stays for its load.
        assert!(p.take_covering(&["b"], Instant::now()).is_some());
        assert!(p.take_all().is_empty());
    }

    #[test]
    fn after_reset_a_late_pin_is_handed_back_and_an_earlier_lookup_pins_nothing() {
        let p = pins();
        pin(&p, &["a"]);
        let before = p.epoch();
        let b = p.begin(before, &keys(&["b"])).unwrap();
        assert_eq!(p.take_all().len(), 1, "the held one");
        // The pin under way at the reset is ended by its thread.
        assert!(b.finish(session(&["b"]), Instant::now()).unwanted.is_some());
        // A lookup from before the reset does not pin.
        assert!(p.begin(before, &keys(&["c"])).is_none());
        assert!(p.take_all().is_empty());
    }
}
