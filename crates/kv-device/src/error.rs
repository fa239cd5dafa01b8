//! Device-side errors.

/// What went wrong with pool memory, staging, copies or events.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// A driver call failed.
    #[error("driver: {0}")]
    Driver(String),
}

impl From<DeviceError> for kv_loader::KvLoadError {
    fn from(e: DeviceError) -> Self {
        kv_loader::KvLoadError::Device(e.to_string())
    }
}
