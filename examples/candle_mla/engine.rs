//! The engine side: TP ranks as threads, each with its own KV pool and kvlink linker, serving
//! two requests in the order a server would make the kvlink calls (docs/integration.md).
//!
//! - Request 1 prefills a prompt (its latents land in the pool through the adapter) and saves
//!   its whole pages through the linker.
//! - Request 2 (request 1's prompt + new tokens) on fresh ranks: local prefix match (none),
//!   `lookup`, allocate slots, `start_load` of the hit, prefill of the new tokens with every
//!   attention layer waiting for its layer of the load, the outcome (a failed load turns
//!   into a recompute of the whole prompt into the same slots), `save`.
//! - The reference: request 2 recomputed from token 0 with no store at all.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{
    page_hashes, ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit,
};
use kvlink::kv_loader::{
    BatchId, BatchPlan, KvLoader, LoadStats, LookupRequest, RequestPages, SaveReport, ShareMode,
};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::{FaultyStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};
use kvlink_candle::candle_core::{DType, Device, Tensor};
use kvlink_candle::{LatentFormat, LatentPool, LayerGate, PagedLatentCache};

use crate::model::{prefill, Comm, LatentCache, MemLatents, MlaConfig, ModelError, RankModel};

/// What to run.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Model shapes.
    pub cfg: MlaConfig,
    /// Seed of the weights and tokens.
    pub seed: u64,
    /// TP ranks (threads).
    pub tp: usize,
    /// Tokens per page.
    pub page_size: u32,
    /// Request 1's prompt.
    pub prompt: Vec<u32>,
    /// Tokens request 2 adds after request 1's prompt.
    pub new_tokens: Vec<u32>,
    /// Prefill chunk (a multiple of the page size; boundaries counted from token 0).
    pub chunk: usize,
    /// Linker settings (the mode is set per run).
    pub linker: LinkerConfig,
}

impl Scenario {
    /// Request 2's tokens: request 1's prompt, then the new tokens.
    pub fn request2(&self) -> Vec<u32> {
        let mut t = self.prompt.clone();
        t.extend_from_slice(&self.new_tokens);
        t
    }

    /// The latent row format in the pool: f32, so candle's CPU kernels take it as is.
    pub fn format(&self) -> anyhow::Result<LatentFormat> {
        Ok(LatentFormat::new(
            self.cfg.kv_lora_rank,
            self.cfg.rope_dim,
            DType::F32,
        )?)
    }

    /// kvlink's view of the model's KV: one replicated token-row component `k` holding the
    /// latent row's bytes, on every layer.
    pub fn spec(&self) -> anyhow::Result<ModelKvSpec> {
        let row = u32::try_from(self.format()?.row_bytes())?;
        Ok(ModelKvSpec::new(
            "tiny-mla",
            u32::try_from(self.cfg.layers)?,
            self.page_size,
            vec![ComponentSpec::new(
                "k",
                RowUnit::Token,
                ElementType::Bytes,
                row,
            )],
        )?)
    }

    /// Every rank's share of the model.
    pub fn models(&self) -> anyhow::Result<Vec<Arc<RankModel>>> {
        if self.chunk == 0 || !self.chunk.is_multiple_of(self.page_size as usize) {
            bail!(
                "chunk {} is not a multiple of the page size {}",
                self.chunk,
                self.page_size
            );
        }
        (0..self.tp)
            .map(|r| Ok(Arc::new(RankModel::new(self.cfg, self.seed, self.tp, r)?)))
            .collect()
    }

    fn config(&self, mode: ShareMode) -> LinkerConfig {
        LinkerConfig {
            mode: ModeChoice::Fixed(mode),
            ..self.linker.clone()
        }
    }
}

/// One rank's KV pool and slot allocator.
struct RankKv {
    geometry: KvGeometry,
    pool: Arc<HostKvPool>,
    latents: LatentPool,
    free: Vec<u32>,
}

impl RankKv {
    /// A pool with room for `pages` pages and some spare; every rank hands out its slots in
    /// a different order, so the same page lands in different slots on different ranks.
    fn new(sc: &Scenario, rank: usize, pages: usize) -> anyhow::Result<Self> {
        let geometry = KvGeometry::new(sc.spec()?, u32::try_from(sc.tp)?, u32::try_from(rank)?)?;
        let pool_pages = u32::try_from(2 * pages + 3)?;
        let pool = Arc::new(HostKvPool::new(geometry.clone(), pool_pages)?);
        let latents = LatentPool::new(pool.clone(), "k", sc.format()?, Device::Cpu)?;
        let mut free: Vec<u32> = (0..pool_pages).collect();
        free.rotate_left((rank * 5 + 1) % pool_pages as usize);
        free.reverse();
        Ok(RankKv {
            geometry,
            pool,
            latents,
            free,
        })
    }

    fn alloc(&mut self, pages: usize) -> anyhow::Result<Vec<u32>> {
        if pages > self.free.len() {
            bail!("pool full");
        }
        Ok(self.free.drain(..pages).collect())
    }
}

/// A fallible step on one rank, then agreement: if any rank failed, every rank stops here
/// (so none waits in a later collective for a rank that is gone).
fn agreed<T>(comm: &Comm, rank: usize, step: anyhow::Result<T>) -> anyhow::Result<T> {
    match comm.agree(rank, step.is_ok()) {
        Ok(()) => step,
        Err(_) => Err(step
            .err()
            .unwrap_or_else(|| anyhow!("another TP rank failed"))),
    }
}

/// Runs `job(rank)` on every rank as threads; the per-rank results in rank order.
fn on_ranks<T: Send>(
    tp: usize,
    job: impl Fn(usize) -> anyhow::Result<T> + Sync,
) -> anyhow::Result<Vec<T>> {
    std::thread::scope(|s| {
        let job = &job;
        let handles: Vec<_> = (0..tp).map(|r| s.spawn(move || job(r))).collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join()
                    .map_err(|_| anyhow!("rank {r} panicked"))?
                    .with_context(|| format!("rank {r}"))
            })
            .collect()
    })
}

/// Request 1: prefill the prompt on every rank and save its whole pages through kvlink.
pub fn save_request1(
    sc: &Scenario,
    models: &[Arc<RankModel>],
    store: Arc<dyn KvStore>,
) -> anyhow::Result<Vec<SaveReport>> {
    let comm = Comm::new(sc.tp);
    let groups = TpGroup::in_process(u32::try_from(sc.tp)?);
    let tokens = &sc.prompt;
    let ps = sc.page_size as usize;
    on_ranks(sc.tp, |rank| {
        let setup = (|| {
            let mut kv = RankKv::new(sc, rank, tokens.len().div_ceil(ps))?;
            let linker = Linker::with_group(
                kv.geometry.clone(),
                store.clone(),
                kv.pool.clone(),
                sc.config(ShareMode::AllRanks),
                groups[rank].clone(),
            )?;
            let table = kv.alloc(tokens.len().div_ceil(ps))?;
            Ok((kv, linker, table))
        })();
        let (kv, linker, table) = agreed(&comm, rank, setup)?;
        // SAFETY: the slots of `table` are this sequence's alone and nothing loads into them.
        let mut cache = unsafe { PagedLatentCache::new(kv.latents.clone(), table.clone(), 0) };
        prefill(&models[rank], &comm, &mut cache, tokens, 0, sc.chunk)?;
        // Save the whole pages (a partial last page is not keyed). Every rank calls it;
        // rank 0 writes the replicated latent, the others own nothing to write.
        let pages = page_hashes(tokens, sc.page_size, None);
        let plan = BatchPlan::all_components(
            &kv.geometry,
            BatchId(1),
            vec![RequestPages {
                request: "request-1".into(),
                pages: pages.clone(),
            }],
            table[..pages.len()].to_vec(),
        );
        let report = linker.save(&plan)?;
        linker.close()?;
        Ok(report)
    })
}

/// The reference: request 2 computed from token 0 on fresh ranks, no store. Every rank's
/// logits of all the tokens.
pub fn recompute_request2(sc: &Scenario, models: &[Arc<RankModel>]) -> anyhow::Result<Vec<Tensor>> {
    let comm = Comm::new(sc.tp);
    let tokens = sc.request2();
    let pages = tokens.len().div_ceil(sc.page_size as usize);
    on_ranks(sc.tp, |rank| {
        let (kv, table) = agreed(
            &comm,
            rank,
            (|| {
                let mut kv = RankKv::new(sc, rank, pages)?;
                let table = kv.alloc(pages)?;
                Ok((kv, table))
            })(),
        )?;
        // SAFETY: fresh ranks: the slots of `table` are this sequence's alone, no loader.
        let mut cache = unsafe { PagedLatentCache::new(kv.latents.clone(), table, 0) };
        Ok(prefill(
            &models[rank],
            &comm,
            &mut cache,
            &tokens,
            0,
            sc.chunk,
        )?)
    })
}

/// An informational pass: request 2 in one chunk, latents in plain tensors (no pool). Its
/// GEMMs have other shapes than the chunked passes', so its sums may round differently.
pub fn dense_request2(sc: &Scenario, models: &[Arc<RankModel>]) -> anyhow::Result<Vec<Tensor>> {
    let comm = Comm::new(sc.tp);
    let tokens = sc.request2();
    on_ranks(sc.tp, |rank| {
        let mut cache = MemLatents::new(sc.cfg.layers);
        Ok(models[rank].forward_chunk(&comm, &mut cache, &tokens, 0)?)
    })
}

/// A sequence's paged cache that also keeps how long attention was blocked waiting for
/// loaded layers (what is left of the load once compute overlaps it).
struct WaitTimed {
    cache: PagedLatentCache,
    blocked: std::cell::Cell<Duration>,
}

impl LatentCache for WaitTimed {
    fn write(&mut self, layer: u32, start: usize, rows: &Tensor) -> Result<(), ModelError> {
        LatentCache::write(&mut self.cache, layer, start, rows)
    }
    fn read(&self, layer: u32, tokens: usize) -> Result<Tensor, ModelError> {
        let t = Instant::now();
        self.cache.gate().wait(layer)?;
        self.blocked.set(self.blocked.get() + t.elapsed());
        Ok(self.cache.layer(layer, tokens)?)
    }
}

/// How request 2's prefix got into the pool.
#[derive(Debug, Clone)]
pub enum PrefixPath {
    /// Loaded through kvlink.
    Loaded(LoadStats),
    /// The load failed (the verdict every rank got); the prompt was recomputed.
    Recomputed(String),
    /// The store had no whole page of it: computed from token 0, nothing loaded.
    NoHit,
}

/// What one rank did for request 2.
#[derive(Debug, Clone)]
pub struct Served {
    /// Tokens the lookup hit (whole pages), loaded instead of computed.
    pub hit_tokens: usize,
    /// Logits of tokens `hit_tokens..` of request 2.
    pub logits: Tensor,
    /// Loaded, or recomputed after a failed load.
    pub path: PrefixPath,
    /// The save of request 2's whole pages after prefill.
    pub save: SaveReport,
    /// From the lookup to the logits (prefill included, save excluded).
    pub prefill: Duration,
    /// Time attention spent blocked in layer waits (the part of the load compute did not
    /// hide).
    pub blocked: Duration,
    /// This rank's page table.
    pub page_table: Vec<u32>,
}

/// Request 2 on fresh ranks, its prefix loaded through kvlink in `mode`. `arm(rank, store)`
/// may inject faults into a rank's view of the store before anything runs.
pub fn serve_request2(
    sc: &Scenario,
    models: &[Arc<RankModel>],
    store: Arc<dyn KvStore>,
    mode: ShareMode,
    arm: &(dyn Fn(usize, &FaultyStore) + Sync),
) -> anyhow::Result<Vec<Served>> {
    let comm = Comm::new(sc.tp);
    let groups = TpGroup::in_process(u32::try_from(sc.tp)?);
    let tokens = sc.request2();
    let ps = sc.page_size as usize;
    let pages = tokens.len().div_ceil(ps);
    on_ranks(sc.tp, |rank| {
        let setup = (|| {
            let mut kv = RankKv::new(sc, rank, pages)?;
            let faulty = Arc::new(FaultyStore::new(store.clone()));
            arm(rank, &faulty);
            let linker: Arc<dyn KvLoader> = Arc::new(Linker::with_group(
                kv.geometry.clone(),
                faulty,
                kv.pool.clone(),
                sc.config(mode),
                groups[rank].clone(),
            )?);
            // The slots of the whole sequence, from the engine's own allocator.
            let table = kv.alloc(pages)?;
            Ok((kv, linker, table))
        })();
        let (kv, loader, table) = agreed(&comm, rank, setup)?;
        let t0 = Instant::now();

        // 1. The engine's own prefix match found nothing (fresh ranks): ask kvlink for the
        //    pages after it. Every rank asks, in the same order; they agree on the minimum.
        let hit = agreed(
            &comm,
            rank,
            loader
                .lookup(&LookupRequest {
                    tokens: &tokens,
                    skip_pages: 0,
                })
                .map_err(Into::into),
        )?;
        // Keep at least one token to compute (its logits start generation), and load whole
        // chunks only: the new tokens then fall in exactly the chunks a recompute from token 0
        // uses, so every GEMM has the same shape in both passes (bit-exact logits). A hit
        // that ends mid-chunk gives up its last pages (docs/integration.md, "Exactness").
        let usable = hit.tokens.min(tokens.len() - 1);
        let loaded = usable / sc.chunk * sc.chunk;
        let hit_pages = loaded / ps;

        // 2-3. The hit pages land in the sequence's first slots: start the layer-wise load.
        // SAFETY: the slots of `table` are this sequence's alone; the only load into them is
        // the one attached below (its first `loaded` tokens).
        let cache = unsafe { PagedLatentCache::new(kv.latents.clone(), table.clone(), loaded) };
        let cache = if hit_pages > 0 {
            let plan = BatchPlan::all_components(
                &kv.geometry,
                BatchId(2),
                vec![RequestPages {
                    request: "request-2".into(),
                    pages: hit.pages[..hit_pages].to_vec(),
                }],
                table[..hit_pages].to_vec(),
            );
            let ticket = agreed(&comm, rank, loader.start_load(plan).map_err(Into::into))?;
            cache.with_load(LayerGate::new(loader.clone(), ticket))
        } else {
            cache
        };

        // 4. Prefill the new tokens while the prefix arrives: each attention layer's
        //    `cache.layer(l, ..)` waits for layer l of the load.
        let mut timed = WaitTimed {
            cache,
            blocked: std::cell::Cell::new(Duration::ZERO),
        };
        let forward = prefill(&models[rank], &comm, &mut timed, &tokens, loaded, sc.chunk);
        let blocked = timed.blocked.get();
        let mut cache = timed.cache;

        // 5. The outcome (the same on every rank); the engine agrees on it too before
        //    trusting the prefix, and on any failure recomputes the prompt into the same slots.
        let outcome = cache.finish_load();
        let all_loaded = comm.agree(rank, outcome.is_ok()).is_ok();
        let (logits, path) = match (all_loaded, forward, outcome) {
            (true, Ok(logits), Ok(stats)) => (
                logits,
                match stats {
                    Some(s) => PrefixPath::Loaded(s),
                    None => PrefixPath::NoHit,
                },
            ),
            (true, Err(e), _) => return Err(e.into()),
            (_, _, outcome) => {
                let why = match outcome {
                    Err(e) => {
                        if e.needs_reset() {
                            // The load may still write the slots: cancel it first, then
                            // take the slots back in a cache of their own.
                            loader.reset()?;
                            // SAFETY: after the reset nothing loads into `table`'s slots.
                            cache = unsafe {
                                PagedLatentCache::new(kv.latents.clone(), table.clone(), 0)
                            };
                        }
                        e.to_string()
                    }
                    Ok(_) => "another rank's load failed".into(),
                };
                let all = prefill(&models[rank], &comm, &mut cache, &tokens, 0, sc.chunk)?;
                (
                    all.narrow(0, loaded, tokens.len() - loaded)?,
                    PrefixPath::Recomputed(why),
                )
            }
        };
        let prefill_time = t0.elapsed();

        // 6. Save request 2's whole pages (the loaded ones are present and skipped).
        let pages2 = page_hashes(&tokens, sc.page_size, None);
        let plan = BatchPlan::all_components(
            &kv.geometry,
            BatchId(3),
            vec![RequestPages {
                request: "request-2".into(),
                pages: pages2.clone(),
            }],
            table[..pages2.len()].to_vec(),
        );
        let save = loader.save(&plan)?;
        loader.close()?;
        Ok(Served {
            hit_tokens: loaded,
            logits,
            path,
            save,
            prefill: prefill_time,
            blocked,
            page_table: table,
        })
    })
}
