//! Why a rank could not form or join a group.

use std::sync::Arc;

/// Why a rendezvous did not produce a group.
///
/// The refusals (`WorldSizeMismatch`, `DuplicateRank`, `GeometryMismatch`,
/// `VersionMismatch`, `SettingsMismatch`) are decided by rank 0 and sent to every rank that
/// joined the formation, so each of them gets the same error; nothing of a batch has been
/// read or moved by then.
///
/// Non-exhaustive: new ways a formation fails may come; keep a `_` arm (or ask
/// [`is_refusal`](Self::is_refusal)).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// The configuration cannot work (rank out of range, an unparsable address or variable).
    #[error("rendezvous configuration: {0}")]
    Config(String),
    /// A rank gave another world size than rank 0.
    #[error("rank {rank} says the group has {got} ranks, rank 0 says {expected}")]
    WorldSizeMismatch {
        /// The rank that differs.
        rank: u32,
        /// Rank 0's world size.
        expected: u32,
        /// The rank's.
        got: u32,
    },
    /// Two processes joined as the same rank (or, over a key-value exchange, a process other
    /// than rank 0 joined as 0). Over TCP only the earlier claim hears it: rank 0 takes the
    /// newest hello of a rank (a crashed host's claim never reads as gone); a joiner's claim of
    /// rank 0 is refused alone there, as `SettingsMismatch`.
    #[error("rank {rank} joined the group twice")]
    DuplicateRank {
        /// The rank claimed twice.
        rank: u32,
    },
    /// A rank runs another KV geometry (model, page size, components or TP size).
    #[error("rank {rank} runs geometry {got}, rank 0 runs {expected}")]
    GeometryMismatch {
        /// The rank that differs.
        rank: u32,
        /// Rank 0's geometry fingerprint (hex).
        expected: String,
        /// The rank's.
        got: String,
    },
    /// A rank runs another kvlink version (or rendezvous protocol).
    #[error("rank {rank} runs kvlink {got}, rank 0 runs {expected}")]
    VersionMismatch {
        /// The rank that differs.
        rank: u32,
        /// Rank 0's version.
        expected: String,
        /// The rank's.
        got: String,
    },
    /// A rank asks for other group settings than rank 0 (NCCL or not, a transport).
    #[error("rank {rank}: {what} is {got}, rank 0 has {expected}")]
    SettingsMismatch {
        /// The rank that differs.
        rank: u32,
        /// Which setting.
        what: String,
        /// Rank 0's value.
        expected: String,
        /// The rank's.
        got: String,
    },
    /// The deadline passed before every rank had joined (`missing`: the ranks not heard
    /// from; for a rank other than 0, `[0]` when rank 0 never answered).
    #[error("rendezvous timed out waiting for ranks {missing:?}: {detail}")]
    Timeout {
        /// Ranks that had not joined.
        missing: Vec<u32>,
        /// What was going on.
        detail: String,
    },
    /// Rank 0 holds a live group in which this rank is a member: another process joined as
    /// this rank, or the group has not re-formed since this rank's process restarted (the
    /// others re-form when their next operation finds the old group broken).
    #[error("rank {rank} is a member of the live group of epoch {epoch}; it re-forms only once the others find that group broken")]
    Occupied {
        /// This rank.
        rank: u32,
        /// The live group's epoch.
        epoch: u64,
    },
    /// Two hellos for one rank in one epoch of a key-value exchange: a process of that rank
    /// that ended without withdrawing its claim (a crash, a kill) and its restart, or two
    /// processes run as that rank. The exchange cannot tell a dead claim from a live one, so
    /// this is not a refusal: the next epoch starts without the dead claim (and forms), while
    /// two live processes meet again there (and it repeats, logged by rank 0 each time).
    #[error("rank {rank} was claimed twice in epoch {epoch}: a process of that rank that ended without withdrawing its claim, or two processes run as rank {rank} (then this repeats)")]
    ClaimedTwice {
        /// The rank claimed twice.
        rank: u32,
        /// The epoch.
        epoch: u64,
    },
    /// Rank 0's own rendezvous address is a name that did not resolve within the bound (a
    /// resolver down, a record not yet published): it may resolve on a later attempt, so this
    /// is not a refusal. An address that is not `host:port` is [`Config`](Self::Config).
    #[error("rank 0's rendezvous address did not resolve: {0}")]
    Unresolved(String),
    /// A socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// A socket operation with rank `rank` failed once the ranks had met (connecting to it,
    /// greeting it, waiting for its answer): it went away, or cannot be reached from here.
    /// The formation fails naming it.
    #[error("{context} (rank {rank}): {source}")]
    Peer {
        /// The other rank.
        rank: u32,
        /// What was being done.
        context: String,
        /// The OS error.
        #[source]
        source: Arc<std::io::Error>,
    },
    /// The ranks met and connected, but the settled gather that confirms the connections on
    /// every rank failed (a rank that failed to reach another dropped its connections): the
    /// collective's error, whose gone or missing ranks [`missing_ranks`](Self::missing_ranks)
    /// gives.
    #[error("confirming the group's connections on every rank: {source}")]
    Unconfirmed {
        /// The settled gather's error.
        #[source]
        source: crate::CollectiveError,
    },
    /// A message from another rank did not decode.
    #[error("rendezvous message: {0}")]
    Protocol(String),
    /// Rank 0 could not create the NCCL unique ids the group asked for (every rank reports
    /// this, naming rank 0: the cause is on rank 0's host, such as its NCCL library). A build
    /// of rank 0 without NCCL is a [`Config`](Self::Config) refusal instead.
    #[error("rank 0 could not make the group's NCCL unique ids: {0}")]
    Nccl(String),
    /// This rank could not join the formed group's NCCL communicators
    /// ([`FormedGroup::join_nccl`](super::FormedGroup::join_nccl)): the collective's error
    /// (an init timeout, a device error), kept as the source. (NCCL's init names no missing
    /// rank: [`missing_ranks`](Self::missing_ranks) passes on what the error names.)
    #[error("joining the group's NCCL communicators: {source}")]
    NcclJoin {
        /// The communicator's start error.
        #[source]
        source: crate::CollectiveError,
    },
    /// The engine's key-value exchange failed.
    #[error("key-value exchange: {0}")]
    Exchange(#[from] super::ExchangeError),
}

impl RendezvousError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        RendezvousError::Io {
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// A failed socket operation with rank `rank` ([`Peer`](Self::Peer)).
    pub(crate) fn peer(rank: u32, context: impl Into<String>, source: std::io::Error) -> Self {
        RendezvousError::Peer {
            rank,
            context: context.into(),
            source: Arc::new(source),
        }
    }

    /// The ranks this error says did not come (a timeout's missing ranks) or went away after
    /// the meeting (a [`Peer`](Self::Peer) failure); empty for any other error.
    pub fn missing_ranks(&self) -> Vec<u32> {
        match self {
            RendezvousError::Timeout { missing, .. } => missing.clone(),
            RendezvousError::Peer { rank, .. } => vec![*rank],
            RendezvousError::Unconfirmed { source } | RendezvousError::NcclJoin { source } => {
                match source {
                    crate::CollectiveError::Timeout { missing, .. }
                    | crate::CollectiveError::Aborted { missing, .. } => missing.clone(),
                    crate::CollectiveError::RankGone { gone, .. } => gone.clone(),
                    _ => Vec::new(),
                }
            }
            _ => Vec::new(),
        }
    }

    /// True for the refusals rank 0 sends every rank, and for a configuration that cannot
    /// work (`Config`: an address that is not `host:port`, a transport rank 0 cannot open):
    /// the group cannot form as configured, and trying again without changing a rank's
    /// settings fails the same way. A name that does not resolve yet is not one.
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            RendezvousError::Config(_)
                | RendezvousError::WorldSizeMismatch { .. }
                | RendezvousError::DuplicateRank { .. }
                | RendezvousError::GeometryMismatch { .. }
                | RendezvousError::VersionMismatch { .. }
                | RendezvousError::SettingsMismatch { .. }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::RendezvousError;

    /// What trying again cannot cure is a refusal; what may pass later is not.
    #[test]
    fn refusals_are_what_retrying_cannot_cure() {
        let refused = [
            RendezvousError::Config("rank 0 cannot open a Unix socket".into()),
            RendezvousError::DuplicateRank { rank: 1 },
            RendezvousError::WorldSizeMismatch {
                rank: 2,
                expected: 4,
                got: 8,
            },
        ];
        assert!(refused.iter().all(RendezvousError::is_refusal));
        let passing = [
            RendezvousError::Timeout {
                missing: vec![3],
                detail: "rank 3 not back".into(),
            },
            RendezvousError::Occupied { rank: 1, epoch: 4 },
            RendezvousError::ClaimedTwice { rank: 1, epoch: 4 },
            RendezvousError::Protocol("a torn message".into()),
            RendezvousError::Unresolved("rank0.example: resolver down".into()),
        ];
        assert!(!passing.iter().any(RendezvousError::is_refusal));
    }

    /// A failed NCCL join keeps the collective's error (it was flattened to text), and
    /// passes on the ranks it names.
    #[test]
    fn a_failed_nccl_join_keeps_its_error_and_names_the_missing_ranks() {
        let late = crate::CollectiveError::Timeout {
            op: "init",
            seq: 0,
            missing: vec![1, 3],
        };
        let e = RendezvousError::NcclJoin {
            source: late.clone(),
        };
        assert_eq!(e.missing_ranks(), vec![1, 3]);
        let source =
            std::error::Error::source(&e).and_then(|s| s.downcast_ref::<crate::CollectiveError>());
        assert_eq!(source, Some(&late));
        assert!(!e.is_refusal());
    }

    /// A connect whose confirming gather failed keeps the collective's error, and names the
    /// ranks it found gone (they reach the linker's `GroupDown { missing, .. }`). Before, the
    /// error was wrapped as I/O: no ranks, and a chain that skipped the collective's error.
    #[test]
    fn an_unconfirmed_connect_names_the_ranks_gone() {
        let gone = crate::CollectiveError::RankGone {
            op: "all_gather_u64",
            seq: 0,
            gone: vec![2],
        };
        let e = RendezvousError::Unconfirmed {
            source: gone.clone(),
        };
        assert_eq!(e.missing_ranks(), vec![2]);
        let source =
            std::error::Error::source(&e).and_then(|s| s.downcast_ref::<crate::CollectiveError>());
        assert_eq!(source, Some(&gone));
        assert!(!e.is_refusal());
    }
}
