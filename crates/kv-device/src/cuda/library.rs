//! Whether a CUDA library can be loaded, asked before any call through cudarc (which panics
//! when a library it loads at run time is missing).
//!
//! kvlink builds cudarc to load its libraries at run time; an engine whose own cudarc links
//! them instead (candle's `cuda` feature turns on cudarc's `dynamic-linking`, and Cargo
//! merges the two) gets a cudarc without its `is_culib_present`. This probe is kvlink's own,
//! so the CUDA backend builds either way. With linked libraries it finds the driver and NVRTC
//! under their sonames (`libcuda.so.1`, `libnvrtc.so.13`); NCCL's soname, `libnccl.so.2`, is
//! not one of cudarc's names, so there `libnccl.so` (the development link) must be on the
//! library path, as cudarc's own loader needs it.

/// A library cudarc loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum CudaLibrary {
    /// The driver, `libcuda`.
    Driver,
    /// The run-time compiler of the row-copy kernel, `libnvrtc`.
    Nvrtc,
    /// NCCL, `libnccl`.
    Nccl,
}

impl CudaLibrary {
    /// The stem of its file names (`cuda`, `nvrtc`, `nccl`).
    pub fn stem(self) -> &'static str {
        match self {
            CudaLibrary::Driver => "cuda",
            CudaLibrary::Nvrtc => "nvrtc",
            CudaLibrary::Nccl => "nccl",
        }
    }

    /// The names cudarc 0.19 tries for this library when it loads it at run time, with the
    /// CUDA 13.0 bindings kvlink builds (`get_lib_name_candidates`), in its order: a name
    /// this accepts is one cudarc's own loader tries.
    ///
    /// ```
    /// use kv_device::cuda::CudaLibrary;
    /// assert!(CudaLibrary::Driver.file_names().iter().any(|n| n == "libcuda.so.1"));
    /// ```
    pub fn file_names(self) -> Vec<String> {
        use std::env::consts::{DLL_PREFIX as P, DLL_SUFFIX as S};
        let (stem, w) = (self.stem(), usize::BITS);
        let (major, minor) = (13, 0);
        vec![
            format!("{P}{stem}{S}"),
            format!("{P}{stem}{w}{S}"),
            format!("{P}{stem}{w}_{major}{S}"),
            format!("{P}{stem}{w}_{major}{minor}{S}"),
            format!("{P}{stem}{w}_{major}{minor}_0{S}"),
            format!("{P}{stem}{w}_{major}0_{minor}{S}"),
            format!("{P}{stem}{w}_10{S}"),
            format!("{P}{stem}{w}_11{S}"),
            format!("{P}{stem}{w}_12{S}"),
            format!("{P}{stem}{w}_{major}0_0{S}"),
            format!("{P}{stem}{w}_9{S}"),
            format!("{P}{stem}{S}.{major}"),
            format!("{P}{stem}{S}.12"),
            format!("{P}{stem}{S}.11"),
            format!("{P}{stem}{S}.10"),
            format!("{P}{stem}{S}.9"),
            format!("{P}{stem}{S}.1"),
        ]
    }

    /// Whether it loads under one of [`file_names`](Self::file_names). Calls nothing in it.
    ///
    /// ```
    /// use kv_device::cuda::CudaLibrary;
    /// // True on a machine with a driver, false without one: never a panic.
    /// let _ = CudaLibrary::Driver.loadable();
    /// ```
    pub fn loadable(self) -> bool {
        self.file_names().iter().any(|name| {
            // SAFETY: loading runs the library's initialisers. The names are only those of the
            // CUDA driver, NVRTC and NCCL (this enum's), the libraries cudarc itself loads and
            // calls right after every caller's probe, whose initialisers set up their own
            // state only. The handle is dropped at once (cudarc holds its own).
            unsafe { libloading::Library::new(name) }.is_ok()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The names are cudarc's own, both ways: one this accepts and cudarc's loader does not
    /// try would have the probe say yes and cudarc then panic.
    #[test]
    fn the_names_are_cudarcs() {
        for lib in [CudaLibrary::Driver, CudaLibrary::Nvrtc, CudaLibrary::Nccl] {
            assert_eq!(
                lib.file_names(),
                cudarc::get_lib_name_candidates(lib.stem()),
                "{lib:?}"
            );
        }
    }
}
