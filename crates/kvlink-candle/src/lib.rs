//! kvlink for candle engines: a layer of kvlink's KV pool as candle tensors.
//!
//! An MLA engine keeps one latent row per token per layer, `[c_kv | k_pe]`
//! (`kv_lora_rank + rope_dim` elements; DeepSeek-V3: 512 + 64). With kvlink that cache *is*
//! a component of the rank's KV pool, and a cached prefix arrives in it layer by layer. This
//! crate gives the engine's attention layers what they need:
//!
//! - [`LatentPool`]: a pool component read as `[tokens, width]` / `[pages, page_size, width]`
//!   tensors for a sequence's page table, and new rows written back into its slots;
//! - [`LayerGate`]: the per-layer wait on a load in flight, through the
//!   [`KvLoader`](kv_loader::KvLoader) trait object;
//! - [`PagedLatentCache`]: one sequence's cache; [`PagedLatentCache::layer`] waits for the
//!   layer, then reads it. A failed load surfaces as [`CandleKvError::Load`]: recompute.
//!
//! The adapter depends on the pool and the trait only; the loader (kvlink's linker, or a
//! mock) is the caller's. On the CPU reads and writes copy between the pool and tensors.
//! docs/integration.md shows the calls of a whole request, in order, and the GPU path.
//!
//! ```
//! use std::sync::Arc;
//! use kv_device::HostKvPool;
//! use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
//! use kvlink_candle::candle_core::{DType, Device, Tensor};
//! use kvlink_candle::{LatentFormat, LatentPool, PagedLatentCache};
//!
//! let format = LatentFormat::new(32, 16, DType::F32).unwrap();
//! let spec = ModelKvSpec::new("tiny-mla", 4, 8, vec![ComponentSpec::new(
//!     "k", RowUnit::Token, ElementType::Bytes, format.row_bytes() as u32)]).unwrap();
//! let pool = Arc::new(HostKvPool::new(KvGeometry::new(spec, 1, 0).unwrap(), 16).unwrap());
//! let latents = LatentPool::new(pool, "k", format, Device::Cpu).unwrap();
//!
//! // A 12-token sequence in slots 9 and 4; prefill writes layer 0's latent, attention reads it.
//! // SAFETY: slots 9 and 4 are this sequence's alone, and no load targets them.
//! let mut cache = unsafe { PagedLatentCache::new(latents, vec![9, 4], 0) };
//! let rows = Tensor::randn(0f32, 1., (12, 48), &Device::Cpu).unwrap();
//! cache.write(0, 0, &rows).unwrap();
//! let (c_kv, k_pe) = format.split(&cache.layer(0, 12).unwrap()).unwrap();
//! assert_eq!((c_kv.dims(), k_pe.dims()), (&[12, 32][..], &[12, 16][..]));
//! ```

mod cache;
mod error;
mod format;
mod gate;
mod pool;
mod recompute;

pub use cache::{PagedLatentCache, LANDED_SLOTS_WAIT};
pub use error::CandleKvError;
pub use format::LatentFormat;
pub use gate::LayerGate;
pub use pool::LatentPool;

/// Re-exported so engines and examples name the same candle.
pub use candle_core;

/// An async engine moves these between tasks and threads: checked when this crate builds.
const _: fn() = || {
    fn movable<T: Send + Sync + 'static>() {}
    movable::<PagedLatentCache>();
    movable::<LayerGate>();
    movable::<LatentPool>();
    movable::<CandleKvError>();
};
