//! CUDA driver errors as [`DeviceError`]s: the helpers every file of this backend maps its
//! driver calls' failures through (so none of them depends on another for its errors).

use cudarc::driver::DriverError;

use crate::DeviceError;

/// A driver error as a [`DeviceError::Cuda`] naming the call that failed.
pub(crate) fn drv(call: &'static str) -> impl FnOnce(DriverError) -> DeviceError {
    move |source| DeviceError::Cuda { call, source }
}

/// `CUDA_ERROR_NAME (description)` for a driver error.
pub(crate) fn driver_error_text(e: DriverError) -> String {
    describe(&e)
}

/// `CUDA_ERROR_NAME (description)` for a driver error (the text of [`DeviceError::Cuda`]);
/// the name alone where the driver library is absent (cudarc would panic asking it).
pub(crate) fn describe(e: &DriverError) -> String {
    if !super::CudaLibrary::Driver.loadable() {
        return format!("{:?}", e.0);
    }
    match e.error_string() {
        Ok(s) => format!("{:?} ({})", e.0, s.to_string_lossy()),
        Err(_) => format!("{:?}", e.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;

    #[test]
    fn a_driver_failure_keeps_the_driver_error_as_its_source() {
        let code = DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        let e = drv("cuMemAlloc")(code);
        let source = std::error::Error::source(&e).expect("a source");
        assert_eq!(source.downcast_ref::<DriverError>(), Some(&code));
        let text = e.to_string();
        assert!(
            text.starts_with("driver: cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY"),
            "{text}"
        );
    }
}
