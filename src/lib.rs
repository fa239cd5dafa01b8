//! kvlink: load a long prompt's cached KV from a Mooncake Store into an LLM server's KV
//! pool layer by layer, and for replicated (MLA) KV read each byte from the store once and
//! share it among the tensor-parallel ranks.
//!
//! This facade re-exports the workspace crates; see `docs/architecture.md` for the shape.
//!
//! Features:
//! - `mock`: [`mock::MockKvLoader`], a scriptable, recording `KvLoader` for an engine's own
//!   tests. One dependency line under `[dev-dependencies]`, e.g. `kvlink = { path =
//!   "../kvlink", features = ["mock"] }` (kvlink is not published on crates.io: depend on it
//!   by path or git).
//! - `testing`: the store's test doubles, `mooncake_linker::store::FaultyStore` (scripted
//!   faults and stalls) and `SimulatedRemoteStore` (a simulation of a remote link).
//! - `cuda`: the CUDA backend of kv-device and the NCCL collective.
//! - `failpoints`: the crates' failpoints (the `fail` crate), for fault-injection tests; off
//!   unless a test turns it on.
//! - `candle`: [`candle`] (the kvlink-candle crate), a layer of the KV pool as candle
//!   tensors for candle engines: `kvlink::candle::{PagedLatentCache, LatentPool, LayerGate}`.

pub use dedup_broadcast;
pub use kv_device;
pub use kv_geometry;
pub use kv_loader;
pub use layerwise_counter;
pub use mooncake_linker;

/// kvlink for candle engines (feature `candle`): a layer of the KV pool as candle tensors,
/// read after the layer's load is ready ([`PagedLatentCache`](candle::PagedLatentCache)), and
/// freshly computed rows written back. The kvlink-candle crate, re-exported.
#[cfg(feature = "candle")]
pub use kvlink_candle as candle;

/// A scriptable, recording [`KvLoader`](kv_loader::KvLoader) for an engine's own tests
/// (feature `mock`).
///
/// ```
/// use kvlink::kv_loader::{BatchId, KvLoader, LookupRequest};
/// use kvlink::mock::{MockKvLoader, MockScript};
/// let mock = MockKvLoader::new(4, MockScript::default());
/// let tokens: Vec<u32> = (0..200).collect();
/// let hit = mock.lookup(&LookupRequest { tokens: &tokens, skip_pages: 0 }).unwrap();
/// assert_eq!(hit.tokens % MockScript::default().page_size as usize, 0);
/// ```
#[cfg(feature = "mock")]
pub mod mock {
    pub use kv_loader::mock::*;
}

/// The engine's share-mode choice, in one crate: `ModeChoice::Fixed(ShareMode::…)` or
/// `ModeChoice::Auto`, set in the linker's configuration.
///
/// ```
/// use kvlink::mooncake_linker::LinkerConfig;
/// use kvlink::{ModeChoice, ShareMode};
/// let cfg = LinkerConfig {
///     mode: ModeChoice::Fixed(ShareMode::SplitAllGather), // or ModeChoice::Auto
///     ..LinkerConfig::default()
/// };
/// assert_eq!(cfg.mode, ModeChoice::Fixed(ShareMode::SplitAllGather));
/// ```
pub use kv_loader::ModeChoice;

/// The share modes, and the bandwidths `ModeChoice::Auto` decides from.
pub use kv_loader::{Bandwidths, ShareMode};
