//! A SIMULATION of a remote store for benchmarks: wraps a store and paces its reads as if
//! they crossed a network — a link per client (its NIC) and one link shared by every client
//! (the storage node's), each with a bandwidth, plus a latency per request. It moves no bytes
//! over any network; everything it names says "simulated".

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::{KvStore, ObjectGet, RangeChecksums, RangedGet, StoreError};

/// A modelled link: transfers queue on it first come, first served at `gbps`.
#[derive(Debug)]
pub struct SimulatedLink {
    gbps: f64,
    free_at: Mutex<Instant>,
}

impl SimulatedLink {
    /// A link of `gbps` GB/s (1e9 bytes per second); non-positive means unlimited.
    pub fn new(gbps: f64) -> Self {
        SimulatedLink {
            gbps,
            free_at: Mutex::new(Instant::now()),
        }
    }

    /// Reserves the link for `bytes` from `now`; returns when the transfer ends.
    fn reserve(&self, now: Instant, bytes: u64) -> Instant {
        if !(self.gbps.is_finite() && self.gbps > 0.0) {
            return now;
        }
        let mut free = self.free_at.lock();
        let start = (*free).max(now);
        // A link too slow to say in a Duration takes "forever" (saturating, never a panic).
        let took =
            Duration::try_from_secs_f64(bytes as f64 / (self.gbps * 1e9)).unwrap_or(Duration::MAX);
        let end = kv_loader::deadline_from(start, took);
        *free = end;
        end
    }
}

/// One client's view of a simulated remote store: reads of the wrapped store are delayed
/// until they would have crossed this client's link and the shared link, plus `latency` per
/// batched call. Puts, lookups and everything else pass through unpaced.
///
/// ```
/// use std::sync::Arc;
/// use std::time::Duration;
/// use mooncake_linker::store::{EmbeddedStore, KvStore, SimulatedLink, SimulatedRemoteStore};
/// let shared = Arc::new(SimulatedLink::new(2.0));
/// let rank0 = SimulatedRemoteStore::new(Arc::new(EmbeddedStore::new(1 << 20)), shared, 1.5, Duration::from_micros(50));
/// assert!(rank0.name().contains("SIMULATED"));
/// ```
pub struct SimulatedRemoteStore {
    inner: Arc<dyn KvStore>,
    shared: Arc<SimulatedLink>,
    own: SimulatedLink,
    latency: Duration,
    name: String,
}

impl std::fmt::Debug for SimulatedRemoteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimulatedRemoteStore")
            .finish_non_exhaustive()
    }
}

impl SimulatedRemoteStore {
    /// A client with a link of `client_gbps` to a store whose node link (`shared`) all
    /// clients made with the same `shared` use.
    pub fn new(
        inner: Arc<dyn KvStore>,
        shared: Arc<SimulatedLink>,
        client_gbps: f64,
        latency: Duration,
    ) -> Self {
        let name = format!(
            "{} (SIMULATED remote: {} GB/s shared, {client_gbps} GB/s per client, {latency:?} per call)",
            inner.name(),
            shared.gbps
        );
        SimulatedRemoteStore {
            inner,
            own: SimulatedLink::new(client_gbps),
            shared,
            latency,
            name,
        }
    }

    fn pace(&self, started: Instant, bytes: u64) {
        let done = kv_loader::deadline_from(
            self.own
                .reserve(started, bytes)
                .max(self.shared.reserve(started, bytes)),
            self.latency,
        );
        let now = Instant::now();
        if done > now {
            std::thread::sleep(done - now);
        }
    }
}

// SAFETY: every call goes to the inner store and its results come back unchanged; the
// pacing only sleeps within the call.
unsafe impl KvStore for SimulatedRemoteStore {
    crate::forward_store_calls!(inner => exists, object_size, put, remove, discard, register,
        unregister, start_session, end_session, health);

    fn name(&self) -> &str {
        &self.name
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let t0 = Instant::now();
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_into(gets) };
        self.pace(t0, r.iter().flatten().sum());
        r
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let t0 = Instant::now();
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_ranges(gets) };
        self.pace(t0, r.iter().flatten().sum());
        r
    }

    // Paced like `get_ranges`; the bytes are the inner store's, so are its checksums.
    unsafe fn get_ranges_checksummed(
        &self,
        gets: &[RangedGet<'_>],
        sums: &mut [RangeChecksums],
    ) -> Vec<Result<u64, StoreError>> {
        let t0 = Instant::now();
        // SAFETY: forwarded with the caller's own promise.
        let r = unsafe { self.inner.get_ranges_checksummed(gets, sums) };
        self.pace(t0, r.iter().flatten().sum());
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{EmbeddedStore, ObjectPut, ReadRange};

    #[test]
    fn a_link_too_slow_to_time_saturates_instead_of_panicking() {
        let now = Instant::now();
        let end = SimulatedLink::new(1e-300).reserve(now, u64::MAX);
        assert!(end >= now + Duration::from_secs(3600));
        // Queued behind it: still no overflow.
        let link = SimulatedLink::new(f64::MIN_POSITIVE);
        let first = link.reserve(now, 1 << 40);
        assert!(link.reserve(now, 1 << 40) >= first);
    }

    #[test]
    fn concurrent_readers_share_the_node_link() {
        let inner: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 24));
        let data = vec![7u8; 1 << 20];
        let put = ObjectPut {
            key: "o",
            parts: [(data.as_ptr(), data.len())].into_iter().collect(),
        };
        // SAFETY: `data` is live and unchanged during the call.
        assert!(unsafe { inner.put(&[put]) }[0].is_ok());
        // 1 MiB at 0.5 GB/s shared: ≈ 2.1 ms alone, ≈ 4.2 ms for two readers together.
        let shared = Arc::new(SimulatedLink::new(0.5));
        let read = |s: &SimulatedRemoteStore| {
            let mut out = vec![0u8; 1 << 20];
            let g = RangedGet {
                key: "o",
                ranges: [ReadRange {
                    dst: out.as_mut_ptr(),
                    len: out.len(),
                    offset: 0,
                }]
                .into_iter()
                .collect(),
            };
            // SAFETY: `out` is ours and untouched during the call.
            assert_eq!(unsafe { s.get_ranges(&[g]) }[0], Ok(1 << 20));
        };
        let a = SimulatedRemoteStore::new(inner.clone(), shared.clone(), 100.0, Duration::ZERO);
        let b = SimulatedRemoteStore::new(inner, shared, 100.0, Duration::ZERO);
        let t0 = Instant::now();
        read(&a);
        let alone = t0.elapsed();
        let t0 = Instant::now();
        std::thread::scope(|s| {
            s.spawn(|| read(&a));
            s.spawn(|| read(&b));
        });
        let together = t0.elapsed();
        assert!(alone >= Duration::from_micros(2000), "{alone:?}");
        assert!(together >= Duration::from_micros(4000), "{together:?}");
        assert!(a.name().contains("SIMULATED"));
    }
}
