//! The CUDA backend (feature `cuda`), through cudarc loaded at run time: device KV pools
//! ([`CudaKvPool`]), a reusable pinned staging pool ([`StagingPool`]), the staged landing
//! ([`StagedLanding`]: store → pinned staging → async copies on a load stream → a per-layer
//! [`CudaLayerEvent`] the engine's compute stream waits on), and the row-copy kernel
//! ([`Kernels`], NVRTC at run time or the PTX shipped in the binary).
//!
//! Every constructor checks first that the driver library is present
//! ([`cuda_device_count`]); a machine without it gets [`DeviceError::Unavailable`]
//! (cudarc itself would panic).
//!
//! [`DeviceError::Unavailable`]: crate::DeviceError::Unavailable

mod device;
mod event;
mod kernels;
mod landing;
mod memory;
mod pool;
mod staging;

pub use device::{cuda_device_count, CudaDevice};
pub use event::CudaLayerEvent;
pub use kernels::{KernelSource, Kernels, RowCopy, COPY_ROWS_PTX, COPY_ROWS_SRC};
pub use landing::{
    LandingStats, ScatterStrategy, StagedLanding, StagedLandingFactory, DIRECT_RUNS_MAX,
};
pub use memory::{DeviceBuffer, PinnedBuffer};
pub use pool::CudaKvPool;
pub use staging::{StagingLease, StagingPool};

/// The cudarc this backend is built on (engines name its types through this re-export).
pub use cudarc;
