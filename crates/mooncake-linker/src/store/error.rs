//! Store errors: one per key, typed, with the key.

use kv_loader::StoreFailure;

/// A failed store operation on one key (or on the whole store).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The object is not in the store.
    #[error("`{key}`: not found")]
    NotFound {
        /// The key.
        key: String,
    },
    /// The store has no room for the object.
    #[error("`{key}`: no space ({detail})")]
    NoSpace {
        /// The key.
        key: String,
        /// The store's words.
        detail: String,
    },
    /// Moving the bytes failed.
    #[error("`{key}`: transfer failed (code {code})")]
    TransferFailed {
        /// The key.
        key: String,
        /// The store's code.
        code: i64,
    },
    /// A lease could not be taken or ran out.
    #[error("`{key}`: lease: {detail}")]
    Lease {
        /// The key.
        key: String,
        /// The store's words.
        detail: String,
    },
    /// An RPC timed out.
    #[error("`{key}`: RPC timeout")]
    RpcTimeout {
        /// The key.
        key: String,
    },
    /// The store refused an argument (bad range, buffer not registered, …).
    #[error("`{key}`: invalid argument: {detail}")]
    InvalidArgument {
        /// The key.
        key: String,
        /// What was wrong.
        detail: String,
    },
    /// The store cannot be reached.
    #[error("store unavailable: {detail}")]
    Unavailable {
        /// What happened, with the typed error behind it where there is one (a connection's
        /// `std::io::Error`, the Mooncake client's error): `detail.downcast_ref::<T>()`.
        #[source]
        detail: kv_loader::Cause,
    },
    /// Fewer bytes than asked for came back.
    #[error("`{key}`: short read: {got} of {expected} bytes")]
    ShortRead {
        /// The key.
        key: String,
        /// Bytes asked for.
        expected: u64,
        /// Bytes that came.
        got: u64,
    },
    /// The store answered a batched call with a different number of results than keys, so
    /// no result can be matched to its key (see [`checked_results`](super::checked_results)).
    #[error("`{key}`: the store gave {got} results for {expected} keys")]
    ResultCount {
        /// The key.
        key: String,
        /// Keys asked about.
        expected: usize,
        /// Results that came back.
        got: usize,
    },
    /// The call did not return by its deadline. It may still be running: the memory it reads
    /// or writes is kept (not freed, not reused) until it returns.
    #[error("`{key}`: {call} did not return within {waited:?}")]
    Overdue {
        /// The key.
        key: String,
        /// The store call.
        call: &'static str,
        /// How long it was waited for.
        waited: std::time::Duration,
    },
    /// The read was refused before it reached the store: its typed targets cannot be written
    /// (two share bytes, or one's loan is not the call's). Nothing was written.
    #[error("`{key}`: refused targets: {reason}")]
    InvalidTarget {
        /// The key.
        key: String,
        /// What was wrong.
        reason: &'static str,
    },
    /// The store call panicked (a defect in the store or the client library under it, not a
    /// condition of the object). It is over: the memory it read or wrote is free again.
    #[error("`{key}`: {call} panicked")]
    Panicked {
        /// The key.
        key: String,
        /// The store call.
        call: &'static str,
    },
    /// The store gave up on the key's transfer while it may still be running (Mooncake's
    /// client stops waiting for its transfers after 60 s and returns, leaving them in
    /// flight): the memory the call read or wrote may still be read or written, so it is kept
    /// for good (never freed, never reused), as for a call that never returns.
    #[error("`{key}`: {call} gave up on a transfer that may still run ({detail})")]
    Abandoned {
        /// The key.
        key: String,
        /// The store call.
        call: &'static str,
        /// What the store said.
        detail: String,
    },
    /// Any other code of the store.
    #[error("`{key}`: store error code {code}")]
    Other {
        /// The key.
        key: String,
        /// The store's code.
        code: i64,
    },
}

impl StoreError {
    /// The same error, naming `key` (an error made for several keys at once, or for a
    /// stand-in such as the store's bounce buffer, told about each key it failed).
    /// [`Unavailable`](StoreError::Unavailable) names no key and stays as it is.
    pub(crate) fn for_key(mut self, key: &str) -> StoreError {
        match &mut self {
            StoreError::NotFound { key: k }
            | StoreError::NoSpace { key: k, .. }
            | StoreError::TransferFailed { key: k, .. }
            | StoreError::Lease { key: k, .. }
            | StoreError::RpcTimeout { key: k }
            | StoreError::InvalidArgument { key: k, .. }
            | StoreError::ShortRead { key: k, .. }
            | StoreError::ResultCount { key: k, .. }
            | StoreError::Overdue { key: k, .. }
            | StoreError::InvalidTarget { key: k, .. }
            | StoreError::Panicked { key: k, .. }
            | StoreError::Abandoned { key: k, .. }
            | StoreError::Other { key: k, .. } => *k = key.to_owned(),
            StoreError::Unavailable { .. } => {}
        }
        self
    }

    /// True when the call may still use the key's memory although it returned
    /// ([`Abandoned`](StoreError::Abandoned)): its memory must be kept for good.
    pub fn may_still_transfer(&self) -> bool {
        matches!(self, StoreError::Abandoned { .. })
    }

    /// The kind, as the loader's errors carry it.
    pub fn failure(&self) -> StoreFailure {
        match self {
            StoreError::NotFound { .. } => StoreFailure::NotFound,
            StoreError::NoSpace { .. } => StoreFailure::NoSpace,
            StoreError::TransferFailed { .. } | StoreError::Abandoned { .. } => {
                StoreFailure::TransferFailed
            }
            StoreError::Lease { .. } => StoreFailure::Lease,
            StoreError::RpcTimeout { .. } | StoreError::Overdue { .. } => StoreFailure::RpcTimeout,
            StoreError::InvalidArgument { .. } | StoreError::InvalidTarget { .. } => {
                StoreFailure::InvalidArgument
            }
            StoreError::Unavailable { .. } => StoreFailure::Unavailable,
            StoreError::ShortRead { .. } => StoreFailure::ShortRead,
            StoreError::ResultCount { .. }
            | StoreError::Panicked { .. }
            | StoreError::Other { .. } => StoreFailure::Other,
        }
    }
}
