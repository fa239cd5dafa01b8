//! The Mooncake Store backend: [`MooncakeStore`] implements [`KvStore`](super::KvStore) on a
//! real Mooncake cluster through `mooncake-sys` (the kvlink shim over the PyPI wheel's client,
//! loaded at run time).
//!
//! ```no_run
//! use mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
//! use mooncake_linker::store::KvStore;
//! // MOONCAKE_MASTER=127.0.0.1:50051 and friends, as SGLang reads them (see MooncakeConfig).
//! let store = MooncakeStore::connect(MooncakeConfig::from_env()?)?;
//! store.health()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! Running one locally: `scripts/mooncake-build-shim.sh` (wheel + shim), then
//! `scripts/with-mooncake.sh CMD` runs CMD next to a master on 127.0.0.1 in a private network
//! namespace, with the `MOONCAKE_*` environment set.

mod bounce;
mod config;
mod gate;
mod parts;
mod ranges;
mod read;
mod registry;
mod sessions;
mod store;

pub use config::{
    auto_read_streams, parse_size, MooncakeConfig, MooncakeConfigError,
    DEFAULT_GLOBAL_SEGMENT_SIZE, DEFAULT_LEASE, DEFAULT_LOCAL_BUFFER_SIZE, DEFAULT_TENANT,
    MAX_READ_STREAMS, MIN_LEASE,
};
pub use gate::{TRANSFER_WAIT, UNREGISTER_WAIT};
pub use mooncake_sys::ReplicateConfig;
pub use store::{code_error, store_error, MooncakeStore, MAX_WHOLE_READS_PER_CALL};
