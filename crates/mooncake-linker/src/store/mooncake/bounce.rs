//! Whole-object reads into memory the transport cannot write in place (over RDMA: memory not
//! registered with the store) go through a registered buffer of the store's own, the
//! **bounce**, and are copied out when the call returns. The load's checksum companions are
//! such reads: they land in buffers of the load's own, never in a registered pool. Before, over
//! RDMA they were refused, so a load with `verify_checksums` needed TCP.
//!
//! Bounce buffers are registered once and stay registered until the store drops; they are
//! freed after its client (the store's first field), so no transfer outlives them. A buffer a
//! transfer the client gave up on may still write is never reused nor freed, as the caller's
//! own buffer would not be; the reads of that call that succeeded are still copied out. At
//! most 256 MiB of bounces exist per store, and after a failed registration none is tried for
//! a minute (the reads are refused meanwhile, as they were before the bounce).

use std::ptr::NonNull;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::store::MooncakeStore;
use crate::store::{KvStore, MemoryRegion, ObjectGet, StoreError};

/// Most bytes one call reads through the bounce: larger reads into unregistered memory are
/// refused, as before (a companion object is a few KiB; a whole KV object belongs in a
/// registered pool).
pub const MAX_BOUNCE_BYTES: usize = 64 << 20;

/// Most bytes of bounce buffers a store keeps registered (free, lent and kept together):
/// past it, reads that would need a new buffer are refused until one is free again.
const MAX_BOUNCE_TOTAL: usize = 256 << 20;

/// The smallest bounce buffer made (a companion read of a few KiB then reuses one buffer).
const MIN_BOUNCE_BYTES: usize = 1 << 20;

/// After a registration failed, how long no new buffer is tried (a lasting cause, such as the
/// locked-memory limit, would otherwise cost every read a failed registration).
const RETRY_AFTER: Duration = Duration::from_secs(60);

/// The store's bounce buffers (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Bounces {
    state: Mutex<BounceState>,
}

#[derive(Debug, Default)]
struct BounceState {
    /// Registered and free.
    free: Vec<Box<[u8]>>,
    /// Bytes of the buffers registered, and possibly still written by a transfer the client
    /// gave up on: leaked when kept (never lent again nor freed; no `Box` of them is held,
    /// which would claim them unique while the transfer writes them).
    kept: usize,
    /// Bytes of every buffer made and still the store's (free, lent, kept).
    total: usize,
    /// Registrations that failed, each leaking its buffer (a registration that failed part
    /// way may have left the pages registered): counted apart from `total`, so that failures
    /// do not leave every later read refused as "all in use"; past
    /// [`MAX_FAILED_REGISTRATIONS`] (at most one a minute) no more are tried, and reads that
    /// need a bounce are refused for good.
    failed_registrations: u32,
    /// When a registration last failed.
    failed_at: Option<Instant>,
}

impl BounceState {
    /// Whether a new buffer of `len` bytes fits the budget: refused for now while buffers in
    /// use fill it (one comes back), for good when the buffers kept for good do (they never
    /// come back; said so, rather than as a passing refusal every read would retry).
    fn room_for(&self, len: usize) -> Result<(), StoreError> {
        if self.total.saturating_add(len) <= MAX_BOUNCE_TOTAL {
            return Ok(());
        }
        let kept = self.kept;
        if kept.saturating_add(len) > MAX_BOUNCE_TOTAL {
            return Err(StoreError::InvalidArgument {
                key: "<bounce>".into(),
                detail: format!(
                    "no bounce for a read into unregistered memory: {kept} bytes of the \
                     {MAX_BOUNCE_TOTAL}-byte budget are kept for good by transfers the store \
                     gave up on; none is lent again (read into registered memory)"
                ),
            });
        }
        Err(refused("the store's bounce buffers are all in use"))
    }
}

/// A bounce buffer lent to one call, held as the raw pointer of its leaked `Box` while the
/// call's transfers may write it (a `Box` moved or held then would claim it unique). Given
/// back (boxed again) or kept explicitly; one dropped otherwise (an unwind between lending
/// and giving back) stays leaked, never freed: it is registered, and a transfer may still
/// write it.
pub(super) struct Lent(Option<NonNull<[u8]>>);

impl Lent {
    fn of(buf: Box<[u8]>) -> Lent {
        Lent(Some(NonNull::from(Box::leak(buf))))
    }

    /// The buffer's first byte (dangling for none).
    fn base(&self) -> *mut u8 {
        self.0
            .map_or(NonNull::dangling().as_ptr(), |p| p.as_ptr().cast())
    }
}

impl Bounces {
    /// A registered buffer of at least `need` bytes: a free one, or a new one registered now.
    fn take(&self, store: &MooncakeStore, need: usize) -> Result<Lent, StoreError> {
        let len = need.max(MIN_BOUNCE_BYTES).next_power_of_two();
        {
            let mut st = self.state.lock();
            if let Some(i) = st.free.iter().position(|b| b.len() >= need) {
                return Ok(Lent::of(st.free.swap_remove(i)));
            }
            if st.failed_registrations >= MAX_FAILED_REGISTRATIONS {
                // Permanent: retrying cannot pass.
                return Err(StoreError::InvalidArgument {
                    key: "<bounce>".into(),
                    detail: format!(
                        "no bounce for a read into unregistered memory: {MAX_FAILED_REGISTRATIONS} \
                         bounce registrations failed (their buffers leaked); none is tried again"
                    ),
                });
            }
            if st.failed_at.is_some_and(|t| t.elapsed() < RETRY_AFTER) {
                return Err(refused(
                    "a bounce registration failed less than a minute ago",
                ));
            }
            st.room_for(len)?;
            st.total += len;
        }
        let Some(buf) = kv_device::zeroed_bytes(len) else {
            self.state.lock().total -= len;
            return Err(StoreError::NoSpace {
                key: "<bounce>".into(),
                detail: format!("{len} bytes for a registered bounce could not be allocated"),
            });
        };
        let buf = buf.into_boxed_slice();
        let region = MemoryRegion {
            addr: buf.as_ptr() as usize,
            len,
        };
        // SAFETY: the buffer is never freed while registered with the client: it is never
        // unregistered, and it goes back to `free` or `kept`, or is leaked (`Lent`'s drop, a
        // failed registration below); free buffers are freed when the store drops, after its
        // client (the store's first field).
        if let Err(e) = unsafe { store.register(region) } {
            // A registration that failed part way may have left the pages registered: leaked,
            // and counted as kept for good (at most `MAX_FAILED_REGISTRATIONS` such buffers).
            let (times, total) = crate::store::count_kept(len as u64);
            tracing::error!(bytes = len, times, total, error = %e,
                "memory kept for good: a bounce buffer whose registration failed part way may \
                 stay registered");
            std::mem::forget(buf);
            let mut st = self.state.lock();
            st.failed_at = Some(Instant::now());
            st.total -= len;
            st.failed_registrations = st.failed_registrations.saturating_add(1);
            return Err(e);
        }
        tracing::debug!(
            bytes = len,
            "registered a bounce buffer for reads into unregistered memory"
        );
        Ok(Lent::of(buf))
    }

    /// A buffer whose call is over: free for the next.
    fn give_back(&self, mut lent: Lent) {
        if let Some(raw) = lent.0.take() {
            // SAFETY: `raw` is the leaked `Box` of `Lent::of`, taken out of the loan (no other
            // pointer to it is used again), and the call that used it is over with no transfer
            // left running (the caller keeps it otherwise).
            let buf = unsafe { Box::from_raw(raw.as_ptr()) };
            self.state.lock().free.push(buf);
        }
    }

    /// A buffer a given-up transfer may still write: never lent again, never freed (not even
    /// with the store: a transfer the client gave up on is not known to have stopped when its
    /// client drops). It stays leaked: no `Box` of it is made again.
    fn keep(&self, mut lent: Lent) {
        if let Some(raw) = lent.0.take() {
            let len = raw.len();
            crate::store::keep_for_good(len as u64, "a bounce buffer");
            let mut st = self.state.lock();
            st.kept = st.kept.saturating_add(len);
        }
    }
}

fn refused(why: &str) -> StoreError {
    StoreError::Unavailable {
        detail: format!("no bounce for a read into unregistered memory: {why}").into(),
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
                    Some(Err(e)) => Some(e),
                    _ => None,
                };
                let why_words = why.as_ref().map_or_else(
                    || format!("more than {MAX_BOUNCE_BYTES} bytes"),
                    |e| e.to_string(),
                );
                // Once a minute at `warn`: a refusal that lasts (the budget held by buffers
                // kept for good) meets every later read of unregistered memory.
                match self.call_failures.due_after("bounce refused") {
                    Some(skipped) => tracing::warn!(
                        why = why_words,
                        skipped,
                        "reads into unregistered memory not bounced (`skipped`: such reads \
                         since the last line, logged at debug)"
                    ),
                    None => tracing::debug!(
                        why = why_words,
                        "reads into unregistered memory not bounced"
                    ),
                }
                // SAFETY: the caller's promise, for the same gets.
                let read = unsafe { self.get_into_in_place(gets) };
                let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();
                return not_bounced(read, &keys, outside, why);
            }
        };
        let base = lent.base();
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
        // Every read that succeeded is copied out, also when another of the call was given
        // up on (its slice of the bounce is its own, and finished).
        for ((g, at), r) in gets.iter().zip(&at).zip(&out) {
            if let (Some(o), Ok(n)) = (at, r) {
                let n = usize::try_from(*n).map_or(g.len, |n| n.min(g.len));
                // SAFETY: the bounce slice `o..o + n` (within `need`, which the bounce holds)
                // was written by the call that returned; `g.dst` is valid for `g.len >= n`
                // bytes (the caller's promise) and is not the bounce (memory the store does
                // not own).
                unsafe { std::ptr::copy_nonoverlapping(base.wrapping_add(*o), g.dst, n) };
            }
        }
        if out
            .iter()
            .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
        {
            self.bounces.keep(lent);
        } else {
            self.bounces.give_back(lent);
        }
        out
    }
}

/// Failed bounce registrations after which no more are tried (each leaked its buffer).
const MAX_FAILED_REGISTRATIONS: u32 = 16;

/// The results of reads whose unregistered destinations (`outside`) could not be bounced:
/// read in place, those are refused (`InvalidArgument`: what a read into unregistered memory
/// is); where a bounce was not to be had for a passing reason (`why`: every bounce in use, a
/// registration that failed a moment ago), they fail with that reason instead, which may
/// pass (a load retried then succeeds). Each names its own key (`keys`, as the reads').
fn not_bounced(
    mut read: Vec<Result<u64, StoreError>>,
    keys: &[&str],
    outside: &[usize],
    why: Option<StoreError>,
) -> Vec<Result<u64, StoreError>> {
    if let Some(why) = why {
        for &i in outside {
            if let (Some(r), Some(key)) = (read.get_mut(i), keys.get(i)) {
                *r = Err(why.clone().for_key(key));
            }
        }
    }
    read
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, a read whose bounce was not to be had (every bounce in use) was refused as an
    /// invalid argument, a permanent failure: it fails with the bounce's own, passing reason.
    #[test]
    fn reads_not_bounced_for_a_passing_reason_fail_with_it() {
        let invalid = || StoreError::InvalidArgument {
            key: "k".into(),
            detail: "unregistered".into(),
        };
        let read = vec![Ok(8), Err(invalid()), Err(invalid())];
        let busy = refused("the store's bounce buffers are all in use");
        let keys = ["a", "b", "c"];
        let out = not_bounced(read.clone(), &keys, &[1, 2], Some(busy.clone()));
        assert_eq!(out, vec![Ok(8), Err(busy.clone()), Err(busy.clone())]);
        assert!(busy.failure().is_retryable());
        // Too large to bounce at all: refused as before.
        assert_eq!(not_bounced(read.clone(), &keys, &[1, 2], None), read);
    }

    /// Before, a budget filled by buffers kept for good was refused as "all in use", a passing
    /// reason every read retried, for good.
    #[test]
    fn a_budget_filled_by_kept_buffers_is_refused_for_good() {
        let mut st = BounceState::default();
        let mib = 1 << 20;
        assert!(st.room_for(mib).is_ok());
        // In use (lent): refused for now.
        st.total = MAX_BOUNCE_TOTAL;
        let busy = st.room_for(mib).unwrap_err();
        assert!(busy.failure().is_retryable(), "{busy:?}");
        // Kept for good: refused for good.
        st.kept = MAX_BOUNCE_TOTAL;
        let gone = st.room_for(mib).unwrap_err();
        assert!(!gone.failure().is_retryable(), "{gone:?}");
        assert!(gone.to_string().contains("kept for good"), "{gone}");
    }

    /// A bounce that could not be had for good (its registrations failed) is told about each
    /// read it failed by that read's key, not as `<bounce>` for all.
    #[test]
    fn reads_not_bounced_name_their_own_keys() {
        let stand_in = StoreError::InvalidArgument {
            key: "<bounce>".into(),
            detail: "no bounce".into(),
        };
        let read = vec![Ok(8), Err(stand_in.clone()), Err(stand_in.clone())];
        let out = not_bounced(read, &["a", "k1", "k2"], &[1, 2], Some(stand_in));
        let named: Vec<String> = out
            .iter()
            .filter_map(|r| match r {
                Err(StoreError::InvalidArgument { key, .. }) => Some(key.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(named, ["k1", "k2"]);
    }
}
