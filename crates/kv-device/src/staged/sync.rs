//! Synchronous copies over a stream, bounded: for pool reads and writes outside loads, and
//! small uploads (the slot table).

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

use crate::{Device, DeviceError, DeviceMemory, PinnedMemory, Stream, Transfer};

/// Longest a synchronous copy waits for its stream.
pub(crate) const SYNC_LIMIT: Duration = Duration::from_secs(60);

/// Waits for everything enqueued on `stream` so far, at most `limit`.
pub(crate) fn drain(stream: &Arc<dyn Stream>, limit: Duration) -> Result<(), DeviceError> {
    let ev = stream.record()?;
    match ev.wait_until(kv_loader::deadline_after(limit))? {
        true => Ok(()),
        false => Err(DeviceError::Timeout {
            what: "stream drain",
            waited: limit,
        }),
    }
}

/// Runs `transfer` (whose host side is `host`) on `stream` and waits for it, at most
/// [`SYNC_LIMIT`]. On a timeout `host` is leaked: the copy may still touch it.
///
/// # Safety
/// The transfer's device side is valid and untouched by others until this returns (or, on a
/// timeout, for ever); its host side lies inside `host`.
pub(crate) unsafe fn run(
    stream: &Arc<dyn Stream>,
    transfer: Transfer,
    host: PinnedMemory,
) -> Result<PinnedMemory, DeviceError> {
    // SAFETY: the caller's promise for the device side; the host side is inside `host`, which
    // lives until the copy is known finished (or is leaked).
    unsafe { stream.transfer(transfer)? };
    match drain(stream, SYNC_LIMIT) {
        Ok(()) => Ok(host),
        Err(e) => {
            tracing::error!(error = %e, "synchronous copy did not finish; leaking its host buffer");
            std::mem::forget(host);
            Err(e)
        }
    }
}

/// Largest piece of one synchronous copy: a longer copy goes in pieces through one pinned
/// buffer of at most this size, so that reading a whole pool buffer out (gigabytes) neither
/// pins as much host memory nor keeps it pinned afterwards.
pub(crate) const BOUNCE_MAX: usize = 32 << 20;

/// A pinned buffer reused by synchronous copies (pinned allocation is slow, and synchronizing,
/// on CUDA): lent to one copy at a time, grown when a copy needs more, up to [`BOUNCE_MAX`].
#[derive(Debug, Default)]
pub(crate) struct Bounce(Mutex<Option<PinnedMemory>>);

impl Bounce {
    /// A pinned buffer of at least `len` bytes: the kept one, or a new one.
    pub(crate) fn take(
        &self,
        device: &dyn Device,
        len: usize,
    ) -> Result<PinnedMemory, DeviceError> {
        match self.0.lock().take() {
            Some(m) if m.len() >= len => Ok(m),
            _ => device.alloc_pinned(len, "synchronous copy"),
        }
    }

    /// Keeps `mem` for the next copy.
    pub(crate) fn give(&self, mem: PinnedMemory) {
        let mut kept = self.0.lock();
        if kept.as_ref().is_none_or(|k| k.len() < mem.len()) {
            *kept = Some(mem);
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
        let host = unsafe { run(&device.load_stream(), t, host) }?;
        bounce.give(host);
        dst += piece.len() as u64;
    }
    Ok(())
}

/// `data` in a new device allocation (`what`), copied there and waited for (bounded). On any
/// failure of the copy the allocation is leaked, not freed: after a failed wait or a timeout
/// the copy may still write it (a failure before anything was queued leaks it too; rare, and
/// small: a slot table).
pub(crate) fn upload(
    device: &dyn Device,
    data: &[u8],
    what: &'static str,
) -> Result<DeviceMemory, DeviceError> {
    let mem = device.alloc(data.len(), what)?;
    // SAFETY: `mem` is ours, exactly `data.len()` bytes, touched by nothing else; on a failure
    // it is never freed (below), so it stays valid for a copy that may still run.
    match unsafe { write(device, &Bounce::default(), mem.addr(), data) } {
        Ok(()) => Ok(mem),
        Err(e) => {
            tracing::error!(what, error = %e, "an upload failed: its device memory is leaked (the copy may still write it)");
            std::mem::forget(mem);
            Err(e)
        }
    }
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
        let host = unsafe { run(&device.load_stream(), t, host) }?;
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
        let kept = bounce.0.lock().as_ref().map(PinnedMemory::len);
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
