//! What the GPU tests (`tests/gpu/`, the `gpu` test target) and the GPU examples (`gpu_check`,
//! `tp_gpu`, `tp_procs`, `mooncake_modes`) share, so that neither includes the other's files:
//!
//! - [`report`]: the result table (rows PASS / FAIL / SKIP / info, last line `N passed, N
//!   failed`) that the tests print and the examples' benchmarks fill.
//! - [`pattern`]: the deterministic row bytes every check writes and compares, and scattered
//!   slots.
//! - [`ranks`]: ranks as threads of one process, and a barrier with a timeout.
//! - [`measure`]: medians, GB/s, sizes, markdown tables.
//! - [`glm`]: the GLM-5.2 FP8 geometry they all load.
//! - [`child`]: child processes that end with the process that started them.
//! - with `cuda`: [`device_linker`] (one Linker into a device pool) and [`tp`] (TP ranks on
//!   device pools, on one GPU or one per GPU over NCCL).
//!
//! A development crate (`publish = false`), not part of kvlink's API: its functions return
//! `String` errors, made to become a table row, and the table logs its rows to stderr.
#![allow(missing_debug_implementations)] // development only: no engine holds its types
#![allow(clippy::print_stderr)]

pub mod child;
#[cfg(feature = "cuda")]
pub mod device_linker;
pub mod glm;
pub mod measure;
pub mod pattern;
pub mod ranks;
pub mod report;
#[cfg(feature = "cuda")]
pub mod tp;
