//! The [`KvStore`](store::KvStore) trait (the in-process [`EmbeddedStore`](store::EmbeddedStore);
//! Mooncake), and the [`Linker`]: the `KvLoader` implementation that plans, reads, saves, and
//! drives the layer counter.

mod linker;
pub(crate) use kv_device::log_every;
pub mod read_plan;
pub mod store;
#[cfg(test)]
mod test_logs;

pub use linker::{
    auto_verify_threads, GroupFallback, Linker, LinkerBuilder, LinkerConfig, LinkerMetrics,
    MetricsSnapshot, PrefixProbe, ReadGranularity, TpGroup, LAYER_LATENCY_BUCKETS_US,
    MAX_READ_PARALLELISM,
};
#[cfg(target_os = "linux")]
pub use linker::{serve_group_store, FormedTpGroup};

/// Re-exported: how keys are prefixed ([`LinkerConfig::namespace`]).
pub use kv_geometry::Namespace;

/// Re-exported: the share-mode choice of [`LinkerConfig::mode`] and what `Auto` decides from.
pub use kv_loader::{Bandwidths, ModeChoice, ShareMode};

/// Re-exported: how the linker shares replicated KV (collectives, staging, mode choice).
pub use dedup_broadcast;

/// Re-exported: the small vectors of [`store::KvStore`]'s signatures (a store written outside
/// kvlink names them through this, without a `smallvec` line of its own).
pub use smallvec;

/// An async engine shares these between tasks and threads: checked when this crate builds.
const _: fn() = || {
    fn movable<T: Send + Sync + 'static>() {}
    movable::<Linker>();
    movable::<PrefixProbe>();
    movable::<MetricsSnapshot>();
    movable::<TpGroup>();
};
