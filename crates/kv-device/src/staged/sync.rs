//! Synchronous copies over a stream, bounded: for pool reads and writes outside loads, and
//! small uploads (the slot table).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::{Device, DeviceError, PinnedMemory, SharedEvent, Stream, Transfer};

/// Longest a synchronous copy waits for its stream.
pub(crate) const SYNC_LIMIT: Duration = Duration::from_secs(60);

/// Waits for everything enqueued on `stream` so far, at most `limit`.
pub(crate) fn drain(stream: &Arc<dyn Stream>, limit: Duration) -> Result<(), DeviceError> {
    drain_or_park(stream, limit).map_err(|(e, _)| e)
}

/// [`drain`], and on failure the event that tells when the stream's work so far has ended
/// (`None` when none could be recorded, or it failed).
fn drain_or_park(
    stream: &Arc<dyn Stream>,
    limit: Duration,
) -> Result<(), (DeviceError, Option<SharedEvent>)> {
    let ev = stream.record().map_err(|e| (e, None))?;
    match ev.wait_until(kv_loader::deadline_after(limit)) {
        Ok(true) => Ok(()),
        Ok(false) => Err((
            DeviceError::Timeout {
                what: "stream drain",
                waited: limit,
            },
            Some(ev),
        )),
        Err(e) => Err((e, None)),
    }
}

/// Largest piece of one synchronous copy: a longer copy goes in pieces through one pinned
/// buffer of at most this size, so that reading a whole pool buffer out (gigabytes) neither
/// pins as much host memory nor keeps it pinned afterwards.
pub(crate) const BOUNCE_MAX: usize = 32 << 20;

/// A pinned buffer reused by synchronous copies (pinned allocation is slow, and synchronizing,
/// on CUDA): lent to one copy at a time, grown when a copy needs more, up to [`BOUNCE_MAX`].
///
/// A copy that does not finish within the bounce's limit parks its buffer here with the event
/// that tells its end: until that event completes every later copy through the bounce fails
/// at once ([`DeviceError::Poisoned`]) rather than waiting out the limit again and leaking a
/// buffer each time; once it completes the buffer is used again. A bounce dropped with a
/// parked copy still running leaks that buffer (the copy may still touch it). A copy whose
/// wait failed (its stream failed: no event can tell its end) leaks its buffer, and every
/// later copy through the bounce is refused for good, as the stream's later work fails too.
#[derive(Debug)]
pub(crate) struct Bounce {
    kept: Mutex<Option<PinnedMemory>>,
    parked: Mutex<Option<(PinnedMemory, SharedEvent)>>,
    /// A copy's wait failed: its buffer was leaked, and copies are refused from then on.
    lost: AtomicBool,
    limit: Duration,
}

impl Default for Bounce {
    fn default() -> Self {
        Bounce::with_limit(SYNC_LIMIT)
    }
}

impl Bounce {
    /// A bounce whose copies wait at most `limit` each.
    pub(crate) fn with_limit(limit: Duration) -> Self {
        Bounce {
            kept: Mutex::new(None),
            parked: Mutex::new(None),
            lost: AtomicBool::new(false),
            limit,
        }
    }

    /// True while a copy that ran past its limit has not finished: the stream it ran on is
    /// still stuck behind it (a failed poll counts as stuck).
    pub(crate) fn stuck(&self) -> bool {
        self.parked
            .lock()
            .as_ref()
            .is_some_and(|(_, ev)| !ev.is_complete().unwrap_or(false))
    }

    /// A pinned buffer of at least `len` bytes: the kept one, or a new one. Refused while a
    /// parked copy has not finished.
    pub(crate) fn take(
        &self,
        device: &dyn Device,
        len: usize,
    ) -> Result<PinnedMemory, DeviceError> {
        self.settle()?;
        match self.kept.lock().take() {
            Some(m) if m.len() >= len => Ok(m),
            _ => device.alloc_pinned(len, "synchronous copy"),
        }
    }

    /// Keeps `mem` for the next copy.
    pub(crate) fn give(&self, mem: PinnedMemory) {
        let mut kept = self.kept.lock();
        if kept.as_ref().is_none_or(|k| k.len() < mem.len()) {
            *kept = Some(mem);
        }
    }

    /// True while a copy through this bounce may still run: one parked past its limit that
    /// has not ended, or one whose wait failed. After a failed [`write`], false means nothing
    /// of it is still queued (it failed before its copy was queued, or the copy ended).
    pub(crate) fn may_still_run(&self) -> bool {
        self.lost.load(Ordering::Acquire) || self.stuck()
    }

    /// Takes back a parked buffer whose copy has ended; an error while one has not (or its
    /// event cannot tell: then it stays parked for good), and for good once a copy's wait
    /// failed.
    pub(crate) fn settle(&self) -> Result<(), DeviceError> {
        if self.lost.load(Ordering::Acquire) {
            return Err(DeviceError::Poisoned(
                "an earlier synchronous copy's wait failed (its stream failed): its buffer may \
                 still be in use, and later copies through it are refused",
            ));
        }
        let mut parked = self.parked.lock();
        let Some((_, ev)) = parked.as_ref() else {
            return Ok(());
        };
        if !ev.is_complete().unwrap_or(false) {
            return Err(DeviceError::Poisoned(
                "an earlier synchronous copy has not finished (its stream is stuck)",
            ));
        }
        if let Some((mem, _)) = parked.take() {
            drop(parked);
            self.give(mem);
        }
        Ok(())
    }

    /// Runs `transfer` (whose host side is `host`, taken from this bounce) on `stream` and
    /// waits for it, at most the bounce's limit; `host` back when it finished. When it did not,
    /// `host` is parked (or leaked, when no event tells the copy's end): the copy may still
    /// touch it.
    ///
    /// # Safety
    /// The transfer's device side is valid and untouched by others until this returns (or, on
    /// a timeout, for ever); its host side lies inside `host`.
    pub(crate) unsafe fn run(
        &self,
        stream: &Arc<dyn Stream>,
        transfer: Transfer,
        host: PinnedMemory,
    ) -> Result<PinnedMemory, DeviceError> {
        // SAFETY: the caller's promise for the device side; the host side is inside `host`,
        // which lives until the copy is known finished (parked, or leaked).
        unsafe { stream.transfer(transfer)? };
        self.finished(stream, host)
    }

    /// Waits for `stream`'s work so far, which uses `host` (this bounce's): `host` back when
    /// it ended, else parked (or leaked) and the error.
    pub(crate) fn finished(
        &self,
        stream: &Arc<dyn Stream>,
        host: PinnedMemory,
    ) -> Result<PinnedMemory, DeviceError> {
        match drain_or_park(stream, self.limit) {
            Ok(()) => Ok(host),
            Err((e, Some(ev))) => {
                tracing::error!(error = %e, "a synchronous copy did not finish: its host buffer is parked until it does; copies through this bounce fail meanwhile");
                if let Some((old, old_ev)) = self.parked.lock().replace((host, ev)) {
                    // Two copies at once (two threads) that both timed out: the earlier one's
                    // buffer is used again if its copy has ended, else kept for good.
                    if old_ev.is_complete().unwrap_or(false) {
                        self.give(old);
                    } else {
                        std::mem::forget(old);
                    }
                }
                Err(e)
            }
            Err((e, None)) => {
                tracing::error!(error = %e, "a synchronous copy's wait failed: leaking its host buffer; later copies through this bounce are refused");
                self.lost.store(true, Ordering::Release);
                std::mem::forget(host);
                Err(e)
            }
        }
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        if let Some((mem, ev)) = self.parked.get_mut().take() {
            if !ev.is_complete().unwrap_or(false) {
                // The copy may still touch it.
                std::mem::forget(mem);
            }
        }
    }
}

/// Copies `data` to device address `dst` and waits (bounded).
///
/// # Safety
/// `dst` is device memory of `device` valid for `data.len()` bytes, untouched by others until
/// this returns (for ever on a timeout).
pub(crate) unsafe fn write(
    device: &dyn Device,
    bounce: &Bounce,
    dst: u64,
    data: &[u8],
) -> Result<(), DeviceError> {
    let mut dst = dst;
    for piece in data.chunks(BOUNCE_MAX) {
        let host = bounce.take(device, piece.len())?;
        // SAFETY: `host` is ours (taken from the bounce), at least `piece.len()` bytes, idle.
        unsafe {
            std::ptr::copy_nonoverlapping(piece.as_ptr(), host.addr() as *mut u8, piece.len())
        };
        let t = Transfer::ToDevice {
            dst,
            src: host.addr(),
            len: piece.len(),
        };
        // SAFETY: the caller's promise for `dst..dst + data.len()`, of which this piece is a
        // part; the source is `host`.
        let host = unsafe { bounce.run(&device.load_stream(), t, host) }?;
        bounce.give(host);
        dst += piece.len() as u64;
    }
    Ok(())
}

/// Copies `out.len()` bytes from device address `src` into `out` and waits (bounded).
///
/// # Safety
/// `src` is device memory of `device` valid for `out.len()` bytes, not written by others
/// until this returns (for ever on a timeout).
pub(crate) unsafe fn read(
    device: &dyn Device,
    bounce: &Bounce,
    src: u64,
    out: &mut [u8],
) -> Result<(), DeviceError> {
    let mut src = src;
    for piece in out.chunks_mut(BOUNCE_MAX) {
        let host = bounce.take(device, piece.len())?;
        let t = Transfer::ToHost {
            dst: host.addr(),
            src,
            len: piece.len(),
        };
        // SAFETY: the caller's promise for `src..src + out.len()`, of which this piece is a
        // part; the destination is `host`.
        let host = unsafe { bounce.run(&device.load_stream(), t, host) }?;
        // SAFETY: the copy finished; `host` holds at least `piece.len()` bytes and is ours.
        unsafe {
            std::ptr::copy_nonoverlapping(host.addr() as *const u8, piece.as_mut_ptr(), piece.len())
        };
        bounce.give(host);
        src += piece.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CpuDevice;

    /// A copy that does not finish within the bounce's limit parks its buffer: later copies
    /// fail at once instead of waiting out the limit and leaking a buffer each; once the copy
    /// ended, the parked buffer is used again and copies go through.
    #[test]
    fn a_copy_past_its_limit_parks_its_buffer_and_later_copies_fail_fast_until_it_ends() {
        let dev = CpuDevice::new(0).unwrap();
        let mem = dev.alloc(4096, "test").unwrap();
        let bounce = Bounce::with_limit(Duration::from_millis(300));
        let data = vec![7u8; 4096];
        dev.stall_for(Duration::from_secs(3));
        // SAFETY: `mem` is ours, 4096 bytes, and nothing else touches it (the stalled copy
        // writes it later, with the same bytes as the copies below).
        let first = unsafe { write(&*dev, &bounce, mem.addr(), &data) };
        assert!(
            matches!(first, Err(DeviceError::Timeout { .. })),
            "{first:?}"
        );
        let parked = bounce.parked.lock().as_ref().map(|(m, _)| m.addr());
        assert!(parked.is_some(), "the buffer is parked");
        let t0 = std::time::Instant::now();
        // SAFETY: as above.
        let again = unsafe { write(&*dev, &bounce, mem.addr(), &data) };
        assert!(matches!(again, Err(DeviceError::Poisoned(_))), "{again:?}");
        assert!(
            t0.elapsed() < Duration::from_millis(250),
            "at once: {:?}",
            t0.elapsed()
        );
        let until = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            // SAFETY: as above.
            match unsafe { write(&*dev, &bounce, mem.addr(), &data) } {
                Ok(()) => break,
                Err(DeviceError::Poisoned(_)) if std::time::Instant::now() < until => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                other => panic!("{other:?}"),
            }
        }
        let kept = bounce.kept.lock().as_ref().map(PinnedMemory::addr);
        assert_eq!(kept, parked, "the parked buffer is used again");
        let mut out = vec![0u8; 4096];
        // SAFETY: as above; the writes have finished.
        unsafe { read(&*dev, &bounce, mem.addr(), &mut out) }.unwrap();
        assert_eq!(out, data);
    }

    /// A copy whose wait fails (its stream failed) leaks its buffer, and later copies through
    /// the bounce are refused at once. Before, each one queued on the failed stream, allocated
    /// a fresh pinned buffer, failed its wait and leaked that buffer too.
    #[test]
    fn a_copy_whose_wait_fails_refuses_later_copies_instead_of_leaking_a_buffer_each() {
        let slow = CpuDevice::new(1).unwrap();
        let dev = CpuDevice::with_config(
            0,
            crate::CpuDeviceConfig {
                wait_limit: Duration::from_millis(100),
                ..crate::CpuDeviceConfig::default()
            },
        )
        .unwrap();
        slow.stall_for(Duration::from_millis(500));
        // The load stream waits for an event that does not complete within its wait limit:
        // the stream fails, and so does every later event of it.
        let never_in_time = slow.load_stream().record().unwrap();
        dev.load_stream().wait(&never_in_time).unwrap();
        let mem = dev.alloc(4096, "test").unwrap();
        let bounce = Bounce::with_limit(Duration::from_secs(5));
        let data = vec![7u8; 4096];
        // SAFETY: `mem` is ours, 4096 bytes, and nothing else touches it (it is never freed
        // before the failed stream has skipped the copies).
        let first = unsafe { write(&*dev, &bounce, mem.addr(), &data) };
        assert!(
            first.is_err() && !matches!(first, Err(DeviceError::Poisoned(_))),
            "{first:?}"
        );
        // SAFETY: as above.
        let again = unsafe { write(&*dev, &bounce, mem.addr(), &data) };
        assert!(matches!(again, Err(DeviceError::Poisoned(_))), "{again:?}");
        let mut out = vec![0u8; 16];
        // SAFETY: as above.
        let read_back = unsafe { read(&*dev, &bounce, mem.addr(), &mut out) };
        assert!(
            matches!(read_back, Err(DeviceError::Poisoned(_))),
            "{read_back:?}"
        );
        assert!(bounce.kept.lock().is_none() && bounce.parked.lock().is_none());
    }

    #[test]
    fn a_copy_longer_than_the_bounce_goes_in_pieces_and_keeps_at_most_its_size_pinned() {
        let dev = CpuDevice::new(0).unwrap();
        let len = 2 * BOUNCE_MAX + 4099;
        let mem = dev.alloc(len, "test").unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4099) as u8).collect();
        let bounce = Bounce::default();
        // SAFETY: `mem` is ours, `len` bytes, and nothing else touches it.
        unsafe { write(&*dev, &bounce, mem.addr(), &data) }.unwrap();
        let mut out = vec![0u8; len];
        // SAFETY: as above; the write has finished.
        unsafe { read(&*dev, &bounce, mem.addr(), &mut out) }.unwrap();
        assert!(out == data, "the pieces land where they belong");
        let kept = bounce.kept.lock().as_ref().map(PinnedMemory::len);
        assert_eq!(
            kept,
            Some(BOUNCE_MAX),
            "one bounce of the largest piece kept"
        );
        // A piece off the middle of the allocation, across a piece boundary.
        let mut mid = vec![0u8; BOUNCE_MAX + 10];
        let at = BOUNCE_MAX / 2;
        // SAFETY: as above.
        unsafe { read(&*dev, &bounce, mem.addr() + at as u64, &mut mid) }.unwrap();
        assert!(mid == data[at..at + mid.len()]);
    }
}
