//! The store's table of Mooncake read sessions, per key.
//!
//! Mooncake's sessions are not reference counted (the client keeps one session per key; a
//! repeated `batch_get_session_start` refreshes it, one `batch_get_session_end` erases it),
//! so the store counts each key's users and ends the client's session only when the last one
//! leaves.
//!
//! Two locks. The table's own is held only to read and change counts, never across a master
//! call. The other, `calls`, is held across every session call to the master (start or end),
//! and taken before the table decides which keys to start or end, so that the master sees a
//! key's starts and ends in the order the table made them. A ranged read whose keys are all
//! in a session joins them under the table's lock alone, without waiting for a master call of
//! other keys (a read session started at lookup, a renewal: 4-5 ms each for a 32K-token
//! GLM-5.2 prefix on the GPU host); only a read that leaves a key with no user takes `calls`,
//! after its transfer, to end that key's session. A key stays in the table, at zero users,
//! until the holder of `calls` ends it; one that gains a user meanwhile is not ended.
//!
//! A wait for `calls` lasts while the store call's caller waits ([`crate::store::caller`]):
//! behind a master call that hangs, each session call would otherwise park its store-call
//! worker for good. A caller that gave up fails its read's keys (`Unavailable`), or leaves an
//! end's keys due, ended when the holder lets go. A removal's forgetting of replicas takes
//! no `calls` at all: a start that overlapped it does not record its renewal.
//!
//! An explicit session is named by a token the table hands out; ending it takes the users
//! that session added and nothing else, once: a session ended twice, or one not started here,
//! ends nothing (another holder's count of the same key stays).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mooncake_sys::Client;
use parking_lot::Mutex;
use tracing::{debug, info, warn};

use super::store::{code_error, split_valid, store_error, store_error_logged};
use crate::log_every::LogEvery;
use crate::store::caller::lock_while_awaited;
use crate::store::StoreError;

/// The error of a session call whose caller gave up while it waited for another thread's
/// master call (which may hang) to let the table go.
fn gave_up_waiting(key: &str) -> StoreError {
    StoreError::Unavailable {
        detail: format!(
            "{key}: the caller gave up while another read-session call to the master held the \
             table"
        )
        .into(),
    }
}

/// Read-session bookkeeping of one key.
#[derive(Debug, Default)]
struct KeySession {
    /// Explicit starts (`KvStore::start_session`) of the key not yet matched by an end
    /// (several linkers, or a renewal overlapping the session it renews).
    explicit: usize,
    /// Ranged reads in flight that opened (or joined) the session.
    implicit: usize,
    /// When the master last started (or renewed) the key's session.
    renewed: Option<Instant>,
}

impl KeySession {
    fn unused(&self) -> bool {
        self.explicit == 0 && self.implicit == 0
    }
}

/// The master's session calls, as the table makes them (a Mooncake client's; a test's fake).
pub(super) trait SessionCalls {
    /// Starts the session of each of `keys` (one master call); per key, whether it did.
    fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>>;
    /// Ends the session of each of `keys` (one master call).
    fn end(&self, keys: &[&str]) -> Result<(), StoreError>;
}

impl SessionCalls for Client {
    fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        start_sessions(self, keys)
    }

    fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
        match keys.first() {
            None => Ok(()),
            Some(first) => self
                .batch_get_session_end(keys)
                .map_err(|e| store_error(first, &e)),
        }
    }
}

/// One ranged read's join (see [`SessionTable::join`]): per distinct key, whether it is in a
/// session now; the keys that are, left when this drops: on every path of the read, a panic
/// inside it (or inside the join's own master call) too, so that no key's session is kept
/// alive by a read that is over.
pub(super) struct JoinedKeys<'t, C: SessionCalls + ?Sized> {
    table: &'t SessionTable,
    client: &'t C,
    /// Per key joined so far: whether it is in a session now (`Ok`: this read is one of its
    /// users, and leaves it on drop). Every distinct key has one once the join returned.
    results: HashMap<String, Result<(), StoreError>>,
}

impl<C: SessionCalls + ?Sized> JoinedKeys<'_, C> {
    /// Whether `key` is in a session now (`None`: not a key of the join).
    pub(super) fn result(&self, key: &str) -> Option<&Result<(), StoreError>> {
        self.results.get(key)
    }

    /// The keys in a session now (this read's to leave).
    fn users(&self) -> impl Iterator<Item = &str> {
        self.results
            .iter()
            .filter(|(_, r)| r.is_ok())
            .map(|(k, _)| k.as_str())
    }
}

impl<C: SessionCalls + ?Sized> Drop for JoinedKeys<'_, C> {
    fn drop(&mut self) {
        self.table.leave(self.client, self.users());
    }
}

/// Which keys are in a client read session, and who uses them (see the module docs).
///
/// A key's session lives for the master's read lease after its last start. A read joins a
/// key without asking the master only while the key was (re)started within half the lease;
/// an older one is started again first (the master's answer to a read under a lapsed session
/// is `LEASE_EXPIRED`). An explicit session whose owner never ended it (its end was given up
/// at a deadline) is dropped once twice the lease has passed: it has lapsed at the master.
#[derive(Debug)]
pub(super) struct SessionTable {
    keys: Mutex<HashMap<String, KeySession>>,
    /// Held across every session call to the master.
    calls: Mutex<()>,
    /// Keys a leaving read found unused while another thread's master call held `calls`, and
    /// those of an end whose caller gave up waiting for it: their sessions are ended by
    /// whoever takes `calls` next, or when that call lets go (see [`end_due`](Self::end_due)),
    /// so that a read that is done never waits on a master call of another read.
    ends_due: Mutex<Vec<String>>,
    /// The explicit sessions open, by token: when each started, and the keys it added a
    /// user to.
    open: Mutex<HashMap<u64, (Instant, Vec<String>)>>,
    /// Removals whose replicas [`forget_replicas`](Self::forget_replicas) forgot so far
    /// (changed under `keys`' lock): a start that overlapped one does not record its renewal.
    forgets: AtomicU64,
    /// The "sessions forgotten" line at `info` lately (once a minute).
    forget_log: LogEvery,
    /// The last token handed out (tokens start at 1; 0 names no session of this table).
    last_token: AtomicU64,
    /// The master's read lease.
    lease: Duration,
}

impl Default for SessionTable {
    fn default() -> Self {
        SessionTable::with_lease(super::config::DEFAULT_LEASE)
    }
}

impl SessionTable {
    /// A table for a master whose read lease is `lease`.
    pub(super) fn with_lease(lease: Duration) -> Self {
        SessionTable {
            keys: Mutex::default(),
            calls: Mutex::default(),
            ends_due: Mutex::default(),
            open: Mutex::default(),
            forgets: AtomicU64::new(0),
            forget_log: LogEvery::new(),
            last_token: AtomicU64::new(0),
            lease,
        }
    }

    /// True when `s`'s session was (re)started less than `age` ago.
    fn renewed_within(s: &KeySession, now: Instant, age: Duration) -> bool {
        s.renewed
            .is_some_and(|at| now.saturating_duration_since(at) < age)
    }

    /// True when `s`'s session may be joined without the master: started within half the
    /// lease.
    fn fresh(&self, s: &KeySession, now: Instant) -> bool {
        Self::renewed_within(s, now, self.lease / 2)
    }

    /// Opens (or joins) sessions for `keys` for one ranged read: per distinct key, whether it
    /// is in a session now; the read leaves the keys that are when the returned join drops.
    pub(super) fn join<'t, C: SessionCalls + ?Sized>(
        &'t self,
        client: &'t C,
        keys: &[&str],
    ) -> JoinedKeys<'t, C> {
        let joined = self.join_keys(client, keys);
        self.end_due(client);
        joined
    }

    /// [`join`](Self::join), but for the ends due.
    fn join_keys<'t, C: SessionCalls + ?Sized>(
        &'t self,
        client: &'t C,
        keys: &[&str],
    ) -> JoinedKeys<'t, C> {
        let distinct: Vec<&str> = {
            let mut seen = HashSet::with_capacity(keys.len());
            keys.iter().copied().filter(|k| seen.insert(*k)).collect()
        };
        fn in_session<'k>(
            keys: impl Iterator<Item = &'k &'k str>,
        ) -> HashMap<String, Result<(), StoreError>> {
            keys.map(|k| ((*k).to_owned(), Ok(()))).collect()
        }
        let mut joined = JoinedKeys {
            table: self,
            client,
            results: HashMap::new(),
        };
        // Every key in a session already: no master call, no wait for one.
        if self.join_present(&distinct, true).is_empty() {
            joined.results = in_session(distinct.iter());
            return joined;
        }
        let Some(_calls) = lock_while_awaited(&self.calls) else {
            // The read's caller gave up while another master call held `calls` (maybe hung).
            joined.results = distinct
                .iter()
                .map(|k| ((*k).to_owned(), Err(gave_up_waiting(k))))
                .collect();
            return joined;
        };
        let to_start = self.join_present(&distinct, false);
        // The keys joined so far count this read as a user from here on: left on drop, also
        // when the master call below unwinds.
        let absent: HashSet<&str> = to_start.iter().copied().collect();
        joined.results = in_session(distinct.iter().filter(|k| !absent.contains(*k)));
        if to_start.is_empty() {
            return joined;
        }
        // A start that panics after the master opened some of its keys leaves those sessions
        // out of the table: the master's lease ends them.
        // The lease may begin anywhere inside the call: counted from its start, so that a
        // slow start does not let later reads join a session whose lease already ran out.
        let forgets = self.forgets.load(Ordering::Acquire);
        let asked = Instant::now();
        let started = client.start(&to_start);
        let mut table = self.keys.lock();
        let renewed = self.renewal(forgets, asked);
        if started
            .iter()
            .any(|r| r.as_ref().is_err_and(master_unreachable))
        {
            self.forget_all_in(&mut table);
        }
        for (k, r) in to_start.iter().zip(started) {
            match &r {
                Ok(()) => {
                    let s = table.entry((*k).to_owned()).or_default();
                    s.implicit += 1;
                    s.renewed = renewed.or(s.renewed);
                }
                // Mooncake's client erases a key's session when its start fails (whatever
                // the reason: the master unreachable too), and a ranged read of a key with no
                // session fails (`INVALID_PARAMS`): the read fails with the start's error, and
                // no later read joins the key without starting it again.
                Err(_) => lapse(&mut table, k),
            }
            joined.results.insert((*k).to_owned(), r);
        }
        drop(table);
        joined
    }

    /// Forgets where `keys`' sessions were resolved (their objects were removed: the replicas
    /// the master named may be given to new puts): the next read of each asks the master
    /// again instead of joining the old session. Reads and starts holding them keep them.
    /// Never waits for a master call: a start asked of the master before the removal does
    /// not write its (older) renewal back after this ([`renewal`](Self::renewal)). Only this
    /// store's table hears of it: another process's sessions of the key lapse with their
    /// lease. Then ends the sessions left due meanwhile ([`end_due`](Self::end_due)).
    pub(super) fn forget_replicas(&self, client: &(impl SessionCalls + ?Sized), keys: &[&str]) {
        {
            let mut table = self.keys.lock();
            self.forgets.fetch_add(1, Ordering::AcqRel);
            for k in keys {
                if let Some(s) = table.get_mut(*k) {
                    s.renewed = None;
                }
            }
        }
        self.end_due(client);
    }

    /// Forgets every key's start (as [`forget_replicas`](Self::forget_replicas) does for some):
    /// after the master was unreachable. A master that restarts comes back empty, and the
    /// client remounts its segment afresh: a new put may take the space an old object's
    /// session still names, and the client's ranged read under that session (no master call)
    /// returns the new object's bytes as the old one's (measured against the pinned wheel).
    /// The next read of each key asks the master, which no longer knows a lost object.
    /// Every session start that finds the master unreachable calls it, whatever store call
    /// made it (a ranged read's join, a pin).
    pub(super) fn forget_all(&self) {
        self.forget_all_in(&mut self.keys.lock());
    }

    /// [`forget_all`](Self::forget_all) with the table's lock held.
    fn forget_all_in(&self, table: &mut HashMap<String, KeySession>) {
        self.forgets.fetch_add(1, Ordering::AcqRel);
        for s in table.values_mut() {
            s.renewed = None;
        }
        // Every call that finds the master unreachable comes here: one line a minute.
        match self.forget_log.due_after("forget all") {
            Some(since) => info!(
                keys = table.len(),
                times_since_last_line = since,
                "the Mooncake master was unreachable: every key's read session is started \
                 again before its next read (a restarted master has lost its objects; their \
                 reads then fail as not found)"
            ),
            None => debug!(
                keys = table.len(),
                "read sessions forgotten: the master was unreachable"
            ),
        }
    }

    /// Marks `keys`' sessions as not open at the client any more (a ranged read of them came
    /// back `LEASE_EXPIRED`: the client erased the session): the next read of each starts it
    /// again instead of joining it.
    pub(super) fn lapsed(&self, keys: &[&str]) {
        let mut table = self.keys.lock();
        for k in keys {
            lapse(&mut table, k);
        }
    }

    /// When a start asked at `asked` renewed its keys' sessions, to record under the table's
    /// lock: `None` (keep what the table has) when a removal forgot replicas since `forgets`
    /// was read, before the start was asked. Which keys it forgot is not looked at: a start
    /// that overlapped any removal leaves the next read of its keys to ask the master again
    /// (one master call, 4-5 ms, on the rare read after a removal).
    fn renewal(&self, forgets: u64, asked: Instant) -> Option<Instant> {
        (self.forgets.load(Ordering::Acquire) == forgets).then_some(asked)
    }

    /// Joins the keys of `keys` in a fresh session now; returns the others (absent, or
    /// started too long ago: to start again). With `all_or_none`, joins none unless every key
    /// is in one.
    fn join_present<'k>(&self, keys: &[&'k str], all_or_none: bool) -> Vec<&'k str> {
        let now = Instant::now();
        let mut table = self.keys.lock();
        let absent: Vec<&str> = keys
            .iter()
            .copied()
            .filter(|k| !table.get(*k).is_some_and(|s| self.fresh(s, now)))
            .collect();
        if all_or_none && !absent.is_empty() {
            return absent;
        }
        for k in keys {
            if let Some(s) = table.get_mut(*k) {
                if self.fresh(s, now) {
                    s.implicit += 1;
                }
            }
        }
        absent
    }

    /// Undoes [`join`](Self::join) for the keys it put in a session.
    ///
    /// Never waits for another thread's master call: while one holds `calls`, the keys left
    /// unused are ended when it lets go (a read that is done was held for the whole of a slow
    /// session start on other keys, and could be reported overdue).
    pub(super) fn leave<'a>(
        &self,
        client: &(impl SessionCalls + ?Sized),
        keys: impl Iterator<Item = &'a str>,
    ) {
        let keys: Vec<&str> = keys.collect();
        if !self.drop_users(&keys, |s| &mut s.implicit) {
            return;
        }
        self.ends_due
            .lock()
            .extend(keys.iter().map(|k| (*k).to_owned()));
        self.end_due(client);
    }

    /// Ends the sessions of the keys due to end ([`leave`](Self::leave)) that are still
    /// unused, unless another thread holds `calls` (it ends them when it lets go). Called
    /// after every use of `calls` that has a client, so a key due is ended by the last of
    /// the threads racing for it.
    fn end_due(&self, client: &(impl SessionCalls + ?Sized)) {
        loop {
            let Some(calls) = self.calls.try_lock() else {
                return;
            };
            let due = std::mem::take(&mut *self.ends_due.lock());
            if due.is_empty() {
                // A key made due after the take, by a thread that found `calls` held (by
                // this one), counts on this one: looked at again once `calls` is let go.
                drop(calls);
                if self.ends_due.lock().is_empty() {
                    return;
                }
                continue;
            }
            let keys: Vec<&str> = due.iter().map(String::as_str).collect();
            if let Err(e) = self.end_unused_held(client, &keys, calls) {
                warn!(error = %e, "mooncake: ending read sessions failed");
            }
        }
    }

    /// An explicit session over `keys`: always asks the master (a repeated start renews the
    /// lease). On failure, what this call opened is ended again and what was open before
    /// kept. On success, the session's token, for [`end`](Self::end).
    pub(super) fn start(
        &self,
        client: &(impl SessionCalls + ?Sized),
        keys: &[&str],
    ) -> Result<u64, StoreError> {
        let started = self.start_keys(client, keys);
        self.end_due(client);
        started
    }

    /// [`start`](Self::start), but for the ends due.
    fn start_keys(
        &self,
        client: &(impl SessionCalls + ?Sized),
        keys: &[&str],
    ) -> Result<u64, StoreError> {
        self.drop_lapsed(client);
        let Some(_calls) = lock_while_awaited(&self.calls) else {
            return Err(gave_up_waiting(keys.first().copied().unwrap_or_default()));
        };
        let forgets = self.forgets.load(Ordering::Acquire);
        // Counted from the call's start, as above.
        let asked = Instant::now();
        let results = client.start(keys);
        if let Some(first) = results.iter().find_map(|r| r.as_ref().err()) {
            // No key enters or leaves the table without `calls`: what is absent now was
            // opened by this call. The client erased the session of each key that failed
            // (see `join_keys`).
            let opened: Vec<&str> = {
                let mut table = self.keys.lock();
                if results
                    .iter()
                    .any(|r| r.as_ref().is_err_and(master_unreachable))
                {
                    self.forget_all_in(&mut table);
                }
                for (k, _) in keys.iter().zip(&results).filter(|(_, r)| r.is_err()) {
                    lapse(&mut table, k);
                }
                keys.iter()
                    .zip(&results)
                    .filter(|(k, r)| r.is_ok() && !table.contains_key(**k))
                    .map(|(k, _)| *k)
                    .collect()
            };
            if !opened.is_empty() {
                if let Err(e) = client.end(&opened) {
                    warn!(error = %e, "mooncake: undoing a partial read session failed");
                }
            }
            return Err(first.clone());
        }
        {
            let mut table = self.keys.lock();
            let renewed = self.renewal(forgets, asked);
            for k in keys {
                let s = table.entry((*k).to_owned()).or_default();
                s.explicit += 1;
                s.renewed = renewed.or(s.renewed);
            }
        }
        let token = self.last_token.fetch_add(1, Ordering::Relaxed) + 1;
        let owned = keys.iter().map(|k| (*k).to_owned()).collect();
        self.open.lock().insert(token, (asked, owned));
        Ok(token)
    }

    /// Drops the explicit sessions started more than twice the lease ago and never ended
    /// (their owner gave their end up at a deadline, or died): they have lapsed at the master,
    /// and left here they would keep their keys in the table for good. Their keys' users go,
    /// and the client's session of each key left unused is ended.
    fn drop_lapsed(&self, client: &(impl SessionCalls + ?Sized)) {
        let horizon = self.lease.saturating_mul(2);
        let mut lapsed: Vec<(u64, Vec<String>)> = Vec::new();
        self.open.lock().retain(|&token, (at, keys)| {
            let keep = at.elapsed() <= horizon;
            if !keep {
                lapsed.push((token, std::mem::take(keys)));
            }
            keep
        });
        for (token, owned) in lapsed {
            warn!(
                token,
                keys = owned.len(),
                "mooncake: a read session never ended outlived twice the lease; dropped"
            );
            let keys: Vec<&str> = owned.iter().map(String::as_str).collect();
            if self.drop_users(&keys, |s| &mut s.explicit) {
                if let Err(e) = self.end_unused(client, &keys) {
                    warn!(error = %e, "mooncake: ending lapsed read sessions failed");
                }
            }
        }
    }

    /// Ends the explicit session `token`: one user off each key it started, and the client's
    /// session of each key its last user leaves is ended. A session ended before, or not
    /// started here, ends nothing.
    pub(super) fn end(
        &self,
        client: &(impl SessionCalls + ?Sized),
        token: u64,
    ) -> Result<(), StoreError> {
        let Some((_, owned)) = self.open.lock().remove(&token) else {
            tracing::debug!(token, "mooncake: a read session ended that is not open");
            return Ok(());
        };
        let keys: Vec<&str> = owned.iter().map(String::as_str).collect();
        if !self.drop_users(&keys, |s| &mut s.explicit) {
            return Ok(());
        }
        self.end_unused(client, &keys)
    }

    /// Takes one user off each of `keys` (`users` picks which count); true if that left any
    /// of them unused.
    fn drop_users(&self, keys: &[&str], users: fn(&mut KeySession) -> &mut usize) -> bool {
        let mut table = self.keys.lock();
        keys.iter().fold(false, |any, k| match table.get_mut(*k) {
            Some(s) => {
                let n = users(s);
                *n = n.saturating_sub(1);
                any | s.unused()
            }
            None => any,
        })
    }

    /// Ends the client's session of each of `keys` with no user left (one that gained a user
    /// since stays). When the caller gives up while another master call holds `calls`, the
    /// keys are left due, ended by that call's thread when it lets go (as a leaving read's).
    fn end_unused(
        &self,
        client: &(impl SessionCalls + ?Sized),
        keys: &[&str],
    ) -> Result<(), StoreError> {
        let ended = match lock_while_awaited(&self.calls) {
            Some(calls) => self.end_unused_held(client, keys, calls),
            None => {
                self.ends_due
                    .lock()
                    .extend(keys.iter().map(|k| (*k).to_owned()));
                Err(StoreError::Unavailable {
                    detail: format!(
                        "{}: the caller gave up while another read-session call to the master \
                         held the table; the sessions end when that call returns",
                        keys.first().copied().unwrap_or_default()
                    )
                    .into(),
                })
            }
        };
        self.end_due(client);
        ended
    }

    /// [`end_unused`](Self::end_unused) with `calls` held (`_calls`, let go at the end).
    fn end_unused_held(
        &self,
        client: &(impl SessionCalls + ?Sized),
        keys: &[&str],
        _calls: parking_lot::MutexGuard<'_, ()>,
    ) -> Result<(), StoreError> {
        let mut to_end: Vec<&str> = Vec::new();
        {
            let mut table = self.keys.lock();
            for &k in keys {
                if table.get(k).is_some_and(KeySession::unused) {
                    table.remove(k);
                    to_end.push(k);
                }
            }
        }
        client.end(&to_end)
    }
}

/// Starts the client's session of each of `keys` (one master call); per key, whether it did.
fn start_sessions(client: &Client, keys: &[&str]) -> Vec<Result<(), StoreError>> {
    let (valid, mut out) = split_valid(keys);
    if valid.is_empty() {
        return out.into_iter().map(|r| r.map(|_| ())).collect();
    }
    let names: Vec<&str> = valid.iter().map(|&i| keys[i]).collect();
    match client.batch_get_session_start(&names) {
        Ok(results) => {
            for (&i, r) in valid.iter().zip(results) {
                out[i] = r.map_err(|c| code_error(keys[i], c));
            }
        }
        Err(e) => {
            // One line for the call, not one per key.
            for (n, &i) in valid.iter().enumerate() {
                out[i] = Err(store_error_logged(keys[i], &e, n == 0));
            }
        }
    }
    out
}

/// The master did not answer (a restart among the causes: see
/// [`SessionTable::forget_all`]).
pub(super) fn master_unreachable(e: &StoreError) -> bool {
    matches!(
        e.failure(),
        kv_loader::StoreFailure::Unavailable | kv_loader::StoreFailure::RpcTimeout
    )
}

/// Forgets when `key`'s session was started, if the table has it: the next read starts it.
fn lapse(table: &mut HashMap<String, KeySession>, key: &str) {
    if let Some(s) = table.get_mut(key) {
        s.renewed = None;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    /// A master's sessions: which keys are in one. Each call takes a little while, and its
    /// effect lands at its end (as an RPC's at the master); every seventh start fails for
    /// `k0` (that key's session is then left as it was).
    #[derive(Default)]
    struct FakeMaster {
        open: MasterSessions,
        starts: AtomicU64,
    }

    impl FakeMaster {
        fn in_session(&self, key: &str) -> bool {
            self.open.has(key)
        }
    }

    fn pause(seed: u64) {
        std::thread::sleep(Duration::from_micros(seed % 150));
    }

    impl SessionCalls for FakeMaster {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            let n = self.starts.fetch_add(1, Ordering::Relaxed);
            pause(n * 37);
            self.open.start(keys, |k| k == "k0" && n % 7 == 6)
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            pause(keys.len() as u64 * 53);
            self.open.end(keys)
        }
    }

    /// Which keys a fake master has in a session.
    #[derive(Default)]
    struct MasterSessions(Mutex<HashMap<String, bool>>);

    impl MasterSessions {
        fn has(&self, key: &str) -> bool {
            self.0.lock().get(key).copied().unwrap_or(false)
        }

        /// Starts `keys`' sessions, failing the keys `fails` names (left as they were).
        fn start(
            &self,
            keys: &[&str],
            fails: impl Fn(&str) -> bool,
        ) -> Vec<Result<(), StoreError>> {
            let mut open = self.0.lock();
            keys.iter()
                .map(|k| {
                    if fails(k) {
                        return Err(StoreError::Unavailable {
                            detail: "injected".into(),
                        });
                    }
                    open.insert((*k).to_owned(), true);
                    Ok(())
                })
                .collect()
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            let mut open = self.0.lock();
            for k in keys {
                open.insert((*k).to_owned(), false);
            }
            Ok(())
        }
    }

    /// A master whose starts answer as `answer` says, counting them.
    struct CountingMaster {
        starts: AtomicU64,
        answer: Mutex<Option<StoreError>>,
    }

    impl SessionCalls for CountingMaster {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            self.starts.fetch_add(1, Ordering::Relaxed);
            let answer = self.answer.lock().clone();
            keys.iter()
                .map(|_| answer.clone().map_or(Ok(()), Err))
                .collect()
        }

        fn end(&self, _: &[&str]) -> Result<(), StoreError> {
            Ok(())
        }
    }

    fn counting() -> CountingMaster {
        CountingMaster {
            starts: AtomicU64::new(0),
            answer: Mutex::new(None),
        }
    }

    /// Before, a key whose object was removed (discarded as bad) was still joined in its old
    /// session for half the lease, with no master call: the read went to the replica the
    /// master may have given to a new put. Once its replicas are forgotten, the next read asks
    /// the master again.
    #[test]
    fn a_key_whose_replicas_are_forgotten_is_asked_of_the_master_again() {
        let master = counting();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let held = table.join(&master, &["k"]);
        drop(table.join(&master, &["k"]));
        assert_eq!(
            master.starts.load(Ordering::Relaxed),
            1,
            "joined while fresh"
        );
        table.forget_replicas(&master, &["k"]);
        let again = table.join(&master, &["k"]);
        assert_eq!(master.starts.load(Ordering::Relaxed), 2, "asked again");
        assert!(matches!(again.result("k"), Some(Ok(()))));
        drop((held, again));
    }

    /// After the master was unreachable (it may have restarted empty) no key's session is
    /// joined without the master: every next read starts its keys again.
    #[test]
    fn every_key_is_asked_of_the_master_again_after_it_was_unreachable() {
        let master = counting();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let held = table.join(&master, &["a", "b"]);
        drop(table.join(&master, &["a", "b"]));
        assert_eq!(
            master.starts.load(Ordering::Relaxed),
            1,
            "joined while fresh"
        );
        // Said once a minute at `info` (every call in an outage forgets), `debug` between.
        let ((), lines) = crate::test_logs::logged(|| {
            table.forget_all();
            table.forget_all();
        });
        let infos: Vec<_> = lines
            .iter()
            .filter(|l| l.level == tracing::Level::INFO)
            .collect();
        assert_eq!(infos.len(), 1, "{lines:?}");
        assert!(infos[0].fields.contains("keys=2"), "{infos:?}");
        let again = table.join(&master, &["a", "b"]);
        assert_eq!(master.starts.load(Ordering::Relaxed), 2, "asked again");
        assert!(matches!(again.result("b"), Some(Ok(()))));
        drop((held, again));
    }

    /// A read's own session start that finds the master unreachable (the most frequent
    /// master call) forgets every key's start too, not only its own keys'.
    #[test]
    fn a_join_that_finds_the_master_unreachable_forgets_every_key() {
        let master = counting();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let held = table.join(&master, &["a"]);
        *master.answer.lock() = Some(StoreError::Unavailable {
            detail: "injected".into(),
        });
        let failed = table.join(&master, &["b"]);
        assert!(matches!(
            failed.result("b"),
            Some(Err(StoreError::Unavailable { .. }))
        ));
        *master.answer.lock() = None;
        drop(table.join(&master, &["a"]));
        assert_eq!(master.starts.load(Ordering::Relaxed), 3, "`a` asked again");
        drop((held, failed));
    }

    /// A read that leaves while another thread holds `calls` leaves its keys due to end, for
    /// that thread to end when it lets go; a removal's forgetting ends them too (before, it
    /// ended none: the session stayed open with no user until a later session call or its
    /// lease, and kept the object pinned against the removal itself).
    #[test]
    fn keys_left_while_another_master_call_holds_calls_are_ended_after_it() {
        let master = FakeMaster::default();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let joined = table.join(&master, &["k"]);
        assert!(master.in_session("k"));
        {
            // As another thread's master call holds it while the read leaves.
            let _calls = table.calls.lock();
            drop(joined);
        }
        assert!(
            master.in_session("k"),
            "left due: not ended while `calls` was held"
        );
        table.forget_replicas(&master, &["other"]);
        assert!(!master.in_session("k"), "ended once the forgetting let go");
    }

    /// Before, a failed renewal of a session with a quarter of its lease left let the read go
    /// ahead under the old one when the failure could pass (the master slow or unreachable).
    /// Mooncake's client erases a key's session when its start fails, whatever the reason, so
    /// such a read failed `INVALID_PARAMS` at the client: every failed renewal fails the read
    /// with its own error now, and the next read starts the key again.
    #[test]
    fn a_failed_renewal_fails_the_read_whatever_the_reason() {
        let master = counting();
        let table = SessionTable::with_lease(Duration::from_secs(6));
        let first = table.join(&master, &["k"]);
        // Past half the lease (a renewal is asked), within three quarters (where the read
        // went ahead before), with more than a second of room either way.
        std::thread::sleep(Duration::from_millis(3300));
        *master.answer.lock() = Some(StoreError::Unavailable {
            detail: "injected".into(),
        });
        let passing = table.join(&master, &["k"]);
        assert!(
            matches!(
                passing.result("k"),
                Some(Err(StoreError::Unavailable { .. }))
            ),
            "{:?}",
            passing.result("k")
        );
        *master.answer.lock() = Some(StoreError::NotFound { key: "k".into() });
        let gone = table.join(&master, &["k"]);
        assert!(
            matches!(gone.result("k"), Some(Err(StoreError::NotFound { .. }))),
            "{:?}",
            gone.result("k")
        );
        drop((first, passing, gone));
    }

    /// Before, a key whose explicit start failed (the client erased its session) was still
    /// joined without the master by the next read for the rest of half the lease (a read
    /// of it then failed at the client); so was a key whose read came back `LEASE_EXPIRED`.
    #[test]
    fn a_key_whose_session_the_client_erased_is_started_again_by_the_next_read() {
        let master = counting();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let held = table.join(&master, &["k"]);
        *master.answer.lock() = Some(StoreError::RpcTimeout { key: "k".into() });
        assert!(table.start(&master, &["k"]).is_err());
        *master.answer.lock() = None;
        let after_start = table.join(&master, &["k"]);
        assert_eq!(master.starts.load(Ordering::Relaxed), 3, "asked again");
        assert!(matches!(after_start.result("k"), Some(Ok(()))));
        drop(table.join(&master, &["k"]));
        assert_eq!(
            master.starts.load(Ordering::Relaxed),
            3,
            "fresh again: joined"
        );
        table.lapsed(&["k"]);
        drop(table.join(&master, &["k"]));
        assert_eq!(
            master.starts.load(Ordering::Relaxed),
            4,
            "lapsed: asked again"
        );
        drop((held, after_start));
    }

    /// Stress: threads join and leave (ranged reads) and start and end (explicit sessions)
    /// overlapping keys at once, with master calls that overlap in time, removals forgetting
    /// replicas, and calls whose caller has given up (they stop waiting for `calls`: a join
    /// fails, an end leaves its keys due). Whoever holds a key finds it in a session at the
    /// master; at the end the table is empty and every session ended.
    #[test]
    fn a_key_held_is_always_in_a_session_at_the_master() {
        use crate::store::caller::testing::TestCaller;
        use crate::store::caller::Awaited;
        let master = FakeMaster::default();
        let table = SessionTable::default();
        let keys: Vec<String> = (0..6).map(|i| format!("k{i}")).collect();
        let gone = Arc::new(TestCaller::default());
        gone.give_up();
        let waiting = Arc::new(TestCaller::default());
        let gave_up = AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (master, table, keys, gave_up) = (&master, &table, &keys, &gave_up);
                let callers = [waiting.clone(), gone.clone()];
                s.spawn(move || {
                    let mut x = t * 7919 + 1;
                    for i in 0..300u64 {
                        // One call in four (on odd threads) for a caller that gave up.
                        let caller = &callers[usize::from(t % 2 == 1 && (x >> 12) % 4 == 0)];
                        let _scope = crate::store::caller::enter(caller.clone());
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let held: Vec<&str> = keys
                            .iter()
                            .enumerate()
                            .filter(|(j, _)| (x >> j) & 1 == 1)
                            .map(|(_, k)| k.as_str())
                            .collect();
                        let check = |held: &[&str]| {
                            for k in held {
                                assert!(master.in_session(k), "thread {t}, step {i}: {k} held");
                            }
                        };
                        if (x >> 10) % 11 == 0 {
                            table.forget_replicas(master, &held);
                        } else if (x >> 8) % 3 == 0 {
                            if let Ok(token) = table.start(master, &held) {
                                check(&held);
                                pause(x);
                                check(&held);
                                match table.end(master, token) {
                                    Ok(()) => {}
                                    // Left due, for the holder of `calls` to end.
                                    Err(StoreError::Unavailable { .. }) if caller.given_up() => {
                                        gave_up.fetch_add(1, Ordering::Relaxed);
                                    }
                                    Err(e) => panic!("thread {t}, step {i}: {e}"),
                                }
                            }
                        } else {
                            let joined = table.join(master, &held);
                            if held.iter().any(|k| {
                                matches!(
                                    joined.result(k),
                                    Some(Err(StoreError::Unavailable { .. }))
                                )
                            }) && caller.given_up()
                            {
                                gave_up.fetch_add(1, Ordering::Relaxed);
                            }
                            let ok: Vec<&str> = joined.users().collect();
                            check(&ok);
                            pause(x);
                            check(&ok);
                        }
                    }
                });
            }
        });
        assert!(table.keys.lock().is_empty());
        for k in &keys {
            assert!(!master.in_session(k), "{k} left in a session");
        }
        assert!(master.starts.load(Ordering::Relaxed) > 100);
        assert!(
            gave_up.load(Ordering::Relaxed) > 0,
            "no call's caller gave up while another held `calls`: the path went untested"
        );
    }

    /// A master whose start fails for `bad`, panics for `panics` (a defect in the client
    /// library under it) and, for `slow`, tells `entered` and then waits (at most 5 s) for
    /// `release` before it answers.
    struct ScriptedMaster {
        open: MasterSessions,
        entered: Mutex<Option<std::sync::mpsc::Sender<()>>>,
        release: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
    }

    impl ScriptedMaster {
        fn new() -> Self {
            ScriptedMaster {
                open: MasterSessions::default(),
                entered: Mutex::new(None),
                release: Mutex::new(None),
            }
        }

        fn in_session(&self, key: &str) -> bool {
            self.open.has(key)
        }
    }

    impl SessionCalls for ScriptedMaster {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            if keys.contains(&"panics") {
                panic!("the session start panics");
            }
            if keys.contains(&"slow") {
                if let Some(tx) = self.entered.lock().take() {
                    let _ = tx.send(());
                }
                if let Some(rx) = self.release.lock().take() {
                    let _ = rx.recv_timeout(Duration::from_secs(5));
                }
            }
            self.open.start(keys, |k| k == "bad")
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            self.open.end(keys)
        }
    }

    /// An explicit start that fails for one key ends again what it opened, and keeps what was
    /// open before it.
    #[test]
    fn a_failed_start_ends_what_it_opened_and_keeps_what_was_open() {
        let master = ScriptedMaster::new();
        let table = SessionTable::default();
        let before = table.start(&master, &["before"]).unwrap();
        let err = table.start(&master, &["new", "before", "bad"]);
        assert!(
            matches!(err, Err(StoreError::Unavailable { .. })),
            "{err:?}"
        );
        assert!(
            !master.in_session("new"),
            "the failed start left `new` open"
        );
        assert!(
            master.in_session("before"),
            "the failed start ended `before`"
        );
        {
            let t = table.keys.lock();
            assert!(!t.contains_key("new"));
            assert_eq!(t.get("before").map(|s| s.explicit), Some(1));
        }
        table.end(&master, before).unwrap();
        assert!(!master.in_session("before"));
        assert!(table.keys.lock().is_empty());
    }

    #[test]
    fn a_read_that_panics_still_leaves_its_keys_and_their_sessions_end() {
        let master = FakeMaster::default();
        let table = SessionTable::default();
        // "kept" is in an explicit session too: leaving it must not end that one.
        let kept = table.start(&master, &["kept"]).unwrap();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _joined = table.join(&master, &["a", "b", "kept"]);
            assert!(master.in_session("a") && master.in_session("b"));
            panic!("the read fails inside");
        }));
        assert!(panicked.is_err());
        assert!(!master.in_session("a") && !master.in_session("b"));
        assert!(
            master.in_session("kept"),
            "the explicit session still holds it"
        );
        // The next read of "a" starts its session again (the table did not think it open).
        let joined = table.join(&master, &["a"]);
        assert!(joined.result("a").is_some_and(Result::is_ok) && master.in_session("a"));
        drop(joined);
        assert!(!master.in_session("a"));
        table.end(&master, kept).unwrap();
        assert!(table.keys.lock().is_empty());
    }

    #[test]
    fn a_join_whose_master_call_panics_leaves_the_keys_it_had_joined() {
        let master = ScriptedMaster::new();
        let table = SessionTable::default();
        // Another read holds "a" in a session.
        let other = table.join(&master, &["a"]);
        assert!(master.in_session("a"));
        // A read of "a" and "panics": it joins "a" (in a session), then the start of "panics"
        // panics.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            table.join(&master, &["a", "panics"])
        }));
        assert!(panicked.is_err());
        // It left "a" as it unwound: when the other read ends, "a" has no user and ends.
        drop(other);
        assert!(!master.in_session("a") && !master.in_session("panics"));
        assert!(table.keys.lock().is_empty());
    }

    /// A ranged read of keys already in a session joins them while another session's master
    /// call is still under way (it waited for it when one lock covered both).
    #[test]
    fn a_read_of_keys_in_a_session_does_not_wait_for_another_start() {
        let master = ScriptedMaster::new();
        let table = SessionTable::default();
        let held = table.start(&master, &["held"]).unwrap();
        let (entered_tx, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release_rx) = std::sync::mpsc::channel();
        *master.entered.lock() = Some(entered_tx);
        *master.release.lock() = Some(release_rx);
        let slow = std::thread::scope(|s| {
            let slow = s.spawn(|| table.start(&master, &["slow"]));
            entered_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("the slow start reached the master");
            let t0 = std::time::Instant::now();
            let joined = table.join(&master, &["held"]);
            let waited = t0.elapsed();
            // (The receiver is gone when the start gave up waiting: nothing to release.)
            let _ = release_tx.send(());
            assert!(joined.result("held").is_some_and(Result::is_ok));
            assert!(
                waited < Duration::from_secs(1),
                "the join waited {waited:?} for another key's start"
            );
            drop(joined);
            slow.join().unwrap().unwrap()
        });
        assert!(
            master.in_session("held"),
            "the explicit session still holds it"
        );
        table.end(&master, held).unwrap();
        table.end(&master, slow).unwrap();
        assert!(!master.in_session("held") && !master.in_session("slow"));
        assert!(table.keys.lock().is_empty());
    }

    /// Two holders of one key: the first ending its session twice (a clone ended again, or
    /// a stale one) ends nothing of the second's, and a token not handed out ends nothing.
    #[test]
    fn a_session_ended_twice_leaves_another_holders_session_of_the_same_key() {
        let master = FakeMaster::default();
        let table = SessionTable::default();
        let first = table.start(&master, &["a"]).unwrap();
        let second = table.start(&master, &["a", "b"]).unwrap();
        assert_ne!(first, second);
        table.end(&master, first).unwrap();
        table.end(&master, first).unwrap();
        table.end(&master, 0).unwrap();
        table.end(&master, second + 100).unwrap();
        assert!(
            master.in_session("a") && master.in_session("b"),
            "the second session's keys were ended by the first's repeated end"
        );
        assert_eq!(table.keys.lock().get("a").map(|s| s.explicit), Some(1));
        table.end(&master, second).unwrap();
        assert!(!master.in_session("a") && !master.in_session("b"));
        assert!(table.keys.lock().is_empty() && table.open.lock().is_empty());
    }

    /// A key whose session was started more than half the lease ago is started again before
    /// a read joins it (the master's session may have lapsed: a read under it would answer
    /// `LEASE_EXPIRED`); an explicit session never ended is dropped once twice the lease has
    /// passed, its keys' sessions ended. Before, such a key stayed in the table for good and
    /// every later read joined it without asking the master.
    #[test]
    fn a_session_older_than_half_the_lease_is_started_again_and_a_lapsed_one_dropped() {
        let master = FakeMaster::default();
        let lease = Duration::from_millis(80);
        let table = SessionTable::with_lease(lease);
        // Started, never ended (its end was given up at a deadline).
        let _forgotten = table.start(&master, &["a"]).unwrap();
        let starts = || master.starts.load(Ordering::Relaxed);
        let before = starts();
        // Fresh: joined without the master.
        drop(table.join(&master, &["a"]));
        assert_eq!(starts(), before);
        // Past half the lease: started again first.
        std::thread::sleep(lease / 2 + Duration::from_millis(10));
        let joined = table.join(&master, &["a"]);
        assert_eq!(joined.result("a"), Some(&Ok(())));
        assert_eq!(starts(), before + 1, "the key's session was started again");
        drop(joined);
        // Past twice the lease: the next start drops the forgotten session and ends the key.
        std::thread::sleep(lease * 2);
        let other = table.start(&master, &["b"]).unwrap();
        assert!(
            !master.in_session("a"),
            "the lapsed session's key was ended"
        );
        assert!(!table.keys.lock().contains_key("a"));
        assert_eq!(table.open.lock().len(), 1);
        table.end(&master, other).unwrap();
        assert!(table.keys.lock().is_empty());
    }

    /// A master whose starts take `slow` each.
    struct SlowMaster {
        inner: FakeMaster,
        slow: Duration,
    }

    impl SessionCalls for SlowMaster {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            std::thread::sleep(self.slow);
            self.inner.start(keys)
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            self.inner.end(keys)
        }
    }

    /// A session whose start took longer than half the lease is not joined without the master
    /// right after: its lease may have begun when the call did. Before, its age counted from
    /// the call's end, and reads joined it while its lease ran out.
    #[test]
    fn a_slow_start_counts_its_lease_from_the_calls_start() {
        let lease = Duration::from_millis(200);
        let master = SlowMaster {
            inner: FakeMaster::default(),
            slow: Duration::from_millis(120),
        };
        let starts = || master.inner.starts.load(Ordering::Relaxed);
        for explicit in [false, true] {
            let table = SessionTable::with_lease(lease);
            let before = starts();
            // The first holder (an explicit session, or a read still under way) keeps the
            // key's session open.
            let (token, first) = if explicit {
                (Some(table.start(&master, &["a"]).unwrap()), None)
            } else {
                (None, Some(table.join(&master, &["a"])))
            };
            assert_eq!(starts(), before + 1);
            // At once after the slow start: past half the lease since it began.
            drop(table.join(&master, &["a"]));
            assert_eq!(starts(), before + 2, "explicit {explicit}: started again");
            drop(first);
            if let Some(t) = token {
                table.end(&master, t).unwrap();
            }
        }
    }

    /// A master whose starts fail while `failing` is set.
    #[derive(Default)]
    struct FlakyMaster {
        inner: FakeMaster,
        failing: std::sync::atomic::AtomicBool,
    }

    impl SessionCalls for FlakyMaster {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            if self.failing.load(Ordering::Relaxed) {
                return keys
                    .iter()
                    .map(|_| Err(StoreError::RpcTimeout { key: "test".into() }))
                    .collect();
            }
            self.inner.start(keys)
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            self.inner.end(keys)
        }
    }

    /// A renewal that fails fails the read with its error (the client erased the session),
    /// and once the master answers again the next read starts the key again.
    #[test]
    fn a_failed_renewal_of_an_explicit_session_fails_the_read_until_the_master_answers() {
        let master = FlakyMaster::default();
        // Windows of a second or more, for a loaded machine's late wake-ups.
        let lease = Duration::from_secs(4);
        let table = SessionTable::with_lease(lease);
        let token = table.start(&master, &["a"]).unwrap();
        master.failing.store(true, Ordering::Relaxed);
        // Past half the lease: renewed, which fails (before, the read went ahead until three
        // quarters of the lease).
        std::thread::sleep(Duration::from_millis(2200));
        let joined = table.join(&master, &["a"]);
        assert!(
            matches!(joined.result("a"), Some(Err(StoreError::RpcTimeout { .. }))),
            "{:?}",
            joined.result("a")
        );
        drop(joined);
        master.failing.store(false, Ordering::Relaxed);
        let joined = table.join(&master, &["a"]);
        assert_eq!(joined.result("a"), Some(&Ok(())));
        assert!(master.inner.in_session("a"));
        drop(joined);
        table.end(&master, token).unwrap();
        assert!(table.keys.lock().is_empty());
    }

    /// A master whose start of a key named "slow" holds until released (or 10 s).
    #[derive(Default)]
    struct HeldStart {
        open: MasterSessions,
        inside: std::sync::atomic::AtomicBool,
        released: std::sync::atomic::AtomicBool,
        starts: AtomicU64,
    }

    impl HeldStart {
        /// Waits until a start of "slow" is inside the master call (at most 10 s).
        fn wait_inside(&self) {
            let until = Instant::now() + Duration::from_secs(10);
            while !self.inside.load(Ordering::Acquire) {
                assert!(
                    Instant::now() < until,
                    "no start of \"slow\" reached the master"
                );
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }

    impl SessionCalls for HeldStart {
        fn start(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
            self.starts.fetch_add(1, Ordering::Relaxed);
            if keys.contains(&"slow") {
                self.inside.store(true, Ordering::Release);
                let until = Instant::now() + Duration::from_secs(10);
                while !self.released.load(Ordering::Acquire) && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            self.open.start(keys, |_| false)
        }

        fn end(&self, keys: &[&str]) -> Result<(), StoreError> {
            self.open.end(keys)
        }
    }

    /// A read that is done leaves its keys without waiting for another read's slow session
    /// start: the session of a key it leaves unused ends once that start lets go. Before, the
    /// leave waited for the start (a finished read held for a master call on other keys).
    #[test]
    fn a_read_that_is_done_does_not_wait_for_another_reads_master_call() {
        let master = HeldStart::default();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let first = table.join(&master, &["k"]);
        let second = table.join(&master, &["k"]);
        drop(first);
        std::thread::scope(|s| {
            let slow = s.spawn(|| table.start(&master, &["slow"]));
            while !master.inside.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let t0 = Instant::now();
            drop(second);
            assert!(
                t0.elapsed() < Duration::from_millis(500),
                "{:?}",
                t0.elapsed()
            );
            assert!(
                master.open.has("k"),
                "its end waits for the start to let go"
            );
            master.released.store(true, Ordering::Release);
            slow.join().unwrap().unwrap();
        });
        assert!(!master.open.has("k"), "ended once the start let go");
        assert!(!table.keys.lock().contains_key("k"));
    }

    /// Behind a master call that does not return (it holds `calls`), a read's join, an
    /// explicit start and an explicit end stop waiting once their caller gives up (before,
    /// each parked its store-call worker until the holder let go); the end leaves its keys
    /// due, ended when the holder lets go. A removal's forgetting does not wait at all.
    #[test]
    fn session_calls_behind_a_hung_master_call_end_with_their_caller() {
        use crate::store::caller::testing::{as_call_of, TestCaller};
        let master = HeldStart::default();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        let token = table.start(&master, &["e"]).unwrap();
        let gone = Arc::new(TestCaller::default());
        gone.give_up();
        std::thread::scope(|s| {
            let holder = s.spawn(|| table.start(&master, &["slow"]));
            master.wait_inside();
            let waiting = Arc::new(TestCaller::default());
            let read = s.spawn({
                let waiting = waiting.clone();
                let (table, master) = (&table, &master);
                move || {
                    as_call_of(&waiting, || {
                        let joined = table.join(master, &["k"]);
                        joined.result("k").cloned()
                    })
                }
            });
            std::thread::sleep(Duration::from_millis(50));
            let still_waiting = !read.is_finished();
            waiting.give_up();
            let t0 = Instant::now();
            let read = read.join().unwrap();
            let start = as_call_of(&gone, || table.start(&master, &["k2"]));
            let end = as_call_of(&gone, || table.end(&master, token));
            table.forget_replicas(&master, &["k"]);
            let waited = t0.elapsed();
            let e_open_while_held = master.open.has("e");
            master.released.store(true, Ordering::Release);
            holder.join().unwrap().unwrap();
            assert!(still_waiting, "waited while its caller waited");
            assert!(
                matches!(read, Some(Err(StoreError::Unavailable { .. }))),
                "{read:?}"
            );
            assert!(
                matches!(start, Err(StoreError::Unavailable { .. })),
                "{start:?}"
            );
            assert!(
                matches!(end, Err(StoreError::Unavailable { .. })),
                "{end:?}"
            );
            assert!(waited < Duration::from_secs(3), "{waited:?}");
            assert!(e_open_while_held, "its end is left to the holder");
        });
        assert!(!master.open.has("e"), "ended once the holder let go");
        assert!(
            !master.open.has("k") && !master.open.has("k2"),
            "never started"
        );
        assert_eq!(master.starts.load(Ordering::Relaxed), 2, "e and slow only");
    }

    /// A start asked of the master before a removal forgot its key's replicas does not
    /// record its renewal after the forgetting (which no longer waits for it): the next read
    /// asks the master again instead of joining a session that resolved the removed object.
    #[test]
    fn a_start_that_overlapped_a_removal_does_not_record_its_renewal() {
        let master = HeldStart::default();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        std::thread::scope(|s| {
            let reader = s.spawn(|| table.join(&master, &["slow"]));
            master.wait_inside();
            let t0 = Instant::now();
            table.forget_replicas(&master, &["slow"]);
            let forgot_in = t0.elapsed();
            master.released.store(true, Ordering::Release);
            // Still reading: the key stays in the table, and in its session.
            let first = reader.join().unwrap();
            assert!(matches!(first.result("slow"), Some(Ok(()))));
            assert!(forgot_in < Duration::from_secs(3), "{forgot_in:?}");
            assert_eq!(master.starts.load(Ordering::Relaxed), 1);
            let again = table.join(&master, &["slow"]);
            assert!(matches!(again.result("slow"), Some(Ok(()))));
            assert_eq!(
                master.starts.load(Ordering::Relaxed),
                2,
                "asked again, not joined under the overlapped start's renewal"
            );
            drop((first, again));
        });
        assert!(!master.open.has("slow"), "ended with its last reader");
    }

    /// As above for an explicit start of a key the table already holds fresh (a read's): the
    /// forgetting during the start is not undone by the start's renewal.
    #[test]
    fn an_explicit_start_that_overlapped_a_removal_does_not_record_its_renewal() {
        let master = HeldStart::default();
        let table = SessionTable::with_lease(Duration::from_secs(10));
        master.released.store(true, Ordering::Release);
        let reading = table.join(&master, &["slow"]);
        master.released.store(false, Ordering::Release);
        master.inside.store(false, Ordering::Release);
        let token = std::thread::scope(|s| {
            let starting = s.spawn(|| table.start(&master, &["slow"]));
            master.wait_inside();
            table.forget_replicas(&master, &["slow"]);
            master.released.store(true, Ordering::Release);
            starting.join().unwrap().unwrap()
        });
        assert_eq!(master.starts.load(Ordering::Relaxed), 2);
        let again = table.join(&master, &["slow"]);
        assert!(matches!(again.result("slow"), Some(Ok(()))));
        assert_eq!(
            master.starts.load(Ordering::Relaxed),
            3,
            "asked again, not joined under the overlapped start's renewal"
        );
        drop((reading, again));
        table.end(&master, token).unwrap();
        assert!(!master.open.has("slow"));
    }
}
