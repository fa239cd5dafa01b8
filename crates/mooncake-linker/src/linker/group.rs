//! The TP group a linker shares replicated KV with.

use std::sync::Arc;

use dedup_broadcast::{Collective, InProcessGroup};

/// One rank's handles on its TP group: `data` carries the per-layer exchanges of the load
/// thread, `control` the lookups of the engine's thread. Two handles, because the two
/// threads issue collectives independently and one handle's operations must stay in one
/// order on every rank (NCCL's rule: over NCCL these are two communicators).
#[derive(Clone)]
pub struct TpGroup {
    /// Used by the load thread only: gate, status words, broadcasts, all-gathers.
    pub data: Arc<dyn Collective>,
    /// Used by `lookup` only: the minimum loadable prefix over the group.
    pub control: Arc<dyn Collective>,
}

impl TpGroup {
    /// Handles for `size` ranks that are threads of this process (rank `r` gets element `r`).
    ///
    /// ```
    /// let groups = mooncake_linker::TpGroup::in_process(4);
    /// assert_eq!(groups.len(), 4);
    /// assert_eq!(groups[2].data.rank(), 2);
    /// ```
    pub fn in_process(size: u32) -> Vec<TpGroup> {
        InProcessGroup::new(size)
            .into_iter()
            .zip(InProcessGroup::new(size))
            .map(|(data, control)| TpGroup {
                data: Arc::new(data),
                control: Arc::new(control),
            })
            .collect()
    }

    /// Ranks in the group.
    pub fn size(&self) -> u32 {
        self.data.size()
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.data.rank()
    }
}
