//! A rank's [`TpGroup`] when TP ranks are processes: formed at a [`Rendezvous`] through a
//! [`RendezvousFormation`] (which the linker keeps, to re-form the group after a rank died),
//! and the store the group's processes share.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use dedup_broadcast::{NcclIds, Rendezvous, RendezvousError, RendezvousFormation};

use super::TpGroup;
use crate::store::{
    EmbeddedStore, KvStore, ServeAt, SocketStore, StoreError, StoreServer, STORE_ATTRIBUTE,
};

/// What forming a group of processes gives one rank.
#[derive(Clone)]
pub struct FormedTpGroup {
    /// The two handles, and the formation that re-forms them: ready for
    /// [`LinkerBuilder::group`](crate::LinkerBuilder::group).
    pub group: TpGroup,
    /// The group's epoch when it was formed here (the rendezvous's numbering; a later
    /// re-formation gives a higher one, which this value does not follow).
    pub epoch: u64,
    /// The NCCL unique ids (data, control), when the rendezvous asked for NCCL.
    pub nccl: Option<NcclIds>,
    /// Rank 0's attributes, e.g. [`STORE_ATTRIBUTE`].
    pub attributes: BTreeMap<String, String>,
    /// The formation (also `group.formation`), e.g. to read what a later formation
    /// announced.
    pub formation: Arc<RendezvousFormation>,
    /// The IP this rank reached rank 0 at, when it met rank 0 over TCP: a store rank 0 serves
    /// on an unspecified IP (`0.0.0.0:port`) is reached there.
    pub rank0_ip: Option<IpAddr>,
}

impl std::fmt::Debug for FormedTpGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FormedTpGroup")
            .field("rank", &self.group.rank())
            .field("size", &self.group.size())
            .field("epoch", &self.epoch)
            .finish()
    }
}

impl TpGroup {
    /// Forms this rank's group of processes at `rendezvous` with two socket-collective
    /// handles (`data` for the load thread, `control` for lookups), bounded by the rendezvous
    /// timeout. The group keeps the rendezvous in its formation: when a rank dies (or a
    /// collective is aborted), the linker re-forms the group there by itself, at the next
    /// batch or lookup (see [`RendezvousFormation`]).
    ///
    /// ```
    /// use dedup_broadcast::{MeetingPoint, Rendezvous, RendezvousConfig};
    /// use mooncake_linker::TpGroup;
    /// // A group of one process (rank 0 of 1): the same calls a rank of 8 makes.
    /// let rv = Rendezvous::new(RendezvousConfig::new(0, 1, MeetingPoint::Tcp("127.0.0.1:0".into()))).unwrap();
    /// let formed = TpGroup::from_rendezvous(rv).unwrap();
    /// assert_eq!((formed.group.rank(), formed.group.size(), formed.epoch), (0, 1, 1));
    /// assert!(formed.group.formation.is_some());
    /// ```
    pub fn from_rendezvous(rendezvous: Rendezvous) -> Result<FormedTpGroup, RendezvousError> {
        Self::from_formation(Arc::new(RendezvousFormation::sockets(rendezvous)))
    }

    /// Forms this rank's group through `formation` (sockets, or NCCL with
    /// `RendezvousFormation::nccl`), bounded by the rendezvous timeout; the group re-forms
    /// through it.
    pub fn from_formation(
        formation: Arc<RendezvousFormation>,
    ) -> Result<FormedTpGroup, RendezvousError> {
        // The meeting these handles came from (not `last`: the formation may be shared with
        // a linker that re-forms meanwhile).
        let (handles, meeting) = formation.form_meeting()?;
        Ok(FormedTpGroup {
            group: TpGroup {
                data: handles.data,
                control: handles.control,
                formation: Some(formation.clone()),
            },
            epoch: handles.epoch,
            nccl: meeting.nccl,
            attributes: meeting.attributes,
            rank0_ip: meeting.rank0_ip,
            formation,
        })
    }
}

/// Serves `store` to the other rank processes of the group and announces its address in the
/// rendezvous's formations ([`STORE_ATTRIBUTE`]): call it on rank 0 before forming. Keep the
/// server as long as the group runs; dropping it stops serving.
///
/// Serves over an abstract Unix socket (every rank on this host); `at` may give TCP instead.
pub fn serve_group_store(
    rendezvous: &mut Rendezvous,
    store: Arc<EmbeddedStore>,
    at: ServeAt,
) -> std::io::Result<StoreServer> {
    let server = StoreServer::start(store, at)?;
    rendezvous.set_attribute(STORE_ATTRIBUTE, server.address());
    Ok(server)
}

impl FormedTpGroup {
    /// The store the group shares: `local` in the process that serves it (pass the store
    /// given to [`serve_group_store`]), a [`SocketStore`] client of the announced address in
    /// every other process, `None` when rank 0 announced none.
    pub fn store(
        &self,
        local: Option<Arc<dyn KvStore>>,
    ) -> Result<Option<Arc<dyn KvStore>>, StoreError> {
        if local.is_some() {
            return Ok(local);
        }
        match self.attributes.get(STORE_ATTRIBUTE) {
            Some(address) => {
                let address = reachable(address, self.rank0_ip);
                Ok(Some(Arc::new(SocketStore::connect(&address)?)))
            }
            None => Ok(None),
        }
    }
}

/// `address` as this rank reaches it: a TCP address on an unspecified IP (rank 0 serving on
/// every interface, `0.0.0.0` or `::`) at the IP this rank reached rank 0 at, when it knows
/// one, its key kept; any other address as it is (on one host an unspecified IP reaches the
/// local one).
fn reachable(address: &str, rank0_ip: Option<IpAddr>) -> String {
    let Ok((base, key)) = crate::store::split_address(address) else {
        return address.to_string();
    };
    let at = base
        .strip_prefix("tcp:")
        .and_then(|a| a.parse::<std::net::SocketAddr>().ok());
    match (at, rank0_ip) {
        (Some(mut at), Some(ip)) if at.ip().is_unspecified() => {
            at.set_ip(ip);
            let base = format!("tcp:{at}");
            match key {
                Some(k) => k.in_address(&base),
                None => base,
            }
        }
        _ => address.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::reachable;

    #[test]
    fn a_store_served_on_every_interface_is_reached_at_rank_0s_ip() {
        let ip = Some("10.0.0.7".parse().unwrap());
        assert_eq!(reachable("tcp:0.0.0.0:4000", ip), "tcp:10.0.0.7:4000");
        let v6 = Some("fd00::7".parse().unwrap());
        assert_eq!(reachable("tcp:[::]:4000", v6), "tcp:[fd00::7]:4000");
        // A specific IP, a Unix socket, or no IP known: as announced.
        assert_eq!(reachable("tcp:10.0.0.9:4000", ip), "tcp:10.0.0.9:4000");
        assert_eq!(reachable("unix:@kvlink-store", ip), "unix:@kvlink-store");
        assert_eq!(reachable("tcp:0.0.0.0:4000", None), "tcp:0.0.0.0:4000");
        // The server's key goes with the address.
        let key = format!("#key={}", "0f".repeat(16));
        assert_eq!(
            reachable(&format!("tcp:0.0.0.0:4000{key}"), ip),
            format!("tcp:10.0.0.7:4000{key}")
        );
    }
}
