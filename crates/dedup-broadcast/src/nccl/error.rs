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

/// NCCL's last error message (`ncclGetLastError`), if any. NCCL keeps one for the whole
/// process (it ignores `comm`) and never clears it: the text may be another communicator's
/// or an earlier failure's, and another thread may be rewriting it as it is read (a torn
/// text); it is quoted as a hint, labelled so.
pub(crate) fn nccl_last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: ncclGetLastError accepts a live communicator or null and returns a pointer to
    // NCCL's static message buffer of `LAST_ERROR_BYTES` bytes (or null).
    let p = unsafe { sys::ncclGetLastError(comm) };
    if p.is_null() {
        return String::new();
    }
    // Copied out byte by byte with volatile reads, never through a reference: another thread
    // (NCCL's own, or another communicator's) may rewrite the buffer meanwhile, which a `&CStr`
    // over it would forbid. Bounded by the buffer's size, whatever its terminator does.
    let mut text = Vec::new();
    for i in 0..LAST_ERROR_BYTES {
        // SAFETY: `p + i` lies inside NCCL's static buffer (`i` < its size), which lives for
        // the process, and no Rust reference covers it. A write by another thread of NCCL at
        // the same time would race this read: Rust's model leaves a race undefined, even a
        // volatile one, so this rests on what a one-byte volatile load does on the platforms
        // NCCL runs on (it reads some byte; every byte is a valid `u8`). The text may come out
        // garbled, and is quoted as a hint only. It is read right after the failing call on
        // the thread that made it, when NCCL's own threads have no cause to write it.
        let byte = unsafe { std::ptr::read_volatile(p.cast::<u8>().add(i)) };
        if byte == 0 {
            break;
        }
        text.push(byte);
    }
    String::from_utf8_lossy(&text).into_owned()
}

/// The size of NCCL's last-error buffer (`ncclLastError[1024]` in NCCL's debug.cc), NUL
/// included: a text that reaches it is cut there.
const LAST_ERROR_BYTES: usize = 1024;

/// An NCCL failure of `call` as a [`CollectiveError::Backend`]: the code's name, NCCL's text
/// for it, and NCCL's last error message (process-wide: [`nccl_last_error`]).
pub(crate) fn nccl_error(
    call: &str,
    code: sys::ncclResult_t,
    comm: sys::ncclComm_t,
) -> CollectiveError {
    let last = nccl_last_error(comm);
    let last = if last.is_empty() {
        String::new()
    } else {
        format!("; NCCL's last error in this process (may be another communicator's): {last}")
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
