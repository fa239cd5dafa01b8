//! The safe entry points the linker shares a layer through: typed handles in, `unsafe`
//! collective calls inside, byte counters and fences kept on the way out.

use std::time::Instant;

use kv_device::{DeviceStage, HostRows, SharedEvent};

use crate::{Collective, CollectiveError};

/// How a layer's host rows are shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowsShare<'a> {
    /// Root's rows are copied into every other rank's rows.
    Broadcast {
        /// The rank that holds the rows.
        root: u32,
    },
    /// Rank `r` owns `counts[r]` consecutive rows (in rank order); every rank gets every
    /// owner's rows.
    AllGather {
        /// Rows per rank; they sum to the rows.
        counts: &'a [usize],
    },
}

/// How a layer's device share area is shared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StageShare {
    /// Root's region is copied into every other rank's region.
    Broadcast {
        /// The rank that holds the bytes.
        root: u32,
    },
    /// The region is `size()` equal chunks; rank `r` holds chunk `r`; in place.
    AllGather,
}

/// Shares `rows` (pool slots of one layer, lent by a landing) among the group, and counts what
/// moved. Completes before it returns.
///
/// ```
/// # // The host path of one rank: nothing moves, the call still completes.
/// use std::sync::Arc;
/// use std::time::{Duration, Instant};
/// use dedup_broadcast::{share_rows, InProcessGroup, RowsShare};
/// use kv_device::{BatchShape, DirectLanding, HostKvPool, HostShare, LayerLanding};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// use kv_device::RowBlock;
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool = Arc::new(HostKvPool::new(g, 4).unwrap());
/// let shape = BatchShape { own: vec![], shared: vec![ComponentId(0)], share_bytes: vec![] };
/// let mut landing = DirectLanding::new(pool, vec![2, 3].into(), shape).unwrap();
/// let mut stages = landing.take_stages();
/// let soon = kv_loader::deadline_after(Duration::from_secs(5));
/// landing.open(&mut stages[0], 0, soon).unwrap();
/// let block = RowBlock { component: ComponentId(0), first_page: 0, pages: 2, offset: 0 };
/// let mut rows = landing.rows(&mut stages[0], &[block]).unwrap();
/// let ranks = InProcessGroup::new(1);
/// share_rows(&ranks[0], &mut rows, RowsShare::Broadcast { root: 0 }, soon).unwrap();
/// ```
pub fn share_rows(
    coll: &dyn Collective,
    rows: &mut HostRows<'_>,
    how: RowsShare<'_>,
    deadline: Instant,
) -> Result<(), CollectiveError> {
    let total = rows.bytes();
    // SAFETY: `HostRows` vouches that its rows are host memory valid for reads and writes,
    // non-overlapping, and touched by nothing else while it is borrowed (here, for the whole
    // call); rows of different ranks are different ranks' pool slots.
    let (received, sent) = unsafe {
        match how {
            RowsShare::Broadcast { root } => {
                coll.broadcast_rows(rows.rows(), root, deadline)?;
                if coll.rank() == root {
                    (0, total)
                } else {
                    (total, 0)
                }
            }
            RowsShare::AllGather { counts } => {
                coll.all_gather_rows(rows.rows(), counts, deadline)?;
                let first: usize = counts.iter().take(coll.rank() as usize).sum();
                let mine = counts.get(coll.rank() as usize).copied().unwrap_or(0);
                let own: u64 = rows
                    .rows()
                    .iter()
                    .skip(first)
                    .take(mine)
                    .map(|r| r.len as u64)
                    .sum();
                (total - own, own)
            }
        }
    };
    rows.count_collective(received, sent);
    Ok(())
}

/// Enqueues the share of `stage` (one layer's device share area) among the group, after the
/// stage's upload, and returns the collective's completion event. The event is pushed onto the
/// stage's fences before this returns, so the stage is not reused while the collective
/// may still write it. On an error that may have left work in flight
/// ([`Collective::may_leave_work`]: by default, from a group that is now
/// [broken](Collective::broken)), the stage is poisoned (no event tells that work's end). A group broken
/// before the call issues nothing: the share fails [`Aborted`](CollectiveError::Aborted) at
/// once and the stage is left as it was (its staging is reused, not quarantined for good).
pub fn share_stage(
    coll: &dyn Collective,
    stage: &mut DeviceStage<'_>,
    how: StageShare,
    deadline: Instant,
) -> Result<SharedEvent, CollectiveError> {
    if let Some(why) = coll.broken() {
        return Err(CollectiveError::Aborted {
            op: "share_stage",
            seq: 0,
            missing: Vec::new(),
            cause: format!("the group was broken before this share (nothing issued): {why}"),
        });
    }
    let region = stage.region();
    let after = stage.after();
    // SAFETY: `DeviceStage` vouches that its region is device memory valid for reads and
    // writes until every fence of the half completes, never reused before, and touched by
    // nothing else from `after` on while it is borrowed; the collective's completion event is
    // pushed as a fence below, before the borrow ends, and a failure that may leave work
    // behind poisons the half (never reused nor freed).
    let r = unsafe {
        match how {
            StageShare::Broadcast { root } => coll.broadcast_device(region, after, root, deadline),
            StageShare::AllGather => coll.all_gather_device(region, after, deadline),
        }
    };
    let ev = match r {
        Ok(ev) => ev,
        Err(e) => {
            if coll.may_leave_work(&e) {
                stage.poison();
            }
            return Err(e);
        }
    };
    stage.fence(ev.clone());
    let len = region.len as u64;
    let (received, sent) = match how {
        StageShare::Broadcast { root } if coll.rank() == root => (0, len),
        StageShare::Broadcast { .. } => (len, 0),
        StageShare::AllGather => {
            let chunk = len / u64::from(coll.size().max(1));
            (len - chunk, chunk)
        }
    };
    stage.count_collective(received, sent);
    Ok(ev)
}
