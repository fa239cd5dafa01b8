//! Memory the collectives keep for good: host buffers left to an NCCL comm thread that did not
//! answer, and an aborted communicator's scratch whose stream was not known idle. Never freed,
//! so a group whose comm threads keep going silent grows the process's memory with each: counted
//! here, process-wide, for the engine's metrics ([`memory_kept`]), and logged as each is kept.

use std::sync::atomic::{AtomicU64, Ordering};

static TIMES: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

/// What this process's collectives have kept for good so far.
///
/// ```
/// use dedup_broadcast::{memory_kept, MemoryKept};
/// // A process whose comm threads never went silent keeps nothing.
/// assert_eq!(memory_kept(), MemoryKept::default());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryKept {
    /// Times memory was kept (a buffer left to a silent comm thread; an aborted
    /// communicator's buffers, together).
    pub times: u64,
    /// The bytes of that memory.
    pub bytes: u64,
}

/// The memory this process's collectives kept for good so far.
pub fn memory_kept() -> MemoryKept {
    MemoryKept {
        times: TIMES.load(Ordering::Relaxed),
        bytes: BYTES.load(Ordering::Relaxed),
    }
}

/// Counts `bytes` kept for good (once); the caller logs its own line.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
pub(crate) fn count_kept(bytes: u64) {
    TIMES.fetch_add(1, Ordering::Relaxed);
    BYTES.fetch_add(bytes, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_time_kept_adds_its_bytes() {
        let before = memory_kept();
        count_kept(4096);
        let after = memory_kept();
        // Other tests of this process may keep memory meanwhile: at least this one's.
        assert!(after.times > before.times);
        assert!(after.bytes >= before.bytes + 4096);
    }
}
