//! Whole-object reads into memory the transport cannot write in place (over RDMA: memory not
//! registered with the store) go through a registered buffer of the store's own, the
//! **bounce**, and are copied out when the call returns. The load's checksum companions are
//! such reads: they land in buffers of the load's own, never in a registered pool. Before, over
//! RDMA they were refused, so a load with `verify_checksums` needed TCP.
//!
//! Bounce buffers are registered once and stay registered until the store drops; they are
//! freed after its client (the store's first field), so no transfer outlives them. A buffer a
//! transfer the client gave up on may still write is never reused (kept until the store
//! drops), as the caller's own buffer would be.

use parking_lot::Mutex;

use super::store::MooncakeStore;
use crate::store::{KvStore, MemoryRegion, ObjectGet, StoreError};

/// Most bytes one call reads through the bounce: larger reads into unregistered memory are
/// refused, as before (a companion object is a few KiB; a whole KV object belongs in a
/// registered pool).
pub const MAX_BOUNCE_BYTES: usize = 64 << 20;

/// The smallest bounce buffer made (a companion read of a few KiB then reuses one buffer).
const MIN_BOUNCE_BYTES: usize = 1 << 20;

/// The store's bounce buffers (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Bounces {
    /// Registered and free.
    free: Mutex<Vec<Box<[u8]>>>,
    /// Registered, and possibly still written by a transfer the client gave up on.
    kept: Mutex<Vec<Box<[u8]>>>,
}

/// A bounce buffer lent to one call.
pub(super) struct Lent(Box<[u8]>);

impl Bounces {
    /// A registered buffer of at least `need` bytes: a free one, or a new one registered now.
    fn take(&self, store: &MooncakeStore, need: usize) -> Result<Lent, StoreError> {
        {
            let mut free = self.free.lock();
            if let Some(i) = free.iter().position(|b| b.len() >= need) {
                return Ok(Lent(free.swap_remove(i)));
            }
        }
        let len = need.max(MIN_BOUNCE_BYTES).next_power_of_two();
        let mut buf = Vec::new();
        buf.try_reserve_exact(len)
            .map_err(|_| StoreError::NoSpace {
                key: "<bounce>".into(),
                detail: format!("{len} bytes for a registered bounce could not be allocated"),
            })?;
        buf.resize(len, 0u8);
        let buf = buf.into_boxed_slice();
        let region = MemoryRegion {
            addr: buf.as_ptr() as usize,
            len,
        };
        // SAFETY: the buffer is never freed while registered with the client: it goes back to
        // `free` or `kept` (never dropped on its own) and is freed when the store drops, after
        // its client (the store's first field), and it is never unregistered.
        unsafe { store.register(region) }?;
        tracing::debug!(
            bytes = len,
            "registered a bounce buffer for reads into unregistered memory"
        );
        Ok(Lent(buf))
    }

    /// A buffer whose call is over: free for the next.
    fn give_back(&self, lent: Lent) {
        self.free.lock().push(lent.0);
    }

    /// A buffer a given-up transfer may still write: never lent again.
    fn keep(&self, lent: Lent) {
        self.kept.lock().push(lent.0);
    }
}

impl MooncakeStore {
    /// [`KvStore::get_into`] where some destinations are memory the transport cannot write
    /// in place (`outside`, indices into `gets`, all of valid keys and non-null destinations):
    /// those are read into one bounce buffer, back to back, and copied out. More than
    /// [`MAX_BOUNCE_BYTES`] of them, or a bounce that cannot be had, and they are refused as
    /// before (the reason is logged).
    ///
    /// # Safety
    /// As [`KvStore::get_into`].
    pub(super) unsafe fn get_into_bounced(
        &self,
        gets: &[ObjectGet<'_>],
        outside: &[usize],
    ) -> Vec<Result<u64, StoreError>> {
        let need = outside
            .iter()
            .try_fold(0usize, |sum, &i| sum.checked_add(gets[i].len))
            .filter(|&n| n <= MAX_BOUNCE_BYTES);
        let lent = match need.map(|n| self.bounces.take(self, n)) {
            Some(Ok(lent)) => lent,
            why => {
                let why = match why {
                    Some(Err(e)) => e.to_string(),
                    _ => format!("more than {MAX_BOUNCE_BYTES} bytes"),
                };
                tracing::warn!(why, "reads into unregistered memory not bounced: refused");
                // SAFETY: the caller's promise, for the same gets.
                return unsafe { self.get_into_in_place(gets) };
            }
        };
        let mut lent = lent;
        let base = lent.0.as_mut_ptr();
        let mut at = vec![None; gets.len()];
        let mut off = 0usize;
        for &i in outside {
            at[i] = Some(off);
            off += gets[i].len;
        }
        let routed: Vec<ObjectGet<'_>> = gets
            .iter()
            .zip(&at)
            .map(|(g, at)| ObjectGet {
                key: g.key,
                // `o + len` of every routed get is at most `need`, which the bounce holds.
                dst: at.map_or(g.dst, |o| base.wrapping_add(o)),
                len: g.len,
            })
            .collect();
        // SAFETY: every destination is the caller's (its promise) or a distinct slice of the
        // bounce, which is registered, lent to this call alone and alive until it returns.
        let out = unsafe { self.get_into_in_place(&routed) };
        if out
            .iter()
            .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
        {
            self.bounces.keep(lent);
            return out;
        }
        for ((g, at), r) in gets.iter().zip(&at).zip(&out) {
            if let (Some(o), Ok(n)) = (at, r) {
                let n = usize::try_from(*n).map_or(g.len, |n| n.min(g.len));
                // SAFETY: the bounce slice `o..o + n` was written by the call that returned;
                // `g.dst` is valid for `g.len >= n` bytes (the caller's promise) and is not
                // the bounce (memory the store does not own).
                unsafe { std::ptr::copy_nonoverlapping(lent.0.as_ptr().add(*o), g.dst, n) };
            }
        }
        self.bounces.give_back(lent);
        out
    }
}
