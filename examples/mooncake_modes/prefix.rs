//! The saved prefix: GLM-5.2 FP8 KV for N tokens written to the Mooncake Store the way TP rank
//! 0 of a deployment writes it after prefill (objects and their checksum companions), by a few
//! saver threads each with its own client; and the checksum of every (component, layer, page)
//! row, against which every rank's pool is verified.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{layer_checksum, page_hashes, KvGeometry, ModelKvSpec, PageHash};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, RequestPages};
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::KvStore;
use kvlink::mooncake_linker::{Linker, LinkerConfig};

use kvlink_rig::pattern::fill_row;

/// Pages per save call of a saver thread.
const CHUNK: usize = 32;

/// A prefix in the store.
pub struct Prefix {
    pub tokens: u64,
    pub pages: Vec<PageHash>,
    pub namespace: String,
    /// Bytes of one copy (every component, every layer).
    pub bytes: u64,
    /// Seconds the save took.
    pub save_s: f64,
    /// `expected[c][pos][page]`: checksum of component `c`'s row at its `pos`-th layer.
    expected: Vec<Vec<Vec<u64>>>,
    /// Every key written (objects and companions), for `discard`.
    keys: Vec<String>,
}

/// The tag of component `c` in the byte pattern.
pub fn tag(c: usize) -> u64 {
    c as u64 + 1
}

/// GLM-5.2 FP8 at TP `tp`, rank `rank`.
pub fn geometry(tp: u32, rank: u32) -> Result<KvGeometry> {
    Ok(KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), tp, rank)?)
}

impl Prefix {
    /// The checksum a pool's row of component `c` at layer position `pos` of plan page `page`
    /// must have.
    pub fn expected(&self, c: usize, pos: usize, page: usize) -> u64 {
        self.expected[c][pos][page]
    }

    /// Saves a prefix of `tokens` tokens under a fresh namespace.
    pub fn save(config: &MooncakeConfig, tokens: u64, savers: usize, seed: u64) -> Result<Self> {
        let g = geometry(1, 0)?;
        let n = (tokens / u64::from(g.page_size())) as usize;
        let ids: Vec<u32> = (0..n as u64 * u64::from(g.page_size()))
            .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(0x9E37)) as u32)
            .collect();
        let pages = page_hashes(&ids, g.page_size(), None);
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let namespace = format!("modes{:x}", nonce ^ (u64::from(std::process::id()) << 32));
        let expected: Vec<Vec<Vec<u64>>> = g
            .components()
            .iter()
            .map(|c| vec![vec![0; n]; c.layers.len()])
            .collect();
        let expected = Mutex::new(expected);
        let chunks = n.div_ceil(CHUNK);
        let next = AtomicUsize::new(0);
        let t0 = Instant::now();
        let savers = savers.clamp(1, chunks.max(1));
        let results: Vec<Result<()>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..savers)
                .map(|_| {
                    s.spawn(|| -> Result<()> {
                        let store = MooncakeStore::connect(config.clone())
                            .context("a saver's Mooncake client")?;
                        let pool = Arc::new(HostKvPool::new(g.clone(), CHUNK as u32)?);
                        let linker = Linker::new(
                            g.clone(),
                            Arc::new(store),
                            pool.clone(),
                            LinkerConfig {
                                namespace: namespace.as_str().into(),
                                ..LinkerConfig::default()
                            },
                        )?;
                        let mut row = Vec::new();
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= chunks {
                                break;
                            }
                            let first = i * CHUNK;
                            let len = CHUNK.min(n - first);
                            let mut sums = Vec::new();
                            for (ci, c) in g.components().iter().enumerate() {
                                row.resize(c.page_layer_bytes as usize, 0);
                                for (pos, &l) in c.layers.iter().enumerate() {
                                    for p in 0..len {
                                        fill_row(&mut row, tag(ci), l, (first + p) as u64);
                                        sums.push((ci, pos, first + p, layer_checksum(&row)));
                                        // SAFETY: this saver's own pool, written before its
                                        // save reads it; no load uses it.
                                        unsafe { pool.write_slot(c.id, l, p as u32, &row) }?;
                                    }
                                }
                            }
                            let plan = BatchPlan::all_components(
                                &g,
                                BatchId(0),
                                vec![RequestPages {
                                    request: "prefill".into(),
                                    pages: pages[first..first + len].to_vec(),
                                }],
                                (0..len as u32).collect(),
                            );
                            let r = linker.save(&plan)?;
                            let want = (len * g.components().len()) as u32;
                            if r.objects_written + r.objects_present != want {
                                bail!("save of pages {first}..{}: {r:?}", first + len);
                            }
                            let mut e = expected.lock().map_err(|_| anyhow!("poisoned"))?;
                            for (ci, pos, page, sum) in sums {
                                e[ci][pos][page] = sum;
                            }
                        }
                        linker.close()?;
                        Ok(())
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("saver panicked"))))
                .collect()
        });
        let save_s = t0.elapsed().as_secs_f64();
        let keys = prefix_keys(&g, &pages, &namespace);
        if let Some(e) = results.into_iter().find_map(Result::err) {
            // Chunks other savers wrote stay in the store otherwise, and crowd the next size.
            return Err(e.context(discard_after_failed_save(config, &keys)));
        }
        Ok(Prefix {
            tokens: n as u64 * u64::from(g.page_size()),
            bytes: g.bytes_per_page() * n as u64,
            pages,
            namespace,
            save_s,
            expected: expected.into_inner().map_err(|_| anyhow!("poisoned"))?,
            keys,
        })
    }

    /// Removes every object and companion of the prefix from the store (forced: the loads'
    /// read leases do not keep them), so the next size fits the storage nodes.
    pub fn discard(&self, store: &dyn KvStore) -> usize {
        discard_keys(store, &self.keys)
    }
}

/// Every object key of the prefix, each after its checksum companion.
fn prefix_keys(g: &KvGeometry, pages: &[PageHash], namespace: &str) -> Vec<String> {
    let scheme = kvlink::kv_geometry::KeyScheme::new(namespace, 0, 0, 0);
    g.components()
        .iter()
        .flat_map(|c| {
            pages
                .iter()
                .map(|p| scheme.object_key(p, c))
                .collect::<Vec<_>>()
        })
        .flat_map(|k| [kvlink::kv_geometry::checksum_key(&k), k])
        .collect()
}

/// Removes what a failed save may have written (every key of the prefix; absent ones are
/// refused by the store and not counted), on a client of its own; says what it did.
fn discard_after_failed_save(config: &MooncakeConfig, keys: &[String]) -> String {
    let store = match MooncakeStore::connect(config.clone()) {
        Ok(s) => s,
        Err(e) => {
            return format!("the save failed; its objects stay (no client to discard them: {e})")
        }
    };
    let removed = discard_keys(&store, keys);
    format!("the save failed; {removed} of its objects and companions discarded")
}

/// Discards `keys` (forced), 512 per store call; how many were removed.
fn discard_keys(store: &dyn KvStore, keys: &[String]) -> usize {
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    keys.chunks(512)
        .map(|c| store.discard(c).into_iter().filter(Result::is_ok).count())
        .sum()
}
