//! Raw C types, function-pointer types and constants of the ABI in `csrc/kvlink_mooncake.h`.
//!
//! Everything here mirrors the C header one to one; nothing is checked. Use [`crate::result`]
//! for checked calls and [`crate::Client`] for the safe handle.

use std::ffi::{c_char, c_int, c_void};

/// Opaque client handle (`mooncake_store_t`): a `Handle { shared_ptr<RealClient> }` in the shim.
pub type MooncakeStoreT = *mut c_void;

/// `mooncake_replicate_config_t` of `store_c.h`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MooncakeReplicateConfig {
    /// Number of replicas, each on a different segment when possible (Mooncake's default is 1).
    pub replica_num: usize,
    /// Non-zero: soft-pin the object (evicted last; `SoftPinAction::ENABLE`).
    pub with_soft_pin: c_int,
    /// Non-zero: hard-pin the object (never evicted).
    pub with_hard_pin: c_int,
    /// `preferred_segments_count` NUL-terminated segment names, or null when the count is 0.
    pub preferred_segments: *const *const c_char,
    /// Number of entries of `preferred_segments`.
    pub preferred_segments_count: usize,
}

/// `kvlink_mc_abi_info_t`: what the shim was compiled against.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvlinkMcAbiInfo {
    /// `KVLINK_MC_ABI_VERSION` of the shim.
    pub abi_version: u32,
    /// `sizeof(kvlink_mc_abi_info_t)` in the shim.
    pub info_size: u32,
    /// `sizeof(mooncake::ReplicateConfig)` as compiled into the shim.
    pub replicate_config_size: u64,
    /// `offsetof(ReplicateConfig, soft_pin_action)`.
    pub off_soft_pin_action: u64,
    /// `offsetof(ReplicateConfig, soft_pin_ttl_ms)`.
    pub off_soft_pin_ttl_ms: u64,
    /// `offsetof(ReplicateConfig, with_hard_pin)`.
    pub off_with_hard_pin: u64,
    /// `offsetof(ReplicateConfig, preferred_segments)`.
    pub off_preferred_segments: u64,
    /// `offsetof(ReplicateConfig, preferred_segment)`.
    pub off_preferred_segment: u64,
    /// `offsetof(ReplicateConfig, host_id)`.
    pub off_host_id: u64,
    /// `offsetof(ReplicateConfig, group_ids)`.
    pub off_group_ids: u64,
    /// NUL-terminated version of the wheel the shim was built for.
    pub wheel_version: [c_char; 32],
}

/// `kvlink_mc_range_t`: `object[offset .. offset + size)` is read into `dst`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KvlinkMcRange {
    /// Destination of the range (caller memory, `size` bytes).
    pub dst: *mut c_void,
    /// Length of the range in bytes.
    pub size: u64,
    /// Byte offset of the range inside the object.
    pub offset: u64,
}

// ---------------------------------------------------------------------------------------------
// Function-pointer types, one per exported symbol (same order as the header).

/// `mooncake_store_create`.
pub type FnCreate = unsafe extern "C" fn() -> MooncakeStoreT;
/// `mooncake_store_destroy`.
pub type FnDestroy = unsafe extern "C" fn(MooncakeStoreT);
/// `mooncake_store_setup`.
pub type FnSetup = unsafe extern "C" fn(
    MooncakeStoreT,
    *const c_char,
    *const c_char,
    u64,
    u64,
    *const c_char,
    *const c_char,
    *const c_char,
) -> c_int;
/// `mooncake_store_health_check`.
pub type FnHealthCheck = unsafe extern "C" fn(MooncakeStoreT) -> c_int;
/// `mooncake_store_put`.
pub type FnPut = unsafe extern "C" fn(
    MooncakeStoreT,
    *const c_char,
    *const c_void,
    usize,
    *const MooncakeReplicateConfig,
) -> c_int;
/// `mooncake_store_put_from`.
pub type FnPutFrom = unsafe extern "C" fn(
    MooncakeStoreT,
    *const c_char,
    *mut c_void,
    usize,
    *const MooncakeReplicateConfig,
) -> c_int;
/// `mooncake_store_batch_put_from` (also the type of `kvlink_mc_batch_upsert_from`).
pub type FnBatchPutFrom = unsafe extern "C" fn(
    MooncakeStoreT,
    *const *const c_char,
    *const *mut c_void,
    *const usize,
    usize,
    *const MooncakeReplicateConfig,
    *mut c_int,
) -> c_int;
/// `mooncake_store_get_into`.
pub type FnGetInto = unsafe extern "C" fn(MooncakeStoreT, *const c_char, *mut c_void, usize) -> i64;
/// `mooncake_store_batch_get_into`.
pub type FnBatchGetInto = unsafe extern "C" fn(
    MooncakeStoreT,
    *const *const c_char,
    *const *mut c_void,
    *const usize,
    usize,
    *mut i64,
) -> c_int;
/// `mooncake_store_is_exist`.
pub type FnIsExist = unsafe extern "C" fn(MooncakeStoreT, *const c_char) -> c_int;
/// `mooncake_store_batch_is_exist` (also the type of `kvlink_mc_batch_get_session_start`).
pub type FnBatchIsExist =
    unsafe extern "C" fn(MooncakeStoreT, *const *const c_char, usize, *mut c_int) -> c_int;
/// `mooncake_store_get_size`.
pub type FnGetSize = unsafe extern "C" fn(MooncakeStoreT, *const c_char) -> i64;
/// `mooncake_store_get_hostname`.
pub type FnGetHostname = unsafe extern "C" fn(MooncakeStoreT, *mut c_char, usize) -> c_int;
/// `mooncake_store_remove`.
pub type FnRemove = unsafe extern "C" fn(MooncakeStoreT, *const c_char, c_int) -> c_int;
/// `mooncake_store_remove_by_regex`.
pub type FnRemoveByRegex = unsafe extern "C" fn(MooncakeStoreT, *const c_char, c_int) -> i64;
/// `mooncake_store_remove_all`.
pub type FnRemoveAll = unsafe extern "C" fn(MooncakeStoreT, c_int) -> i64;
/// `mooncake_store_register_buffer`.
pub type FnRegisterBuffer = unsafe extern "C" fn(MooncakeStoreT, *mut c_void, usize) -> c_int;
/// `mooncake_store_unregister_buffer`.
pub type FnUnregisterBuffer = unsafe extern "C" fn(MooncakeStoreT, *mut c_void) -> c_int;

/// `kvlink_mc_abi_info`.
pub type FnAbiInfo = unsafe extern "C" fn(*mut KvlinkMcAbiInfo) -> c_int;
/// `kvlink_mc_error_name`.
pub type FnErrorName = unsafe extern "C" fn(i32) -> *const c_char;
/// `kvlink_mc_last_error`.
pub type FnLastError = unsafe extern "C" fn(*mut c_char, usize) -> usize;
/// `kvlink_mc_batch_get_ranges`.
pub type FnBatchGetRanges = unsafe extern "C" fn(
    MooncakeStoreT,
    *const *const c_char,
    usize,
    *const usize,
    *const KvlinkMcRange,
    usize,
    *mut i64,
) -> c_int;
/// `kvlink_mc_batch_get_session_start`.
pub type FnBatchGetSessionStart = FnBatchIsExist;
/// `kvlink_mc_batch_get_session_end`.
pub type FnBatchGetSessionEnd =
    unsafe extern "C" fn(MooncakeStoreT, *const *const c_char, usize) -> c_int;
/// `kvlink_mc_batch_upsert_from`.
pub type FnBatchUpsertFrom = FnBatchPutFrom;
/// `kvlink_mc_setup`: `mooncake_store_setup`'s arguments, then the tenant.
pub type FnMcSetup = unsafe extern "C" fn(
    MooncakeStoreT,
    *const c_char,
    *const c_char,
    u64,
    u64,
    *const c_char,
    *const c_char,
    *const c_char,
    *const c_char,
) -> c_int;

// ---------------------------------------------------------------------------------------------
// ABI expectations: what this crate was written against. A shim reporting anything else is
// refused at load time (see `Library::open`).

/// `KVLINK_MC_ABI_VERSION` this crate speaks.
pub const KVLINK_MC_ABI_VERSION: u32 = 2;
/// The wheel version the shim must have been built for.
pub const EXPECTED_WHEEL_VERSION: &str = "0.3.13.post1";
/// Expected `sizeof(mooncake::ReplicateConfig)` (x86_64, libstdc++) for the pinned wheel.
pub const EXPECTED_REPLICATE_CONFIG_SIZE: u64 = 208;
/// Expected offsets inside `ReplicateConfig`: soft_pin_action, soft_pin_ttl_ms, with_hard_pin,
/// preferred_segments, preferred_segment, host_id, group_ids.
pub const EXPECTED_REPLICATE_CONFIG_OFFSETS: [u64; 7] = [24, 32, 48, 56, 80, 144, 176];

/// Names of the exported symbols, NUL-terminated, for `dlsym`.
pub mod symbols {
    /// Part 1 (`store_c.h`): required.
    pub const CREATE: &[u8] = b"mooncake_store_create\0";
    /// See [`CREATE`].
    pub const DESTROY: &[u8] = b"mooncake_store_destroy\0";
    /// See [`CREATE`].
    pub const SETUP: &[u8] = b"mooncake_store_setup\0";
    /// See [`CREATE`].
    pub const HEALTH_CHECK: &[u8] = b"mooncake_store_health_check\0";
    /// See [`CREATE`].
    pub const PUT: &[u8] = b"mooncake_store_put\0";
    /// See [`CREATE`].
    pub const PUT_FROM: &[u8] = b"mooncake_store_put_from\0";
    /// See [`CREATE`].
    pub const BATCH_PUT_FROM: &[u8] = b"mooncake_store_batch_put_from\0";
    /// See [`CREATE`].
    pub const GET_INTO: &[u8] = b"mooncake_store_get_into\0";
    /// See [`CREATE`].
    pub const BATCH_GET_INTO: &[u8] = b"mooncake_store_batch_get_into\0";
    /// See [`CREATE`].
    pub const IS_EXIST: &[u8] = b"mooncake_store_is_exist\0";
    /// See [`CREATE`].
    pub const BATCH_IS_EXIST: &[u8] = b"mooncake_store_batch_is_exist\0";
    /// See [`CREATE`].
    pub const GET_SIZE: &[u8] = b"mooncake_store_get_size\0";
    /// See [`CREATE`].
    pub const GET_HOSTNAME: &[u8] = b"mooncake_store_get_hostname\0";
    /// See [`CREATE`].
    pub const REMOVE: &[u8] = b"mooncake_store_remove\0";
    /// See [`CREATE`].
    pub const REMOVE_BY_REGEX: &[u8] = b"mooncake_store_remove_by_regex\0";
    /// See [`CREATE`].
    pub const REMOVE_ALL: &[u8] = b"mooncake_store_remove_all\0";
    /// See [`CREATE`].
    pub const REGISTER_BUFFER: &[u8] = b"mooncake_store_register_buffer\0";
    /// See [`CREATE`].
    pub const UNREGISTER_BUFFER: &[u8] = b"mooncake_store_unregister_buffer\0";
    /// Part 2 (kvlink extensions): present in the kvlink shim only.
    pub const ABI_INFO: &[u8] = b"kvlink_mc_abi_info\0";
    /// See [`ABI_INFO`].
    pub const ERROR_NAME: &[u8] = b"kvlink_mc_error_name\0";
    /// See [`ABI_INFO`].
    pub const LAST_ERROR: &[u8] = b"kvlink_mc_last_error\0";
    /// See [`ABI_INFO`].
    pub const BATCH_GET_RANGES: &[u8] = b"kvlink_mc_batch_get_ranges\0";
    /// See [`ABI_INFO`].
    pub const BATCH_GET_SESSION_START: &[u8] = b"kvlink_mc_batch_get_session_start\0";
    /// See [`ABI_INFO`].
    pub const BATCH_GET_SESSION_END: &[u8] = b"kvlink_mc_batch_get_session_end\0";
    /// See [`ABI_INFO`].
    pub const BATCH_UPSERT_FROM: &[u8] = b"kvlink_mc_batch_upsert_from\0";
    /// See [`ABI_INFO`] (ABI 2).
    pub const MC_SETUP: &[u8] = b"kvlink_mc_setup\0";
}

// ---------------------------------------------------------------------------------------------
// Error codes.

/// Codes of the shim itself (`KVLINK_MC_ERR_*`); Mooncake never uses -90000..-90099.
pub mod shim_codes {
    /// A required pointer (or key) was NULL.
    pub const NULL_ARG: i32 = -90001;
    /// A C++ exception was thrown inside a client call that moves bytes (message:
    /// `kvlink_mc_last_error`): the call was cut short, its transfers may still run.
    pub const EXCEPTION: i32 = -90002;
    /// `std::bad_alloc` was thrown inside a client call that moves bytes: as [`EXCEPTION`].
    pub const OUT_OF_MEMORY: i32 = -90003;
    /// Invalid arguments (counts overflow, buffer too small, ...).
    pub const INVALID_ARG: i32 = -90004;
    /// The client returned a result vector of the wrong length.
    pub const BAD_RESULT: i32 = -90005;
    /// A C++ exception in the shim's own work before or after the client's call (copying keys,
    /// arguments, results), or in a client call that moves no bytes: no transfer of the call
    /// runs (message: `kvlink_mc_last_error`).
    pub const SHIM_EXCEPTION: i32 = -90006;
    /// `std::bad_alloc` where [`SHIM_EXCEPTION`] says.
    pub const SHIM_OUT_OF_MEMORY: i32 = -90007;
}

/// Mooncake's `mooncake::ErrorCode` values as the pinned wheel defines them.
///
/// The table was read out of the wheel's own `mooncake::toString(ErrorCode)` for every value in
/// -5000..=0; the smoke test compares it with `kvlink_mc_error_name` again.
pub mod codes {
    macro_rules! error_codes {
        ($($name:ident = $value:literal,)*) => {
            $(
                #[doc = concat!("`ErrorCode::", stringify!($name), "`")]
                pub const $name: i32 = $value;
            )*
            /// Every `(code, name)` pair of the table, in ascending code order.
            pub const ALL: &[(i32, &str)] = &[$(($value, stringify!($name)),)*];
        };
    }
    error_codes! {
        TENANT_NOT_EMPTY = -1702,
        TENANT_NOT_REGISTERED = -1701,
        TENANT_QUOTA_EXCEEDED = -1700,
        DFS_PARTIAL_WRITE = -1605,
        DFS_STALE_HANDLE = -1604,
        DFS_PERMISSION_DENIED = -1603,
        DFS_QUOTA_EXCEEDED = -1602,
        DFS_SERVICE_UNAVAILABLE = -1601,
        DFS_NETWORK_TIMEOUT = -1600,
        PERSISTENT_FAIL = -1503,
        DESERIALIZE_FAIL = -1502,
        SERIALIZE_FAIL = -1501,
        SERIALIZE_UNSUPPORTED = -1500,
        JOB_NOT_FOUND = -1402,
        TASK_PENDING_LIMIT_EXCEEDED = -1401,
        TASK_NOT_FOUND = -1400,
        UNABLE_OFFLOADING = -1301,
        UNABLE_OFFLOAD = -1300,
        KEYS_ULTRA_LIMIT = -1203,
        KEYS_EXCEED_BUCKET_LIMIT = -1202,
        BUCKET_ALREADY_EXISTS = -1201,
        BUCKET_NOT_FOUND = -1200,
        FILE_INVALID_HANDLE = -1106,
        FILE_LOCK_FAIL = -1105,
        FILE_INVALID_BUFFER = -1104,
        FILE_WRITE_FAIL = -1103,
        FILE_READ_FAIL = -1102,
        FILE_OPEN_FAIL = -1101,
        FILE_NOT_FOUND = -1100,
        NOT_SUPPORTED = -1012,
        UNAVAILABLE_IN_CURRENT_MODE = -1011,
        UNAVAILABLE_IN_CURRENT_STATUS = -1010,
        INCOMPLETE_OPLOG_CATCH_UP = -1007,
        K8S_LEASE_NOT_FOUND = -1006,
        K8S_LEASE_OPERATION_ERROR = -1005,
        OPLOG_ENTRY_NOT_FOUND = -1004,
        ETCD_CTX_CANCELLED = -1003,
        ETCD_TRANSACTION_FAIL = -1002,
        ETCD_KEY_NOT_EXIST = -1001,
        ETCD_OPERATION_ERROR = -1000,
        RPC_TIMEOUT = -901,
        RPC_FAIL = -900,
        CHECKSUM_MISMATCH = -801,
        TRANSFER_FAIL = -800,
        OBJECT_REPLICA_BUSY = -714,
        REPLICA_IS_GONE = -712,
        REPLICA_ALREADY_EXISTS = -711,
        REPLICA_NOT_FOUND = -710,
        OBJECT_NO_REPLICATION_TASK = -709,
        OBJECT_HAS_REPLICATION_TASK = -708,
        LEASE_EXPIRED = -707,
        OBJECT_HAS_LEASE = -706,
        OBJECT_ALREADY_EXISTS = -705,
        OBJECT_NOT_FOUND = -704,
        REPLICA_IS_NOT_READY = -703,
        INVALID_REPLICA = -702,
        INVALID_READ = -701,
        INVALID_WRITE = -700,
        ILLEGAL_CLIENT = -601,
        INVALID_PARAMS = -600,
        WRITE_FAIL = -500,
        INVALID_KEY = -400,
        INVALID_VERSION = -300,
        NO_AVAILABLE_HANDLE = -200,
        CLIENT_NOT_FOUND = -103,
        SEGMENT_ALREADY_EXISTS = -102,
        SEGMENT_NOT_FOUND = -101,
        SHARD_INDEX_OUT_OF_RANGE = -100,
        BUFFER_OVERFLOW = -10,
        INTERNAL_ERROR = -1,
        OK = 0,
    }
}

/// The name of a Mooncake or shim error code (`"OBJECT_NOT_FOUND"`), if it is known.
pub fn code_name(code: i32) -> Option<&'static str> {
    match code {
        shim_codes::NULL_ARG => Some("KVLINK_MC_ERR_NULL_ARG"),
        shim_codes::EXCEPTION => Some("KVLINK_MC_ERR_EXCEPTION"),
        shim_codes::OUT_OF_MEMORY => Some("KVLINK_MC_ERR_OUT_OF_MEMORY"),
        shim_codes::INVALID_ARG => Some("KVLINK_MC_ERR_INVALID_ARG"),
        shim_codes::BAD_RESULT => Some("KVLINK_MC_ERR_BAD_RESULT"),
        shim_codes::SHIM_EXCEPTION => Some("KVLINK_MC_ERR_SHIM_EXCEPTION"),
        shim_codes::SHIM_OUT_OF_MEMORY => Some("KVLINK_MC_ERR_SHIM_OUT_OF_MEMORY"),
        _ => codes::ALL
            .binary_search_by_key(&code, |&(c, _)| c)
            .ok()
            .map(|i| codes::ALL[i].1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn code_table_is_sorted_and_unique() {
        assert!(codes::ALL.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(code_name(-704), Some("OBJECT_NOT_FOUND"));
        assert_eq!(code_name(-200), Some("NO_AVAILABLE_HANDLE"));
        assert_eq!(
            code_name(shim_codes::EXCEPTION),
            Some("KVLINK_MC_ERR_EXCEPTION")
        );
        assert_eq!(code_name(-12345), None);
    }

    #[test]
    fn abi_info_layout_matches_the_header() {
        // 2 x u32 + 8 x u64 + 32 chars.
        assert_eq!(std::mem::size_of::<KvlinkMcAbiInfo>(), 8 + 8 * 8 + 32);
        assert_eq!(std::mem::size_of::<KvlinkMcRange>(), 24);
        assert_eq!(std::mem::size_of::<MooncakeReplicateConfig>(), 32);
    }
}
