//! Lease pins held for the length of a load, renewed before they run out, always released.

use std::time::{Duration, Instant};

use tracing::warn;

use crate::store::{KvStore, ReadSession, StoreError};

/// A read session over a batch's keys; ended on drop.
pub(crate) struct PinnedKeys<'a> {
    store: &'a dyn KvStore,
    session: Option<ReadSession>,
    renewed: Instant,
    every: Duration,
}

impl<'a> PinnedKeys<'a> {
    pub(crate) fn start(
        store: &'a dyn KvStore,
        keys: &[&str],
        every: Duration,
    ) -> Result<Self, StoreError> {
        let session = store.start_session(keys)?;
        Ok(PinnedKeys {
            store,
            session: Some(session),
            renewed: Instant::now(),
            every,
        })
    }

    /// Renews the pins if the renewal period has passed. Renewal extends: the fresh session
    /// starts before the old one ends, so every key stays pinned throughout (stores count
    /// sessions per key; ending the old one leaves the fresh one). If the fresh start fails,
    /// the old session is kept (and ended on drop).
    pub(crate) fn renew_if_due(&mut self) -> Result<(), StoreError> {
        if self.renewed.elapsed() < self.every {
            return Ok(());
        }
        let Some(current) = &self.session else {
            return Ok(());
        };
        let keys: Vec<&str> = current.keys.iter().map(String::as_str).collect();
        let fresh = self.store.start_session(&keys)?;
        if let Some(old) = self.session.replace(fresh) {
            if let Err(e) = self.store.end_session(&old) {
                warn!(error = %e, "ending a renewed read session failed");
            }
        }
        self.renewed = Instant::now();
        Ok(())
    }
}

impl Drop for PinnedKeys<'_> {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if let Err(e) = self.store.end_session(&s) {
                warn!(error = %e, keys = s.keys.len(), "ending a read session failed");
            }
        }
    }
}
