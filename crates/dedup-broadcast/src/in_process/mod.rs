//! [`InProcessGroup`]: a TP group whose ranks are threads of one process. Host rows move
//! through shared memory (a receiver copies straight from the owner's row into its own);
//! with [`InProcessGroup::on_devices`], device regions move by device-to-device copies on
//! each rank's comm stream, ordered by events.
//!
//! # How an operation runs
//! Each rank numbers its operations `0, 1, 2, ...` (its sequence number); the operations with
//! the same number form a *round*. A round is decided exactly once, under the group's lock:
//! - **committed** when the last rank arrives with matching arguments: every rank then copies
//!   (or enqueues copies of) what it needs and returns `Ok` (a rows-broadcast receiver may
//!   start copying as soon as the root has arrived, but returns only once the round is
//!   committed);
//! - **failed** when, before that, a rank arrives with a different operation, root, length or
//!   row shape ([`CollectiveError::Mismatch`], [`CollectiveError::SizeMismatch`]) or with
//!   arguments the operation cannot take ([`CollectiveError::InvalidArgument`]), when a waiting
//!   rank's deadline passes ([`CollectiveError::Timeout`], naming the ranks that had not
//!   arrived), or when a rank that has not arrived has dropped its handle
//!   ([`CollectiveError::RankGone`]).
//!
//! So every rank that issues a round gets the same answer. A rank that arrives **late**,
//! after its round failed, gets [`CollectiveError::Aborted`] at once (naming the ranks that
//! were missing, itself among them): it never copies, and its memory is left as it was. Its
//! sequence number still advances, so if the ranks keep issuing operations in order, the late
//! rank's next operation meets the survivors' next operation and the group works again.
//!
//! # Memory
//! Host rows: an owner (the root, or any rank of an all-gather) returns only after every peer
//! has finished copying out of its rows, so the caller may reuse them as soon as the call
//! returns, whatever the outcome. Copies run outside the lock, in parallel.
//!
//! Device regions: once committed, each rank enqueues on its comm stream (after the `after`
//! events of the regions it reads and of its own) the device-to-device copies into its own
//! region, and records a copy event; its completion event then also waits (device-side) for
//! the copy events of every rank that reads its region, so a region is never reused while a
//! peer may still read it. A group can be [aborted](Collective::abort): every handle's later
//! operations fail at once, and the group is [`broken`](Collective::broken) until re-formed
//! ([`GroupFormation`](crate::GroupFormation)).
//!
//! Every wait is bounded: a rank waits for others to arrive until its deadline, and an owner
//! waits for peers of a committed round to copy out of its rows until its deadline plus a
//! grace. Then the round is given up, unless a copy is running: a copy under way is a bounded
//! memory copy, so it is waited for first (when every peer had started its copy, the round
//! still ends committed, every rank `Ok`). A round given up fails every rank that has not
//! returned (peers that had already copied out of a broadcast's root returned `Ok`).

mod device;
mod round;
mod rows;

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kv_device::{Device, DeviceRegion, HostRow, SharedEvent, Stream};

use crate::{Collective, CollectiveError, MemorySupport};
use round::{Arrival, Desc, Group, OpKind};

/// Builds the ranks of an in-process TP group.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{Collective, InProcessGroup};
/// let ranks = InProcessGroup::new(3);
/// let deadline = kv_loader::deadline_after(Duration::from_secs(10));
/// let mins: Vec<u64> = std::thread::scope(|s| {
///     let hs: Vec<_> = ranks
///         .iter()
///         .map(|c| s.spawn(move || c.all_reduce_min_u64(10 + u64::from(c.rank()), deadline)))
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
/// });
/// assert_eq!(mins, vec![10, 10, 10]);
/// ```
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// One handle per rank, rank `r` at index `r`, moving host memory only; move each into
    /// its rank's thread. A size of 0 gives no ranks.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(size: u32) -> Vec<InProcessCollective> {
        Self::build(size, (0..size).map(|_| None).collect())
    }

    /// One handle per device, rank `r` on `devices[r]` (ranks may share one device), moving
    /// host rows and device regions; each rank gets its own comm stream from its device. All
    /// devices must be of one backend (a stream waits only on its own backend's events;
    /// devices of two are refused with [`CollectiveError::Device`]); on distinct GPUs the
    /// copies rely on unified addressing.
    ///
    /// ```
    /// use dedup_broadcast::{Collective, InProcessGroup};
    /// use kv_device::{CpuDevice, Device};
    /// let dev = CpuDevice::new(0).unwrap();
    /// let ranks = InProcessGroup::on_devices(vec![dev.clone(), dev]).unwrap();
    /// assert!(ranks[1].memory().device);
    /// ```
    pub fn on_devices(
        devices: Vec<Arc<dyn Device>>,
    ) -> Result<Vec<InProcessCollective>, CollectiveError> {
        let size = u32::try_from(devices.len())
            .map_err(|_| CollectiveError::Backend("too many ranks".into()))?;
        let ranks = devices
            .into_iter()
            .map(|device| {
                let comm = device
                    .new_stream()
                    .map_err(|source| CollectiveError::Device {
                        what: "comm stream",
                        source,
                    })?;
                Ok(Some(RankDevice { device, comm }))
            })
            .collect::<Result<Vec<_>, CollectiveError>>()?;
        one_backend(&ranks)?;
        Ok(Self::build(size, ranks))
    }

    fn build(size: u32, devices: Vec<Option<RankDevice>>) -> Vec<InProcessCollective> {
        Self::ranks_of(Arc::new(Group::new(size)), devices)
    }

    /// One handle per entry of `devices` on `group` (rank `r` at index `r`).
    fn ranks_of(group: Arc<Group>, devices: Vec<Option<RankDevice>>) -> Vec<InProcessCollective> {
        devices
            .into_iter()
            .enumerate()
            .map(|(rank, device)| InProcessCollective {
                group: group.clone(),
                rank: rank as u32,
                seq: AtomicU64::new(0),
                device,
            })
            .collect()
    }
}

/// A rank's device and its comm stream.
struct RankDevice {
    device: Arc<dyn Device>,
    comm: Arc<dyn Stream>,
}

/// Refuses devices of more than one backend: a rank's comm stream copies from a peer's
/// device address with its own backend, so a CUDA rank and a CPU rank in one group would read
/// one backend's addresses as another's. Checked with the streams themselves: each comm stream
/// must be able to wait on an event of rank 0's (another backend's event is refused).
fn one_backend(ranks: &[Option<RankDevice>]) -> Result<(), CollectiveError> {
    let mut ranks = ranks.iter().flatten();
    let Some(first) = ranks.next() else {
        return Ok(());
    };
    let probe = first
        .comm
        .record()
        .map_err(|source| CollectiveError::Device {
            what: "backend check (rank 0's comm stream)",
            source,
        })?;
    for r in ranks {
        r.comm
            .wait(&probe)
            .map_err(|source| CollectiveError::Device {
                what: "backend check: all ranks' devices must be of one backend",
                source,
            })?;
    }
    Ok(())
}

/// One rank's handle of an [`InProcessGroup`]. Dropping it tells the group this rank is gone:
/// operations waiting for it fail at once with [`CollectiveError::RankGone`].
pub struct InProcessCollective {
    group: Arc<Group>,
    rank: u32,
    seq: AtomicU64,
    device: Option<RankDevice>,
}

impl fmt::Debug for InProcessCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessCollective")
            .field("rank", &self.rank)
            .field("size", &self.group.size)
            .field("next_seq", &self.seq.load(Ordering::Relaxed))
            .field("device", &self.device.as_ref().map(|d| d.device.ordinal()))
            .finish()
    }
}

impl InProcessCollective {
    /// This rank's next sequence number.
    fn next_seq(&self) -> u64 {
        self.seq.fetch_add(1, Ordering::Relaxed)
    }

    /// A host-value round: every rank's `value`, in rank order.
    fn gather_values(
        &self,
        kind: OpKind,
        value: Vec<u8>,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let desc = Desc {
            kind,
            len: value.len(),
            root: 0,
            shape: 0,
        };
        let seq = self.next_seq();
        let g = &self.group;
        let mut st = g.arrive(self.rank, seq, desc, None, Arrival::Value(value))?;
        g.committed(self.rank, &mut st, seq, kind.name(), deadline)?;
        let round = round::round_mut(&mut st, seq)?;
        let values = round
            .arrivals
            .iter()
            .map(|a| match a {
                Some(Arrival::Value(v)) => v.clone(),
                _ => Vec::new(),
            })
            .collect();
        st.leave(seq);
        Ok(values)
    }
}

impl Drop for InProcessCollective {
    fn drop(&mut self) {
        let mut st = self.group.state.lock();
        if let Some(g) = st.gone.get_mut(self.rank as usize) {
            *g = true;
        }
        let seqs: Vec<u64> = st.rounds.keys().copied().collect();
        for seq in seqs {
            st.collect(seq);
        }
        self.group.cv.notify_all();
    }
}

// SAFETY: host rows are copied under the group's lock within the call, a rank's rows only
// until its copies are counted (none after it returns or unwinds); a device round's returned
// event is recorded after this rank's copies and waits on its peers' copy events; and
// `may_leave_work` answers `true` for every error after a round committed (the only rounds
// that enqueue copies).
unsafe impl Collective for InProcessCollective {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.group.size
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        let all = self.gather_values(OpKind::GatherU64, value.to_le_bytes().to_vec(), deadline)?;
        Ok(crate::collective::u64_words(&all))
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.gather_values(OpKind::GatherBytes, value.to_vec(), deadline)
    }

    /// The plain gather: a round's fate is decided once for every rank (all took part, or
    /// it failed on all), so it is settled as it is.
    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        self.all_gather_u64(value, deadline)
    }

    /// The plain gather, settled as it is (see `all_gather_u64_settled`).
    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.all_gather_bytes(value, deadline)
    }

    fn memory(&self) -> MemorySupport {
        MemorySupport {
            host: true,
            device: self.device.is_some(),
        }
    }

    fn device_ordinal(&self) -> Option<u32> {
        self.device.as_ref().map(|d| d.device.ordinal())
    }

    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller's promise (Collective::broadcast_rows) is passed on.
        unsafe { self.rows_broadcast(rows, root, deadline) }
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller's promise (Collective::all_gather_rows) is passed on.
        unsafe { self.rows_all_gather(rows, counts, deadline) }
    }

    unsafe fn broadcast_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        root: u32,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        // SAFETY: the caller's promise (Collective::broadcast_device) is passed on.
        unsafe { self.device_broadcast(region, after, root, deadline) }
    }

    unsafe fn all_gather_device(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        // SAFETY: the caller's promise (Collective::all_gather_device) is passed on.
        unsafe { self.device_all_gather(region, after, deadline) }
    }

    /// Breaks the group for every handle: every later operation fails at once
    /// ([`CollectiveError::Aborted`]) and [`broken`](Collective::broken) says why, until the
    /// group is re-formed. Device groups: copies of a round may still be enqueued (callers must
    /// not reuse memory they cannot fence). Host-only groups finish every operation before it
    /// returns; breaking one is how the ranks resynchronise after their collectives shifted
    /// (every rank re-forms at its next batch, with sequence numbers from 0).
    fn abort(&self, cause: &str) {
        tracing::warn!(rank = self.rank, cause, "in-process group aborted");
        self.group.state.lock().break_group(cause);
        self.group.cv.notify_all();
    }

    fn broken(&self) -> Option<String> {
        self.group.state.lock().broken.clone()
    }

    /// Only a device round that committed can have enqueued copies, and its failures after
    /// the commit are `Backend` or `Device` (a copy or event that failed, peers that did not
    /// post in time). Every failure before the commit (a timeout, a mismatch, a rank gone, an
    /// abort that failed the open round) enqueued nothing.
    fn may_leave_work(&self, error: &CollectiveError) -> bool {
        matches!(
            error,
            CollectiveError::Backend(_) | CollectiveError::Device { .. }
        )
    }
}
