//! Store calls with a deadline: [`StoreCalls`] runs every call of a [`KvStore`] on a worker
//! thread and waits for it at most until the call's deadline. A call that hangs fails its
//! keys with [`StoreError::Overdue`] at the deadline, whatever the store does; the worker
//! keeps the call's **hold** (whatever keeps its memory allocated and away from everyone else:
//! the landing, the pool, the batch's outcome) until the call really returns, so memory a
//! late call may still write is neither freed, nor unregistered, nor handed to another batch
//! before then. A call that panics fails its keys with [`StoreError::Panicked`] as soon as it
//! has unwound (it is over: its memory is free again, as the store's buffer contract says),
//! not at its deadline, and its worker goes on to the next call.
//!
//! Workers are kept and reused (a call costs a hand-off, not a thread start); a call that
//! hangs keeps its worker, and a new one is started for the next call. A call goes to the
//! most recently idle worker, and a worker idle for [`WORKER_IDLE_RETIRE`] ends (after a burst
//! of hung calls, their workers do not stay for the server's life, under traffic too). At most
//! [`MAX_WORKERS`] calls run at once: past that (a store that hangs every call) a call fails
//! at once with [`StoreError::Unavailable`].

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tracing::{debug, error, warn};

use super::{KvStore, ObjectGet, ReadSession};
use super::{ReadSession as Session, StoreError};
use crate::log_every::LogEvery;

/// Most store calls running at once, hung ones included.
pub const MAX_WORKERS: usize = 256;

/// How long a store-call worker waits for a call before it ends (the next call past the
/// idle ones starts a new worker).
pub const WORKER_IDLE_RETIRE: Duration = Duration::from_secs(60);

/// What a call keeps alive (and away from others) until it returns.
pub type Hold = Arc<dyn Any + Send + Sync>;

/// A hold for calls whose memory is their own (owned buffers, nothing borrowed).
pub fn no_hold() -> Hold {
    Arc::new(())
}

type Job = Box<dyn FnOnce() + Send>;

/// An idle worker's mailbox: the job handed to it (`None` while it waits).
#[derive(Default)]
struct Mailbox {
    job: Mutex<Option<Job>>,
    ready: Condvar,
}

/// The worker threads of one [`StoreCalls`].
struct Workers {
    /// Idle workers' mailboxes, the most recently idle last: a job goes to it, so that under
    /// steady traffic the same few workers serve and the others' waits run out (handed out
    /// in turn, every idle worker got a job now and then and none ever ended).
    idle: Arc<Mutex<Vec<Arc<Mailbox>>>>,
    /// Set when the [`StoreCalls`] goes: idle workers end, busy ones after their call.
    closed: Arc<AtomicBool>,
    /// Workers alive (idle, busy or hung).
    alive: Arc<AtomicUsize>,
    /// How long a worker waits for a job before it ends ([`WORKER_IDLE_RETIRE`]).
    retire_after: Duration,
    /// "Every worker is busy or hung": at `error` once a minute while it lasts.
    all_busy_log: LogEvery,
}

impl Workers {
    fn new() -> Self {
        Workers {
            idle: Arc::default(),
            closed: Arc::default(),
            alive: Arc::new(AtomicUsize::new(0)),
            retire_after: WORKER_IDLE_RETIRE,
            all_busy_log: LogEvery::default(),
        }
    }

    /// Workers waiting for a job.
    #[cfg(test)]
    fn idle_count(&self) -> usize {
        self.idle.lock().len()
    }

    /// Hands `job` to the most recently idle worker, or to a new one.
    fn submit(&self, job: Job) -> Result<(), StoreError> {
        if self.closed.load(Ordering::Acquire) {
            return Err(StoreError::Unavailable {
                detail: "the store's call workers have stopped".into(),
            });
        }
        let Some(mailbox) = self.idle.lock().pop() else {
            return self.spawn(job);
        };
        *mailbox.job.lock() = Some(job);
        mailbox.ready.notify_one();
        Ok(())
    }

    /// Starts a worker with `job`, its first.
    fn spawn(&self, job: Job) -> Result<(), StoreError> {
        if self.alive.fetch_add(1, Ordering::AcqRel) >= MAX_WORKERS {
            self.alive.fetch_sub(1, Ordering::AcqRel);
            // Every call fails so while the hang lasts: one line a minute at `error`.
            if self.all_busy_log.due("all busy") {
                error!(
                    max = MAX_WORKERS,
                    "every store-call worker is busy or hung: failing the call (and the \
                     calls after it, logged at debug for a minute)"
                );
            } else {
                debug!(max = MAX_WORKERS, "every store-call worker is busy or hung");
            }
            return Err(StoreError::Unavailable {
                detail: format!("{MAX_WORKERS} store calls are running or hung").into(),
            });
        }
        let worker = Worker {
            idle: self.idle.clone(),
            closed: self.closed.clone(),
            mailbox: Arc::default(),
            retire_after: self.retire_after,
        };
        let alive = self.alive.clone();
        let spawned = std::thread::Builder::new()
            .name("kvlink-store-call".into())
            .spawn(move || {
                let mut job = Some(job);
                while let Some(next) = job {
                    // A call's own panic is caught inside the job (its caller gets
                    // `Panicked`); this catches one of its `late` handler, so the worker lives
                    // on either way.
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(next)).is_err() {
                        error!("a store call panicked");
                    }
                    job = worker.next_job();
                }
                alive.fetch_sub(1, Ordering::AcqRel);
            });
        spawned.map(drop).map_err(|e| {
            self.alive.fetch_sub(1, Ordering::AcqRel);
            StoreError::Unavailable {
                detail: kv_loader::Cause::with_source(
                    format!("starting a store-call worker: {e}"),
                    e,
                ),
            }
        })
    }
}

/// What one worker thread waits with.
struct Worker {
    idle: Arc<Mutex<Vec<Arc<Mailbox>>>>,
    closed: Arc<AtomicBool>,
    mailbox: Arc<Mailbox>,
    retire_after: Duration,
}

impl Worker {
    /// Its next job; `None` when the calls are closed, or when it waited `retire_after` with
    /// none (it takes its mailbox off the idle ones and ends; one already taken off has a job
    /// on its way, which it waits for).
    fn next_job(&self) -> Option<Job> {
        let mut job = self.mailbox.job.lock();
        if self.closed.load(Ordering::Acquire) {
            return None;
        }
        self.idle.lock().push(self.mailbox.clone());
        let until = kv_loader::deadline_after(self.retire_after);
        loop {
            if let Some(next) = job.take() {
                return Some(next);
            }
            if self.closed.load(Ordering::Acquire) {
                return None;
            }
            if self.mailbox.ready.wait_until(&mut job, until).timed_out() && job.is_none() {
                let mut idle = self.idle.lock();
                if let Some(at) = idle.iter().position(|m| Arc::ptr_eq(m, &self.mailbox)) {
                    idle.remove(at);
                    debug!(idle_for = ?self.retire_after, "a store-call worker ends, idle");
                    return None;
                }
                drop(idle);
                // Taken off by a submit: its job is on its way (it locks this mailbox next).
                while job.is_none() && !self.closed.load(Ordering::Acquire) {
                    self.mailbox.ready.wait(&mut job);
                }
            }
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        // Idle workers end now; busy ones when their call returns.
        self.closed.store(true, Ordering::Release);
        // Taken out first: a worker locks its mailbox, then the idle list, never the other way.
        let idle = std::mem::take(&mut *self.idle.lock());
        for mailbox in idle {
            let _held = mailbox.job.lock();
            mailbox.ready.notify_one();
        }
    }
}

/// A store whose every call is bounded by a deadline (see the module docs).
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use mooncake_linker::store::{EmbeddedStore, StoreCalls};
/// let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
/// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
/// assert_eq!(calls.exists(&["nothing"], deadline), vec![Ok(false)]);
/// ```
pub struct StoreCalls {
    store: Arc<dyn KvStore>,
    workers: Workers,
    overdue: Arc<OverdueCalls>,
    /// "A call's deadline passed before it started": at `warn` once a minute per kind of
    /// call.
    not_started_log: LogEvery,
}

impl std::fmt::Debug for StoreCalls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreCalls").finish_non_exhaustive()
    }
}

/// The calls that did not return by their deadline: how many, and their log lines (a master
/// that answers late fails every call alike: at its level once a minute per kind of call, at
/// `debug` in between).
#[derive(Default)]
pub(super) struct OverdueCalls {
    count: AtomicU64,
    log: LogEvery,
}

/// Why a call gave its caller no result.
pub(super) enum Unanswered {
    /// It did not return by its deadline (it may still be running).
    Overdue(Duration),
    /// It panicked (it is over).
    Panicked,
    /// Its deadline had passed before it was started: it never went to the store.
    NotStarted,
    /// Its deadline had passed before it was started, and it was sent all the same, not
    /// waited for (cleanup that holds none of the caller's memory: [`StoreCalls::discard`]).
    NotWaited,
}

impl Unanswered {
    /// The error of `key` in a call `call` that gave no result.
    pub(super) fn error(&self, key: &str, call: &'static str) -> StoreError {
        let key = key.to_owned();
        match *self {
            Unanswered::Overdue(waited) => StoreError::Overdue { key, call, waited },
            Unanswered::Panicked => StoreError::Panicked { key, call },
            Unanswered::NotStarted | Unanswered::NotWaited => StoreError::RpcTimeout { key },
        }
    }
}

/// Where a call's result meets its caller.
struct Slot<T> {
    state: Mutex<Answer<T>>,
    cv: Condvar,
}

enum Answer<T> {
    Waiting,
    Done(T),
    /// The call panicked.
    Panicked,
    /// The caller gave up at its deadline.
    Abandoned,
    /// The caller sent the call without waiting for it ([`Pending::detach`]): no caller
    /// takes its result, and it is not overdue.
    Detached,
}

impl<T: Send> super::caller::Awaited for Slot<T> {
    /// Given up at its deadline, or sent without a caller waiting (cleanup past its deadline,
    /// a registration left to its worker): no one takes the answer.
    fn given_up(&self) -> bool {
        matches!(*self.state.lock(), Answer::Abandoned | Answer::Detached)
    }
}

/// A call started on a worker.
pub(super) struct Pending<T> {
    slot: Arc<Slot<T>>,
    what: &'static str,
    started: Instant,
    overdue: Arc<OverdueCalls>,
}

impl<T> Pending<T> {
    /// The call's result; [`Unanswered::Panicked`] as soon as it panicked, or
    /// [`Unanswered::Overdue`] at `deadline` (the call is then abandoned: its result, when it
    /// comes, goes to its `late`).
    pub(super) fn wait(self, deadline: Instant) -> Result<T, Unanswered> {
        let mut state = self.slot.state.lock();
        loop {
            match std::mem::replace(&mut *state, Answer::Waiting) {
                Answer::Done(out) => return Ok(out),
                Answer::Panicked => return Err(Unanswered::Panicked),
                _ if Instant::now() >= deadline => {
                    *state = Answer::Abandoned;
                    self.overdue.count.fetch_add(1, Ordering::Relaxed);
                    let waited = self.started.elapsed();
                    match self.overdue.log.due_after(self.what) {
                        Some(skipped) => {
                            error!(call = self.what, ?waited, skipped,
                            "a store call is overdue: it fails now; its memory is kept until it \
                             returns (`skipped`: calls of this kind overdue since the last such \
                             line, logged at debug)")
                        }
                        None => debug!(call = self.what, ?waited, "a store call is overdue"),
                    }
                    return Err(Unanswered::Overdue(waited));
                }
                _ => {
                    self.slot.cv.wait_until(&mut state, deadline);
                }
            }
        }
    }
}

impl<T> Pending<T> {
    /// The call's result if it has answered; otherwise it is left to run without a caller,
    /// as [`detach`](Self::detach) leaves it (not counted nor logged as overdue: the caller
    /// stops waiting for a reason of its own, not at a deadline).
    pub(super) fn answered_or_detach(self) -> Option<Result<T, Unanswered>> {
        let mut state = self.slot.state.lock();
        match std::mem::replace(&mut *state, Answer::Detached) {
            Answer::Done(out) => Some(Ok(out)),
            Answer::Panicked => Some(Err(Unanswered::Panicked)),
            Answer::Waiting => None,
            other => {
                *state = other;
                None
            }
        }
    }

    /// Leaves the call to run without a caller: its result, when it comes, goes to its `late`
    /// on the worker, quietly (not counted nor logged as overdue: no one waited for it).
    pub(super) fn detach(self) {
        let mut state = self.slot.state.lock();
        if matches!(*state, Answer::Waiting) {
            *state = Answer::Detached;
        }
    }
}

impl<T> Drop for Pending<T> {
    /// A caller that stops waiting before the call answered gives it up, as a deadline does:
    /// its result then goes to its `late` on the worker, not into a slot no one reads. (A
    /// result already in the slot is dropped with it: take it with `wait`.)
    fn drop(&mut self) {
        let mut state = self.slot.state.lock();
        if matches!(*state, Answer::Waiting) {
            *state = Answer::Abandoned;
        }
    }
}

/// Every key's error in a call `call` that gave no result.
pub(super) fn unanswered_all<T>(
    keys: &[String],
    call: &'static str,
    why: &Unanswered,
) -> Vec<Result<T, StoreError>> {
    keys.iter().map(|k| Err(why.error(k, call))).collect()
}

pub(super) fn failed_all<T>(keys: &[String], e: &StoreError) -> Vec<Result<T, StoreError>> {
    keys.iter().map(|_| Err(e.clone())).collect()
}

fn owned(keys: &[&str]) -> Vec<String> {
    keys.iter().map(|k| (*k).to_owned()).collect()
}

impl StoreCalls {
    /// Bounded calls of `store`.
    pub fn new(store: Arc<dyn KvStore>) -> Self {
        StoreCalls {
            store,
            workers: Workers::new(),
            overdue: Arc::default(),
            not_started_log: LogEvery::default(),
        }
    }

    /// Bounded calls of the same store on workers of their own (a call parked on one set
    /// does not take a worker of the other), counting their overdue calls with these: one
    /// [`overdue_calls`](Self::overdue_calls) for both.
    pub(crate) fn beside(&self) -> Self {
        StoreCalls {
            store: self.store.clone(),
            workers: Workers::new(),
            overdue: self.overdue.clone(),
            not_started_log: LogEvery::default(),
        }
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn KvStore> {
        &self.store
    }

    /// Calls that did not return by their deadline so far.
    pub fn overdue_calls(&self) -> u64 {
        self.overdue.count.load(Ordering::Relaxed)
    }

    /// Store-call workers alive now (idle, running or hung).
    pub fn workers(&self) -> usize {
        self.workers.alive.load(Ordering::Acquire)
    }

    /// Starts `call` on a worker. `call` owns everything it uses (it may outlive its
    /// caller's wait); a result that comes after the caller gave up goes to `late` instead
    /// (on the worker).
    pub(super) fn submit<T: Send + 'static>(
        &self,
        what: &'static str,
        call: impl FnOnce(&dyn KvStore) -> T + Send + 'static,
        late: impl FnOnce(&dyn KvStore, T) + Send + 'static,
    ) -> Result<Pending<T>, StoreError> {
        let slot = Arc::new(Slot {
            state: Mutex::new(Answer::Waiting),
            cv: Condvar::new(),
        });
        let theirs = slot.clone();
        let store = self.store.clone();
        let started = Instant::now();
        let overdue = self.overdue.clone();
        // The caller's span (its batch, its rank) on the worker too: the store's lines name
        // what they were for.
        let span = tracing::Span::current();
        self.workers.submit(Box::new(move || {
            let _span = span.enter();
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // The store's own waits (for a lock another call holds across a master call)
                // end once this caller gives up (`super::caller`).
                let _caller = super::caller::enter(theirs.clone());
                call(store.as_ref())
            }));
            let Ok(out) = out else {
                error!(call = what, took = ?started.elapsed(), "a store call panicked: its keys fail");
                let mut state = theirs.state.lock();
                if matches!(*state, Answer::Waiting) {
                    *state = Answer::Panicked;
                    theirs.cv.notify_all();
                }
                return;
            };
            let mut state = theirs.state.lock();
            // No caller takes the result: it goes to `late`, here.
            if let Answer::Abandoned | Answer::Detached = *state {
                let waited_for = matches!(*state, Answer::Abandoned);
                drop(state);
                let took = started.elapsed();
                if waited_for {
                    match overdue.log.due_after(&format!("{what} returned late")) {
                        Some(skipped) => warn!(call = what, ?took, skipped,
                            "a store call returned after its deadline; its memory is released \
                             now (`skipped`: such returns since the last such line, at debug)"),
                        None => debug!(call = what, ?took, "a store call returned after its deadline"),
                    }
                } else {
                    debug!(call = what, ?took, "a store call sent without waiting returned");
                }
                // Still this call's given-up caller: a store call `late` makes (ending a
                // session that started late) waits for no hung holder of the store's locks.
                let _caller = super::caller::enter(theirs.clone());
                late(store.as_ref(), out);
                return;
            }
            *state = Answer::Done(out);
            theirs.cv.notify_all();
        }))?;
        Ok(Pending {
            slot,
            what,
            started,
            overdue: self.overdue.clone(),
        })
    }

    /// Runs `call` on a worker and waits for it until `deadline` (see [`submit`](Self::submit)).
    fn run<T: Send + 'static>(
        &self,
        what: &'static str,
        deadline: Instant,
        call: impl FnOnce(&dyn KvStore) -> T + Send + 'static,
        late: impl FnOnce(&dyn KvStore, T) + Send + 'static,
    ) -> Result<Result<T, Unanswered>, StoreError> {
        if Instant::now() >= deadline {
            // Its caller's bound (a TP peer's wait, say) is spent: the call would only be
            // given up at once, its memory held until it returned.
            if self.not_started_log.due(what) {
                warn!(
                    call = what,
                    "a store call's deadline passed before it started: not sent (more such \
                     calls are logged at debug for a minute)"
                );
            } else {
                debug!(
                    call = what,
                    "a store call's deadline passed before it started"
                );
            }
            return Ok(Err(Unanswered::NotStarted));
        }
        Ok(self.submit(what, call, late)?.wait(deadline))
    }

    /// Per-key results of a call over `keys`: its own, or an error for every key.
    pub(super) fn per_key<T: Send + 'static>(
        &self,
        what: &'static str,
        keys: Vec<String>,
        deadline: Instant,
        call: impl FnOnce(&dyn KvStore, &[&str]) -> Vec<Result<T, StoreError>> + Send + 'static,
    ) -> Vec<Result<T, StoreError>> {
        self.per_key_then(what, keys, deadline, call, |_, _, _| {})
    }

    /// [`per_key`](Self::per_key), and `late` on the worker with the call's own results when
    /// the call returned after its caller gave up (to undo what no caller will take).
    pub(super) fn per_key_then<T: Send + 'static>(
        &self,
        what: &'static str,
        keys: Vec<String>,
        deadline: Instant,
        call: impl FnOnce(&dyn KvStore, &[&str]) -> Vec<Result<T, StoreError>> + Send + 'static,
        late: impl FnOnce(&dyn KvStore, &[&str], Vec<Result<T, StoreError>>) + Send + 'static,
    ) -> Vec<Result<T, StoreError>> {
        let shared: Arc<[String]> = keys.into();
        let mine = shared.clone();
        let theirs = shared.clone();
        let out = self.run(
            what,
            deadline,
            move |s| {
                let refs: Vec<&str> = mine.iter().map(String::as_str).collect();
                super::checked_results(&refs, call(s, &refs))
            },
            move |s, r| {
                let refs: Vec<&str> = theirs.iter().map(String::as_str).collect();
                late(s, &refs, r);
            },
        );
        match out {
            Ok(Ok(r)) => r,
            Ok(Err(why)) => unanswered_all(&shared, what, &why),
            Err(e) => failed_all(&shared, &e),
        }
    }

    /// [`KvStore::exists`], bounded.
    pub fn exists(&self, keys: &[&str], deadline: Instant) -> Vec<Result<bool, StoreError>> {
        self.per_key("exists", owned(keys), deadline, |s, k| s.exists(k))
    }

    /// [`KvStore::object_size`], bounded.
    pub fn object_size(&self, keys: &[&str], deadline: Instant) -> Vec<Result<u64, StoreError>> {
        self.per_key("object_size", owned(keys), deadline, |s, k| {
            s.object_size(k)
        })
    }

    /// [`KvStore::discard`], bounded.
    ///
    /// A discard is cleanup that holds none of the caller's memory: it is sent even when its
    /// deadline has passed (then given up on at once, the store still carrying it out), so
    /// that a bad object found after a TP peer's bound is not left for every later load.
    ///
    /// Sent past its deadline, it is not waited for: every key answers `RpcTimeout` at once
    /// (whether the object went is not known), and the call is neither counted nor logged as
    /// overdue.
    pub fn discard(&self, keys: &[&str], deadline: Instant) -> Vec<Result<(), StoreError>> {
        let keys = owned(keys);
        let now = Instant::now();
        if now < deadline {
            // At least 1 ms: a deadline that passes between this check and the call's own
            // would leave the discard unsent.
            let by = deadline.max(now + Duration::from_millis(1));
            return self.per_key("discard", keys, by, |s, k| s.discard(k));
        }
        let mine = keys.clone();
        let sent = self.submit(
            "discard",
            move |s| {
                let refs: Vec<&str> = mine.iter().map(String::as_str).collect();
                s.discard(&refs)
            },
            // Whether the objects went, once the store answers (the caller already moved on).
            |_, results: Vec<Result<(), StoreError>>| {
                let failed: Vec<&StoreError> = results
                    .iter()
                    .filter_map(|r| r.as_ref().err())
                    .filter(|e| !matches!(e, StoreError::NotFound { .. }))
                    .collect();
                match failed.first() {
                    Some(e) => warn!(keys = results.len(), failed = failed.len(), error = %e,
                        "a discard sent past its deadline returned: some objects stay"),
                    None => debug!(
                        keys = results.len(),
                        "a discard sent past its deadline returned: the objects are gone"
                    ),
                }
            },
        );
        match sent {
            Ok(pending) => {
                pending.detach();
                debug!(
                    keys = keys.len(),
                    "a discard past its deadline: sent, not waited for"
                );
                unanswered_all(&keys, "discard", &Unanswered::NotWaited)
            }
            Err(e) => failed_all(&keys, &e),
        }
    }

    /// [`KvStore::start_session`], bounded. A session that starts after its deadline is
    /// ended by the worker.
    pub fn start_session(&self, keys: &[&str], deadline: Instant) -> Result<Session, StoreError> {
        let key = keys.first().map_or_else(String::new, |k| (*k).to_owned());
        let keys = owned(keys);
        let out = self.run(
            "start_session",
            deadline,
            move |s| {
                let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
                s.start_session(&refs)
            },
            // A session that started after its caller gave up is ended at once.
            |s, r| {
                if let Ok(session) = r {
                    // Not ended here: queued behind another master call (whose holder ends
                    // it), or failed (the store's lease ends it).
                    if let Err(e) = s.end_session(&session) {
                        debug!(keys = session.keys.len(), error = %e,
                            "a session that started after its caller gave up was not ended here: \
                             the holder of the master calls, or the store's lease, ends it");
                    }
                }
            },
        )?;
        out.unwrap_or_else(|why| Err(why.error(&key, "start_session")))
    }

    /// [`KvStore::end_session`], bounded.
    ///
    /// Ending a session is cleanup that holds none of the caller's memory: like a
    /// [`discard`](Self::discard), it is sent even when its deadline has passed (a caller that
    /// spent its bound waiting for a load, or on an earlier end, must not leave the keys
    /// pinned), and then not waited for: it answers `RpcTimeout` at once.
    pub fn end_session(&self, session: &ReadSession, deadline: Instant) -> Result<(), StoreError> {
        let key = session.keys.first().cloned().unwrap_or_default();
        let session = session.clone();
        let now = Instant::now();
        if now >= deadline {
            let pending =
                self.submit("end_session", move |s| s.end_session(&session), |_, _| {})?;
            pending.detach();
            debug!(
                key,
                "ending a session past its deadline: sent, not waited for"
            );
            return Err(Unanswered::NotWaited.error(&key, "end_session"));
        }
        // At least 1 ms: a deadline that passes between this check and the call's own would
        // leave the end unsent.
        let by = deadline.max(now + Duration::from_millis(1));
        let out = self.run(
            "end_session",
            by,
            move |s| s.end_session(&session),
            |_, _| {},
        )?;
        out.unwrap_or_else(|why| Err(why.error(&key, "end_session")))
    }

    /// Reads objects `keys[i]` whole, each into a buffer of the call's own of `lens[i]` bytes
    /// (whole-object reads: no read session, so no request to a master beyond the read),
    /// bounded. An object of fewer bytes is a [`StoreError::ShortRead`]; one of more fails as
    /// the store says (a buffer too small).
    pub fn read_whole_owned(
        &self,
        keys: &[&str],
        lens: &[usize],
        deadline: Instant,
    ) -> Vec<Result<Vec<u8>, StoreError>> {
        if lens.len() != keys.len() {
            return keys
                .iter()
                .map(|k| {
                    Err(StoreError::InvalidArgument {
                        key: (*k).to_owned(),
                        detail: format!("{} lengths for {} keys", lens.len(), keys.len()),
                    })
                })
                .collect();
        }
        let lens = lens.to_vec();
        self.per_key("read_whole_owned", owned(keys), deadline, move |s, k| {
            // Zeroed lazily (calloc), on the worker: the pages are touched only as bytes land.
            let mut bufs: Vec<Vec<u8>> = lens.iter().map(|&n| vec![0u8; n]).collect();
            let gets: Vec<ObjectGet<'_>> = k
                .iter()
                .zip(bufs.iter_mut())
                .map(|(key, buf)| ObjectGet {
                    key,
                    dst: buf.as_mut_ptr(),
                    len: buf.len(),
                })
                .collect();
            // SAFETY: every destination is a buffer this closure owns, of exactly its length,
            // distinct from the others, alive and untouched until the call returns.
            let got = unsafe { s.get_into(&gets) };
            if got
                .iter()
                .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
            {
                // The store gave up on a transfer that may still write these buffers: they
                // are kept for good, and every key fails.
                let failed = super::checked_results(k, got)
                    .into_iter()
                    .zip(k)
                    .map(|(r, key)| match r {
                        Err(e) => Err(e),
                        Ok(_) => Err(StoreError::Abandoned {
                            key: (*key).to_owned(),
                            call: "get_into",
                            detail: "another key's transfer of the same call was given up".into(),
                        }),
                    })
                    .collect();
                let bytes = bufs.iter().map(|b| b.len() as u64).sum();
                super::keep_for_good(bytes, "whole reads' buffers");
                std::mem::forget(bufs);
                return failed;
            }
            owned_results(k, bufs, super::checked_results(k, got))
        })
    }
}

/// Each key's buffer when the store filled it whole, else a short read (or the store's error).
fn owned_results(
    keys: &[&str],
    bufs: Vec<Vec<u8>>,
    got: Vec<Result<u64, StoreError>>,
) -> Vec<Result<Vec<u8>, StoreError>> {
    got.into_iter()
        .zip(bufs)
        .zip(keys)
        .map(|((r, buf), key)| match r {
            Ok(n) if n == buf.len() as u64 => Ok(buf),
            Ok(n) => Err(StoreError::ShortRead {
                key: (*key).to_owned(),
                expected: buf.len() as u64,
                got: n,
            }),
            Err(e) => Err(e),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, Stall};
    use crate::store::{ObjectPut, TargetRange, TargetRead};
    use kv_device::{BatchShape, DirectLanding, HostKvPool, LayerLanding, LayerStage};
    use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
    use std::sync::mpsc;

    fn put(store: &dyn KvStore, key: &str, bytes: &[u8]) {
        let p = ObjectPut {
            key,
            parts: [(bytes.as_ptr(), bytes.len())].into_iter().collect(),
        };
        // SAFETY: `bytes` is live and unchanged during the call.
        assert!(unsafe { store.put(&[p]) }[0].is_ok());
    }

    /// A store call that waits inside the store for a lock another call holds (across a master
    /// call that hangs) stops waiting once its caller gave up at the deadline: its worker
    /// comes back. Before, it stayed parked until the holder let go; behind a hung holder,
    /// every session call parked one until no worker was left for any call.
    #[test]
    fn a_wait_inside_the_store_ends_once_its_caller_gave_up() {
        let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
        let lock = Arc::new(Mutex::new(()));
        let held = lock.lock();
        let theirs = lock.clone();
        let (tx, rx) = mpsc::channel();
        let pending = calls
            .submit(
                "exists",
                move |_| super::super::caller::lock_while_awaited(&theirs).is_some(),
                move |_, took| {
                    let _ = tx.send(took);
                },
            )
            .unwrap();
        let why = pending.wait(Instant::now() + Duration::from_millis(100));
        assert!(matches!(why, Err(Unanswered::Overdue(_))));
        let answer = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert_eq!(
            answer,
            Ok(false),
            "the wait ended with its caller, lock not taken"
        );
    }

    /// A store call that a late result's handler makes (ending a session that started after
    /// its caller gave up) waits for no lock another call holds: its caller gave up. Before,
    /// the handler ran with no caller and waited as long as the holder (a hung master call),
    /// parking its worker.
    #[test]
    fn a_late_handlers_wait_inside_the_store_does_not_outlast_the_holder() {
        let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
        let lock = Arc::new(Mutex::new(()));
        let held = lock.lock();
        let theirs = lock.clone();
        let (tx, rx) = mpsc::channel();
        let pending = calls
            .submit(
                "start_session",
                |_| std::thread::sleep(Duration::from_millis(150)),
                move |_, ()| {
                    let _ = tx.send(super::super::caller::lock_while_awaited(&theirs).is_some());
                },
            )
            .unwrap();
        let why = pending.wait(Instant::now() + Duration::from_millis(50));
        assert!(matches!(why, Err(Unanswered::Overdue(_))));
        let answer = rx.recv_timeout(Duration::from_secs(5));
        drop(held);
        assert_eq!(answer, Ok(false), "the late handler waited for the holder");
    }

    /// A discard past its deadline is still sent: the object goes.
    #[test]
    fn a_discard_past_its_deadline_is_still_carried_out() {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
        put(&*store, "bad", &[1u8; 64]);
        let calls = StoreCalls::new(store.clone());
        let _ = calls.discard(&["bad"], Instant::now() - Duration::from_millis(5));
        let until = Instant::now() + Duration::from_secs(5);
        while store.exists(&["bad"]) != vec![Ok(false)] {
            assert!(Instant::now() < until, "the discard was never carried out");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Lengths that do not pair with the keys are the caller's mistake, said as such for every
    /// key (before, the store's result count was blamed).
    #[test]
    fn whole_reads_refuse_lengths_that_do_not_pair_with_their_keys() {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
        put(&*store, "a", &[1u8; 8]);
        let calls = StoreCalls::new(store);
        let soon = Instant::now() + Duration::from_secs(5);
        let got = calls.read_whole_owned(&["a", "b"], &[8], soon);
        assert!(
            got.iter()
                .all(|r| matches!(r, Err(StoreError::InvalidArgument { .. }))),
            "{got:?}"
        );
        assert_eq!(
            calls.read_whole_owned(&["a"], &[8], soon),
            vec![Ok(vec![1u8; 8])]
        );
    }

    /// A session ended past its deadline (its caller spent the bound waiting for a load, say)
    /// is still ended: the end is sent, not waited for. Before, it was never sent, and the
    /// keys stayed pinned (for good on this store: a plain remove refused them).
    #[test]
    fn a_session_ended_past_its_deadline_is_still_ended() {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
        put(&*store, "k", &[1u8; 64]);
        let calls = StoreCalls::new(store.clone());
        let session = calls
            .start_session(&["k"], Instant::now() + Duration::from_secs(5))
            .unwrap();
        assert!(matches!(
            &store.remove(&["k"])[..],
            [Err(StoreError::Lease { .. })]
        ));
        let now = Instant::now();
        let past = now.checked_sub(Duration::from_millis(5)).unwrap_or(now);
        assert!(matches!(
            calls.end_session(&session, past),
            Err(StoreError::RpcTimeout { .. })
        ));
        let until = Instant::now() + Duration::from_secs(5);
        while store.remove(&["k"]) != vec![Ok(())] {
            assert!(Instant::now() < until, "the session was never ended");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// A store that answers late fails every call alike: the "overdue" line is logged at
    /// `error` once a minute per kind of call, the rest at `debug`. Before, each call logged
    /// one at `error` (a master that answers late: thousands a minute).
    #[test]
    fn overdue_calls_of_one_kind_are_logged_at_their_level_once_a_minute() {
        let stall = Stall::new();
        let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20))));
        faulty.inject_on(
            crate::store::FaultCall::ReadWhole,
            FaultRule::default(),
            Fault::Stall(stall.clone()),
        );
        let calls = StoreCalls::new(faulty);
        let ((), lines) = crate::test_logs::logged(|| {
            for _ in 0..5 {
                let soon = Instant::now() + Duration::from_millis(10);
                let got = calls.read_whole_owned(&["a"], &[8], soon);
                assert!(
                    matches!(got[..], [Err(StoreError::Overdue { .. })]),
                    "{got:?}"
                );
            }
        });
        stall.release();
        assert_eq!(calls.overdue_calls(), 5);
        let overdue = |level| {
            lines
                .iter()
                .filter(|e| e.level == level && e.message.contains("overdue"))
                .count()
        };
        assert_eq!(overdue(tracing::Level::ERROR), 1, "{lines:?}");
        assert_eq!(overdue(tracing::Level::DEBUG), 4, "{lines:?}");
    }

    /// A discard sent past its deadline to a slow store is not waited for, and is no overdue
    /// call: before, it was waited for 1 ms, then counted (and logged) as overdue, a false
    /// alarm in `LinkerMetrics::overdue_calls` on every replace after a peer's bound.
    #[test]
    fn a_discard_past_its_deadline_is_not_an_overdue_call() {
        let stall = Stall::new();
        let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20))));
        put(&*faulty, "bad", &[1u8; 64]);
        faulty.inject(FaultRule::default(), Fault::Stall(stall.clone()));
        let calls = StoreCalls::new(faulty.clone());
        let t0 = Instant::now();
        let got = calls.discard(
            &["bad"],
            t0.checked_sub(Duration::from_millis(5)).unwrap_or(t0),
        );
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert!(
            matches!(got[..], [Err(StoreError::RpcTimeout { .. })]),
            "{got:?}"
        );
        assert_eq!(calls.overdue_calls(), 0);
        // The store still carries it out once it answers.
        stall.release();
        let until = Instant::now() + Duration::from_secs(5);
        while faulty.exists(&["bad"]) != vec![Ok(false)] {
            assert!(Instant::now() < until, "the discard was never carried out");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(calls.overdue_calls(), 0);
    }

    /// A call whose deadline has passed is not sent: a stalled store is never reached (no
    /// worker holds it), and every key fails at once as timed out.
    #[test]
    fn a_call_past_its_deadline_is_not_sent() {
        let stall = Stall::new();
        let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20))));
        faulty.inject(FaultRule::default(), Fault::Stall(stall.clone()));
        let calls = StoreCalls::new(faulty);
        let t0 = Instant::now();
        let passed = t0.checked_sub(Duration::from_millis(1)).unwrap_or(t0);
        let got = calls.read_whole_owned(&["a", "b"], &[8, 8], passed);
        assert!(t0.elapsed() < Duration::from_secs(1));
        assert!(
            got.iter()
                .all(|r| matches!(r, Err(StoreError::RpcTimeout { .. }))),
            "{got:?}"
        );
        assert_eq!(calls.workers(), 0, "nothing went to the store");
        stall.release();
    }

    #[test]
    fn a_whole_read_the_store_gave_up_on_fails_every_key_of_its_call() {
        let inner = Arc::new(EmbeddedStore::new(1 << 20));
        put(inner.as_ref(), "a", &[1; 8]);
        put(inner.as_ref(), "b", &[2; 8]);
        let faulty = Arc::new(FaultyStore::new(inner));
        faulty.inject_on(
            FaultCall::ReadWhole,
            FaultRule {
                key_contains: Some("b".into()),
                ..FaultRule::default()
            },
            Fault::Error(StoreError::Abandoned {
                key: "b".into(),
                call: "get_into",
                detail: "injected".into(),
            }),
        );
        let calls = StoreCalls::new(faulty);
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        let got = calls.read_whole_owned(&["a", "b"], &[8, 8], soon);
        // `a` came whole, but its buffer is kept with `b`'s (the call may still write both):
        // neither is handed out.
        assert!(
            got.iter()
                .all(|r| matches!(r, Err(StoreError::Abandoned { .. }))),
            "{got:?}"
        );
    }

    /// A landing of one batch (plan pages → slots 0, 1) over a fresh host pool, its first
    /// stage open at layer 0.
    fn landing() -> (
        Arc<dyn kv_device::KvPool>,
        kv_device::DirectLanding,
        Vec<LayerStage>,
    ) {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool: Arc<dyn kv_device::KvPool> = Arc::new(HostKvPool::new(g, 2).unwrap());
        let shape = BatchShape::own_only(vec![ComponentId(0)]);
        let mut landing = DirectLanding::new(pool.clone(), vec![0, 1].into(), shape).unwrap();
        let mut stages = landing.take_stages();
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        landing.open(&mut stages[0], 0, soon).unwrap();
        (pool, landing, stages)
    }

    /// What a test of one read into slot 1 of a fresh landing's stage 0 looks at after it.
    struct SlotRead {
        pool: Arc<dyn kv_device::KvPool>,
        landing: DirectLanding,
        stages: Vec<LayerStage>,
        /// What the batch keeps while a call may write its slots (its outcome, in the
        /// linker): the read's loan keeps it.
        batch: Arc<()>,
        faulty: Arc<FaultyStore>,
        calls: StoreCalls,
        /// The slot's bytes.
        len: usize,
    }

    /// Reads key `k` (the slot's bytes, all 9s) into slot 1 of a fresh landing through a
    /// store with `fault` on its reads, waiting `wait` at most: the rig, the read's results
    /// and how long the caller waited.
    fn slot_read(
        fault: Fault,
        wait: Duration,
    ) -> (SlotRead, Vec<Result<u64, StoreError>>, Duration) {
        let (pool, landing, mut stages) = landing();
        let mut loan = landing.lend(&mut stages[0]).unwrap();
        let target = landing.target(&loan, ComponentId(0), 1).unwrap();
        let len = target.len();
        let inner = Arc::new(EmbeddedStore::new(1 << 22));
        put(inner.as_ref(), "k", &vec![9u8; len]);
        let faulty = Arc::new(FaultyStore::new(inner));
        faulty.inject(FaultRule::default(), fault);
        let calls = StoreCalls::new(faulty.clone());
        let batch: Arc<()> = Arc::new(());
        loan.keep(batch.clone());
        let read = TargetRead {
            key: "k",
            ranges: [TargetRange { target, offset: 0 }].into_iter().collect(),
        };
        let t0 = Instant::now();
        let r = calls.read_targets(&[read], vec![loan], 1, kv_loader::deadline_after(wait));
        let rig = SlotRead {
            pool,
            landing,
            stages,
            batch,
            faulty,
            calls,
            len,
        };
        (rig, r, t0.elapsed())
    }

    /// The error of a read's one key (a test failure when it is anything else).
    fn only_error(r: &[Result<u64, StoreError>]) -> &StoreError {
        match r {
            [Err(e)] => e,
            _ => panic!("not one error: {r:?}"),
        }
    }

    #[test]
    fn a_hung_read_fails_at_its_deadline_and_keeps_its_memory_until_it_returns() {
        let stall = Stall::new();
        let (rig, r, waited) = slot_read(Fault::Stall(stall.clone()), Duration::from_millis(50));
        assert!(waited < Duration::from_secs(2));
        let StoreError::Overdue { call, .. } = only_error(&r) else {
            panic!("not overdue: {r:?}")
        };
        assert_eq!(*call, "get_ranges");
        // The hung call still holds the loan: the stage is not the landing's, and the pool
        // stays allocated after the landing is gone.
        assert!(matches!(
            rig.landing.target_bytes(&rig.stages[0], ComponentId(0), 1),
            Err(kv_device::DeviceError::Lent(_))
        ));
        assert_eq!(Arc::strong_count(&rig.batch), 2);
        // Other calls go on meanwhile, on another worker.
        rig.faulty.clear();
        let ok = rig
            .calls
            .exists(&["k"], kv_loader::deadline_after(Duration::from_secs(5)));
        assert_eq!(ok, vec![Ok(true)]);
        assert_eq!(rig.calls.workers(), 2);
        drop(rig.landing);
        assert_eq!(Arc::strong_count(&rig.pool), 2, "the loan keeps the pool");
        stall.release();
        let t0 = Instant::now();
        while Arc::strong_count(&rig.batch) > 1 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the loan was not let go"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(
            Arc::strong_count(&rig.pool),
            1,
            "the loan let go of the pool"
        );
        let mut out = vec![0u8; rig.len];
        // SAFETY: the call has returned and let go of its loan; nothing else writes the slot.
        unsafe { rig.pool.read_slot(ComponentId(0), 0, 1, &mut out) }.unwrap();
        assert!(out.iter().all(|&b| b == 9), "the late call wrote its bytes");
    }

    #[test]
    fn a_call_that_panics_fails_its_keys_at_once_and_its_worker_takes_the_next_call() {
        let inner = Arc::new(EmbeddedStore::new(1 << 20));
        put(inner.as_ref(), "k", b"bytes");
        let faulty = Arc::new(FaultyStore::new(inner));
        faulty.inject_on(FaultCall::Exists, FaultRule::default(), Fault::Panic);
        let calls = StoreCalls::new(faulty.clone());
        let t0 = Instant::now();
        let r = calls.exists(
            &["k", "other"],
            kv_loader::deadline_after(Duration::from_secs(30)),
        );
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "it waited for the deadline"
        );
        let panicked = |key: &str| {
            Err(StoreError::Panicked {
                key: key.into(),
                call: "exists",
            })
        };
        assert_eq!(r, vec![panicked("k"), panicked("other")]);
        assert_eq!(calls.overdue_calls(), 0);
        // The worker lives on: it comes back idle (it counts itself so after answering).
        let t0 = Instant::now();
        while calls.workers.idle_count() == 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the worker did not come back"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(calls.workers(), 1);
        faulty.clear();
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        assert_eq!(calls.exists(&["k"], soon), vec![Ok(true)]);
        assert_eq!(
            calls.workers(),
            1,
            "the worker that saw the panic took the next call"
        );
    }

    #[test]
    fn a_read_that_panics_fails_at_once_and_lets_go_of_its_memory() {
        let (rig, r, waited) = slot_read(Fault::Panic, Duration::from_secs(30));
        assert!(
            waited < Duration::from_secs(10),
            "it waited for the deadline"
        );
        let StoreError::Panicked { call, .. } = only_error(&r) else {
            panic!("not panicked: {r:?}")
        };
        assert_eq!(*call, "get_ranges");
        // The call is over: its loan went back with it, and the batch's hold with the loan.
        assert_eq!(Arc::strong_count(&rig.batch), 1);
        let stage = &rig.stages[0];
        assert!(rig.landing.target_bytes(stage, ComponentId(0), 1).is_ok());
        let pool = rig.pool.clone();
        drop(rig);
        assert_eq!(Arc::strong_count(&pool), 1);
    }

    #[test]
    fn too_many_hung_calls_fail_new_ones_at_once() {
        let workers = Workers::new();
        workers.alive.store(MAX_WORKERS, Ordering::Release);
        assert!(matches!(
            workers.submit(Box::new(|| {})),
            Err(StoreError::Unavailable { .. })
        ));
        workers.alive.store(0, Ordering::Release);
    }

    /// Waits up to 10 s for `workers` to have `n` alive.
    fn until_alive(workers: &Workers, n: usize) {
        let t0 = Instant::now();
        while workers.alive.load(Ordering::Acquire) != n {
            let alive = workers.alive.load(Ordering::Acquire);
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{alive} alive, not {n}"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Before, the workers of a burst of hung calls stayed for the store's life (up to
    /// `MAX_WORKERS` threads): idle ones now end, and a later call starts one again.
    #[test]
    fn idle_workers_end_and_a_later_call_starts_one() {
        let mut workers = Workers::new();
        workers.retire_after = Duration::from_millis(20);
        let go_tx = Arc::new(Mutex::new(()));
        let hold = go_tx.lock();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        for _ in 0..4 {
            let (go, done) = (go_tx.clone(), done_tx.clone());
            workers
                .submit(Box::new(move || {
                    drop(go.lock());
                    let _ = done.send(());
                }))
                .unwrap();
        }
        // Four calls "hung" at once: four workers.
        assert_eq!(workers.alive.load(Ordering::Acquire), 4);
        drop(hold);
        for _ in 0..4 {
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        until_alive(&workers, 0);
        let done = done_tx.clone();
        workers
            .submit(Box::new(move || {
                let _ = done.send(());
            }))
            .unwrap();
        done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        until_alive(&workers, 0);
    }

    /// Under steady traffic the workers a burst left behind still end: the calls go to the
    /// most recently idle worker, and the others' waits run out. Before, idle workers took
    /// calls in turn: sixteen of them, a call every 10 ms and 200 ms to retire, and none ended.
    #[test]
    fn spare_workers_end_under_steady_traffic() {
        let mut workers = Workers::new();
        workers.retire_after = Duration::from_millis(200);
        let gate = Arc::new(Mutex::new(()));
        let held = gate.lock();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        for _ in 0..16 {
            let (gate, done) = (gate.clone(), done_tx.clone());
            workers
                .submit(Box::new(move || {
                    drop(gate.lock());
                    let _ = done.send(());
                }))
                .unwrap();
        }
        assert_eq!(workers.alive.load(Ordering::Acquire), 16);
        drop(held);
        for _ in 0..16 {
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        }
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(1500) {
            let done = done_tx.clone();
            workers
                .submit(Box::new(move || {
                    let _ = done.send(());
                }))
                .unwrap();
            done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        let alive = workers.alive.load(Ordering::Acquire);
        assert!(alive <= 2, "{alive} workers alive under steady traffic");
    }

    /// Workers ending while calls come: no call is left without a worker (each one runs).
    #[test]
    fn workers_ending_never_strand_a_call() {
        let mut workers = Workers::new();
        workers.retire_after = Duration::from_micros(200);
        let (done_tx, done_rx) = mpsc::channel::<u32>();
        for i in 0..2000u32 {
            let done = done_tx.clone();
            workers
                .submit(Box::new(move || {
                    let _ = done.send(i);
                }))
                .unwrap();
            if i % 7 == 0 {
                std::thread::sleep(Duration::from_micros(u64::from(i % 400)));
            }
        }
        let mut got: Vec<u32> = (0..2000)
            .map(|_| done_rx.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        got.sort_unstable();
        assert!(got.iter().copied().eq(0..2000));
        until_alive(&workers, 0);
    }

    /// A call whose caller dropped its `Pending` without waiting is given up: its result goes
    /// to `late` when it comes, not into the slot.
    #[test]
    fn a_dropped_pending_gives_its_call_up_to_late() {
        let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
        let (go_tx, go_rx) = mpsc::channel::<()>();
        let (late_tx, late_rx) = mpsc::channel::<u32>();
        let pending = calls
            .submit(
                "test",
                move |_| {
                    let _ = go_rx.recv_timeout(Duration::from_secs(10));
                    7u32
                },
                move |_, out| {
                    let _ = late_tx.send(out);
                },
            )
            .unwrap();
        drop(pending);
        go_tx.send(()).unwrap();
        assert_eq!(late_rx.recv_timeout(Duration::from_secs(10)), Ok(7));
    }
}
