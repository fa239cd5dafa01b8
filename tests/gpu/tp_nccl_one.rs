//! NCCL with one rank (the one-GPU machine). The Linker over a one-rank NCCL group (its gate
//! and status words go through NCCL; with one rank there is nothing to share, so every mode
//! reads its own copy), and the device share step that the Linker's shared modes run (upload
//! of the share area, the collective on device staging through `share_stage` over NCCL, the
//! scatter after its event, land) driven on a staged landing for every layer of a GLM-5.2
//! batch, bytes compared.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::NcclGroup;
use kvlink::dedup_broadcast::{share_stage, StageShare, StagingLayout};
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{BatchShape, DeviceShare, LayerLanding, StagedLanding, StagingPool};
use kvlink::kv_loader::ShareMode;

use super::Args;
use kvlink_rig::glm::{glm, half_bytes, tag};
use kvlink_rig::measure::fmt_bytes;
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::{de, Report};
use kvlink_rig::tp::{compare_pool, Fabric, RankDev};

const SEC: &str = "nccl-1";

pub fn run(args: &Args, report: &mut Report) {
    super::tp_dedup::run(args, Fabric::Nccl { tp: 1 }, report);
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        report.check(
            SEC,
            &format!("NCCL 1 rank: the {mode:?} share step on a staged landing (upload → share_stage → scatter → land), every layer"),
            || share_step(args, mode),
        );
    }
}

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

fn share_step(args: &Args, mode: ShareMode) -> Result<String, String> {
    let ranks = NcclGroup::new_in_process(&[0]).map_err(|e| e.to_string())?;
    let coll = &ranks[0];
    let n = if args.quick { 32 } else { 128 };
    let pool_pages = 2 * n as u32 + 8;
    let g = glm(1, 0)?;
    let dev = CudaDevice::new(0).map_err(de)?;
    let d = RankDev {
        rank: 0,
        pool: Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?),
        staging: StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?,
        dev: dev.clone(),
        g: g.clone(),
    };
    let slots = Rng(0xabc).scattered_slots(n, pool_pages);
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
        slots.clone().into(),
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
        // This check stands in for the store: it fills the stage through its loan.
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
            return Err(format!(
                "layer {layer}: the NCCL collective did not complete"
            ));
        }
    }
    let t = landing.transfers();
    drop(landing);
    let compared = compare_pool(&d, &slots, g.num_layers(), &|_| true)?;
    let h2d: u64 = t.iter().map(|t| t.host_to_device).sum();
    let sent: u64 = t.iter().map(|t| t.collective_sent).sum();
    let whole = g.bytes_per_page() * n as u64;
    if h2d != whole || sent != whole {
        return Err(format!(
            "counters: {} host→device and {} sent, one copy is {}",
            fmt_bytes(h2d),
            fmt_bytes(sent),
            fmt_bytes(whole)
        ));
    }
    Ok(format!(
        "{} layers × {n} pages; {} compared; {} host→device (one upload per layer), {} through NCCL",
        g.num_layers(),
        fmt_bytes(compared),
        fmt_bytes(h2d),
        fmt_bytes(sent)
    ))
}
