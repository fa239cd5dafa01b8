//! One rank's GPU: its device, device pool and pinned staging; the host's and the GPU's free
//! memory.

use std::sync::Arc;

use kv_device::cuda::cudarc::driver::result;
use kv_device::cuda::{CudaDevice, CudaKvPool};
use kv_device::{CpuDevice, Device, StagingPool};
use kv_geometry::KvGeometry;

use super::Fabric;
use crate::glm::{glm, half_bytes};
use crate::ranks::{all_ok, on_ranks};
use crate::report::de;

/// One rank's GPU (its own load stream, even when ranks share a GPU): its device pool and
/// pinned staging, and the geometry of its rank.
pub struct RankDev {
    /// The rank.
    pub rank: u32,
    /// Its device (own load stream).
    pub dev: Arc<dyn Device>,
    /// GLM-5.2 at this rank of the TP size.
    pub g: KvGeometry,
    /// Its device pool.
    pub pool: Arc<CudaKvPool>,
    /// Its pinned staging (two buffers).
    pub staging: Arc<StagingPool>,
}

/// A device of its own for one rank on GPU `ordinal` (its own load stream; ranks on one GPU
/// share its context), or with `cpu` a CPU device (the dry run of this program's logic on a
/// machine without a GPU).
pub fn open_device(cpu: bool, ordinal: u32) -> Result<Arc<dyn Device>, String> {
    if cpu {
        Ok(CpuDevice::new(ordinal).map_err(de)?)
    } else {
        Ok(CudaDevice::new(ordinal).map_err(de)?)
    }
}

/// Every rank of `fabric` at once: a device pool of `pool_pages` and two staging buffers for
/// batches of up to `batch_pages` pages, on the rank's GPU.
pub fn rank_devs(
    cpu: bool,
    fabric: Fabric,
    pool_pages: u32,
    batch_pages: usize,
) -> Result<Vec<RankDev>, String> {
    let tp = fabric.tp();
    all_ok(on_ranks(tp as usize, |r| {
        let r = r as u32;
        let dev = open_device(cpu, fabric.ordinal(r))?;
        let g = glm(tp, r)?;
        let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?);
        let staging = StagingPool::new(dev.clone(), half_bytes(&g, batch_pages), 2).map_err(de)?;
        Ok(RankDev {
            rank: r,
            dev,
            g,
            pool,
            staging,
        })
    }))
}

/// (free, total) bytes of GPU memory of `dev`.
pub fn gpu_mem(dev: &CudaDevice) -> Result<(u64, u64), String> {
    dev.bind().map_err(de)?;
    let (free, total) = result::mem_get_info().map_err(|e| e.to_string())?;
    Ok((free as u64, total as u64))
}

/// `MemAvailable` of the host in bytes (None when /proc/meminfo cannot be read).
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
