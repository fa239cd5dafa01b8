//! Whether a CUDA library can be loaded, asked before any call through cudarc (which panics
//! when a library it loads at run time is missing).
//!
//! kvlink builds cudarc to load its libraries at run time; an engine whose own cudarc links
//! them instead (candle's `cuda` feature turns on cudarc's `dynamic-linking`, and Cargo
//! merges the two) gets a cudarc without its `is_culib_present`. This probe is kvlink's own,
//! so the CUDA backend builds either way: with linked libraries it finds them loaded already.

/// The names cudarc tries for library `stem` (`cuda`, `nvrtc`, `nccl`) when it loads it at
/// run time, for every CUDA major version cudarc knows, in its order: a library this finds
/// is one cudarc's own loader finds.
///
/// ```
/// let names = kv_device::cuda::library_names("cuda");
/// assert!(names.iter().any(|n| n == "libcuda.so.1"));
/// ```
pub fn library_names(stem: &str) -> Vec<String> {
    use std::env::consts::{DLL_PREFIX as P, DLL_SUFFIX as S};
    let width = usize::BITS;
    let mut names = vec![format!("{P}{stem}{S}"), format!("{P}{stem}{width}{S}")];
    for major in ["13", "12", "11", "10", "9"] {
        names.push(format!("{P}{stem}{width}_{major}{S}"));
        names.push(format!("{P}{stem}{width}_{major}0_0{S}"));
    }
    for version in ["13", "12", "11", "10", "9", "1"] {
        names.push(format!("{P}{stem}{S}.{version}"));
    }
    names
}

/// Whether library `stem` (`cuda`, `nvrtc`, `nccl`) can be loaded under one of
/// [`library_names`]. It calls nothing in the library.
///
/// ```
/// // A name no system has: never found, never a panic.
/// assert!(!kv_device::cuda::library_loadable("kvlink-no-such-library"));
/// ```
pub fn library_loadable(stem: &str) -> bool {
    library_names(stem).iter().any(|name| {
        // SAFETY: loading runs the library's initialisers; the names are the CUDA driver's,
        // NVRTC's and NCCL's, the libraries cudarc itself loads and calls on the next line
        // of every caller, whose initialisers only set up their own state. The handle is
        // dropped at once (the library stays loaded while cudarc holds it).
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every name cudarc 0.19 tries on Linux for the CUDA 13 bindings this crate builds is
    /// tried (`get_lib_name_candidates`: plain, `.so.{major}`, `.so.12` to `.9`, `.so.1`).
    #[test]
    fn the_names_cover_cudarcs_on_linux() {
        let names = library_names("nccl");
        for n in [
            "libnccl.so",
            "libnccl.so.13",
            "libnccl.so.12",
            "libnccl.so.11",
            "libnccl.so.1",
        ] {
            assert!(names.iter().any(|m| m == n), "{n} missing from {names:?}");
        }
    }

    #[test]
    fn an_absent_library_is_not_loadable() {
        assert!(!library_loadable("kvlink-absent-for-this-test"));
    }
}
