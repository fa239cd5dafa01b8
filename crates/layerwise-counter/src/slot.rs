//! [`Slot`]: the readiness state machine of one batch, reused batch after batch.
//!
//! Everything is written under the slot's mutex; the generation, the number of layers and
//! the published ready prefix are mirrored in atomics so that a reader can answer "is
//! layer `l` ready?" without the lock (see [`Slot::snapshot`]).

use std::time::Instant;

use crate::bits::LayerBits;
use crate::sync::{AtomicU32, AtomicU64, Condvar, Mutex, MutexGuard, Ordering};
use crate::{CounterError, LayerHook, Ticket, WaitOutcome};

/// Generation of a slot that holds no batch; tickets never carry it.
pub(crate) const FREE: u64 = 0;

/// One slot of the counter's table.
pub(crate) struct Slot<E> {
    /// Mirror of `SlotState::generation`, written under the lock, last on activation.
    generation: AtomicU64,
    /// Mirror of `SlotState::num_layers`.
    num_layers: AtomicU32,
    /// Mirror of `SlotState::published`.
    ready: AtomicU32,
    state: Mutex<SlotState<E>>,
    cond: Condvar,
}

/// The lock-protected part of a slot.
struct SlotState<E> {
    /// Generation of the live batch, or [`FREE`].
    generation: u64,
    num_layers: u32,
    /// Layers reported complete, in any order.
    completed: LayerBits,
    /// Length of the complete prefix of `completed`.
    done: u32,
    /// Length of the prefix that waiters see as ready: `done`, less the layers whose hook
    /// has not returned yet.
    published: u32,
    hook: Option<LayerHook>,
    /// Some thread is running hooks for this batch (and will publish what they cover).
    hook_running: bool,
    /// A hook of this batch panicked: nothing more is published (a layer is ready only once
    /// its hook has returned).
    hook_panicked: bool,
    /// First failure of the batch.
    error: Option<E>,
    /// Threads blocked in `cond` (of any generation).
    waiters: u32,
}

impl<E> SlotState<E> {
    fn check_live(&self, ticket: Ticket) -> Result<(), CounterError> {
        if self.generation == ticket.generation() {
            Ok(())
        } else {
            Err(CounterError::StaleTicket { ticket })
        }
    }

    fn check_layer(&self, ticket: Ticket, layer: u32) -> Result<(), CounterError> {
        if layer < self.num_layers {
            Ok(())
        } else {
            Err(CounterError::LayerOutOfRange {
                ticket,
                layer,
                num_layers: self.num_layers,
            })
        }
    }
}

/// What a released slot held; dropped by the caller after the lock is gone, so that user
/// `Drop` code (the hook's captures, the error) never runs under the slot lock.
pub(crate) struct Released<E> {
    _hook: Option<LayerHook>,
    _error: Option<E>,
}

impl<E: Clone> Slot<E> {
    /// Threads blocked waiting on this slot now (tests: to know a waiter is in its wait).
    #[cfg(test)]
    pub(crate) fn waiting(&self) -> u32 {
        self.state.lock().waiters
    }

    /// A free slot.
    pub(crate) fn new() -> Self {
        Self {
            generation: AtomicU64::new(FREE),
            num_layers: AtomicU32::new(0),
            ready: AtomicU32::new(0),
            state: Mutex::new(SlotState {
                generation: FREE,
                num_layers: 0,
                completed: LayerBits::default(),
                done: 0,
                published: 0,
                hook: None,
                hook_running: false,
                hook_panicked: false,
                error: None,
                waiters: 0,
            }),
            cond: Condvar::new(),
        }
    }

    /// Lock-free read of `(ready prefix, num_layers)` of the batch `generation`, or `None`
    /// if the slot does not hold that batch (now or at any point during the read).
    ///
    /// Seqlock-style: the generation is read before and after the data. Every data store
    /// is a release store made under the lock after the previous batch's generation was
    /// overwritten, so a reader that acquires a value of a later batch also sees the
    /// changed generation on its second read and refuses the snapshot. Generations are
    /// never reused, so there is no ABA.
    #[inline]
    pub(crate) fn snapshot(&self, generation: u64) -> Option<(u32, u32)> {
        if self.generation.load(Ordering::Acquire) != generation {
            return None;
        }
        let num_layers = self.num_layers.load(Ordering::Acquire);
        let ready = self.ready.load(Ordering::Acquire);
        if self.generation.load(Ordering::Acquire) != generation {
            return None;
        }
        Some((ready, num_layers))
    }

    /// Makes a free slot hold batch `generation`. The caller took the slot off the free
    /// list, so no other batch is live in it.
    pub(crate) fn activate(&self, generation: u64, num_layers: u32, hook: Option<LayerHook>) {
        let old_hook = {
            let mut st = self.state.lock();
            st.generation = generation;
            st.num_layers = num_layers;
            st.completed.reset(num_layers);
            st.done = 0;
            st.published = 0;
            st.hook_running = false;
            st.hook_panicked = false;
            st.error = None;
            let old = std::mem::replace(&mut st.hook, hook);
            self.num_layers.store(num_layers, Ordering::Release);
            self.ready.store(0, Ordering::Release);
            // Last: readers that see this generation see the fields above.
            self.generation.store(generation, Ordering::Release);
            old
        };
        drop(old_hook);
    }

    /// Releases the slot if it holds batch `generation` (`None`: whatever batch it holds).
    /// Waiters of the released batch return [`WaitOutcome::Cancelled`]. Returns the
    /// released generation and its leftovers, or `None` if nothing was released.
    pub(crate) fn release(&self, generation: Option<u64>) -> Option<(u64, Released<E>)> {
        let mut st = self.state.lock();
        if st.generation == FREE || generation.is_some_and(|g| g != st.generation) {
            return None;
        }
        let released = st.generation;
        st.generation = FREE;
        self.generation.store(FREE, Ordering::Release);
        // A hook runner of the released batch notices the new generation and stops.
        st.hook_running = false;
        let leftovers = Released {
            _hook: st.hook.take(),
            _error: st.error.take(),
        };
        let wake = st.waiters > 0;
        drop(st);
        self.wake(wake);
        Some((released, leftovers))
    }

    /// Marks `layer` of `ticket` complete; see [`LayerCounter::complete`](crate::LayerCounter::complete).
    pub(crate) fn complete(&self, ticket: Ticket, layer: u32) -> Result<(), CounterError> {
        let mut st = self.state.lock();
        st.check_live(ticket)?;
        st.check_layer(ticket, layer)?;
        if st.error.is_some() || !st.completed.insert(layer) {
            return Ok(());
        }
        while st.done < st.num_layers && st.completed.contains(st.done) {
            st.done += 1;
        }
        if st.hook_panicked {
            // Its layers from the panicking one on never become ready: a waiter gets the
            // batch's failure, or its deadline.
        } else if st.hook.is_none() {
            let done = st.done;
            let wake = self.publish(&mut st, done);
            drop(st);
            self.wake(wake);
        } else if !st.hook_running && st.published < st.done {
            st.hook_running = true;
            self.run_hooks(ticket, st);
        }
        Ok(())
    }

    /// Runs the hook for each layer of `done` not yet published, in layer order, one at a
    /// time and without the lock, publishing each layer after its hook returned. Called
    /// with the lock held by the one thread that set `hook_running`.
    fn run_hooks<'a>(&'a self, ticket: Ticket, mut st: MutexGuard<'a, SlotState<E>>) {
        // Waiters of the layer published last, to wake once the lock is dropped.
        let mut wake = false;
        loop {
            if st.generation != ticket.generation() {
                // Released meanwhile; `release` cleared `hook_running`.
                drop(st);
                self.wake(wake);
                return;
            }
            let hook = match &st.hook {
                Some(hook) if st.error.is_none() && st.published < st.done => hook.clone(),
                _ => {
                    st.hook_running = false;
                    drop(st);
                    self.wake(wake);
                    return;
                }
            };
            let layer = st.published;
            drop(st);
            self.wake(std::mem::take(&mut wake));
            let mut guard = HookPanicGuard {
                slot: self,
                ticket,
                armed: true,
            };
            hook(ticket, layer);
            guard.armed = false;
            drop(hook);
            st = self.state.lock();
            if st.generation == ticket.generation() && st.error.is_none() {
                wake = self.publish(&mut st, layer + 1);
            }
        }
    }

    /// Makes the first `prefix` layers visible as ready; true if threads wait on the slot
    /// and must be woken (by [`wake`](Self::wake), after the lock is dropped).
    fn publish(&self, st: &mut SlotState<E>, prefix: u32) -> bool {
        if prefix > st.published {
            st.published = prefix;
            self.ready.store(prefix, Ordering::Release);
            st.waiters > 0
        } else {
            false
        }
    }

    /// Wakes every thread waiting on the slot if `needed`. Called after a state change made
    /// under the lock, once the lock is dropped: a waiter checks the state and joins the
    /// condvar atomically under the lock, so it either saw the change or is woken here, and
    /// a woken thread does not run into the still-held lock.
    fn wake(&self, needed: bool) {
        if needed {
            self.cond.notify_all();
        }
    }

    /// Records the first failure of `ticket`; true if this one was the first.
    pub(crate) fn fail(&self, ticket: Ticket, error: E) -> Result<bool, CounterError> {
        let mut st = self.state.lock();
        st.check_live(ticket)?;
        if st.error.is_some() {
            return Ok(false);
        }
        st.error = Some(error);
        let wake = st.waiters > 0;
        drop(st);
        self.wake(wake);
        Ok(true)
    }

    /// The slow path of [`LayerCounter::wait`](crate::LayerCounter::wait).
    pub(crate) fn wait(
        &self,
        ticket: Ticket,
        layer: u32,
        deadline: Instant,
    ) -> Result<WaitOutcome<E>, CounterError> {
        let mut st = self.state.lock();
        st.check_live(ticket)?;
        st.check_layer(ticket, layer)?;
        loop {
            if st.published > layer {
                return Ok(WaitOutcome::Ready);
            }
            if let Some(error) = &st.error {
                return Ok(WaitOutcome::Failed(error.clone()));
            }
            if Instant::now() >= deadline {
                return Ok(WaitOutcome::TimedOut);
            }
            st.waiters += 1;
            st = self.cond.wait_until(st, deadline);
            st.waiters -= 1;
            if st.generation != ticket.generation() {
                return Ok(WaitOutcome::Cancelled);
            }
        }
    }
}

/// Set while a hook runs without the lock: if the hook panics, the batch drops its hook (no
/// further hook calls), stops claiming a runner and publishes nothing more: the panicking
/// layer's hook did not return, so neither it nor a later layer may be seen as ready. The
/// panic goes on to the caller of `complete`.
struct HookPanicGuard<'a, E: Clone> {
    slot: &'a Slot<E>,
    ticket: Ticket,
    armed: bool,
}

impl<E: Clone> Drop for HookPanicGuard<'_, E> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.slot.state.lock();
        if st.generation != self.ticket.generation() {
            return;
        }
        let hook = st.hook.take();
        st.hook_running = false;
        st.hook_panicked = true;
        drop(st);
        drop(hook);
    }
}
