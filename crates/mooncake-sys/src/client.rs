//! The safe client handle.

use std::ffi::c_void;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::call_buffer::{cut_short, CallBuffer};
use crate::error::{ErrorCode, MooncakeError, Result};
use crate::library::Library;
use crate::result::{self, CKeys, ReplicateConfig, SetupArgs};
use crate::sys::KvlinkMcRange;

/// Per-key outcome of a batch call.
pub type KeyResult<T> = std::result::Result<T, ErrorCode>;

/// What `health_check` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Health {
    /// Set up and the master answers.
    Healthy,
    /// Not set up, or closed.
    Closed,
    /// The master does not answer.
    MasterUnreachable,
    /// A value this crate does not know.
    Other(i32),
}

/// A Mooncake store client (`RealClient` inside the loaded library), set up and connected.
///
/// The client is shared between threads by reference (`&Client`); all methods take `&self`.
/// Dropping it tears the client down (`tearDownAll`: its segment is unmounted, so objects held
/// only there disappear) and frees it.
///
/// Memory handed to the client: the methods taking slices copy them into (or out of) a buffer
/// of their own, which they keep for good when a call failed late enough that its transfers
/// may still run ([`CLIENT_GIVES_UP_AFTER`](crate::CLIENT_GIVES_UP_AFTER) on either clock, or
/// across a wall-clock step: [`CallClock`](crate::CallClock)): Mooncake's whole-object calls
/// wait for their transfers for 60 s at most, timed on the wall clock. Its ranged reads
/// ([`batch_get_ranges_raw`](Self::batch_get_ranges_raw)) wait for every transfer with no time
/// limit (a storage node that stops sending mid-payload holds the call until its socket
/// fails): bound the caller yourself. The `*_raw` methods take raw pointers for zero-copy
/// into registered regions; their contracts are on each.
///
/// Only over TCP does the wheel move bytes from and to memory it has not registered: over any
/// other transport (RDMA) the slice methods but [`put`](Self::put) (the copying put, through
/// the client's local buffer) are refused with `InvalidArguments` rather than sent to fail
/// key by key: use the `*_raw` methods on registered regions there.
pub struct Client {
    lib: Arc<Library>,
    store: NonNull<c_void>,
    /// The transport moves bytes from and to any memory (TCP), not only registered regions.
    any_memory: bool,
}

// SAFETY: the handle is a heap-allocated `shared_ptr<RealClient>` that is not tied to the
// thread that created it. `RealClient` is used concurrently from many threads by its Python
// users (SGLang's HiCache backend) and by upstream's own Rust crate (which declares its store
// `Send + Sync`); kvlink's own test with 4 threads sharing one client saw no error.
// The only operation needing exclusivity, `destroy`, happens in `Drop` (which has `&mut self`).
unsafe impl Send for Client {}
// SAFETY: see `Send` above: every `&self` method is a thread-safe call into `RealClient`.
unsafe impl Sync for Client {}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("library", &self.lib.path())
            .field("handle", &self.store)
            .finish()
    }
}

impl Client {
    /// Creates a client and sets it up (mounts `global_segment_size` bytes of this process's
    /// RAM into the pool, connects to the master).
    pub fn connect(lib: Arc<Library>, args: &SetupArgs) -> Result<Self> {
        let store = result::create(&lib)?;
        let store = NonNull::new(store).ok_or(MooncakeError::CreateFailed { message: None })?;
        let client = Self {
            lib,
            store,
            any_memory: moves_any_memory(&args.protocol),
        };
        // SAFETY: `client.store` was just created by `client.lib`; on failure `client` is
        // dropped, which destroys the handle exactly once.
        unsafe { result::setup(&client.lib, client.raw(), args) }?;
        Ok(client)
    }

    /// Refuses `operation`, a zero-copy call on a buffer of the call's own (not registered),
    /// where the transport moves registered memory only.
    fn own_buffer_moves(&self, operation: &'static str) -> Result<()> {
        if self.any_memory {
            return Ok(());
        }
        Err(MooncakeError::InvalidArguments {
            operation,
            detail: "this transport moves registered memory only, and the call's own buffer is \
                     not registered: use the copying `put`, or the `*_raw` calls on registered \
                     regions"
                .into(),
        })
    }

    /// The library this client lives in.
    pub fn library(&self) -> &Arc<Library> {
        &self.lib
    }

    /// The raw handle, for [`crate::result`] calls. It stays valid while `self` lives.
    pub fn raw(&self) -> *mut c_void {
        self.store.as_ptr()
    }

    /// `health_check`.
    pub fn health(&self) -> Result<Health> {
        // SAFETY: `self.store` is a live handle of `self.lib` until `Drop`.
        let v = unsafe { result::health_check(&self.lib, self.raw()) }?;
        Ok(match v {
            0 => Health::Healthy,
            1 => Health::Closed,
            2 => Health::MasterUnreachable,
            other => Health::Other(other),
        })
    }

    /// Puts a copy of `value` under `key` (first write wins: an existing key is left as it is).
    pub fn put(&self, key: &str, value: &[u8], cfg: &ReplicateConfig) -> Result<()> {
        let copy = CallBuffer::copy_of("put", &[value])?;
        // SAFETY: live handle (see `health`); `copy` is ours, kept for good by `after` when
        // the call failed late enough that a transfer may still read it.
        let r = unsafe { result::put(&self.lib, self.raw(), key, copy.bytes(), cfg) };
        copy.after(r.is_err(), cut_short(&r));
        r
    }

    /// Reads the whole object `key` into `buf` (which must be at least as large as the object)
    /// and returns its size. The object is read into a buffer of the call's own and copied.
    pub fn get_into(&self, key: &str, buf: &mut [u8]) -> Result<usize> {
        self.own_buffer_moves("get_into")?;
        let (bytes, n) = self.read_owned(key, buf.len())?;
        let n = usize::try_from(n).unwrap_or(usize::MAX);
        let copied = n.min(buf.len()).min(bytes.len());
        buf[..copied].copy_from_slice(&bytes[..copied]);
        Ok(n)
    }

    /// Reads the whole object `key` into a new vector.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.own_buffer_moves("get")?;
        let size = self.get_size(key)?;
        // A size the store reports is input: one that cannot be allocated is an error, not an
        // allocation abort.
        let len = usize::try_from(size).map_err(|_| MooncakeError::InvalidArguments {
            operation: "get",
            detail: format!("`{key}`: an object of {size} bytes cannot be allocated here"),
        })?;
        let (mut bytes, n) = self.read_owned(key, len)?;
        bytes.truncate(usize::try_from(n).unwrap_or(usize::MAX));
        Ok(bytes)
    }

    /// `get_into` into a buffer of `len` bytes of its own: the buffer and the object's size.
    fn read_owned(&self, key: &str, len: usize) -> Result<(Vec<u8>, u64)> {
        let mut into = CallBuffer::zeroed("get_into", len)?;
        let ptr = into.parts("get_into", &[len])?[0];
        // SAFETY: live handle; `ptr` is our buffer of `len` bytes, written by this call only,
        // and kept for good by `after` when the call failed late enough that a transfer may
        // still write it.
        let r = unsafe { result::get_into(&self.lib, self.raw(), key, ptr, len) };
        // Kept (`None`) only after a failure, which `?` returns.
        let bytes = into.after(r.is_err(), cut_short(&r));
        Ok((bytes.unwrap_or_default(), r?))
    }

    /// Whether `key` exists.
    pub fn is_exist(&self, key: &str) -> Result<bool> {
        // SAFETY: live handle.
        unsafe { result::is_exist(&self.lib, self.raw(), key) }
    }

    /// Per key, whether it exists.
    pub fn batch_is_exist<K: AsRef<str>>(&self, keys: &[K]) -> Result<Vec<KeyResult<bool>>> {
        let keys = CKeys::new(keys)?;
        // SAFETY: live handle.
        unsafe { result::batch_is_exist(&self.lib, self.raw(), &keys) }
    }

    /// The size of object `key` in bytes.
    pub fn get_size(&self, key: &str) -> Result<u64> {
        // SAFETY: live handle.
        unsafe { result::get_size(&self.lib, self.raw(), key) }
    }

    /// The address this client registered under.
    pub fn hostname(&self) -> Result<String> {
        // SAFETY: live handle.
        unsafe { result::get_hostname(&self.lib, self.raw()) }
    }

    /// Removes `key` (`force`: even when it holds a lease).
    pub fn remove(&self, key: &str, force: bool) -> Result<()> {
        // SAFETY: live handle.
        unsafe { result::remove(&self.lib, self.raw(), key, force) }
    }

    /// Removes every key matching the regular expression; returns how many.
    pub fn remove_by_regex(&self, pattern: &str, force: bool) -> Result<u64> {
        // SAFETY: live handle.
        unsafe { result::remove_by_regex(&self.lib, self.raw(), pattern, force) }
    }

    /// Removes every object of the cluster; returns how many.
    pub fn remove_all(&self, force: bool) -> Result<u64> {
        // SAFETY: live handle.
        unsafe { result::remove_all(&self.lib, self.raw(), force) }
    }

    /// Batched put from slices (first write wins per key).
    pub fn batch_put<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        cfg: &ReplicateConfig,
    ) -> Result<Vec<KeyResult<()>>> {
        self.batch_write("batch_put", keys, values, |k, p, s| {
            // SAFETY: the pointers are `batch_write`'s own buffer, as it promises.
            unsafe { self.batch_put_from_raw(k, p, s, cfg) }
        })
    }

    /// Batched upsert from slices (overwrites existing keys).
    pub fn batch_upsert<K: AsRef<str>>(
        &self,
        keys: &[K],
        values: &[&[u8]],
        cfg: &ReplicateConfig,
    ) -> Result<Vec<KeyResult<()>>> {
        self.batch_write("batch_upsert", keys, values, |k, p, s| {
            // SAFETY: the pointers are `batch_write`'s own buffer, as it promises.
            unsafe { self.batch_upsert_from_raw(k, p, s, cfg) }
        })
    }

    /// A batched write of copies of `values`: `call` gets pointers into a buffer of this
    /// call's own, valid for reads of their sizes for the call and, when it failed late
    /// enough that a transfer may still read them, for good.
    fn batch_write<K: AsRef<str>>(
        &self,
        operation: &'static str,
        keys: &[K],
        values: &[&[u8]],
        call: impl FnOnce(&CKeys, &[*mut u8], &[usize]) -> Result<Vec<KeyResult<()>>>,
    ) -> Result<Vec<KeyResult<()>>> {
        self.own_buffer_moves(operation)?;
        let keys = CKeys::new(keys)?;
        let mut copy = CallBuffer::copy_of(operation, values)?;
        let lens: Vec<usize> = values.iter().map(|v| v.len()).collect();
        let ptrs = copy.parts(operation, &lens)?;
        let r = call(&keys, &ptrs, &lens);
        copy.after(failed(&r), cut_short(&r));
        r
    }

    /// Batched whole-object reads into slices; per key, the object's size.
    pub fn batch_get_into<K: AsRef<str>>(
        &self,
        keys: &[K],
        bufs: &mut [&mut [u8]],
    ) -> Result<Vec<KeyResult<u64>>> {
        self.own_buffer_moves("batch_get_into")?;
        let keys = CKeys::new(keys)?;
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let total = lens.iter().try_fold(0usize, |n, &l| n.checked_add(l));
        let mut into = CallBuffer::zeroed("batch_get_into", total.unwrap_or(usize::MAX))?;
        let ptrs = into.parts("batch_get_into", &lens)?;
        // SAFETY: live handle; the pointers are parts of our own buffer, written by this call
        // only, and kept for good by `after` when it failed late enough that a transfer may
        // still write them.
        let r = unsafe { self.batch_get_into_raw(&keys, &ptrs, &lens) };
        // Every key read is copied out, also when the buffer is then kept for good: each from
        // its own part only, since a transfer given up on may still write another key's part.
        if let Ok(per_key) = &r {
            for (((buf, &from), &len), got) in bufs.iter_mut().zip(&ptrs).zip(&lens).zip(per_key) {
                if let Ok(n) = got {
                    let n = usize::try_from(*n)
                        .unwrap_or(usize::MAX)
                        .min(len)
                        .min(buf.len());
                    // SAFETY: `from` is this key's part of our buffer, `len` bytes, which the
                    // call has finished writing (its result is in); `buf` is the caller's, at
                    // least `n` bytes, distinct from our buffer.
                    unsafe { std::ptr::copy_nonoverlapping(from, buf.as_mut_ptr(), n) };
                }
            }
        }
        into.after(failed(&r), cut_short(&r));
        r
    }

    /// Starts a read session (replicas resolved once, read lease per key): needed before
    /// [`Client::batch_get_ranges_raw`].
    pub fn batch_get_session_start<K: AsRef<str>>(&self, keys: &[K]) -> Result<Vec<KeyResult<()>>> {
        let keys = CKeys::new(keys)?;
        // SAFETY: live handle.
        unsafe { result::batch_get_session_start(&self.lib, self.raw(), &keys) }
    }

    /// Ends a read session for `keys`.
    pub fn batch_get_session_end<K: AsRef<str>>(&self, keys: &[K]) -> Result<()> {
        let keys = CKeys::new(keys)?;
        // SAFETY: live handle.
        unsafe { result::batch_get_session_end(&self.lib, self.raw(), &keys) }
    }

    /// Zero-copy batched put: per key, `sizes[i]` bytes at `ptrs[i]`.
    ///
    /// # Safety
    /// Each `ptrs[i]` is valid for reads of `sizes[i]` bytes for the duration of the call (for
    /// good when it fails and a [`CallClock`](crate::CallClock) started before it says
    /// [`past`](crate::CallSpan::past)`(`[`CLIENT_GIVES_UP_AFTER`](crate::CLIENT_GIVES_UP_AFTER)`)`
    /// after it, both clocks read: its transfers may still run) and lies in a region
    /// registered with
    /// [`Client::register_buffer`] (required by RDMA).
    pub unsafe fn batch_put_from_raw(
        &self,
        keys: &CKeys,
        ptrs: &[*mut u8],
        sizes: &[usize],
        cfg: &ReplicateConfig,
    ) -> Result<Vec<KeyResult<()>>> {
        // SAFETY: live handle; pointer contract forwarded from the caller.
        unsafe { result::batch_put_from(&self.lib, self.raw(), keys, ptrs, sizes, cfg) }
    }

    /// Zero-copy batched upsert.
    ///
    /// # Safety
    /// As [`Client::batch_put_from_raw`].
    pub unsafe fn batch_upsert_from_raw(
        &self,
        keys: &CKeys,
        ptrs: &[*mut u8],
        sizes: &[usize],
        cfg: &ReplicateConfig,
    ) -> Result<Vec<KeyResult<()>>> {
        // SAFETY: live handle; pointer contract forwarded from the caller.
        unsafe { result::batch_upsert_from(&self.lib, self.raw(), keys, ptrs, sizes, cfg) }
    }

    /// Zero-copy batched whole-object reads.
    ///
    /// # Safety
    /// Each `ptrs[i]` is valid for writes of `sizes[i]` bytes, not accessed by anything else
    /// during the call (for good when it fails and a [`CallClock`](crate::CallClock) started
    /// before it says [`past`](crate::CallSpan::past)`(`[`CLIENT_GIVES_UP_AFTER`](crate::CLIENT_GIVES_UP_AFTER)`)`
    /// after it: its transfers may still run), and lies in a registered region (required by
    /// RDMA).
    pub unsafe fn batch_get_into_raw(
        &self,
        keys: &CKeys,
        ptrs: &[*mut u8],
        sizes: &[usize],
    ) -> Result<Vec<KeyResult<u64>>> {
        // SAFETY: live handle; pointer contract forwarded from the caller.
        unsafe { result::batch_get_into(&self.lib, self.raw(), keys, ptrs, sizes) }
    }

    /// Zero-copy ranged reads: key `i` owns the next `range_counts[i]` entries of `ranges`.
    /// Per key, the bytes read. The keys must be in a read session.
    ///
    /// # Safety
    /// Every `ranges[j].dst` is valid for writes of `ranges[j].size` bytes, not accessed by
    /// anything else during the call (for good when the call was cut short,
    /// [`MooncakeError::cut_short`](crate::MooncakeError::cut_short): the wheel may have
    /// submitted transfers it never waited for; otherwise the wheel's ranged read returns
    /// only once every transfer it submitted has ended, however late), and lies in a
    /// registered region (required by RDMA).
    pub unsafe fn batch_get_ranges_raw(
        &self,
        keys: &CKeys,
        range_counts: &[usize],
        ranges: &[KvlinkMcRange],
    ) -> Result<Vec<KeyResult<u64>>> {
        // SAFETY: live handle; pointer contract forwarded from the caller.
        unsafe { result::batch_get_ranges(&self.lib, self.raw(), keys, range_counts, ranges) }
    }

    /// Registers `[ptr, ptr + len)` with the transfer engine, for zero-copy transfers.
    ///
    /// # Safety
    /// The region stays allocated until [`Client::unregister_buffer`] or until the client is
    /// dropped.
    pub unsafe fn register_buffer(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: live handle; region lifetime guaranteed by the caller.
        unsafe { result::register_buffer(&self.lib, self.raw(), ptr, len) }
    }

    /// Unregisters a region registered with [`Client::register_buffer`].
    ///
    /// # Safety
    /// No transfer using the region is in flight: no call using it is running, and none that
    /// used it failed late (past the client's own 60 s transfer timeout, after which it
    /// returns with its transfers possibly still running).
    pub unsafe fn unregister_buffer(&self, ptr: *mut u8) -> Result<()> {
        // SAFETY: live handle; no transfer in flight (caller).
        unsafe { result::unregister_buffer(&self.lib, self.raw(), ptr) }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        // SAFETY: `self.store` was created by `self.lib`, `&mut self` proves no other use is in
        // progress, and it is destroyed exactly once (here).
        unsafe { result::destroy(&self.lib, self.raw()) }
    }
}

/// Whether a batch call failed whole or for some key (its memory may then still be in use,
/// if it failed late).
fn failed<T>(r: &Result<Vec<KeyResult<T>>>) -> bool {
    !r.as_ref()
        .is_ok_and(|per_key| per_key.iter().all(|k| k.is_ok()))
}

/// Whether transport `protocol` moves bytes from and to memory the wheel has not registered
/// (TCP does; RDMA reads and writes registered regions only).
fn moves_any_memory(protocol: &str) -> bool {
    protocol.trim().eq_ignore_ascii_case("tcp")
}

#[cfg(test)]
mod transport_tests {
    use super::moves_any_memory;

    #[test]
    fn only_tcp_moves_memory_it_has_not_registered() {
        assert!(moves_any_memory("tcp") && moves_any_memory("TCP"));
        assert!(!moves_any_memory("rdma") && !moves_any_memory("") && !moves_any_memory("nvlink"));
    }
}
