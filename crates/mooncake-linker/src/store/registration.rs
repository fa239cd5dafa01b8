//! Registering memory with a store without `unsafe` at the call site: the region
//! ([`StoreRegion`]) keeps its memory allocated, and a [`Registration`] keeps the region until
//! the store has let go of it, or for good when it will not. [`Registration::bounded`]
//! registers and unregisters on a store-call worker and waits for either at most a bound: a
//! store whose `register` or `unregister` hangs (its metadata service down) then fails the
//! caller in time, and the worker keeps the region until the store has answered.

use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_device::StoreRegion;
use parking_lot::Mutex;

use super::{KvStore, MemoryRegion, StoreCalls, StoreError};

/// A region registered with a store. Dropping it (or [`release`](Registration::release))
/// unregisters it; when the store refuses (a transfer still in flight), the region is kept
/// for the rest of the process (its memory is never freed under the store).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::StoreRegion;
/// use mooncake_linker::store::{EmbeddedStore, KvStore, Registration};
/// let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
/// let buf: Arc<Vec<u8>> = Arc::new(vec![0; 4096]);
/// // SAFETY: `buf`'s bytes stay allocated while `buf` (the owner) lives.
/// let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
/// let reg = Registration::new(&store, region).unwrap();
/// reg.release().unwrap();
/// ```
#[must_use = "the memory stays registered until this is released or dropped"]
pub struct Registration {
    store: Arc<dyn KvStore>,
    region: Option<StoreRegion>,
    /// Where the unregister runs and how long it is waited for ([`Registration::bounded`]);
    /// `None`: on the calling thread, unbounded.
    bound: Option<(Arc<StoreCalls>, Duration)>,
}

fn raw(region: &StoreRegion) -> MemoryRegion {
    MemoryRegion {
        addr: region.addr(),
        len: region.len(),
    }
}

/// Unregisters `region` and lets it go; when the store refuses, or panics, the region is
/// kept for the rest of the process (leaked, never freed under the store).
fn unregister_owned(store: &dyn KvStore, region: StoreRegion) -> Result<(), StoreError> {
    let region = ManuallyDrop::new(region);
    // Counted as kept for good if the store's call unwinds (the region stays leaked).
    let unwinding = KeptIfUnwinding(region.len() as u64);
    let answer = store.unregister(raw(&region));
    std::mem::forget(unwinding);
    match answer {
        Ok(()) => {
            drop(ManuallyDrop::into_inner(region));
            Ok(())
        }
        Err(e) => {
            let (kept, total) = super::count_kept(region.len() as u64);
            tracing::error!(error = %e, bytes = region.len(), kept, total,
                "memory stays registered with the store: kept for good, never freed (`kept`, \
                 `total`: what this process keeps for good so far)");
            Err(e)
        }
    }
}

/// Counts its bytes as kept for good when dropped: armed across a store call that keeps its
/// region when it panics, and forgotten once the call returned.
struct KeptIfUnwinding(u64);

impl Drop for KeptIfUnwinding {
    fn drop(&mut self) {
        let (kept, total) = super::count_kept(self.0);
        tracing::error!(
            bytes = self.0,
            kept,
            total,
            "the store panicked unregistering memory: it stays registered, kept for good"
        );
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("store", &self.store.name())
            .field("region", &self.region)
            .field("bound", &self.bound.as_ref().map(|(_, wait)| wait))
            .finish()
    }
}

impl Registration {
    /// Registers `region` with `store`, on the calling thread; its unregister runs there too.
    /// Both wait as long as the store takes: [`bounded`](Self::bounded) does not.
    pub fn new(store: &Arc<dyn KvStore>, region: StoreRegion) -> Result<Self, StoreError> {
        // SAFETY: `region` keeps its memory allocated while it lives (its constructor's
        // contract). The registration keeps both the region and the store until `unregister`
        // returned `Ok`, and leaks the region when it did not, so the memory stays allocated
        // as long as the store may use it.
        unsafe { store.register(raw(&region)) }?;
        Ok(Registration {
            store: store.clone(),
            region: Some(region),
            bound: None,
        })
    }

    /// Registers `region` on a worker of `calls`, waiting for it until `deadline`
    /// ([`StoreError::Overdue`] then); its unregister (drop or [`release`](Self::release)) runs
    /// on a worker too and is waited for at most `unregister_wait`. Whatever the waits, the
    /// region stays allocated until the store has let go of it: a register that completes
    /// after its caller gave up is undone on the worker, and an unregister still running at
    /// its bound keeps the region until it returns (for good when the store refuses).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use kv_device::StoreRegion;
    /// use mooncake_linker::store::{EmbeddedStore, Registration, StoreCalls};
    /// let calls = Arc::new(StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20))));
    /// let buf: Arc<Vec<u8>> = Arc::new(vec![0; 4096]);
    /// // SAFETY: `buf`'s bytes stay allocated while `buf` (the owner) lives.
    /// let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
    /// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
    /// let reg = Registration::bounded(&calls, region, deadline, Duration::from_secs(5)).unwrap();
    /// reg.release().unwrap();
    /// ```
    pub fn bounded(
        calls: &Arc<StoreCalls>,
        region: StoreRegion,
        deadline: Instant,
        unregister_wait: Duration,
    ) -> Result<Self, StoreError> {
        if Instant::now() >= deadline {
            // As every bounded call: not sent once its deadline has passed (it would only be
            // given up at once, a worker held until the store answered).
            let name = raw(&region).to_string();
            tracing::warn!(
                region = %name,
                "a register's deadline passed before it started: not sent"
            );
            // As `bounded_all` says a wave it did not start.
            return Err(StoreError::Overdue {
                key: name,
                call: "register",
                waited: Duration::ZERO,
            });
        }
        Registering::start(calls, region)?.finish(calls, deadline, unregister_wait)
    }

    /// [`bounded`](Self::bounded) for every region, under **one** deadline for all: the
    /// registers start side by side, [`REGISTRATION_WAVE`] at a time. On a failure the ones
    /// registered are let go (side by side, [`release_all`](Self::release_all)), the ones still
    /// running are given up (each undone on its worker when it completes), and the rest are
    /// not started (nor is a wave once the deadline has passed); the first error is returned.
    pub fn bounded_all(
        calls: &Arc<StoreCalls>,
        regions: Vec<StoreRegion>,
        deadline: Instant,
        unregister_wait: Duration,
    ) -> Result<Vec<Self>, StoreError> {
        let started = Instant::now();
        let mut done = Vec::with_capacity(regions.len());
        let mut failed: Option<StoreError> = None;
        let mut regions = regions.into_iter();
        while failed.is_none() {
            let wave: Vec<StoreRegion> = regions.by_ref().take(REGISTRATION_WAVE).collect();
            let Some(first) = wave.first() else {
                break;
            };
            // Past the deadline (earlier waves took it all), a wave is not started.
            if Instant::now() >= deadline {
                failed = Some(StoreError::Overdue {
                    key: raw(first).to_string(),
                    call: "register",
                    waited: started.elapsed(),
                });
                break;
            }
            let registering: Vec<_> = wave
                .into_iter()
                .map(|region| Registering::start(calls, region))
                .collect();
            for registering in registering {
                // Once one failed, the others are taken if done and left if not (a register
                // that completes later is undone on its worker): not overdue, none waited.
                if failed.is_some() {
                    if let Ok(Some(registration)) =
                        registering.map(|r| r.answered_or_leave(calls, unregister_wait))
                    {
                        done.push(registration);
                    }
                    continue;
                }
                match registering.and_then(|r| r.finish(calls, deadline, unregister_wait)) {
                    Ok(registration) => done.push(registration),
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
            }
        }
        match failed {
            None => Ok(done),
            Some(e) => {
                let _ = Self::release_all(done);
                Err(e)
            }
        }
    }

    /// The region.
    pub fn region(&self) -> Option<&StoreRegion> {
        self.region.as_ref()
    }

    /// Unregisters the region. On `Err` the region stays registered, and its memory
    /// allocated for the rest of the process (or, for a [bounded](Self::bounded) unregister
    /// past its wait, until the store answers).
    pub fn release(mut self) -> Result<(), StoreError> {
        self.let_go()
    }

    fn let_go(&mut self) -> Result<(), StoreError> {
        self.start_let_go().answer(Instant::now())
    }
}

/// Most registers or unregisters [`Registration::bounded_all`] and
/// [`Registration::release_all`] start side by side: well under the store calls that may run
/// at once ([`MAX_WORKERS`](super::MAX_WORKERS)), whatever the number of regions.
pub const REGISTRATION_WAVE: usize = 64;

/// A register started on a worker.
struct Registering {
    pending: super::bounded::Pending<(Result<(), StoreError>, StoreRegion)>,
    name: String,
}

impl Registering {
    /// Starts registering `region` on a worker of `calls`.
    fn start(calls: &StoreCalls, region: StoreRegion) -> Result<Self, StoreError> {
        let name = raw(&region).to_string();
        let pending = calls.submit(
            "register",
            move |s| {
                // Not dropped by an unwinding `register`: it may have registered part of it.
                let region = ManuallyDrop::new(region);
                // SAFETY: `region` keeps its memory allocated while it lives (its
                // constructor's contract); it goes back to the caller with the answer, or is
                // unregistered on this worker when the caller has given up (and kept for good
                // when the store will not let go), so the memory outlives the registration.
                let registered = unsafe { s.register(raw(&region)) };
                (registered, ManuallyDrop::into_inner(region))
            },
            // A late success is undone. A newer registration of the same memory (a linker
            // built again over the same pool) stays: `MooncakeStore` counts a region's holders
            // and lets the wheel go only with the last. (A store that does not count would
            // undo that one too: its transfers fail; the memory stays allocated either way.)
            |s, (registered, region)| {
                if registered.is_ok() {
                    tracing::warn!("a registration completed after its caller gave up: undone");
                    let _ = unregister_owned(s, region);
                }
            },
        )?;
        Ok(Registering { pending, name })
    }

    /// The registration, waited for until `deadline` (given up then).
    fn finish(
        self,
        calls: &Arc<StoreCalls>,
        deadline: Instant,
        unregister_wait: Duration,
    ) -> Result<Registration, StoreError> {
        match self.pending.wait(deadline) {
            Ok((Ok(()), region)) => Ok(Registration {
                store: calls.store().clone(),
                region: Some(region),
                bound: Some((calls.clone(), unregister_wait)),
            }),
            Ok((Err(e), _not_registered)) => Err(e),
            Err(why) => Err(why.error(&self.name, "register")),
        }
    }
}

impl Registering {
    /// The registration if the register has answered `Ok`; otherwise nothing, and a register
    /// still running is left to its worker (undone there when it completes).
    fn answered_or_leave(
        self,
        calls: &Arc<StoreCalls>,
        unregister_wait: Duration,
    ) -> Option<Registration> {
        match self.pending.answered_or_detach()? {
            Ok((Ok(()), region)) => Some(Registration {
                store: calls.store().clone(),
                region: Some(region),
                bound: Some((calls.clone(), unregister_wait)),
            }),
            _ => None,
        }
    }
}

/// An unregister started on a worker, or already answered.
enum Unregistering {
    Answered(Result<(), StoreError>),
    Running {
        pending: super::bounded::Pending<Result<(), StoreError>>,
        name: String,
        wait: Duration,
    },
}

impl Unregistering {
    /// Starts the unregister of `region` on a worker of `calls`; the worker owns the region
    /// until the store answers.
    fn start(calls: &StoreCalls, region: StoreRegion, wait: Duration) -> Self {
        let name = raw(&region).to_string();
        // Shared, so that a call no worker took leaves the region here, to be kept.
        let slot = Arc::new(Mutex::new(Some(region)));
        let theirs = slot.clone();
        let submitted = calls.submit(
            "unregister",
            move |s| match theirs.lock().take() {
                Some(region) => unregister_owned(s, region),
                None => Ok(()),
            },
            |_, _| {},
        );
        match submitted {
            Ok(pending) => Unregistering::Running {
                pending,
                name,
                wait,
            },
            Err(e) => {
                if let Some(region) = slot.lock().take() {
                    tracing::error!(error = %e, region = %name, "no worker to unregister: the memory stays registered, kept for good");
                    keep_for_good(vec![region]);
                }
                Unregistering::Answered(Err(e))
            }
        }
    }

    /// The store's answer, waited for until `wait` after `started`.
    fn answer(self, started: Instant) -> Result<(), StoreError> {
        match self {
            Unregistering::Answered(answer) => answer,
            Unregistering::Running {
                pending,
                name,
                wait,
            } => match pending.wait(kv_loader::deadline_from(started, wait)) {
                Ok(answer) => answer,
                Err(why) => {
                    tracing::error!(region = %name, "unregister overdue: the region is kept until the store answers");
                    Err(why.error(&name, "unregister"))
                }
            },
        }
    }
}

impl Registration {
    /// Starts letting go of the region: on a worker when bounded, else here.
    fn start_let_go(&mut self) -> Unregistering {
        let Some(region) = self.region.take() else {
            return Unregistering::Answered(Ok(()));
        };
        match &self.bound {
            None => Unregistering::Answered(unregister_owned(self.store.as_ref(), region)),
            Some((calls, wait)) => Unregistering::start(calls, region, *wait),
        }
    }

    /// Unregisters every registration at once: the bounded ones' unregisters run side by side
    /// ([`REGISTRATION_WAVE`] at a time), so letting go of several regions waits one bound,
    /// not one per region. Once the bound is spent, the regions left are unregistered one
    /// after another on a single worker, not waited for (each kept until the store answers
    /// for it): a wave each would hang 64 more workers on a store that does not answer, and
    /// enough of them take every worker of the calls. The answers, in order.
    pub fn release_all(registrations: Vec<Registration>) -> Vec<Result<(), StoreError>> {
        let started = Instant::now();
        let mut registrations = registrations;
        let mut answers = Vec::with_capacity(registrations.len());
        let mut late = LateUnregisters::default();
        for wave in registrations.chunks_mut(REGISTRATION_WAVE) {
            let running: Vec<Unregistering> = wave
                .iter_mut()
                .map(|r| match r.bound_passed(started) {
                    Some(waited) => Unregistering::Answered(late.take(r, waited)),
                    None => r.start_let_go(),
                })
                .collect();
            answers.extend(running.into_iter().map(|u| u.answer(started)));
        }
        late.start();
        answers
    }

    /// How long it has been since `started`, when that is past this registration's
    /// unregister bound (a bounded one only).
    fn bound_passed(&self, started: Instant) -> Option<Duration> {
        let (_, wait) = self.bound.as_ref()?;
        let waited = started.elapsed();
        (waited >= *wait).then_some(waited)
    }
}

/// The regions a release reached past its bound, by the calls that unregister them.
#[derive(Default)]
struct LateUnregisters {
    by_calls: Vec<(Arc<StoreCalls>, Vec<StoreRegion>)>,
}

impl LateUnregisters {
    /// Takes `r`'s region (a bounded registration's) to unregister later; its answer now.
    fn take(&mut self, r: &mut Registration, waited: Duration) -> Result<(), StoreError> {
        let (Some(region), Some((calls, _))) = (r.region.take(), r.bound.as_ref()) else {
            return Ok(());
        };
        let name = raw(&region).to_string();
        match self
            .by_calls
            .iter_mut()
            .find(|(c, _)| Arc::ptr_eq(c, calls))
        {
            Some((_, regions)) => regions.push(region),
            None => self.by_calls.push((calls.clone(), vec![region])),
        }
        Err(StoreError::Overdue {
            key: name,
            call: "unregister",
            waited,
        })
    }

    /// Unregisters the regions on one worker of their calls each, one after another. A region
    /// no worker takes, or that the worker has not reached when it stops (a panic), stays
    /// registered with its memory kept for good.
    fn start(mut self) {
        for (calls, regions) in std::mem::take(&mut self.by_calls) {
            let n = regions.len();
            tracing::warn!(
                regions = n,
                "unregister bound spent: the rest let go one by one on one worker, not waited for"
            );
            let left = Arc::new(Mutex::new(regions));
            let theirs = left.clone();
            let submitted = calls.submit(
                "unregister",
                move |s| {
                    let _rest = KeepRest(theirs.clone());
                    loop {
                        // Taken out under the lock, unregistered without it.
                        let next = theirs.lock().pop();
                        let Some(region) = next else { break };
                        let _ = unregister_owned(s, region);
                    }
                },
                |_, _| {},
            );
            match submitted {
                // Sent without a caller waiting: its end is not a late answer.
                Ok(pending) => pending.detach(),
                Err(e) => {
                    tracing::error!(error = %e, regions = n, "no worker to unregister: the memory stays registered, kept for good");
                    drop(KeepRest(left));
                }
            }
        }
    }
}

impl Drop for LateUnregisters {
    /// Regions not handed to a worker (the release unwound before `start`): registered still,
    /// so kept for good.
    fn drop(&mut self) {
        for (_, regions) in std::mem::take(&mut self.by_calls) {
            keep_for_good(regions);
        }
    }
}

/// Keeps `regions` registered and their memory allocated for good: what nothing will
/// unregister any more (counted in [`kept_for_good`](super::kept_for_good)).
fn keep_for_good(regions: Vec<StoreRegion>) {
    for region in regions {
        super::count_kept(region.len() as u64);
        std::mem::forget(region);
    }
}

/// Keeps the regions still in the list registered and allocated for good when dropped (a
/// worker that stopped before it reached them, or a job no worker took).
struct KeepRest(Arc<Mutex<Vec<StoreRegion>>>);

impl Drop for KeepRest {
    fn drop(&mut self) {
        keep_for_good(std::mem::take(&mut *self.0.lock()));
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = self.let_go();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EmbeddedStore;

    #[test]
    fn a_registration_keeps_its_memory_until_released() {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 20));
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
        // SAFETY: `buf`'s bytes stay allocated while `buf` lives.
        let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
        let reg = Registration::new(&store, region).unwrap();
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the registration holds the owner"
        );
        reg.release().unwrap();
        assert_eq!(Arc::strong_count(&buf), 1, "released: the owner is let go");
    }

    /// A store whose unregister fails with `fault` (the test store's rule).
    fn unregister_faulted(fault: crate::store::Fault) -> Arc<dyn KvStore> {
        let store = crate::store::FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20)));
        store.inject_on(
            crate::store::FaultCall::Unregister,
            crate::store::FaultRule::default(),
            fault,
        );
        Arc::new(store)
    }

    /// A region whose unregister panicked is kept for good and counted (before, only a
    /// refusal was).
    #[test]
    fn a_region_whose_unregister_panicked_is_counted_as_kept_for_good() {
        let store = unregister_faulted(crate::store::Fault::Panic);
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 259 << 20]);
        let before = crate::store::kept_for_good();
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            unregister_owned(store.as_ref(), region_of(&buf))
        }));
        assert!(unwound.is_err());
        let after = crate::store::kept_for_good();
        assert!(
            after.bytes >= before.bytes + (259 << 20),
            "{before:?} -> {after:?}"
        );
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the owner is kept, never let go"
        );
    }

    /// A region the store did not unregister stays allocated for good, and is counted in
    /// `kept_for_good` (before, it was only logged: the metric said nothing was kept).
    #[test]
    fn a_region_the_store_did_not_unregister_is_counted_as_kept_for_good() {
        let store = unregister_faulted(crate::store::Fault::Error(StoreError::Unavailable {
            detail: "injected: unregister refused".into(),
        }));
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 257 << 20]);
        let before = crate::store::kept_for_good();
        let reg = Registration::new(&store, region_of(&buf)).unwrap();
        assert!(reg.release().is_err());
        let after = crate::store::kept_for_good();
        assert!(after.calls > before.calls);
        // Other tests of this process may keep memory meanwhile: at least this region.
        assert!(
            after.bytes >= before.bytes + (257 << 20),
            "{before:?} -> {after:?}"
        );
        assert_eq!(
            Arc::strong_count(&buf),
            2,
            "the owner is kept, never let go"
        );
    }

    /// A store whose `register` and `unregister` wait until the gate opens (a metadata service
    /// that hangs), and that counts the regions it holds registered.
    struct HangingRegistry {
        inner: EmbeddedStore,
        open: parking_lot::Mutex<bool>,
        opened: parking_lot::Condvar,
        registered: std::sync::atomic::AtomicI64,
        /// Registers that go through while the gate is shut.
        free_registers: std::sync::atomic::AtomicUsize,
        /// Registers asked for.
        register_calls: std::sync::atomic::AtomicUsize,
        /// Unregisters under way (waiting for the gate, while it is shut).
        unregistering: std::sync::atomic::AtomicUsize,
        /// Registers of regions this long fail at once (0: none).
        fail_len: std::sync::atomic::AtomicUsize,
    }

    impl HangingRegistry {
        fn new(open: bool) -> Arc<Self> {
            Arc::new(HangingRegistry {
                inner: EmbeddedStore::new(1 << 20),
                open: parking_lot::Mutex::new(open),
                opened: parking_lot::Condvar::new(),
                registered: std::sync::atomic::AtomicI64::new(0),
                free_registers: std::sync::atomic::AtomicUsize::new(0),
                register_calls: std::sync::atomic::AtomicUsize::new(0),
                unregistering: std::sync::atomic::AtomicUsize::new(0),
                fail_len: std::sync::atomic::AtomicUsize::new(0),
            })
        }

        fn wait_open(&self) {
            let deadline = kv_loader::deadline_after(Duration::from_secs(30));
            let mut open = self.open.lock();
            while !*open && !self.opened.wait_until(&mut open, deadline).timed_out() {}
        }

        fn set_open(&self, open: bool) {
            *self.open.lock() = open;
            self.opened.notify_all();
        }

        fn unregistering(&self) -> usize {
            self.unregistering
                .load(std::sync::atomic::Ordering::Acquire)
        }

        fn held(&self) -> i64 {
            self.registered.load(std::sync::atomic::Ordering::Acquire)
        }
    }

    // SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
    // writes reach the inner store, whose results it returns as they are or fails before it
    // (touching nothing); it starts no thread that touches caller memory.
    unsafe impl KvStore for HangingRegistry {
        crate::forward_store_calls!(inner => exists, object_size, get_into, get_ranges, put,
            remove, discard, start_session, end_session, health);

        fn name(&self) -> &str {
            "hanging-registry"
        }

        unsafe fn register(&self, region: MemoryRegion) -> Result<(), StoreError> {
            self.register_calls
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            if region.len == self.fail_len.load(std::sync::atomic::Ordering::Acquire) {
                return Err(StoreError::Unavailable {
                    detail: "injected: registration refused".into(),
                });
            }
            let free = self
                .free_registers
                .fetch_update(
                    std::sync::atomic::Ordering::AcqRel,
                    std::sync::atomic::Ordering::Acquire,
                    |n| n.checked_sub(1),
                )
                .is_ok();
            if !free {
                self.wait_open();
            }
            self.registered
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            Ok(())
        }

        fn unregister(&self, _: MemoryRegion) -> Result<(), StoreError> {
            self.unregistering
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            self.wait_open();
            self.unregistering
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            self.registered
                .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            Ok(())
        }
    }

    fn region_of(buf: &Arc<Vec<u8>>) -> StoreRegion {
        // SAFETY: `buf`'s bytes stay allocated while `buf` (the owner) lives.
        unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) }
    }

    /// Waits (bounded) until `what` holds.
    fn eventually(what: impl Fn() -> bool) -> bool {
        let limit = Instant::now() + Duration::from_secs(10);
        while !what() {
            if Instant::now() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    /// `out` is `call` overdue, returned in time, while the store's worker still holds `buf`.
    fn overdue_and_kept<T: std::fmt::Debug>(
        out: Result<T, StoreError>,
        call: &str,
        started: Instant,
        buf: &Arc<Vec<u8>>,
    ) {
        assert_overdue(&out, call);
        assert!(started.elapsed() < Duration::from_secs(5));
        assert_eq!(Arc::strong_count(buf), 2, "the stuck call keeps the memory");
    }

    /// `out` is `call` overdue.
    fn assert_overdue<T: std::fmt::Debug>(out: &Result<T, StoreError>, call: &str) {
        assert!(
            matches!(out, Err(StoreError::Overdue { call: c, .. }) if *c == call),
            "{out:?}"
        );
    }

    const SHORT: Duration = Duration::from_millis(100);

    #[test]
    fn a_hanging_register_fails_at_its_deadline_and_is_undone_when_it_completes() {
        let store = HangingRegistry::new(false);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
        let started = Instant::now();
        let out = Registration::bounded(&calls, region_of(&buf), Instant::now() + SHORT, SHORT);
        overdue_and_kept(out, "register", started, &buf);
        store.set_open(true);
        assert!(
            eventually(|| Arc::strong_count(&buf) == 1),
            "let go once undone"
        );
        assert_eq!(store.held(), 0, "the late registration was undone");
    }

    #[test]
    fn a_hanging_unregister_returns_at_its_bound_and_keeps_the_memory_until_it_answers() {
        let store = HangingRegistry::new(true);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let buf: Arc<Vec<u8>> = Arc::new(vec![0; 64]);
        let deadline = Instant::now() + Duration::from_secs(5);
        let reg = Registration::bounded(&calls, region_of(&buf), deadline, SHORT).unwrap();
        assert_eq!(store.held(), 1);
        store.set_open(false);
        let started = Instant::now();
        let out = reg.release();
        overdue_and_kept(out, "unregister", started, &buf);
        store.set_open(true);
        assert!(eventually(|| Arc::strong_count(&buf) == 1));
        assert_eq!(store.held(), 0);
    }

    #[test]
    fn releasing_several_hanging_registrations_waits_one_bound_not_one_each() {
        let store = HangingRegistry::new(true);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let wait = Duration::from_millis(300);
        let bufs: Vec<Arc<Vec<u8>>> = (0..4).map(|_| Arc::new(vec![0; 64])).collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let regs: Vec<Registration> = bufs
            .iter()
            .map(|b| Registration::bounded(&calls, region_of(b), deadline, wait).unwrap())
            .collect();
        store.set_open(false);
        let started = Instant::now();
        let out = Registration::release_all(regs);
        let took = started.elapsed();
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(Result::is_err), "{out:?}");
        assert!(
            took < wait * 3,
            "{took:?} for four unregisters of {wait:?} each"
        );
        store.set_open(true);
        assert!(eventually(|| bufs
            .iter()
            .all(|b| Arc::strong_count(b) == 1)));
        assert_eq!(store.held(), 0);
    }

    #[test]
    fn a_release_past_its_bound_lets_go_of_the_rest_on_one_worker() {
        let store = HangingRegistry::new(true);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let wait = Duration::from_millis(300);
        let n = REGISTRATION_WAVE * 3;
        let bufs: Vec<Arc<Vec<u8>>> = (0..n).map(|_| Arc::new(vec![0; 64])).collect();
        let deadline = Instant::now() + Duration::from_secs(10);
        let regs =
            Registration::bounded_all(&calls, bufs.iter().map(region_of).collect(), deadline, wait)
                .unwrap();
        store.set_open(false);
        let started = Instant::now();
        let out = Registration::release_all(regs);
        let took = started.elapsed();
        assert_eq!(out.len(), n);
        assert!(
            out.iter()
                .all(|o| matches!(o, Err(StoreError::Overdue { .. }))),
            "{out:?}"
        );
        assert!(took < wait * 3, "{took:?}");
        // Unregisters under way: the first wave's, and the one worker letting go of the rest
        // in turn (a wave each had 64 more).
        assert!(eventually(|| store.unregistering() == REGISTRATION_WAVE + 1));
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(store.unregistering(), REGISTRATION_WAVE + 1);
        store.set_open(true);
        // Once the store answers, every region is let go.
        assert!(eventually(|| store.held() == 0));
        assert!(eventually(|| bufs
            .iter()
            .all(|b| Arc::strong_count(b) == 1)));
    }

    /// The store registers 3 of 5 regions, then hangs: `bounded_all` fails by its one
    /// deadline, lets go of the 3, and the 2 given up are undone when the store comes back.
    #[test]
    fn registering_several_regions_fails_by_one_deadline_and_lets_go_of_those_registered() {
        let store = HangingRegistry::new(false);
        store
            .free_registers
            .store(3, std::sync::atomic::Ordering::Release);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let bufs: Vec<Arc<Vec<u8>>> = (0..5).map(|_| Arc::new(vec![0; 64])).collect();
        let regions = bufs.iter().map(region_of).collect();
        let started = Instant::now();
        // Unregisters hang too (the gate is shut): each is waited for at most SHORT.
        let out = Registration::bounded_all(&calls, regions, Instant::now() + SHORT, SHORT);
        assert_overdue(&out, "register");
        assert!(started.elapsed() < SHORT * 6, "{:?}", started.elapsed());
        store.set_open(true);
        assert!(eventually(|| bufs
            .iter()
            .all(|b| Arc::strong_count(b) == 1)));
        assert_eq!(store.held(), 0, "every registration let go or undone");
    }

    /// Once one register of a wave failed, the others still running are left to their
    /// workers (undone when they complete), not counted nor logged as overdue: their deadline
    /// has not passed. Before, each was waited for with a deadline of "now" and counted an
    /// overdue call, with an error-level log.
    #[test]
    fn registers_left_after_a_failed_one_are_not_overdue() {
        let store = HangingRegistry::new(false);
        store
            .fail_len
            .store(32, std::sync::atomic::Ordering::Release);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let bufs: Vec<Arc<Vec<u8>>> = vec![Arc::new(vec![0; 32]), Arc::new(vec![0; 64])];
        let regions = bufs.iter().map(region_of).collect();
        let deadline = Instant::now() + Duration::from_secs(5);
        let out = Registration::bounded_all(&calls, regions, deadline, SHORT);
        assert!(
            matches!(&out, Err(StoreError::Unavailable { .. })),
            "{:?}",
            out.as_ref().err()
        );
        assert_eq!(calls.overdue_calls(), 0);
        store.set_open(true);
        assert!(eventually(|| bufs
            .iter()
            .all(|b| Arc::strong_count(b) == 1)));
        assert!(eventually(|| store.held() == 0), "the late one undone");
    }

    /// A deadline already past starts no wave: nothing is asked of the store (before, every
    /// region was registered, given up at once and undone later).
    #[test]
    fn a_deadline_already_past_starts_no_registration() {
        let store = HangingRegistry::new(true);
        let calls = Arc::new(StoreCalls::new(store.clone()));
        let bufs: Vec<Arc<Vec<u8>>> = (0..REGISTRATION_WAVE + 6)
            .map(|_| Arc::new(vec![0; 64]))
            .collect();
        let regions = bufs.iter().map(region_of).collect();
        let out = Registration::bounded_all(&calls, regions, Instant::now(), SHORT);
        assert_overdue(&out, "register");
        assert!(bufs.iter().all(|b| Arc::strong_count(b) == 1));
        let asked = store
            .register_calls
            .load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(asked, 0, "no register started");
        // Nor does one region's (before, it was sent, given up at once and undone later).
        let buf = Arc::new(vec![0u8; 64]);
        let one = Registration::bounded(&calls, region_of(&buf), Instant::now(), SHORT);
        assert_overdue(&one.map(|r| vec![r]), "register");
        assert_eq!(Arc::strong_count(&buf), 1, "the region was let go");
        let asked = store
            .register_calls
            .load(std::sync::atomic::Ordering::Acquire);
        assert_eq!(asked, 0, "no register started");
    }
}
