//! Device-side errors.

use std::time::Duration;

/// What went wrong with pool memory, staging, copies or events.
///
/// Non-exhaustive: the `cuda` feature adds variants, and a feature another crate of the build
/// turns on must not break a `match` written without it; match the cases you handle and keep
/// a `_` arm (or ask [`is_unavailable`](Self::is_unavailable)).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// A (component, layer, slot) outside the pool.
    #[error("no slice for component #{component}, layer {layer}, slot {slot}: {reason}")]
    OutOfPool {
        /// Component id.
        component: u16,
        /// Layer.
        layer: u32,
        /// Slot.
        slot: u32,
        /// Why.
        reason: &'static str,
    },
    /// A batch's layer needs more bytes than a staging stage holds (the staging pool was sized
    /// for fewer pages: [`StagingPool::max_batch_pages`](crate::StagingPool::max_batch_pages)).
    /// Nothing was started: the batch can be recomputed, no reset needed.
    #[error("layer {layer} of this batch needs {need} bytes of staging, a stage holds {stage}")]
    StageTooSmall {
        /// The first layer that does not fit.
        layer: u32,
        /// Its bytes.
        need: u64,
        /// A stage's bytes.
        stage: u64,
    },
    /// Memory could not be allocated.
    #[error("could not allocate {bytes} bytes of {what}")]
    Alloc {
        /// Bytes asked for.
        bytes: u64,
        /// What for.
        what: &'static str,
    },
    /// The backend is not available on this machine (e.g. no CUDA driver).
    #[error("backend unavailable: {0}")]
    Unavailable(String),
    /// An operation this pool or path does not offer (a direct landing into a device pool, a
    /// save read in place from one, slot claims of a pool that keeps none): a caller's choice
    /// of path, not a machine without the backend.
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    /// A device ordinal past the devices this process sees.
    #[error("device {ordinal} does not exist ({visible} visible)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: u32,
        /// Devices visible.
        visible: u32,
    },
    /// CUDA is not available on this machine: the driver is there, but a call that finds the
    /// devices failed (feature `cuda`; `cuInit` with no device visible, say); the driver's
    /// error is the source. [`is_unavailable`](Self::is_unavailable) covers both.
    #[cfg(feature = "cuda")]
    #[error("backend unavailable: CUDA: {call}: {}", crate::cuda::error::describe(.source))]
    CudaUnavailable {
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A driver call failed (the CPU device's injected failures; the CUDA backend's calls
    /// that report no driver code, such as an NVRTC compile).
    #[error("driver: {0}")]
    Driver(String),
    /// A CUDA driver call failed (feature `cuda`); the driver's error is the source.
    #[cfg(feature = "cuda")]
    #[error("driver: {call}: {}", crate::cuda::error::describe(.source))]
    Cuda {
        /// The driver call.
        call: &'static str,
        /// The driver's error.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// A stream was asked to wait on an event of another backend.
    #[error("event of another backend: {0}")]
    ForeignEvent(String),
    /// A bounded wait for device work ran out.
    #[error("{what}: device work not finished after {waited:?}")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: Duration,
    },
    /// Staging that device work may still use (a wait for it timed out, or a collective on it
    /// was aborted): it is never reused nor freed until that work is known to be done. Also a
    /// pool's synchronous copy refused while an earlier one (past its limit) has not ended:
    /// the load stream is stuck; it clears once that copy ends (or rebuild the pool). After a
    /// copy whose wait failed outright (its stream failed: a CUDA error that leaves the
    /// context unusable, say) the pool's synchronous copies, slot-table uploads included, are
    /// refused for good: rebuild the pool (and, on CUDA, the device).
    #[error("staging poisoned: {0}")]
    Poisoned(&'static str),
    /// A stage or row block used against the rules (another batch's stage, a layer not open,
    /// a block outside the share area).
    #[error("invalid stage use: {0}")]
    InvalidStage(&'static str),
    /// A page slot kvlink's own paths cannot take now: a landing writes it while a save would
    /// read it or another landing write it (two batches in flight on one slot), or a save
    /// reads it while a landing would write it.
    #[error("page slot {slot} is busy: {reason}")]
    SlotBusy {
        /// The slot.
        slot: u32,
        /// Who holds it.
        reason: &'static str,
    },
    /// The stage is lent to a store read that has not returned (its
    /// [`StageLoan`](crate::StageLoan) is still out): nothing else may touch its memory yet.
    #[error("{0}: the stage is lent to a store read that has not returned")]
    Lent(&'static str),
}

impl DeviceError {
    /// True when the backend itself is not available on this machine (no driver, no device,
    /// no kernel compiler): a caller may fall back to another backend or path; any other
    /// error is a failure of a backend that is there.
    pub fn is_unavailable(&self) -> bool {
        match self {
            DeviceError::Unavailable(_) => true,
            #[cfg(feature = "cuda")]
            DeviceError::CudaUnavailable { .. } => true,
            _ => false,
        }
    }
}

impl From<DeviceError> for kv_loader::KvLoadError {
    fn from(e: DeviceError) -> Self {
        kv_loader::KvLoadError::Device(kv_loader::Cause::from_error(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_missing_backend_is_unavailable() {
        assert!(DeviceError::Unavailable("no driver".into()).is_unavailable());
        let busy = DeviceError::SlotBusy {
            slot: 3,
            reason: "a save reads it",
        };
        assert!(!busy.is_unavailable());
        assert!(!DeviceError::Driver("injected".into()).is_unavailable());
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn a_failed_cuinit_keeps_the_drivers_error() {
        use cudarc::driver::{sys::CUresult, DriverError};
        use std::error::Error;
        let e = DeviceError::CudaUnavailable {
            call: "cuInit",
            source: DriverError(CUresult::CUDA_ERROR_NO_DEVICE),
        };
        assert!(e.is_unavailable());
        assert!(e.to_string().contains("cuInit"), "{e}");
        assert!(e.to_string().contains("CUDA_ERROR_NO_DEVICE"), "{e}");
        let source = e.source().expect("the driver's error is kept");
        assert_eq!(
            source.downcast_ref::<DriverError>(),
            Some(&DriverError(CUresult::CUDA_ERROR_NO_DEVICE))
        );
    }
}
