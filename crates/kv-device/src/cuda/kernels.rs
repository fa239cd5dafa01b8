//! The row-copy kernel (scatter into / gather from pool slots), compiled at run time with
//! NVRTC or loaded from the PTX built from the same source ahead of time.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{CompileOptions, Ptx};
use parking_lot::Mutex;

use super::current::{ContextRestore, Current};
use super::error::drv;
use crate::{DeviceError, RowCopy};

/// The CUDA C source of the kernels.
pub const COPY_ROWS_SRC: &str = include_str!("copy_rows.cu");
/// The same source compiled to PTX (`compute_80`, NVRTC 13.0, PTX ISA 9.0) ahead of time, for
/// machines without `libnvrtc`; the driver JIT-compiles it for the device at load, which needs
/// a driver that supports CUDA 13 (R580 or later): an older one refuses the module.
pub const COPY_ROWS_PTX: &str = include_str!("copy_rows.ptx");
const KERNEL: &str = "kvlink_copy_rows";

/// Where the loaded kernels came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSource {
    /// Compiled at run time by NVRTC for the device's architecture.
    Nvrtc,
    /// The PTX shipped in the binary, JIT-compiled by the driver.
    EmbeddedPtx,
}

/// The loaded copy kernel of one context.
#[derive(Debug)]
pub struct Kernels {
    source: KernelSource,
    func: CudaFunction,
    _module: Arc<CudaModule>,
    /// Last: the thread's own context current again after the module (whose drop makes
    /// kvlink's context current, and may release it) dropped.
    restore: ContextRestore,
}

impl Drop for Kernels {
    /// The fields drop after this, `restore` last (see `ContextRestore`).
    fn drop(&mut self) {
        self.restore.save();
    }
}

/// Threads per block of the copy kernel.
const BLOCK: u32 = 256;

/// The kernel source `KVLINK_KERNELS` names (`nvrtc` or `ptx`, any case, blanks around):
/// `None` when unset or empty, and for anything else, with a warning (a typo would otherwise
/// leave the automatic choice unsaid).
fn kernels_from_env(value: Option<String>) -> Option<KernelSource> {
    let value = value?;
    match value.trim().to_ascii_lowercase().as_str() {
        "nvrtc" => Some(KernelSource::Nvrtc),
        "ptx" => Some(KernelSource::EmbeddedPtx),
        "" => None,
        _ => {
            tracing::warn!(
                value,
                "KVLINK_KERNELS is neither `nvrtc` nor `ptx`: choosing the kernels' source as \
                 if it were unset"
            );
            None
        }
    }
}

impl Kernels {
    /// Loads the kernels into `ctx` (current on this thread). `force`: a given source;
    /// `None`: `KVLINK_KERNELS=nvrtc|ptx` if set, else NVRTC when `libnvrtc` is present,
    /// falling back to the embedded PTX when it is absent or fails.
    pub(crate) fn load(
        ctx: &Arc<CudaContext>,
        force: Option<KernelSource>,
    ) -> Result<Self, DeviceError> {
        let wanted = force.or_else(|| kernels_from_env(std::env::var("KVLINK_KERNELS").ok()));
        match wanted {
            Some(KernelSource::Nvrtc) => Self::from_nvrtc(ctx),
            Some(KernelSource::EmbeddedPtx) => Self::from_ptx(ctx),
            None => match Self::from_nvrtc(ctx) {
                Ok(k) => Ok(k),
                Err(e) => {
                    tracing::info!(reason = %e, "NVRTC not usable; loading the embedded PTX");
                    Self::from_ptx(ctx)
                }
            },
        }
    }

    fn from_nvrtc(ctx: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        if !super::CudaLibrary::Nvrtc.loadable() {
            return Err(DeviceError::Unavailable(
                "libnvrtc is not on the library path".into(),
            ));
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(drv("cuDeviceGetAttribute (compute capability)"))?;
        let opts = CompileOptions {
            options: vec![
                format!("--gpu-architecture=compute_{major}{minor}"),
                "-default-device".into(),
            ],
            name: Some("copy_rows.cu".into()),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(COPY_ROWS_SRC, opts)
            .map_err(|e| DeviceError::Driver(format!("NVRTC compile of {KERNEL}: {e}")))?;
        Self::from_module(ctx, ptx, KernelSource::Nvrtc)
    }

    fn from_ptx(ctx: &Arc<CudaContext>) -> Result<Self, DeviceError> {
        Self::from_module(ctx, Ptx::from_src(COPY_ROWS_PTX), KernelSource::EmbeddedPtx)
    }

    fn from_module(
        ctx: &Arc<CudaContext>,
        ptx: Ptx,
        source: KernelSource,
    ) -> Result<Self, DeviceError> {
        let module = ctx.load_module(ptx).map_err(drv("cuModuleLoadData"))?;
        let func = module
            .load_function(KERNEL)
            .map_err(drv("cuModuleGetFunction"))?;
        Ok(Kernels {
            source,
            func,
            _module: module,
            restore: ContextRestore::default(),
        })
    }

    /// Where the kernels came from.
    pub fn source(&self) -> KernelSource {
        self.source
    }

    /// Enqueues `copy` on `stream`: for every row `r < n_rows`, `row_bytes` bytes from
    /// `src + (src_rows ? src_rows[r] : r) * row_bytes` to
    /// `dst + (dst_rows ? dst_rows[r] : r) * row_bytes`. One launch, whatever `n_rows`.
    ///
    /// # Safety
    /// `src`, `dst` are device addresses (or device-mapped) of `stream`'s context; every row
    /// named lies inside its buffer; `src_rows`/`dst_rows` are 0 or device arrays of `n_rows`
    /// `u32`; destination rows are distinct and do not overlap source rows; all of it stays
    /// allocated and untouched by others until the launch completes on `stream`.
    pub unsafe fn copy_rows(
        &self,
        stream: sys::CUstream,
        copy: RowCopy,
    ) -> Result<(), DeviceError> {
        let RowCopy {
            src,
            dst,
            src_rows,
            dst_rows,
            n_rows,
            row_bytes,
        } = copy;
        if n_rows == 0 || row_bytes == 0 {
            return Ok(());
        }
        if n_rows > MAX_ROWS {
            return Err(DeviceError::InvalidStage(
                "a row copy of more rows than the kernel's row loop can count",
            ));
        }
        let (grid_x, grid_y) = grid(n_rows, row_bytes);
        let mut a_src = src;
        let mut a_dst = dst;
        let mut a_src_rows = src_rows;
        let mut a_dst_rows = dst_rows;
        let mut a_n = n_rows;
        let mut a_row = row_bytes;
        let mut params: [*mut c_void; 6] = [
            (&mut a_src) as *mut u64 as *mut c_void,
            (&mut a_dst) as *mut u64 as *mut c_void,
            (&mut a_src_rows) as *mut u64 as *mut c_void,
            (&mut a_dst_rows) as *mut u64 as *mut c_void,
            (&mut a_n) as *mut u32 as *mut c_void,
            (&mut a_row) as *mut u64 as *mut c_void,
        ];
        // SAFETY: `func` is a live kernel of a module we hold; the six parameters match the
        // kernel's signature (four 64-bit pointers, u32, u64) and outlive the call (the driver
        // copies them at launch); the memory rules are the caller's (see above).
        unsafe {
            result::launch_kernel(
                self.func.cu_function(),
                (grid_x, grid_y, 1),
                (BLOCK, 1, 1),
                0,
                stream,
                &mut params,
            )
        }
        .map_err(drv("cuLaunchKernel (kvlink_copy_rows)"))
    }
}

/// Most rows one launch copies: the kernel's row loop (`r += gridDim.y`, a 32-bit index, at
/// most 65535 per step) must not wrap past `n_rows`, or its blocks never end.
const MAX_ROWS: u32 = u32::MAX - 65_535;

/// Launch grid for `n_rows` rows of `row_bytes`: x blocks cover a row's 16-byte words (at
/// most 64 blocks, grid-stride beyond), y covers rows (at most 65535, grid-stride beyond).
fn grid(n_rows: u32, row_bytes: u64) -> (u32, u32) {
    let words = row_bytes.div_ceil(16);
    let x = words.div_ceil(u64::from(BLOCK)).clamp(1, 64) as u32;
    let y = n_rows.clamp(1, 65_535);
    (x, y)
}

/// The copy kernels of one context, loaded on first use and shared by its streams.
#[derive(Debug)]
pub(crate) struct KernelCache {
    ctx: Arc<CudaContext>,
    /// The kernels, or why they could not be loaded and when: a failure answers every call
    /// for [`LOAD_RETRY_AFTER`] (loading again on every copy would compile under this lock,
    /// serializing every stream's enqueues), then the load is tried again (its cause may
    /// pass: memory short when the engine had just reserved the GPU).
    loaded: Mutex<Option<Loaded>>,
}

/// A load's outcome: the kernels, or why not and when it failed.
type Loaded = Result<Arc<Kernels>, (DeviceError, std::time::Instant)>;

/// How long a failed kernel load answers for itself before it is tried again.
const LOAD_RETRY_AFTER: std::time::Duration = std::time::Duration::from_secs(10);

impl KernelCache {
    /// Nothing loaded yet: the first [`get`](Self::get) loads the kernels into `ctx`.
    pub(crate) fn new(ctx: Arc<CudaContext>) -> Self {
        KernelCache {
            ctx,
            loaded: Mutex::new(None),
        }
    }

    pub(crate) fn get(&self) -> Result<Arc<Kernels>, DeviceError> {
        let mut k = self.loaded.lock();
        match k.as_ref() {
            Some(Ok(kernels)) => return Ok(kernels.clone()),
            Some(Err((e, at))) if at.elapsed() < LOAD_RETRY_AFTER => return Err(e.clone()),
            _ => {}
        }
        // A context that cannot be made current says nothing of the kernels: not kept.
        let _current = Current::of(&self.ctx)?;
        let loaded = Kernels::load(&self.ctx, None).map(Arc::new);
        *k = Some(match &loaded {
            Ok(kernels) => Ok(kernels.clone()),
            Err(e) => {
                tracing::error!(error = %e, retry_after = ?LOAD_RETRY_AFTER, "the copy kernels could not be loaded");
                Err((e.clone(), std::time::Instant::now()))
            }
        });
        loaded
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_covers_rows_and_bytes() {
        assert_eq!(grid(2048, 41_984), (11, 2048));
        assert_eq!(grid(1, 1), (1, 1));
        assert_eq!(grid(100_000, 1 << 30), (64, 65_535));
        // At the row limit the last row plus one grid step still fits in the kernel's u32.
        let (_, y) = grid(MAX_ROWS, 1);
        assert!(u64::from(MAX_ROWS - 1) + u64::from(y) <= u64::from(u32::MAX));
    }

    /// `KVLINK_KERNELS` in any case, with blanks, names its source; empty or unknown, none.
    #[test]
    fn kvlink_kernels_is_read_in_any_case() {
        let from = |v: &str| kernels_from_env(Some(v.to_string()));
        assert!(matches!(from(" PTX "), Some(KernelSource::EmbeddedPtx)));
        assert!(matches!(from("Nvrtc"), Some(KernelSource::Nvrtc)));
        assert!(from("").is_none());
        assert!(from("pxt").is_none());
        assert!(kernels_from_env(None).is_none());
    }

    #[test]
    fn ptx_matches_the_kernel() {
        assert!(COPY_ROWS_PTX.contains(".entry kvlink_copy_rows("));
        assert!(COPY_ROWS_SRC.contains("kvlink_copy_rows("));
    }
}
