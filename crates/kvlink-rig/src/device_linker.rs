//! One rank's Linker into a device pool: a GLM-5.2 prefix saved through a host-pool linker
//! (as a previous request would have), a linker landing into a fresh `CudaKvPool` through
//! pinned staging, and the layer waits an engine does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_device::cuda::{CudaDevice, CudaKvPool};
use kv_device::{HostKvPool, StagedLandingFactory, StagingPool};
use kv_geometry::{page_hashes, KvGeometry, PageHash};
use kv_loader::{BatchId, BatchPlan, KvLoader, LayerReady, LoadTicket, RequestPages};
use mooncake_linker::store::{EmbeddedStore, KvStore};
use mooncake_linker::{Linker, LinkerConfig};

use crate::glm::{glm, half_bytes, tag};
use crate::pattern::fill_row;
use crate::report::de;

/// A saved prefix: its geometry (TP 1), the store that holds it, its pages in prefix order.
/// Page `p`'s rows are `fill_row(tag(c), layer, p)`.
pub struct SavedPrefix {
    /// GLM-5.2 at TP 1.
    pub g: KvGeometry,
    /// Every object of the prefix.
    pub store: Arc<EmbeddedStore>,
    /// The prefix's pages.
    pub pages: Vec<PageHash>,
}

/// Saves `n` pages of GLM-5.2 through a host-pool linker (as a previous request would have).
pub fn saved_prefix(n: usize, seed: u32) -> Result<SavedPrefix, String> {
    let g = glm(1, 0)?;
    let store = Arc::new(EmbeddedStore::new(
        g.bytes_per_page() * n as u64 + (1 << 30),
    ));
    let tokens: Vec<u32> = (0..n as u32 * g.page_size()).map(|i| i ^ seed).collect();
    let pages = page_hashes(&tokens, g.page_size(), None);
    let src = Arc::new(HostKvPool::new(g.clone(), n as u32).map_err(de)?);
    let mut row = Vec::new();
    for c in g.components() {
        row.resize(c.page_layer_bytes as usize, 0);
        for &l in &c.layers {
            for p in 0..n {
                fill_row(&mut row, tag(c), l, p as u64);
                // SAFETY: `src` is filled here, on one thread, before the saver shares it.
                unsafe { src.write_slot(c.id, l, p as u32, &row) }.map_err(de)?;
            }
        }
    }
    let saver = Linker::new(g.clone(), store.clone(), src, LinkerConfig::default())
        .map_err(|e| e.to_string())?;
    saver
        .save(&plan(&g, 0, &pages, (0..n as u32).collect()))
        .map_err(|e| e.to_string())?;
    saver.close().map_err(|e| e.to_string())?;
    Ok(SavedPrefix { g, store, pages })
}

/// A plan of one request loading `pages` into `slots`.
pub fn plan(g: &KvGeometry, batch: u64, pages: &[PageHash], slots: Vec<u32>) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: "gpu".into(),
            pages: pages.to_vec(),
        }],
        slots,
    )
}

/// A linker over `store` landing into a fresh device pool of `pool_pages`.
pub fn device_linker(
    read_parallelism: usize,
    dev: &Arc<CudaDevice>,
    g: &KvGeometry,
    store: Arc<dyn KvStore>,
    pool_pages: u32,
    pages: usize,
) -> Result<(Linker, Arc<CudaKvPool>), String> {
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(g, pages), 2).map_err(de)?;
    let landings = Arc::new(StagedLandingFactory::new(pool.clone(), staging));
    let config = LinkerConfig {
        wait_deadline: Duration::from_secs(60),
        read_parallelism,
        // As many hashing threads as readers (what this rig measured before the two were
        // separate settings).
        verify_threads: read_parallelism,
        ..LinkerConfig::default()
    };
    let linker = Linker::with_landings(g.clone(), store, pool.clone(), landings, config, None)
        .map_err(|e| e.to_string())?;
    Ok((linker, pool))
}

/// Waits every layer as an engine would: the event each wait hands back, synchronized. The
/// times (ms) are since `since` (take it before `start_load`, as the batch's total is, so
/// that the first layer's time includes what `start_load` does before it returns).
pub fn wait_layers(linker: &Linker, t: &LoadTicket, since: Instant) -> Result<Vec<f64>, String> {
    let t0 = since;
    let mut at = Vec::new();
    for l in 0..linker.num_layers() {
        match linker.wait_layer(t, l).map_err(|e| e.to_string())? {
            LayerReady::Event(ev) => ev.synchronize().map_err(|e| e.to_string())?,
            LayerReady::Resident => {
                return Err(format!("layer {l}: a device pool must hand back an event"))
            }
        }
        at.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(at)
}
