//! kvlink's CUDA backend beside an engine's cudarc built with `dynamic-linking` (see
//! Cargo.toml): it must build, and ask whether the driver is there without cudarc's
//! loader-only `is_culib_present`.

/// The devices kvlink's CUDA backend sees (an engine's first call).
pub fn devices() -> Result<u32, kvlink::kv_device::DeviceError> {
    kvlink::kv_device::cuda::cuda_device_count()
}
