//! [`MooncakeStore`]: [`KvStore`] on a real Mooncake Store through mooncake-sys.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_loader::Cause;
use mooncake_sys::{CKeys, Client, ErrorCode, ErrorKind, Health, Library, MooncakeError};
use parking_lot::{Mutex, RwLock};
use tracing::{debug, warn};

use super::bounce::Bounces;
use super::config::MooncakeConfig;
use super::gate::{gate_held, TransferGate, UNREGISTER_WAIT};
use super::parts::run_parts;
use super::registry::{moves_in_place, RegionCounts, Release};
use super::sessions::{master_unreachable, SessionTable};
use crate::log_every::LogEvery;
use crate::store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangeChecksums, RangedGet, ReadRange,
    ReadSession, StoreError,
};

/// Most threads one `object_size` call asks the master on.
const SIZE_QUERY_THREADS: usize = 8;
/// Most keys one whole-object read call (`batch_get_into`) carries; longer reads are split
/// into calls made one after the other. The wheel's TCP transfer stalled until its 60 s
/// timeout with 4,096 small objects in one call (a 128K-token prefix's checksum companions),
/// and eight calls of 512 at once on one client failed transfers; 1,024 per call (a 32K
/// prefix's companions) ran on every GPU-host run.
pub const MAX_WHOLE_READS_PER_CALL: usize = 1024;
/// Keys per thread below which `object_size` asks on fewer threads.
const SIZE_QUERY_KEYS_PER_THREAD: usize = 32;

/// A [`KvStore`] on a Mooncake Store: one Mooncake client embedded in this process (it also
/// lends `global_segment_size` bytes of RAM to the pool).
///
/// - Reads go straight into caller memory (`batch_get_into`, and ranged reads with
///   `batch_get_into_multi_buffer_ranges`); register the destination once with
///   [`KvStore::register`] (TCP works either way; over RDMA a whole-object read into memory
///   not registered goes through the store's registered bounce and is copied out).
/// - Ranged reads need a Mooncake read session: keys that are not in one opened with
///   [`KvStore::start_session`] get one for the duration of the call. Sessions are counted
///   per key: a start renews the lease (the master is asked again), and the client's session
///   ends only when every start has been ended, so a renewal (start, then end of the old
///   session) and two linkers on one store keep each other's sessions.
/// - Puts are first-write-wins, as in Mooncake: keys found present are reported
///   [`PutOutcome::AlreadyPresent`] and not written (a key that appears between the check and
///   the write is reported `Written`, while Mooncake keeps the other writer's bytes).
///   Single-part objects are put zero-copy (over RDMA only those inside a registered region;
///   others go through the client's copying put, one object at a time); multi-part objects
///   are gathered into one staging buffer first.
/// - `remove` does not force: an object with a live read lease (10 s after a read or an
///   exists check) is refused with [`StoreError::Lease`]; `discard` (for objects found bad)
///   forces.
/// - Each error carries the key; Mooncake codes map to [`StoreError`] variants (see
///   [`store_error`]).
pub struct MooncakeStore {
    pub(super) client: Client,
    pub(super) config: MooncakeConfig,
    sessions: SessionTable,
    /// Reads and puts hold it shared; `unregister` alone.
    pub(super) transfers: TransferGate,
    /// Regions registered through this store, with their holders.
    registered: Mutex<RegionCounts>,
    /// The registered regions (address, length), as `registered` last changed: what reads
    /// and puts look at over RDMA (`registered` is held across a registration's wheel call,
    /// which pins every page: seconds for a large pool).
    in_place: RwLock<Vec<(usize, usize)>>,
    /// Scratch areas of staged merges, kept for reuse (see `read.rs`).
    pub(super) scratch: Mutex<Vec<Vec<u8>>>,
    /// Registered buffers that whole-object reads into unregistered memory go through (see
    /// `bounce.rs`). Dropped after `client`, which is declared first.
    pub(super) bounces: Bounces,
    /// Whole batched calls that failed, logged at `warn` once a minute per operation (per
    /// store: ranks as threads each have their own).
    pub(super) call_failures: LogEvery,
}

impl std::fmt::Debug for MooncakeStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeStore")
            .field("config", &self.config)
            .field("library", &self.client.library().path())
            .finish()
    }
}

impl MooncakeStore {
    /// Whether the wheel moves the `len` bytes at `addr` in place ([`moves_in_place`]).
    fn moves_in_place(&self, addr: usize, len: usize) -> bool {
        let any = self.config.any_memory_in_place();
        any || moves_in_place(any, &self.in_place.read(), addr, len)
    }

    /// Why a read into the `len` bytes at `addr` is refused: over RDMA, memory outside the
    /// registered regions, which the wheel cannot write (the read would fail in the transfer
    /// engine with a less telling error). Whole-object reads go through the store's bounce
    /// instead (`bounce.rs`, up to `MAX_BOUNCE_BYTES` a call); ranged reads have no copying
    /// path: read them into registered memory (a registered pool), or over TCP.
    fn unregistered_dst(&self, addr: usize, len: usize) -> Option<&'static str> {
        (!self.moves_in_place(addr, len)).then_some(
            "a destination outside the memory registered with the store: over RDMA the wheel \
             writes registered memory only",
        )
    }

    /// Loads the store library, creates a client and joins the cluster.
    pub fn connect(config: MooncakeConfig) -> Result<Self, StoreError> {
        let library = match config.library_path() {
            Some(path) => Library::open(path),
            None => Library::load_default(),
        }
        .map_err(|e| StoreError::Unavailable {
            detail: Cause::from_error(e),
        })?;
        Self::connect_with(library, config)
    }

    /// Like [`connect`](Self::connect), with an already loaded library.
    pub fn connect_with(library: Arc<Library>, config: MooncakeConfig) -> Result<Self, StoreError> {
        config.check_lease()?;
        let client = Client::connect(library, &config.setup_args()).map_err(|e| {
            StoreError::Unavailable {
                detail: Cause::with_source(
                    format!(
                        "joining the Mooncake master at {} failed: {e}",
                        config.master_addr()
                    ),
                    e,
                ),
            }
        })?;
        debug!(
            master = config.master_addr(),
            protocol = config.protocol_name(),
            segment = config.global_segment_bytes(),
            "mooncake store connected"
        );
        if config.staged_merge_refused() {
            warn!(
                protocol = config.protocol_name(),
                "staged merge asked for over a protocol other than tcp: not used (its scratch is \
                 not registered for that transport)"
            );
        }
        Ok(Self {
            client,
            sessions: SessionTable::with_lease(config.lease_duration()),
            config,
            transfers: TransferGate::default(),
            registered: Mutex::new(RegionCounts::default()),
            in_place: RwLock::new(Vec::new()),
            scratch: Mutex::new(Vec::new()),
            bounces: Bounces::default(),
            call_failures: LogEvery::new(),
        })
    }

    /// The configuration it was connected with.
    pub fn config(&self) -> &MooncakeConfig {
        &self.config
    }

    /// The underlying mooncake-sys client (for what the trait does not cover, e.g. upsert;
    /// over RDMA its slice calls other than `put` are refused, see [`Client`]). Calls made
    /// through it bypass this store's transfer gate: [`KvStore::unregister`] does
    /// not wait for them, so a region such a call uses must not be unregistered meanwhile.
    pub fn client(&self) -> &Client {
        &self.client
    }
}

/// Indices of keys Mooncake can take (no NUL byte), and a result vector with the others
/// already failed.
pub(super) fn split_valid(keys: &[&str]) -> (Vec<usize>, Vec<Result<(), StoreError>>) {
    let mut valid = Vec::with_capacity(keys.len());
    let out = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            if k.contains('\0') {
                Err(StoreError::InvalidArgument {
                    key: (*k).to_owned(),
                    detail: "key contains a NUL byte".into(),
                })
            } else {
                valid.push(i);
                Ok(())
            }
        })
        .collect();
    (valid, out)
}

/// The reads of `keys` to issue, and every key's result so far: a key with a NUL byte, or
/// whose read is malformed (`refused(i)` says why: a null destination, a range ending past
/// the largest object offset), is refused; one with nothing to read (`!reads_bytes(i)`)
/// succeeds with 0 bytes and no I/O; the rest are issued (`Ok(0)` until they are).
fn vet_reads(
    keys: &[&str],
    refused: impl Fn(usize) -> Option<&'static str>,
    reads_bytes: impl Fn(usize) -> bool,
) -> (Vec<usize>, Vec<Result<u64, StoreError>>) {
    let (valid, checked) = split_valid(keys);
    let mut out: Vec<Result<u64, StoreError>> =
        checked.into_iter().map(|r| r.map(|()| 0)).collect();
    let valid = valid
        .into_iter()
        .filter(|&i| {
            if let Some(why) = refused(i) {
                out[i] = Err(StoreError::InvalidArgument {
                    key: keys[i].to_owned(),
                    detail: why.into(),
                });
                return false;
            }
            reads_bytes(i)
        })
        .collect();
    (valid, out)
}

/// Why a read into `dst` is refused: a null destination.
fn null_dst(dst: *mut u8) -> Option<&'static str> {
    dst.is_null().then_some("null destination")
}

/// Why a range is refused: a null destination, or an end past the largest object offset (no
/// object reaches it, and the range arithmetic would overflow).
fn refused_range(r: &ReadRange) -> Option<&'static str> {
    null_dst(r.dst).or_else(|| {
        let end = u64::try_from(r.len)
            .ok()
            .and_then(|n| r.offset.checked_add(n));
        end.is_none()
            .then_some("a range ending past the largest object offset")
    })
}

/// Why a ranged read of one key is refused: one of its ranges is ([`refused_range`]), or
/// their total is ([`too_long`]).
fn refused_get(get: &RangedGet<'_>) -> Option<&'static str> {
    get.ranges
        .iter()
        .find_map(refused_range)
        .or_else(|| too_long(get.expected()))
}

/// Why a key's ranges are refused as a whole: they add up to more than the wheel's per-key
/// result (an `int`) can count. Refused here, the key fails alone; the shim would refuse the
/// whole call, and with it every other key the call carries.
fn too_long(total: u64) -> Option<&'static str> {
    (total > i32::MAX as u64).then_some("a key's ranges add up to more than INT_MAX bytes")
}

/// Maps a Mooncake status code for `key` to a [`StoreError`].
///
/// | Mooncake codes | StoreError |
/// |---|---|
/// | OBJECT_NOT_FOUND (-704), REPLICA_NOT_FOUND, REPLICA_IS_GONE | `NotFound` |
/// | NO_AVAILABLE_HANDLE (-200), BUFFER_OVERFLOW, quota/limit codes | `NoSpace` |
/// | OBJECT_HAS_LEASE (-706), LEASE_EXPIRED (-707) | `Lease` |
/// | REPLICA_IS_NOT_READY (-703), OBJECT_REPLICA_BUSY (-714): a put still in progress | `Lease` |
/// | ILLEGAL_CLIENT (-601): another client put the key since our put started | `Lease` |
/// | TRANSFER_FAIL (-800), CHECKSUM_MISMATCH, WRITE_FAIL | `TransferFailed` |
/// | RPC_TIMEOUT (-901) | `RpcTimeout` |
/// | RPC_FAIL (-900), SEGMENT/CLIENT_NOT_FOUND, UNAVAILABLE_* | `Unavailable` |
/// | INVALID_PARAMS (-600), INVALID_KEY/READ/WRITE, shim argument codes | `InvalidArgument` |
/// | anything else | `Other` |
pub fn code_error(key: &str, code: ErrorCode) -> StoreError {
    let key = key.to_owned();
    match code.kind() {
        ErrorKind::NotFound => StoreError::NotFound { key },
        ErrorKind::NoSpace => StoreError::NoSpace {
            key,
            detail: code.to_string(),
        },
        ErrorKind::Lease => StoreError::Lease {
            key,
            detail: code.to_string(),
        },
        // The object's put is still in progress (a load or prefetch racing a save), or
        // another client's put of it took over this one's: it may be ready a moment later,
        // as a held lease lets go.
        ErrorKind::Busy => StoreError::Lease {
            key,
            detail: format!("{code} (a put of it in progress, this client's or another's)"),
        },
        ErrorKind::Transfer => StoreError::TransferFailed {
            key,
            code: i64::from(code.raw()),
        },
        ErrorKind::Timeout => StoreError::RpcTimeout { key },
        ErrorKind::Unavailable => StoreError::Unavailable {
            detail: format!("`{key}`: {code}").into(),
        },
        ErrorKind::InvalidArgument => StoreError::InvalidArgument {
            key,
            detail: code.to_string(),
        },
        _ => StoreError::Other {
            key,
            code: i64::from(code.raw()),
        },
    }
}

/// How long Mooncake's client waits for a call's transfers before it gives up on them and
/// returns with them still in flight (`TransferEngineOperationState::wait_for_completion`,
/// 60 s), less a margin: a call that failed a transfer after this long is taken as one the
/// client gave up on.
pub(super) const CLIENT_GIVES_UP_AFTER: Duration = mooncake_sys::CLIENT_GIVES_UP_AFTER;

/// The client's give-up time of a call that waits for every transfer it submitted, however
/// long they take: Mooncake's ranged read (`batch_get_into_multi_buffer_ranges`, a scatter
/// transfer whose wait has no time limit). Such a call that failed late left nothing running:
/// it is never taken as abandoned for its time (only when the shim cut it short). Its time is
/// bounded by the caller's deadline alone (`StoreCalls`: the caller is answered `Overdue`,
/// the worker stays with the call until the wheel returns).
pub(super) const WAITS_FOR_EVERY_TRANSFER: Duration = Duration::MAX;

/// How a wheel call ended, for [`mark_abandoned`]: after how long, on both clocks the client's
/// give-up depends on (see [`mooncake_sys::CallClock`]), and whether the shim cut it short
/// ([`MooncakeError::cut_short`]: an exception caught inside the call).
#[derive(Debug, Clone, Copy)]
pub(super) struct CallEnd {
    pub(super) span: mooncake_sys::CallSpan,
    pub(super) cut_short: bool,
}

/// Marks the failures of a wheel call whose transfers may still run as
/// [`StoreError::Abandoned`]: one that ran into the client's own transfer timeout (the client
/// returned without waiting for its transfers), or one the shim cut short (the wheel may have
/// submitted transfers it never waited for); they may still read or write the call's memory.
/// That holds whatever the call then reported (a key's transfer code, or the whole call failing
/// while it built its results), so every failure of `keys` (one result each, in order) is
/// marked but those refused before any transfer began (missing object, no space, lease, bad
/// argument). True when there was one.
pub(super) fn mark_abandoned<T>(
    call: &'static str,
    end: CallEnd,
    keys: &[&str],
    results: &mut [Result<T, StoreError>],
) -> bool {
    mark_abandoned_after(call, end, CLIENT_GIVES_UP_AFTER, keys, results)
}

/// [`mark_abandoned`] with the client's timeout given (`limit`).
fn mark_abandoned_after<T>(
    call: &'static str,
    end: CallEnd,
    limit: Duration,
    keys: &[&str],
    results: &mut [Result<T, StoreError>],
) -> bool {
    let took = end.span.monotonic;
    if end.cut_short {
        return abandon_failures(call, keys, results, |e| {
            format!("{e}: the call was cut short by an exception; its transfers may still run")
        });
    }
    // `WAITS_FOR_EVERY_TRANSFER`: the call returns only once each of its transfers ended.
    if limit == WAITS_FOR_EVERY_TRANSFER || !end.span.past(limit) {
        return false;
    }
    abandon_failures(call, keys, results, |e| match e {
        StoreError::TransferFailed { code, .. } => {
            format!("transfer code {code} after {took:?}; the client stops waiting at 60 s")
        }
        e => format!("{e} after {took:?}; the client stops waiting for its transfers at 60 s"),
    })
}

/// A put's failure that says the key is there already (OBJECT_ALREADY_EXISTS: another writer
/// put it first, or the key came twice in one call): first write wins, so the key is
/// present, not failed, and no transfer of it ran.
fn already_there(e: &StoreError) -> bool {
    matches!(e, StoreError::Other { code, .. }
        if i32::try_from(*code).is_ok_and(|c| ErrorCode(c).kind() == ErrorKind::AlreadyExists))
}

/// A put's result for one key: written, or present already ([`already_there`]).
fn put_outcome(r: Result<(), StoreError>) -> Result<PutOutcome, StoreError> {
    match r {
        Ok(()) => Ok(PutOutcome::Written),
        Err(e) if already_there(&e) => Ok(PutOutcome::AlreadyPresent),
        Err(e) => Err(e),
    }
}

/// Marks every failure of `results` (one per key of `keys`) `Abandoned`, with the detail
/// `why` gives, but those refused before any transfer began. True when there was one.
fn abandon_failures<T>(
    call: &'static str,
    keys: &[&str],
    results: &mut [Result<T, StoreError>],
    why: impl Fn(&StoreError) -> String,
) -> bool {
    let mut any = false;
    for (r, key) in results.iter_mut().zip(keys) {
        let detail = match r {
            // Refused before any transfer began: nothing of the key may still run.
            Ok(_)
            | Err(StoreError::NotFound { .. })
            | Err(StoreError::NoSpace { .. })
            | Err(StoreError::Lease { .. })
            | Err(StoreError::InvalidArgument { .. }) => continue,
            Err(e) if already_there(e) => continue,
            Err(StoreError::Abandoned { .. }) => {
                any = true;
                continue;
            }
            Err(e) => why(e),
        };
        *r = Err(StoreError::Abandoned {
            key: (*key).to_owned(),
            call,
            detail,
        });
        any = true;
    }
    if any {
        tracing::error!(
            call,
            "Mooncake left transfers that may still run: their memory is kept for good"
        );
    }
    any
}

/// Why the later calls of one read are not tried after this call, if they are not: it
/// failed whole, or every transfer of it failed. Each later call would wait out the client's
/// transfer timeout too (a storage node that stalls would cost calls × 60 s) while the caller
/// has given up.
fn gives_up<T>(
    results: &Result<Vec<mooncake_sys::KeyResult<T>>, MooncakeError>,
    what: &str,
) -> Option<String> {
    match results {
        Err(e) => Some(format!("an earlier {what} call failed ({e})")),
        Ok(r)
            if r.iter()
                .all(|k| matches!(k, Err(c) if *c == ErrorCode::TRANSFER_FAIL)) =>
        {
            Some(format!("every transfer of an earlier {what} call failed"))
        }
        Ok(_) => None,
    }
}

/// The error of a key not read because an earlier call of the same read gave up (`why`).
pub(super) fn not_read(key: &str, why: &str) -> StoreError {
    StoreError::Unavailable {
        detail: format!("`{key}` not read: {why}").into(),
    }
}

/// The error of a key whose wheel call panicked after `span`: `Abandoned` once the client may
/// have given up on its transfers (they may still run), else `Panicked`.
fn panicked_call(
    key: &str,
    call: &'static str,
    span: mooncake_sys::CallSpan,
    limit: Duration,
) -> StoreError {
    let took = span.monotonic;
    if limit != WAITS_FOR_EVERY_TRANSFER && span.past(limit) {
        StoreError::Abandoned {
            key: key.to_owned(),
            call,
            detail: format!("the call panicked after {took:?}; its transfers may still run"),
        }
    } else {
        StoreError::Panicked {
            key: key.to_owned(),
            call,
        }
    }
}

/// What one read call of the wheel gave: per key its result, why the read's later calls are
/// not tried ([`gives_up`]), and whether the client gave up on a transfer that may still run.
pub(super) struct WheelRead {
    pub(super) results: Vec<Result<u64, StoreError>>,
    pub(super) given_up: Option<String>,
    pub(super) abandoned: bool,
}

/// Runs one read call of the wheel (`call` names it, `what` in the messages) over `keys`,
/// timed and with a panic caught: the call's results per key, or every key failed when it
/// panicked (`Abandoned` past `limit`, the client's own timeout; else `Panicked`), with the
/// failed transfers of a call that ran to `limit` marked `Abandoned`; a call that failed
/// whole is logged through `failures`.
pub(super) fn wheel_read(
    call: &'static str,
    what: &str,
    keys: &[&str],
    limit: Duration,
    failures: &LogEvery,
    run: impl FnOnce() -> Result<Vec<mooncake_sys::KeyResult<u64>>, MooncakeError>,
) -> WheelRead {
    let clock = mooncake_sys::CallClock::start();
    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run));
    let span = clock.span();
    let mut results: Vec<Result<u64, StoreError>> =
        keys.iter().map(|k| failed_placeholder(k)).collect();
    let cut_short = matches!(&ran, Ok(Err(e)) if e.cut_short());
    let given_up = match ran {
        Ok(r) => {
            let why = gives_up(&r, what);
            let positions: Vec<usize> = (0..keys.len()).collect();
            per_key(failures, keys, r, &positions, &mut results);
            why
        }
        Err(_) => {
            for (r, k) in results.iter_mut().zip(keys) {
                *r = Err(panicked_call(k, call, span, limit));
            }
            Some(format!("an earlier {what} call panicked"))
        }
    };
    let end = CallEnd { span, cut_short };
    let abandoned = mark_abandoned_after(call, end, limit, keys, &mut results)
        || results
            .iter()
            .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer));
    // A call that ran into the client's transfer timeout (a storage node that stalls): each
    // later call touching that node would wait it out too, while the caller has given up.
    let given_up = given_up.or_else(|| {
        abandoned.then(|| format!("an earlier {what} call ran into the client's transfer timeout"))
    });
    WheelRead {
        results,
        given_up,
        abandoned,
    }
}

/// Maps a whole-call mooncake-sys error to the [`StoreError`] of `key`.
pub fn store_error(key: &str, e: &MooncakeError) -> StoreError {
    store_error_logged(key, e, true)
}

/// [`store_error`], logging the failure (where the error has no room for the shim's
/// message) only when `log`: a batched call's failure is logged once by its caller, not once
/// per key.
pub(super) fn store_error_logged(key: &str, e: &MooncakeError, log: bool) -> StoreError {
    match e {
        MooncakeError::Status {
            code,
            message,
            operation,
            ..
        } => {
            let typed = code_error(key, *code);
            let typed = match message {
                Some(message) => with_message(typed, operation, message, log),
                None => typed,
            };
            match typed {
                // The kind with room for it keeps the status behind its words.
                StoreError::Unavailable { detail } => StoreError::Unavailable {
                    detail: Cause::with_source(detail.to_string(), e.clone()),
                },
                other => other,
            }
        }
        MooncakeError::NulInString { .. } | MooncakeError::InvalidArguments { .. } => {
            StoreError::InvalidArgument {
                key: key.to_owned(),
                detail: e.to_string(),
            }
        }
        MooncakeError::OutOfMemory { .. } => StoreError::NoSpace {
            key: key.to_owned(),
            detail: e.to_string(),
        },
        // The library itself (missing, refused, without the kvlink extensions), or a client
        // that could not be made: the typed error stays behind the words.
        _ => StoreError::Unavailable {
            detail: Cause::with_source(format!("`{key}`: {e}"), e.clone()),
        },
    }
}

/// `e` with the message of the C++ exception behind it (the shim's): in its detail where it
/// has one, else in a log line beside it (the kinds without a detail cross the served
/// protocol as they are).
fn with_message(e: StoreError, operation: &str, message: &str, log: bool) -> StoreError {
    let more = |detail: String| format!("{detail}; {operation}: {message}");
    match e {
        StoreError::NoSpace { key, detail } => StoreError::NoSpace {
            key,
            detail: more(detail),
        },
        StoreError::Lease { key, detail } => StoreError::Lease {
            key,
            detail: more(detail),
        },
        StoreError::InvalidArgument { key, detail } => StoreError::InvalidArgument {
            key,
            detail: more(detail),
        },
        StoreError::Unavailable { detail } => StoreError::Unavailable {
            detail: more(detail.to_string()).into(),
        },
        other => {
            if log {
                tracing::warn!(error = %other, operation, message, "Mooncake call failed");
            }
            other
        }
    }
}

/// Whether `e`'s kind carries the shim's message in its words ([`with_message`]); the others
/// log it beside them.
fn has_room_for_message(e: &StoreError) -> bool {
    matches!(
        e,
        StoreError::NoSpace { .. }
            | StoreError::Lease { .. }
            | StoreError::InvalidArgument { .. }
            | StoreError::Unavailable { .. }
    )
}

/// Each key's result of a batched call over the keys at `valid` (of `keys`), into `out`:
/// the call's own failure, when it failed whole, for each of them (logged once, through
/// `failures`, the store's limiter).
pub(super) fn per_key<T>(
    failures: &LogEvery,
    keys: &[&str],
    results: Result<Vec<mooncake_sys::KeyResult<T>>, MooncakeError>,
    valid: &[usize],
    out: &mut [Result<T, StoreError>],
) {
    match results {
        Ok(results) => {
            for (&i, r) in valid.iter().zip(results) {
                out[i] = r.map_err(|c| code_error(keys[i], c));
            }
        }
        Err(e) => {
            // One line for the call: the same failure for each of its keys (hundreds of
            // pages times components) would be as many lines; and at `warn` once a minute
            // per operation (a master down fails every lookup's call alike), else at debug.
            if let Some(&first) = valid.first() {
                let operation = match &e {
                    MooncakeError::Status { operation, .. } => operation,
                    _ => "other",
                };
                if failures.due(operation) {
                    tracing::warn!(error = %e, keys = valid.len(), first_key = keys[first],
                        "Mooncake call failed for every key it named (more such failures of \
                         this call are logged at debug for a minute)");
                } else {
                    tracing::debug!(error = %e, keys = valid.len(), first_key = keys[first],
                        "Mooncake call failed for every key it named");
                }
            }
            for &i in valid {
                out[i] = Err(store_error_logged(keys[i], &e, false));
            }
        }
    }
}

/// An empty buffer with room for a gathered object of `len` bytes: `NoSpace` for the key
/// when the host cannot give it (an allocation failure would abort the process).
fn gather_buffer(key: &str, len: u64) -> Result<Vec<u8>, StoreError> {
    let mut buf = Vec::new();
    usize::try_from(len)
        .ok()
        .and_then(|n| buf.try_reserve_exact(n).ok())
        .ok_or_else(|| StoreError::NoSpace {
            key: key.to_owned(),
            detail: format!("{len} bytes to gather the object's parts could not be allocated"),
        })?;
    Ok(buf)
}

/// A failed registration: mapped as any call's error (a master that cannot be reached is
/// `Unavailable`, not the caller's bad argument), the region named where a key would be.
fn region_error(region: MemoryRegion, e: &MooncakeError) -> StoreError {
    store_error(&format!("<region {:#x}+{}>", region.addr, region.len), e)
}

pub(super) fn failed_placeholder<T>(key: &str) -> Result<T, StoreError> {
    Err(StoreError::Other {
        key: key.to_owned(),
        code: 0,
    })
}

// SAFETY: a wheel call's transfers end before it returns, except where the client gave up on
// them (its own transfer timeout) or the shim cut the call short: then every failure of that
// call is marked `Abandoned` (`mark_abandoned`), the bounce and staging memory the call used
// are kept for good, and a late call's results are marked the same way; a panicking wheel
// call's keys past the client's timeout are `Abandoned` too.
unsafe impl KvStore for MooncakeStore {
    fn name(&self) -> &str {
        "mooncake"
    }

    fn exists(&self, keys: &[&str]) -> Vec<Result<bool, StoreError>> {
        let (valid, checked) = split_valid(keys);
        let mut out: Vec<Result<bool, StoreError>> =
            checked.into_iter().map(|r| r.map(|()| false)).collect();
        if valid.is_empty() {
            return out;
        }
        let names: Vec<&str> = valid.iter().map(|&i| keys[i]).collect();
        per_key(
            &self.call_failures,
            keys,
            self.client.batch_is_exist(&names),
            &valid,
            &mut out,
        );
        self.seen(out)
    }

    /// The pinned wheel asks the master once per key (no batched size query), so a large
    /// batch's keys are asked on up to `SIZE_QUERY_THREADS` threads at once: the calls are
    /// round trips, not CPU work.
    fn object_size(&self, keys: &[&str]) -> Vec<Result<u64, StoreError>> {
        let one = |k: &&str| self.client.get_size(k).map_err(|e| self.key_error(k, &e));
        let threads = (keys.len() / SIZE_QUERY_KEYS_PER_THREAD).clamp(1, SIZE_QUERY_THREADS);
        if threads == 1 {
            return self.seen(keys.iter().map(one).collect());
        }
        let parts: Vec<&[&str]> = keys.chunks(keys.len().div_ceil(threads)).collect();
        let sizes = run_parts(
            "size-query",
            &parts,
            |part| part.iter().map(one).collect::<Vec<_>>(),
            |part| {
                part.iter()
                    .map(|k| {
                        Err(StoreError::Panicked {
                            key: (*k).to_owned(),
                            call: "object_size",
                        })
                    })
                    .collect()
            },
        )
        .into_iter()
        .flatten()
        .collect();
        self.seen(sizes)
    }

    unsafe fn get_into(&self, gets: &[ObjectGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // Destinations the transport cannot write in place (over RDMA: unregistered memory)
        // go through the bounce; null ones and bad keys are refused as any call's.
        let outside: Vec<usize> = (0..gets.len())
            .filter(|&i| {
                !gets[i].dst.is_null()
                    && !gets[i].key.contains('\0')
                    && self
                        .unregistered_dst(gets[i].dst as usize, gets[i].len)
                        .is_some()
            })
            .collect();
        if outside.is_empty() {
            // SAFETY: the caller's promise, for the same gets.
            unsafe { self.get_into_in_place(gets) }
        } else {
            // SAFETY: the caller's promise, for the same gets.
            unsafe { self.get_into_bounced(gets, &outside) }
        }
    }

    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        // SAFETY: the caller's own promise, for the same call.
        unsafe { self.get_ranges_checksummed(gets, &mut []) }
    }

    // Ranges staged through scratch (several layers of one page read as one range) are copied
    // out by the store: their checksums are taken in that pass, on the copy-out thread, while
    // the next call of the stream is on the wire.
    unsafe fn get_ranges_checksummed(
        &self,
        gets: &[RangedGet<'_>],
        sums: &mut [RangeChecksums],
    ) -> Vec<Result<u64, StoreError>> {
        let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();
        // Gets with nothing to read (no range, or only empty ones) succeed without I/O.
        let (valid, mut out) = vet_reads(
            &keys,
            |i| {
                refused_get(&gets[i]).or_else(|| {
                    gets[i]
                        .ranges
                        .iter()
                        .find_map(|r| self.unregistered_dst(r.dst as usize, r.len))
                })
            },
            |i| gets[i].ranges.iter().any(|r| r.len > 0),
        );
        if valid.is_empty() {
            return out;
        }
        let names: Vec<&str> = valid.iter().map(|&i| keys[i]).collect();
        // Left when it drops: after the read, on every path.
        let joined = self.sessions.join(&self.client, &names);
        // Keys in a session now; the others fail with the session's error.
        let readable: Vec<usize> = valid
            .iter()
            .copied()
            .filter(|&i| match joined.result(keys[i]) {
                Some(Ok(())) => true,
                Some(Err(e)) => {
                    out[i] = Err(e.clone());
                    false
                }
                // Every key of `names` has a result (the join's contract); one without fails
                // unread, never a panic.
                None => {
                    out[i] = failed_placeholder(keys[i]);
                    false
                }
            })
            .collect();
        if !readable.is_empty() {
            // Failed until a read says otherwise: a result the read paths drop is never an
            // `Ok(0)`.
            for &i in &readable {
                out[i] = failed_placeholder(keys[i]);
            }
            self.read_streamed(gets, &readable, &mut out, sums);
            // A read under a session whose lease ran out erased it at the client.
            let lapsed: Vec<&str> = readable
                .iter()
                .filter(|&&i| matches!(out[i], Err(StoreError::Lease { .. })))
                .map(|&i| keys[i])
                .collect();
            if !lapsed.is_empty() {
                self.sessions.lapsed(&lapsed);
            }
        }
        out
    }

    unsafe fn put(&self, puts: &[ObjectPut<'_>]) -> Vec<Result<PutOutcome, StoreError>> {
        let keys: Vec<&str> = puts.iter().map(|p| p.key).collect();
        let mut out: Vec<Result<PutOutcome, StoreError>> =
            keys.iter().map(|k| failed_placeholder(k)).collect();
        // First write wins: find the keys already there. Needed: the wheel's put of a key
        // there already answers success (measured against a real master: the round-trip test
        // in crates/mooncake-linker/tests/mooncake_store.rs reads `Written` without this call).
        let exists = self.exists(&keys);
        let mut to_write = Vec::new();
        for (i, e) in exists.into_iter().enumerate() {
            match e {
                Ok(true) => out[i] = Ok(PutOutcome::AlreadyPresent),
                Ok(false) if puts[i].is_empty() => {
                    out[i] = Err(StoreError::InvalidArgument {
                        key: keys[i].to_owned(),
                        detail: "Mooncake cannot store an empty object".into(),
                    })
                }
                Ok(false) if puts[i].parts.iter().any(|p| p.0.is_null() && p.1 > 0) => {
                    out[i] = Err(StoreError::InvalidArgument {
                        key: keys[i].to_owned(),
                        detail: "null source".into(),
                    })
                }
                Ok(false) => to_write.push(i),
                Err(e) => out[i] = Err(e),
            }
        }
        if to_write.is_empty() {
            return out;
        }
        // Multi-part objects are gathered into staging buffers (kept alive until the put
        // returns); single-part objects go zero-copy. Over any protocol but TCP the wheel
        // reads a zero-copy put's sources through their registration, which a gathered buffer
        // has not, nor a single part outside the registered regions (a companion's, a device
        // pool's gathered objects): those objects go through the client's copying put, one at
        // a time.
        let gather_zero_copy = self.config.gathered_puts_zero_copy();
        let mut copied: Vec<(usize, Cow<'_, [u8]>)> = Vec::new();
        let mut staging: Vec<Vec<u8>> = Vec::new();
        let mut ptrs: Vec<*mut u8> = Vec::with_capacity(to_write.len());
        let mut sizes: Vec<usize> = Vec::with_capacity(to_write.len());
        let mut zero_copy = Vec::with_capacity(to_write.len());
        for &i in &to_write {
            let parts = &puts[i].parts;
            match parts.as_slice() {
                [(ptr, len)] if self.moves_in_place(*ptr as usize, *len) => {
                    ptrs.push(ptr.cast_mut());
                    sizes.push(*len);
                    zero_copy.push(i);
                }
                [(ptr, len)] => {
                    // One part the wheel cannot read in place (not registered, over RDMA): the
                    // copying put reads it where it is.
                    // SAFETY: the caller of this `unsafe fn` promised (KvStore's buffer
                    // contract) that the part is valid for reads of its length and not written
                    // during the call; a null part of length > 0 was refused above (length 0
                    // moves in place).
                    let part = unsafe { std::slice::from_raw_parts(*ptr, *len) };
                    copied.push((i, Cow::Borrowed(part)));
                }
                _ => {
                    // Several parts: gathered, then put zero-copy or copying as above.
                    let mut buf = match gather_buffer(puts[i].key, puts[i].len()) {
                        Ok(buf) => buf,
                        Err(e) => {
                            out[i] = Err(e);
                            continue;
                        }
                    };
                    for &(ptr, len) in parts.iter().filter(|p| p.1 > 0) {
                        // SAFETY: the caller of this `unsafe fn` promised (KvStore's buffer
                        // contract) that every source part is valid for reads of its length
                        // and not written during the call; null parts of length > 0 were
                        // refused above.
                        buf.extend_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
                    }
                    if gather_zero_copy {
                        ptrs.push(buf.as_mut_ptr());
                        sizes.push(buf.len());
                        staging.push(buf);
                        zero_copy.push(i);
                    } else {
                        copied.push((i, Cow::Owned(buf)));
                    }
                }
            }
        }
        // Once one fails, the rest are not tried: each could wait out the client's transfer
        // timeout too, while the caller has given up.
        let mut failed: Option<String> = None;
        for (i, buf) in copied {
            if let Some(why) = &failed {
                out[i] = Err(StoreError::Unavailable {
                    detail: format!("`{}` not written: {why}", keys[i]).into(),
                });
                continue;
            }
            // The client copies through its local buffer: an object larger than it can never
            // be put so (a setting to change, said plainly rather than as the wheel's
            // INVALID_PARAMS).
            let local = self.config.local_buffer_bytes();
            if buf.len() as u64 > local {
                out[i] = Err(StoreError::InvalidArgument {
                    key: keys[i].to_owned(),
                    detail: format!(
                        "an object of {} bytes is larger than the client's local buffer ({local} \
                         bytes, MOONCAKE_LOCAL_BUFFER_SIZE) that a copying put goes through",
                        buf.len()
                    ),
                });
                continue;
            }
            let Some(_transfer) = self.transfers.transfer() else {
                let e = gate_held(keys[i]);
                failed = Some(e.to_string());
                out[i] = Err(e);
                continue;
            };
            let began = Instant::now();
            // Fault injection (feature `failpoints`): a copying put that failed as a transfer.
            #[cfg(feature = "failpoints")]
            let injected = (|| {
                fail::fail_point!("mooncake-copying-put", |_| Some(
                    StoreError::TransferFailed {
                        key: keys[i].to_owned(),
                        code: -1,
                    }
                ));
                None
            })();
            #[cfg(not(feature = "failpoints"))]
            let injected: Option<StoreError> = None;
            out[i] = match injected {
                Some(e) => Err(e),
                None => put_outcome(
                    self.client
                        .put(keys[i], &buf, self.config.replicate_config())
                        .map_err(|e| self.key_error(keys[i], &e)),
                ),
            };
            // A failure that may have waited out the client's transfer timeout (by its kind,
            // or by how long it took) stops the rest (the caller has given up); one about this
            // object alone does not.
            if let Err(e) = &out[i] {
                if began.elapsed() >= CLIENT_GIVES_UP_AFTER
                    || matches!(
                        e.failure(),
                        kv_loader::StoreFailure::TransferFailed
                            | kv_loader::StoreFailure::RpcTimeout
                            | kv_loader::StoreFailure::Unavailable
                    )
                {
                    failed = Some(format!("an earlier copying put failed ({e})"));
                }
            }
        }
        let to_write = zero_copy;
        // Nor the zero-copy batch, which would wait out the same timeout once more.
        if let Some(why) = &failed {
            for &i in &to_write {
                out[i] = Err(StoreError::Unavailable {
                    detail: format!("`{}` not written: {why}", keys[i]).into(),
                });
            }
            return out;
        }
        if to_write.is_empty() {
            return out;
        }
        let names: Vec<&str> = to_write.iter().map(|&i| keys[i]).collect();
        let Some(transfer) = self.transfers.transfer() else {
            for &i in &to_write {
                out[i] = Err(gate_held(keys[i]));
            }
            return out;
        };
        let clock = mooncake_sys::CallClock::start();
        let results = match CKeys::new(&names) {
            // SAFETY: every pointer is either a caller's single source part (valid for reads of
            // its length for the whole call, by the trait's contract) or one of `staging`'s
            // buffers, which live until the end of this function; the put is synchronous.
            Ok(ckeys) => unsafe {
                self.client.batch_put_from_raw(
                    &ckeys,
                    &ptrs,
                    &sizes,
                    self.config.replicate_config(),
                )
            },
            Err(e) => Err(e),
        };
        let span = clock.span();
        let cut_short = results.as_ref().is_err_and(MooncakeError::cut_short);
        let mut written: Vec<Result<(), StoreError>> = to_write
            .iter()
            .map(|&i| failed_placeholder(keys[i]))
            .collect();
        let positions: Vec<usize> = (0..to_write.len()).collect();
        per_key(
            &self.call_failures,
            &names,
            results,
            &positions,
            &mut written,
        );
        let end = CallEnd { span, cut_short };
        let abandoned = mark_abandoned("batch_put_from", end, &names, &mut written);
        if abandoned {
            // Transfers may still read the staging and the registered sources.
            let bytes = staging.iter().map(|b| b.len() as u64).sum();
            crate::store::keep_for_good(bytes, "a put's gathered staging");
            std::mem::forget(staging);
            self.transfers.abandon(transfer);
            staging = Vec::new();
        } else {
            drop(transfer);
        }
        for (&i, r) in to_write.iter().zip(written) {
            out[i] = put_outcome(r);
        }
        drop(staging);
        out
    }

    fn remove(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        // Before and after the master call: a read joining in between asks the master.
        self.sessions.forget_replicas(&self.client, keys);
        let out: Vec<_> = keys
            .iter()
            .map(|k| {
                self.client
                    .remove(k, false)
                    .map_err(|e| self.key_error(k, &e))
            })
            .collect();
        // The replicas their sessions resolved may go to new puts: the next read asks again.
        self.sessions.forget_replicas(&self.client, keys);
        self.seen(out)
    }

    /// A forced remove: a bad object goes even while a read lease (a load, a lookup) holds it.
    /// Sessions of its key that reads would join without the master are forgotten: their
    /// replica may be given to a new put, whose bytes a ranged read would return as the
    /// object's.
    fn discard(&self, keys: &[&str]) -> Vec<Result<(), StoreError>> {
        // Before and after the master call: a read joining in between asks the master.
        self.sessions.forget_replicas(&self.client, keys);
        let out: Vec<_> = keys
            .iter()
            .map(|k| {
                self.client
                    .remove(k, true)
                    .map_err(|e| self.key_error(k, &e))
            })
            .collect();
        self.sessions.forget_replicas(&self.client, keys);
        self.seen(out)
    }

    unsafe fn register(&self, region: MemoryRegion) -> Result<(), StoreError> {
        // Another registration holds the table across its wheel call, which may hang (a
        // metadata service that does not answer) or only be slow (RDMA pins about a second
        // per GB): waited for while this call's caller waits.
        let Some(mut registered) = crate::store::caller::lock_while_awaited(&self.registered)
        else {
            return Err(StoreError::Unavailable {
                detail: format!(
                    "<region {:#x}+{}>: the caller gave up while another registration held \
                     the table",
                    region.addr, region.len
                )
                .into(),
            });
        };
        if registered.hold_again(&region) {
            return Ok(());
        }
        // Fault injection (feature `failpoints`): a `sleep` here is a registration that hangs
        // in the wheel with the table held.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("mooncake-register-held");
        // SAFETY: mooncake-sys asks that the region stay allocated until it is unregistered or
        // the client is dropped: exactly this function's own contract, which our caller took
        // on. The client is dropped with this store.
        unsafe {
            self.client
                .register_buffer(region.addr as *mut u8, region.len)
        }
        .map_err(|e| region_error(region, &e))?;
        registered.added(&region);
        *self.in_place.write() = registered.regions();
        Ok(())
    }

    fn unregister(&self, region: MemoryRegion) -> Result<(), StoreError> {
        let deadline = kv_loader::deadline_after(UNREGISTER_WAIT);
        // A register holds the table across its wheel call, which may hang (a metadata
        // service that does not answer): waited for within the same bound, then the region
        // stays registered (counted as held).
        let Some(mut table) = self.registered.try_lock_until(deadline) else {
            return Err(StoreError::Unavailable {
                detail: format!(
                    "<region {:#x}+{}>: a registration held the table for {UNREGISTER_WAIT:?}; \
                     the region stays registered",
                    region.addr, region.len
                )
                .into(),
            });
        };
        // Not held across the wait below: a register (of any region) would wait with it.
        let last = matches!(table.release(&region), Release::Last);
        drop(table);
        if !last {
            return Ok(());
        }
        let still_in_flight = || StoreError::Unavailable {
            detail: format!(
                "<region {:#x}+{}>: transfers still in flight after {UNREGISTER_WAIT:?}, or one \
                 was given up on and may still run; the region stays registered",
                region.addr, region.len
            )
            .into(),
        };
        // mooncake-sys asks that no call using the region be in flight: wait until no
        // transfer of this store is (bounded; on time-out the region stays registered).
        let (_quiet, mut registered) = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let quiet = self.transfers.quiet(left).ok_or_else(still_in_flight)?;
            // A register holds the counts across its wheel call (slow over RDMA, which pins
            // every page): never wait for them while holding the gate, which parks every
            // transfer of the store. Let the gate go and try again.
            if let Some(registered) = self.registered.try_lock() {
                break (quiet, registered);
            }
            drop(quiet);
            if Instant::now() >= deadline {
                return Err(still_in_flight());
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        // Registered again while this waited (its count went back up), or let go by a
        // concurrent unregister of the same holder: the wheel keeps or already lost it.
        match registered.release(&region) {
            Release::Last => {}
            Release::NotHeld | Release::StillHeld => return Ok(()),
        }
        // Fault injection (feature `failpoints`): a `sleep` here is an unregistration that
        // hangs in the wheel with the transfer gate held alone.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("mooncake-unregister-held");
        // SAFETY: no transfer of this store is in flight (the gate is held exclusively), and
        // every transfer goes through this store's client.
        unsafe { self.client.unregister_buffer(region.addr as *mut u8) }
            .map_err(|e| region_error(region, &e))?;
        registered.forget(&region);
        *self.in_place.write() = registered.regions();
        Ok(())
    }

    fn start_session(&self, keys: &[&str]) -> Result<ReadSession, StoreError> {
        let token = self.sessions.start(&self.client, keys)?;
        Ok(ReadSession {
            keys: keys.iter().map(|k| (*k).to_owned()).collect(),
            lease: Some(self.config.lease_duration()),
            token,
        })
    }

    /// Lets go of what the session pinned (its keys as started, whatever `session.keys` says
    /// now); a session ended before, or not started here, lets go of nothing.
    fn end_session(&self, session: &ReadSession) -> Result<(), StoreError> {
        self.sessions.end(&self.client, session.token)
    }

    fn health(&self) -> Result<(), StoreError> {
        match self.client.health() {
            Ok(Health::Healthy) => Ok(()),
            Ok(other) => Err(StoreError::Unavailable {
                detail: format!("Mooncake health check: {other:?}").into(),
            }),
            Err(e) => Err(StoreError::Unavailable {
                detail: Cause::from_error(e),
            }),
        }
    }
}

impl MooncakeStore {
    /// Results of a call to the master: one that found it unreachable (`Unavailable`,
    /// `RpcTimeout`) makes every read session's key ask the master again before its next read
    /// ([`SessionTable::forget_all`](super::sessions::SessionTable::forget_all)): the master
    /// may have restarted empty. A restart no call of this store saw is found by each key's
    /// next renewal (`LinkerConfig::lease_renewal` for a load's pin) or once half the lease has
    /// passed.
    fn seen<T>(&self, results: Vec<Result<T, StoreError>>) -> Vec<Result<T, StoreError>> {
        if results
            .iter()
            .any(|r| r.as_ref().is_err_and(master_unreachable))
        {
            self.sessions.forget_all();
        }
        results
    }

    /// [`store_error`] for a call of one key, its log line (where the error has no room for
    /// the shim's message) through the store's limiter: at `warn` once a minute per
    /// operation. A master down fails every key's call alike (an object-size query per key,
    /// a remove per key): one line each was as many lines as keys.
    fn key_error(&self, key: &str, e: &MooncakeError) -> StoreError {
        let typed = store_error_logged(key, e, false);
        if let MooncakeError::Status {
            operation,
            message: Some(message),
            ..
        } = e
        {
            if !has_room_for_message(&typed) {
                match self.call_failures.due_after(operation) {
                    Some(skipped) => tracing::warn!(error = %typed, operation, message, skipped,
                        "Mooncake call failed (`skipped`: failures of this call since the last \
                         such line, logged at debug)"),
                    None => {
                        tracing::debug!(error = %typed, operation, message, "Mooncake call failed")
                    }
                }
            }
        }
        typed
    }

    /// [`KvStore::get_into`] with every destination written in place (none is routed through
    /// the bounce; one the transport cannot write is refused).
    ///
    /// # Safety
    /// As [`KvStore::get_into`].
    pub(super) unsafe fn get_into_in_place(
        &self,
        gets: &[ObjectGet<'_>],
    ) -> Vec<Result<u64, StoreError>> {
        let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();

        let (valid, mut out) = vet_reads(
            &keys,
            |i| {
                null_dst(gets[i].dst)
                    .or_else(|| self.unregistered_dst(gets[i].dst as usize, gets[i].len))
            },
            |_| true,
        );
        // Marked abandoned as soon as a call is (not after the loop): a later call that
        // panicked would otherwise unwind past the mark.
        let Some(held) = self.transfers.transfer() else {
            for &i in &valid {
                out[i] = Err(gate_held(keys[i]));
            }
            return out;
        };
        let mut transfer = Some(held);
        // The wheel's `batch_get_into` stalls (until its 60 s transfer timeout) when one call
        // carries thousands of keys over TCP: at most MAX_WHOLE_READS_PER_CALL keys per call.
        // Once a call fails whole (or every key of it fails its transfer), the later parts are
        // not tried: each would wait out the same timeout while the caller has given up.
        let mut given_up: Option<String> = None;
        for part in valid.chunks(MAX_WHOLE_READS_PER_CALL) {
            if let Some(why) = &given_up {
                for &i in part {
                    out[i] = Err(not_read(keys[i], why));
                }
                continue;
            }
            let names: Vec<&str> = part.iter().map(|&i| keys[i]).collect();
            let ckeys = match CKeys::new(&names) {
                Ok(k) => k,
                Err(e) => {
                    // One line for the call, not one per key.
                    for (n, &i) in part.iter().enumerate() {
                        out[i] = Err(store_error_logged(keys[i], &e, n == 0));
                    }
                    continue;
                }
            };
            let ptrs: Vec<*mut u8> = part.iter().map(|&i| gets[i].dst).collect();
            let sizes: Vec<usize> = part.iter().map(|&i| gets[i].len).collect();
            // SAFETY: the caller of this `unsafe fn` promised
            // (KvStore's buffer contract) that each `dst` is valid for writes of `len` bytes,
            // not accessed by anyone else during the call, and registered where the transport
            // needs it; the call is synchronous, except for a transfer the client gives up on,
            // whose memory the caller then keeps for good (`StoreError::Abandoned`).
            let call = || unsafe { self.client.batch_get_into_raw(&ckeys, &ptrs, &sizes) };
            let read = wheel_read(
                "batch_get_into",
                "whole-object read",
                &names,
                CLIENT_GIVES_UP_AFTER,
                &self.call_failures,
                call,
            );
            given_up = read.given_up;
            if let Some(why) = &given_up {
                tracing::warn!(keys = part.len(), why, "whole-object reads given up");
            }
            if read.abandoned {
                // Transfers may still run: `unregister` must not let their memory go.
                if let Some(t) = transfer.take() {
                    self.transfers.abandon(t);
                }
            }
            let mine = read.results;
            for (&i, r) in part.iter().zip(mine) {
                out[i] = r;
            }
        }
        drop(transfer);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A multi-part object whose gathering buffer cannot be had fails its key with
    /// `NoSpace`, not the process with an allocation abort.
    #[test]
    fn a_gather_buffer_the_host_cannot_give_is_no_space() {
        let e = gather_buffer("k", isize::MAX as u64).unwrap_err();
        assert!(
            matches!(&e, StoreError::NoSpace { key, .. } if key == "k"),
            "{e:?}"
        );
        assert!(gather_buffer("k", u64::MAX).is_err());
        assert!(gather_buffer("k", 4096).unwrap().capacity() >= 4096);
    }

    /// Before, a call buffer that could not be allocated came back as `InvalidArgument`, a
    /// permanent failure: it is `NoSpace`, which may pass.
    #[test]
    fn a_call_buffer_that_cannot_be_allocated_is_no_space() {
        let oom = MooncakeError::OutOfMemory {
            operation: "put",
            bytes: usize::MAX,
        };
        let e = store_error("k", &oom);
        assert!(matches!(e, StoreError::NoSpace { .. }), "{e:?}");
        assert!(e.failure().is_retryable());
    }

    /// Before, the master's "replica not ready" / "replica busy" (a put of the object still in
    /// progress, as when a load races a save) came back as `Other`, a permanent failure; so
    /// did "illegal client" (another client put the key again since this one's put started).
    #[test]
    fn a_replica_still_being_put_is_a_retryable_failure() {
        for code in [-703, -714, -601].map(mooncake_sys::ErrorCode) {
            let e = code_error("k", code);
            assert!(e.failure().is_retryable(), "{code}: {e:?}");
        }
    }

    /// A library or client error keeps the typed `MooncakeError` behind the words, and a
    /// registration that fails for a reason other than its arguments is not `InvalidArgument`.
    #[test]
    fn errors_keep_their_typed_source_and_registration_failures_their_kind() {
        let unsupported = MooncakeError::Unsupported {
            path: "store.so".into(),
            operation: "get_ranges",
        };
        match store_error("k", &unsupported) {
            StoreError::Unavailable { detail } => assert!(
                matches!(
                    detail.downcast_ref::<MooncakeError>(),
                    Some(MooncakeError::Unsupported { .. })
                ),
                "{detail:?}"
            ),
            other => panic!("{other:?}"),
        }
        let region = MemoryRegion {
            addr: 0x1000,
            len: 64,
        };
        let rpc = MooncakeError::Status {
            operation: "register_buffer",
            key: None,
            code: mooncake_sys::ErrorCode::RPC_FAIL,
            message: None,
        };
        let e = region_error(region, &rpc);
        assert!(!matches!(e, StoreError::InvalidArgument { .. }), "{e:?}");
        // A status mapped to `Unavailable` keeps the status as its source.
        match store_error("k", &rpc) {
            StoreError::Unavailable { detail } => assert!(
                matches!(
                    detail.downcast_ref::<MooncakeError>(),
                    Some(MooncakeError::Status { code, .. }) if *code == mooncake_sys::ErrorCode::RPC_FAIL
                ),
                "{detail:?}"
            ),
            other => panic!("{other:?}"),
        }
        let bad = MooncakeError::InvalidArguments {
            operation: "register_buffer",
            detail: "zero length".into(),
        };
        assert!(matches!(
            region_error(region, &bad),
            StoreError::InvalidArgument { key, .. } if key.starts_with("<region 0x1000+64>")
        ));
    }

    #[test]
    fn a_key_whose_ranges_exceed_int_max_is_refused_alone() {
        // The wheel's per-key result is an int: the shim refuses a whole call with such a key
        // in it, so the vetting refuses that key before the call, and the others go ahead.
        assert_eq!(too_long(i32::MAX as u64), None);
        assert!(too_long(i32::MAX as u64 + 1).is_some());
        let big = ReadRange {
            dst: std::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 1 << 30,
            offset: 0,
        };
        let gets = [
            RangedGet {
                key: "small",
                ranges: smallvec::smallvec![ReadRange { len: 4096, ..big }],
            },
            RangedGet {
                key: "big",
                ranges: smallvec::smallvec![
                    big,
                    ReadRange {
                        offset: 1 << 30,
                        ..big
                    }
                ],
            },
        ];
        let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();
        let (valid, out) = vet_reads(
            &keys,
            |i| refused_get(&gets[i]),
            |i| !gets[i].ranges.is_empty(),
        );
        assert_eq!(valid, [0]);
        assert!(matches!(&out[1], Err(StoreError::InvalidArgument { key, .. }) if key == "big"));
    }

    #[test]
    fn transfers_failed_after_the_clients_own_timeout_are_abandoned() {
        let results = || {
            vec![
                Ok(3u64),
                Err(StoreError::TransferFailed {
                    key: "k".into(),
                    code: -800,
                }),
                Err(StoreError::NotFound { key: "n".into() }),
                // Refused before any transfer began: stays what it is, nothing kept.
                Err(StoreError::NoSpace {
                    key: "f".into(),
                    detail: "full".into(),
                }),
            ]
        };
        let keys = ["o", "k", "n", "f"];
        let span = |d| mooncake_sys::CallSpan {
            monotonic: d,
            wall: Some(d),
        };
        let mut early = results();
        assert!(!mark_abandoned(
            "get",
            CallEnd {
                span: span(Duration::from_secs(10)),
                cut_short: false
            },
            &keys,
            &mut early
        ));
        assert_eq!(early, results());
        let mut late = results();
        assert!(mark_abandoned(
            "get",
            CallEnd {
                span: span(Duration::from_secs(60)),
                cut_short: false
            },
            &keys,
            &mut late
        ));
        assert_eq!(late[0], Ok(3));
        assert!(
            matches!(&late[1], Err(StoreError::Abandoned { key, call: "get", .. }) if key == "k")
        );
        assert_eq!(late[2], Err(StoreError::NotFound { key: "n".into() }));
        assert_eq!(late[3], results()[3]);
    }

    /// Mooncake's ranged read waits for every transfer of its scatter with no time limit:
    /// one that failed after a minute, or across a wall-clock step, left nothing running.
    /// Before, it was taken as abandoned (its memory kept for good, the transfer gate closed to
    /// unregistering for the process's life) as a whole-object read's is.
    #[test]
    fn a_late_ranged_read_left_nothing_running() {
        let failed = || -> Vec<Result<u64, StoreError>> {
            vec![Err(StoreError::TransferFailed {
                key: "k".into(),
                code: -800,
            })]
        };
        for span in [
            mooncake_sys::CallSpan {
                monotonic: Duration::from_secs(600),
                wall: Some(Duration::from_secs(600)),
            },
            mooncake_sys::CallSpan {
                monotonic: Duration::from_millis(200),
                wall: None,
            },
        ] {
            let end = CallEnd {
                span,
                cut_short: false,
            };
            let mut results = failed();
            assert!(!mark_abandoned_after(
                "batch_get_ranges",
                end,
                WAITS_FOR_EVERY_TRANSFER,
                &["k"],
                &mut results
            ));
            assert_eq!(results, failed(), "{span:?}");
            let mut whole = failed();
            assert!(mark_abandoned("batch_get_into", end, &["k"], &mut whole));
        }
        // Cut short by an exception inside the call: its transfers may not have been waited.
        let mut results = failed();
        let cut = CallEnd {
            span: mooncake_sys::CallSpan {
                monotonic: Duration::from_millis(1),
                wall: Some(Duration::from_millis(1)),
            },
            cut_short: true,
        };
        assert!(mark_abandoned_after(
            "batch_get_ranges",
            cut,
            WAITS_FOR_EVERY_TRANSFER,
            &["k"],
            &mut results
        ));
    }

    /// A key another writer put first (OBJECT_ALREADY_EXISTS) is present, not failed, and no
    /// transfer of it ran: a late call does not abandon it. Before, it was a permanent `Other`
    /// failure, and a late one was marked `Abandoned` (its staging leaked, the gate closed).
    #[test]
    fn a_key_put_first_by_another_writer_is_present_not_failed() {
        let exists = || code_error("k", mooncake_sys::ErrorCode(-705));
        assert_eq!(put_outcome(Err(exists())), Ok(PutOutcome::AlreadyPresent));
        assert_eq!(put_outcome(Ok(())), Ok(PutOutcome::Written));
        let mut late: Vec<Result<(), StoreError>> = vec![Err(exists())];
        let end = CallEnd {
            span: mooncake_sys::CallSpan {
                monotonic: Duration::from_secs(60),
                wall: Some(Duration::from_secs(60)),
            },
            cut_short: false,
        };
        assert!(!mark_abandoned("batch_put_from", end, &["k"], &mut late));
        assert_eq!(late, vec![Err(exists())]);
    }

    /// The client times its 60 s on the wall clock: a call of 0.2 s across which the wall
    /// clock was stepped a minute forward had its failed transfers given up on, still running.
    /// Before, only the monotonic time was read, and the call's memory was handed back.
    #[test]
    fn a_call_across_a_wall_clock_step_is_abandoned() {
        let mut results: Vec<Result<u64, StoreError>> = vec![Err(StoreError::TransferFailed {
            key: "k".into(),
            code: -800,
        })];
        let stepped = CallEnd {
            span: mooncake_sys::CallSpan {
                monotonic: Duration::from_millis(200),
                wall: Some(Duration::from_secs(61)),
            },
            cut_short: false,
        };
        assert!(mark_abandoned("get", stepped, &["k"], &mut results));
        assert!(matches!(&results[0], Err(StoreError::Abandoned { .. })));
    }

    /// A call that failed whole is logged through the limiter it is given (its store's):
    /// before, one `static` limited every store of the process, so ranks as threads shared
    /// one line a minute per operation and a second store's first failure went to `debug`.
    #[test]
    fn a_call_that_failed_whole_is_logged_through_its_stores_limiter() {
        let failed = || {
            Err(MooncakeError::Status {
                operation: "batch_is_exist",
                key: None,
                code: ErrorCode(-1),
                message: None,
            })
        };
        let (one, other) = (LogEvery::new(), LogEvery::new());
        let mut out: Vec<Result<bool, StoreError>> = vec![failed_placeholder("a")];
        per_key::<bool>(&one, &["a"], failed(), &[0], &mut out);
        assert!(out[0].is_err());
        assert!(!one.due("batch_is_exist"), "the line went through `one`");
        assert!(
            other.due("batch_is_exist"),
            "another store's limiter is its own"
        );
    }

    /// Before, only a key's transfer code was taken as abandoned: a late call that failed
    /// whole (the wheel throwing while it built its results) left its scratch reused, its
    /// staging freed and the gate open to unregistering while its transfers could still run.
    #[test]
    fn a_late_call_that_failed_whole_is_abandoned_too() {
        let whole = MooncakeError::Status {
            operation: "batch_get_ranges",
            key: None,
            code: ErrorCode(mooncake_sys::sys::shim_codes::EXCEPTION),
            message: Some("std::bad_alloc".into()),
        };
        let keys = ["a", "b"];
        let read = wheel_read(
            "batch_get_ranges",
            "ranged read",
            &keys,
            Duration::ZERO,
            &LogEvery::new(),
            || Err(whole),
        );
        assert!(read.abandoned);
        assert!(read.given_up.is_some());
        for (r, k) in read.results.iter().zip(keys) {
            assert!(
                matches!(r, Err(StoreError::Abandoned { key, .. }) if key == k),
                "{r:?}"
            );
        }
        // In time, a whole failure after the wheel's call returned (results of the wrong
        // shape) is the call's own error, nothing kept.
        let whole = |code: i32| MooncakeError::Status {
            operation: "batch_get_ranges",
            key: None,
            code: ErrorCode(code),
            message: None,
        };
        let bad_result = mooncake_sys::sys::shim_codes::BAD_RESULT;
        let read = wheel_read(
            "batch_get_ranges",
            "ranged read",
            &keys,
            Duration::from_secs(60),
            &LogEvery::new(),
            || Err(whole(bad_result)),
        );
        assert!(!read.abandoned);
        assert!(
            !read.results[0].as_ref().unwrap_err().may_still_transfer(),
            "{:?}",
            read.results[0]
        );
        // An exception the shim caught inside the wheel's call cut it short: the transfers it
        // submitted may never have been waited for, however soon it failed. Before, that
        // memory was freed or reused at once.
        for code in [
            mooncake_sys::sys::shim_codes::EXCEPTION,
            mooncake_sys::sys::shim_codes::OUT_OF_MEMORY,
        ] {
            let read = wheel_read(
                "batch_get_ranges",
                "ranged read",
                &keys,
                Duration::from_secs(60),
                &LogEvery::new(),
                || Err(whole(code)),
            );
            assert!(read.abandoned, "{code}");
            for (r, k) in read.results.iter().zip(keys) {
                assert!(
                    matches!(r, Err(StoreError::Abandoned { key, .. }) if key == k),
                    "{r:?}"
                );
            }
        }
    }

    #[test]
    fn the_shims_exception_message_stays_with_the_error() {
        let status = |code: i32| MooncakeError::Status {
            operation: "batch_get_ranges",
            key: None,
            code: ErrorCode(code),
            message: Some("boom".into()),
        };
        let invalid = store_error("k", &status(mooncake_sys::sys::shim_codes::INVALID_ARG));
        assert!(
            matches!(invalid, StoreError::InvalidArgument { .. }),
            "{invalid:?}"
        );
        assert!(
            invalid.to_string().contains("batch_get_ranges: boom"),
            "{invalid}"
        );
        // A kind without a detail keeps its kind (the message goes to the log).
        let other = store_error("k", &status(mooncake_sys::sys::shim_codes::EXCEPTION));
        assert!(matches!(other, StoreError::Other { .. }), "{other:?}");
    }

    #[test]
    fn a_range_with_a_null_destination_or_ending_past_the_largest_offset_is_refused() {
        let mut byte = 0u8;
        let dst: *mut u8 = &mut byte;
        let r = |dst: *mut u8, len: usize, offset: u64| ReadRange { dst, len, offset };
        assert_eq!(refused_range(&r(dst, 1, 0)), None);
        assert_eq!(refused_range(&r(dst, 16, u64::MAX - 16)), None);
        assert_eq!(
            refused_range(&r(std::ptr::null_mut(), 1, 0)),
            Some("null destination")
        );
        assert!(refused_range(&r(dst, 16, u64::MAX - 15)).is_some());
        assert!(refused_range(&r(dst, usize::MAX, 1)).is_some());
        // A read with one such range fails that key only, with its reason.
        let keys = ["ok", "past"];
        let ranges = [r(dst, 1, 0), r(dst, 16, u64::MAX - 15)];
        let (valid, out) = vet_reads(&keys, |i| refused_range(&ranges[i]), |_| true);
        assert_eq!(valid, [0]);
        assert!(matches!(
            &out[1],
            Err(StoreError::InvalidArgument { key, .. }) if key == "past"
        ));
    }
}
