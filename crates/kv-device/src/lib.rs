//! Where loaded KV bytes land: KV pools ([`KvPool`]), landing of a batch's layer reads
//! ([`LayerLanding`]), and the backends that implement them. The host backend
//! ([`HostKvPool`], [`DirectLanding`]) is always built; the CUDA backend comes behind the
//! feature `cuda`.
//!
//! ```
//! use kv_device::{HostKvPool, KvPool, Residence};
//! use kv_geometry::{KvGeometry, ModelKvSpec, ElementType};
//! let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3), 1, 0).unwrap();
//! let pool = HostKvPool::new(g, 16).unwrap();
//! assert_eq!(pool.residence(), Residence::Host);
//! assert_eq!(pool.regions()[0].1, 16 * 64 * 576);
//! ```

#[cfg(feature = "cuda")]
pub mod cuda;
mod error;
mod host;
mod landing;
mod pool;
mod region;

pub use error::DeviceError;
pub use host::HostKvPool;
pub use landing::{DirectLanding, DirectLandingFactory, LandingFactory, LayerLanding, SaveGather};
pub use pool::{KvPool, Residence};
pub use region::{DeviceEvent, DeviceRegion, HostRow, SharedEvent};
