//! A prefix saved by rank 0 into one embedded store, and the plans that load it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_device::HostKvPool;
use kv_geometry::{page_hashes, KvGeometry, PageHash};
use kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages, ShareMode};
use mooncake_linker::store::EmbeddedStore;
use mooncake_linker::Linker;

use super::config;
use crate::glm::{glm, tag};
use crate::pattern::fill_row;
use crate::ranks::{all_ok, on_ranks};
use crate::report::de;

/// A saved prefix: `pages` in prefix order, every object in `store`.
pub struct Prefix {
    /// Every object of the prefix.
    pub store: Arc<EmbeddedStore>,
    /// The prefix's pages, in order.
    pub pages: Vec<PageHash>,
    /// Bytes of one copy of the prefix (all components, all layers).
    pub bytes: u64,
    /// Seconds the save took.
    pub fill_s: f64,
}

/// Saves `n` pages of GLM-5.2 the way TP rank 0 of a TP `tp` deployment does after prefill
/// (a host-pool linker of rank 0 writes the replicated objects), in chunks on `threads`
/// threads so that only the store holds the whole prefix. Page `p`'s rows are
/// `fill_row(tag(c), layer, p)`.
pub fn save_prefix(tp: u32, n: usize, seed: u32, threads: usize) -> Result<Prefix, String> {
    let g = glm(tp, 0)?;
    let bytes = g.bytes_per_page() * n as u64;
    let store = Arc::new(EmbeddedStore::new(bytes + (1 << 30)));
    let tokens: Vec<u32> = (0..n as u32 * g.page_size())
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect();
    let pages = page_hashes(&tokens, g.page_size(), None);
    let chunk = 32usize;
    let chunks = n.div_ceil(chunk);
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let results = on_ranks(threads.clamp(1, chunks.max(1)), |_| {
        let pool = Arc::new(HostKvPool::new(g.clone(), chunk as u32).map_err(de)?);
        let saver = Linker::new(
            g.clone(),
            store.clone(),
            pool.clone(),
            config(
                ShareMode::AllRanks,
                Duration::from_secs(60),
                Duration::from_secs(60),
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut row = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= chunks {
                break;
            }
            let first = i * chunk;
            let len = chunk.min(n - first);
            for c in g.components() {
                row.resize(c.page_layer_bytes as usize, 0);
                for &l in &c.layers {
                    for s in 0..len {
                        fill_row(&mut row, tag(c), l, (first + s) as u64);
                        // SAFETY: this thread's own pool, filled before any linker uses it.
                        unsafe { pool.write_slot(c.id, l, s as u32, &row) }.map_err(de)?;
                    }
                }
            }
            let p = plan(
                &g,
                0,
                "prefill",
                &pages[first..first + len],
                (0..len as u32).collect(),
            );
            let r = saver.save(&p).map_err(|e| e.to_string())?;
            let want = (len * g.components().len()) as u32;
            if r.objects_written + r.objects_present != want {
                return Err(format!(
                    "save of pages {first}..{}: {} written + {} present, want {want}",
                    first + len,
                    r.objects_written,
                    r.objects_present
                ));
            }
        }
        saver.close().map_err(|e| e.to_string())
    });
    all_ok(results)?;
    Ok(Prefix {
        store,
        pages,
        bytes,
        fill_s: t0.elapsed().as_secs_f64(),
    })
}

/// A plan of one request loading `pages` into `slots`.
pub fn plan(
    g: &KvGeometry,
    batch: u64,
    request: &str,
    pages: &[PageHash],
    slots: Vec<u32>,
) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: request.into(),
            pages: pages.to_vec(),
        }],
        slots,
    )
}
