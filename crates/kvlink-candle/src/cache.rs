//! One sequence's paged latent cache: a page table into the pool, and the load (if any)
//! that fills its leading pages.

use candle_core::Tensor;
use kv_loader::{KvLoadError, LoadStats};

use crate::recompute::Recompute;
use crate::{CandleKvError, LatentPool, LayerGate};

/// How long a write into a page the load landed waits, once the load's last layer is in, for
/// its landing to let go of the page's slot (it does so as its batch ends: at once).
pub const LANDED_SLOTS_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

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
/// let script = MockScript { page_size: 4, ..Default::default() };
/// let loader: Arc<dyn KvLoader> = Arc::new(MockKvLoader::new(2, script));
/// let tokens: Vec<u32> = (0..10).collect();
/// let hit = loader.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
/// let table = vec![3, 0, 6];
/// let plan = BatchPlan::all_components(&geometry, BatchId(1),
///     vec![RequestPages { request: "r".into(), pages: hit.pages.clone() }], table[..2].to_vec());
/// let ticket = loader.start_load(plan).unwrap();
/// // The loaded tokens end after the hit's last page (`hit.tokens` is a count: the same
/// // here only because the lookup skipped no pages).
/// let loaded_end = (hit.first_page + hit.pages.len()) * 4;
/// // SAFETY: slots 3, 0, 6 are this sequence's alone; the only load into them is `ticket`'s.
/// let mut cache = unsafe { PagedLatentCache::new(latents, table, loaded_end) }
///     .with_load(LayerGate::new(loader.clone(), ticket));
///
/// // Attention on layer 1 over tokens 8 and 9: write their rows, then read all 10.
/// let new_rows = Tensor::ones((2, 6), DType::F32, &Device::Cpu).unwrap();
/// cache.write(1, 8, &new_rows).unwrap();
/// let all = cache.layer(1, 10).unwrap(); // waits for layer 1 of the load first
/// assert_eq!(all.dims(), &[10, 6]);
/// assert!(cache.finish_load().unwrap().is_some());
/// ```
///
/// Building one is `unsafe`: the cache reads and writes its slots through raw copies, so
/// the engine promises once, here, that nothing else writes them meanwhile (see
/// [`new`](Self::new); [`load_starts_at`](Self::load_starts_at), also `unsafe`, adds that no
/// load writes the pages before the given token).
///
/// ```compile_fail,E0133
/// # use std::sync::Arc;
/// # use kv_device::HostKvPool;
/// # use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
/// # use kvlink_candle::candle_core::{DType, Device};
/// # use kvlink_candle::{LatentFormat, LatentPool, PagedLatentCache};
/// # let format = LatentFormat::new(4, 2, DType::F32).unwrap();
/// # let spec = ModelKvSpec::new("tiny", 2, 4, vec![ComponentSpec::new(
/// #     "k", RowUnit::Token, ElementType::Bytes, format.row_bytes() as u32)]).unwrap();
/// # let pool = Arc::new(HostKvPool::new(KvGeometry::new(spec, 1, 0).unwrap(), 8).unwrap());
/// # let latents = LatentPool::new(pool, "k", format, Device::Cpu).unwrap();
/// let cache = PagedLatentCache::new(latents, vec![3], 0); // needs `unsafe`
/// ```
#[derive(Debug)]
pub struct PagedLatentCache {
    pool: LatentPool,
    page_table: Vec<u32>,
    loaded_tokens: usize,
    /// The tokens a load attached to this cache covers (`new`'s `loaded_tokens`): what
    /// `loaded_tokens` is again when a load is attached after a failed one.
    load_extent: usize,
    /// The first token a load covers (a page boundary; 0 unless
    /// [`load_starts_at`](Self::load_starts_at) says): the tokens before it are the
    /// sequence's own prefix, never the load's.
    load_start: usize,
    gate: LayerGate,
    /// Set when a load's outcome could not be taken: it may still be writing the slots of
    /// the tokens fenced here (the loaded tokens when it was found), so they stay fenced for
    /// the life of the cache, whatever later loads or failures do to `loaded_tokens`.
    unsettled: Option<Fence>,
    /// Set when a load failed (and settled): per layer, its tokens not yet written again,
    /// which reads refuse ([`CandleKvError::NotRecomputed`]) instead of returning stale rows.
    recompute: Option<Recompute>,
}

/// Tokens `from..to` of a load that did not settle (`source`): the load may still write them.
#[derive(Debug)]
struct Fence {
    source: KvLoadError,
    from: usize,
    to: usize,
}

impl PagedLatentCache {
    /// A sequence whose page `i` lives in slot `page_table[i]`, whose first `loaded_tokens`
    /// tokens come from a load (attach it with [`with_load`](Self::with_load); without one
    /// they are taken as already in the pool).
    ///
    /// # Safety
    /// The slots of `page_table` are distinct (a slot named twice holds two pages' rows at once:
    /// each write of one overwrites the other). While the cache lives, nothing writes the slots of
    /// `page_table` but this cache and the one load attached with `with_load` (covering the first
    /// `loaded_tokens` tokens), and nothing reads the slots this cache writes while it may be
    /// writing them: another cache or [`LatentPool`] call over them, or a save of them, runs only
    /// between the cache's calls, ordered after them (the same thread, say: the save after
    /// prefill). Slots only read here (a prefix shared with other sequences, below `loaded_tokens`
    /// and never written) may be read by others at any time. The cache itself waits for the load's
    /// layer before it touches the loaded tokens.
    pub unsafe fn new(pool: LatentPool, page_table: Vec<u32>, loaded_tokens: usize) -> Self {
        PagedLatentCache {
            pool,
            page_table,
            loaded_tokens,
            load_extent: loaded_tokens,
            load_start: 0,
            gate: LayerGate::open(),
            unsettled: None,
            recompute: None,
        }
    }

    /// The same cache, its load covering tokens `tokens..loaded_tokens` only: the first
    /// `tokens` (rounded down to a page boundary, at most `loaded_tokens`) are the sequence's
    /// own prefix, already in the pool (the engine's prefix cache found them; the load fills
    /// the pages after them). A failed load leaves them readable, the engine recomputes from
    /// the load's first token on ([`CandleKvError::NotRecomputed`] names no token before it),
    /// and a load that does not settle fences its own tokens only.
    ///
    /// Without it the load is taken to cover every token from 0: after a failure the engine
    /// would have to write its own (possibly shared) prefix pages again before reading.
    ///
    /// A fence already in place (a load that did not settle) keeps its own first token.
    ///
    /// # Safety
    /// No load attached to this cache, now or later ([`with_load`](Self::with_load)), writes
    /// the slots of the pages before `tokens` (its plan names only the slots of the pages from
    /// there on): the cache reads and writes those pages without waiting for a load or
    /// fencing them.
    pub unsafe fn load_starts_at(mut self, tokens: usize) -> Self {
        let ps = self.pool.page_size().max(1);
        self.load_start = (tokens.min(self.load_extent) / ps) * ps;
        self
    }

    /// The first token the load covers (see [`load_starts_at`](Self::load_starts_at)).
    pub fn load_start(&self) -> usize {
        self.load_start
    }

    /// The same cache, its reads gated on `gate`'s load. A load already attached is finished
    /// first (its outcome taken, as [`finish_load`](Self::finish_load) waits for it), so no
    /// load is left writing the slots unwatched; when it cannot be settled the loaded tokens
    /// stay fenced ([`CandleKvError::Unsettled`]).
    ///
    /// The fence outlives the new load: a later failure that drops
    /// [`loaded_tokens`](Self::loaded_tokens) to zero does not lift it. The new load covers
    /// the tokens given to [`new`](Self::new) (`new`'s contract: the only load into the slots
    /// covers those), also after a failed load dropped `loaded_tokens` to zero: its layers are
    /// waited for, and fenced if it does not settle (a gate whose outcome a clone already took
    /// answers that verdict). An open gate ([`LayerGate::open`]) covers nothing: after a
    /// failed load its tokens stay refused until the engine writes them again.
    pub fn with_load(mut self, gate: LayerGate) -> Self {
        let out = self.gate.finish();
        self.settle(&out);
        let attached = gate.ticket().is_some();
        self.gate = gate;
        if attached {
            // The new load covers the tokens again.
            self.loaded_tokens = self.load_extent;
            self.recompute = None;
        }
        self
    }

    /// Fences the loaded tokens (and any fenced before) for good: `source` could not settle.
    fn mark_unsettled(&mut self, source: KvLoadError) {
        let (from, to) = match &self.unsettled {
            Some(f) => (f.from.min(self.load_start), f.to.max(self.loaded_tokens)),
            None => (self.load_start, self.loaded_tokens),
        };
        self.unsettled = Some(Fence { source, from, to });
    }

    /// The end of the tokens fenced for good because a load into their slots did not settle
    /// (0: none). They run to here from the first token of the first load fenced (what
    /// [`load_start`](Self::load_start) was then: a later `load_starts_at` does not move it).
    pub fn fenced_tokens(&self) -> usize {
        self.unsettled.as_ref().map_or(0, |f| f.to)
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

    /// The gate of the load attached: open when none, and after a failed load's outcome was
    /// taken (the fences answer for its tokens); a loaded one keeps answering its verdict.
    pub fn gate(&self) -> &LayerGate {
        &self.gate
    }

    /// Waits for layer `layer` of the load, then reads the layer's rows of the first
    /// `tokens` tokens as `[tokens, kv_lora_rank + rope_dim]` (a copy on the CPU).
    /// A failed load gives [`CandleKvError::Load`]; once its outcome was taken, a read of its
    /// tokens before the engine wrote them again gives [`CandleKvError::NotRecomputed`].
    pub fn layer(&self, layer: u32, tokens: usize) -> Result<Tensor, CandleKvError> {
        self.fence(0, tokens)?;
        self.gate.wait_on_host(layer)?;
        self.recomputed(layer, tokens)?;
        // SAFETY: the slots are this cache's alone (`new`'s contract); the load into them has
        // landed this layer (the wait above blocks the host on a device layer's event, also
        // for a gate built `on_stream`), or it did not settle and the fence above refused
        // every page it may write (from its first token: no load writes the pages before,
        // `load_starts_at`'s contract); writes need `&mut self`.
        unsafe { self.pool.read_tokens(layer, &self.page_table, tokens) }
    }

    /// Like [`layer`](Self::layer), in the paged form `[pages, page_size, width]` for the
    /// first `pages` pages.
    pub fn layer_pages(&self, layer: u32, pages: usize) -> Result<Tensor, CandleKvError> {
        self.fence(0, pages.saturating_mul(self.pool.page_size()))?;
        self.gate.wait_on_host(layer)?;
        self.recomputed(layer, pages.saturating_mul(self.pool.page_size()))?;
        let have = self.page_table.len();
        let slots = self
            .page_table
            .get(..pages)
            .ok_or(CandleKvError::PageTable {
                start: 0,
                end: pages.saturating_mul(self.pool.page_size()),
                needed: pages,
                have,
            })?;
        // SAFETY: as in `layer`.
        unsafe { self.pool.read_pages(layer, slots) }
    }

    /// Writes layer `layer`'s rows `[n, width]` of tokens `start..start + n`. Rows inside
    /// the loaded prefix wait for the layer's load first (they would race it otherwise); while
    /// the load is under way, rows in a page it lands (a `loaded_tokens` that ends mid-page, or
    /// a loaded token computed again) wait for the whole load on a pool that tracks slot
    /// claims: its landing holds each of its slots, every layer, until its batch is done (the
    /// pool refuses the write until then, [`CandleKvError::Pool`] with `SlotBusy`, which this
    /// wait avoids; it is bounded by the loader's waits, then by [`LANDED_SLOTS_WAIT`]). A load
    /// that fails at a later layer then fails the write too ([`CandleKvError::Load`]).
    pub fn write(&mut self, layer: u32, start: usize, rows: &Tensor) -> Result<(), CandleKvError> {
        let n = rows.dims().first().copied().unwrap_or(0);
        let end = start.saturating_add(n);
        self.fence(start, end)?;
        if self.touches(start, self.loaded_tokens) {
            self.gate.wait_on_host(layer)?;
            self.wait_landed_slots(layer, start, end)?;
        }
        // SAFETY: the slots are this cache's alone (`new`'s contract), `&mut self` excludes
        // its own readers, and the load's layer has landed wherever the rows overlap it (a
        // load that did not settle: the fence above refused its pages, as in `layer`).
        unsafe { self.pool.write_tokens(layer, &self.page_table, start, rows) }?;
        if let Some(r) = self.recompute.as_mut() {
            r.wrote(layer, start, start.saturating_add(n));
        }
        Ok(())
    }

    /// Takes the load's outcome (see [`LayerGate::finish`]); after a failure the gate is
    /// detached (the cache's gate is open and the fences below answer for the tokens). After a
    /// failure the loaded tokens drop to zero: the engine recomputes them into the same
    /// slots, and until it has written a layer's rows again (from the load's first token on:
    /// 0, or what [`load_starts_at`](Self::load_starts_at) said), a read of them gives
    /// [`CandleKvError::NotRecomputed`] instead of the stale rows. When the load may still be
    /// writing them (no outcome could be taken,
    /// [`CandleKvError::Unsettled`], or a failure whose
    /// [`needs_reset`](CandleKvError::needs_reset) is true) every later access to the loaded
    /// tokens fails with [`CandleKvError::Unsettled`] (reset the loader and build a new cache).
    pub fn finish_load(&mut self) -> Result<Option<LoadStats>, CandleKvError> {
        let out = self.gate.finish();
        self.settle(&out);
        if out.is_err() {
            // The fences above answer for the failed load's tokens now: the recomputed rows
            // are read without the gate, whose verdict would refuse every layer.
            self.gate = LayerGate::open();
        }
        out
    }

    /// What a load's outcome `out` leaves: on a failure whose load may still be writing the
    /// slots ([`needs_reset`](CandleKvError::needs_reset): no outcome taken, or a failed
    /// load whose error says so) the loaded tokens are fenced for good; on another failure
    /// they drop to zero (the engine recomputes them into the same slots).
    fn settle(&mut self, out: &Result<Option<LoadStats>, CandleKvError>) {
        match out {
            Err(e @ (CandleKvError::Unsettled { source } | CandleKvError::Load { source, .. }))
                if e.needs_reset() =>
            {
                self.mark_unsettled(source.clone())
            }
            Err(_) => {
                if self.loaded_tokens > 0 {
                    let layers = self.pool.pool().geometry().num_layers() as usize;
                    self.recompute =
                        Some(Recompute::new(layers, self.load_start, self.loaded_tokens));
                }
                self.loaded_tokens = 0;
            }
            Ok(_) => {}
        }
    }

    /// Refuses a read of layer `layer`'s first `tokens` tokens that reaches rows of a failed
    /// load the engine has not written again.
    fn recomputed(&self, layer: u32, tokens: usize) -> Result<(), CandleKvError> {
        match self.recompute.as_ref().and_then(|r| r.stale(layer, tokens)) {
            Some(stale) => Err(CandleKvError::NotRecomputed {
                layer,
                from: stale.start,
                to: stale.end,
            }),
            None => Ok(()),
        }
    }

    /// Waits until the load attached no longer claims the slots of the pages it lands among
    /// tokens `start..end` (written at `layer`, waited for already): for its last layer
    /// (through the gate, bounded by the loader), then for the claims to go (bounded by
    /// [`LANDED_SLOTS_WAIT`]). Nothing to wait for on a pool that tracks no claims, once the
    /// load's outcome was taken, with no load attached, or below the load's first page.
    fn wait_landed_slots(&self, layer: u32, start: usize, end: usize) -> Result<(), CandleKvError> {
        if self.pool.pool().slot_claims().is_none() {
            return Ok(());
        }
        let Some(layers) = self.gate.num_layers().filter(|_| self.gate.is_loading()) else {
            return Ok(());
        };
        let ps = self.pool.page_size().max(1);
        let first = start.max(self.load_start) / ps;
        let pages = first..end.div_ceil(ps).min(self.loaded_tokens.div_ceil(ps));
        let Some(slots) = self
            .page_table
            .get(pages.start.min(pages.end)..pages.end)
            .filter(|s| !s.is_empty())
        else {
            return Ok(());
        };
        let last = layers.saturating_sub(1);
        if layer != last {
            self.gate.wait_on_host(last)?;
        }
        kv_device::SlotClaims::wait_free(
            self.pool.pool().as_ref(),
            slots,
            kv_loader::deadline_after(LANDED_SLOTS_WAIT),
        )?;
        Ok(())
    }

    /// Whether an access from token `start` on reaches a page of the first `tokens` tokens:
    /// loads land whole pages, so the page holding the last of them is the load's whole, its
    /// later tokens too (a write there rewrites the page beside the load).
    fn touches(&self, start: usize, tokens: usize) -> bool {
        let ps = self.pool.page_size().max(1);
        start / ps < tokens.div_ceil(ps)
    }

    /// Refuses an access to tokens `start..end` that reaches a page of the fenced tokens of a
    /// load that did not settle.
    fn fence(&self, start: usize, end: usize) -> Result<(), CandleKvError> {
        match &self.unsettled {
            Some(f) if start < end && self.touches(start, f.to) && self.touches(f.from, end) => {
                Err(CandleKvError::Unsettled {
                    source: f.source.clone(),
                })
            }
            _ => Ok(()),
        }
    }
}
