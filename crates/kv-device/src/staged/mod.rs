//! The device path, written once over the [`Device`](crate::Device) traits: a KV pool in
//! device memory ([`DeviceKvPool`]), reusable pinned + device staging ([`StagingPool`]), and
//! the staged landing ([`StagedLanding`]): store → pinned staging → copies and scatters on the
//! load stream → a per-layer event the engine's compute stream waits on, with the share step
//! of replicated rows in device memory between them.
//!
//! It runs over CUDA on a GPU and over [`CpuDevice`](crate::CpuDevice) in CI.

mod copy;
mod factory;
mod landing;
mod pool;
mod staging;
pub(crate) mod sync;

pub use copy::{ScatterStrategy, DIRECT_RUNS_MAX};
pub use factory::{StagedLandingFactory, DEFAULT_LEASE_WAIT};
pub use landing::{LandingStats, StagedLanding};
pub use pool::DeviceKvPool;
pub use staging::{StagingLease, StagingPool};
