//! A rank's [`TpGroup`] when TP ranks are processes: formed at a [`Rendezvous`], with two
//! socket-collective handles (data, control), and the store the group's processes share.

use std::collections::BTreeMap;
use std::sync::Arc;

use dedup_broadcast::{NcclIds, Rendezvous, RendezvousError};

use super::TpGroup;
use crate::store::{
    EmbeddedStore, KvStore, ServeAt, SocketStore, StoreError, StoreServer, STORE_ATTRIBUTE,
};

/// What forming a group of processes gives one rank.
#[derive(Clone)]
pub struct FormedTpGroup {
    /// The two handles, over sockets: ready for [`Linker::with_group`](crate::Linker::with_group).
    pub group: TpGroup,
    /// The group's epoch: it grows every time the group re-forms.
    pub epoch: u64,
    /// The NCCL unique ids (data, control), when the rendezvous asked for NCCL; an engine
    /// that shares over NCCL joins them (`FormedGroup::join_nccl` in `dedup-broadcast`).
    pub nccl: Option<NcclIds>,
    /// Rank 0's attributes, e.g. [`STORE_ATTRIBUTE`].
    pub attributes: BTreeMap<String, String>,
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
    /// Forms this rank's group of processes at `rendezvous` (or re-forms it after a failure:
    /// call again on the same `Rendezvous`; the epoch grows) and connects its two handles as
    /// [`SocketCollective`](dedup_broadcast::SocketCollective)s: `data` for the load thread,
    /// `control` for lookups. Bounded by the rendezvous timeout.
    ///
    /// ```
    /// use dedup_broadcast::{MeetingPoint, Rendezvous, RendezvousConfig};
    /// use mooncake_linker::TpGroup;
    /// // A group of one process (rank 0 of 1): the same calls a rank of 8 makes.
    /// let mut rv = Rendezvous::new(RendezvousConfig::new(0, 1, MeetingPoint::Tcp("127.0.0.1:0".into()))).unwrap();
    /// let formed = TpGroup::from_rendezvous(&mut rv).unwrap();
    /// assert_eq!((formed.group.rank(), formed.group.size(), formed.epoch), (0, 1, 1));
    /// assert_eq!(TpGroup::from_rendezvous(&mut rv).unwrap().epoch, 2);
    /// ```
    pub fn from_rendezvous(rendezvous: &mut Rendezvous) -> Result<FormedTpGroup, RendezvousError> {
        let formed = rendezvous.form()?;
        let epoch = formed.epoch();
        let nccl = formed.nccl_ids().copied();
        let attributes = formed.attributes();
        let mut handles = formed.connect(2)?.into_iter();
        let (Some(data), Some(control)) = (handles.next(), handles.next()) else {
            return Err(RendezvousError::Protocol(
                "fewer handles than asked for".into(),
            ));
        };
        Ok(FormedTpGroup {
            group: TpGroup {
                data: Arc::new(data),
                control: Arc::new(control),
                formation: None,
            },
            epoch,
            nccl,
            attributes,
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
            Some(address) => Ok(Some(Arc::new(SocketStore::connect(address)?))),
            None => Ok(None),
        }
    }
}
