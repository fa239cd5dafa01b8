//! Read-session pins taken when a prefix is looked up, for its load to take over.
//!
//! A load reads its objects under a read session (lease pins, see `session`), and starting
//! one is a master call (about 4 ms on the GPU host for a 32K-token GLM-5.2 prefix) on the
//! first layer's path. A lookup that found pages therefore also starts the session its load
//! will read under, on the thread that reads the companions ahead (see `prefetch`), beside
//! that read; the load takes it over when it covers every key the load reads, and renews it
//! as its own before its first read if it is older than `LinkerConfig::lease_renewal` (so a
//! late load is as safe as one that pinned for itself). SGLang's later linker likewise pins
//! between the match and the load.
//!
//! Only where this rank's reads are known at the lookup (a rank alone; a fixed mode, or the
//! one `Auto` keeps): the same keys the load pins (every page of its own components, its
//! share of the replicated ones, reckoned on the looked-up pages as the batch's plan pages).
//! One slot per linker: the pins of the last lookup that took any. They are ended by the
//! load that takes them (as its own session, on its drop), or else by the next lookup that
//! pins other keys, by `reset`, or by `close`; Mooncake's lease also lets them go on its own
//! (5 s by default). A load that finds a pin still under way does not wait for it: it pins
//! for itself, and the late pin is ended by the thread that took it.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::store::ReadSession;

/// The one slot of pins held ahead of a load.
#[derive(Debug, Default)]
pub(crate) struct PinsAhead {
    slot: Mutex<Slot>,
}

#[derive(Debug, Default)]
enum Slot {
    #[default]
    Empty,
    /// The read ahead `generation` is starting a session; nobody has asked for it yet.
    Starting {
        generation: u64,
    },
    Held(HeldPins),
}

/// A session started at a lookup, and when.
#[derive(Debug)]
pub(crate) struct HeldPins {
    pub(crate) session: ReadSession,
    pub(crate) started: Instant,
    keys: HashSet<String>,
}

impl HeldPins {
    fn new(session: ReadSession, started: Instant) -> Self {
        let keys = session.keys.iter().cloned().collect();
        HeldPins {
            session,
            started,
            keys,
        }
    }

    fn covers<'k>(&self, keys: impl IntoIterator<Item = &'k str>) -> bool {
        keys.into_iter().all(|k| self.keys.contains(k))
    }
}

impl PinsAhead {
    /// True if the pins held cover `keys` and were taken less than `fresh_for` ago: a lookup
    /// then need not pin again.
    pub(crate) fn hold_fresh(&self, keys: &[String], fresh_for: Duration) -> bool {
        match &*self.slot.lock() {
            Slot::Held(h) => {
                h.started.elapsed() < fresh_for && h.covers(keys.iter().map(String::as_str))
            }
            _ => false,
        }
    }

    /// Read ahead `generation` is about to pin: marks the slot so, and returns the pins held
    /// before (which that read ahead ends once its own are in).
    pub(crate) fn begin(&self, generation: u64) -> Option<HeldPins> {
        let before = std::mem::replace(&mut *self.slot.lock(), Slot::Starting { generation });
        match before {
            Slot::Held(h) => Some(h),
            _ => None,
        }
    }

    /// Read ahead `generation`'s pin is in: held for the next load if still wanted; if not
    /// (a load came first and pinned for itself, or the linker is ending), handed back to be
    /// ended.
    pub(crate) fn finish(
        &self,
        generation: u64,
        session: ReadSession,
        started: Instant,
    ) -> Option<ReadSession> {
        let mut slot = self.slot.lock();
        match &*slot {
            Slot::Starting { generation: g } if *g == generation => {
                *slot = Slot::Held(HeldPins::new(session, started));
                None
            }
            _ => Some(session),
        }
    }

    /// Read ahead `generation`'s pin failed or was not started: the slot is empty again.
    pub(crate) fn abandon(&self, generation: u64) {
        let mut slot = self.slot.lock();
        if matches!(&*slot, Slot::Starting { generation: g } if *g == generation) {
            *slot = Slot::Empty;
        }
    }

    /// What a load finds for `keys`: the pins held when they cover every key (taken out of
    /// the slot); none otherwise. Pins of other keys stay for a later load; a pin still under
    /// way is given up (its thread ends it), since the load pins for itself rather than wait.
    pub(crate) fn take_covering<'k>(
        &self,
        keys: impl IntoIterator<Item = &'k str>,
    ) -> Option<HeldPins> {
        let mut slot = self.slot.lock();
        match &*slot {
            Slot::Held(h) if h.covers(keys) => match std::mem::take(&mut *slot) {
                Slot::Held(h) => Some(h),
                _ => None,
            },
            Slot::Starting { .. } => {
                *slot = Slot::Empty;
                None
            }
            _ => None,
        }
    }

    /// Empties the slot (`reset`, `close`): returns the pins held, for the caller to end. A
    /// pin still under way is ended by its thread.
    pub(crate) fn take_all(&self) -> Option<ReadSession> {
        match std::mem::take(&mut *self.slot.lock()) {
            Slot::Held(h) => Some(h.session),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(keys: &[&str]) -> ReadSession {
        ReadSession {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            lease: None,
        }
    }

    #[test]
    fn a_load_takes_pins_that_cover_its_keys_and_leaves_others() {
        let p = PinsAhead::default();
        assert!(p.begin(1).is_none());
        assert!(p
            .finish(1, session(&["a", "b", "c"]), Instant::now())
            .is_none());
        assert!(p.hold_fresh(&["a".into(), "c".into()], Duration::from_secs(1)));
        assert!(!p.hold_fresh(&["a".into()], Duration::ZERO), "not fresh");
        // Keys it does not cover: the pins stay.
        assert!(p.take_covering(["a", "d"]).is_none());
        let h = p.take_covering(["c", "a"]).expect("covered");
        assert_eq!(h.session.keys, ["a", "b", "c"]);
        assert!(p.take_covering(["a"]).is_none(), "taken once");
    }

    #[test]
    fn a_pin_no_longer_wanted_is_handed_back_to_be_ended() {
        let p = PinsAhead::default();
        p.begin(1);
        // A load came first: it gives the pin under way up.
        assert!(p.take_covering(["a"]).is_none());
        assert!(p.finish(1, session(&["a"]), Instant::now()).is_some());
        // A later read ahead replaced this one.
        p.begin(2);
        p.begin(3);
        assert!(p.finish(2, session(&["a"]), Instant::now()).is_some());
        assert!(p.finish(3, session(&["a"]), Instant::now()).is_none());
        // The next read ahead gets the pins held before, to end them.
        let before = p.begin(4).expect("held");
        assert_eq!(before.session.keys, ["a"]);
        p.abandon(4);
        assert!(p.take_all().is_none());
    }

    #[test]
    fn ending_takes_what_is_held_and_a_late_pin_ends_itself() {
        let p = PinsAhead::default();
        p.begin(1);
        p.finish(1, session(&["a"]), Instant::now());
        assert!(p.take_all().is_some());
        p.begin(2);
        assert!(p.take_all().is_none());
        assert!(p.finish(2, session(&["a"]), Instant::now()).is_some());
    }
}
