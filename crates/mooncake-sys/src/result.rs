//! Checked calls: one function per C entry point, every return code checked.
//!
//! Whole-call failures become [`MooncakeError::Status`]; batch calls return one
//! `Result<_, ErrorCode>` per key. The functions taking a raw `store` handle are `unsafe`: the
//! handle must come from [`create`] of the same [`Library`] and not be destroyed yet, and
//! pointer arguments must satisfy the documented contract.
//!
//! Memory a call reads or writes "for the call" must also stay allocated, and untouched by
//! anything else, **for good** when the call fails after
//! [`CLIENT_GIVES_UP_AFTER`](crate::CLIENT_GIVES_UP_AFTER): Mooncake's client stops waiting
//! for its transfers after 60 s and returns with them still in flight. Its ranged read
//! (`batch_get_into_multi_buffer_ranges`, a scatter transfer) is the exception: it waits for
//! every transfer with no limit, so only a call the shim cut short may leave one running.

use std::ffi::{c_char, c_int, c_void, CString};

use crate::error::{ErrorCode, MooncakeError, Result};
use crate::library::Library;
use crate::sys::{self, KvlinkMcRange, MooncakeReplicateConfig, MooncakeStoreT};

/// Replication options of a put (the store_c.h `mooncake_replicate_config_t`, owned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicateConfig {
    /// Number of replicas (on distinct segments when possible). Mooncake's default is 1.
    pub replica_num: usize,
    /// Soft-pin the object: evicted last.
    pub soft_pin: bool,
    /// Hard-pin the object: never evicted.
    pub hard_pin: bool,
    /// Segments to allocate on, by name (empty: the master chooses).
    pub preferred_segments: Vec<String>,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        Self {
            replica_num: 1,
            soft_pin: false,
            hard_pin: false,
            preferred_segments: Vec::new(),
        }
    }
}

/// A [`ReplicateConfig`] lowered to C, owning the strings it points to.
struct RawConfig {
    raw: MooncakeReplicateConfig,
    _names: Vec<CString>,
    _ptrs: Vec<*const c_char>,
}

impl RawConfig {
    fn new(cfg: &ReplicateConfig) -> Result<Self> {
        let names = cfg
            .preferred_segments
            .iter()
            .map(|s| cstring("preferred segment", s))
            .collect::<Result<Vec<_>>>()?;
        let ptrs: Vec<*const c_char> = names.iter().map(|s| s.as_ptr()).collect();
        let raw = MooncakeReplicateConfig {
            replica_num: cfg.replica_num,
            with_soft_pin: c_int::from(cfg.soft_pin),
            with_hard_pin: c_int::from(cfg.hard_pin),
            preferred_segments: if ptrs.is_empty() {
                std::ptr::null()
            } else {
                ptrs.as_ptr()
            },
            preferred_segments_count: ptrs.len(),
        };
        // Moving the Vecs into the struct does not move their heap buffers, so `raw`'s
        // pointers stay valid for the life of the RawConfig.
        Ok(Self {
            raw,
            _names: names,
            _ptrs: ptrs,
        })
    }
}

/// Keys lowered to C: NUL-terminated copies and the pointer array.
pub struct CKeys {
    owned: Vec<CString>,
    ptrs: Vec<*const c_char>,
}

impl std::fmt::Debug for CKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CKeys").finish_non_exhaustive()
    }
}

impl CKeys {
    /// Copies `keys`; a key containing a NUL byte is an error.
    pub fn new<K: AsRef<str>>(keys: &[K]) -> Result<Self> {
        let owned = keys
            .iter()
            .map(|k| cstring("key", k.as_ref()))
            .collect::<Result<Vec<_>>>()?;
        let ptrs = owned.iter().map(|k| k.as_ptr()).collect();
        Ok(Self { owned, ptrs })
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.ptrs.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.ptrs.is_empty()
    }

    fn as_ptr(&self) -> *const *const c_char {
        self.ptrs.as_ptr()
    }

    fn key(&self, i: usize) -> Option<String> {
        self.owned.get(i).map(|k| k.to_string_lossy().into_owned())
    }
}

fn cstring(what: &'static str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| MooncakeError::NulInString {
        what,
        value: s.replace('\0', "\\0"),
    })
}

fn status(lib: &Library, operation: &'static str, key: Option<&str>, code: i64) -> MooncakeError {
    let code = ErrorCode(i32::try_from(code).unwrap_or(i32::MIN));
    let message = if matches!(
        code.0,
        sys::shim_codes::EXCEPTION
            | sys::shim_codes::OUT_OF_MEMORY
            | sys::shim_codes::NULL_ARG
            | sys::shim_codes::INVALID_ARG
            | sys::shim_codes::BAD_RESULT
            | sys::shim_codes::SHIM_EXCEPTION
            | sys::shim_codes::SHIM_OUT_OF_MEMORY
    ) {
        lib.last_error()
    } else {
        None
    };
    MooncakeError::Status {
        operation,
        key: key.map(str::to_owned),
        code,
        message,
    }
}

fn check(lib: &Library, operation: &'static str, key: Option<&str>, rc: i64) -> Result<i64> {
    if rc < 0 {
        Err(status(lib, operation, key, rc))
    } else {
        Ok(rc)
    }
}

fn same_len(operation: &'static str, what: &str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(MooncakeError::InvalidArguments {
            operation,
            detail: format!("{a} keys but {b} {what}"),
        })
    }
}

fn per_key_bytes(v: i64) -> std::result::Result<u64, ErrorCode> {
    u64::try_from(v).map_err(|_| ErrorCode(i32::try_from(v).unwrap_or(i32::MIN)))
}

fn per_key_unit(v: c_int) -> std::result::Result<(), ErrorCode> {
    if v < 0 {
        Err(ErrorCode(v))
    } else {
        Ok(())
    }
}

/// Arguments of `mooncake_store_setup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SetupArgs {
    /// Address other clients reach this one at (`"127.0.0.1"`, `"host:port"`).
    pub local_hostname: String,
    /// Metadata service: `"P2PHANDSHAKE"`, `"http://host:port/metadata"`, `"etcd://host:port"`.
    pub metadata_server: String,
    /// Bytes of this process's RAM mounted into the cluster pool (0: a pure client).
    pub global_segment_size: u64,
    /// Bytes of the client's local transfer buffer (0: a pure server; copying put/get need it).
    pub local_buffer_size: u64,
    /// Transport: `"tcp"` or `"rdma"`.
    pub protocol: String,
    /// RDMA device names (`""` for TCP).
    pub device_name: String,
    /// The master's RPC address, `"host:port"`.
    pub master_server_addr: String,
    /// The Mooncake tenant whose key space the client puts and finds objects in
    /// (`"default"`, the wheel's own default and `MOONCAKE_TENANT_ID`'s).
    pub tenant_id: String,
}

/// `mooncake_store_create`: a new, not yet set up client.
pub fn create(lib: &Library) -> Result<MooncakeStoreT> {
    // SAFETY: `mooncake_store_create` takes no arguments and returns a new handle or NULL.
    let store = unsafe { (lib.core.create)() };
    if store.is_null() {
        Err(MooncakeError::CreateFailed {
            message: lib.last_error(),
        })
    } else {
        Ok(store)
    }
}

/// `mooncake_store_destroy`: tears the client down (unmounts its segment) and frees it.
///
/// # Safety
/// `store` comes from [`create`] on `lib`, is not used by any other thread during or after
/// this call, and is not destroyed twice.
pub unsafe fn destroy(lib: &Library, store: MooncakeStoreT) {
    // SAFETY: the caller guarantees exclusive, final use of a live handle.
    unsafe { (lib.core.destroy)(store) }
}

/// `kvlink_mc_setup` (`mooncake_store_setup` in a tenant).
///
/// # Safety
/// `store` is a live handle of `lib` (see the module docs).
pub unsafe fn setup(lib: &Library, store: MooncakeStoreT, args: &SetupArgs) -> Result<()> {
    let host = cstring("local_hostname", &args.local_hostname)?;
    let meta = cstring("metadata_server", &args.metadata_server)?;
    let proto = cstring("protocol", &args.protocol)?;
    let dev = cstring("device_name", &args.device_name)?;
    let master = cstring("master_server_addr", &args.master_server_addr)?;
    let tenant = cstring("tenant_id", &args.tenant_id)?;
    let f = lib.extensions("setup")?.setup;
    // SAFETY: live handle (caller); every string is a NUL-terminated CString alive for the call.
    let rc = unsafe {
        f(
            store,
            host.as_ptr(),
            meta.as_ptr(),
            args.global_segment_size,
            args.local_buffer_size,
            proto.as_ptr(),
            dev.as_ptr(),
            master.as_ptr(),
            tenant.as_ptr(),
        )
    };
    // setup returns 0 on success and any non-zero value (not only negatives) on failure.
    if rc != 0 {
        return Err(status(lib, "setup", None, i64::from(rc)));
    }
    Ok(())
}

/// `mooncake_store_health_check`: 0 healthy, 1 closed / not set up, 2 master unreachable.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn health_check(lib: &Library, store: MooncakeStoreT) -> Result<i32> {
    // SAFETY: live handle (caller).
    let rc = unsafe { (lib.core.health_check)(store) };
    check(lib, "health_check", None, i64::from(rc)).map(|v| v as i32)
}

/// `mooncake_store_put`: copies `value` into the store under `key` (first write wins: an
/// existing key is left unchanged and the call succeeds).
///
/// # Safety
/// `store` is a live handle of `lib`; `value` stays as it is for the call (and for good when
/// it fails late: see the module docs).
pub unsafe fn put(
    lib: &Library,
    store: MooncakeStoreT,
    key: &str,
    value: &[u8],
    cfg: &ReplicateConfig,
) -> Result<()> {
    let k = cstring("key", key)?;
    let cfg = RawConfig::new(cfg)?;
    // SAFETY: live handle (caller); `k` NUL-terminated; `value` readable for `value.len()`
    // bytes for the duration of the call (the put is synchronous); `cfg.raw` and the strings it
    // points to live until the end of this function.
    let rc = unsafe {
        (lib.core.put)(
            store,
            k.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            &cfg.raw,
        )
    };
    check(lib, "put", Some(key), i64::from(rc)).map(drop)
}

/// `mooncake_store_put_from`: zero-copy put of `len` bytes at `ptr` under `key`.
///
/// # Safety
/// `store` is a live handle of `lib`; `ptr` is valid for reads of `len` bytes for the duration
/// of the call, or for good when it fails late (module docs), and inside a registered region
/// for RDMA.
pub unsafe fn put_from(
    lib: &Library,
    store: MooncakeStoreT,
    key: &str,
    ptr: *mut u8,
    len: usize,
    cfg: &ReplicateConfig,
) -> Result<()> {
    let k = cstring("key", key)?;
    let cfg = RawConfig::new(cfg)?;
    // SAFETY: live handle and readable `ptr` (caller); `k` NUL-terminated; `cfg.raw` and its
    // strings live until the end of this function.
    let rc = unsafe { (lib.core.put_from)(store, k.as_ptr(), ptr.cast(), len, &cfg.raw) };
    check(lib, "put_from", Some(key), i64::from(rc)).map(drop)
}

/// `mooncake_store_get_into`: reads the whole object into `buf` and returns its size.
///
/// # Safety
/// `store` is a live handle of `lib`; `buf` is valid for writes of `len` bytes and not
/// accessed by anything else during the call, or for good when it fails late (module docs).
pub unsafe fn get_into(
    lib: &Library,
    store: MooncakeStoreT,
    key: &str,
    buf: *mut u8,
    len: usize,
) -> Result<u64> {
    let k = cstring("key", key)?;
    // SAFETY: live handle and writable `buf` of `len` bytes (caller); `k` NUL-terminated.
    let rc = unsafe { (lib.core.get_into)(store, k.as_ptr(), buf.cast(), len) };
    check(lib, "get_into", Some(key), rc).map(|v| v as u64)
}

/// `mooncake_store_batch_put_from`: per key, puts `sizes[i]` bytes from `buffers[i]`.
///
/// # Safety
/// `store` is a live handle of `lib`; each `buffers[i]` is valid for reads of `sizes[i]` bytes
/// for the duration of the call, or for good when it fails late (module docs), and inside a
/// registered region for RDMA.
pub unsafe fn batch_put_from(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
    buffers: &[*mut u8],
    sizes: &[usize],
    cfg: &ReplicateConfig,
) -> Result<Vec<std::result::Result<(), ErrorCode>>> {
    // SAFETY: forwarded contract (caller).
    unsafe {
        batch_write(
            lib,
            lib.core.batch_put_from,
            "batch_put_from",
            store,
            keys,
            buffers,
            sizes,
            cfg,
        )
    }
}

/// `kvlink_mc_batch_upsert_from`: like [`batch_put_from`] but overwrites existing objects.
///
/// # Safety
/// As [`batch_put_from`].
pub unsafe fn batch_upsert_from(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
    buffers: &[*mut u8],
    sizes: &[usize],
    cfg: &ReplicateConfig,
) -> Result<Vec<std::result::Result<(), ErrorCode>>> {
    let f = lib.extensions("batch_upsert_from")?.batch_upsert_from;
    // SAFETY: forwarded contract (caller).
    unsafe {
        batch_write(
            lib,
            f,
            "batch_upsert_from",
            store,
            keys,
            buffers,
            sizes,
            cfg,
        )
    }
}

#[allow(clippy::too_many_arguments)]
unsafe fn batch_write(
    lib: &Library,
    f: sys::FnBatchPutFrom,
    operation: &'static str,
    store: MooncakeStoreT,
    keys: &CKeys,
    buffers: &[*mut u8],
    sizes: &[usize],
    cfg: &ReplicateConfig,
) -> Result<Vec<std::result::Result<(), ErrorCode>>> {
    same_len(operation, "buffers", keys.len(), buffers.len())?;
    same_len(operation, "sizes", keys.len(), sizes.len())?;
    let cfg = RawConfig::new(cfg)?;
    let mut results: Vec<c_int> = vec![0; keys.len()];
    // SAFETY: live handle and readable buffers (caller); `keys`, `buffers`, `sizes` and
    // `results` all have `keys.len()` entries (checked above); `*mut u8` and `void*` have the
    // same layout; `cfg.raw` and its strings live until the end of this function.
    let rc = unsafe {
        f(
            store,
            keys.as_ptr(),
            buffers.as_ptr().cast::<*mut c_void>(),
            sizes.as_ptr(),
            keys.len(),
            &cfg.raw,
            results.as_mut_ptr(),
        )
    };
    check(lib, operation, None, i64::from(rc))?;
    Ok(results.into_iter().map(per_key_unit).collect())
}

/// `mooncake_store_batch_get_into`: per key, reads the whole object into `buffers[i]`
/// (capacity `sizes[i]`) and reports its size.
///
/// # Safety
/// `store` is a live handle of `lib`; each `buffers[i]` is valid for writes of `sizes[i]`
/// bytes and not accessed by anything else during the call, or for good when it fails late
/// (module docs).
pub unsafe fn batch_get_into(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
    buffers: &[*mut u8],
    sizes: &[usize],
) -> Result<Vec<std::result::Result<u64, ErrorCode>>> {
    same_len("batch_get_into", "buffers", keys.len(), buffers.len())?;
    same_len("batch_get_into", "sizes", keys.len(), sizes.len())?;
    let mut results: Vec<i64> = vec![0; keys.len()];
    // SAFETY: live handle and writable buffers (caller); all arrays have `keys.len()` entries.
    let rc = unsafe {
        (lib.core.batch_get_into)(
            store,
            keys.as_ptr(),
            buffers.as_ptr().cast::<*mut c_void>(),
            sizes.as_ptr(),
            keys.len(),
            results.as_mut_ptr(),
        )
    };
    check(lib, "batch_get_into", None, i64::from(rc))?;
    Ok(results.into_iter().map(per_key_bytes).collect())
}

/// `kvlink_mc_batch_get_ranges`: key `i` owns the next `range_counts[i]` entries of `ranges`;
/// each copies `object[offset .. offset + size)` to `dst`. Per key: the bytes read (the sum of
/// its range sizes) or an error. The keys must be in a read session
/// ([`batch_get_session_start`]).
///
/// # Safety
/// `store` is a live handle of `lib`; every `ranges[j].dst` is valid for writes of
/// `ranges[j].size` bytes and not accessed by anything else during the call, or for good when
/// it fails late (module docs).
pub unsafe fn batch_get_ranges(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
    range_counts: &[usize],
    ranges: &[KvlinkMcRange],
) -> Result<Vec<std::result::Result<u64, ErrorCode>>> {
    let f = lib.extensions("batch_get_ranges")?.batch_get_ranges;
    same_len(
        "batch_get_ranges",
        "range counts",
        keys.len(),
        range_counts.len(),
    )?;
    let total = range_counts
        .iter()
        .try_fold(0usize, |acc, &n| acc.checked_add(n));
    if total != Some(ranges.len()) {
        return Err(MooncakeError::InvalidArguments {
            operation: "batch_get_ranges",
            detail: format!(
                "range counts add up to {total:?}, but {} ranges were given",
                ranges.len()
            ),
        });
    }
    let mut results: Vec<i64> = vec![0; keys.len()];
    // SAFETY: live handle and writable destinations (caller); `range_counts` and `results` have
    // `keys.len()` entries and `range_counts` adds up to `ranges.len()` (checked above).
    let rc = unsafe {
        f(
            store,
            keys.as_ptr(),
            keys.len(),
            range_counts.as_ptr(),
            ranges.as_ptr(),
            ranges.len(),
            results.as_mut_ptr(),
        )
    };
    check(lib, "batch_get_ranges", None, i64::from(rc))?;
    Ok(results.into_iter().map(per_key_bytes).collect())
}

/// `kvlink_mc_batch_get_session_start`: resolves replicas once and takes a read lease per key.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn batch_get_session_start(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
) -> Result<Vec<std::result::Result<(), ErrorCode>>> {
    let f = lib
        .extensions("batch_get_session_start")?
        .batch_get_session_start;
    let mut results: Vec<c_int> = vec![0; keys.len()];
    // SAFETY: live handle (caller); `results` has `keys.len()` entries.
    let rc = unsafe { f(store, keys.as_ptr(), keys.len(), results.as_mut_ptr()) };
    check(lib, "batch_get_session_start", None, i64::from(rc))?;
    Ok(results.into_iter().map(per_key_unit).collect())
}

/// `kvlink_mc_batch_get_session_end`: drops the cached replicas of these keys.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn batch_get_session_end(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
) -> Result<()> {
    let f = lib
        .extensions("batch_get_session_end")?
        .batch_get_session_end;
    // SAFETY: live handle (caller); `keys` has `keys.len()` entries.
    let rc = unsafe { f(store, keys.as_ptr(), keys.len()) };
    check(lib, "batch_get_session_end", None, i64::from(rc)).map(drop)
}

/// `mooncake_store_is_exist`.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn is_exist(lib: &Library, store: MooncakeStoreT, key: &str) -> Result<bool> {
    let k = cstring("key", key)?;
    // SAFETY: live handle (caller); `k` NUL-terminated.
    let rc = unsafe { (lib.core.is_exist)(store, k.as_ptr()) };
    check(lib, "is_exist", Some(key), i64::from(rc)).map(|v| v > 0)
}

/// `mooncake_store_batch_is_exist`: per key, present or not (or an error).
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn batch_is_exist(
    lib: &Library,
    store: MooncakeStoreT,
    keys: &CKeys,
) -> Result<Vec<std::result::Result<bool, ErrorCode>>> {
    let mut results: Vec<c_int> = vec![0; keys.len()];
    // SAFETY: live handle (caller); `results` has `keys.len()` entries.
    let rc = unsafe {
        (lib.core.batch_is_exist)(store, keys.as_ptr(), keys.len(), results.as_mut_ptr())
    };
    check(lib, "batch_is_exist", None, i64::from(rc))?;
    Ok(results
        .into_iter()
        .map(|v| if v < 0 { Err(ErrorCode(v)) } else { Ok(v > 0) })
        .collect())
}

/// `mooncake_store_get_size`.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn get_size(lib: &Library, store: MooncakeStoreT, key: &str) -> Result<u64> {
    let k = cstring("key", key)?;
    // SAFETY: live handle (caller); `k` NUL-terminated.
    let rc = unsafe { (lib.core.get_size)(store, k.as_ptr()) };
    check(lib, "get_size", Some(key), rc).map(|v| v as u64)
}

/// `mooncake_store_get_hostname`: the address this client registered under.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn get_hostname(lib: &Library, store: MooncakeStoreT) -> Result<String> {
    let mut buf = vec![0u8; 1024];
    // SAFETY: live handle (caller); `buf` is writable for `buf.len()` bytes.
    let rc = unsafe { (lib.core.get_hostname)(store, buf.as_mut_ptr().cast(), buf.len()) };
    check(lib, "get_hostname", None, i64::from(rc))?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// `mooncake_store_remove`.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn remove(lib: &Library, store: MooncakeStoreT, key: &str, force: bool) -> Result<()> {
    let k = cstring("key", key)?;
    // SAFETY: live handle (caller); `k` NUL-terminated.
    let rc = unsafe { (lib.core.remove)(store, k.as_ptr(), c_int::from(force)) };
    check(lib, "remove", Some(key), i64::from(rc)).map(drop)
}

/// `mooncake_store_remove_by_regex`: the number of objects removed.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn remove_by_regex(
    lib: &Library,
    store: MooncakeStoreT,
    pattern: &str,
    force: bool,
) -> Result<u64> {
    let p = cstring("pattern", pattern)?;
    // SAFETY: live handle (caller); `p` NUL-terminated.
    let rc = unsafe { (lib.core.remove_by_regex)(store, p.as_ptr(), c_int::from(force)) };
    check(lib, "remove_by_regex", None, rc).map(|v| v as u64)
}

/// `mooncake_store_remove_all`: the number of objects removed.
///
/// # Safety
/// `store` is a live handle of `lib`.
pub unsafe fn remove_all(lib: &Library, store: MooncakeStoreT, force: bool) -> Result<u64> {
    // SAFETY: live handle (caller).
    let rc = unsafe { (lib.core.remove_all)(store, c_int::from(force)) };
    check(lib, "remove_all", None, rc).map(|v| v as u64)
}

/// `mooncake_store_register_buffer`: registers `[ptr, ptr + len)` with the transfer engine.
///
/// # Safety
/// `store` is a live handle of `lib`; the region stays valid (allocated, not unmapped) until it
/// is unregistered with [`unregister_buffer`] or the client is destroyed.
pub unsafe fn register_buffer(
    lib: &Library,
    store: MooncakeStoreT,
    ptr: *mut u8,
    len: usize,
) -> Result<()> {
    // SAFETY: live handle and a region valid while registered (caller).
    let rc = unsafe { (lib.core.register_buffer)(store, ptr.cast(), len) };
    check(lib, "register_buffer", None, i64::from(rc)).map(drop)
}

/// `mooncake_store_unregister_buffer`.
///
/// # Safety
/// `store` is a live handle of `lib`; no transfer into or out of the region is in flight.
pub unsafe fn unregister_buffer(lib: &Library, store: MooncakeStoreT, ptr: *mut u8) -> Result<()> {
    // SAFETY: live handle, no transfer in flight (caller).
    let rc = unsafe { (lib.core.unregister_buffer)(store, ptr.cast()) };
    check(lib, "unregister_buffer", None, i64::from(rc)).map(drop)
}

/// Name of the key at `index` of `keys` (for error reports built by callers); `None` past
/// the last key.
pub fn key_at(keys: &CKeys, index: usize) -> Option<String> {
    keys.key(index)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_index_past_the_last_key_is_none_not_a_panic() {
        let keys = CKeys::new(&["a", "b"]).unwrap();
        assert_eq!(key_at(&keys, 1).as_deref(), Some("b"));
        assert_eq!(key_at(&keys, 2), None);
        assert_eq!(key_at(&keys, usize::MAX), None);
    }

    /// An exception in the shim's own work before the wheel's call (here: reserving room for
    /// more keys than a vector can hold) is the shim's code, which says no transfer of the call
    /// runs; it was `KVLINK_MC_ERR_EXCEPTION`, which says the wheel's transfers may still run
    /// (the call's memory kept for good). Needs the shim (`scripts/with-mooncake.sh`); skips
    /// without it unless `KVLINK_REQUIRE_MOONCAKE=1`. No master is contacted.
    #[test]
    fn an_exception_before_the_wheels_call_is_the_shims_own() {
        let lib = match Library::load_default() {
            Ok(lib) => lib,
            Err(e) if std::env::var("KVLINK_REQUIRE_MOONCAKE").is_ok_and(|v| v == "1") => {
                panic!("KVLINK_REQUIRE_MOONCAKE=1 but the shim did not load: {e}")
            }
            Err(_) => return,
        };
        let store = create(&lib).unwrap();
        let key = c"k";
        let keys = [key.as_ptr()];
        let mut byte = 0u8;
        let buffers = [(&mut byte as *mut u8).cast::<c_void>()];
        let sizes = [1usize];
        let mut results = [0i64];
        // SAFETY: a live handle of `lib`; every pointer is valid for one element, and the
        // shim refuses the count before it reads any element (its key vector cannot reserve
        // that many), so nothing past them is touched.
        let rc = unsafe {
            (lib.core.batch_get_into)(
                store,
                keys.as_ptr(),
                buffers.as_ptr(),
                sizes.as_ptr(),
                usize::MAX / 4,
                results.as_mut_ptr(),
            )
        };
        // SAFETY: the handle is live, used by no other thread, destroyed once.
        unsafe { destroy(&lib, store) };
        assert_eq!(rc, sys::shim_codes::SHIM_EXCEPTION, "{rc}");
        let e = status(&lib, "batch_get_into", None, i64::from(rc));
        assert!(!e.cut_short(), "{e}");
    }
}
