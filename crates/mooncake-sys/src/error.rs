//! Errors of mooncake-sys.

use std::fmt;
use std::path::PathBuf;

use crate::sys;

/// A negative status code returned by Mooncake (its `ErrorCode`) or by the kvlink shim.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub i32);

impl ErrorCode {
    /// `OBJECT_NOT_FOUND` (-704).
    pub const OBJECT_NOT_FOUND: Self = Self(sys::codes::OBJECT_NOT_FOUND);
    /// `NO_AVAILABLE_HANDLE` (-200): no segment has room for the object.
    pub const NO_AVAILABLE_HANDLE: Self = Self(sys::codes::NO_AVAILABLE_HANDLE);
    /// `INVALID_PARAMS` (-600).
    pub const INVALID_PARAMS: Self = Self(sys::codes::INVALID_PARAMS);
    /// `TRANSFER_FAIL` (-800).
    pub const TRANSFER_FAIL: Self = Self(sys::codes::TRANSFER_FAIL);
    /// `RPC_FAIL` (-900).
    pub const RPC_FAIL: Self = Self(sys::codes::RPC_FAIL);
    /// `RPC_TIMEOUT` (-901).
    pub const RPC_TIMEOUT: Self = Self(sys::codes::RPC_TIMEOUT);

    /// The raw value.
    pub fn raw(self) -> i32 {
        self.0
    }

    /// The code's name (`"OBJECT_NOT_FOUND"`), if this crate knows it.
    pub fn name(self) -> Option<&'static str> {
        sys::code_name(self.0)
    }

    /// The broad class of the code, for mapping to higher-level errors.
    pub fn kind(self) -> ErrorKind {
        use sys::codes as c;
        match self.0 {
            c::OBJECT_NOT_FOUND | c::REPLICA_NOT_FOUND | c::REPLICA_IS_GONE => ErrorKind::NotFound,
            c::NO_AVAILABLE_HANDLE
            | c::BUFFER_OVERFLOW
            | c::TENANT_QUOTA_EXCEEDED
            | c::KEYS_ULTRA_LIMIT
            | c::KEYS_EXCEED_BUCKET_LIMIT => ErrorKind::NoSpace,
            c::OBJECT_HAS_LEASE | c::LEASE_EXPIRED => ErrorKind::Lease,
            c::TRANSFER_FAIL | c::CHECKSUM_MISMATCH | c::WRITE_FAIL => ErrorKind::Transfer,
            c::RPC_TIMEOUT => ErrorKind::Timeout,
            c::RPC_FAIL
            | c::SEGMENT_NOT_FOUND
            | c::CLIENT_NOT_FOUND
            | c::UNAVAILABLE_IN_CURRENT_STATUS
            | c::UNAVAILABLE_IN_CURRENT_MODE => ErrorKind::Unavailable,
            c::INVALID_PARAMS
            | c::INVALID_KEY
            | c::INVALID_READ
            | c::INVALID_WRITE
            | c::INVALID_VERSION
            | sys::shim_codes::NULL_ARG
            | sys::shim_codes::INVALID_ARG => ErrorKind::InvalidArgument,
            c::OBJECT_ALREADY_EXISTS => ErrorKind::AlreadyExists,
            // ILLEGAL_CLIENT: the key's put (or copy, move) was started by another client
            // since ours, e.g. a writer that removed and put it again.
            c::REPLICA_IS_NOT_READY | c::OBJECT_REPLICA_BUSY | c::ILLEGAL_CLIENT => ErrorKind::Busy,
            _ => ErrorKind::Other,
        }
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => write!(f, "{name} ({})", self.0),
            None => write!(f, "error code {}", self.0),
        }
    }
}

/// Broad classes of [`ErrorCode`]s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// The object (or its replica) does not exist.
    NotFound,
    /// The store has no room for the object.
    NoSpace,
    /// A lease prevented the operation or ran out during it.
    Lease,
    /// Moving the bytes failed (e.g. the holder of the replica is gone).
    Transfer,
    /// An RPC timed out.
    Timeout,
    /// The master or a segment could not be reached.
    Unavailable,
    /// The arguments were rejected (sizes, keys, null pointers).
    InvalidArgument,
    /// The object already exists.
    AlreadyExists,
    /// The replica is being written or moved.
    Busy,
    /// Anything else (internal errors, exceptions in the shim, ...).
    Other,
}

/// Errors of mooncake-sys.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum MooncakeError {
    /// No candidate library could be loaded and accepted: each attempt names the path or name
    /// tried and why it was not used (the loader's error, or a library that loaded but was
    /// refused: a missing symbol, an ABI mismatch).
    #[error("no usable Mooncake store library; set MOONCAKE_STORE_LIBRARY or build it with scripts/mooncake-build-shim.sh (tried: {})", display_attempts(.attempts))]
    LibraryNotFound {
        /// Each path or name tried, with the loader's error.
        attempts: Vec<(PathBuf, String)>,
    },
    /// The library loaded but lacks a required symbol.
    #[error("{path}: missing symbol {symbol}: {reason}")]
    MissingSymbol {
        /// The library.
        path: PathBuf,
        /// The symbol.
        symbol: String,
        /// The loader's message.
        reason: String,
    },
    /// The shim was built for another ABI or wheel than this crate expects.
    #[error("{path}: ABI mismatch: {detail}")]
    AbiMismatch {
        /// The library.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// The loaded library lacks the kvlink extensions (ranged reads, sessions, upsert).
    #[error("{operation} needs the kvlink shim's extensions, which {path} does not export")]
    Unsupported {
        /// The library.
        path: PathBuf,
        /// The operation.
        operation: &'static str,
    },
    /// A string argument contains a NUL byte.
    #[error("{what} contains a NUL byte: {value:?}")]
    NulInString {
        /// Which argument.
        what: &'static str,
        /// Its value (lossy).
        value: String,
    },
    /// Arguments that cannot be passed (lengths differ, sizes overflow, ...).
    #[error("invalid arguments to {operation}: {detail}")]
    InvalidArguments {
        /// The operation.
        operation: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The allocator could not give a buffer for a call (host memory short): it may pass once
    /// memory is free. (A size no buffer can have is [`InvalidArguments`](Self::InvalidArguments).)
    #[error("{operation}: a buffer of {bytes} bytes cannot be allocated here")]
    OutOfMemory {
        /// The operation.
        operation: &'static str,
        /// The bytes asked for.
        bytes: usize,
    },
    /// `mooncake_store_create` returned NULL.
    #[error("mooncake_store_create failed{}", display_message(.message))]
    CreateFailed {
        /// The shim's last exception message, if any.
        message: Option<String>,
    },
    /// An operation returned a negative status for the whole call.
    #[error("{operation}{} failed: {code}{}", display_key(.key), display_message(.message))]
    Status {
        /// The operation (the C function's short name).
        operation: &'static str,
        /// The key, for single-key operations.
        key: Option<String>,
        /// The status.
        code: ErrorCode,
        /// The shim's last exception message (for shim exception codes).
        message: Option<String>,
    },
}

impl MooncakeError {
    /// The status code, for [`MooncakeError::Status`].
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            Self::Status { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// True when the shim cut the call short: it caught an exception or an allocation
    /// failure thrown inside the wheel's call that moves bytes (`KVLINK_MC_ERR_EXCEPTION`,
    /// `KVLINK_MC_ERR_OUT_OF_MEMORY`). The wheel may have submitted transfers it then never
    /// waited for, so the call's memory must be kept as if the client had given up on them.
    /// One thrown in the shim's own work before or after that call
    /// (`KVLINK_MC_ERR_SHIM_EXCEPTION`, `_SHIM_OUT_OF_MEMORY`) ran no transfer: not cut short.
    ///
    /// ```
    /// use mooncake_sys::{ErrorCode, MooncakeError};
    /// let status = |code| MooncakeError::Status { operation: "get_into", key: None, code: ErrorCode(code), message: None };
    /// assert!(status(-90002).cut_short());
    /// assert!(!status(-90006).cut_short(), "the shim's own, outside the wheel's call");
    /// assert!(!status(-704).cut_short());
    /// ```
    pub fn cut_short(&self) -> bool {
        self.code().is_some_and(|c| {
            matches!(
                c.0,
                crate::sys::shim_codes::EXCEPTION | crate::sys::shim_codes::OUT_OF_MEMORY
            )
        })
    }
}

fn display_attempts(attempts: &[(PathBuf, String)]) -> String {
    attempts
        .iter()
        .map(|(p, e)| format!("{}: {e}", p.display()))
        .collect::<Vec<_>>()
        .join("; ")
}

fn display_key(key: &Option<String>) -> String {
    key.as_ref()
        .map(|k| format!(" of {k:?}"))
        .unwrap_or_default()
}

fn display_message(message: &Option<String>) -> String {
    message
        .as_ref()
        .map(|m| format!(" ({m})"))
        .unwrap_or_default()
}

/// `Result` of mooncake-sys.
pub type Result<T, E = MooncakeError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::{ErrorCode, ErrorKind};
    use crate::sys::codes;

    /// Before, ILLEGAL_CLIENT (another client's put of the key since ours) fell through to
    /// `Other`, an error class that names no cause.
    #[test]
    fn codes_of_a_put_another_client_owns_are_busy() {
        for code in [
            codes::REPLICA_IS_NOT_READY,
            codes::OBJECT_REPLICA_BUSY,
            codes::ILLEGAL_CLIENT,
        ] {
            assert_eq!(
                ErrorCode(code).kind(),
                ErrorKind::Busy,
                "{}",
                ErrorCode(code)
            );
        }
        assert_eq!(ErrorCode(-12345).kind(), ErrorKind::Other);
    }
}
