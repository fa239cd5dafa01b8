//! The device share step on one rank over NCCL: the reader's rows go to the share area of
//! pinned staging, one upload to device staging, NCCL broadcasts it on the comm stream
//! (ordered after the upload by an event), the load stream waits for it and scatters into the
//! slots; the device pool must equal a host pool that loaded the same rows.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::NcclCollective;
use kvlink::dedup_broadcast::{share_stage, StageShare};
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{
    BatchShape, DeviceShare, DirectLanding, HostKvPool, KvPool, LayerLanding, RowBlock,
    StagedLanding, StagingPool,
};
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::LayerReady;
use kvlink_rig::glm::{glm, half_bytes, own_all};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::de;

use super::staged_landing::compare_pools;
use super::Args;

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

/// Rank0Broadcast's share area of `layer`: one block per component carried, pages in plan
/// order.
fn blocks(g: &KvGeometry, layer: u32, n: usize) -> Vec<RowBlock> {
    let mut off = 0;
    g.components()
        .iter()
        .filter(|c| c.position(layer).is_some())
        .map(|c| {
            let b = RowBlock {
                component: c.id,
                first_page: 0,
                pages: n,
                offset: off,
            };
            off += n * c.page_layer_bytes as usize;
            b
        })
        .collect()
}

/// The dedup path on one rank: the reader's rows go to the share area of pinned staging, one
/// upload to device staging, NCCL broadcasts it on the comm stream (ordered after the upload
/// by an event), the load stream waits for the broadcast and scatters into the slots; the pool
/// must equal the host reference.
pub fn dedup_path(coll: &NcclCollective, args: &Args) -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    let g = glm(1, 0)?;
    let pages = if args.quick { 48 } else { 128 };
    let n = if args.quick { 16 } else { 48 };
    let slots: Arc<[u32]> = Rng(77).scattered_slots(n, pages)?.into();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let host = Arc::new(HostKvPool::new(g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
    let share_bytes: Vec<usize> = (0..g.num_layers())
        .map(|l| {
            blocks(&g, l, n)
                .iter()
                .map(|b| {
                    b.pages
                        * g.component(b.component)
                            .map_or(0, |c| c.page_layer_bytes as usize)
                })
                .sum()
        })
        .collect();
    let shape = BatchShape {
        own: Vec::new(),
        shared: g.components().iter().map(|c| c.id).collect(),
        share_bytes: share_bytes.clone(),
    };
    let mut staged = StagedLanding::new(
        pool.clone(),
        staging.lease().map_err(de)?,
        slots.clone(),
        shape,
    )
    .map_err(de)?;
    let host_dyn: Arc<dyn KvPool> = host.clone();
    let mut direct = DirectLanding::new(host_dyn, slots.clone(), own_all(&g)).map_err(de)?;
    let (mut ss, mut ds) = (staged.take_stages(), direct.take_stages());
    // A stream of kvlink's handle: the tracked one's first stream would synchronize the
    // whole context, with no bound. SAFETY: a stream for raw kernels and events: no
    // `CudaSlice` is made through it.
    let compute = unsafe { dev.untracked_context() }
        .new_stream()
        .map_err(|e| e.to_string())?;
    for layer in 0..g.num_layers() {
        let (s, d) = (&mut ss[layer as usize % 2], &mut ds[layer as usize % 2]);
        staged.open(s, layer, soon()).map_err(de)?;
        direct.open(d, layer, soon()).map_err(de)?;
        let bl = blocks(&g, layer, n);
        // This check stands in for the store: it fills both stages through their loans.
        let (mut sloan, mut dloan) = (staged.lend(s).map_err(de)?, direct.lend(d).map_err(de)?);
        for b in &bl {
            let len = g
                .component(b.component)
                .map_err(|e| e.to_string())?
                .page_layer_bytes as usize;
            let mut row = vec![0u8; len];
            for page in 0..n {
                fill_row(&mut row, u64::from(b.component.0) + 1, layer, page as u64);
                let t = staged
                    .share_target(&sloan, b.offset + page * len, len)
                    .map_err(de)?;
                let h = direct.target(&dloan, b.component, page).map_err(de)?;
                sloan.write(t, &row).map_err(de)?;
                dloan.write(h, &row).map_err(de)?;
            }
        }
        drop((sloan, dloan));
        staged
            .upload(s, 0..share_bytes[layer as usize])
            .map_err(de)?;
        let bcast = {
            let mut stage = staged.device_stage(s).map_err(de)?;
            share_stage(coll, &mut stage, StageShare::Broadcast { root: 0 }, soon())
                .map_err(|e| e.to_string())?
        };
        staged.scatter(s, &bl, &bcast).map_err(de)?;
        match staged.land(s).map_err(de)? {
            LayerReady::Event(ev) => {
                // SAFETY: `compute` is a live stream of this context, alive past this call.
                let raw =
                    unsafe { kvlink::kv_loader::RawStream::from_raw(compute.cu_stream() as usize) };
                ev.wait_on_stream(raw).map_err(|e| e.to_string())?
            }
            LayerReady::Resident => return Err("Resident from a device landing".into()),
        }
        direct.land(d).map_err(de)?;
    }
    compute.synchronize().map_err(|e| e.to_string())?;
    let t = staged.transfers();
    drop(staged);
    let bytes = compare_pools(&pool, &host)?;
    let h2d: u64 = t.iter().map(|t| t.host_to_device).sum();
    let d2d: u64 = t.iter().map(|t| t.device_to_device).sum();
    Ok(format!(
        "{} layers, {:.0} MB compared; {:.0} MB host→device (one upload per layer), {:.0} MB device→device (scatter)",
        g.num_layers(),
        bytes as f64 / 1e6,
        h2d as f64 / 1e6,
        d2d as f64 / 1e6
    ))
}
