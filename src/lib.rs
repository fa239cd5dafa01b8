//! kvlink: load a long prompt's cached KV from a Mooncake Store into an LLM server's KV
//! pool layer by layer, and for replicated (MLA) KV read each byte from the store once and
//! share it among the tensor-parallel ranks.
//!
//! This facade re-exports the workspace crates; see `docs/architecture.md` for the shape.

pub use dedup_broadcast;
pub use kv_device;
pub use kv_geometry;
pub use kv_loader;
pub use layerwise_counter;
pub use mooncake_linker;

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
