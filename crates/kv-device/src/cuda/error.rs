//! CUDA driver errors as [`DeviceError`]s: the helpers every file of this backend maps its
//! driver calls' failures through (so none of them depends on another for its errors).

use cudarc::driver::DriverError;

use crate::DeviceError;

/// A driver error as a [`DeviceError::Driver`] naming the call that failed.
pub(crate) fn drv(what: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |e| DeviceError::Driver(format!("{what}: {}", driver_error_text(e)))
}

/// `CUDA_ERROR_NAME (description)` for a driver error.
pub(crate) fn driver_error_text(e: DriverError) -> String {
    match e.error_string() {
        Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}
