//! Per-batch, per-layer readiness: complete, fail, wait with a deadline, an on-layer-ready
//! hook, reset with generations. No I/O, no printing, no panics on input.
//!
//! A loader [`begin`](LayerCounter::begin)s a batch of `L` layers and gets a [`Ticket`];
//! its readers [`complete`](LayerCounter::complete) layers as their bytes land (in any
//! order, from any threads) or [`fail`](LayerCounter::fail) the batch; the engine
//! [`wait`](LayerCounter::wait)s for layer `l` before attention on `l`, then
//! [`finish`](LayerCounter::finish)es the batch.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use layerwise_counter::{LayerCounter, WaitOutcome};
//!
//! let counter: LayerCounter<String> = LayerCounter::new();
//! let ticket = counter.begin(3)?;
//! counter.complete(ticket, 1)?; // out of order: layer 1 is complete but not ready
//! assert!(!counter.is_ready(ticket, 1)?);
//! counter.complete(ticket, 0)?; // now layers 0 and 1 are ready
//! let deadline = Instant::now() + Duration::from_secs(1);
//! assert_eq!(counter.wait(ticket, 1, deadline)?, WaitOutcome::Ready);
//! assert_eq!(counter.ready_layers(ticket)?, 2);
//! assert_eq!(counter.wait(ticket, 2, Instant::now())?, WaitOutcome::TimedOut);
//! counter.finish(ticket)?;
//! assert!(counter.wait(ticket, 0, deadline).is_err()); // stale
//! # Ok::<(), layerwise_counter::CounterError>(())
//! ```
//!
//! # Semantics
//! - **Ready prefix.** Layer `l` is *ready* when layers `0..=l` are all complete and, if
//!   the batch has a hook, the hook has returned for each of them. Completions may come in
//!   any order and twice; readiness follows the prefix.
//! - **Hook.** [`begin_with_hook`](LayerCounter::begin_with_hook) takes a [`LayerHook`],
//!   called exactly once per layer, in order `0, 1, 2, ...`, even with out-of-order and
//!   concurrent completions. The thread whose completion extends the prefix becomes the
//!   batch's *hook runner* (unless one is running already, which then takes the new layers
//!   too): it calls the hook for each newly complete layer without holding any lock, then
//!   publishes that layer as ready. So **a waiter that sees `Ready` for `l` knows the hook
//!   for `l` has returned.** The hook may call back into the counter. Hooks stop when the
//!   batch fails or is released; a hook that was already running when the batch failed
//!   has run for a layer that then never becomes ready. If a hook panics, the panic goes
//!   to the `complete` call that ran it, the batch drops its hook (no more calls), and
//!   neither that layer nor a later one ever becomes ready (its hook never returned): their
//!   waiters get the batch's failure once the caller fails it, or their deadline.
//! - **Failure.** The first [`fail`](LayerCounter::fail) wins and wakes every waiter of
//!   the batch. A layer already ready stays `Ready`; waiting for any other layer returns
//!   [`WaitOutcome::Failed`] with a clone of the first error.
//! - **Deadline.** Every wait has one: [`WaitOutcome::TimedOut`] when it passes.
//! - **Stale tickets.** [`finish`](LayerCounter::finish) and [`reset`](LayerCounter::reset)
//!   release slots; a released ticket is refused with [`CounterError::StaleTicket`] by
//!   every call, never answered from the slot's next batch. A thread already waiting when
//!   its ticket is released returns [`WaitOutcome::Cancelled`].
//! - **Generations.** Each `begin` takes the next value of a process-wide 64-bit
//!   generation (shared by every counter), so a slot reused after `finish`/`reset` yields a
//!   ticket that differs from every earlier one, of this counter or another.
//!
//! # Cost
//! The slot table is allocated by the constructor; `begin` allocates only to grow a slot's
//! layer bit set. A `wait`/`is_ready`/`ready_layers` on a ready layer reads four atomics
//! of its slot (generation, layer count, ready prefix, then the generation again,
//! seqlock-style, so a recycled slot is never read as the old batch) and takes no lock,
//! allocates nothing and does not read the clock (about 8 ns, `docs/benchmarks.md`). The
//! slow path blocks on the slot's parking_lot `Condvar` with `wait_until(deadline)`;
//! writers notify it after dropping the slot lock.
//!
//! # Concurrency checks
//! Both: `tests/loom.rs` runs small models under [loom](https://docs.rs/loom) (built with
//! `RUSTFLAGS="--cfg kvlink_loom" cargo test -p layerwise-counter --test loom --release`;
//! `src/sync.rs` switches atomics, mutexes and condvars to loom's). Loom explores every
//! interleaving (up to a preemption bound) and the weak-memory orderings of the atomics,
//! which checks the seqlock fast path on a recycled slot, hook order and exactly-once
//! under racing completers, and lost wake-ups: loom has no clock, so the shim's
//! `wait_until` waits for a notification only, and a missed one shows up as a deadlock.
//! Because time is not modelled, deadlines are covered by `tests/stress.rs` instead:
//! thousands of randomized schedules on real threads (2 to 8 threads, random completion
//! orders, failures, resets, finishes and yields, every wait bounded) checking the same
//! invariants.
//!
//! Events: `tracing` debug events on `begin`, `fail` and `reset`, trace on `finish`.

mod bits;
mod counter;
mod error;
mod outcome;
mod slot;
mod sync;
mod ticket;

#[cfg(all(test, not(kvlink_loom)))]
mod tests;

pub use counter::{LayerCounter, DEFAULT_CAPACITY, MAX_CAPACITY, MAX_LAYERS};
pub use error::CounterError;
pub use outcome::WaitOutcome;
pub use ticket::Ticket;

/// Called as `hook(ticket, layer)` once per layer as it becomes ready, in layer order.
pub type LayerHook = std::sync::Arc<dyn Fn(Ticket, u32) + Send + Sync>;
