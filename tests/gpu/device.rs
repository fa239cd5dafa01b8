//! The checks of `examples/gpu_check` (their code is shared with that example), with the
//! settings they read.

pub(crate) use super::util;

/// The settings those checks read.
pub struct Args {
    pub quick: bool,
    pub no_128k: bool,
    pub out: Option<std::path::PathBuf>,
}

#[path = "../../examples/gpu_check/checks.rs"]
pub mod checks;
#[path = "../../examples/gpu_check/linker.rs"]
pub mod linker;
#[path = "../../examples/gpu_check/nccl_checks.rs"]
pub mod nccl_checks;
