//! The CUDA backend (feature `cuda`), through cudarc loaded at run time: [`CudaDevice`]
//! implements the [`Device`](crate::Device) traits (async copies and the row-copy kernel on
//! CUDA streams, [`CudaLayerEvent`] as the event), so the device path of this crate
//! ([`DeviceKvPool`](crate::DeviceKvPool), [`StagingPool`](crate::StagingPool),
//! [`StagedLanding`](crate::StagedLanding)) runs on a GPU. The row-copy kernel ([`Kernels`])
//! is compiled by NVRTC at run time, or loaded from the PTX shipped in the binary.
//!
//! Every constructor checks first that the driver library is present
//! ([`cuda_device_count`]); a machine without it, or without a device, gets an error for
//! which [`DeviceError::is_unavailable`] is true (cudarc itself would panic).
//!
//! Files, each depending only on those before it: `library` (whether a CUDA library loads),
//! `error` (driver errors as
//! [`DeviceError`]s), `current` (our context current for a call, the thread's own restored
//! after), `memory`, `kernels` (and the per-context kernel cache), `event`, `stream`,
//! `device`.
//!
//! [`DeviceError`]: crate::DeviceError
//! [`DeviceError::Unavailable`]: crate::DeviceError::Unavailable
//! [`DeviceError::is_unavailable`]: crate::DeviceError::is_unavailable

mod current;
mod device;
pub(crate) mod error;
mod event;
mod kernels;
mod library;
mod memory;
mod stream;

pub use device::{cuda_device_count, CudaDevice};
pub use event::CudaLayerEvent;
pub use kernels::{KernelSource, Kernels, COPY_ROWS_PTX, COPY_ROWS_SRC};
pub use library::CudaLibrary;
pub use memory::{DeviceBuffer, PinnedBuffer};

/// The device KV pool on a GPU: [`DeviceKvPool`](crate::DeviceKvPool) over a [`CudaDevice`].
pub type CudaKvPool = crate::DeviceKvPool;

/// The cudarc this backend is built on (engines name its types through this re-export).
pub use cudarc;
