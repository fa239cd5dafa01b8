//! A timeline of one batch's reads and share steps: a store decorator that notes when each
//! ranged read call starts and ends, and a data-collective decorator that holds every host-row
//! share step until enough read calls have started (a gate, no sleeps) and notes when rank 0's
//! returns. Used to check that a rank reads its next group while its exchange loop is still
//! sharing the last one: where the reader waited for the exchange loop instead, the gate would
//! hold the share step until it gives up, and says so in the timeline.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::{Collective, CollectiveError, MemorySupport};
use kvlink::kv_device::HostRow;
use kvlink::mooncake_linker::store::{KvStore, RangedGet, StoreError};

/// What happened, in the order it happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// A ranged read call started.
    ReadStart,
    /// A ranged read call returned.
    ReadEnd,
    /// Rank 0's share step of one layer returned.
    Shared,
    /// A share step's gate gave up waiting for the reads it needed.
    GateGaveUp,
}

/// The shared timeline.
#[derive(Debug, Default, Clone)]
pub struct Timeline(Arc<Mutex<Vec<(Instant, Step)>>>);

impl Timeline {
    fn note(&self, step: Step) {
        self.0.lock().unwrap().push((Instant::now(), step));
    }

    /// The steps so far, in time order.
    pub fn steps(&self) -> Vec<Step> {
        let mut v = self.0.lock().unwrap().clone();
        v.sort_by_key(|(t, _)| *t);
        v.into_iter().map(|(_, s)| s).collect()
    }

    pub fn clear(&self) {
        self.0.lock().unwrap().clear();
    }

    fn count(&self, step: Step) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| *s == step)
            .count()
    }
}

/// Notes the start and end of every ranged read call; forwards everything.
pub struct TimedReads {
    pub inner: Arc<dyn KvStore>,
    pub timeline: Timeline,
}

// SAFETY: a test decorator: the calls it forwards (`forward_store_calls!`) and those it
// writes reach the inner store, whose results it returns as they are or fails before it
// (touching nothing); it starts no thread that touches caller memory.
unsafe impl KvStore for TimedReads {
    kvlink::mooncake_linker::forward_store_calls!(inner => exists, object_size, get_into, put,
        remove, discard, register, unregister, start_session, end_session, health);

    fn name(&self) -> &str {
        "timed-reads"
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        self.timeline.note(Step::ReadStart);
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_ranges(gets) };
        self.timeline.note(Step::ReadEnd);
        r
    }
}

/// Every host-row share step waits, before it shares, until `reads_needed(n)` read calls
/// have started (n: this rank's share steps so far), at most [`GATE_LIMIT`]; a wait that runs
/// out is noted as [`Step::GateGaveUp`]. Rank 0 notes when each of its steps returns.
/// Everything else is forwarded.
pub struct PacedShares {
    inner: Arc<dyn Collective>,
    reads_needed: fn(usize) -> usize,
    timeline: Timeline,
    calls: AtomicUsize,
}

/// Longest a share step's gate waits for its reads (under the tests' collective timeout, so
/// a gate that gives up says so before the batch times out).
pub const GATE_LIMIT: Duration = Duration::from_secs(3);

impl PacedShares {
    pub fn new(
        inner: Arc<dyn Collective>,
        reads_needed: fn(usize) -> usize,
        timeline: Timeline,
    ) -> Self {
        PacedShares {
            inner,
            reads_needed,
            timeline,
            calls: AtomicUsize::new(0),
        }
    }

    /// The decorated handle (always there).
    fn handle(&self, _op: &'static str) -> Result<Arc<dyn Collective>, CollectiveError> {
        Ok(self.inner.clone())
    }

    /// Waits until this step's reads have started (bounded).
    fn gate(&self) {
        let n = self.calls.fetch_add(1, Ordering::AcqRel);
        let needed = (self.reads_needed)(n);
        let limit = Instant::now() + GATE_LIMIT;
        while self.timeline.count(Step::ReadStart) < needed {
            if Instant::now() >= limit {
                self.timeline.note(Step::GateGaveUp);
                return;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn shared(&self) {
        if self.inner.rank() == 0 {
            self.timeline.note(Step::Shared);
        }
    }
}

impl super::coll::DeviceEventHook for PacedShares {}

// SAFETY: a gate that only delays, then every operation, `broken` and `may_leave_work` on
// the inner handle, whose events it returns as they are.
unsafe impl Collective for PacedShares {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    fn size(&self) -> u32 {
        self.inner.size()
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        self.inner.all_gather_u64(value, deadline)
    }

    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        self.inner.all_gather_u64_settled(value, deadline)
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.inner.all_gather_bytes(value, deadline)
    }

    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.inner.all_gather_bytes_settled(value, deadline)
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
        self.gate();
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.broadcast_rows(rows, root, deadline) };
        self.shared();
        r
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.gate();
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.all_gather_rows(rows, counts, deadline) };
        self.shared();
        r
    }

    super::coll::forward_device_ops!(handle);

    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }

    fn broken(&self) -> Option<String> {
        self.inner.broken()
    }
}
