//! The device share step the Linker's shared modes run, driven by hand on one rank: every
//! layer of a GLM-5.2 batch through a staged landing, with the collective of the caller's
//! choosing (a one-rank NCCL group on the one-GPU machine, a rank process's NCCL handle).

use std::time::Duration;

use dedup_broadcast::{share_stage, Collective, StageShare, StagingLayout};
use kv_device::{BatchShape, DeviceShare, LayerLanding, StagedLanding};
use kv_loader::{ShareMode, TransferBytes};

use super::RankDev;
use crate::glm::tag;
use crate::pattern::fill_row;
use crate::report::de;

fn soon() -> std::time::Instant {
    kv_loader::deadline_after(Duration::from_secs(30))
}

/// Every layer of a batch of `slots.len()` pages of rank `d`'s geometry, through a staged
/// landing over `d`'s pool and staging: this rank's share written into pinned staging through
/// the stage's loan (standing in for the store), uploaded, shared with `share_stage` on
/// `coll` in `mode`, scattered into the pool after the collective's event, landed, and the
/// event waited for (bounded). Returns the landing's transfer counters; the caller compares
/// the pool.
///
/// One rank only: the layout is built for a group of one and this rank writes every share
/// itself, so with more ranks the pool would hold the right bytes whatever the collective
/// moved (a `Rank0Broadcast` that moved nothing would pass). A collective of more ranks, or a
/// geometry of another TP size, is refused.
pub fn share_every_layer(
    d: &RankDev,
    coll: &dyn Collective,
    mode: ShareMode,
    slots: &[u32],
) -> Result<Vec<TransferBytes>, String> {
    if coll.size() != 1 || d.g.tp_size() != 1 {
        return Err(format!(
            "share_every_layer drives one rank: a collective of {} ranks and a geometry at TP {} \
             would let the pool pass whatever the collective moved",
            coll.size(),
            d.g.tp_size()
        ));
    }
    let g = &d.g;
    let n = slots.len();
    let layouts: Vec<StagingLayout> = (0..g.num_layers())
        .map(|l| StagingLayout::new(mode, l, g.components(), n, 1))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let shape = BatchShape {
        own: Vec::new(),
        shared: g.components().iter().map(|c| c.id).collect(),
        share_bytes: layouts.iter().map(StagingLayout::len).collect(),
    };
    let mut landing = StagedLanding::new(
        d.pool.clone(),
        d.staging.lease().map_err(de)?,
        slots.to_vec().into(),
        shape,
    )
    .map_err(de)?;
    let mut stages = landing.take_stages();
    let how = match mode {
        ShareMode::SplitAllGather => StageShare::AllGather,
        _ => StageShare::Broadcast { root: 0 },
    };
    let mut row = Vec::new();
    for (layer, layout) in (0..).zip(&layouts) {
        let s = &mut stages[layer as usize % 2];
        landing.open(s, layer, soon()).map_err(de)?;
        let mut loan = landing.lend(s).map_err(de)?;
        for r in layout.rows(layout.share(0)) {
            let c = g.component(r.component).map_err(|e| e.to_string())?;
            row.resize(r.len, 0);
            fill_row(&mut row, tag(c), layer, r.plan_page as u64);
            let at = landing.share_target(&loan, r.offset, r.len).map_err(de)?;
            loan.write(at, &row).map_err(de)?;
        }
        drop(loan);
        landing.upload(s, layout.chunk(0)).map_err(de)?;
        let ev = {
            let mut stage = landing.device_stage(s).map_err(de)?;
            share_stage(coll, &mut stage, how, soon()).map_err(|e| e.to_string())?
        };
        landing.scatter(s, &layout.blocks(), &ev).map_err(de)?;
        landing.land(s).map_err(de)?;
        if !ev.wait_until(soon()).map_err(de)? {
            return Err(format!("layer {layer}: the collective did not complete"));
        }
    }
    Ok(landing.transfers())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use dedup_broadcast::InProcessGroup;
    use kv_device::{CpuDevice, DeviceKvPool, StagingPool};
    use kv_loader::ShareMode;

    use super::share_every_layer;
    use crate::glm::{glm, half_bytes};
    use crate::tp::RankDev;

    fn cpu_rank(tp: u32) -> RankDev {
        let dev = CpuDevice::new(0).unwrap();
        let g = glm(tp, 0).unwrap();
        RankDev {
            rank: 0,
            pool: Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 4).unwrap()),
            staging: StagingPool::new(dev.clone(), half_bytes(&g, 2), 1).unwrap(),
            dev,
            g,
        }
    }

    /// Before, any collective was taken: with more ranks each wrote every share itself, and
    /// the pool passed its comparison whatever the collective moved.
    #[test]
    fn more_than_one_rank_is_refused() {
        let two = InProcessGroup::new(2);
        let e = share_every_layer(&cpu_rank(1), &two[0], ShareMode::Rank0Broadcast, &[0, 1])
            .unwrap_err();
        assert!(e.contains("a collective of 2 ranks"), "{e}");
        let one = InProcessGroup::new(1);
        let e = share_every_layer(&cpu_rank(2), &one[0], ShareMode::SplitAllGather, &[0, 1])
            .unwrap_err();
        assert!(e.contains("at TP 2"), "{e}");
    }
}
