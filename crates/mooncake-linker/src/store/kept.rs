//! Memory kept for good: buffers (and pool rows) a store call's transfer may still use after
//! the store gave up on it (`StoreError::Abandoned`), and registered regions the store did
//! not unregister. They are never freed nor handed on, so a store that keeps stalling grows
//! the process's memory with each such call: counted here, process-wide, for the engine's
//! metrics ([`kept_for_good`]), and logged as each is kept.

use std::sync::atomic::{AtomicU64, Ordering};

static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process keeps for good so far, over every store and linker.
///
/// ```
/// use mooncake_linker::store::{kept_for_good, KeptForGood};
/// // A process whose store never gave up on a transfer keeps nothing.
/// assert_eq!(kept_for_good(), KeptForGood::default());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KeptForGood {
    /// Times memory was kept: one store call given up on may keep several buffers (a ranged
    /// read its scratch and its targets, a put its staging and its sources), each counted;
    /// so is each registered region the store did not unregister (refused, panicked, or no
    /// worker to ask it), which stays registered and allocated.
    pub calls: u64,
    /// The bytes of that memory (buffers of the calls' own, and pool or staging rows they
    /// held, which stay out of use).
    pub bytes: u64,
}

/// The memory kept for good so far in this process.
pub fn kept_for_good() -> KeptForGood {
    KeptForGood {
        calls: CALLS.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
    }
}

/// One call's memory, `bytes` of it (`what` it was), is kept for good.
pub(crate) fn keep_for_good(bytes: u64, what: &'static str) {
    let (calls, total) = count_kept(bytes);
    tracing::error!(
        bytes,
        what,
        calls,
        total,
        "memory kept for good: a transfer the store gave up on may still use it"
    );
}

/// Counts `bytes` kept for good (once), not logged: for a caller that logs its own line.
/// The counts so far (calls, bytes), this one included.
pub(crate) fn count_kept(bytes: u64) -> (u64, u64) {
    let calls = CALLS.fetch_add(1, Ordering::Relaxed).saturating_add(1);
    let total = BYTES
        .fetch_add(bytes, Ordering::Relaxed)
        .saturating_add(bytes);
    (calls, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_call_kept_adds_its_bytes() {
        let before = kept_for_good();
        keep_for_good(4096, "a test's buffer");
        let after = kept_for_good();
        // Other tests of this process may keep memory meanwhile: at least this call's.
        assert!(after.calls > before.calls);
        assert!(after.bytes >= before.bytes + 4096);
    }
}
