//! [`RendezvousFormation`]: the [`GroupFormation`] of a group whose ranks are processes. It
//! keeps the rank's [`Rendezvous`] and forms the group there, the first time and after every
//! failure: same meeting point, a new epoch, a new socket mesh (data and control), and, for a
//! group that shares over NCCL, two new communicators from the unique ids rank 0 ships.
//!
//! A re-formation's meeting is bounded by
//! [`reform_timeout`](RendezvousFormation::reform_timeout) (and the caller's deadline); once
//! every rank has met, connecting the handles gets a bound of its own, the shorter of the
//! rendezvous timeout and `reform_timeout` (at least 2 s), which may end past the caller's
//! deadline: the ranks leave the meeting together, and a rank that gave up connecting at its
//! own deadline would fail the formation for every other rank. So a re-formation returns at
//! most about twice `reform_timeout` after it began, or `reform_timeout` and 2.5 s with a
//! bound under 2 s (connecting has a 2 s floor, and a TCP joiner waits up to 0.5 s past its
//! deadline for rank 0's answer); NCCL groups: the meeting, then NCCL's `init_timeout`. While a rank is not back, every batch and lookup that needs
//! the group fails within that time with [`CollectiveError::Formation`] naming the missing
//! ranks, and the first one after the rank is back meets it. A rank process that restarts
//! makes a new `Rendezvous` with the same settings and forms with
//! [`form`](RendezvousFormation::form) (bounded by the rendezvous timeout): it waits there
//! until the others re-form.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::rendezvous::{FormedGroup, NcclIds, Rendezvous, RendezvousError, Transport};
use crate::{Collective, CollectiveError, GroupFormation, GroupHandles};

/// How a formed group's handles move bytes.
#[derive(Debug, Clone, Copy)]
enum Sharing {
    /// Two socket meshes ([`SocketCollective`](super::SocketCollective)): host memory.
    Sockets,
    /// Two NCCL communicators on GPU `ordinal` (device and host memory).
    #[cfg(feature = "nccl")]
    Nccl {
        ordinal: u32,
        config: crate::nccl::NcclConfig,
    },
}

/// What the last formation at the rendezvous announced.
#[derive(Debug, Clone)]
pub struct Meeting {
    /// The group's epoch.
    pub epoch: u64,
    /// Unix sockets or TCP (for the socket meshes).
    pub transport: Transport,
    /// The NCCL unique ids (data, control), when the group shares over NCCL.
    pub nccl: Option<NcclIds>,
    /// Rank 0's attributes (e.g. the address of a store it serves).
    pub attributes: BTreeMap<String, String>,
    /// The IP this rank reached rank 0 at, when it met rank 0 over TCP
    /// ([`FormedGroup::rank0_ip`](crate::FormedGroup::rank0_ip)).
    pub rank0_ip: Option<std::net::IpAddr>,
}

/// Default bound of one re-formation.
pub const DEFAULT_REFORM_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest bound of one re-formation's meeting.
pub const MIN_REFORM_TIMEOUT: Duration = Duration::from_millis(100);

/// The formation of a group of processes at a rendezvous (see the module docs).
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{GroupFormation, MeetingPoint, Rendezvous, RendezvousConfig, RendezvousFormation};
/// // A group of one process: the same calls a rank of 8 makes.
/// let rv = Rendezvous::new(RendezvousConfig::new(0, 1, MeetingPoint::Tcp("127.0.0.1:0".into()))).unwrap();
/// let formation = RendezvousFormation::sockets(rv).reform_timeout(Duration::from_secs(2));
/// let first = formation.form().unwrap();
/// assert_eq!((first.data.rank(), first.epoch), (0, 1));
/// // After a failure (here: an abort), the next formation at the same rendezvous.
/// first.abort("a peer died");
/// let soon = kv_loader::deadline_after(Duration::from_secs(10));
/// let next = formation.reform(0, first.epoch + 1, soon).unwrap();
/// assert!(next.broken().is_none());
/// assert_eq!(next.epoch, 2);
/// ```
pub struct RendezvousFormation {
    rank: u32,
    world: u32,
    rendezvous: Mutex<Rendezvous>,
    sharing: Sharing,
    reform_timeout: Duration,
    /// The rendezvous timeout (its configuration, fixed), read without its lock: a
    /// formation under way holds that lock.
    form_timeout: Duration,
    last: Mutex<Option<Meeting>>,
}

impl std::fmt::Debug for RendezvousFormation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousFormation")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("sharing", &self.sharing)
            .field("reform_timeout", &self.reform_timeout)
            .finish()
    }
}

impl RendezvousFormation {
    fn with(rendezvous: Rendezvous, sharing: Sharing) -> Self {
        let c = rendezvous.config();
        RendezvousFormation {
            rank: c.rank,
            world: c.world,
            reform_timeout: DEFAULT_REFORM_TIMEOUT
                .min(c.timeout)
                .max(MIN_REFORM_TIMEOUT),
            form_timeout: c.timeout,
            rendezvous: Mutex::new(rendezvous),
            sharing,
            last: Mutex::new(None),
        }
    }

    /// Groups whose handles are socket meshes (host memory: CPU engines, host pools).
    pub fn sockets(rendezvous: Rendezvous) -> Self {
        Self::with(rendezvous, Sharing::Sockets)
    }

    /// Groups whose handles are NCCL communicators on GPU `ordinal` (feature `nccl`): the
    /// rendezvous must ask for NCCL ([`RendezvousConfig::nccl`](super::RendezvousConfig::nccl)),
    /// so that rank 0 makes two unique ids per formation. One rank per process, as
    /// [`NcclCollective::join`](crate::nccl::NcclCollective::join) asks (ranks that are
    /// threads of one process use `NcclGroup::formation`).
    #[cfg(feature = "nccl")]
    pub fn nccl(
        rendezvous: Rendezvous,
        ordinal: u32,
        config: crate::nccl::NcclConfig,
    ) -> Result<Self, RendezvousError> {
        if !rendezvous.config().nccl {
            return Err(RendezvousError::Config(
                "an NCCL group needs a rendezvous that asks for NCCL (RendezvousConfig::nccl)"
                    .into(),
            ));
        }
        Ok(Self::with(rendezvous, Sharing::Nccl { ordinal, config }))
    }

    /// Bounds each re-formation (default [`DEFAULT_REFORM_TIMEOUT`]): how long a batch or
    /// lookup waits for a rank that is not back before it fails. Held at most the rendezvous
    /// timeout (a longer one would hold every batch longer than the first formation may take)
    /// and at least [`MIN_REFORM_TIMEOUT`] (a zero bound would fail every re-formation at
    /// once, and the group would never come back), the floor winning over a shorter
    /// rendezvous timeout; the default ([`DEFAULT_REFORM_TIMEOUT`]) is held alike.
    pub fn reform_timeout(mut self, timeout: Duration) -> Self {
        self.reform_timeout = timeout.min(self.form_timeout).max(MIN_REFORM_TIMEOUT);
        self
    }

    /// The bound of each re-formation's meeting, as [`reform_timeout`](Self::reform_timeout)
    /// set it.
    pub fn reform_bound(&self) -> Duration {
        self.reform_timeout
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> u32 {
        self.world
    }

    /// What the last successful formation announced (`None` before the first).
    pub fn last(&self) -> Option<Meeting> {
        self.last.lock().clone()
    }

    /// Forms the group (the first time, or in a restarted process), bounded by the
    /// rendezvous timeout.
    pub fn form(&self) -> Result<GroupHandles, RendezvousError> {
        self.form_meeting().map(|(handles, _)| handles)
    }

    /// [`form`](Self::form), with the meeting these handles came from (what
    /// [`last`](Self::last) says unless another thread formed again since).
    pub fn form_meeting(&self) -> Result<(GroupHandles, Meeting), RendezvousError> {
        // Not the rendezvous's lock: a formation under way on another thread holds it, and
        // waiting for it here before the deadline starts would double the bound.
        self.form_meeting_by(kv_loader::deadline_after(self.form_timeout))
    }

    /// Forms the group by `deadline`: meets every rank, then connects both handles (a
    /// connection that does not come within the rendezvous timeout fails it too).
    pub fn form_by(&self, deadline: Instant) -> Result<GroupHandles, RendezvousError> {
        self.form_meeting_by(deadline).map(|(handles, _)| handles)
    }

    /// [`form_by`](Self::form_by), with the meeting these handles came from.
    fn form_meeting_by(
        &self,
        deadline: Instant,
    ) -> Result<(GroupHandles, Meeting), RendezvousError> {
        let Some(mut rv) = self.rendezvous.try_lock_until(deadline) else {
            return Err(RendezvousError::Timeout {
                missing: Vec::new(),
                detail: format!(
                    "rank {}: another formation of this process was still running",
                    self.rank
                ),
            });
        };
        let formed = rv.form_by(deadline)?;
        let timeout = rv.config().timeout;
        drop(rv);
        let meeting = Meeting {
            epoch: formed.epoch(),
            transport: formed.transport(),
            nccl: formed.nccl_ids().copied(),
            attributes: formed.attributes(),
            rank0_ip: formed.rank0_ip(),
        };
        // The meeting is over on every rank at about the same time: connecting gets its own
        // bound (a rank that gave up just before rank 0's answer never connects).
        let connect_by =
            kv_loader::deadline_after(timeout.min(self.reform_timeout.max(Duration::from_secs(2))))
                .max(deadline);
        let (data, control) = self.connect(formed, connect_by)?;
        tracing::info!(
            rank = self.rank,
            epoch = meeting.epoch,
            "group formed at the rendezvous"
        );
        let epoch = meeting.epoch;
        *self.last.lock() = Some(meeting.clone());
        Ok((
            GroupHandles {
                data,
                control,
                epoch,
            },
            meeting,
        ))
    }

    #[allow(clippy::type_complexity)]
    fn connect(
        &self,
        formed: FormedGroup,
        deadline: Instant,
    ) -> Result<
        (
            std::sync::Arc<dyn Collective>,
            std::sync::Arc<dyn Collective>,
        ),
        RendezvousError,
    > {
        use std::sync::Arc;
        match self.sharing {
            Sharing::Sockets => {
                let mut handles = formed.connect_by(2, deadline)?.into_iter();
                match (handles.next(), handles.next()) {
                    (Some(d), Some(c)) => Ok((Arc::new(d), Arc::new(c))),
                    _ => Err(RendezvousError::Protocol(
                        "fewer handles than asked for".into(),
                    )),
                }
            }
            #[cfg(feature = "nccl")]
            Sharing::Nccl { ordinal, config } => {
                // Both communicators within one `init_timeout`, not each within its own, and
                // not within the meeting's shorter bound: how long NCCL takes to initialise on
                // eight GPUs was not measured here, and a shorter bound could fail healthy
                // formations.
                let by = kv_loader::deadline_after(config.init_timeout);
                let (d, c) = formed.join_nccl(ordinal, config, by)?;
                Ok((Arc::new(d), Arc::new(c)))
            }
        }
    }
}

impl GroupFormation for RendezvousFormation {
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<GroupHandles, CollectiveError> {
        if rank != self.rank {
            return Err(CollectiveError::Backend(format!(
                "rank {rank} asked the formation of rank {}",
                self.rank
            )));
        }
        let by = deadline.min(kv_loader::deadline_after(self.reform_timeout));
        self.form_by(by).map_err(|e| {
            // Debug: the caller has the error (a linker tries again on every batch and lookup
            // while its group is down, and says so in its own lines: the batch's failure, or
            // its loading alone once a minute).
            tracing::debug!(rank, epoch, error = %e, "re-forming the group failed");
            let missing = e.missing_ranks();
            CollectiveError::Formation {
                epoch,
                missing,
                detail: e.to_string(),
                cause: Some(e.into()),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::process::rendezvous::{MeetingPoint, RendezvousConfig};

    /// Before, `form` read the rendezvous timeout under the rendezvous's lock, which a
    /// formation under way holds: a second caller waited that formation out before its own
    /// bound began, twice the timeout in all.
    #[test]
    fn a_second_form_while_one_runs_ends_within_the_timeout() {
        let timeout = Duration::from_millis(1200);
        // Rank 0 of two: rank 1 never comes, so each formation runs its whole bound.
        let rv = Rendezvous::new(
            RendezvousConfig::new(0, 2, MeetingPoint::Tcp("127.0.0.1:0".into())).timeout(timeout),
        )
        .unwrap();
        let formation = RendezvousFormation::sockets(rv);
        let started = Instant::now();
        let (first, second) = std::thread::scope(|s| {
            let a = s.spawn(|| formation.form());
            std::thread::sleep(Duration::from_millis(100));
            let b = s.spawn(|| (formation.form(), started.elapsed()));
            (a.join().unwrap(), b.join().unwrap())
        });
        assert!(
            matches!(first, Err(RendezvousError::Timeout { .. })),
            "{first:?}"
        );
        let (second, took) = second;
        // Either the first still held the rendezvous at the second's deadline, or it let go
        // just before and the second met no one by then: a timeout by its own deadline.
        assert!(
            matches!(&second, Err(RendezvousError::Timeout { .. })),
            "{second:?}"
        );
        // Its own bound began when it was called, 100 ms after the first's (about 1.3 s; waiting
        // the first out before its bound began took 2.4 s): the line sits well between.
        assert!(took < timeout + Duration::from_millis(700), "{took:?}");
    }
}
