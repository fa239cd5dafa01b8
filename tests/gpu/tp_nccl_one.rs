//! NCCL with one rank (the one-GPU machine). The Linker over a one-rank NCCL group (its gate
//! and status words go through NCCL; with one rank there is nothing to share, so every mode
//! reads its own copy), and the device share step that the Linker's shared modes run (upload
//! of the share area, the collective on device staging through `share_stage` over NCCL, the
//! scatter after its event, land) driven on a staged landing for every layer of a GLM-5.2
//! batch, bytes compared.

use std::sync::Arc;

use kvlink::dedup_broadcast::nccl::NcclGroup;
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::StagingPool;
use kvlink::kv_loader::ShareMode;

use super::Args;
use kvlink_rig::glm::{glm, half_bytes};
use kvlink_rig::measure::fmt_bytes;
use kvlink_rig::pattern::Rng;
use kvlink_rig::report::{de, Report};
use kvlink_rig::tp::{compare_pool, share_every_layer, Fabric, RankDev};

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
    let slots = Rng(0xabc).scattered_slots(n, pool_pages)?;
    // This check stands in for the store: the rig fills each stage through its loan.
    let t = share_every_layer(&d, coll, mode, &slots)?;
    // SAFETY: `share_every_layer` landed every layer (waited for): nothing writes the pool.
    let compared = unsafe { compare_pool(&d, &slots, g.num_layers(), &|_| true) }?;
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
