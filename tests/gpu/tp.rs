//! The checks of `examples/tp_gpu` (their code is shared with that example), with the settings
//! they read.

pub(crate) use super::util;

/// The settings those checks read.
pub struct Args {
    pub quick: bool,
    pub threads: usize,
    pub cpu: bool,
}

#[path = "../../examples/tp_gpu/checks.rs"]
pub mod checks;
#[path = "../../examples/tp_gpu/nccl_one.rs"]
pub mod nccl_one;
#[path = "../../examples/tp_gpu/setup.rs"]
pub mod setup;
