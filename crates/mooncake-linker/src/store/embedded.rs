//! The embedded store: in-process, thread-safe, byte-bounded with LRU eviction.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tracing::{debug, warn};

use super::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangeChecksums, RangedGet,
    ReadSession, StoreError,
};

const SHARDS: usize = 16;

struct Entry {
    data: Arc<[u8]>,
    last_used: AtomicU64,
    pins: AtomicU32,
    /// Which write of its key this is (unique in the store): a session lets go only of the
    /// object it pinned, not of one written again at the same key since.
    generation: u64,
}

/// What one read session pinned: each key with the generation of the object pinned.
type SessionPins = Vec<(String, u64)>;

/// An open read session: what it pinned, and when.
struct OpenSession {
    pins: SessionPins,
    started: Instant,
}

/// An in-process [`KvStore`]: the default of the example and of most tests, with no setup.
///
/// Thread-safe (keys spread over 16 lock shards; bytes are copied outside the locks), bounded
/// by a byte capacity with least-recently-used eviction of unpinned objects, first-write-wins
/// puts like Mooncake, ranged reads. An object that cannot fit is refused with `NoSpace`,
/// and then nothing is evicted for it. A read session pins the objects present when it starts
/// and lets go of exactly those when it ends (once); `remove` refuses a pinned object
/// (`Lease`), `discard` takes it regardless.
///
/// A session lasts its lease ([`EmbeddedStore::DEFAULT_LEASE`], or
/// [`with_lease`](EmbeddedStore::with_lease)) unless ended before, as Mooncake's do: a session
/// whose end never came (its caller gave up on the call, or the end failed) is ended by the
/// store once the lease is over, when a put needs its room, a `remove` meets its pin, or a
/// session starts. A reader renews its pins by starting a session again before the lease
/// ends (the linker does, every `LinkerConfig::lease_renewal`).
///
/// ```
/// use mooncake_linker::store::{EmbeddedStore, KvStore, ObjectPut, RangedGet, ReadRange};
/// let store = EmbeddedStore::new(1 << 20);
/// let data = [1u8, 2, 3, 4, 5, 6];
/// let put = ObjectPut { key: "a", parts: [(data.as_ptr(), 6)].into_iter().collect() };
/// // SAFETY: `data` is valid for reads of 6 bytes for the call.
/// let written = unsafe { store.put(&[put]) };
/// assert!(written[0].is_ok());
/// let mut out = [0u8; 2];
/// let get = RangedGet {
///     key: "a",
///     ranges: [ReadRange { dst: out.as_mut_ptr(), len: 2, offset: 3 }].into_iter().collect(),
/// };
/// // SAFETY: `out` is valid for writes of 2 bytes and nothing else touches it.
/// let got = unsafe { store.get_ranges(&[get]) };
/// assert_eq!(got[0], Ok(2));
/// assert_eq!(out, [4, 5]);
/// ```
pub struct EmbeddedStore {
    shards: Vec<RwLock<HashMap<String, Entry>>>,
    capacity: u64,
    used: Mutex<u64>,
    clock: AtomicU64,
    /// Open read sessions by token, with what each pinned.
    sessions: Mutex<HashMap<u64, OpenSession>>,
    next_session: AtomicU64,
    /// How long a session lasts unless ended (`None`: until ended).
    lease: Option<Duration>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedStore")
            .field("capacity", &self.capacity)
            // `try_lock`: formatting never waits (nor deadlocks under the lock).
            .field("used", &self.used.try_lock().map(|u| *u))
            .field("sessions", &self.sessions.try_lock().map(|s| s.len()))
            .field("lease", &self.lease)
            .finish_non_exhaustive()
    }
}

/// A new object's buffer of `len` bytes, allocated once and filled in place by `fill` (an
/// object kept as `Arc<[u8]>` built from a `Vec` would be copied once more, and held twice
/// meanwhile).
pub(crate) fn new_object<E>(
    len: usize,
    fill: impl FnOnce(&mut [u8]) -> Result<(), E>,
) -> Result<Arc<[u8]>, E> {
    // `repeat_n` has an exact length: the Arc is allocated once, at its size.
    let mut data: Arc<[u8]> = std::iter::repeat_n(0u8, len).collect();
    match Arc::get_mut(&mut data) {
        Some(dst) => fill(dst)?,
        // Not reached (a fresh Arc has one owner); the copying way keeps it correct.
        None => {
            let mut v = vec![0u8; len];
            fill(&mut v)?;
            data = v.into();
        }
    }
    Ok(data)
}

/// The first of `keys` that `pins` (what [`EmbeddedStore::pin_present`] pinned of them, in
/// their order) lacks: one walk of both, linear in the keys (a session of a million keys with
/// one absent is answered at once).
fn first_absent<'k>(keys: &[&'k str], pins: &SessionPins) -> Option<&'k str> {
    let mut pinned = pins.iter().peekable();
    keys.iter().copied().find(|k| {
        if pinned.peek().is_some_and(|(p, _)| p == k) {
            pinned.next();
            false
        } else {
            true
        }
    })
}

fn shard_of(key: &str) -> usize {
    // FNV-1a: cheap and good enough to spread keys over the shards.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.as_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    (h % SHARDS as u64) as usize
}

impl EmbeddedStore {
    /// How long a read session lasts unless ended or renewed: a minute, far longer than the
    /// linker's renewal period (2 s by default) and its bounds on a load's waits.
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);

    /// The shortest lease [`with_lease`](Self::with_lease) sets (100 ms): the linker renews a
    /// session at most every 50 ms, and only between store calls, so a shorter lease would end
    /// sessions a load still reads under (a zero one, every session at the next start). A
    /// lease must still outlast each store call (a group read over 100 ms needs a longer one).
    pub const MIN_LEASE: Duration = Duration::from_millis(100);

    /// An empty store holding at most `capacity` bytes of objects, its sessions lasting
    /// [`DEFAULT_LEASE`](Self::DEFAULT_LEASE).
    pub fn new(capacity: u64) -> Self {
        EmbeddedStore {
            shards: (0..SHARDS).map(|_| RwLock::new(HashMap::new())).collect(),
            capacity,
            used: Mutex::new(0),
            clock: AtomicU64::new(1),
            sessions: Mutex::new(HashMap::new()),
            next_session: AtomicU64::new(1),
            lease: Some(Self::DEFAULT_LEASE),
        }
    }

    /// The same store with its sessions lasting `lease` unless ended (`None`: until ended,
    /// so a session whose end never comes pins its objects for the store's life). A lease
    /// under [`MIN_LEASE`](Self::MIN_LEASE) is raised to it (logged at `warn`).
    pub fn with_lease(mut self, lease: Option<Duration>) -> Self {
        self.lease = lease.map(|l| {
            if l < Self::MIN_LEASE {
                warn!(
                    asked = ?l,
                    used = ?Self::MIN_LEASE,
                    "embedded store: a read lease under the shortest taken (the linker renews at \
                     most every 50 ms): raised"
                );
            }
            l.max(Self::MIN_LEASE)
        });
        self
    }

    /// How long a read session lasts unless ended (`None`: until ended).
    pub fn lease(&self) -> Option<Duration> {
        self.lease
    }

    /// Whether session `token` is open (started here, not ended, not past its lease and
    /// ended by the store).
    pub(crate) fn session_open(&self, token: u64) -> bool {
        self.sessions.lock().contains_key(&token)
    }

    /// Ends the sessions whose lease is over (their end never came), letting go of their
    /// pins; how many it ended. Never called with a shard locked (it takes shard locks to
    /// unpin); `used` may be held (nothing takes `used` under `sessions`).
    fn end_expired(&self) -> usize {
        let Some(lease) = self.lease else {
            return 0;
        };
        let now = Instant::now();
        let expired: Vec<(u64, OpenSession)> = self
            .sessions
            .lock()
            .extract_if(|_, s| now.saturating_duration_since(s.started) >= lease)
            .collect();
        for (token, session) in &expired {
            warn!(
                token,
                keys = session.pins.len(),
                lease = ?lease,
                "embedded store: a read session outlived its lease without an end; its pins \
                 are let go"
            );
            self.unpin(&session.pins);
        }
        expired.len()
    }

    /// The most bytes of objects it holds.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held now.
    pub fn used_bytes(&self) -> u64 {
        *self.used.lock()
    }

    /// Objects held now.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.read().len()).sum()
    }

    /// True when no object is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    fn lookup(&self, key: &str) -> Option<Arc<[u8]>> {
        let shard = self.shards[shard_of(key)].read();
        let e = shard.get(key)?;
        e.last_used.store(self.tick(), Ordering::Relaxed);
        Some(e.data.clone())
    }

    /// Frees at least `need` bytes by evicting unpinned objects, oldest first; evicts nothing
    /// when even all of them would not free enough. Called with `used` locked, so evictions
    /// and reservations do not race, and no pin comes in between (pins are taken under it).
    ///
    /// Each round is two passes over the objects, copying no key: the last uses and sizes of
    /// the unpinned ones, from which a heap gives the oldest that free enough (the last of
    /// them sets a cut-off), then every unpinned object used at or before the cut-off goes.
    /// O(N + K log N) for K evictions among N objects (a scan per eviction was O(K x N) under
    /// the lock). An object read since the first pass is newer than the cut-off and stays;
    /// the next round then frees the rest (a few rounds at most, as reads must keep
    /// refreshing exactly the oldest objects to delay it).
    fn evict_for(&self, used: &mut u64, need: u64) -> bool {
        const ROUNDS: usize = 8;
        for _ in 0..ROUNDS {
            let short = (*used + need).saturating_sub(self.capacity);
            if short == 0 {
                return true;
            }
            let mut unpinned = 0u64;
            let mut ages = Vec::new();
            for shard in &self.shards {
                for e in shard.read().values().filter(|e| !Self::is_pinned(e)) {
                    unpinned += e.data.len() as u64;
                    ages.push(Reverse((e.last_used.load(Ordering::Relaxed), e.data.len())));
                }
            }
            if unpinned < short {
                return false;
            }
            let mut oldest_first = BinaryHeap::from(ages);
            let (mut freed, mut cut_off) = (0u64, 0u64);
            while freed < short {
                let Some(Reverse((t, len))) = oldest_first.pop() else {
                    break;
                };
                freed += len as u64;
                cut_off = t;
            }
            for shard in &self.shards {
                shard.write().retain(|key, e| {
                    let goes =
                        !Self::is_pinned(e) && e.last_used.load(Ordering::Relaxed) <= cut_off;
                    if goes {
                        *used -= e.data.len() as u64;
                        debug!(key, bytes = e.data.len(), "embedded store evicted");
                    }
                    !goes
                });
            }
        }
        *used + need <= self.capacity
    }

    fn put_one(&self, put: &ObjectPut<'_>) -> Result<PutOutcome, StoreError> {
        let len = put.len();
        if let Some(done) = self.admit(put.key, len) {
            return done;
        }
        let data = new_object(len as usize, |dst| {
            let mut rest = dst;
            for &(ptr, n) in &put.parts {
                if n == 0 {
                    continue;
                }
                if ptr.is_null() {
                    return Err(StoreError::InvalidArgument {
                        key: put.key.to_string(),
                        detail: "null source".into(),
                    });
                }
                // SAFETY: the caller of `put` promised each part is valid for reads of `n`
                // bytes and not written during the call (trait contract).
                let src = unsafe { std::slice::from_raw_parts(ptr, n) };
                // The parts' lengths sum to the object's (`put.len()`): `rest` holds `n`.
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
                head.copy_from_slice(src);
                rest = tail;
            }
            Ok(())
        })?;
        self.insert(put.key, data)
    }

    /// The answer to a put of `len` bytes at `key` that needs no bytes: already present, or
    /// too large for the store; `None` when the bytes should be stored.
    pub(crate) fn admit(&self, key: &str, len: u64) -> Option<Result<PutOutcome, StoreError>> {
        if self.shards[shard_of(key)].read().contains_key(key) {
            return Some(Ok(PutOutcome::AlreadyPresent));
        }
        if len > self.capacity {
            return Some(Err(StoreError::NoSpace {
                key: key.to_string(),
                detail: format!(
                    "object of {len} bytes exceeds the store's capacity of {} bytes",
                    self.capacity
                ),
            }));
        }
        None
    }

    /// Stores `data` at `key` (first write wins), evicting as needed: the store keeps the
    /// caller's buffer, no copy (make it with [`new_object`], filled in place).
    pub(crate) fn insert(&self, key: &str, data: Arc<[u8]>) -> Result<PutOutcome, StoreError> {
        let len = data.len() as u64;
        let mut used = self.used.lock();
        // Every insert holds `used`: a put of the same key that came first is seen here,
        // before anything is evicted for this one.
        if self.shards[shard_of(key)].read().contains_key(key) {
            return Ok(PutOutcome::AlreadyPresent);
        }
        if *used + len > self.capacity {
            // Sessions whose end never came give their room back first.
            self.end_expired();
        }
        if !self.evict_for(&mut used, len) {
            return Err(StoreError::NoSpace {
                key: key.to_string(),
                detail: format!(
                    "{len} bytes do not fit: {} of {} bytes held, all pinned",
                    *used, self.capacity
                ),
            });
        }
        let mut shard = self.shards[shard_of(key)].write();
        *used += len;
        let now = self.tick();
        shard.insert(
            key.to_string(),
            Entry {
                data,
                last_used: AtomicU64::new(now),
                pins: AtomicU32::new(0),
                generation: now,
            },
        );
        Ok(PutOutcome::Written)
    }

    /// An object's bytes, shared (not copied), marked as used.
    pub(crate) fn object(&self, key: &str) -> Option<Arc<[u8]>> {
        self.lookup(key)
    }

    fn not_found(key: &str) -> StoreError {
        StoreError::NotFound {
            key: key.to_string(),
        }
    }

    /// Pins those of `keys` that are present, each object once per occurrence. Under `used`,
    /// as evictions are: an object an eviction chose is never pinned before it goes, and a
    /// put's check of what it could evict holds while it evicts.
    fn pin_present(&self, keys: &[&str]) -> SessionPins {
        let _evictions = self.used.lock();
        keys.iter()
            .filter_map(|k| {
                let shard = self.shards[shard_of(k)].read();
                let e = shard.get(*k)?;
                e.pins.fetch_add(1, Ordering::AcqRel);
                Some((k.to_string(), e.generation))
            })
            .collect()
    }

    /// Takes back one pin of each object of `pins` still held (never below zero).
    fn unpin(&self, pins: &SessionPins) {
        for (k, generation) in pins {
            if let Some(e) = self.shards[shard_of(k)].read().get(k.as_str()) {
                if e.generation == *generation {
                    let _ = e
                        .pins
                        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |p| p.checked_sub(1));
                }
            }
        }
    }

    fn is_pinned(e: &Entry) -> bool {
        e.pins.load(Ordering::Acquire) > 0
    }

    /// Removes `key` (only when unpinned unless `force`).
    fn remove_one(&self, key: &str, force: bool) -> Result<(), StoreError> {
        // `used` first, as `insert` takes it: an eviction (under `used`) then never sees bytes
        // counted that are in no shard any more.
        let mut used = self.used.lock();
        let mut shard = self.shards[shard_of(key)].write();
        let e = shard.get(key).ok_or_else(|| Self::not_found(key))?;
        if !force && Self::is_pinned(e) {
            return Err(StoreError::Lease {
                key: key.to_string(),
                detail: "pinned by a read session".into(),
            });
        }
        let Some(e) = shard.remove(key) else {
            return Err(Self::not_found(key));
        };
        drop(shard);
        *used -= e.data.len() as u64;
        Ok(())
    }
}

// SAFETY: every read and write copies between the caller's memory and the store's own on
// the calling thread, within the call; the store starts no thread that touches caller memory.
unsafe impl KvStore for EmbeddedStore {
    fn name(&self) -> &str {
        "embedded"
    }

    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        keys.iter()
            .map(|k| Ok(self.shards[shard_of(k)].read().contains_key(*k)))
            .collect()
    }

    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
        keys.iter()
            .map(|k| {
                self.shards[shard_of(k)]
                    .read()
                    .get(*k)
                    .map(|e| e.data.len() as u64)
                    .ok_or_else(|| Self::not_found(k))
            })
            .collect()
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        gets.iter()
            .map(|g| {
                let data = self.lookup(g.key).ok_or_else(|| Self::not_found(g.key))?;
                if data.len() > g.len || g.dst.is_null() {
                    return Err(StoreError::InvalidArgument {
                        key: g.key.to_string(),
                        detail: format!("object of {} bytes, buffer of {}", data.len(), g.len),
                    });
                }
                // SAFETY: the caller promised `dst` is valid for writes of `g.len` >=
                // data.len() bytes and not accessed by others; `data` is our own allocation,
                // so the two cannot overlap.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), g.dst, data.len()) };
                Ok(data.len() as u64)
            })
            .collect()
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // SAFETY: the caller's own promise, for the same call.
        unsafe { self.get_ranges_checksummed(gets, &mut []) }
    }

    // Every range is a copy out of the store's own memory: each one's checksum is taken of
    // its destination right after the copy wrote it (still in cache), when `sums` asks.
    unsafe fn get_ranges_checksummed(
        &self,
        gets: &[RangedGet<'_>],
        sums: &mut [RangeChecksums],
    ) -> Vec<Result<u64, StoreError>> {
        let hash = sums.len() == gets.len();
        gets.iter()
            .enumerate()
            .map(|(i, g)| {
                let data = self.lookup(g.key).ok_or_else(|| Self::not_found(g.key))?;
                let mut sums = sums
                    .get_mut(i)
                    .filter(|s| hash && s.len() == g.ranges.len());
                let mut done = 0u64;
                for (j, r) in g.ranges.iter().enumerate() {
                    let end = r.offset.checked_add(r.len as u64);
                    if end.is_none_or(|e| e > data.len() as u64) || r.dst.is_null() {
                        return Err(StoreError::InvalidArgument {
                            key: g.key.to_string(),
                            detail: format!(
                                "range {}+{} outside an object of {} bytes",
                                r.offset,
                                r.len,
                                data.len()
                            ),
                        });
                    }
                    // SAFETY: the range was checked to lie inside `data`; the caller promised
                    // `dst` is valid for writes of `r.len` bytes and not accessed by others.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr().add(r.offset as usize),
                            r.dst,
                            r.len,
                        )
                    };
                    if let Some(s) = sums.as_deref_mut() {
                        // SAFETY: `dst` was just written with `r.len` bytes and no one else
                        // touches it until this call returns (the caller's promise).
                        let landed = unsafe { std::slice::from_raw_parts(r.dst, r.len) };
                        s[j] = Some(kv_geometry::layer_checksum(landed));
                    }
                    done += r.len as u64;
                }
                Ok(done)
            })
            .collect()
    }

    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
        puts.iter().map(|p| self.put_one(p)).collect()
    }

    fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        let mut expired_ended = false;
        keys.iter()
            .map(|k| match self.remove_one(k, false) {
                // A pin of a session whose end never came goes once its lease is over.
                Err(StoreError::Lease { .. }) if !expired_ended => {
                    expired_ended = true;
                    self.end_expired();
                    self.remove_one(k, false)
                }
                r => r,
            })
            .collect()
    }

    fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        keys.iter().map(|k| self.remove_one(k, true)).collect()
    }

    unsafe fn register(&self, _region: MemoryRegion) -> Result<(), StoreError> {
        Ok(())
    }

    fn unregister(&self, _region: MemoryRegion) -> Result<(), StoreError> {
        Ok(())
    }

    /// Pins every key, or fails with the first absent one's `NotFound` and pins nothing, as
    /// Mooncake's session start does (it resolves every key's replicas).
    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        // Sessions whose end never came do not pile up in the table.
        self.end_expired();
        let token = self.next_session.fetch_add(1, Ordering::Relaxed);
        // The lease runs from before the pins are taken, as the caller counts it.
        let started = Instant::now();
        let pins = self.pin_present(keys);
        if pins.len() < keys.len() {
            let absent = first_absent(keys, &pins).map_or_else(String::new, |k| k.to_string());
            self.unpin(&pins);
            return Err(StoreError::NotFound { key: absent });
        }
        self.sessions
            .lock()
            .insert(token, OpenSession { pins, started });
        Ok(ReadSession {
            keys: keys.iter().map(|k| k.to_string()).collect(),
            lease: self.lease,
            token,
        })
    }

    /// Lets go of what the session pinned; a session ended before, or not started here,
    /// lets go of nothing.
    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        let open = self.sessions.lock().remove(&session.token);
        match open {
            Some(open) => self.unpin(&open.pins),
            None => debug!(
                token = session.token,
                "embedded store: a session ended that is not open (ended before, or past its \
                 lease)"
            ),
        }
        Ok(())
    }

    fn health(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::ReadRange;

    /// The first key the pins lack, by one walk: as the search over every pin it replaced
    /// (quadratic: a million-key session with one key absent took minutes), with repeated
    /// keys, absent keys first, last, or none.
    #[test]
    fn the_first_absent_key_is_found_in_one_walk() {
        let naive = |keys: &[&str], pins: &SessionPins| -> Option<String> {
            let mut left: Vec<&str> = pins.iter().map(|(k, _)| k.as_str()).collect();
            keys.iter()
                .find(|k| match left.iter().position(|p| p == *k) {
                    Some(i) => {
                        left.remove(i);
                        false
                    }
                    None => true,
                })
                .map(|k| k.to_string())
        };
        let cases: [(&[&str], &[usize]); 6] = [
            (&["a", "b", "c"], &[0, 1, 2]),
            (&["a", "b", "c"], &[1, 2]),
            (&["a", "b", "c"], &[0, 1]),
            (&["a", "a", "b"], &[0, 2]),
            (&["a", "a", "b"], &[0, 1]),
            (&[], &[]),
        ];
        for (keys, present) in cases {
            let pins: SessionPins = present.iter().map(|&i| (keys[i].to_string(), 1)).collect();
            assert_eq!(
                first_absent(keys, &pins).map(str::to_string),
                naive(keys, &pins),
                "{keys:?} {present:?}"
            );
        }
        let many: Vec<String> = (0..200_000).map(|i| format!("k{i}")).collect();
        let keys: Vec<&str> = many.iter().map(String::as_str).collect();
        let pins: SessionPins = many[..many.len() - 1]
            .iter()
            .map(|k| (k.clone(), 1))
            .collect();
        assert_eq!(first_absent(&keys, &pins), Some("k199999"));
    }

    fn put(store: &EmbeddedStore, key: &str, data: &[u8]) -> Result<PutOutcome, StoreError> {
        let p = ObjectPut {
            key,
            parts: [(data.as_ptr(), data.len())].into_iter().collect(),
        };
        // SAFETY: `data` is a live slice, read-only for the call.
        unsafe { store.put(&[p]) }.remove(0)
    }

    fn get(store: &EmbeddedStore, key: &str, n: usize) -> Result<Vec<u8>, StoreError> {
        let mut out = vec![0u8; n];
        let g = ObjectGet {
            key,
            dst: out.as_mut_ptr(),
            len: n,
        };
        // SAFETY: `out` is ours, n bytes long, untouched during the call.
        let got = unsafe { store.get_into(&[g]) }.remove(0)?;
        out.truncate(got as usize);
        Ok(out)
    }

    #[test]
    fn first_write_wins_and_round_trips() {
        let s = EmbeddedStore::new(1000);
        assert_eq!(put(&s, "a", &[1, 2, 3]), Ok(PutOutcome::Written));
        assert_eq!(put(&s, "a", &[9, 9, 9]), Ok(PutOutcome::AlreadyPresent));
        assert_eq!(get(&s, "a", 10).unwrap(), vec![1, 2, 3]);
        assert_eq!(s.used_bytes(), 3);
        assert_eq!(s.exists(&["a", "b"]), vec![Ok(true), Ok(false)]);
        assert_eq!(s.object_size(&["a"]), vec![Ok(3)]);
        assert!(matches!(get(&s, "b", 3), Err(StoreError::NotFound { key }) if key == "b"));
    }

    #[test]
    fn lru_evicts_oldest_unpinned_and_refuses_what_cannot_fit() {
        let s = EmbeddedStore::new(30);
        put(&s, "a", &[0; 10]).unwrap();
        put(&s, "b", &[0; 10]).unwrap();
        put(&s, "c", &[0; 10]).unwrap();
        get(&s, "a", 10).unwrap(); // a is now newer than b
        put(&s, "d", &[0; 10]).unwrap();
        assert_eq!(
            s.exists(&["a", "b", "c", "d"]),
            vec![Ok(true), Ok(false), Ok(true), Ok(true)]
        );
        let err = put(&s, "huge", &[0; 31]).unwrap_err();
        assert!(matches!(&err, StoreError::NoSpace { key, .. } if key == "huge"));
        assert!(err.to_string().contains("exceeds the store's capacity"));
        // Pinned objects are never evicted.
        let sess = s.start_session(&["a", "c", "d"]).unwrap();
        assert!(matches!(
            put(&s, "e", &[0; 10]),
            Err(StoreError::NoSpace { .. })
        ));
        s.end_session(&sess).unwrap();
        assert_eq!(put(&s, "e", &[0; 10]), Ok(PutOutcome::Written));
        assert_eq!(s.used_bytes(), 30);
    }

    /// One put that needs the room of thousands of small objects evicts exactly the oldest
    /// (the rewrite's own check: it passes on the old code too, which took 5.2 s here, a
    /// scan of every object per object evicted, where this takes well under a second).
    #[test]
    fn one_put_evicts_thousands_of_objects_oldest_first() {
        let s = EmbeddedStore::new(20_000);
        for i in 0..20_000 {
            put(&s, &format!("o{i}"), &[1]).unwrap();
        }
        get(&s, "o0", 1).unwrap(); // the oldest is now the newest
        assert_eq!(put(&s, "big", &[0; 15_000]), Ok(PutOutcome::Written));
        assert_eq!(s.len(), 5_001);
        assert_eq!(s.used_bytes(), 20_000);
        let kept = |k: &str| s.exists(&[k])[0] == Ok(true);
        assert!(kept("o0") && kept("o19999") && kept("o15001"));
        assert!(!kept("o1") && !kept("o15000"));
    }

    proptest::proptest! {
        /// Puts and gets against a model LRU list: the store holds what the model holds.
        #[test]
        fn eviction_follows_least_recent_use(
            ops in proptest::collection::vec((0u8..12, 0usize..=11, proptest::bool::ANY), 1..60),
        ) {
            let s = EmbeddedStore::new(30);
            // Oldest use first: (key, size).
            let mut model: Vec<(String, usize)> = Vec::new();
            for (k, size, is_put) in ops {
                let key = format!("k{k}");
                let at = model.iter().position(|(m, _)| *m == key);
                if is_put {
                    let got = put(&s, &key, &vec![k; size]);
                    match at {
                        Some(_) => proptest::prop_assert_eq!(got, Ok(PutOutcome::AlreadyPresent)),
                        None if size > 30 => proptest::prop_assert!(got.is_err()),
                        None => {
                            proptest::prop_assert_eq!(got, Ok(PutOutcome::Written));
                            while model.iter().map(|(_, n)| n).sum::<usize>() + size > 30 {
                                model.remove(0);
                            }
                            model.push((key, size));
                        }
                    }
                } else {
                    let got = get(&s, &key, 16);
                    proptest::prop_assert_eq!(got.is_ok(), at.is_some());
                    if let Some(at) = at {
                        let used = model.remove(at);
                        model.push(used);
                    }
                }
                for k in 0..12u8 {
                    let key = format!("k{k}");
                    let held = model.iter().any(|(m, _)| *m == key);
                    proptest::prop_assert_eq!(s.exists(&[key.as_str()]), vec![Ok(held)], "{}", key);
                }
            }
        }
    }

    #[test]
    fn a_put_that_cannot_fit_evicts_nothing() {
        let s = EmbeddedStore::new(30);
        for k in ["a", "b", "c"] {
            put(&s, k, &[0; 10]).unwrap();
        }
        let _pin = s.start_session(&["a"]).unwrap();
        // 25 bytes need 25 free; b and c give only 20: before, both were evicted anyway.
        assert!(matches!(
            put(&s, "d", &[0; 25]),
            Err(StoreError::NoSpace { .. })
        ));
        assert_eq!(
            s.exists(&["a", "b", "c"]),
            vec![Ok(true), Ok(true), Ok(true)]
        );
        assert_eq!(s.used_bytes(), 30);
    }

    /// Fills the store with unpinned objects so that only pinned ones survive.
    fn flush(s: &EmbeddedStore, n: usize) {
        for i in 0..n {
            put(s, &format!("filler-{i}"), &[0; 10]).unwrap();
        }
    }

    #[test]
    fn a_session_lets_go_only_of_the_objects_it_pinned() {
        let s = EmbeddedStore::new(30);
        // A session over an absent key is refused, as Mooncake refuses it, and pins nothing
        // (not even the keys present): before, it pinned what was there and said `Ok`.
        put(&s, "j", &[2; 10]).unwrap();
        assert!(matches!(
            s.start_session(&["j", "k"]),
            Err(StoreError::NotFound { key }) if key == "k"
        ));
        let early = s.start_session(&["j"]).unwrap();
        put(&s, "k", &[1; 10]).unwrap();
        let later = s.start_session(&["k"]).unwrap();
        // Ending a session on other objects takes nothing of `k`'s pin.
        s.end_session(&early).unwrap();
        flush(&s, 4);
        assert_eq!(
            s.exists(&["k"]),
            vec![Ok(true)],
            "the later session's pin held"
        );
        assert_eq!(
            s.exists(&["j"]),
            vec![Ok(false)],
            "the refused start pinned nothing"
        );
        // Ended twice: the second end takes nothing.
        let other = s.start_session(&["k"]).unwrap();
        s.end_session(&later).unwrap();
        s.end_session(&later).unwrap();
        flush(&s, 4);
        assert_eq!(
            s.exists(&["k"]),
            vec![Ok(true)],
            "the other session's pin held"
        );
        s.end_session(&other).unwrap();
        flush(&s, 4);
        assert_eq!(s.exists(&["k"]), vec![Ok(false)], "unpinned at last");
    }

    #[test]
    fn a_session_does_not_let_go_of_an_object_written_again_since() {
        let s = EmbeddedStore::new(30);
        put(&s, "k", &[1; 10]).unwrap();
        let first = s.start_session(&["k"]).unwrap();
        assert_eq!(
            s.discard(&["k"]),
            vec![Ok(())],
            "discard takes a pinned object"
        );
        put(&s, "k", &[2; 10]).unwrap();
        let second = s.start_session(&["k"]).unwrap();
        s.end_session(&first).unwrap();
        flush(&s, 4);
        assert_eq!(
            get(&s, "k", 10).unwrap(),
            vec![2; 10],
            "still pinned by the second"
        );
        s.end_session(&second).unwrap();
    }

    /// A lease under the shortest taken (100 ms) is raised to it: a zero
    /// one ended every open session at the next start, under a load still reading.
    #[test]
    fn a_lease_too_short_to_renew_is_raised_to_the_shortest() {
        let s = EmbeddedStore::new(20).with_lease(Some(Duration::ZERO));
        assert_eq!(s.lease(), Some(EmbeddedStore::MIN_LEASE));
        put(&s, "a", &[1; 10]).unwrap();
        put(&s, "b", &[2; 10]).unwrap();
        let t0 = Instant::now();
        let first = s.start_session(&["a"]).unwrap();
        let second = s.start_session(&["b"]).unwrap();
        // Within the raised lease (a machine stalled past it checks nothing here).
        if t0.elapsed() < EmbeddedStore::MIN_LEASE / 2 {
            assert!(
                s.session_open(first.token),
                "the first session outlives the second's start"
            );
        }
        s.end_session(&first).unwrap();
        s.end_session(&second).unwrap();
        let longer = EmbeddedStore::new(20).with_lease(Some(Duration::from_secs(3)));
        assert_eq!(longer.lease(), Some(Duration::from_secs(3)));
    }

    /// A session whose end never comes (its caller gave up on the call, or the end failed)
    /// pins its objects until its lease is over, then gives their room to a put and lets a
    /// `remove` take them; its late end does nothing. Before, the store had no lease: such a
    /// session pinned its objects for the store's life, and once they filled it every put
    /// failed `NoSpace`.
    #[test]
    fn a_session_never_ended_lets_go_at_the_end_of_its_lease() {
        let lease = Duration::from_millis(100);
        let s = EmbeddedStore::new(20).with_lease(Some(lease));
        put(&s, "a", &[1; 10]).unwrap();
        put(&s, "b", &[2; 10]).unwrap();
        let left = s.start_session(&["a", "b"]).unwrap();
        assert_eq!(left.lease, Some(lease));
        std::thread::sleep(lease + Duration::from_millis(50));
        // The put needs a's room: the session is over, a (the oldest) goes.
        assert_eq!(put(&s, "c", &[3; 10]), Ok(PutOutcome::Written));
        assert_eq!(
            s.exists(&["a", "b", "c"]),
            vec![Ok(false), Ok(true), Ok(true)]
        );
        // Its pin of b went too.
        assert_eq!(s.remove(&["b"]), vec![Ok(())]);
        // The late end lets go of nothing (c was never its pin; b's pin is not taken twice).
        let c_pin = s.start_session(&["c"]).unwrap();
        s.end_session(&left).unwrap();
        assert!(matches!(
            &s.remove(&["c"])[0],
            Err(StoreError::Lease { .. })
        ));
        s.end_session(&c_pin).unwrap();
        assert_eq!(s.remove(&["c"]), vec![Ok(())]);
        assert_eq!(s.used_bytes(), 0);
    }

    /// Within its lease a session keeps its pins (a put that needs their room is refused, a
    /// remove too), and one without a lease keeps them until ended; a renewal (a session
    /// started again over the keys before the first ends) keeps them past the first's lease.
    #[test]
    fn a_session_keeps_its_pins_within_its_lease_and_a_renewal_extends_them() {
        assert_eq!(
            EmbeddedStore::new(1).lease(),
            Some(EmbeddedStore::DEFAULT_LEASE)
        );
        for lease in [None, Some(Duration::from_secs(30))] {
            let s = EmbeddedStore::new(10).with_lease(lease);
            put(&s, "a", &[1; 10]).unwrap();
            let pin = s.start_session(&["a"]).unwrap();
            assert_eq!(pin.lease, lease);
            assert!(matches!(
                put(&s, "b", &[2; 10]),
                Err(StoreError::NoSpace { .. })
            ));
            assert!(matches!(
                &s.remove(&["a"])[0],
                Err(StoreError::Lease { .. })
            ));
            s.end_session(&pin).unwrap();
        }
        // Renewed at 0.6 of the lease, checked at 1.2 of the first's: 0.4 of a lease (800 ms)
        // of room for a late wake-up.
        let lease = Duration::from_secs(2);
        let s = EmbeddedStore::new(10).with_lease(Some(lease));
        put(&s, "a", &[1; 10]).unwrap();
        let first = s.start_session(&["a"]).unwrap();
        std::thread::sleep(lease * 6 / 10);
        let renewed = s.start_session(&["a"]).unwrap();
        s.end_session(&first).unwrap();
        std::thread::sleep(lease * 6 / 10);
        assert!(matches!(
            put(&s, "b", &[2; 10]),
            Err(StoreError::NoSpace { .. })
        ));
        s.end_session(&renewed).unwrap();
        assert_eq!(put(&s, "b", &[2; 10]), Ok(PutOutcome::Written));
    }

    #[test]
    fn remove_refuses_a_pinned_object_and_discard_takes_it() {
        let s = EmbeddedStore::new(30);
        put(&s, "k", &[1; 10]).unwrap();
        let pin = s.start_session(&["k"]).unwrap();
        assert!(matches!(
            &s.remove(&["k"])[0],
            Err(StoreError::Lease { key, .. }) if key == "k"
        ));
        assert_eq!(s.exists(&["k"]), vec![Ok(true)]);
        s.end_session(&pin).unwrap();
        assert_eq!(s.remove(&["k"]), vec![Ok(())]);
        assert_eq!(s.used_bytes(), 0);
    }

    #[test]
    fn ranged_reads_check_bounds() {
        let s = EmbeddedStore::new(100);
        put(&s, "o", &(0u8..20).collect::<Vec<_>>()).unwrap();
        let mut a = [0u8; 4];
        let mut b = [0u8; 3];
        let g = RangedGet {
            key: "o",
            ranges: [
                ReadRange {
                    dst: a.as_mut_ptr(),
                    len: 4,
                    offset: 16,
                },
                ReadRange {
                    dst: b.as_mut_ptr(),
                    len: 3,
                    offset: 2,
                },
            ]
            .into_iter()
            .collect(),
        };
        // SAFETY: a and b are live, distinct, untouched during the call.
        assert_eq!(unsafe { s.get_ranges(&[g]) }, vec![Ok(7)]);
        assert_eq!((a, b), ([16, 17, 18, 19], [2, 3, 4]));
        let bad = RangedGet {
            key: "o",
            ranges: [ReadRange {
                dst: a.as_mut_ptr(),
                len: 4,
                offset: 17,
            }]
            .into_iter()
            .collect(),
        };
        // SAFETY: as above.
        let r = unsafe { s.get_ranges(&[bad]) };
        assert!(matches!(&r[0], Err(StoreError::InvalidArgument { .. })));
    }

    #[test]
    fn remove_frees_space() {
        let s = EmbeddedStore::new(10);
        put(&s, "a", &[0; 10]).unwrap();
        assert_eq!(
            s.remove(&["a", "a"]),
            vec![Ok(()), Err(EmbeddedStore::not_found("a"))]
        );
        assert_eq!(s.used_bytes(), 0);
        assert!(s.is_empty());
    }

    #[test]
    fn concurrent_readers_and_writers() {
        let s = Arc::new(EmbeddedStore::new(1 << 20));
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let s = &s;
                sc.spawn(move || {
                    for i in 0..200u32 {
                        let key = format!("k{}", i % 50);
                        let _ = put(s, &key, &[t; 64]);
                        if let Ok(v) = get(s, &key, 64) {
                            // Whoever wrote first, the object is whole and one writer's.
                            assert!(v.len() == 64 && v.iter().all(|&x| x == v[0]));
                        }
                    }
                });
            }
        });
        assert_eq!(s.len(), 50);
    }

    #[test]
    fn ranged_reads_give_each_range_the_checksum_of_the_bytes_it_landed() {
        let store = EmbeddedStore::new(1 << 16);
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 7) as u8).collect();
        assert_eq!(put(&store, "obj", &data), Ok(PutOutcome::Written));
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 300];
        let get = RangedGet {
            key: "obj",
            ranges: [(&mut a, 1000u64), (&mut b, 2000)]
                .into_iter()
                .map(|(d, offset)| ReadRange {
                    dst: d.as_mut_ptr(),
                    len: d.len(),
                    offset,
                })
                .collect(),
        };
        let missing = RangedGet {
            key: "missing",
            ranges: Default::default(),
        };
        let mut sums = vec![smallvec::smallvec![None; 2], RangeChecksums::new()];
        // SAFETY: `a` and `b` are live, distinct and untouched during the call.
        let got = unsafe { store.get_ranges_checksummed(&[get.clone(), missing], &mut sums) };
        assert_eq!(got[0], Ok(400));
        assert!(got[1].is_err());
        let (a_sum, b_sum) = (
            kv_geometry::layer_checksum(&a),
            kv_geometry::layer_checksum(&b),
        );
        assert_eq!(a[..], data[1000..1100]);
        assert_eq!(sums[0].as_slice(), &[Some(a_sum), Some(b_sum)]);
        // Checksums not shaped as the gets: none set, the read still done.
        let mut wrong = vec![smallvec::smallvec![None; 1]];
        // SAFETY: as above.
        let got = unsafe { store.get_ranges_checksummed(std::slice::from_ref(&get), &mut wrong) };
        assert_eq!(got, vec![Ok(400)]);
        assert_eq!(wrong[0].as_slice(), &[None]);
        let mut short: Vec<RangeChecksums> = Vec::new();
        // SAFETY: as above.
        let got = unsafe { store.get_ranges_checksummed(std::slice::from_ref(&get), &mut short) };
        assert_eq!(got, vec![Ok(400)]);
    }

    /// A put's object is allocated once, at its size, and kept as it is: the store's entry is
    /// the very buffer the put filled (no `Vec` turned into an `Arc` by a copy).
    #[test]
    fn an_object_is_kept_in_the_buffer_it_was_filled_in() {
        let store = EmbeddedStore::new(1 << 10);
        let data = new_object(6, |d| {
            d.copy_from_slice(b"abcdef");
            Ok::<_, StoreError>(())
        })
        .unwrap();
        let at = Arc::as_ptr(&data);
        assert_eq!(store.insert("k", data), Ok(PutOutcome::Written));
        let kept = store.object("k").unwrap();
        assert!(std::ptr::eq(Arc::as_ptr(&kept), at));
        assert_eq!(&kept[..], b"abcdef");
        // A put of several parts fills the object in order.
        let (a, b) = (b"01".to_vec(), b"2345".to_vec());
        let p = ObjectPut {
            key: "two",
            parts: [
                (a.as_ptr(), a.len()),
                (std::ptr::null(), 0),
                (b.as_ptr(), b.len()),
            ]
            .into_iter()
            .collect(),
        };
        // SAFETY: both parts are live vectors, unchanged during the call.
        assert_eq!(unsafe { store.put(&[p]) }, vec![Ok(PutOutcome::Written)]);
        assert_eq!(&store.object("two").unwrap()[..], b"012345");
        // A failed fill stores nothing.
        let failed = new_object(4, |_| Err(StoreError::RpcTimeout { key: "x".into() }));
        assert!(failed.is_err());
    }
}
