//! A tiny MLA transformer in candle (DeepSeek-V3's attention, small): seeded random weights,
//! heads sharded across TP ranks, the latent KV replicated.
//!
//! Per layer, for a chunk of tokens at positions `start..start + n`:
//! - `kv = rmsnorm(x) · W_dkv` gives the latent `c_kv = rmsnorm(kv[.., :R])` and the shared
//!   rope key `k_pe = rope(kv[.., R:])`; the row `[c_kv | k_pe]` is **all the cache holds**
//!   (written into the pool, then the layer's rows `0..start + n` are read back from it);
//! - K and V are reconstructed from the latent: `k_nope = c_kv · W_uk`, `v = c_kv · W_uv`
//!   (this rank's heads), `q = rmsnorm(x) · W_q` split into `q_nope | rope(q_pe)`;
//! - `softmax(q_nope·k_noperᵀ + q_pe·k_peᵀ, causal) · v · W_o` is this rank's partial
//!   output; an all-reduce over the TP ranks (summed in rank order) completes it;
//! - residual, then a SwiGLU MLP (replicated), residual; finally `rmsnorm · lm_head`.
//!
//! Exactness: every rank and every path runs the same kernels on the same shapes on the same
//! bytes. Prefill goes in chunks whose boundaries are multiples of `chunk` from token 0 and the
//! engine loads whole chunks of a prefix from the store, so the new tokens fall in exactly the
//! chunks a full recompute would use; and the rows attention reads always come out of the
//! latent cache.

use std::fmt;
use std::sync::{Arc, Barrier, Mutex};

use kvlink_candle::candle_core::{self, DType, Device, Tensor, D};
use kvlink_candle::{CandleKvError, PagedLatentCache};

/// Shapes of the tiny model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads (over all TP ranks).
    pub heads: usize,
    /// Non-rope part of each head's query/key.
    pub qk_nope_dim: usize,
    /// Rope part of each query, and of the one key shared by every head.
    pub rope_dim: usize,
    /// Each head's value size.
    pub v_head_dim: usize,
    /// Latent (compressed KV) size.
    pub kv_lora_rank: usize,
    /// MLP inner size.
    pub ffn: usize,
    /// Vocabulary.
    pub vocab: usize,
}

impl MlaConfig {
    /// 4 layers, hidden 64, 4 heads, latent 32 + rope 16.
    pub fn tiny() -> Self {
        MlaConfig {
            layers: 4,
            hidden: 64,
            heads: 4,
            qk_nope_dim: 16,
            rope_dim: 16,
            v_head_dim: 16,
            kv_lora_rank: 32,
            ffn: 128,
            vocab: 256,
        }
    }

    /// Elements of one cached latent row.
    pub fn latent_width(&self) -> usize {
        self.kv_lora_rank + self.rope_dim
    }
}

/// Why a forward pass stopped.
#[derive(Debug)]
pub enum ModelError {
    /// A tensor operation failed.
    Candle(candle_core::Error),
    /// The latent cache failed; `Load` errors mean the loaded prefix is unusable.
    Cache(CandleKvError),
    /// Another TP rank stopped this step (its own error is on its side).
    Aborted,
    /// Bad configuration.
    Config(String),
}

impl fmt::Display for ModelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelError::Candle(e) => write!(f, "candle: {e}"),
            ModelError::Cache(e) => write!(f, "latent cache: {e}"),
            ModelError::Aborted => f.write_str("aborted by another TP rank"),
            ModelError::Config(s) => write!(f, "config: {s}"),
        }
    }
}

impl std::error::Error for ModelError {}

impl From<candle_core::Error> for ModelError {
    fn from(e: candle_core::Error) -> Self {
        ModelError::Candle(e)
    }
}

impl From<CandleKvError> for ModelError {
    fn from(e: CandleKvError) -> Self {
        ModelError::Cache(e)
    }
}

/// Where a layer's latent rows live while a sequence is computed.
pub trait LatentCache {
    /// Stores layer `layer`'s rows `[n, width]` of tokens `start..start + n`.
    fn write(&mut self, layer: u32, start: usize, rows: &Tensor) -> Result<(), ModelError>;
    /// Layer `layer`'s rows of tokens `0..tokens`, `[tokens, width]` (waits for a load).
    fn read(&self, layer: u32, tokens: usize) -> Result<Tensor, ModelError>;
}

impl LatentCache for PagedLatentCache {
    fn write(&mut self, layer: u32, start: usize, rows: &Tensor) -> Result<(), ModelError> {
        Ok(PagedLatentCache::write(self, layer, start, rows)?)
    }
    fn read(&self, layer: u32, tokens: usize) -> Result<Tensor, ModelError> {
        Ok(self.layer(layer, tokens)?)
    }
}

/// A plain in-memory latent cache (one growing tensor per layer), for a reference pass that
/// never touches a pool.
pub struct MemLatents {
    layers: Mutex<Vec<Option<Tensor>>>,
}

impl MemLatents {
    /// An empty cache of `layers` layers.
    pub fn new(layers: usize) -> Self {
        MemLatents {
            layers: Mutex::new(vec![None; layers]),
        }
    }
}

impl LatentCache for MemLatents {
    fn write(&mut self, layer: u32, start: usize, rows: &Tensor) -> Result<(), ModelError> {
        let mut g = self
            .layers
            .lock()
            .map_err(|_| ModelError::Config("poisoned".into()))?;
        let slot = g
            .get_mut(layer as usize)
            .ok_or_else(|| ModelError::Config(format!("no layer {layer}")))?;
        let have = slot.as_ref().map_or(0, |t| t.dims()[0]);
        if have != start {
            return Err(ModelError::Config(format!(
                "append at {start} to a cache of {have}"
            )));
        }
        *slot = Some(match slot.take() {
            None => rows.clone(),
            Some(t) => Tensor::cat(&[&t, rows], 0)?,
        });
        Ok(())
    }

    fn read(&self, layer: u32, tokens: usize) -> Result<Tensor, ModelError> {
        let g = self
            .layers
            .lock()
            .map_err(|_| ModelError::Config("poisoned".into()))?;
        let t = g
            .get(layer as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::Config(format!("layer {layer} empty")))?;
        Ok(t.narrow(0, 0, tokens)?)
    }
}

/// The TP group of the engine's own collectives (ranks are threads): a sum all-reduce in
/// rank order (so every rank, and every run, adds the same numbers in the same order) and
/// an agreement. A rank that failed contributes nothing and every rank gets `Aborted`, so
/// no rank is left waiting in a later collective (the rule kvlink's linker keeps too).
pub struct Comm {
    parts: Mutex<Vec<Option<Option<Tensor>>>>,
    barrier: Barrier,
}

impl Comm {
    /// A group of `size` ranks.
    pub fn new(size: usize) -> Arc<Self> {
        Arc::new(Comm {
            parts: Mutex::new(vec![None; size]),
            barrier: Barrier::new(size),
        })
    }

    fn round(&self, rank: usize, part: Option<Tensor>) -> Result<Vec<Tensor>, ModelError> {
        if let Ok(mut p) = self.parts.lock() {
            if let Some(slot) = p.get_mut(rank) {
                *slot = Some(part);
            }
        }
        self.barrier.wait();
        let all: Option<Vec<Tensor>> = match self.parts.lock() {
            Ok(p) => p.iter().map(|x| x.clone().flatten()).collect(),
            Err(_) => None,
        };
        // Nobody writes the next round before everyone has read this one.
        self.barrier.wait();
        all.ok_or(ModelError::Aborted)
    }

    /// Sum over ranks, in rank order; `None` aborts the step on every rank.
    pub fn all_reduce(&self, rank: usize, part: Option<Tensor>) -> Result<Tensor, ModelError> {
        let parts = self.round(rank, part)?;
        let mut it = parts.into_iter();
        let mut sum = it
            .next()
            .ok_or_else(|| ModelError::Config("empty group".into()))?;
        for p in it {
            sum = (sum + p)?;
        }
        Ok(sum)
    }

    /// `Ok` when every rank says `ok`.
    pub fn agree(&self, rank: usize, ok: bool) -> Result<(), ModelError> {
        let token = if ok {
            Some(Tensor::zeros(1, DType::U8, &Device::Cpu)?)
        } else {
            None
        };
        self.round(rank, token).map(|_| ())
    }
}

/// SplitMix64: the seeded source of every weight and token.
pub struct SplitMix(u64);

impl SplitMix {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// `count` seeded token ids below `vocab`.
pub fn random_tokens(seed: u64, count: usize, vocab: usize) -> Vec<u32> {
    let mut r = SplitMix::new(seed ^ 0x746f_6b65_6e73);
    (0..count)
        .map(|_| (r.next_u64() % vocab as u64) as u32)
        .collect()
}

fn random(
    seed: u64,
    name: &str,
    shape: (usize, usize),
    scale: f32,
    dev: &Device,
) -> Result<Tensor, ModelError> {
    let mut s = seed;
    for b in name.bytes() {
        s = s.rotate_left(7) ^ u64::from(b);
    }
    let mut r = SplitMix::new(s);
    let data: Vec<f32> = (0..shape.0 * shape.1).map(|_| r.unit() * scale).collect();
    Ok(Tensor::from_vec(data, shape, dev)?)
}

fn norm_weight(seed: u64, name: &str, n: usize, dev: &Device) -> Result<Tensor, ModelError> {
    Ok((random(seed, name, (1, n), 0.1, dev)? + 1.0)?.reshape(n)?)
}

/// One layer's weights as one TP rank holds them (its heads of W_q, W_uk, W_uv, W_o).
struct Layer {
    attn_norm: Tensor,
    w_q: Tensor,
    w_dkv: Tensor,
    kv_norm: Tensor,
    w_uk: Tensor,
    w_uv: Tensor,
    w_o: Tensor,
    mlp_norm: Tensor,
    w_gate: Tensor,
    w_up: Tensor,
    w_down: Tensor,
}

/// The model as one TP rank runs it.
pub struct RankModel {
    /// Shapes.
    pub cfg: MlaConfig,
    /// This rank.
    pub rank: usize,
    /// Heads on this rank.
    pub local_heads: usize,
    embed: Tensor,
    layers: Vec<Layer>,
    final_norm: Tensor,
    lm_head: Tensor,
    dev: Device,
}

impl RankModel {
    /// Rank `rank` of `tp`'s share of the model seeded by `seed` (every rank draws the same
    /// full weights and keeps its heads).
    pub fn new(cfg: MlaConfig, seed: u64, tp: usize, rank: usize) -> Result<Self, ModelError> {
        if tp == 0 || !cfg.heads.is_multiple_of(tp) || rank >= tp || !cfg.rope_dim.is_multiple_of(2)
        {
            return Err(ModelError::Config(format!(
                "{} heads over {tp} ranks (rank {rank}), rope dim {}",
                cfg.heads, cfg.rope_dim
            )));
        }
        let dev = Device::Cpu;
        let d = cfg.hidden;
        let hl = cfg.heads / tp;
        let qk = cfg.qk_nope_dim + cfg.rope_dim;
        let inv = |n: usize| 1.0 / (n as f32).sqrt();
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let n = |s: &str| format!("layer{l}.{s}");
            // Full weights, then this rank's columns (or rows, for W_o) of its heads.
            let shard = |t: Tensor, dim: usize, per_head: usize| -> Result<Tensor, ModelError> {
                Ok(t.narrow(dim, rank * hl * per_head, hl * per_head)?
                    .contiguous()?)
            };
            layers.push(Layer {
                attn_norm: norm_weight(seed, &n("attn_norm"), d, &dev)?,
                w_q: shard(
                    random(seed, &n("w_q"), (d, cfg.heads * qk), inv(d), &dev)?,
                    1,
                    qk,
                )?,
                w_dkv: random(seed, &n("w_dkv"), (d, cfg.latent_width()), inv(d), &dev)?,
                kv_norm: norm_weight(seed, &n("kv_norm"), cfg.kv_lora_rank, &dev)?,
                w_uk: shard(
                    random(
                        seed,
                        &n("w_uk"),
                        (cfg.kv_lora_rank, cfg.heads * cfg.qk_nope_dim),
                        inv(cfg.kv_lora_rank),
                        &dev,
                    )?,
                    1,
                    cfg.qk_nope_dim,
                )?,
                w_uv: shard(
                    random(
                        seed,
                        &n("w_uv"),
                        (cfg.kv_lora_rank, cfg.heads * cfg.v_head_dim),
                        inv(cfg.kv_lora_rank),
                        &dev,
                    )?,
                    1,
                    cfg.v_head_dim,
                )?,
                w_o: shard(
                    random(
                        seed,
                        &n("w_o"),
                        (cfg.heads * cfg.v_head_dim, d),
                        inv(cfg.heads * cfg.v_head_dim),
                        &dev,
                    )?,
                    0,
                    cfg.v_head_dim,
                )?,
                mlp_norm: norm_weight(seed, &n("mlp_norm"), d, &dev)?,
                w_gate: random(seed, &n("w_gate"), (d, cfg.ffn), inv(d), &dev)?,
                w_up: random(seed, &n("w_up"), (d, cfg.ffn), inv(d), &dev)?,
                w_down: random(seed, &n("w_down"), (cfg.ffn, d), inv(cfg.ffn), &dev)?,
            });
        }
        Ok(RankModel {
            cfg,
            rank,
            local_heads: hl,
            embed: random(seed, "embed", (cfg.vocab, d), 1.0, &dev)?,
            layers,
            final_norm: norm_weight(seed, "final_norm", d, &dev)?,
            lm_head: random(seed, "lm_head", (d, cfg.vocab), inv(d), &dev)?,
            dev,
        })
    }

    /// Logits `[n, vocab]` of a chunk of `tokens` at positions `start..start + n`, whose
    /// earlier tokens' latents are in `cache`; the chunk's own latents are written there.
    /// Every rank of `comm` must call this for the same chunk.
    pub fn forward_chunk(
        &self,
        comm: &Comm,
        cache: &mut dyn LatentCache,
        tokens: &[u32],
        start: usize,
    ) -> Result<Tensor, ModelError> {
        // A local failure is carried to the next collective, which it aborts on every rank.
        let mut failed: Option<ModelError> = None;
        let mut x = match self.embed(tokens) {
            Ok(x) => Some(x),
            Err(e) => {
                failed = Some(e);
                None
            }
        };
        let rope = self.rope_tables(start, tokens.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let part = match (&x, &rope, &failed) {
                (Some(x), Ok(rope), None) => {
                    match self.attention(l as u32, layer, x, rope, cache, start) {
                        Ok(p) => Some(p),
                        Err(e) => {
                            failed = Some(e);
                            None
                        }
                    }
                }
                _ => None,
            };
            let attn = comm
                .all_reduce(self.rank, part)
                .map_err(|e| failed.take().unwrap_or(e))?;
            let Some(xv) = x.take() else {
                return Err(ModelError::Aborted);
            };
            match self.mlp(layer, &(xv + attn)?) {
                Ok(nx) => x = Some(nx),
                Err(e) => failed = Some(e),
            }
        }
        let logits = match (x, failed.take()) {
            (Some(x), None) => self.head(&x),
            (_, Some(e)) => Err(e),
            (None, None) => Err(ModelError::Aborted),
        };
        match comm.agree(self.rank, logits.is_ok()) {
            Ok(()) => logits,
            Err(aborted) => Err(logits.err().unwrap_or(aborted)),
        }
    }

    fn embed(&self, tokens: &[u32]) -> Result<Tensor, ModelError> {
        let ids = Tensor::from_vec(tokens.to_vec(), tokens.len(), &self.dev)?;
        Ok(self.embed.index_select(&ids, 0)?)
    }

    /// cos and sin `[n, rope_dim / 2]` of positions `start..start + n` (computed per
    /// position, so a position's table does not depend on the chunk).
    fn rope_tables(&self, start: usize, n: usize) -> Result<(Tensor, Tensor), ModelError> {
        let half = self.cfg.rope_dim / 2;
        let mut cos = Vec::with_capacity(n * half);
        let mut sin = Vec::with_capacity(n * half);
        for p in start..start + n {
            for i in 0..half {
                let inv_freq = 10_000f64.powf(-(2.0 * i as f64) / self.cfg.rope_dim as f64);
                let a = p as f64 * inv_freq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Ok((
            Tensor::from_vec(cos, (n, half), &self.dev)?,
            Tensor::from_vec(sin, (n, half), &self.dev)?,
        ))
    }

    /// Rotates the last dimension of `x` (`[.., n, rope_dim]`), rotate-half form.
    fn rope(x: &Tensor, (cos, sin): &(Tensor, Tensor)) -> Result<Tensor, ModelError> {
        let half = x.dim(D::Minus1)? / 2;
        let x1 = x.narrow(D::Minus1, 0, half)?;
        let x2 = x.narrow(D::Minus1, half, half)?;
        let a = (x1.broadcast_mul(cos)? - x2.broadcast_mul(sin)?)?;
        let b = (x1.broadcast_mul(sin)? + x2.broadcast_mul(cos)?)?;
        Ok(Tensor::cat(&[a, b], D::Minus1)?)
    }

    fn rms_norm(x: &Tensor, w: &Tensor) -> Result<Tensor, ModelError> {
        let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
        Ok(x.broadcast_div(&(ms + 1e-6)?.sqrt()?)?.broadcast_mul(w)?)
    }

    fn softmax(x: &Tensor) -> Result<Tensor, ModelError> {
        let m = x.max_keepdim(D::Minus1)?;
        let e = x.broadcast_sub(&m)?.exp()?;
        Ok(e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?)
    }

    /// This rank's partial attention output `[n, hidden]` for layer `l`.
    fn attention(
        &self,
        l: u32,
        w: &Layer,
        x: &Tensor,
        rope: &(Tensor, Tensor),
        cache: &mut dyn LatentCache,
        start: usize,
    ) -> Result<Tensor, ModelError> {
        let c = &self.cfg;
        let n = x.dim(0)?;
        let total = start + n;
        let hl = self.local_heads;
        let h = Self::rms_norm(x, &w.attn_norm)?;

        // The latent of the new tokens: all the cache keeps. Into the pool it goes...
        let kv = h.matmul(&w.w_dkv)?;
        let c_kv = Self::rms_norm(&kv.narrow(1, 0, c.kv_lora_rank)?, &w.kv_norm)?;
        let k_pe = Self::rope(&kv.narrow(1, c.kv_lora_rank, c.rope_dim)?, rope)?;
        cache.write(l, start, &Tensor::cat(&[c_kv, k_pe], 1)?)?;
        // ...and every token's latent, loaded prefix and new rows alike, comes back out of it.
        let latent = cache.read(l, total)?;
        let c_all = latent.narrow(1, 0, c.kv_lora_rank)?;
        let kpe_all = latent.narrow(1, c.kv_lora_rank, c.rope_dim)?;

        // K and V of this rank's heads, reconstructed from the latent.
        let heads = |t: Tensor, len: usize, dim: usize| -> Result<Tensor, ModelError> {
            Ok(t.reshape((len, hl, dim))?.transpose(0, 1)?.contiguous()?)
        };
        let k_nope = heads(c_all.matmul(&w.w_uk)?, total, c.qk_nope_dim)?;
        let v = heads(c_all.matmul(&w.w_uv)?, total, c.v_head_dim)?;
        let q = heads(h.matmul(&w.w_q)?, n, c.qk_nope_dim + c.rope_dim)?;
        let q_nope = q.narrow(2, 0, c.qk_nope_dim)?.contiguous()?;
        let q_pe = Self::rope(&q.narrow(2, c.qk_nope_dim, c.rope_dim)?, rope)?;

        let scale = 1.0 / ((c.qk_nope_dim + c.rope_dim) as f64).sqrt();
        let nope = q_nope.matmul(&k_nope.transpose(1, 2)?.contiguous()?)?;
        let pe = q_pe
            .reshape((hl * n, c.rope_dim))?
            .matmul(&kpe_all.t()?.contiguous()?)?
            .reshape((hl, n, total))?;
        let mask: Vec<f32> = (0..n)
            .flat_map(|i| {
                (0..total).map(move |j| {
                    if j <= start + i {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (n, total), &self.dev)?;
        let scores = ((nope + pe)? * scale)?.broadcast_add(&mask)?;
        let out = Self::softmax(&scores)?.matmul(&v)?; // [hl, n, v_head_dim]
        let out = out
            .transpose(0, 1)?
            .contiguous()?
            .reshape((n, hl * c.v_head_dim))?;
        Ok(out.matmul(&w.w_o)?)
    }

    fn mlp(&self, w: &Layer, x: &Tensor) -> Result<Tensor, ModelError> {
        let h = Self::rms_norm(x, &w.mlp_norm)?;
        let m = (h.matmul(&w.w_gate)?.silu()? * h.matmul(&w.w_up)?)?.matmul(&w.w_down)?;
        Ok((x + m)?)
    }

    fn head(&self, x: &Tensor) -> Result<Tensor, ModelError> {
        Ok(Self::rms_norm(x, &self.final_norm)?.matmul(&self.lm_head)?)
    }
}

/// Prefills `tokens[from..]` in chunks whose boundaries are multiples of `chunk` counted from
/// token 0, on top of the latents of `tokens[..from]` already in `cache`; the logits of
/// `tokens[from..]`, `[len - from, vocab]`.
pub fn prefill(
    model: &RankModel,
    comm: &Comm,
    cache: &mut dyn LatentCache,
    tokens: &[u32],
    from: usize,
    chunk: usize,
) -> Result<Tensor, ModelError> {
    if chunk == 0 || from >= tokens.len() {
        return Err(ModelError::Config(format!(
            "prefill of tokens {from}..{} in chunks of {chunk}",
            tokens.len()
        )));
    }
    let mut out = Vec::new();
    let mut c0 = from;
    while c0 < tokens.len() {
        let c1 = ((c0 / chunk + 1) * chunk).min(tokens.len());
        out.push(model.forward_chunk(comm, cache, &tokens[c0..c1], c0)?);
        c0 = c1;
    }
    Ok(Tensor::cat(&out, 0)?)
}

/// Largest |a - b| over two tensors of one shape (f32).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32, ModelError> {
    if a.dims() != b.dims() {
        return Err(ModelError::Config(format!(
            "shapes {:?} and {:?}",
            a.dims(),
            b.dims()
        )));
    }
    Ok((a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// True when two f32 tensors are equal bit for bit.
pub fn bit_identical(a: &Tensor, b: &Tensor) -> Result<bool, ModelError> {
    if a.dims() != b.dims() {
        return Ok(false);
    }
    let x = a.flatten_all()?.to_vec1::<f32>()?;
    let y = b.flatten_all()?.to_vec1::<f32>()?;
    Ok(x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()))
}
