//! Where loaded KV bytes land: KV pools ([`KvPool`]), landing of a batch's layer reads
//! ([`LayerLanding`]), and the backends that implement them.
//!
//! - The host backend ([`HostKvPool`], [`DirectLanding`]): reads go straight into pool slots.
//! - The device path ([`DeviceKvPool`], [`StagingPool`], [`StagedLanding`]), written once over
//!   the device traits ([`Device`], [`Stream`], [`DeviceEvent`]): pinned staging, copies and
//!   scatters on a load stream ordered by events, and the share step of replicated rows in
//!   device memory. Two backends implement the traits: CUDA (feature `cuda`) and
//!   [`CpuDevice`], which runs the device path in host memory (CI).
//!
//! ```
//! use kv_device::{HostKvPool, KvPool, Residence};
//! use kv_geometry::{KvGeometry, ModelKvSpec, ElementType};
//! let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3), 1, 0).unwrap();
//! let pool = HostKvPool::new(g, 16).unwrap();
//! assert_eq!(pool.residence(), Residence::Host);
//! assert_eq!(pool.regions()[0].1, 16 * 64 * 576);
//! ```

mod backend;
mod claims;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod host;
mod landing;
#[doc(hidden)]
pub mod log_every;
mod pool;
mod region;
#[cfg(test)]
mod scripted_event;
mod source;
mod staged;

pub use backend::{Device, DeviceMemory, PinnedMemory, RowCopy, Stream, Transfer};
pub use claims::{ReadClaim, ReadClaims, SlotClaims, WriteClaim};
pub use cpu::{CpuDevice, CpuDeviceConfig};
pub use error::DeviceError;
pub use host::{zeroed_bytes, HostKvPool};
pub use landing::{
    first_overlap, BatchShape, DeviceShare, DeviceStage, DirectLanding, DirectLandingFactory,
    HostRows, HostShare, LandingFactory, LayerLanding, LayerStage, ReadTarget, RowBlock,
    SaveGather, SharePath, ShareSide, StageLoan, EARLIER_SETTLE_TIMED_OUT,
};
pub use pool::{KvPool, Residence};
pub use region::{first_overlap_by, DeviceEvent, DeviceRegion, HostRow, SharedEvent, StoreRegion};
pub use source::SaveSource;
pub use staged::{
    DeviceKvPool, LandingStats, ScatterStrategy, StagedLanding, StagedLandingFactory, StagingLease,
    StagingPool, DEFAULT_LEASE_WAIT, DIRECT_RUNS_MAX,
};
