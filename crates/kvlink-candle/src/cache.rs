//! One sequence's paged latent cache: a page table into the pool, and the load (if any)
//! that fills its leading pages.

use candle_core::Tensor;
use kv_loader::LoadStats;

use crate::{CandleKvError, LatentPool, LayerGate};

/// One sequence's MLA latent cache in a kvlink pool: its page table (slot of each page, in
/// sequence order), the [`LayerGate`] of the load filling its first `loaded_tokens` tokens,
/// and the [`LatentPool`] to read and write through.
///
/// [`layer`](Self::layer) is what an attention layer calls: it waits for that layer of the
/// load, then reads the layer's rows as `[tokens, kv_lora_rank + rope_dim]`.
/// [`write`](Self::write) puts the rows the engine computed for new tokens into the
/// sequence's slots, so they can later be saved through the loader.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::HostKvPool;
/// use kv_geometry::{page_hashes, ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
/// use kv_loader::mock::{MockKvLoader, MockScript};
/// use kv_loader::{BatchId, BatchPlan, KvLoader, LookupRequest, RequestPages};
/// use kvlink_candle::candle_core::{DType, Device, Tensor};
/// use kvlink_candle::{LatentFormat, LatentPool, LayerGate, PagedLatentCache};
///
/// // A 2-layer model, page size 4, latent 4 + 2 in f32.
/// let format = LatentFormat::new(4, 2, DType::F32).unwrap();
/// let spec = ModelKvSpec::new("tiny", 2, 4, vec![ComponentSpec::new(
///     "k", RowUnit::Token, ElementType::Bytes, format.row_bytes() as u32)]).unwrap();
/// let geometry = KvGeometry::new(spec, 1, 0).unwrap();
/// let pool = Arc::new(HostKvPool::new(geometry.clone(), 8).unwrap());
/// let latents = LatentPool::new(pool, "k", format, Device::Cpu).unwrap();
///
/// // The loader finds the first 2 pages of a 10-token prompt; the engine gives the
/// // sequence slots 3, 0, 6 and starts the load.
/// let loader: Arc<dyn KvLoader> = Arc::new(MockKvLoader::new(2, MockScript { page_size: 4, ..Default::default() }));
/// let tokens: Vec<u32> = (0..10).collect();
/// let hit = loader.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
/// let table = vec![3, 0, 6];
/// let plan = BatchPlan::all_components(&geometry, BatchId(1),
///     vec![RequestPages { request: "r".into(), pages: hit.pages.clone() }], table[..2].to_vec());
/// let ticket = loader.start_load(plan).unwrap();
/// let mut cache = PagedLatentCache::new(latents, table, hit.tokens)
///     .with_load(LayerGate::new(loader.clone(), ticket));
///
/// // Attention on layer 1 over tokens 8 and 9: write their rows, then read all 10.
/// let new_rows = Tensor::ones((2, 6), DType::F32, &Device::Cpu).unwrap();
/// cache.write(1, 8, &new_rows).unwrap();
/// let all = cache.layer(1, 10).unwrap(); // waits for layer 1 of the load first
/// assert_eq!(all.dims(), &[10, 6]);
/// assert!(cache.finish_load().unwrap().is_some());
/// ```
#[derive(Debug)]
pub struct PagedLatentCache {
    pool: LatentPool,
    page_table: Vec<u32>,
    loaded_tokens: usize,
    gate: LayerGate,
}

impl PagedLatentCache {
    /// A sequence whose page `i` lives in slot `page_table[i]`, whose first `loaded_tokens`
    /// tokens come from a load (attach it with [`with_load`](Self::with_load); without one
    /// they are taken as already in the pool).
    pub fn new(pool: LatentPool, page_table: Vec<u32>, loaded_tokens: usize) -> Self {
        PagedLatentCache {
            pool,
            page_table,
            loaded_tokens,
            gate: LayerGate::open(),
        }
    }

    /// The same cache, its reads gated on `gate`'s load.
    pub fn with_load(mut self, gate: LayerGate) -> Self {
        self.gate = gate;
        self
    }

    /// The page table (slot of each page, in sequence order).
    pub fn page_table(&self) -> &[u32] {
        &self.page_table
    }

    /// Tokens covered by the load (whole pages).
    pub fn loaded_tokens(&self) -> usize {
        self.loaded_tokens
    }

    /// The pool adapter.
    pub fn pool(&self) -> &LatentPool {
        &self.pool
    }

    /// The gate of the load in flight (open when none).
    pub fn gate(&self) -> &LayerGate {
        &self.gate
    }

    /// Waits for layer `layer` of the load, then reads the layer's rows of the first
    /// `tokens` tokens as `[tokens, kv_lora_rank + rope_dim]` (a copy on the CPU).
    /// A failed load gives [`CandleKvError::Load`].
    pub fn layer(&self, layer: u32, tokens: usize) -> Result<Tensor, CandleKvError> {
        self.gate.wait(layer)?;
        self.pool.read_tokens(layer, &self.page_table, tokens)
    }

    /// Like [`layer`](Self::layer), in the paged form `[pages, page_size, width]` for the
    /// first `pages` pages.
    pub fn layer_pages(&self, layer: u32, pages: usize) -> Result<Tensor, CandleKvError> {
        self.gate.wait(layer)?;
        let have = self.page_table.len();
        let slots = self
            .page_table
            .get(..pages)
            .ok_or(CandleKvError::PageTable {
                start: 0,
                end: pages * self.pool.page_size(),
                needed: pages,
                have,
            })?;
        self.pool.read_pages(layer, slots)
    }

    /// Writes layer `layer`'s rows `[n, width]` of tokens `start..start + n`. Rows inside
    /// the loaded prefix wait for the layer's load first (they would race it otherwise).
    pub fn write(&self, layer: u32, start: usize, rows: &Tensor) -> Result<(), CandleKvError> {
        if start < self.loaded_tokens {
            self.gate.wait(layer)?;
        }
        self.pool.write_tokens(layer, &self.page_table, start, rows)
    }

    /// Takes the load's outcome and detaches it (see [`LayerGate::finish`]). After a
    /// failure the loaded tokens drop to zero: the engine recomputes them into the same
    /// slots.
    pub fn finish_load(&mut self) -> Result<Option<LoadStats>, CandleKvError> {
        let out = self.gate.finish();
        if out.is_err() {
            self.loaded_tokens = 0;
        }
        out
    }
}
