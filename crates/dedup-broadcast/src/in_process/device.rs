//! Device regions: broadcast and in-place all-gather by device-to-device copies on each rank's
//! comm stream, ordered by events.

use std::time::{Duration, Instant};

use kv_device::{DeviceRegion, SharedEvent, Transfer};
use parking_lot::MutexGuard;

use super::round::{round_mut, Arrival, Desc, OpKind, State};
use super::{InProcessCollective, RankDevice};
use crate::CollectiveError;

/// How long past its deadline a rank waits for its peers to enqueue their copies once a round
/// has committed (they do so at once; this only bounds a backend that blocks in an enqueue).
const POST_GRACE: Duration = Duration::from_secs(10);

/// This rank's own failed device call, its error kept as the source.
fn backend(source: kv_device::DeviceError) -> CollectiveError {
    CollectiveError::Device {
        what: "in-process device copy",
        source,
    }
}

impl InProcessCollective {
    fn rank_device(&self, op: &'static str) -> Result<&RankDevice, CollectiveError> {
        self.device.as_ref().ok_or(CollectiveError::Unsupported {
            op,
            detail: "this in-process group moves host memory only (InProcessGroup::new)".into(),
        })
    }

    /// Why `region` cannot be used by this rank, if it cannot.
    fn check_region(&self, dev: &RankDevice, region: &DeviceRegion) -> Option<String> {
        let ordinal = dev.device.ordinal();
        (region.ordinal != ordinal).then(|| {
            format!(
                "region on device {}, but this rank's device is {ordinal}",
                region.ordinal
            )
        })
    }

    /// The committed round's arrivals: every rank's region and `after`.
    fn regions(
        st: &mut State,
        seq: u64,
    ) -> Result<Vec<(DeviceRegion, Option<SharedEvent>)>, CollectiveError> {
        round_mut(st, seq)?
            .arrivals
            .iter()
            .map(|a| match a {
                Some(Arrival::Device { region, after }) => Ok((*region, after.clone())),
                _ => Err(super::round::internal(seq)),
            })
            .collect()
    }

    /// Posts this rank's copy event (or why there is none) for its peers.
    fn post(&self, st: &mut State, seq: u64, ev: Result<SharedEvent, CollectiveError>) {
        if let Ok(round) = round_mut(st, seq) {
            round.posted[self.rank as usize] = Some(ev);
        }
        self.group.cv.notify_all();
    }

    /// Waits until each of `ranks` has posted; their copy events. A rank that could not enqueue
    /// (or a wait that outlasts the grace) breaks the group: copies of others may be in flight.
    fn peers_posted(
        &self,
        st: &mut MutexGuard<'_, State>,
        seq: u64,
        ranks: &[u32],
        deadline: Instant,
    ) -> Result<Vec<SharedEvent>, CollectiveError> {
        let limit = kv_loader::deadline_from(deadline.max(Instant::now()), POST_GRACE);
        loop {
            if let Some(cause) = st.broken.clone() {
                return Err(CollectiveError::Backend(format!(
                    "the group was aborted: {cause}"
                )));
            }
            let round = round_mut(st, seq)?;
            let posted: Option<Vec<&Result<SharedEvent, CollectiveError>>> = ranks
                .iter()
                .map(|&r| round.posted[r as usize].as_ref())
                .collect();
            if let Some(posted) = posted {
                return ranks
                    .iter()
                    .zip(posted)
                    .map(|(r, p)| {
                        p.clone().map_err(|e| {
                            CollectiveError::Backend(format!(
                                "rank {r} could not enqueue its copy: {}",
                                backend_text(&e)
                            ))
                        })
                    })
                    .collect();
            }
            // Checked after the look at `posted`: a post made as the wait timed out (before
            // this rank had the lock again) still counts.
            if Instant::now() >= limit {
                return Err(CollectiveError::Backend(
                    "peers did not enqueue their copies in time".into(),
                ));
            }
            self.group.cv.wait_until(st, limit);
        }
    }

    /// Finishes a device round after its copies: the completion event waits (device-side) for
    /// `own` and every `peer` event. Any failure breaks the group. The stream calls run with the
    /// group's lock let go (a backend may block in one: the peers' `broken`, `abort` and grace
    /// checks must not wait for it); the round stays until this rank leaves it, after them.
    fn complete(
        &self,
        dev: &RankDevice,
        st: &mut MutexGuard<'_, State>,
        seq: u64,
        op: &'static str,
        readers: Result<Vec<SharedEvent>, CollectiveError>,
        own: Option<SharedEvent>,
    ) -> Result<SharedEvent, CollectiveError> {
        let done = readers.and_then(|evs| {
            MutexGuard::unlocked(st, || {
                for ev in evs.iter().chain(own.iter()) {
                    dev.comm.wait(ev).map_err(backend)?;
                }
                dev.comm.record().map_err(backend)
            })
        });
        let result = done.map_err(|e| {
            let cause = format!("{op} #{seq} on rank {}: {}", self.rank, backend_text(&e));
            st.break_group(&cause);
            self.group.cv.notify_all();
            tracing::warn!(rank = self.rank, cause, "device round failed: group broken");
            match e {
                // This rank's own device failure keeps its typed error.
                e @ CollectiveError::Device { .. } => e,
                _ => CollectiveError::Backend(cause),
            }
        });
        st.leave(seq);
        result
    }

    /// [`Collective::broadcast_device`](crate::Collective::broadcast_device).
    ///
    /// # Safety
    /// As the trait method.
    pub(super) unsafe fn device_broadcast(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        root: u32,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let kind = OpKind::BroadcastDevice;
        let dev = self.rank_device(kind.name())?;
        let (g, rank, size) = (&self.group, self.rank, self.group.size);
        let invalid = (root >= size)
            .then(|| format!("root {root} is not a rank of a group of {size}"))
            .or_else(|| self.check_region(dev, &region));
        let desc = Desc {
            kind,
            len: region.len,
            root,
            shape: 0,
        };
        let seq = self.next_seq();
        let arrival = Arrival::Device {
            region,
            after: after.clone(),
        };
        let mut st = g.arrive(rank, seq, desc, invalid, arrival)?;
        g.committed(rank, &mut st, seq, kind.name(), deadline)?;
        let all = Self::regions(&mut st, seq)?;
        if rank != root {
            let (src, src_after) = all[root as usize].clone();
            let copy = MutexGuard::unlocked(&mut st, || -> Result<SharedEvent, CollectiveError> {
                for ev in src_after.iter().chain(after.iter()) {
                    dev.comm.wait(ev).map_err(backend)?;
                }
                let t = Transfer::OnDevice {
                    dst: region.addr,
                    src: src.addr,
                    len: region.len,
                };
                // SAFETY: the root's region is readable from its `after` on (waited above) and
                // stays untouched until the root's completion event, which waits for this
                // copy's event (below); this rank's region is writable from its `after` on
                // (waited above) until the event returned (the caller's promise); lengths
                // matched when the round committed; ranks' regions do not overlap.
                unsafe { dev.comm.transfer(t) }.map_err(backend)?;
                dev.comm.record().map_err(backend)
            });
            self.post(&mut st, seq, copy.clone());
            return self.complete(
                dev,
                &mut st,
                seq,
                kind.name(),
                copy.map(|ev| vec![ev]),
                None,
            );
        }
        let receivers: Vec<u32> = (0..size).filter(|&r| r != root).collect();
        let readers = self.peers_posted(&mut st, seq, &receivers, deadline);
        self.complete(dev, &mut st, seq, kind.name(), readers, after)
    }

    /// [`Collective::all_gather_device`](crate::Collective::all_gather_device).
    ///
    /// # Safety
    /// As the trait method.
    pub(super) unsafe fn device_all_gather(
        &self,
        region: DeviceRegion,
        after: Option<SharedEvent>,
        deadline: Instant,
    ) -> Result<SharedEvent, CollectiveError> {
        let kind = OpKind::AllGatherDevice;
        let dev = self.rank_device(kind.name())?;
        let (g, rank, size) = (&self.group, self.rank, self.group.size);
        let invalid = (!region.len.is_multiple_of(size.max(1) as usize))
            .then(|| format!("{} bytes do not split into {size} chunks", region.len))
            .or_else(|| self.check_region(dev, &region));
        let desc = Desc {
            kind,
            len: region.len,
            root: 0,
            shape: 0,
        };
        let seq = self.next_seq();
        let arrival = Arrival::Device {
            region,
            after: after.clone(),
        };
        let mut st = g.arrive(rank, seq, desc, invalid, arrival)?;
        g.committed(rank, &mut st, seq, kind.name(), deadline)?;
        let all = Self::regions(&mut st, seq)?;
        let chunk = region.len / size.max(1) as usize;
        let copy = MutexGuard::unlocked(&mut st, || -> Result<SharedEvent, CollectiveError> {
            for ev in all.iter().filter_map(|(_, a)| a.as_ref()) {
                dev.comm.wait(ev).map_err(backend)?;
            }
            for (peer, (src, _)) in all.iter().enumerate() {
                if peer == rank as usize || chunk == 0 {
                    continue;
                }
                let at = (peer * chunk) as u64;
                let t = Transfer::OnDevice {
                    dst: region.addr + at,
                    src: src.addr + at,
                    len: chunk,
                };
                // SAFETY: peer `peer`'s chunk `peer` is readable from its `after` on (waited
                // above) and untouched until the peer's completion event, which waits for this
                // rank's copy event; this rank's chunk `peer` is written by this rank only,
                // from its own `after` on (waited above) until the event returned; every
                // region holds `size` chunks of `chunk` bytes (lengths matched).
                unsafe { dev.comm.transfer(t) }.map_err(backend)?;
            }
            dev.comm.record().map_err(backend)
        });
        self.post(&mut st, seq, copy.clone());
        let peers: Vec<u32> = (0..size).filter(|&r| r != rank).collect();
        let readers = copy.and_then(|mine| {
            let mut evs = self.peers_posted(&mut st, seq, &peers, deadline)?;
            evs.push(mine);
            Ok(evs)
        });
        self.complete(dev, &mut st, seq, kind.name(), readers, None)
    }
}

/// `e`'s words, without the `collective backend:` a `Backend` or `Device` error's display
/// starts with (a backend error wrapped in another says it once).
fn backend_text(e: &CollectiveError) -> String {
    match e {
        CollectiveError::Backend(m) => m.clone(),
        CollectiveError::Device { what, source } => format!("{what}: {source}"),
        other => other.to_string(),
    }
}
