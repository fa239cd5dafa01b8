//! Memory that one call of the wheel may still use after it returned.
//!
//! Mooncake's client waits for a call's transfers for at most 60 s
//! (`TransferEngineOperationState::wait_for_completion`); then it returns an error with the
//! transfers still in flight, and they may go on reading or writing the call's memory. So a
//! call that failed after [`CLIENT_GIVES_UP_AFTER`] (on either clock, or across a wall-clock
//! step: [`CallClock`]) must leave its memory allocated for good.
//! So must a call the shim cut short by catching an exception the wheel threw (or an
//! allocation failure) inside it: the wheel may have submitted transfers it then never waited
//! for.
//! The safe slice methods of [`Client`](crate::Client) therefore never hand the wheel the
//! caller's memory: they read and write a buffer of their own, copied in or out, and
//! keep it (leak it) when the call failed that late.

use std::time::{Duration, Instant, SystemTime};

use crate::error::{MooncakeError, Result};

/// How long Mooncake's client waits for a call's transfers before it gives up on them and
/// returns with them still in flight (60 s), less a margin: a call that failed after this
/// long is taken as one the client gave up on, whose memory its transfers may still use.
pub const CLIENT_GIVES_UP_AFTER: Duration = Duration::from_secs(55);

/// How far the wall clock may drift from the monotonic one over a call before the call is
/// taken as one across which the wall clock was stepped.
const CLOCK_SLACK: Duration = Duration::from_secs(1);

/// When a wheel call started, on both clocks its client's give-up depends on.
///
/// Mooncake's client times its wait for a call's transfers on the wall clock
/// (`CLOCK_REALTIME`, in `TransferEngineOperationState::wait_for_completion`), which an NTP
/// step, `date -s` or a resumed VM moves: a step forward of a minute makes it give up at its
/// next poll, transfers in flight, after a fraction of a second by the monotonic clock. So a
/// call counts as one the client may have given up on ([`CallSpan::past`]) when either clock
/// says it ran the limit, or the wall clock was stepped during it (it drifted more than a
/// second from the monotonic clock, or went back: a step forward before that cannot be told
/// out).
///
/// ```
/// use std::time::Duration;
/// use mooncake_sys::{CallClock, CLIENT_GIVES_UP_AFTER};
/// let clock = CallClock::start();
/// let span = clock.span();
/// assert!(span.monotonic < Duration::from_secs(1));
/// assert!(!span.past(CLIENT_GIVES_UP_AFTER));
/// ```
#[derive(Debug, Clone, Copy)]
pub struct CallClock {
    monotonic: Instant,
    wall: SystemTime,
}

impl CallClock {
    /// Now, on both clocks.
    pub fn start() -> Self {
        CallClock {
            monotonic: Instant::now(),
            wall: SystemTime::now(),
        }
    }

    /// The span from the start to now, on both clocks.
    pub fn span(&self) -> CallSpan {
        CallSpan {
            monotonic: self.monotonic.elapsed(),
            wall: SystemTime::now().duration_since(self.wall).ok(),
        }
    }
}

/// How long a call took on both clocks (see [`CallClock`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSpan {
    /// Elapsed on the monotonic clock.
    pub monotonic: Duration,
    /// Elapsed on the wall clock; `None` when it went back.
    pub wall: Option<Duration>,
}

impl CallSpan {
    /// Whether the call may have outlived the client's wait of `limit` for its transfers:
    /// either clock says it ran `limit`, or the wall clock was stepped during it (see
    /// [`CallClock`]).
    pub fn past(&self, limit: Duration) -> bool {
        let Some(wall) = self.wall else {
            return true;
        };
        let drift = wall.abs_diff(self.monotonic);
        self.monotonic >= limit || wall >= limit || drift > CLOCK_SLACK
    }
}

/// Whether `r` is a call the shim cut short: it caught an exception thrown inside the wheel's
/// call, or an allocation failure, so transfers the call submitted may not have been waited
/// for.
pub(crate) fn cut_short<T>(r: &Result<T>) -> bool {
    r.as_ref().is_err_and(MooncakeError::cut_short)
}

/// A buffer owned by one wheel call: handed back after the call, or kept for good when the
/// call failed after [`CLIENT_GIVES_UP_AFTER`] or was cut short.
pub(crate) struct CallBuffer {
    bytes: Vec<u8>,
    started: CallClock,
}

impl CallBuffer {
    /// `len` zeroed bytes (an error, not an allocation abort, when they cannot be had). The
    /// memory comes zeroed from the allocator (fresh pages are not touched until bytes land
    /// in them), so that a size no host can back fails or is backed as it is written, rather
    /// than every page being written up front (under overcommit, an out-of-memory kill).
    pub(crate) fn zeroed(operation: &'static str, len: usize) -> Result<Self> {
        if len == 0 {
            return Ok(Self::owning(Vec::new()));
        }
        // A size no allocation can ever have (past `isize::MAX`, as an overflowed sum is
        // passed on): an argument that cannot work, never memory that may free up.
        let layout =
            std::alloc::Layout::array::<u8>(len).map_err(|_| MooncakeError::InvalidArguments {
                operation,
                detail: format!("a buffer of {len} bytes cannot exist"),
            })?;
        // SAFETY: `layout` has a non-zero size (`len > 0`).
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return Err(MooncakeError::OutOfMemory {
                operation,
                bytes: len,
            });
        }
        // SAFETY: `ptr` was allocated by the global allocator with the layout of `len` bytes
        // of `u8` (so capacity `len`), and all `len` of them are initialised (zeroed).
        let bytes = unsafe { Vec::from_raw_parts(ptr, len, len) };
        Ok(Self::owning(bytes))
    }

    /// The parts, back to back.
    pub(crate) fn copy_of(operation: &'static str, parts: &[&[u8]]) -> Result<Self> {
        let len = parts
            .iter()
            .try_fold(0usize, |n, p| n.checked_add(p.len()))
            .ok_or_else(|| MooncakeError::InvalidArguments {
                operation,
                detail: "the values' total length overflows".into(),
            })?;
        let mut b = Self::zeroed(operation, len)?;
        let mut at = 0;
        for p in parts {
            b.bytes[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(b)
    }

    fn owning(bytes: Vec<u8>) -> Self {
        Self {
            bytes,
            started: CallClock::start(),
        }
    }

    /// The bytes (for a call that only reads them).
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// Per part of `lens`, back to back: its address (for a call that writes them). An error
    /// when the parts do not fit in the buffer.
    pub(crate) fn parts(
        &mut self,
        operation: &'static str,
        lens: &[usize],
    ) -> Result<Vec<*mut u8>> {
        let len = self.bytes.len();
        // One base pointer for every part (`Vec::as_mut_ptr` makes no reference that a later
        // part's would invalidate).
        let base = self.bytes.as_mut_ptr();
        let mut at = 0usize;
        let mut ptrs = Vec::with_capacity(lens.len());
        for &n in lens {
            let end = at.checked_add(n).filter(|&e| e <= len).ok_or_else(|| {
                MooncakeError::InvalidArguments {
                    operation,
                    detail: format!("parts of {lens:?} bytes do not fit in {len}"),
                }
            })?;
            // SAFETY: `at <= end <= len`: the offset stays within the buffer (or one past it,
            // for a last empty part).
            ptrs.push(unsafe { base.add(at) });
            at = end;
        }
        Ok(ptrs)
    }

    /// After the call: the bytes back, or `None` when the call `failed` after
    /// [`CLIENT_GIVES_UP_AFTER`] or was `cut_short` (see [`cut_short`]), in which case the
    /// buffer is kept for good (leaked).
    pub(crate) fn after(self, failed: bool, cut_short: bool) -> Option<Vec<u8>> {
        if cut_short || (failed && self.started.span().past(CLIENT_GIVES_UP_AFTER)) {
            // Transfers the client gave up on, or never waited for, may still use these
            // bytes.
            std::mem::forget(self.bytes);
            return None;
        }
        Some(self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sys::shim_codes;

    /// Before, a buffer the allocator could not give was `InvalidArguments` (a permanent
    /// failure for the caller); it is `OutOfMemory`, which may pass. A size no buffer can
    /// have stays `InvalidArguments`.
    #[test]
    fn a_buffer_that_cannot_be_allocated_is_out_of_memory() {
        let len = isize::MAX as usize;
        assert!(matches!(
            CallBuffer::zeroed("put", len),
            Err(MooncakeError::OutOfMemory { bytes, .. }) if bytes == len
        ));
        assert!(matches!(
            CallBuffer::zeroed("put", usize::MAX),
            Err(MooncakeError::InvalidArguments { .. })
        ));
    }

    #[test]
    fn parts_tile_the_copied_values_in_order() {
        let mut b = CallBuffer::copy_of("test", &[b"ab", b"", b"cde"]).unwrap();
        assert_eq!(b.bytes(), b"abcde");
        let ptrs = b.parts("test", &[2, 0, 3]).unwrap();
        let base = b.bytes().as_ptr() as usize;
        let offsets: Vec<usize> = ptrs.iter().map(|p| *p as usize - base).collect();
        assert_eq!(offsets, [0, 2, 2]);
        assert!(
            b.parts("test", &[2, 4]).is_err(),
            "parts past the end are refused"
        );
        assert_eq!(
            b.after(true, false).as_deref(),
            Some(&b"abcde"[..]),
            "failed at once: freed"
        );
    }

    /// A call the shim cut short (an exception caught inside the wheel's call) keeps its
    /// buffer however soon it failed: the wheel may not have waited for its transfers.
    #[test]
    fn a_call_cut_short_keeps_its_buffer() {
        let status = |code: i32| -> Result<()> {
            Err(MooncakeError::Status {
                operation: "get_into",
                key: None,
                code: crate::error::ErrorCode(code),
                message: None,
            })
        };
        assert!(cut_short(&status(shim_codes::EXCEPTION)));
        assert!(cut_short(&status(shim_codes::OUT_OF_MEMORY)));
        assert!(!cut_short(&status(-704)), "a status of the wheel's own");
        assert!(!cut_short(&status(shim_codes::SHIM_EXCEPTION)));
        assert!(!cut_short(&status(shim_codes::SHIM_OUT_OF_MEMORY)));
        assert!(!cut_short(&Ok(())));
        let b = CallBuffer::zeroed("test", 8).unwrap();
        assert!(b.after(true, true).is_none(), "kept");
    }

    /// The client times its give-up on the wall clock: a call of 0.2 s across which the wall
    /// clock stepped a minute forward, or back, or drifted, may have been given up on. Before,
    /// only the monotonic clock was read, and such a call's memory was freed under transfers
    /// still running.
    #[test]
    fn a_step_of_the_wall_clock_counts_the_call_as_given_up() {
        let limit = CLIENT_GIVES_UP_AFTER;
        let short = Duration::from_millis(200);
        let past = |monotonic, wall| CallSpan { monotonic, wall }.past(limit);
        assert!(!past(short, Some(short)));
        assert!(
            past(short, Some(Duration::from_secs(61))),
            "stepped forward"
        );
        assert!(past(short, None), "stepped back");
        assert!(past(short, Some(Duration::from_secs(3))), "drifted");
        assert!(past(limit, Some(limit)), "ran the limit");
        assert!(
            !past(short, Some(Duration::from_millis(900))),
            "within the slack"
        );
    }

    /// A large buffer is not written up front: 2 GiB of it adds far less than that to the
    /// process's resident memory. Before, every byte was written at allocation (a size the
    /// host cannot back was an out-of-memory kill under overcommit, not an error).
    #[test]
    fn a_large_zeroed_buffer_is_not_written_up_front() {
        let resident = || -> u64 {
            let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
            let pages: u64 = statm
                .split_whitespace()
                .nth(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            pages * 4096
        };
        let before = resident();
        let b = CallBuffer::zeroed("test", 2 << 30).unwrap();
        let grew = resident().saturating_sub(before);
        assert!(grew < 1 << 30, "resident memory grew by {grew} bytes");
        assert_eq!(b.bytes()[(2 << 30) - 1], 0);
    }
}
