//! Lease pins held for the length of a load, renewed before they run out, always released.
//! Every session call is bounded (`LinkerConfig::store_call_timeout`).

use std::time::{Duration, Instant};

use tracing::warn;

use crate::store::{ReadSession, StoreCalls, StoreError};

/// A read session over a batch's keys; ended on drop.
pub(crate) struct PinnedKeys<'a> {
    calls: &'a StoreCalls,
    timeout: Duration,
    session: Option<ReadSession>,
    /// What a renewal pins: the batch's own keys (an adopted session may cover more).
    keys: Vec<String>,
    renewed: Instant,
    /// The renewal period: the configured one, or half the session's lease when that is
    /// shorter ([`period`]).
    every: Duration,
    /// The configured renewal period (`LinkerConfig::lease_renewal`).
    configured: Duration,
}

/// How often a session is renewed: `configured`, or half the lease the store granted when
/// that is shorter. A store whose lease is at most the configured period (an embedded store
/// `with_lease` a second, say, against the default two) would otherwise let the pins lapse
/// between renewals: its objects could be evicted under the load. (At least [`MIN_PERIOD`], or
/// `configured` itself when that is shorter still: a lease is never renewed more often than
/// every [`MIN_PERIOD`]).
pub(super) fn period(configured: Duration, session: Option<&ReadSession>) -> Duration {
    match session.and_then(|s| s.lease) {
        Some(lease) if lease / 2 < configured => (lease / 2).max(MIN_PERIOD.min(configured)),
        _ => configured,
    }
}

/// The shortest renewal period a store's short lease brings (a session start before every
/// store call is what a zero `lease_renewal` is refused for).
const MIN_PERIOD: Duration = Duration::from_millis(50);

impl<'a> PinnedKeys<'a> {
    /// A session over `keys`, renewed every `every`; each session call waits at most
    /// `timeout`. No keys (a rank that reads nothing of the batch: not rank 0 in
    /// `Rank0Broadcast` of an all-replicated model, fewer pages than ranks in
    /// `SplitAllGather`): no session and no store call, so a slow or stuck master call does
    /// not fail a batch this rank reads nothing of.
    pub(crate) fn start(
        calls: &'a StoreCalls,
        keys: &[&str],
        every: Duration,
        timeout: Duration,
    ) -> Result<Self, StoreError> {
        // The lease runs from when the store granted it, somewhere inside the call: counted
        // from the call's start, so that a slow call does not push the renewal past it.
        let started = Instant::now();
        let session = if keys.is_empty() {
            None
        } else {
            Some(calls.start_session(keys, kv_loader::deadline_after(timeout))?)
        };
        let period = period(every, session.as_ref());
        if period < every {
            tracing::debug!(
                ?period,
                configured = ?every,
                "renewing the read session at half the store's lease, under lease_renewal"
            );
        }
        Ok(PinnedKeys {
            calls,
            timeout,
            every: period,
            session,
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            renewed: started,
            configured: every,
        })
    }

    /// Takes over `session`, started at `started` (pins a lookup took, `pins_ahead`), for a
    /// batch that reads `keys` (which the session covers, and maybe more): it is renewed as
    /// [`start`](Self::start)'s would be, counting from `started`, over `keys` alone (a key it
    /// does not read, evicted since, must not fail the batch), and ended on drop.
    pub(crate) fn adopt(
        calls: &'a StoreCalls,
        (session, keys): (ReadSession, &[&str]),
        started: Instant,
        every: Duration,
        timeout: Duration,
    ) -> Self {
        PinnedKeys {
            calls,
            timeout,
            every: period(every, Some(&session)),
            session: Some(session),
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            renewed: started,
            configured: every,
        }
    }

    fn deadline(&self) -> Instant {
        kv_loader::deadline_after(self.timeout)
    }

    /// How often the session is renewed.
    #[cfg(test)]
    pub(crate) fn renewal_period(&self) -> Duration {
        self.every
    }

    /// How long until the next renewal is due (zero when it is).
    pub(crate) fn until_due(&self) -> Duration {
        self.every.saturating_sub(self.renewed.elapsed())
    }

    /// Renews the pins if the renewal period has passed. Renewal extends: the fresh session
    /// starts before the old one ends, so every key stays pinned throughout (stores count
    /// sessions per key; ending the old one leaves the fresh one). If the fresh start fails,
    /// the old session is kept (and ended on drop).
    pub(crate) fn renew_if_due(&mut self) -> Result<(), StoreError> {
        if self.renewed.elapsed() < self.every {
            return Ok(());
        }
        if self.session.is_none() {
            return Ok(());
        }
        let keys: Vec<&str> = self.keys.iter().map(String::as_str).collect();
        // Counted from the call's start, as in `start`.
        let started = Instant::now();
        let fresh = self.calls.start_session(&keys, self.deadline())?;
        self.every = period(self.configured, Some(&fresh));
        if let Some(old) = self.session.replace(fresh) {
            if let Err(e) = self.calls.end_session(&old, self.deadline()) {
                warn!(error = %e, "ending a renewed read session failed");
            }
        }
        self.renewed = started;
        Ok(())
    }
}

impl Drop for PinnedKeys<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = self.calls.end_session(&s, self.deadline()) {
                warn!(error = %e, keys = s.keys.len(), "ending a read session failed");
            }
        }
    }
}

/// A fault-injecting store over an embedded one that holds one 8-byte object `key` (tests of
/// read sessions).
#[cfg(test)]
pub(crate) fn faulty_store_holding(key: &str) -> std::sync::Arc<crate::store::FaultyStore> {
    use crate::store::{EmbeddedStore, FaultyStore, KvStore, ObjectPut};
    let inner = std::sync::Arc::new(EmbeddedStore::new(1 << 20));
    let bytes = [7u8; 8];
    let put = ObjectPut {
        key,
        parts: [(bytes.as_ptr(), bytes.len())].into_iter().collect(),
    };
    // SAFETY: `bytes` is a live slice, read-only for the call.
    assert!(unsafe { inner.put(&[put]) }[0].is_ok());
    std::sync::Arc::new(FaultyStore::new(inner))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::store::{EmbeddedStore, Fault, FaultCall, FaultRule, FaultyStore, KvStore};

    /// A session whose start took longer than the renewal period is due for renewal at once:
    /// its lease ran from inside the call. Before, the period was counted from the call's
    /// end, so a slow store left the pins to lapse before the renewal came.
    #[test]
    fn the_renewal_counts_from_the_session_calls_start() {
        let faulty = faulty_store_holding("k");
        let slow = Duration::from_millis(150);
        faulty.inject_on(FaultCall::Session, FaultRule::default(), Fault::Delay(slow));
        let store: Arc<dyn KvStore> = faulty;
        let calls = StoreCalls::new(store);
        let every = Duration::from_millis(100);
        let pins = PinnedKeys::start(&calls, &["k"], every, Duration::from_secs(5)).unwrap();
        assert!(
            pins.renewed.elapsed() >= every,
            "the renewal is due once the slow call returns"
        );
    }

    /// A store whose lease is shorter than twice the configured period is renewed at half
    /// its lease. Before, an embedded store `with_lease` a second under the default two
    /// seconds' renewal let the pins lapse between renewals (its objects evictable mid-load).
    #[test]
    fn a_lease_shorter_than_the_renewal_is_renewed_at_half_the_lease() {
        let store = EmbeddedStore::new(1 << 20).with_lease(Some(Duration::from_secs(1)));
        let bytes = [7u8; 8];
        let put = crate::store::ObjectPut {
            key: "k",
            parts: [(bytes.as_ptr(), bytes.len())].into_iter().collect(),
        };
        // SAFETY: `bytes` is a live slice, read-only for the call.
        assert!(unsafe { store.put(&[put]) }[0].is_ok());
        let calls = StoreCalls::new(Arc::new(store) as Arc<dyn KvStore>);
        let timeout = Duration::from_secs(5);
        let every = Duration::from_secs(2);
        let pins = PinnedKeys::start(&calls, &["k"], every, timeout).unwrap();
        assert_eq!(pins.renewal_period(), Duration::from_millis(500));
        // A lease of next to nothing is not renewed before every call.
        let tiny = ReadSession {
            keys: Vec::new(),
            lease: Some(Duration::from_millis(1)),
            token: 0,
        };
        assert_eq!(period(every, Some(&tiny)), MIN_PERIOD);
        // A lease longer than twice the period leaves the period as configured.
        let pins = PinnedKeys::start(&calls, &["k"], Duration::from_millis(400), timeout).unwrap();
        assert_eq!(pins.renewal_period(), Duration::from_millis(400));
    }

    /// Before, a rank that reads nothing of a batch still started (and renewed) a read
    /// session of no keys: a store call that, queued behind a stuck master call, failed a
    /// batch this rank needed nothing of.
    #[test]
    fn no_keys_pin_nothing_and_call_no_store() {
        let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 20))));
        let failing = crate::store::StoreError::RpcTimeout { key: "k".into() };
        faulty.inject_on(
            FaultCall::Session,
            FaultRule::default(),
            Fault::Error(failing),
        );
        let store: Arc<dyn KvStore> = faulty;
        let calls = StoreCalls::new(store);
        let every = Duration::ZERO;
        let mut pins = PinnedKeys::start(&calls, &[], every, Duration::from_secs(5)).unwrap();
        assert!(pins.session.is_none());
        pins.renew_if_due().unwrap();
        assert!(pins.session.is_none(), "nothing to renew");
        // The fault is real: a session of one key fails on it.
        assert!(PinnedKeys::start(&calls, &["k"], every, Duration::from_secs(5)).is_err());
    }
}
