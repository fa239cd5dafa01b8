//! Meeting through the engine's own key-value exchange (a store it already runs, like
//! torch's `TCPStore`), through the small [`KeyValueExchange`] trait; and two exchanges that
//! ship with kvlink: [`MemoryExchange`] (threads of one process) and [`FileExchange`] (a
//! directory every rank of one host, or a shared file system, can write).
//!
//! The protocol, under the group's prefix `P`:
//! 1. Rank 0 opens epoch `E`: the first `E` above the last closed epoch (`P/closed`) and its
//!    own last epoch whose key `P/E/open` it can **create** (so two rank-0 processes never
//!    open the same epoch), then sets `P/current = E`.
//! 2. Every other rank reads `P/current`; an epoch already decided (`P/E/verdict` present) is
//!    not for it: it waits for a newer one. Otherwise it claims its rank by creating
//!    `P/E/hello/{rank}` with its hello; if that key exists, another process claimed the
//!    rank: it writes its hello to `P/E/dup/{rank}` instead.
//! 3. Rank 0 waits for every rank's hello (through the exchange's `wait`, in slices of 200 ms,
//!    reading the claims and duplicates after each). A hello whose rank has belonged to epoch
//!    `E` or a later one (the exchange restarted empty, so `P/closed` was lost) makes rank 0
//!    open a new epoch above it, as in step 1: the joiners see `P/current` move
//!    and claim their rank there. So the epoch grows past every member's last, as over TCP.
//!    Once every hello is there (or at the deadline) rank 0 decides exactly as over TCP, and
//!    writes the reply to `P/E/verdict`, then `P/closed = E`. Every rank waits for the
//!    verdict; a joiner whose nonce is not the
//!    accepted one for its rank was the duplicate. A joiner that sees `P/current` move past
//!    `E` (rank 0 restarted) joins the newer epoch instead. A joiner that gives up at its
//!    deadline overwrites its claim with a withdrawal, so that its next attempt takes the
//!    rank over instead of counting as a second process for it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::decide::{decide, missing, next_epoch, past_jump, IdSource, Rank0Address, MAX_EPOCH};
use super::message::{fits_a_frame, Hello, Reply, Welcome};
use super::RendezvousError;
use crate::process::wire::MAX_FRAME;

/// A key-value exchange failed (the engine's store is unreachable, a file cannot be written).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{detail}")]
pub struct ExchangeError {
    /// What happened.
    pub detail: String,
}

impl ExchangeError {
    /// An error with this text.
    pub fn new(detail: impl Into<String>) -> Self {
        ExchangeError {
            detail: detail.into(),
        }
    }
}

/// A key-value exchange every rank of a group can reach: what an engine that already runs a
/// store (torch's `TCPStore`, etcd, Redis) gives kvlink to meet through. Every call is
/// bounded by its `deadline`.
///
/// Mapping `TCPStore`: `set` → `set`, `get` → `check` then `get`, `create` →
/// `compare_set(key, "", value)` (true when the returned value is `value`), `wait` → `wait`
/// with the time left as its timeout (`TCPStore` raises at it: return `Ok(false)` or the
/// error, the rendezvous takes either as "not yet"). The rendezvous waits for keys through
/// `wait`, in slices of 200 ms.
pub trait KeyValueExchange: Send + Sync {
    /// Sets `key` to `value`, replacing any value.
    fn set(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), ExchangeError>;

    /// The value of `key`, `None` when absent. Does not wait for it.
    fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>, ExchangeError>;

    /// Sets `key` to `value` only if `key` is absent, atomically; true when this call set it.
    fn create(&self, key: &str, value: &[u8], deadline: Instant) -> Result<bool, ExchangeError>;

    /// Removes `keys`, in order (absent ones are no error): rank 0 removes the keys of epochs
    /// more than one re-formation back, so that an exchange does not keep a key per rank per
    /// re-formation while a group stays down. The default keeps them (an exchange that cannot
    /// remove; `TCPStore`: `delete_key` each).
    fn remove(&self, keys: &[&str], deadline: Instant) -> Result<(), ExchangeError> {
        let _ = (keys, deadline);
        Ok(())
    }

    /// Waits until every key of `keys` is present (`Ok(true)`) or `deadline` (`Ok(false)`).
    /// The default polls [`get`](KeyValueExchange::get) every 10 ms.
    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<bool, ExchangeError> {
        loop {
            let mut all = true;
            for k in keys {
                if self.get(k, deadline)?.is_none() {
                    all = false;
                    break;
                }
            }
            if all {
                return Ok(true);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            std::thread::sleep(left.min(Duration::from_millis(10)));
        }
    }
}

/// A [`KeyValueExchange`] in this process's memory: ranks that are threads of one process
/// (tests), or an engine that relays keys itself.
#[derive(Debug, Default)]
pub struct MemoryExchange {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl MemoryExchange {
    /// An empty exchange.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets every key, as an exchange that restarted empty does.
    pub fn clear(&self) {
        self.map.lock().clear();
        self.changed.notify_all();
    }
}

impl KeyValueExchange for MemoryExchange {
    fn set(&self, key: &str, value: &[u8], _deadline: Instant) -> Result<(), ExchangeError> {
        self.map.lock().insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(())
    }

    fn get(&self, key: &str, _deadline: Instant) -> Result<Option<Vec<u8>>, ExchangeError> {
        Ok(self.map.lock().get(key).cloned())
    }

    fn create(&self, key: &str, value: &[u8], _deadline: Instant) -> Result<bool, ExchangeError> {
        let mut m = self.map.lock();
        if m.contains_key(key) {
            return Ok(false);
        }
        m.insert(key.to_string(), value.to_vec());
        self.changed.notify_all();
        Ok(true)
    }

    fn remove(&self, keys: &[&str], _deadline: Instant) -> Result<(), ExchangeError> {
        let mut m = self.map.lock();
        for k in keys {
            m.remove(*k);
        }
        Ok(())
    }

    fn wait(&self, keys: &[&str], deadline: Instant) -> Result<bool, ExchangeError> {
        let mut m = self.map.lock();
        loop {
            if keys.iter().all(|k| m.contains_key(*k)) {
                return Ok(true);
            }
            if self.changed.wait_until(&mut m, deadline).timed_out() {
                return Ok(keys.iter().all(|k| m.contains_key(*k)));
            }
        }
    }
}

/// Keys of one group's rendezvous.
struct Keys<'a>(&'a str);

impl Keys<'_> {
    fn current(&self) -> String {
        format!("{}/current", self.0)
    }
    fn closed(&self) -> String {
        format!("{}/closed", self.0)
    }
    fn open(&self, e: u64) -> String {
        format!("{}/{e}/open", self.0)
    }
    fn hello(&self, e: u64, rank: u32) -> String {
        format!("{}/{e}/hello/{rank}", self.0)
    }
    fn dup(&self, e: u64, rank: u32) -> String {
        format!("{}/{e}/dup/{rank}", self.0)
    }
    fn verdict(&self, e: u64) -> String {
        format!("{}/{e}/verdict", self.0)
    }
}

/// The epoch at `key` (`closed`, `current`); absent when not 8 bytes or past [`MAX_EPOCH`]
/// (corrupt: taken as never written, so that the next opening writes it anew, where a huge
/// value would leave no next epoch for every formation after).
fn read_epoch(
    x: &dyn KeyValueExchange,
    key: &str,
    level: EpochLog,
    deadline: Instant,
) -> Result<Option<u64>, RendezvousError> {
    let Some(v) = x.get(key, deadline)? else {
        return Ok(None);
    };
    let epoch = <[u8; 8]>::try_from(v.as_slice())
        .ok()
        .map(u64::from_le_bytes)
        .filter(|e| *e <= MAX_EPOCH);
    if epoch.is_none() {
        match level {
            EpochLog::Warn => tracing::warn!(
                key,
                bytes = v.len(),
                "the exchange's epoch is not one (corrupt): taken as absent"
            ),
            EpochLog::Debug => tracing::debug!(
                key,
                bytes = v.len(),
                "the exchange's epoch is not one (corrupt): taken as absent"
            ),
        }
    }
    Ok(epoch)
}

/// How [`read_epoch`] says a corrupt epoch: `Warn` where it is read once a formation (rank
/// 0's `closed`), `Debug` where joiners poll it (`current`, every few milliseconds).
#[derive(Clone, Copy)]
enum EpochLog {
    Warn,
    Debug,
}

const POLL: Duration = Duration::from_millis(10);

/// What a joiner that gave up leaves in its claim, so that its next attempt (or another
/// process for the same rank) can take the rank over instead of counting as a duplicate.
const WITHDRAWN: &[u8] = b"withdrawn";

fn pause(deadline: Instant) {
    std::thread::sleep(POLL.min(deadline.saturating_duration_since(Instant::now())));
}

/// How long one wait on keys lasts before the caller looks again at what a wait on keys
/// cannot see (a newer epoch, a claim withdrawn, the exchange restarted empty).
const WAIT_SLICE: Duration = Duration::from_millis(200);

/// Waits, through the exchange's own [`wait`](KeyValueExchange::wait) (a store that can block
/// on keys answers as they appear, with no polling), until every key of `keys` is present:
/// for at most [`WAIT_SLICE`] and until `deadline`. True when they all are. A wait that
/// fails is taken as "not yet" (an adapter may report a wait's timeout as an error, as
/// `TCPStore` raises one): logged, paused for, and left to the reads and writes around it,
/// which fail the formation where the exchange itself fails. Under a millisecond left, no
/// wait is made (a store may take a zero timeout as none).
fn wait_slice(x: &dyn KeyValueExchange, keys: &[String], deadline: Instant) -> bool {
    let until = deadline.min(Instant::now() + WAIT_SLICE);
    if until.saturating_duration_since(Instant::now()) < Duration::from_millis(1) {
        return false;
    }
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    match x.wait(&keys, until) {
        Ok(all) => all,
        Err(e) => {
            tracing::debug!(error = %e, "a wait on the exchange failed: taken as not yet");
            pause(deadline);
            false
        }
    }
}

/// How long rank 0 rests between reads while every missing rank's claim is there but not
/// usable (withdrawn by a joiner that gave up): a wait on the keys cannot see it rewritten.
const UNUSABLE_CLAIMS_PAUSE: Duration = Duration::from_millis(100);

/// Rank 0's formation over the exchange.
pub(crate) fn lead(
    x: &dyn KeyValueExchange,
    prefix: &str,
    leader: &Hello,
    ids: Option<&IdSource>,
    deadline: Instant,
) -> Result<Welcome, RendezvousError> {
    let k = Keys(prefix);
    let closed = read_epoch(x, &k.closed(), EpochLog::Warn, deadline)?.unwrap_or(0);
    // Further past this rank's last epoch than any group forms in its life: corrupt.
    let closed = if past_jump(leader.last_epoch, closed) {
        tracing::warn!(
            closed,
            last_epoch = leader.last_epoch,
            "the exchange's closed epoch is \
            further past this rank's than any group forms (corrupt): taken as absent"
        );
        0
    } else {
        closed
    };
    let mut epoch = open_epoch(x, &k, leader, closed.max(leader.last_epoch), deadline)?;
    let world = leader.world;
    let mut absent: Vec<u32> = (1..world).collect();
    // The last wait found every missing claim there, yet some rank still missing.
    let mut unusable_claims = false;
    // From here on every way out is a verdict the joiners read: a failed read of the exchange
    // too (before, it returned at once and the joiners waited out their deadline).
    let decision = loop {
        // Checked before reading: a read with its deadline already past may fail at once.
        if Instant::now() >= deadline {
            break Err(RendezvousError::Timeout {
                missing: absent,
                detail: format!("rank 0 waited for every rank of {world} to join"),
            });
        }
        let (hellos, foreign) = match read_hellos(x, &k, epoch, leader, deadline) {
            Ok(read) => read,
            Err(e) => break Err(e),
        };
        // A member of epoch `epoch` or later: the exchange lost what came before (restarted
        // empty). Open an epoch above every such member's at once.
        if let Some(last) = latest_at_or_past(&hellos, epoch) {
            tracing::info!(
                epoch,
                last,
                "a rank has belonged to this epoch or a later one: the exchange restarted \
                 empty; opening a newer epoch"
            );
            match open_epoch(x, &k, leader, last, deadline) {
                Ok(newer) => {
                    epoch = newer;
                    continue;
                }
                // The joiners of this epoch get it as its verdict, like any refusal.
                Err(e) => break Err(e),
            }
        }
        absent = missing(world, &hellos);
        absent.retain(|r| !foreign.iter().any(|(f, _)| f == r));
        if absent.is_empty() {
            break match foreign.into_iter().next() {
                Some((_, e)) => Err(e),
                None => decide(leader, &hellos, ids, Rank0Address::AsAnnounced),
            };
        }
        // Until the missing ranks' claims appear (or a while). Claims that are there but not
        // usable (withdrawn) end the wait at once: read again at once the first time (they
        // may have just come), then after a longer pause while it lasts.
        let claims: Vec<String> = absent.iter().map(|&r| k.hello(epoch, r)).collect();
        if wait_slice(x, &claims, deadline) {
            if unusable_claims {
                std::thread::sleep(
                    UNUSABLE_CLAIMS_PAUSE.min(deadline.saturating_duration_since(Instant::now())),
                );
            }
            unusable_claims = true;
        } else {
            unusable_claims = false;
        }
    };
    // The epoch is the one opened (above every member's last: each was at most `closed`). A
    // welcome past a frame is refused to every rank, as over TCP (no joiner reads a larger
    // value: before, rank 0 formed alone while every joiner failed to read it).
    let decision = decision
        .map(|mut w| {
            w.epoch = epoch;
            w
        })
        .and_then(fits_a_frame)
        .map_err(|e| claimed_twice(e, epoch));
    let reply = match &decision {
        Ok(w) => Reply::Welcome(Box::new(w.clone())),
        Err(e) => Reply::Refused(e.clone()),
    };
    // The verdict goes out even past the deadline, so that no joiner waits for nothing.
    let late = kv_loader::deadline_after(Duration::from_secs(5));
    x.set(&k.verdict(epoch), &reply.encode(), late)?;
    // Once the verdict is out the joiners act on it: rank 0 must too. `closed` is a hint
    // (`open_epoch` opens above it, and never reuses an epoch whose `open` key stays), so
    // failing to write it is logged, not returned; an old epoch's keys are removed only once
    // `closed` is past it (a leader reading an older `closed` would reopen a removed epoch).
    match x.set(&k.closed(), &epoch.to_le_bytes(), late) {
        // Every epoch the last close kept (`closed - 1`) up to two before this one: epochs
        // skipped in between (a rank 0 that died in one, a lead that failed before closing
        // it) are forgotten too, or their keys would stay for good.
        Ok(()) => forget_epochs(
            x,
            &k,
            closed.saturating_sub(1),
            epoch.saturating_sub(2),
            world,
            late,
        ),
        Err(e) => {
            tracing::warn!(epoch, error = %e, "could not mark the epoch closed: the verdict stands");
        }
    }
    decision
}

/// Most epochs one close forgets: past them (an exchange that restarted empty, a jump to an
/// epoch above a member's last), the older ones were never in this exchange.
const FORGET_AT_MOST: u64 = 64;

/// Removes the keys of epochs `from..=to` (at most the last [`FORGET_AT_MOST`]; none for
/// epoch 0), in one call, logged when that fails. Their joiners are done: `current` is two
/// epochs past them, which a joiner still waiting on a verdict sees and moves on. Per epoch,
/// the claims go first and the `open` key last, so that a removal cut short leaves the epoch
/// reserved (never opened again over claims left behind). Keys of ranks at or past `world` (a
/// joiner of another group size), of epochs past the [`FORGET_AT_MOST`] window, and of a
/// removal that failed stay.
fn forget_epochs(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    from: u64,
    to: u64,
    world: u32,
    deadline: Instant,
) {
    let from = from.max(1).max(to.saturating_sub(FORGET_AT_MOST - 1));
    if from > to {
        return;
    }
    let mut keys = Vec::new();
    for old in from..=to {
        for r in 0..world {
            keys.push(k.hello(old, r));
            keys.push(k.dup(old, r));
        }
        keys.push(k.verdict(old));
        keys.push(k.open(old));
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    if let Err(e) = x.remove(&refs, deadline) {
        tracing::warn!(from, to, error = %e, "could not remove old epochs' keys from the exchange");
    }
}

/// A joiner's rank claimed twice in one epoch is no refusal here (see
/// [`RendezvousError::ClaimedTwice`]): a claim left by a process that died cannot be told from
/// a live one's. Rank 0 joined as by another process stays the refusal it is.
fn claimed_twice(e: RendezvousError, epoch: u64) -> RendezvousError {
    match e {
        RendezvousError::DuplicateRank { rank } if rank != 0 => {
            tracing::warn!(
                rank,
                epoch,
                "a rank was claimed twice: a process of it ended without withdrawing its claim, \
                 or two processes run as it; the next epoch starts without this one's claims"
            );
            RendezvousError::ClaimedTwice { rank, epoch }
        }
        other => other,
    }
}

/// A rank whose hello is of another protocol, and the refusal it calls for.
type Foreign = (u32, RendezvousError);

/// The hellos of epoch `epoch` (claims and duplicates), and the ranks whose hello is of
/// another protocol (the rank is there, and the group is refused).
fn read_hellos(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    epoch: u64,
    leader: &Hello,
    deadline: Instant,
) -> Result<(Vec<Hello>, Vec<Foreign>), RendezvousError> {
    let mut hellos = Vec::new();
    let mut foreign = Vec::new();
    for r in 1..leader.world {
        for key in [k.hello(epoch, r), k.dup(epoch, r)] {
            // One past a frame is no hello kvlink writes (an exchange may cut it there).
            if let Some(v) = x
                .get(&key, deadline)?
                .filter(|v| v != WITHDRAWN && v.len() <= MAX_FRAME)
            {
                match Hello::decode(&v, &leader.version) {
                    Ok(h) => hellos.push(h),
                    Err(e @ RendezvousError::VersionMismatch { .. }) => foreign.push((r, e)),
                    Err(e) => {
                        tracing::warn!(key, error = %e, "ignoring a value that is no hello")
                    }
                }
            }
        }
    }
    Ok((hellos, foreign))
}

/// The latest epoch a hello's rank belonged to, when it is `epoch` or later.
fn latest_at_or_past(hellos: &[Hello], epoch: u64) -> Option<u64> {
    hellos
        .iter()
        .map(|h| h.last_epoch)
        .filter(|&last| last >= epoch)
        .max()
}

/// Opens the first epoch above `after` whose key rank 0 can create, and makes it current.
fn open_epoch(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    leader: &Hello,
    after: u64,
    deadline: Instant,
) -> Result<u64, RendezvousError> {
    let mut epoch = next_epoch(after)?;
    // Each taken epoch is one store call: bounded by the deadline as well as by the epochs.
    while !x.create(&k.open(epoch), &leader.encode(), deadline)? {
        if Instant::now() >= deadline {
            return Err(RendezvousError::Timeout {
                missing: (1..leader.world).collect(),
                detail: format!("rank 0 found every epoch up to {epoch} already opened"),
            });
        }
        epoch = next_epoch(epoch)?;
    }
    x.set(&k.current(), &epoch.to_le_bytes(), deadline)?;
    Ok(epoch)
}

/// A joiner's formation over the exchange: returns the welcome (its hello accepted).
pub(crate) fn join(
    x: &dyn KeyValueExchange,
    prefix: &str,
    hello: &Hello,
    deadline: Instant,
) -> Result<Welcome, RendezvousError> {
    let k = Keys(prefix);
    let rank = hello.rank;
    // As over TCP, where a frame carries it: rank 0 reads no larger value.
    let len = hello.encode().len();
    if len > MAX_FRAME {
        return Err(RendezvousError::Config(format!(
            "rank {rank}'s hello is {len} bytes, past the {MAX_FRAME}-byte message limit: its \
             attributes are too large"
        )));
    }
    // Rank 0's last formation that timed out (a rank missing): not a refusal of this rank,
    // which waits for the next epoch until its own deadline.
    let mut timed_out: Option<RendezvousError> = None;
    'epochs: loop {
        // The pause while an epoch is opened and not yet current: it doubles up to a wait
        // slice, so that a rank 0 gone between the two steps costs a few calls per second,
        // not a hundred loops' calls (a thread each through a `FileExchange`).
        let mut idle = POLL;
        // The last read of the exchange that failed here, reported at the deadline.
        let mut unread: Option<RendezvousError> = None;
        // An open epoch not decided yet. One at or below this process's last group's means the
        // exchange restarted empty: the hello says so, and rank 0 opens a newer epoch.
        let epoch = loop {
            if Instant::now() >= deadline {
                return Err(timed_out.take().or(unread.take()).unwrap_or(
                    RendezvousError::Timeout {
                        missing: vec![0],
                        detail: format!("rank 0 opened no new epoch under {prefix:?}"),
                    },
                ));
            }
            // Waited for through the exchange: the current epoch's key, or (the current one
            // decided) the next epoch's opening, which rank 0 makes first. A read that fails
            // (a store hiccup) is "not yet", as a failed wait is: nothing of this rank is in
            // the exchange yet, and rank 0 waits for it until its own deadline anyway.
            let current =
                read_epoch(x, &k.current(), EpochLog::Debug, deadline).and_then(|current| {
                    match current {
                        Some(e) => Ok(Some((e, x.get(&k.verdict(e), deadline)?.is_none()))),
                        None => Ok(None),
                    }
                });
            if current.is_ok() {
                // Reported at the deadline only while reads keep failing.
                unread = None;
            }
            let awaited = match current {
                Ok(Some((e, true))) => break e,
                Ok(Some((e, false))) => k.open(e.saturating_add(1)),
                Ok(None) => k.current(),
                Err(e) => {
                    tracing::debug!(rank, error = %e, "reading the exchange failed: taken as not yet");
                    unread = Some(e);
                    pause(deadline);
                    continue;
                }
            };
            // There already (rank 0 between opening an epoch and making it current): a pause.
            if wait_slice(x, &[awaited], deadline) {
                std::thread::sleep(idle.min(deadline.saturating_duration_since(Instant::now())));
                idle = (idle * 2).min(WAIT_SLICE);
            }
        };
        let bytes = hello.encode();
        let claim = k.hello(epoch, rank);
        let created = match x.create(&claim, &bytes, deadline) {
            Ok(created) => created,
            Err(e) => return lost_create(x, &k, epoch, &claim, hello, &bytes, e.into()),
        };
        let mine = if created {
            claim
        } else {
            let key = if x.get(&claim, deadline)?.as_deref() == Some(WITHDRAWN) {
                claim
            } else {
                k.dup(epoch, rank)
            };
            if let Err(e) = x.set(&key, &bytes, deadline) {
                // It may have been written all the same: never leave it standing.
                return withdrawn_after(x, &k, epoch, &key, hello, e.into());
            }
            key
        };
        match await_verdict(x, &k, epoch, hello, deadline) {
            Ok(Awaited::Verdict(verdict)) => return *verdict,
            Ok(Awaited::NextEpoch(timeout)) => {
                timed_out = timeout.or(timed_out);
                continue 'epochs;
            }
            Ok(Awaited::Deadline) => return withdraw(x, &k, epoch, &mine, hello),
            Err(e) => return withdrawn_after(x, &k, epoch, &mine, hello, e),
        }
    }
}

/// How a joiner's wait for rank 0's verdict on one epoch ended.
enum Awaited {
    /// Rank 0 decided: this rank's welcome or refusal.
    Verdict(Box<Result<Welcome, RendezvousError>>),
    /// The epoch is over for this rank: rank 0 timed out on it (the timeout, which this rank
    /// reports if no later epoch forms by its own deadline) or opened a newer one (`None`).
    NextEpoch(Option<RendezvousError>),
    /// This rank's deadline came first.
    Deadline,
}

/// Waits for rank 0's verdict on `epoch` until `deadline`. The deadline is checked before each
/// read: a store may fail a read whose deadline is past at once, which is no error of the
/// exchange's.
fn await_verdict(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    epoch: u64,
    hello: &Hello,
    deadline: Instant,
) -> Result<Awaited, RendezvousError> {
    loop {
        if Instant::now() >= deadline {
            return Ok(Awaited::Deadline);
        }
        if let Some(v) = x.get(&k.verdict(epoch), deadline)? {
            return Ok(match verdict_for(&v, hello)? {
                Err(e @ RendezvousError::Timeout { .. }) => Awaited::NextEpoch(Some(e)),
                verdict => Awaited::Verdict(Box::new(verdict)),
            });
        }
        if Instant::now() >= deadline {
            return Ok(Awaited::Deadline);
        }
        if read_epoch(x, &k.current(), EpochLog::Debug, deadline)?.is_some_and(|c| c > epoch) {
            return Ok(Awaited::NextEpoch(None));
        }
        wait_slice(x, &[k.verdict(epoch)], deadline);
    }
}

/// A joiner's end on error `e` once its hello may stand in the exchange: it withdraws its
/// claim, as at its deadline, so that its next attempt is not taken for a second process of
/// this rank (which gets the whole group refused as configured). A verdict rank 0 was already
/// writing for this hello still stands: its welcome (every other rank joins that group) or its
/// refusal; otherwise `e`. It takes up to 1 s for the withdrawal and [`REPLY_GRACE`] for the
/// verdict, which may end past the caller's deadline, as at the deadline itself. (A `create`
/// of the claim that fails is withdrawn only when the claim reads back as this attempt's:
/// [`lost_create`].)
fn withdrawn_after(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    epoch: u64,
    mine: &str,
    hello: &Hello,
    e: RendezvousError,
) -> Result<Welcome, RendezvousError> {
    tracing::warn!(
        epoch,
        rank = hello.rank,
        error = %e,
        "rendezvous join failed; withdrawing this rank's hello"
    );
    withdraw(x, k, epoch, mine, hello).map_err(|verdict| match verdict {
        RendezvousError::Timeout { .. } => e,
        refused => refused,
    })
}

/// A joiner's end when the `create` of its claim failed: the write may have landed all the
/// same (the answer was lost). The claim is read back once: when it holds this attempt's
/// hello (its nonce is this attempt's own), it is withdrawn as after any other error, so the
/// next attempt takes the rank over; otherwise (another process's claim, or nothing, or the
/// read failed too) nothing is written, and the error is `e`.
fn lost_create(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    epoch: u64,
    claim: &str,
    hello: &Hello,
    bytes: &[u8],
    e: RendezvousError,
) -> Result<Welcome, RendezvousError> {
    let read = x.get(claim, kv_loader::deadline_after(Duration::from_secs(1)));
    match read {
        Ok(Some(v)) if v == bytes => withdrawn_after(x, k, epoch, claim, hello, e),
        Ok(_) => Err(e),
        Err(read) => {
            tracing::warn!(
                epoch,
                rank = hello.rank,
                error = %e,
                read = %read,
                "rendezvous claim failed and could not be read back; it may stand"
            );
            Err(e)
        }
    }
}

/// How long past its deadline a joiner that withdrew still takes a verdict rank 0 was writing
/// (as the TCP meeting point's joiners do).
const REPLY_GRACE: Duration = Duration::from_millis(500);

/// A joiner's end at its deadline: withdraws its claim (so that a retry is not taken for a
/// second process of this rank), then still takes, for [`REPLY_GRACE`], a verdict rank 0 was
/// already writing: rank 0 may have read the hello just before the withdrawal, and a
/// welcome that names this rank is then the group every other rank joins.
fn withdraw(
    x: &dyn KeyValueExchange,
    k: &Keys<'_>,
    epoch: u64,
    mine: &str,
    hello: &Hello,
) -> Result<Welcome, RendezvousError> {
    let grace = kv_loader::deadline_after(REPLY_GRACE);
    let _ = x.set(
        mine,
        WITHDRAWN,
        kv_loader::deadline_after(Duration::from_secs(1)),
    );
    let timed_out = || RendezvousError::Timeout {
        missing: vec![0],
        detail: format!("rank 0 did not decide epoch {epoch}"),
    };
    while Instant::now() < grace {
        if let Ok(Some(v)) = x.get(&k.verdict(epoch), grace) {
            return verdict_for(&v, hello)?.map_err(|e| match e {
                // Rank 0's own timeout: this rank's is what it reports.
                RendezvousError::Timeout { .. } => timed_out(),
                e => e,
            });
        }
        pause(grace);
    }
    Err(timed_out())
}

/// What rank 0's verdict `v` means for the joiner that said `hello`: the welcome, or the
/// refusal. A welcome of a group too small for this rank is
/// [`RendezvousError::WorldSizeMismatch`]. A welcome naming another process for this rank is
/// [`RendezvousError::ClaimedTwice`]
/// (rank 0 took the other claim, perhaps one left by a process of this rank that died; no
/// refusal, as where rank 0 saw both claims). The outer error: `v` does not decode.
fn verdict_for(
    v: &[u8],
    hello: &Hello,
) -> Result<Result<Welcome, RendezvousError>, RendezvousError> {
    let rank = hello.rank;
    Ok(match Reply::decode_for(v, hello)? {
        // A group without this rank: rank 0 runs a smaller world (it never reads a claim past
        // its own size, so only this rank can tell). A refusal, of this rank alone.
        Reply::Welcome(w) if rank as usize >= w.nonces.len() => {
            Err(RendezvousError::WorldSizeMismatch {
                rank,
                expected: u32::try_from(w.nonces.len()).unwrap_or(u32::MAX),
                got: hello.world,
            })
        }
        Reply::Welcome(w) if w.nonces.get(rank as usize) == Some(&hello.nonce) => Ok(*w),
        Reply::Welcome(w) => Err(RendezvousError::ClaimedTwice {
            rank,
            epoch: w.epoch,
        }),
        Reply::Refused(e) => Err(e),
        Reply::Idle { .. } => Err(RendezvousError::Protocol(
            "an idle reply as a verdict".into(),
        )),
    })
}

#[cfg(test)]
mod tests {
    use super::super::decide::EPOCH_JUMP_MAX;
    use super::super::file_exchange::FileExchange;
    use super::*;

    fn exercise(x: &dyn KeyValueExchange) {
        let d = kv_loader::deadline_after(Duration::from_secs(5));
        assert_eq!(x.get("a/b", d).unwrap(), None);
        x.set("a/b", b"1", d).unwrap();
        x.set("a/b", b"2", d).unwrap();
        assert_eq!(x.get("a/b", d).unwrap().as_deref(), Some(&b"2"[..]));
        assert!(x.create("c", b"x", d).unwrap());
        assert!(!x.create("c", b"y", d).unwrap());
        assert_eq!(x.get("c", d).unwrap().as_deref(), Some(&b"x"[..]));
        assert!(x.wait(&["a/b", "c"], d).unwrap());
        let soon = kv_loader::deadline_after(Duration::from_millis(30));
        assert!(!x.wait(&["a/b", "never"], soon).unwrap());
    }

    #[test]
    fn memory_and_file_exchanges_set_get_create_and_wait() {
        exercise(&MemoryExchange::new());
        let dir = std::env::temp_dir().join(format!("kvlink-fx-{}", super::super::fresh_nonce()));
        exercise(&FileExchange::new(&dir).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A group that re-forms again and again over an exchange of files (a group down for
    /// hours, a re-formation per batch) keeps the files of its last two epochs only, not a file
    /// per rank per re-formation; each meeting still forms.
    #[test]
    fn re_formations_leave_the_files_of_two_epochs_only() {
        use super::super::decide::tests::hello;
        let dir = std::env::temp_dir().join(format!("kvlink-fx-{}", super::super::fresh_nonce()));
        let x = FileExchange::new(&dir).unwrap();
        let leader = hello(0);
        let files = || -> Vec<_> {
            std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name())
                .collect()
        };
        let mut after_two = 0;
        for round in 1..=8u64 {
            let deadline = kv_loader::deadline_after(Duration::from_secs(10));
            let (led, joined) = meet(&x, &leader, deadline);
            assert_eq!(led.unwrap().epoch, round);
            assert!(joined.iter().all(|j| j.is_ok()), "{joined:?}");
            if round == 2 {
                after_two = files().len();
            }
        }
        // `current`, `closed`, and two epochs' keys, as after the second meeting.
        let left = files();
        assert_eq!(left.len(), after_two, "{left:?}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// An epoch rank 0 opened and never closed (it died in it) does not leave the epoch kept
    /// before it for good: the next close forgets every epoch from the one the last close kept
    /// up to two before its own. Before, each close forgot one epoch, and the one the skipped
    /// close would have forgotten stayed (its claims and verdict files).
    #[test]
    fn an_epoch_rank_0_never_closed_leaves_no_epoch_behind() {
        use super::super::decide::tests::hello;
        let dir = std::env::temp_dir().join(format!("kvlink-fx-{}", super::super::fresh_nonce()));
        let x = FileExchange::new(&dir).unwrap();
        let leader = hello(0);
        let files = || std::fs::read_dir(&dir).unwrap().count();
        let soon = || kv_loader::deadline_after(Duration::from_secs(10));
        let mut after_two = 0;
        for round in 1..=3u64 {
            let (led, joined) = meet(&x, &leader, soon());
            assert_eq!(led.unwrap().epoch, round);
            assert!(joined.iter().all(|j| j.is_ok()), "{joined:?}");
            if round == 2 {
                after_two = files();
            }
        }
        // Rank 0 opened epoch 4 and died before closing it.
        assert!(x.create(&Keys("p").open(4), &[0], soon()).unwrap());
        for epoch in 5..=9u64 {
            let (led, joined) = meet(&x, &leader, soon());
            assert_eq!(led.unwrap().epoch, epoch);
            assert!(joined.iter().all(|j| j.is_ok()), "{joined:?}");
        }
        // `current`, `closed`, and two epochs' keys, as after the second meeting.
        assert_eq!(files(), after_two);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn create_is_atomic_under_contention() {
        let x = MemoryExchange::new();
        let dir = std::env::temp_dir().join(format!("kvlink-fx-{}", super::super::fresh_nonce()));
        let f = FileExchange::new(&dir).unwrap();
        for ex in [&x as &dyn KeyValueExchange, &f] {
            let wins: usize = std::thread::scope(|s| {
                let hs: Vec<_> = (0..8)
                    .map(|i| {
                        s.spawn(move || {
                            let d = kv_loader::deadline_after(Duration::from_secs(5));
                            usize::from(ex.create("k", &[i], d).unwrap())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).sum()
            });
            assert_eq!(wins, 1);
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Rank 0 went away after opening epoch 2 and before making it current (epoch 1 decided):
    /// a joiner waits to its deadline with a pause that grows to a wait slice. Before, it
    /// looked again every 10 ms: about three exchange calls each time, 300 a second.
    #[test]
    fn a_joiner_waiting_on_an_epoch_never_made_current_backs_off() {
        use super::super::decide::tests::hello;
        let x = Counting::default();
        let k = Keys("p");
        let d = kv_loader::deadline_after(Duration::from_secs(5));
        x.set(&k.current(), &1u64.to_le_bytes(), d).unwrap();
        x.set(&k.verdict(1), b"decided", d).unwrap();
        x.set(&k.open(2), b"", d).unwrap();
        let got = join(
            &x,
            "p",
            &hello(1),
            kv_loader::deadline_after(Duration::from_secs(1)),
        );
        assert!(
            matches!(got, Err(RendezvousError::Timeout { .. })),
            "{got:?}"
        );
        let gets = x.gets.load(std::sync::atomic::Ordering::Relaxed);
        let waits = x.waits.load(std::sync::atomic::Ordering::Relaxed);
        assert!(gets + waits < 60, "{gets} reads and {waits} waits in 1 s");
    }

    /// A joiner whose last epoch has no next one makes rank 0's move to a newer epoch fail:
    /// that failure is the epoch's verdict, so the joiner gets the same refusal at once
    /// instead of waiting out its deadline.
    #[test]
    fn a_failed_move_to_a_newer_epoch_is_every_ranks_refusal() {
        use super::super::decide::tests::hello;
        let x = MemoryExchange::new();
        let (leader, mut late) = (hello(0), hello(1));
        late.last_epoch = MAX_EPOCH;
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let started = Instant::now();
        let (led, joined) = std::thread::scope(|s| {
            let l = s.spawn(|| lead(&x, "p", &leader, None, deadline));
            let j = s.spawn(|| join(&x, "p", &late, deadline));
            (l.join().unwrap(), j.join().unwrap())
        });
        assert!(matches!(led, Err(RendezvousError::Protocol(_))), "{led:?}");
        assert!(
            matches!(joined, Err(RendezvousError::Protocol(_))),
            "{joined:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    /// A welcome past a frame (rank 0's attributes) is refused to every rank, as over TCP;
    /// before, rank 0 formed while every joiner failed to read it (or, with `FileExchange`'s
    /// cap, could not). A joiner's own hello past a frame is refused at once, unwritten.
    #[test]
    fn a_welcome_or_hello_past_a_frame_is_refused_to_every_rank() {
        use super::super::decide::tests::hello;
        let x = MemoryExchange::new();
        let huge = Hello {
            attributes: vec![("big".into(), "x".repeat(MAX_FRAME))],
            ..hello(0)
        };
        let (led, joined) = meet(
            &x,
            &huge,
            kv_loader::deadline_after(Duration::from_secs(10)),
        );
        assert!(
            matches!(led, Err(RendezvousError::Config(_))),
            "{:?}",
            led.map(|w| w.epoch)
        );
        for j in joined {
            assert!(
                matches!(j, Err(RendezvousError::Config(_))),
                "{:?}",
                j.map(|w| w.epoch)
            );
        }
        let big_joiner = Hello {
            attributes: vec![("big".into(), "x".repeat(MAX_FRAME))],
            ..hello(1)
        };
        let got = join(
            &x,
            "q",
            &big_joiner,
            kv_loader::deadline_after(Duration::from_secs(10)),
        );
        assert!(
            matches!(got, Err(RendezvousError::Config(_))),
            "{:?}",
            got.map(|w| w.epoch)
        );
    }

    /// A corrupt `closed` marker (past `MAX_EPOCH`, further past this rank's last epoch than
    /// `EPOCH_JUMP_MAX`, or not 8 bytes) is taken as absent. Before,
    /// `u64::MAX` there left no next epoch: every formation failed before any verdict, and
    /// every joiner waited out its deadline, for as long as the exchange kept the key.
    #[test]
    fn a_corrupt_closed_marker_does_not_stop_formations() {
        use super::super::decide::tests::hello;
        let leader = hello(0);
        for corrupt in [
            u64::MAX.to_le_bytes().to_vec(),
            MAX_EPOCH.to_le_bytes().to_vec(),
            (EPOCH_JUMP_MAX + 1).to_le_bytes().to_vec(),
            vec![7; 3],
        ] {
            let x = MemoryExchange::new();
            let soon = || kv_loader::deadline_after(Duration::from_secs(10));
            x.set(&Keys("p").closed(), &corrupt, soon()).unwrap();
            for epoch in 1..=2u64 {
                let (led, joined) = meet(&x, &leader, soon());
                assert_eq!(led.unwrap().epoch, epoch);
                assert!(joined.iter().all(|j| j.is_ok()), "{joined:?}");
            }
        }
    }

    /// A joiner of a larger world claims a rank past rank 0's group: rank 0 never reads that
    /// claim and forms without it. Before, the joiner read the welcome as its rank claimed
    /// twice (`ClaimedTwice`, retried for good); now it is refused with the world size, alone
    /// (over TCP rank 0 reads every hello, and one of another world size refuses every rank).
    #[test]
    fn a_joiner_past_rank_0s_world_is_refused_with_the_world_size() {
        use super::super::decide::tests::hello;
        let x = MemoryExchange::new();
        let leader = hello(0);
        let past = Hello {
            rank: leader.world + 2,
            world: leader.world + 4,
            ..hello(1)
        };
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        std::thread::scope(|s| {
            let l = s.spawn(|| lead(&x, "p", &leader, None, deadline));
            let p = s.spawn(|| join(&x, "p", &past, deadline));
            // The larger world's claim stands before the group can form.
            let claim = Keys("p").hello(1, past.rank);
            while x.get(&claim, deadline).unwrap().is_none() {
                assert!(Instant::now() < deadline, "no claim");
                std::thread::sleep(Duration::from_millis(5));
            }
            let js: Vec<_> = (1..leader.world)
                .map(|r| {
                    let h = hello(r);
                    let x = &x;
                    s.spawn(move || join(x, "p", &h, deadline))
                })
                .collect();
            for j in js {
                let got = j.join().unwrap();
                assert!(got.is_ok(), "{got:?}");
            }
            assert!(l.join().unwrap().is_ok());
            let got = p.join().unwrap();
            assert!(
                matches!(
                    got,
                    Err(RendezvousError::WorldSizeMismatch { rank, expected, got })
                        if rank == leader.world + 2 && expected == leader.world && got == leader.world + 4
                ),
                "{got:?}"
            );
        });
    }

    /// Rank 0 (`leader`) and every other rank of its group meet over `x` at once: what rank 0
    /// and each joiner got.
    fn meet(
        x: &dyn KeyValueExchange,
        leader: &Hello,
        deadline: Instant,
    ) -> (
        Result<Welcome, RendezvousError>,
        Vec<Result<Welcome, RendezvousError>>,
    ) {
        use super::super::decide::tests::hello;
        std::thread::scope(|s| {
            let l = s.spawn(|| lead(x, "p", leader, None, deadline));
            let js: Vec<_> = (1..leader.world)
                .map(|r| {
                    let h = hello(r);
                    s.spawn(move || join(x, "p", &h, deadline))
                })
                .collect();
            let joined: Vec<_> = js.into_iter().map(|j| j.join().unwrap()).collect();
            (l.join().unwrap(), joined)
        })
    }

    /// A memory exchange whose writes (`set_fails`) or reads (`get_fails`, which may look at
    /// the exchange) of some keys fail: a store hiccup.
    struct Hiccup {
        x: MemoryExchange,
        set_fails: fn(&str) -> bool,
        get_fails: fn(&MemoryExchange, &str) -> bool,
        /// Creates of these keys happen, but report an error (the answer was lost).
        create_lost: fn(&str) -> bool,
    }

    impl Hiccup {
        fn new(set_fails: fn(&str) -> bool, get_fails: fn(&MemoryExchange, &str) -> bool) -> Self {
            Hiccup {
                x: MemoryExchange::new(),
                set_fails,
                get_fails,
                create_lost: |_| false,
            }
        }
    }

    impl KeyValueExchange for Hiccup {
        fn set(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), ExchangeError> {
            if (self.set_fails)(key) {
                return Err(ExchangeError::new("test: the key cannot be written"));
            }
            self.x.set(key, value, deadline)
        }
        fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>, ExchangeError> {
            if (self.get_fails)(&self.x, key) {
                return Err(ExchangeError::new("test: the store cannot be read"));
            }
            self.x.get(key, deadline)
        }
        fn create(
            &self,
            key: &str,
            value: &[u8],
            deadline: Instant,
        ) -> Result<bool, ExchangeError> {
            let created = self.x.create(key, value, deadline);
            if (self.create_lost)(key) {
                return Err(ExchangeError::new("test: the answer to a create was lost"));
            }
            created
        }
        fn wait(&self, keys: &[&str], deadline: Instant) -> Result<bool, ExchangeError> {
            self.x.wait(keys, deadline)
        }
    }

    /// The joiners act on the verdict once it is out: rank 0 reports the same formed group
    /// even when marking the epoch closed then fails.
    #[test]
    fn rank_0_keeps_the_verdict_it_sent_when_the_closed_marker_fails() {
        use super::super::decide::tests::hello;
        // A store hiccup after the verdict: the `closed` marker cannot be written.
        let x = Hiccup::new(|key| key.ends_with("/closed"), |_, _| false);
        let leader = hello(0);
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let (led, joined) = meet(&x, &leader, deadline);
        let led = led.unwrap();
        for j in joined {
            assert_eq!(j.unwrap().epoch, led.epoch);
        }
    }

    /// A read that fails while rank 0 collects the hellos is the formation's verdict: the
    /// joiners read it and fail at once, rather than wait out their deadline for a verdict
    /// rank 0 never wrote.
    #[test]
    fn a_failed_read_while_collecting_hellos_is_every_ranks_verdict() {
        use super::super::decide::tests::hello;
        // Rank 0's reads of the duplicate claims fail once ranks 1 and 2 have both claimed
        // their places (a store hiccup while rank 0 collects the hellos).
        let x = Hiccup::new(
            |_| false,
            |x, key| {
                let far = kv_loader::deadline_after(Duration::from_secs(1));
                key.split_once("/dup/").is_some_and(|(epoch, _)| {
                    [1, 2]
                        .iter()
                        .all(|r| matches!(x.get(&format!("{epoch}/hello/{r}"), far), Ok(Some(_))))
                })
            },
        );
        let leader = hello(0);
        let deadline = kv_loader::deadline_after(Duration::from_secs(20));
        let started = Instant::now();
        let (led, joined) = meet(&x, &leader, deadline);
        assert!(matches!(led, Err(RendezvousError::Exchange(_))), "{led:?}");
        for j in joined {
            let e = j.unwrap_err();
            assert!(e.to_string().contains("cannot be read"), "{e}");
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
    }

    /// A joiner's reads before it claims its place fail a few times (a store hiccup): it
    /// tries again and joins. Before, the first failed read ended its formation at once,
    /// while rank 0 waited for it until its deadline.
    #[test]
    fn a_joiner_whose_first_reads_fail_tries_again() {
        use super::super::decide::tests::hello;
        use std::sync::atomic::{AtomicU32, Ordering};
        static FAILS_LEFT: AtomicU32 = AtomicU32::new(3);
        let x = Hiccup::new(
            |_| false,
            |_, key| {
                key == "p/current"
                    && FAILS_LEFT
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok()
            },
        );
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let (led, joined) = meet(&x, &hello(0), deadline);
        let led = led.unwrap();
        for j in joined {
            assert_eq!(j.unwrap().epoch, led.epoch);
        }
        assert_eq!(FAILS_LEFT.load(Ordering::SeqCst), 0, "the reads failed");
    }

    /// A joiner whose wait for the verdict fails (a store hiccup) withdraws its hello, as at
    /// its deadline: before, the hello stood, the next attempt's was taken for a second
    /// process of this rank, and rank 0 refused the whole group as configured.
    #[test]
    fn a_joiner_whose_read_fails_withdraws_its_hello() {
        use super::super::decide::tests::hello;
        use std::sync::atomic::{AtomicBool, Ordering};
        static VERDICT_FAILS: AtomicBool = AtomicBool::new(true);
        let x = Hiccup::new(
            |_| false,
            // Once the hello is claimed: the joiner's wait for the verdict fails.
            |x, key| {
                let far = kv_loader::deadline_after(Duration::from_secs(1));
                key.ends_with("/verdict")
                    && VERDICT_FAILS.load(Ordering::SeqCst)
                    && matches!(x.get("p/1/hello/1", far), Ok(Some(_)))
            },
        );
        let far = kv_loader::deadline_after(Duration::from_secs(10));
        x.set("p/current", &1u64.to_le_bytes(), far).unwrap();
        let started = Instant::now();
        let e = join(&x, "p", &hello(1), far).unwrap_err();
        assert!(matches!(e, RendezvousError::Exchange(_)), "{e:?}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(
            x.get("p/1/hello/1", far).unwrap().as_deref(),
            Some(WITHDRAWN)
        );
        // The next attempt (a new nonce) takes the place again, not a duplicate's.
        VERDICT_FAILS.store(false, Ordering::SeqCst);
        let mut again = hello(1);
        again.nonce = again.nonce.wrapping_add(1);
        let soon = kv_loader::deadline_after(Duration::from_millis(200));
        let e = join(&x, "p", &again, soon).unwrap_err();
        assert!(matches!(e, RendezvousError::Timeout { .. }), "{e:?}");
        assert_eq!(
            x.get("p/1/dup/1", far).unwrap(),
            None,
            "taken for a second process"
        );
    }

    /// A joiner whose `create` of its claim landed but answered an error withdraws the claim
    /// (it reads back as this attempt's hello), so its next attempt takes the rank over; a
    /// claim that reads back as another process's is left as it is.
    #[test]
    fn a_joiner_whose_create_answer_is_lost_withdraws_only_its_own_claim() {
        use super::super::decide::tests::hello;
        use std::sync::atomic::{AtomicBool, Ordering};
        static LOST: AtomicBool = AtomicBool::new(true);
        let mut x = Hiccup::new(|_| false, |_, _| false);
        x.create_lost = |key| key.ends_with("/hello/1") && LOST.load(Ordering::SeqCst);
        let far = kv_loader::deadline_after(Duration::from_secs(10));
        x.set("p/current", &1u64.to_le_bytes(), far).unwrap();
        let started = Instant::now();
        let e = join(&x, "p", &hello(1), far).unwrap_err();
        assert!(matches!(e, RendezvousError::Exchange(_)), "{e:?}");
        assert!(started.elapsed() < Duration::from_secs(3));
        assert_eq!(
            x.get("p/1/hello/1", far).unwrap().as_deref(),
            Some(WITHDRAWN),
            "this attempt's claim left standing"
        );
        // The next attempt takes the place again, not a duplicate's.
        LOST.store(false, Ordering::SeqCst);
        let mut again = hello(1);
        again.nonce = again.nonce.wrapping_add(1);
        let soon = kv_loader::deadline_after(Duration::from_millis(200));
        let e = join(&x, "p", &again, soon).unwrap_err();
        assert!(matches!(e, RendezvousError::Timeout { .. }), "{e:?}");
        assert_eq!(x.get("p/1/dup/1", far).unwrap(), None);

        // Another process's claim stands: a lost answer to a create that found it is no
        // reason to withdraw it.
        let x = Hiccup {
            create_lost: |key| key.ends_with("/hello/2"),
            ..Hiccup::new(|_| false, |_, _| false)
        };
        x.set("p/current", &1u64.to_le_bytes(), far).unwrap();
        let theirs = hello(2).encode();
        x.set("p/1/hello/2", &theirs, far).unwrap();
        let mut other = hello(2);
        other.nonce = other.nonce.wrapping_add(7);
        let e = join(&x, "p", &other, far).unwrap_err();
        assert!(matches!(e, RendezvousError::Exchange(_)), "{e:?}");
        assert_eq!(x.get("p/1/hello/2", far).unwrap(), Some(theirs));
    }

    /// A joiner whose deadline passes while rank 0 writes the verdict of a formation it is in
    /// takes that welcome: rank 0 read its hello, so every other rank joins a group with it.
    #[test]
    fn a_joiner_takes_a_welcome_written_just_after_its_deadline() {
        use super::super::decide::{decide, tests::hello};
        let x = MemoryExchange::new();
        let far = kv_loader::deadline_after(Duration::from_secs(10));
        x.set("p/current", &1u64.to_le_bytes(), far).unwrap();
        let started = Instant::now();
        let deadline = started + Duration::from_millis(300);
        let joined = std::thread::scope(|s| {
            let j = s.spawn(|| join(&x, "p", &hello(1), deadline));
            // Rank 0 reads the claim, then writes its welcome just past the joiner's deadline.
            while x.get("p/1/hello/1", far).unwrap().is_none() {
                std::thread::sleep(Duration::from_millis(5));
            }
            let claimed = Hello::decode(&x.get("p/1/hello/1", far).unwrap().unwrap(), "0.1.0");
            let mut w = decide(
                &hello(0),
                &[claimed.unwrap(), hello(2)],
                None,
                Rank0Address::AsAnnounced,
            )
            .unwrap();
            w.epoch = 1;
            std::thread::sleep(deadline.saturating_duration_since(Instant::now()));
            std::thread::sleep(Duration::from_millis(100));
            let verdict = Reply::Welcome(Box::new(w)).encode();
            x.set("p/1/verdict", &verdict, far).unwrap();
            j.join().unwrap()
        });
        assert_eq!(joined.unwrap().epoch, 1);
        assert!(started.elapsed() < Duration::from_secs(3));
    }

    /// A memory exchange that counts reads and waits, and whose `wait` raises when its keys
    /// do not come in time (as torch's `TCPStore.wait` raises on its timeout) if asked to.
    #[derive(Default)]
    struct Counting {
        x: MemoryExchange,
        gets: std::sync::atomic::AtomicU64,
        waits: std::sync::atomic::AtomicU64,
        raises: bool,
    }

    impl KeyValueExchange for Counting {
        fn set(&self, key: &str, value: &[u8], deadline: Instant) -> Result<(), ExchangeError> {
            self.x.set(key, value, deadline)
        }
        fn get(&self, key: &str, deadline: Instant) -> Result<Option<Vec<u8>>, ExchangeError> {
            self.gets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.x.get(key, deadline)
        }
        fn create(
            &self,
            key: &str,
            value: &[u8],
            deadline: Instant,
        ) -> Result<bool, ExchangeError> {
            self.x.create(key, value, deadline)
        }
        fn wait(&self, keys: &[&str], deadline: Instant) -> Result<bool, ExchangeError> {
            self.waits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            match self.x.wait(keys, deadline)? {
                false if self.raises => Err(ExchangeError::new("test: wait timed out")),
                all => Ok(all),
            }
        }
    }

    /// Ranks that wait for each other wait through the exchange's own `wait` (an engine's
    /// store that blocks on keys, as `TCPStore` does), not by reading keys every 10 ms: rank 0
    /// read every rank's two claim keys 100 times a second while a rank was away (thousands
    /// of reads a second on the engine's store in a group of 8, on every re-formation).
    #[test]
    fn ranks_wait_on_the_exchange_rather_than_poll_it() {
        use super::super::decide::tests::hello;
        let x = Counting::default();
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let (leader, late) = (hello(0), Duration::from_millis(600));
        let (led, joined) = std::thread::scope(|s| {
            let l = s.spawn(|| lead(&x, "p", &leader, None, deadline));
            let js: Vec<_> = (1..leader.world)
                .map(|r| {
                    let (h, x) = (hello(r), &x);
                    s.spawn(move || {
                        // Rank 2 comes late: the others wait for it.
                        if r == 2 {
                            std::thread::sleep(late);
                        }
                        join(x, "p", &h, deadline)
                    })
                })
                .collect();
            let joined: Vec<_> = js.into_iter().map(|j| j.join().unwrap()).collect();
            (l.join().unwrap(), joined)
        });
        let epoch = led.unwrap().epoch;
        assert!(joined.into_iter().all(|j| j.unwrap().epoch == epoch));
        let gets = x.gets.load(std::sync::atomic::Ordering::Relaxed);
        let waits = x.waits.load(std::sync::atomic::Ordering::Relaxed);
        assert!(waits > 0, "no wait on the exchange");
        // Polling, 600 ms cost rank 0 about 240 reads and rank 1 about 120.
        assert!(gets < 100, "{gets} reads, {waits} waits");
    }

    /// A wait that reports its timeout as an error is "not yet": a rank that comes a second
    /// late still forms the group. Before, rank 0 took the first such error as the
    /// formation's verdict, and every joiner failed.
    #[test]
    fn a_wait_that_raises_on_its_timeout_is_not_yet() {
        use super::super::decide::tests::hello;
        let x = Counting {
            raises: true,
            ..Counting::default()
        };
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let leader = hello(0);
        let (led, joined) = std::thread::scope(|s| {
            let l = s.spawn(|| lead(&x, "p", &leader, None, deadline));
            let js: Vec<_> = (1..leader.world)
                .map(|r| {
                    let (h, x) = (hello(r), &x);
                    s.spawn(move || {
                        if r == 2 {
                            std::thread::sleep(Duration::from_secs(1));
                        }
                        join(x, "p", &h, deadline)
                    })
                })
                .collect();
            let joined: Vec<_> = js.into_iter().map(|j| j.join().unwrap()).collect();
            (l.join().unwrap(), joined)
        });
        let epoch = led.expect("rank 0 formed").epoch;
        for j in joined {
            assert_eq!(j.expect("a joiner formed").epoch, epoch);
        }
    }
}
