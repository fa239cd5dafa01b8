//! A formed group's NCCL communicators (feature `nccl`): every rank joins the two unique ids
//! rank 0 shipped, one communicator per handle.

use std::time::Instant;

use super::{FormedGroup, RendezvousError};
use crate::nccl::{NcclCollective, NcclConfig};
use crate::Collective;

impl FormedGroup {
    /// Joins the group's two NCCL communicators on GPU `ordinal`: `(data, control)`, in that
    /// order on every rank (each join waits for every rank, bounded by `deadline` and by
    /// `config.init_timeout`). The group must have been formed with
    /// [`RendezvousConfig::nccl`](super::RendezvousConfig::nccl). When the control
    /// communicator does not form, the data one is aborted (its peers may be gone), not
    /// finalized with them. One rank per process, as
    /// [`NcclCollective::join`](crate::nccl::NcclCollective::join) asks.
    pub fn join_nccl(
        &self,
        ordinal: u32,
        config: NcclConfig,
        deadline: Instant,
    ) -> Result<(NcclCollective, NcclCollective), RendezvousError> {
        // This rank's own configuration, not rank 0's ids: a `Config` error.
        let ids = self.nccl_ids().ok_or_else(|| {
            RendezvousError::Config(
                "joining NCCL communicators of a group formed without NCCL \
                 (RendezvousConfig::nccl)"
                    .into(),
            )
        })?;
        let (rank, world) = (self.rank(), self.world());
        let join = |id| {
            NcclCollective::join_by((id, rank, world), ordinal, config, deadline)
                .map_err(|source| RendezvousError::NcclJoin { source })
        };
        let data = join(ids.data)?;
        let control = match join(ids.control) {
            Ok(c) => c,
            Err(e) => {
                data.abort("the control communicator did not form");
                return Err(e);
            }
        };
        Ok((data, control))
    }
}
