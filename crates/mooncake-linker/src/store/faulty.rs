//! A [`KvStore`] wrapper that injects failures into chosen calls: fault injection for tests
//! of every failure rule (and for engines' own tests).

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use super::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangeChecksums, RangedGet, ReadRange,
    ReadSession, StoreError,
};

/// Longest a [`Fault::Stall`] holds a call when it is never released (so a forgotten stall
/// cannot keep a test's threads for ever).
pub const STALL_LIMIT: Duration = Duration::from_secs(600);

/// A switch that holds every call a [`Fault::Stall`] hits until [`release`](Stall::release):
/// a store call that hangs.
///
/// ```
/// use mooncake_linker::store::Stall;
/// let s = Stall::new();
/// assert!(!s.released());
/// s.release();
/// assert!(s.released());
/// ```
#[derive(Debug, Clone, Default)]
pub struct Stall(Arc<(Mutex<bool>, Condvar)>, Arc<AtomicU32>);

impl Stall {
    /// A stall that holds calls until released.
    pub fn new() -> Self {
        Stall::default()
    }

    /// Lets every held call (and every later one) go on.
    pub fn release(&self) {
        *self.0 .0.lock() = true;
        self.0 .1.notify_all();
    }

    /// True once released.
    pub fn released(&self) -> bool {
        *self.0 .0.lock()
    }

    /// Keys it has held so far, over every call (a test waits for this to know a call is
    /// stuck).
    pub fn hits(&self) -> u32 {
        self.1.load(Ordering::Acquire)
    }

    /// Holds the calling thread until released (at most [`STALL_LIMIT`]).
    fn hold(&self) {
        self.1.fetch_add(1, Ordering::AcqRel);
        let deadline = kv_loader::deadline_after(STALL_LIMIT);
        let mut released = self.0 .0.lock();
        while !*released {
            if self.0 .1.wait_until(&mut released, deadline).timed_out() {
                break;
            }
        }
    }
}

/// What an injected fault does to a matching call.
#[derive(Debug, Clone)]
pub enum Fault {
    /// The key fails with this error. On reads, puts, `exists` and `object_size` the inner
    /// store's call still runs (a put is written): a store that reports a failure for a call it
    /// carried out. On `discard` the key is left in the store, and `start_session`,
    /// `end_session`, `register` and `unregister` fail before they reach the store.
    Error(StoreError),
    /// The key's read returns one byte less than asked (a short read; reads only).
    Short,
    /// The key's ranged read lands with the first byte of one range flipped (the range at the
    /// rule's `offset`, else the first with bytes), and no checksum taken as it landed (a
    /// transfer that corrupted the bytes on their way; ranged reads only).
    Corrupt,
    /// The call sleeps this long (per matching key) first (a slow store), then runs normally.
    Delay(Duration),
    /// The call waits until the stall is released (a hung store call), then runs normally.
    Stall(Stall),
    /// The call panics (a defect in the store or the client library under it), once per
    /// call, before it reaches the store.
    Panic,
    /// The store goes down: this call and every later one of any kind fail with
    /// [`StoreError::Unavailable`] until [`FaultyStore::clear`] (ending sessions still
    /// reaches the store, so that its pins are let go).
    Down,
}

/// Which calls a rule hits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultCall {
    /// Ranged reads (`get_ranges`) of objects (not of checksum companions): what
    /// [`FaultyStore::inject`] hits.
    Read,
    /// Reads of checksum companions (keys ending in
    /// [`CHECKSUM_KEY_SUFFIX`](kv_geometry::CHECKSUM_KEY_SUFFIX)), ranged or whole (the
    /// linker reads them whole, `get_into`).
    Checksums,
    /// Whole-object reads (`get_into`) of any key, checksum companions included.
    ReadWhole,
    /// `exists` (lookups, saves).
    Exists,
    /// `object_size`.
    Size,
    /// `start_session`.
    Session,
    /// `end_session` (a store down still lets it through, so pins are let go).
    EndSession,
    /// `put`.
    Put,
    /// `discard` (a key the fault hits is not discarded).
    Discard,
    /// Every call above (not the two below).
    Any,
    /// `register`: the key a rule matches is the region, `memory 0x<addr>+<len>`. An error,
    /// or `Down` from a rule on this call, fails it before it reaches the store (nothing is
    /// registered); a store taken down by a rule on other calls still lets it through.
    Register,
    /// `unregister` (same key and rules): a failed one leaves the region registered.
    Unregister,
}

/// Which keys a fault hits: all conditions given must match.
#[derive(Debug, Clone, Default)]
pub struct FaultRule {
    /// Only keys containing this text.
    pub key_contains: Option<String>,
    /// Only ranges starting at this byte offset of the object (picks a layer; ranged reads
    /// only).
    pub offset: Option<u64>,
    /// How many matching keys to hit before the rule is spent (`None`: forever).
    pub times: Option<u32>,
    /// How many matching keys pass untouched before the rule hits (0: from the first).
    pub skip: u32,
}

struct Armed {
    call: FaultCall,
    rule: FaultRule,
    fault: Fault,
    hits: AtomicU32,
    /// Matching keys seen (for `skip`).
    seen: AtomicU32,
}

impl Armed {
    fn matches(&self, call: FaultCall, key: &str, ranges: &[ReadRange]) -> bool {
        let companion = key.ends_with(kv_geometry::CHECKSUM_KEY_SUFFIX);
        let hits_call = match self.call {
            FaultCall::Any => !matches!(call, FaultCall::Register | FaultCall::Unregister),
            FaultCall::Checksums => {
                companion && matches!(call, FaultCall::Read | FaultCall::ReadWhole)
            }
            FaultCall::Read => call == FaultCall::Read && !companion,
            own => own == call,
        };
        if !hits_call {
            return false;
        }
        if let Some(k) = &self.rule.key_contains {
            if !key.contains(k.as_str()) {
                return false;
            }
        }
        if let Some(off) = self.rule.offset {
            if !ranges.iter().any(|r| r.offset == off) {
                return false;
            }
        }
        if self.rule.skip > 0
            && self
                .seen
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < self.rule.skip).then_some(n + 1)
                })
                .is_ok()
        {
            return false;
        }
        match self.rule.times {
            None => {
                let _ = self
                    .hits
                    .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                        Some(h.saturating_add(1))
                    });
                true
            }
            Some(t) => self
                .hits
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                    (h < t).then_some(h + 1)
                })
                .is_ok(),
        }
    }
}

/// Wraps a store and fails, shortens, delays or holds the calls that match its rules, or
/// takes the store down; every other call passes through untouched.
///
/// ```
/// use std::sync::Arc;
/// use mooncake_linker::store::{EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore, StoreError};
/// let faulty = FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20)));
/// faulty.inject(
///     FaultRule { key_contains: Some("_k".into()), ..FaultRule::default() },
///     Fault::Error(StoreError::RpcTimeout { key: "injected".into() }),
/// );
/// faulty.inject_on(FaultCall::Exists, FaultRule::default(), Fault::Down);
/// assert_eq!(faulty.name(), "embedded+faults");
/// assert!(faulty.exists(&["a"])[0].is_err());
/// assert!(faulty.health().is_err());
/// faulty.clear();
/// assert!(faulty.health().is_ok());
/// ```
pub struct FaultyStore {
    inner: Arc<dyn KvStore>,
    rules: Mutex<Vec<Arc<Armed>>>,
    down: AtomicBool,
    /// Counts [`clear`](FaultyStore::clear)s: a call that a delay or stall held across one
    /// applies no more of the rules it took before it.
    cleared: AtomicU64,
}

impl std::fmt::Debug for FaultyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyStore").finish_non_exhaustive()
    }
}

/// A fault hit by a call, key by key.
type Hits = Vec<Option<Fault>>;

impl FaultyStore {
    /// A pass-through wrapper until rules are injected.
    pub fn new(inner: Arc<dyn KvStore>) -> Self {
        FaultyStore {
            inner,
            rules: Mutex::new(Vec::new()),
            down: AtomicBool::new(false),
            cleared: AtomicU64::new(0),
        }
    }

    /// Adds a rule for ranged reads.
    pub fn inject(&self, rule: FaultRule, fault: Fault) {
        self.inject_on(FaultCall::Read, rule, fault);
    }

    /// Adds a rule for the calls `call` names.
    pub fn inject_on(&self, call: FaultCall, rule: FaultRule, fault: Fault) {
        self.rules.lock().push(Arc::new(Armed {
            call,
            rule,
            fault,
            hits: AtomicU32::new(0),
            seen: AtomicU32::new(0),
        }));
    }

    /// Removes every rule, and brings the store back up. A call held by a delay or stall
    /// meanwhile applies none of its rules after that (it does not take the store down again
    /// once released).
    pub fn clear(&self) {
        let mut rules = self.rules.lock();
        rules.clear();
        self.cleared.fetch_add(1, Ordering::AcqRel);
        self.down.store(false, Ordering::Release);
    }

    /// Keys its rules' faults hit so far, over every rule in place (a demo or test checks
    /// that the fault it injected fired, not only what followed).
    pub fn faults_hit(&self) -> u32 {
        self.rules
            .lock()
            .iter()
            .map(|r| r.hits.load(Ordering::Acquire))
            .sum()
    }

    /// True while a [`Fault::Down`] holds.
    pub fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    fn unavailable() -> StoreError {
        StoreError::Unavailable {
            detail: "injected: the store is down".into(),
        }
    }

    /// The faults of a call over `keys` (with their read ranges, where it reads ranges): a
    /// delay or stall is served here (per matching key and rule), a `Down` takes the store
    /// down.
    fn hits<'a>(
        &self,
        call: FaultCall,
        keys: impl Iterator<Item = (&'a str, &'a [ReadRange])>,
    ) -> Hits {
        self.hits_at(call, keys)
            .into_iter()
            .map(|h| h.map(|(f, _)| f))
            .collect()
    }

    /// As [`hits`](Self::hits), each fault with the offset its rule picked (`None`: any).
    fn hits_at<'a>(
        &self,
        call: FaultCall,
        keys: impl Iterator<Item = (&'a str, &'a [ReadRange])>,
    ) -> Vec<Option<(Fault, Option<u64>)>> {
        let (rules, taken_at) = {
            let rules = self.rules.lock();
            (rules.clone(), self.cleared.load(Ordering::Acquire))
        };
        keys.map(|(key, ranges)| {
            let mut hit = None;
            for r in &rules {
                if self.cleared.load(Ordering::Acquire) != taken_at {
                    // Cleared while a delay or stall held this call: its rules are gone.
                    break;
                }
                if !r.matches(call, key, ranges) {
                    continue;
                }
                match &r.fault {
                    Fault::Delay(d) => std::thread::sleep(*d),
                    Fault::Stall(s) => s.hold(),
                    Fault::Panic => panic!("injected: the store call panics ({key})"),
                    Fault::Down => {
                        // Under the rules' lock, as `clear` brings the store up: a clear since
                        // this call took its rules wins.
                        let _rules = self.rules.lock();
                        if self.cleared.load(Ordering::Acquire) != taken_at {
                            break;
                        }
                        self.down.store(true, Ordering::Release);
                        hit = Some((Fault::Down, None));
                    }
                    f => hit = Some((f.clone(), r.rule.offset)),
                }
            }
            hit
        })
        .collect()
    }

    /// `results` with the faults of `hits` applied; every key fails while the store is down.
    /// A result that says the inner store's transfer may still use the key's memory
    /// ([`StoreError::may_still_transfer`]) is never replaced: the caller must keep that memory.
    fn apply<T>(
        &self,
        mut results: Vec<Result<T, StoreError>>,
        hits: Hits,
    ) -> Vec<Result<T, StoreError>>
    where
        T: ShortenBy,
    {
        let down = self.is_down();
        for (r, f) in results.iter_mut().zip(hits) {
            if r.as_ref().is_err_and(StoreError::may_still_transfer) {
                continue;
            }
            match f {
                _ if down => *r = Err(Self::unavailable()),
                Some(Fault::Error(e)) => *r = Err(e),
                Some(Fault::Short) => {
                    if let Ok(n) = r {
                        n.shorten();
                    }
                }
                _ => {}
            }
        }
        results
    }

    fn plain<'a>(keys: &'a [&'a str]) -> impl Iterator<Item = (&'a str, &'a [ReadRange])> {
        keys.iter().map(|k| (*k, &[][..]))
    }

    /// Every key fails: the store is down.
    fn all_down<T>(n: usize) -> Vec<Result<T, StoreError>> {
        (0..n).map(|_| Err(Self::unavailable())).collect()
    }
}

/// What a short read does to a result.
trait ShortenBy {
    fn shorten(&mut self);
}

impl ShortenBy for u64 {
    fn shorten(&mut self) {
        *self = self.saturating_sub(1);
    }
}

impl ShortenBy for bool {
    fn shorten(&mut self) {}
}

impl ShortenBy for PutOutcome {
    fn shorten(&mut self) {}
}

impl ShortenBy for () {
    fn shorten(&mut self) {}
}

impl FaultyStore {
    /// The faults a `register` or `unregister` of `region` hits, as the error to fail it with.
    fn registry_fault(&self, call: FaultCall, region: &MemoryRegion) -> Option<StoreError> {
        let key = region.to_string();
        let hit = self.hits(call, std::iter::once((key.as_str(), &[][..])));
        match hit.into_iter().next().flatten() {
            Some(Fault::Error(e)) => Some(e),
            Some(Fault::Down) => Some(Self::unavailable()),
            _ => None,
        }
    }
}

// SAFETY: every call goes to the inner store (or fails before it, touching nothing); a
// delay or stall holds the call itself; results the inner store marked as possibly still
// transferring (`Abandoned`) are returned as they are, never replaced by an injected fault.
unsafe impl KvStore for FaultyStore {
    unsafe fn register(&self, region: MemoryRegion) -> Result<(), StoreError> {
        if let Some(e) = self.registry_fault(FaultCall::Register, &region) {
            return Err(e);
        }
        // SAFETY: forwarded with the caller's promise.
        unsafe { self.inner.register(region) }
    }

    fn unregister(&self, region: MemoryRegion) -> Result<(), StoreError> {
        if let Some(e) = self.registry_fault(FaultCall::Unregister, &region) {
            return Err(e);
        }
        self.inner.unregister(region)
    }

    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        let keys: Vec<&str> = session.keys.iter().map(String::as_str).collect();
        let hits = self.hits(FaultCall::EndSession, Self::plain(&keys));
        if let Some(Some(Fault::Error(e))) = hits.into_iter().find(Option::is_some) {
            return Err(e);
        }
        self.inner.end_session(session)
    }

    fn name(&self) -> &str {
        match self.inner.name() {
            "embedded" => "embedded+faults",
            "mooncake" => "mooncake+faults",
            _ => "store+faults",
        }
    }

    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        let hits = self.hits(FaultCall::Exists, Self::plain(keys));
        if self.is_down() {
            return Self::all_down(keys.len());
        }
        self.apply(self.inner.exists(keys), hits)
    }

    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
        let hits = self.hits(FaultCall::Size, Self::plain(keys));
        if self.is_down() {
            return Self::all_down(keys.len());
        }
        let mut r = self.inner.object_size(keys);
        // A short read does not apply to sizes.
        let hits = hits
            .into_iter()
            .map(|h| h.filter(|f| !matches!(f, Fault::Short)))
            .collect();
        r = self.apply(r, hits);
        r
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let hits = self.hits(FaultCall::ReadWhole, gets.iter().map(|g| (g.key, &[][..])));
        if self.is_down() {
            return Self::all_down(gets.len());
        }
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_into(gets) };
        self.apply(r, hits)
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // SAFETY: the caller's own promise, for the same call.
        unsafe { self.get_ranges_checksummed(gets, &mut []) }
    }

    // Only `Corrupt` changes a byte the inner store wrote (a short read changes the count it
    // returns), and it clears that read's checksums: those left are of what landed.
    unsafe fn get_ranges_checksummed(
        &self,
        gets: &[RangedGet<'_>],
        sums: &mut [RangeChecksums],
    ) -> Vec<Result<u64, StoreError>> {
        let hits = self.hits_at(FaultCall::Read, gets.iter().map(|g| (g.key, &g.ranges[..])));
        if self.is_down() {
            return Self::all_down(gets.len());
        }
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_ranges_checksummed(gets, sums) };
        for (i, (g, (r, hit))) in gets.iter().zip(r.iter().zip(&hits)).enumerate() {
            let Some((Fault::Corrupt, at)) = hit else {
                continue;
            };
            if r.is_err() {
                continue;
            }
            // The range the rule picked (its offset), else the first with bytes.
            let picked = |range: &&ReadRange| range.len > 0 && at.is_none_or(|o| range.offset == o);
            if let Some(range) = g.ranges.iter().find(picked) {
                // SAFETY: still inside the call: the caller promised `dst` valid for writes of
                // `len` (> 0) bytes and untouched by anyone else until the call returns.
                unsafe { *range.dst ^= 0x5a };
            }
            if let Some(s) = sums.get_mut(i) {
                s.iter_mut().for_each(|c| *c = None);
            }
        }
        self.apply(r, hits.into_iter().map(|h| h.map(|(f, _)| f)).collect())
    }

    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
        let hits = self.hits(FaultCall::Put, puts.iter().map(|p| (p.key, &[][..])));
        if self.is_down() {
            return Self::all_down(puts.len());
        }
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.put(puts) };
        self.apply(r, hits)
    }

    fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        if self.is_down() {
            return Self::all_down(keys.len());
        }
        self.inner.remove(keys)
    }

    fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        let hits = self.hits(FaultCall::Discard, Self::plain(keys));
        if self.is_down() {
            return Self::all_down(keys.len());
        }
        // A key its fault fails is left in the store; the others are discarded.
        let spared: Vec<&str> = keys
            .iter()
            .zip(&hits)
            .filter(|(_, h)| !matches!(h, Some(Fault::Error(_))))
            .map(|(k, _)| *k)
            .collect();
        let mut done = super::checked_results(&spared, self.inner.discard(&spared)).into_iter();
        keys.iter()
            .zip(hits)
            .map(|(key, h)| match h {
                Some(Fault::Error(e)) => Err(e),
                _ => done.next().unwrap_or_else(|| {
                    Err(StoreError::ResultCount {
                        key: (*key).to_owned(),
                        expected: spared.len(),
                        got: 0,
                    })
                }),
            })
            .collect()
    }

    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        let hits = self.hits(FaultCall::Session, Self::plain(keys));
        if self.is_down() {
            return Err(Self::unavailable());
        }
        if let Some(Some(Fault::Error(e))) = hits.into_iter().find(Option::is_some) {
            return Err(e);
        }
        self.inner.start_session(keys)
    }

    fn health(&self) -> Result<(), StoreError> {
        if self.is_down() {
            return Err(Self::unavailable());
        }
        self.inner.health()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EmbeddedStore;

    /// An inner store whose whole-object reads all come back `Abandoned` (a transfer the store
    /// gave up on, which may still write the caller's memory).
    struct Abandons {
        inner: EmbeddedStore,
    }

    // SAFETY: a test store over an embedded one: its whole-object reads end within the call
    // and it answers them `Abandoned` (which only costs the caller their memory); everything
    // else is forwarded and returned unchanged.
    unsafe impl KvStore for Abandons {
        crate::forward_store_calls!(inner => exists, object_size, get_ranges, put, remove,
            discard, register, unregister, start_session, end_session, health);

        fn name(&self) -> &str {
            "abandons"
        }

        unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
            gets.iter()
                .map(|g| {
                    Err(StoreError::Abandoned {
                        key: g.key.to_owned(),
                        call: "get_into",
                        detail: "test".into(),
                    })
                })
                .collect()
        }
    }

    /// A whole read of 8 bytes of `key` through `faulty`.
    fn read_whole(faulty: &FaultyStore, key: &str) -> Result<u64, StoreError> {
        let mut buf = [0u8; 8];
        let g = ObjectGet {
            key,
            dst: buf.as_mut_ptr(),
            len: buf.len(),
        };
        // SAFETY: `buf` is ours for the call and outlives it (a store that abandons a read
        // writes nothing in these tests).
        unsafe { faulty.get_into(&[g]) }.remove(0)
    }

    #[test]
    fn an_injected_error_never_hides_an_abandoned_read() {
        let inner = Arc::new(Abandons {
            inner: EmbeddedStore::new(1 << 10),
        });
        let faulty = FaultyStore::new(inner);
        let read = |faulty: &FaultyStore| read_whole(faulty, "k");
        let injected = StoreError::Unavailable {
            detail: "injected".into(),
        };
        faulty.inject_on(
            FaultCall::ReadWhole,
            FaultRule::default(),
            Fault::Error(injected),
        );
        assert!(matches!(read(&faulty), Err(StoreError::Abandoned { .. })));
        // Down before the call: the inner store is not called, so nothing is abandoned.
        faulty.clear();
        faulty.inject_on(FaultCall::ReadWhole, FaultRule::default(), Fault::Down);
        assert!(matches!(read(&faulty), Err(StoreError::Unavailable { .. })));
    }

    /// A call held by a stall across a `clear` applies none of its rules after it: a `Down`
    /// rule on a later key of the call does not take the store down again once the stall is
    /// released. Before, it did (the call had taken the rules before the clear), and every
    /// later call failed "the store is down" with no rule in place.
    #[test]
    fn a_call_held_across_a_clear_applies_no_more_of_its_rules() {
        let inner = Arc::new(EmbeddedStore::new(1 << 10));
        let data = [5u8; 8];
        for key in ["a", "b"] {
            let put = ObjectPut {
                key,
                parts: smallvec::smallvec![(data.as_ptr(), data.len())],
            };
            // SAFETY: `data` outlives the call and is only read.
            assert!(unsafe { inner.put(&[put]) }[0].is_ok());
        }
        let faulty = FaultyStore::new(inner);
        let stall = Stall::new();
        let on = |key: &str| FaultRule {
            key_contains: Some(key.into()),
            ..FaultRule::default()
        };
        faulty.inject_on(FaultCall::ReadWhole, on("a"), Fault::Stall(stall.clone()));
        faulty.inject_on(FaultCall::ReadWhole, on("b"), Fault::Down);
        std::thread::scope(|s| {
            let held = s.spawn(|| {
                let (mut x, mut y) = ([0u8; 8], [0u8; 8]);
                let gets = [
                    ObjectGet {
                        key: "a",
                        dst: x.as_mut_ptr(),
                        len: x.len(),
                    },
                    ObjectGet {
                        key: "b",
                        dst: y.as_mut_ptr(),
                        len: y.len(),
                    },
                ];
                // SAFETY: both buffers are ours for the call.
                unsafe { faulty.get_into(&gets) }
            });
            while stall.hits() == 0 {
                std::thread::sleep(Duration::from_millis(1));
            }
            faulty.clear();
            stall.release();
            let _ = held.join().unwrap();
        });
        assert!(!faulty.is_down(), "taken down after the clear");
        assert!(read_whole(&faulty, "b").is_ok());
    }

    /// A `Checksums` rule hits a companion's whole read (`get_into`, as the linker reads
    /// companions), not an object's; `ReadWhole` hits both. Before, `Checksums` matched ranged
    /// reads only, so a rule on it never fired on the linker's reads.
    #[test]
    fn a_checksums_rule_hits_whole_reads_of_companions() {
        let inner = Arc::new(EmbeddedStore::new(1 << 10));
        let companion = format!("k{}", kv_geometry::CHECKSUM_KEY_SUFFIX);
        let data = [5u8; 8];
        for key in ["k", companion.as_str()] {
            let put = ObjectPut {
                key,
                parts: smallvec::smallvec![(data.as_ptr(), data.len())],
            };
            // SAFETY: `data` outlives the call and is only read.
            assert!(unsafe { inner.put(&[put]) }[0].is_ok());
        }
        let faulty = FaultyStore::new(inner);
        let read = |key: &str| read_whole(&faulty, key);
        let injected = StoreError::Unavailable {
            detail: "injected".into(),
        };
        faulty.inject_on(
            FaultCall::Checksums,
            FaultRule::default(),
            Fault::Error(injected),
        );
        assert!(read("k").is_ok(), "an object's read");
        assert!(matches!(
            read(&companion),
            Err(StoreError::Unavailable { .. })
        ));
        assert_eq!(faulty.faults_hit(), 1);
        faulty.clear();
        faulty.inject_on(FaultCall::ReadWhole, FaultRule::default(), Fault::Down);
        assert!(read(&companion).is_err(), "ReadWhole hits companions too");
    }

    /// A `Corrupt` rule with an offset flips a byte of the range at that offset (the layer it
    /// picked). Before, it flipped the first range of the read whichever the rule picked.
    #[test]
    fn a_corrupt_rule_with_an_offset_corrupts_the_range_at_that_offset() {
        let inner = Arc::new(EmbeddedStore::new(1 << 10));
        let data: Vec<u8> = (0..32).collect();
        let put = ObjectPut {
            key: "k",
            parts: smallvec::smallvec![(data.as_ptr(), data.len())],
        };
        // SAFETY: `data` outlives the call and is only read.
        assert!(unsafe { inner.put(&[put]) }[0].is_ok());
        let faulty = FaultyStore::new(inner);
        faulty.inject(
            FaultRule {
                offset: Some(16),
                ..FaultRule::default()
            },
            Fault::Corrupt,
        );
        let (mut a, mut b) = ([0u8; 8], [0u8; 8]);
        let range = |dst: &mut [u8; 8], offset| ReadRange {
            dst: dst.as_mut_ptr(),
            len: dst.len(),
            offset,
        };
        let get = RangedGet {
            key: "k",
            ranges: smallvec::smallvec![range(&mut a, 0), range(&mut b, 16)],
        };
        // SAFETY: `a` and `b` are ours for the call.
        assert_eq!(unsafe { faulty.get_ranges(&[get]) }[0], Ok(16));
        assert_eq!(a[..], data[0..8], "the range at offset 0 is untouched");
        assert_ne!(b[0], data[16], "the range at offset 16 is corrupted");
        assert_eq!(b[1..], data[17..24]);
    }
}
