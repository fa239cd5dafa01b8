//! A test decorator of a rank's data collective that misbehaves once: it skips one status
//! exchange (the rank's collectives shift by one), it leaves the group at a layer's status
//! exchange (a rank gone: its handle is dropped, every peer waiting on it fails at once), it
//! panics there, or one of its device collectives' events reports a device error.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvlink::dedup_broadcast::{Collective, CollectiveError, LayerStatus, MemorySupport};
use kvlink::kv_device::{DeviceError, DeviceEvent, HostRow, SharedEvent};
use kvlink::kv_loader::{KvLoadError, RawStream, StreamWaitable};
use std::sync::Mutex;

/// How the decorated rank misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehave {
    /// Its `nth` status exchange (0-based, any layer) is never issued: the call fails at once.
    SkipStatus { nth: u64 },
    /// At the first status exchange of `layer` (armed by [`Misbehaving::arm`]), it leaves the
    /// group: the handle is dropped.
    GoneAtLayer { layer: u32 },
    /// At the first status exchange of `layer` (armed), it panics: a defect in a collective
    /// the engine supplied.
    PanicAtLayer { layer: u32 },
    /// The event of its `nth` device collective (0-based) reports a device error once the
    /// collective completed: the device failed under it.
    FailedDeviceEvent { nth: u64 },
    /// At the first status exchange of `layer` (armed), it sleeps `stall` (a rank hung, not
    /// dead: a stopped process, a stalled host), then issues the exchange.
    StallAtLayer {
        layer: u32,
        stall: std::time::Duration,
    },
}

/// The decorator.
pub struct Misbehaving {
    inner: Mutex<Option<Arc<dyn Collective>>>,
    rank: u32,
    size: u32,
    how: Misbehave,
    statuses: AtomicU64,
    armed: AtomicBool,
    done: AtomicBool,
}

impl Misbehaving {
    /// Leaves the group now: the handle is dropped (`broken()` says so from here on).
    pub fn leave(&self) {
        self.inner.lock().unwrap().take();
    }

    pub fn new(inner: Arc<dyn Collective>, how: Misbehave) -> Arc<Self> {
        Arc::new(Misbehaving {
            rank: inner.rank(),
            size: inner.size(),
            inner: Mutex::new(Some(inner)),
            how,
            statuses: AtomicU64::new(0),
            armed: AtomicBool::new(matches!(how, Misbehave::SkipStatus { .. })),
            done: AtomicBool::new(false),
        })
    }

    /// Misbehaves from now on (once).
    pub fn arm(&self) {
        self.armed.store(true, Ordering::Release);
    }

    /// Stops it misbehaving unless it did already (an arm whose layer no batch reached).
    pub fn disarm(&self) {
        self.armed.store(false, Ordering::Release);
    }

    /// True once it misbehaved.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }

    fn handle(&self, op: &'static str) -> Result<Arc<dyn Collective>, CollectiveError> {
        self.inner
            .lock()
            .unwrap()
            .clone()
            .ok_or(CollectiveError::RankGone {
                op,
                seq: 0,
                gone: vec![self.rank],
            })
    }

    /// Whether this status word is the one to misbehave at.
    fn strikes(&self, word: u64) -> bool {
        let Some((_, layer, _)) = LayerStatus::decode_tagged(word) else {
            return false;
        };
        if !self.armed.load(Ordering::Acquire) || self.done() {
            if matches!(self.how, Misbehave::SkipStatus { .. }) {
                self.statuses.fetch_add(1, Ordering::AcqRel);
            }
            return false;
        }
        let hit = match self.how {
            Misbehave::SkipStatus { nth } => self.statuses.fetch_add(1, Ordering::AcqRel) == nth,
            Misbehave::GoneAtLayer { layer: l }
            | Misbehave::PanicAtLayer { layer: l }
            | Misbehave::StallAtLayer { layer: l, .. } => layer == l,
            Misbehave::FailedDeviceEvent { .. } => false,
        };
        if hit {
            self.done.store(true, Ordering::Release);
        }
        hit
    }

    /// A status word through the inner handle (settled or not), unless this one strikes.
    fn status_word(
        &self,
        value: u64,
        settled: bool,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        if self.strikes(value) {
            if let Misbehave::StallAtLayer { stall, .. } = self.how {
                std::thread::sleep(stall);
                let h = self.handle("all_gather_u64")?;
                return if settled {
                    h.all_gather_u64_settled(value, deadline)
                } else {
                    h.all_gather_u64(value, deadline)
                };
            }
            return match self.how {
                Misbehave::FailedDeviceEvent { .. } | Misbehave::StallAtLayer { .. } => {
                    unreachable!("never strikes here")
                }
                Misbehave::SkipStatus { .. } => Err(CollectiveError::Backend(
                    "injected: this status exchange was never issued".into(),
                )),
                Misbehave::PanicAtLayer { layer } => {
                    panic!("injected: the collective panics at layer {layer}'s status exchange")
                }
                Misbehave::GoneAtLayer { .. } => {
                    // The rank leaves: its handle goes, and peers waiting on it fail at once.
                    drop(self.inner.lock().unwrap().take());
                    Err(CollectiveError::RankGone {
                        op: "all_gather_u64",
                        seq: 0,
                        gone: vec![self.rank],
                    })
                }
            };
        }
        let h = self.handle("all_gather_u64")?;
        if settled {
            h.all_gather_u64_settled(value, deadline)
        } else {
            h.all_gather_u64(value, deadline)
        }
    }
}

/// What a test decorator does to each event its handle's device operations return (by
/// default, nothing).
pub trait DeviceEventHook {
    fn device_event(&self, event: SharedEvent) -> SharedEvent {
        event
    }
}

/// The device operations of a test decorator of a collective, forwarded to the handle that
/// `self.$handle(op)?` gives (`op`: the operation's name); each event returned goes through
/// [`DeviceEventHook::device_event`]. `may_leave_work` is the inner handle's (with no handle
/// left: `true`).
macro_rules! forward_device_ops {
    ($handle:ident) => {
        fn may_leave_work(&self, error: &kvlink::dedup_broadcast::CollectiveError) -> bool {
            self.$handle("may_leave_work")
                .map_or(true, |h| h.may_leave_work(error))
        }

        unsafe fn broadcast_device(
            &self,
            region: kvlink::kv_device::DeviceRegion,
            after: Option<kvlink::kv_device::SharedEvent>,
            root: u32,
            deadline: std::time::Instant,
        ) -> Result<kvlink::kv_device::SharedEvent, kvlink::dedup_broadcast::CollectiveError> {
            // SAFETY: forwarded with the caller's own promise.
            let event = unsafe {
                self.$handle("broadcast_device")?
                    .broadcast_device(region, after, root, deadline)
            }?;
            Ok(crate::common::coll::DeviceEventHook::device_event(
                self, event,
            ))
        }

        unsafe fn all_gather_device(
            &self,
            region: kvlink::kv_device::DeviceRegion,
            after: Option<kvlink::kv_device::SharedEvent>,
            deadline: std::time::Instant,
        ) -> Result<kvlink::kv_device::SharedEvent, kvlink::dedup_broadcast::CollectiveError> {
            // SAFETY: forwarded with the caller's own promise.
            let event = unsafe {
                self.$handle("all_gather_device")?
                    .all_gather_device(region, after, deadline)
            }?;
            Ok(crate::common::coll::DeviceEventHook::device_event(
                self, event,
            ))
        }
    };
}
pub(crate) use forward_device_ops;

impl DeviceEventHook for Misbehaving {
    fn device_event(&self, event: SharedEvent) -> SharedEvent {
        let Misbehave::FailedDeviceEvent { nth } = self.how else {
            return event;
        };
        if self.statuses.fetch_add(1, Ordering::AcqRel) != nth {
            return event;
        }
        self.done.store(true, Ordering::Release);
        Arc::new(FailedEvent(event))
    }
}

/// An event that reports a device error once the work before it finished.
#[derive(Debug)]
struct FailedEvent(SharedEvent);

impl FailedEvent {
    fn error() -> DeviceError {
        DeviceError::Driver("injected: the device failed under a collective".into())
    }
}

impl DeviceEvent for FailedEvent {
    fn is_complete(&self) -> Result<bool, DeviceError> {
        match self.0.is_complete()? {
            true => Err(Self::error()),
            false => Ok(false),
        }
    }

    fn wait_until(&self, deadline: Instant) -> Result<bool, DeviceError> {
        match self.0.wait_until(deadline)? {
            true => Err(Self::error()),
            false => Ok(false),
        }
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl StreamWaitable for FailedEvent {
    fn wait_on_stream(&self, _: RawStream) -> Result<(), KvLoadError> {
        Err(Self::error().into())
    }

    fn synchronize(&self) -> Result<(), KvLoadError> {
        Err(Self::error().into())
    }
}

// SAFETY: every operation, `broken` and `may_leave_work` go to the inner handle (with the
// handle gone, `broken` says so and nothing is issued); the events it returns are the inner
// ones, or a `FailedEvent`, which reports complete (as a failure) only once the inner one
// completed, and fails a stream wait or a synchronize at once (no work is ordered after it).
unsafe impl Collective for Misbehaving {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        self.status_word(value, false, deadline)
    }

    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        self.status_word(value, true, deadline)
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.handle("all_gather_bytes")?
            .all_gather_bytes(value, deadline)
    }

    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.handle("all_gather_bytes")?
            .all_gather_bytes_settled(value, deadline)
    }

    fn memory(&self) -> MemorySupport {
        self.handle("memory")
            .map(|h| h.memory())
            .unwrap_or(MemorySupport {
                host: true,
                device: true,
            })
    }

    fn device_ordinal(&self) -> Option<u32> {
        self.handle("device_ordinal")
            .ok()
            .and_then(|h| h.device_ordinal())
    }

    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: forwarded with the caller's own promise.
        unsafe {
            self.handle("broadcast_rows")?
                .broadcast_rows(rows, root, deadline)
        }
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: forwarded with the caller's own promise.
        unsafe {
            self.handle("all_gather_rows")?
                .all_gather_rows(rows, counts, deadline)
        }
    }

    forward_device_ops!(handle);

    fn abort(&self, cause: &str) {
        if let Some(h) = self.inner.lock().unwrap().clone() {
            h.abort(cause);
        }
    }

    fn broken(&self) -> Option<String> {
        match self.inner.lock().unwrap().clone() {
            Some(h) => h.broken(),
            None => Some("this rank left the group".into()),
        }
    }
}

/// Counts a handle's gathers in progress at once, and holds each one a few milliseconds so
/// that calls that may overlap do: the most seen at once is the answer to "did two calls on
/// this one handle overlap" (which a collective's callers must not let happen).
pub struct Overlaps {
    inner: Arc<dyn Collective>,
    now: std::sync::atomic::AtomicUsize,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl Overlaps {
    /// `inner`, its most calls at once counted in `most`.
    pub fn new(inner: Arc<dyn Collective>, most: Arc<std::sync::atomic::AtomicUsize>) -> Self {
        Overlaps {
            inner,
            now: Default::default(),
            most,
        }
    }

    fn handle(&self, _op: &'static str) -> Result<Arc<dyn Collective>, CollectiveError> {
        Ok(self.inner.clone())
    }

    fn counted<T>(&self, call: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering::AcqRel;
        let at_once = self.now.fetch_add(1, AcqRel) + 1;
        self.most.fetch_max(at_once, AcqRel);
        std::thread::sleep(std::time::Duration::from_millis(5));
        let r = call();
        self.now.fetch_sub(1, AcqRel);
        r
    }
}

impl DeviceEventHook for Overlaps {}

// SAFETY: every operation, `broken` and `may_leave_work` go to the inner handle unchanged (the
// gathers after a pause); its events are returned as they are.
unsafe impl Collective for Overlaps {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    fn size(&self) -> u32 {
        self.inner.size()
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        self.counted(|| self.inner.all_gather_u64(value, deadline))
    }

    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        self.counted(|| self.inner.all_gather_u64_settled(value, deadline))
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.counted(|| self.inner.all_gather_bytes(value, deadline))
    }

    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.counted(|| self.inner.all_gather_bytes_settled(value, deadline))
    }

    fn memory(&self) -> MemorySupport {
        self.inner.memory()
    }

    fn device_ordinal(&self) -> Option<u32> {
        self.inner.device_ordinal()
    }

    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: forwarded with the caller's own promise.
        unsafe { self.inner.broadcast_rows(rows, root, deadline) }
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: forwarded with the caller's own promise.
        unsafe { self.inner.all_gather_rows(rows, counts, deadline) }
    }

    forward_device_ops!(handle);

    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }

    fn broken(&self) -> Option<String> {
        self.inner.broken()
    }
}
