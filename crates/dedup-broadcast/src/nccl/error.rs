//! NCCL result codes as text (cudarc's `NcclError` has no `Display`).

use std::ffi::CStr;

use cudarc::nccl::sys;

use crate::CollectiveError;

/// The name of an NCCL result code, e.g. `"ncclRemoteError"`.
pub fn nccl_result_name(code: sys::ncclResult_t) -> String {
    format!("{code:?}")
}

/// NCCL's own description of a result code (`ncclGetErrorString`).
pub(crate) fn nccl_result_text(code: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a pointer to a static NUL-terminated string (or
    // null), for any code; we copy it out at once.
    let p = unsafe { sys::ncclGetErrorString(code) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The communicator's last error message (`ncclGetLastError`), if any.
pub(crate) fn nccl_last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: ncclGetLastError accepts a live communicator or null and returns a pointer to a
    // NUL-terminated string owned by NCCL, valid until the next NCCL call on this thread; we
    // copy it out at once.
    let p = unsafe { sys::ncclGetLastError(comm) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// An NCCL failure of `call` as a [`CollectiveError::Backend`]: the code's name, NCCL's text
/// for it, and the communicator's last error message.
pub(crate) fn nccl_error(
    call: &str,
    code: sys::ncclResult_t,
    comm: sys::ncclComm_t,
) -> CollectiveError {
    let last = nccl_last_error(comm);
    let last = if last.is_empty() {
        String::new()
    } else {
        format!("; last error: {last}")
    };
    CollectiveError::Backend(format!(
        "{call}: {} ({}){last}",
        nccl_result_name(code),
        nccl_result_text(code)
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_code() {
        assert_eq!(
            nccl_result_name(sys::ncclResult_t::ncclRemoteError),
            "ncclRemoteError"
        );
        assert_eq!(
            nccl_result_name(sys::ncclResult_t::ncclInvalidUsage),
            "ncclInvalidUsage"
        );
    }
}
