//! The hand-off between a batch's reader thread and its exchange loop: free stages go to the
//! reader, read layers go to the exchange loop (at most `depth` of them waiting), and either
//! side can leave, which ends the other side's waits at once. Every wait has a deadline.
//!
//! It is one small state machine behind one mutex and one condition variable, so that loom
//! can check it (`tests/loom_handoff.rs` builds this very file with loom's primitives under
//! `--cfg kvlink_loom`: no lost wake-up, no stage lost, layers in order, a side that leaves never
//! strands the other). Loom has no clock: there, waits end only on a notification.

use std::collections::VecDeque;
use std::time::Instant;

#[cfg(kvlink_loom)]
use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(kvlink_loom))]
use std::sync::{Condvar, Mutex, MutexGuard};

/// What a wait got.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Wait<T> {
    /// The item.
    Got(T),
    /// The other side left (and nothing is left to take).
    Closed,
    /// The deadline passed.
    TimedOut,
}

struct State<S, L> {
    free: VecDeque<S>,
    read: VecDeque<L>,
    depth: usize,
    reader_open: bool,
    exchange_open: bool,
    /// Why the reader left before handing every layer over, when it says (its first reason).
    stopped: Option<String>,
}

/// The hand-off of one batch (see the module docs).
pub(crate) struct Handoff<S, L> {
    state: Mutex<State<S, L>>,
    cv: Condvar,
}

impl<S, L> Handoff<S, L> {
    /// A hand-off lending `stages` to the reader, with at most `depth` read layers waiting
    /// for the exchange loop (at least one).
    pub(crate) fn new(stages: impl IntoIterator<Item = S>, depth: usize) -> Self {
        Handoff {
            state: Mutex::new(State {
                free: stages.into_iter().collect(),
                read: VecDeque::new(),
                depth: depth.max(1),
                reader_open: true,
                exchange_open: true,
                stopped: None,
            }),
            cv: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State<S, L>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits on the condition variable until notified or `deadline`; false once it passed.
    fn wait<'a>(
        &self,
        guard: MutexGuard<'a, State<S, L>>,
        deadline: Instant,
    ) -> (MutexGuard<'a, State<S, L>>, bool) {
        let now = Instant::now();
        if now >= deadline {
            return (guard, false);
        }
        let g = match self.cv.wait_timeout(guard, deadline - now) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
        (g, true)
    }

    /// Reader: the next free stage, waiting (until `deadline`) for the exchange loop to give
    /// one back. `Closed` once the exchange loop left. A wait that times out says nothing of
    /// why the reader stops: the caller may wait again (a slice of its wait, to renew its read
    /// session), and says so ([`reader_stopped`](Self::reader_stopped)) when it gives up.
    pub(crate) fn free_stage(&self, deadline: Instant) -> Wait<S> {
        let mut st = self.lock();
        loop {
            if !st.exchange_open {
                return Wait::Closed;
            }
            if let Some(s) = st.free.pop_front() {
                return Wait::Got(s);
            }
            let (g, in_time) = self.wait(st, deadline);
            st = g;
            if !in_time {
                return Wait::TimedOut;
            }
        }
    }

    /// Reader: hands a read layer to the exchange loop, waiting (until `deadline`) while
    /// `depth` layers are already waiting. The layer comes back when the exchange loop left
    /// or the deadline passed.
    pub(crate) fn hand_over(&self, layer: L, deadline: Instant) -> Result<(), L> {
        let mut st = self.lock();
        loop {
            if !st.exchange_open {
                return Err(layer);
            }
            if st.read.len() < st.depth {
                st.read.push_back(layer);
                drop(st);
                self.cv.notify_all();
                return Ok(());
            }
            let (g, in_time) = self.wait(st, deadline);
            st = g;
            if !in_time {
                st.stopped.get_or_insert_with(|| {
                    "its wait to hand a layer over ran out (the exchange loop took none in time)"
                        .into()
                });
                return Err(layer);
            }
        }
    }

    /// Reader: why it leaves early (kept when it gave none yet), for the exchange loop's
    /// error.
    pub(crate) fn reader_stopped(&self, why: String) {
        self.lock().stopped.get_or_insert(why);
    }

    /// Why the reader left early, if it said.
    pub(crate) fn why_reader_stopped(&self) -> Option<String> {
        self.lock().stopped.clone()
    }

    /// Reader: it hands over nothing more.
    pub(crate) fn reader_done(&self) {
        self.lock().reader_open = false;
        self.cv.notify_all();
    }

    /// Exchange loop: the next read layer, waiting (until `deadline`) for the reader. Layers
    /// handed over before the reader left are still given; then `Closed`.
    pub(crate) fn next_layer(&self, deadline: Instant) -> Wait<L> {
        let mut st = self.lock();
        loop {
            if let Some(l) = st.read.pop_front() {
                drop(st);
                self.cv.notify_all();
                return Wait::Got(l);
            }
            if !st.reader_open {
                return Wait::Closed;
            }
            let (g, in_time) = self.wait(st, deadline);
            st = g;
            if !in_time {
                return Wait::TimedOut;
            }
        }
    }

    /// Exchange loop: a stage back to the reader.
    pub(crate) fn give_back(&self, stage: S) {
        self.lock().free.push_back(stage);
        self.cv.notify_all();
    }

    /// Exchange loop: it takes nothing more (the reader's waits end at once). Returns the
    /// stages and layers still in the hand-off, so that the caller decides when they go.
    pub(crate) fn exchange_done(&self) -> (Vec<S>, Vec<L>) {
        let mut st = self.lock();
        st.exchange_open = false;
        let left = (st.free.drain(..).collect(), st.read.drain(..).collect());
        drop(st);
        self.cv.notify_all();
        left
    }
}

#[cfg(all(test, not(kvlink_loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    #[test]
    fn stages_and_layers_flow_and_waits_are_bounded() {
        let h: Handoff<u8, u32> = Handoff::new([1, 2], 1);
        assert_eq!(h.free_stage(soon()), Wait::Got(1));
        assert_eq!(h.hand_over(10, soon()), Ok(()));
        // The queue is full (depth 1): the next hand-over times out and gives the layer back.
        let t0 = Instant::now();
        assert_eq!(h.hand_over(11, soon()), Err(11));
        assert!(t0.elapsed() >= Duration::from_millis(40));
        assert_eq!(h.next_layer(soon()), Wait::Got(10));
        assert_eq!(h.next_layer(soon()), Wait::TimedOut);
        h.give_back(1);
        assert_eq!(h.free_stage(soon()), Wait::Got(2));
        assert_eq!(h.free_stage(soon()), Wait::Got(1));
        assert_eq!(h.free_stage(soon()), Wait::TimedOut);
        h.reader_done();
        assert_eq!(h.next_layer(soon()), Wait::Closed);
        assert_eq!(h.exchange_done(), (vec![], vec![]));
        assert_eq!(h.free_stage(soon()), Wait::Closed);
        assert_eq!(h.hand_over(12, soon()), Err(12));
    }

    /// A free-stage wait that timed out and was waited again says nothing of why the reader
    /// stops: its later reason (a panic) is the one kept. Before, the first timed-out slice
    /// wrote "its wait for a free stage ran out" for good.
    #[test]
    fn a_timed_out_slice_of_a_stage_wait_is_not_the_readers_reason() {
        let h: Handoff<u8, u32> = Handoff::new([], 1);
        assert_eq!(
            h.free_stage(Instant::now() + Duration::from_millis(5)),
            Wait::TimedOut
        );
        h.give_back(1);
        assert_eq!(h.free_stage(soon()), Wait::Got(1));
        h.reader_stopped("it panicked: boom".into());
        assert_eq!(h.why_reader_stopped().as_deref(), Some("it panicked: boom"));
    }
}
