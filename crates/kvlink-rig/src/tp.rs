//! TP ranks as threads of one process, landing into device pools: the fabric (N ranks on one
//! GPU with the in-process device group, or one rank per GPU over NCCL), a prefix saved into
//! one shared embedded store, each rank's device pool and pinned staging, the groups and the
//! linkers over them, a batch run on every rank at once, and the comparison of a device pool
//! with the saved bytes.

mod batch;
mod groups;
mod prefix;
mod rank_dev;
mod share_step;

use std::time::Duration;

use kv_loader::ShareMode;
use mooncake_linker::dedup_broadcast::ModeChoice;
use mooncake_linker::LinkerConfig;

pub use batch::{clear_pools, compare_all, compare_pool, run_batch, RankRun};
pub use groups::{close_all, linkers, nccl_groups, Groups};
pub use prefix::{plan, save_prefix, Prefix};
pub use rank_dev::{gpu_mem, host_available, open_device, rank_devs, RankDev};
pub use share_step::share_every_layer;

/// Key namespace of every object the TP rig writes.
pub const NAMESPACE: &str = "tp_gpu";

/// The three ways of sharing replicated components, in table order.
pub const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

/// Where the ranks run and how they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    /// `ranks` ranks on GPU 0 (threads of this process), sharing through the in-process device
    /// group: device-to-device copies on each rank's comm stream, ordered by events.
    OneGpu {
        /// Ranks on GPU 0.
        ranks: u32,
    },
    /// Rank `r` on GPU `r`, `tp` of them, sharing over NCCL (two communicators per rank).
    Nccl {
        /// Ranks, one per GPU.
        tp: u32,
    },
}

impl Fabric {
    /// Ranks.
    pub fn tp(self) -> u32 {
        match self {
            Fabric::OneGpu { ranks } => ranks,
            Fabric::Nccl { tp } => tp,
        }
    }

    /// The GPU of rank `r`.
    pub fn ordinal(self, r: u32) -> u32 {
        match self {
            Fabric::OneGpu { .. } => 0,
            Fabric::Nccl { .. } => r,
        }
    }

    /// GPUs used.
    pub fn gpus(self) -> u32 {
        match self {
            Fabric::OneGpu { .. } => 1,
            Fabric::Nccl { tp } => tp,
        }
    }

    /// A short label, e.g. "8 ranks on 1 GPU (in-process device group)".
    pub fn label(self) -> String {
        match self {
            Fabric::OneGpu { ranks } => {
                format!("{ranks} ranks on 1 GPU (in-process device group)")
            }
            Fabric::Nccl { tp } => format!("{tp} rank(s), one per GPU (NCCL)"),
        }
    }
}

/// What the mode really is at this TP: one rank alone always reads its own copy (the linker
/// shares only in a group of more than one).
pub fn effective(mode: ShareMode, tp: u32) -> ShareMode {
    if tp > 1 {
        mode
    } else {
        ShareMode::AllRanks
    }
}

/// A linker configuration for `mode`.
pub fn config(mode: ShareMode, collective_timeout: Duration, wait: Duration) -> LinkerConfig {
    LinkerConfig {
        namespace: NAMESPACE.into(),
        mode: ModeChoice::Fixed(mode),
        wait_deadline: wait,
        layer_read_timeout: collective_timeout.mul_f64(0.75),
        collective_timeout,
        ..LinkerConfig::default()
    }
}
