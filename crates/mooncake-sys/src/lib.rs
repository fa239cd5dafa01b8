//! Raw binding to the Mooncake Store C ABI (store_c.h plus kvlink's extensions), loaded at run time.
//!
//! No registry ships upstream's `libmooncake_store.so`, so kvlink builds its own: a small C++
//! shim (`csrc/shim.cpp`, ABI in `csrc/kvlink_mooncake.h`) over the client inside the pinned
//! PyPI wheel `mooncake-transfer-engine-non-cuda==0.3.13.post1`, built by
//! `scripts/mooncake-build-shim.sh` into `<repo>/.mooncake/lib/libkvlink_mooncake.so`. It
//! exports the `store_c.h` functions under their upstream names, plus `kvlink_mc_*`
//! extensions: ranged multi-buffer reads, read sessions (lease pinning), batched upsert, an ABI
//! report and error names.
//!
//! The library is opened with `dlopen` when asked for ([`Library::load_default`],
//! [`Library::open`]), so this crate builds and its users' tests run without Mooncake; a
//! missing library is a [`MooncakeError::LibraryNotFound`], never a panic.
//!
//! Layers (as in cudarc):
//! - [`sys`]: the C types, function-pointer types and error-code constants, unchecked;
//! - [`result`]: one checked function per C entry point (`Result<_, MooncakeError>`, per-key
//!   results for batches);
//! - [`Library`] and [`Client`]: the loaded library (the shim's ABI report checked at load)
//!   and a safe client handle (`Send + Sync`, destroyed on drop).
//!
//! What the load check covers: the shim reports the ABI it was compiled against (its own
//! structs and the wheel version named when it was built), and a shim of another ABI is
//! refused. It does not inspect the wheel's `store.so` that the shim resolves at run time:
//! keep the shim and the wheel it was built against together (the build script and the GPU
//! bundle do). Loading a library runs its initialisers, as any `dlopen` does: point
//! `MOONCAKE_STORE_LIBRARY` only at a library you trust.
//!
//! | variable | meaning |
//! |---|---|
//! | `MOONCAKE_STORE_LIBRARY` | the library to load (path or name); when set, the only candidate |
//! | `KVLINK_MOONCAKE_DIR` | the build script's directory (`<dir>/lib/libkvlink_mooncake.so`) |

pub mod call_buffer;
pub mod client;
pub mod error;
pub mod library;
pub mod result;
pub mod sys;

pub use call_buffer::{CallClock, CallSpan, CLIENT_GIVES_UP_AFTER};
pub use client::{Client, Health, KeyResult};
pub use error::{ErrorCode, ErrorKind, MooncakeError, Result};
pub use library::{AbiInfo, Library};
pub use result::{CKeys, ReplicateConfig, SetupArgs};
pub use sys::KvlinkMcRange as Range;
