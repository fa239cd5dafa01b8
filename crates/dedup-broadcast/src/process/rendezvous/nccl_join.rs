//! A formed group's NCCL communicators (feature `nccl`): every rank joins the two unique ids
//! rank 0 shipped, one communicator per handle.

use super::{FormedGroup, RendezvousError};
use crate::nccl::{NcclCollective, NcclConfig};

impl FormedGroup {
    /// Joins the group's two NCCL communicators on GPU `ordinal`: `(data, control)`, in that
    /// order on every rank (each join waits for every rank, bounded by
    /// `config.init_timeout`). The group must have been formed with
    /// [`RendezvousConfig::nccl`](super::RendezvousConfig::nccl).
    pub fn join_nccl(
        &self,
        ordinal: u32,
        config: NcclConfig,
    ) -> Result<(NcclCollective, NcclCollective), RendezvousError> {
        let ids = self.nccl_ids().ok_or_else(|| {
            RendezvousError::Nccl(
                "the group was formed without NCCL (RendezvousConfig::nccl)".into(),
            )
        })?;
        let (rank, world) = (self.rank(), self.world());
        let join = |id| {
            NcclCollective::join(id, rank, world, ordinal, config)
                .map_err(|e| RendezvousError::Nccl(e.to_string()))
        };
        let data = join(ids.data)?;
        let control = join(ids.control)?;
        Ok((data, control))
    }
}
