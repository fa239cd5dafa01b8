//! [`Rendezvous`]: where the ranks of a group of processes meet, agree, and (after a rank
//! died and came back) meet again.
//!
//! Every rank gives its rank, the world size and the meeting point ([`RendezvousConfig`]).
//! Rank 0 leads each formation: it collects every rank's hello, checks that all run the same
//! kvlink version, world size and geometry fingerprint, and answers every member with the same
//! thing: the group, or the same typed refusal. A hello that can be no member (a rank past the
//! group) is refused alone, and of two claims of one rank the earlier one is (over TCP the
//! newest claim joins; over a key-value exchange see [`RendezvousError::ClaimedTwice`]).
//! Nothing of a batch has moved by then, and every wait is bounded by
//! [`RendezvousConfig::timeout`]. The meeting point is not authenticated: a process that can
//! reach it during a formation, with the version and the geometry, can claim a rank.
//!
//! The group rank 0 announces ([`FormedGroup`]) carries:
//! - the **epoch**: one more than the highest epoch any member belonged to, so it grows every
//!   time the group re-forms, whichever process restarted (rank 0 included);
//! - the two **NCCL unique ids** (data, control), made by rank 0 when the group asked for
//!   NCCL;
//! - rank 0's **attributes** (e.g. the address of the store it serves);
//! - every rank's listening **endpoint**, from which [`FormedGroup::connect`] builds the
//!   [`SocketCollective`] handles (a full mesh per handle, Unix sockets when every rank is on
//!   one host).
//!
//! **Re-forming.** A [`Rendezvous`] is meant to be kept: when a batch fails because a peer
//! died ([`Collective::broken`](crate::Collective::broken) reports it), every surviving rank
//! calls [`form`](Rendezvous::form) again on the same object; the restarted process makes a
//! new `Rendezvous` with the same settings and calls `form` too. They meet at a new epoch.
//!
//! Three ranks as threads, meeting over TCP:
//!
//! ```
//! use std::time::{Duration, Instant};
//! use dedup_broadcast::{Collective, MeetingPoint, Rendezvous, RendezvousConfig};
//! let leader = Rendezvous::new(RendezvousConfig::new(0, 3, MeetingPoint::Tcp("127.0.0.1:0".into()))).unwrap();
//! let at = leader.listen_addr().unwrap().to_string();
//! let mut ranks = vec![leader];
//! for r in 1..3 {
//!     ranks.push(Rendezvous::new(RendezvousConfig::new(r, 3, MeetingPoint::Tcp(at.clone()))).unwrap());
//! }
//! let sums: Vec<u64> = std::thread::scope(|s| {
//!     let hs: Vec<_> = ranks.iter_mut().map(|rv| s.spawn(move || {
//!         let group = rv.form().unwrap();
//!         assert_eq!(group.epoch(), 1);
//!         let handles = group.connect(1).unwrap();
//!         let deadline = kv_loader::deadline_after(Duration::from_secs(10));
//!         handles[0].all_gather_u64(u64::from(handles[0].rank()), deadline).unwrap().iter().sum()
//!     })).collect();
//!     hs.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert_eq!(sums, vec![3, 3, 3]);
//! ```

mod config;
mod decide;
mod error;
mod exchange;
mod file_exchange;
pub(crate) mod message;
#[cfg(feature = "nccl")]
mod nccl_join;
mod resolve;
mod tcp;

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub use config::{MeetingPoint, RendezvousConfig, KVLINK_VERSION};
pub use error::RendezvousError;
pub use exchange::{ExchangeError, KeyValueExchange, MemoryExchange};
pub use file_exchange::FileExchange;
pub use message::{NcclIds, Transport, TransportChoice};
pub use resolve::{AddressLookups, ResolveFailure};

use super::mesh::{connect_meshes, MeshListener, MeshPlan};
use super::socket_collective::{Algorithm, SocketCollective};
use decide::IdSource;
use message::{Endpoint, Hello, Welcome, PROTOCOL};

/// A fresh random `u64` (join nonces, temporary names).
pub(crate) fn fresh_nonce() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// One rank's rendezvous, kept across formations (see the module docs).
pub struct Rendezvous {
    config: RendezvousConfig,
    last_epoch: u64,
    leader: Option<tcp::TcpLeader>,
    ids: Option<Arc<IdSource>>,
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rendezvous")
            .field("rank", &self.config.rank)
            .field("world", &self.config.world)
            .field("meet", &self.config.meet)
            .field("last_epoch", &self.last_epoch)
            .finish()
    }
}

impl Rendezvous {
    /// Checks `config` and, on rank 0 of a TCP meeting point, starts listening (for the life
    /// of this object, so restarted ranks can always reach it). No formation yet.
    pub fn new(config: RendezvousConfig) -> Result<Self, RendezvousError> {
        config.validate()?;
        let leader = match (&config.meet, config.rank) {
            (MeetingPoint::Tcp(addr), 0) => {
                Some(tcp::TcpLeader::bind(addr, config.version.clone())?)
            }
            _ => None,
        };
        Ok(Rendezvous {
            config,
            last_epoch: 0,
            leader,
            ids: default_ids(),
        })
    }

    /// Replaces how rank 0 makes NCCL unique ids (by default `ncclGetUniqueId` in builds with
    /// the `nccl` feature, none otherwise).
    pub fn with_nccl_ids(
        mut self,
        ids: impl Fn() -> Result<[u8; 128], String> + Send + Sync + 'static,
    ) -> Self {
        self.ids = Some(Arc::new(ids));
        self
    }

    /// The settings.
    pub fn config(&self) -> &RendezvousConfig {
        &self.config
    }

    /// Sets an attribute rank 0 ships with the next formation.
    pub fn set_attribute(&mut self, key: impl Into<String>, value: impl Into<String>) {
        self.config.attributes.insert(key.into(), value.into());
    }

    /// The epoch of the last group this rank formed (0: none yet).
    pub fn last_epoch(&self) -> u64 {
        self.last_epoch
    }

    /// Rank 0 of a TCP meeting point: the address it listens at (useful with port 0).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.leader.as_ref().map(tcp::TcpLeader::local_addr)
    }

    fn hello(&self, nonce: u64, endpoint: Endpoint) -> Hello {
        let c = &self.config;
        Hello {
            protocol: PROTOCOL,
            version: c.version.clone(),
            rank: c.rank,
            world: c.world,
            fingerprint: c.fingerprint.0,
            nccl: c.nccl,
            last_epoch: self.last_epoch,
            nonce,
            transport: c.transport,
            algorithm: c.algorithm,
            endpoint,
            attributes: if c.rank == 0 {
                c.attributes.clone().into_iter().collect()
            } else {
                Vec::new()
            },
        }
    }

    /// The mesh listener, its Unix name made from `name` (never the hello's nonce).
    fn listener(&self, ip: IpAddr, name: u64) -> Result<MeshListener, RendezvousError> {
        MeshListener::bind(ip, self.config.transport != TransportChoice::Tcp, name)
            .map_err(|e| RendezvousError::io("listening for the group's connections", e))
    }

    /// Forms the group (first time) or re-forms it (after a failure): meets every other rank
    /// at the meeting point, within [`RendezvousConfig::timeout`]. On success the group's
    /// epoch is above every epoch any member belonged to.
    pub fn form(&mut self) -> Result<FormedGroup, RendezvousError> {
        self.form_by(kv_loader::deadline_after(self.config.timeout))
    }

    /// [`form`](Self::form) with its own deadline instead of the configured timeout: what a
    /// re-formation at a batch boundary uses, so that a batch fails fast while a rank is not
    /// back (and meets it once it is). A joiner that rank 0 gave up on (its formation timed
    /// out) keeps trying until its own deadline: rank 0 may open the next formation before.
    pub fn form_by(&mut self, deadline: Instant) -> Result<FormedGroup, RendezvousError> {
        let nonce = fresh_nonce();
        // The Unix listener's name is listed to every process of the host
        // (`/proc/net/unix`): it takes a value of its own, never the nonce members greet with.
        let name = fresh_nonce();
        let rank = self.config.rank;
        let (welcome, listener, rendezvous_ip) = match &self.config.meet {
            MeetingPoint::Tcp(_) if rank == 0 => {
                let Some(leader) = &self.leader else {
                    return Err(RendezvousError::Config("rank 0 without a listener".into()));
                };
                let listener = self.listener(leader.local_addr().ip(), name)?;
                let hello = self.hello(nonce, listener.endpoint.clone());
                let w = leader.form(&hello, self.ids.as_deref(), deadline)?;
                (w, listener, None)
            }
            MeetingPoint::Tcp(addr) => {
                let (w, l, ip) = tcp::join(
                    addr,
                    rank,
                    |ip| {
                        let l = self.listener(ip, name)?;
                        Ok((self.hello(nonce, l.endpoint.clone()), l))
                    },
                    deadline,
                )?;
                (w, l, Some(ip))
            }
            MeetingPoint::Exchange { exchange, prefix } => {
                let ip = self
                    .config
                    .host_ip
                    .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST));
                let listener = self.listener(ip, name)?;
                let hello = self.hello(nonce, listener.endpoint.clone());
                let w = if rank == 0 {
                    exchange::lead(
                        exchange.as_ref(),
                        prefix,
                        &hello,
                        self.ids.as_deref(),
                        deadline,
                    )?
                } else {
                    exchange::join(exchange.as_ref(), prefix, &hello, deadline)?
                };
                (w, listener, None)
            }
        };
        if welcome.members.len() != self.config.world as usize {
            return Err(RendezvousError::Protocol(format!(
                "rank 0 announced {} members for a group of {}",
                welcome.members.len(),
                self.config.world
            )));
        }
        self.last_epoch = welcome.epoch;
        tracing::info!(rank, epoch = welcome.epoch, transport = ?welcome.transport, "group formed");
        let live = match (&self.config.meet, &self.leader) {
            (MeetingPoint::Tcp(_), Some(leader)) if rank == 0 => {
                Some(leader.live_group(welcome.epoch))
            }
            _ => None,
        };
        Ok(FormedGroup {
            rank,
            welcome,
            listener,
            rendezvous_ip,
            timeout: self.config.timeout,
            live,
        })
    }
}

#[cfg(feature = "nccl")]
fn default_ids() -> Option<Arc<IdSource>> {
    Some(Arc::new(|| {
        crate::nccl::nccl_unique_id().map_err(|e| e.to_string())
    }))
}

#[cfg(not(feature = "nccl"))]
fn default_ids() -> Option<Arc<IdSource>> {
    None
}

/// A group rank 0 announced, before its connections are made.
pub struct FormedGroup {
    rank: u32,
    welcome: Welcome,
    listener: MeshListener,
    rendezvous_ip: Option<IpAddr>,
    timeout: Duration,
    /// Rank 0's (over TCP): what its listener answers of this group, ended should the
    /// connect fail.
    live: Option<tcp::LiveGroup>,
}

impl std::fmt::Debug for FormedGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FormedGroup")
            .field("rank", &self.rank)
            .field("world", &self.world())
            .field("epoch", &self.welcome.epoch)
            .field("transport", &self.welcome.transport)
            .finish()
    }
}

impl FormedGroup {
    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Ranks in the group.
    pub fn world(&self) -> u32 {
        self.welcome.members.len() as u32
    }

    /// The group's epoch.
    pub fn epoch(&self) -> u64 {
        self.welcome.epoch
    }

    /// Unix sockets (every rank on one host) or TCP.
    pub fn transport(&self) -> Transport {
        self.welcome.transport
    }

    /// How the socket collective moves rows (rank 0's choice).
    pub fn algorithm(&self) -> Algorithm {
        self.welcome.algorithm
    }

    /// The NCCL unique ids, when the group asked for NCCL.
    pub fn nccl_ids(&self) -> Option<&NcclIds> {
        self.welcome.nccl.as_ref()
    }

    /// The IP this rank reached rank 0 at (over the TCP meeting point; `None` on rank 0 and
    /// over a key-value exchange): where rank 0 is reachable from this host, for an address
    /// rank 0 announced on an unspecified IP (`0.0.0.0`, `::`).
    pub fn rank0_ip(&self) -> Option<IpAddr> {
        self.rendezvous_ip
    }

    /// One of rank 0's attributes.
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.welcome
            .attributes
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// All of rank 0's attributes.
    pub fn attributes(&self) -> BTreeMap<String, String> {
        self.welcome.attributes.iter().cloned().collect()
    }

    /// Connects `handles` independent [`SocketCollective`] handles (e.g. 2: data and control),
    /// each a full mesh of the group; every rank calls it with the same count. Bounded by the
    /// rendezvous timeout.
    pub fn connect(self, handles: u32) -> Result<Vec<SocketCollective>, RendezvousError> {
        let deadline = kv_loader::deadline_after(self.timeout);
        self.connect_by(handles, deadline)
    }

    /// [`connect`](Self::connect) by `deadline` instead of the rendezvous timeout.
    pub fn connect_by(
        self,
        handles: u32,
        deadline: Instant,
    ) -> Result<Vec<SocketCollective>, RendezvousError> {
        let connected = self.mesh_by(handles, deadline);
        if let (Err(e), Some(live)) = (&connected, &self.live) {
            live.connect_failed(e);
        }
        connected
    }

    /// The meshes of [`connect_by`](Self::connect_by), settled on every rank.
    fn mesh_by(
        &self,
        handles: u32,
        deadline: Instant,
    ) -> Result<Vec<SocketCollective>, RendezvousError> {
        let plan = MeshPlan {
            rank: self.rank,
            epoch: self.welcome.epoch,
            nonces: &self.welcome.nonces,
            transport: self.welcome.transport,
            members: &self.welcome.members,
            rendezvous_ip: self.rendezvous_ip,
        };
        let meshes = connect_meshes(&plan, &self.listener, handles, deadline)?;
        let world = self.world();
        let handles: Vec<SocketCollective> = meshes
            .into_iter()
            .map(|links| {
                SocketCollective::new(
                    self.rank,
                    world,
                    self.welcome.epoch,
                    self.welcome.algorithm,
                    links,
                )
            })
            .collect();
        self.settle(&handles, deadline)?;
        Ok(handles)
    }

    /// The connect's last step, on every rank: a settled gather of the epoch over the first
    /// handle, so that every rank connects or none does. Rank 0 makes no connection of its
    /// own and its accepts end once each higher rank reached it, so without this it returned
    /// its handles while two other ranks failed to reach each other; a rank that failed has
    /// dropped its connections, so its peers' gather fails at once.
    fn settle(
        &self,
        handles: &[SocketCollective],
        deadline: Instant,
    ) -> Result<(), RendezvousError> {
        use crate::Collective;
        let Some(first) = handles.first() else {
            return Ok(());
        };
        let epoch = self.welcome.epoch;
        let words = first
            .all_gather_u64_settled(epoch, deadline)
            .map_err(|source| RendezvousError::Unconfirmed { source })?;
        if words.iter().any(|&w| w != epoch) {
            return Err(RendezvousError::Protocol(format!(
                "the ranks confirmed epochs {words:?}, not {epoch}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nonce a member greets its peers with is told only to the group's members: it must
    /// not be in any member's abstract Unix socket name, which every process of the host can
    /// list (`/proc/net/unix`). Before, the listener was named from that very nonce.
    #[test]
    fn no_members_nonce_is_in_a_socket_name() {
        let x: Arc<dyn KeyValueExchange> = Arc::new(MemoryExchange::new());
        let config = |rank| {
            RendezvousConfig::new(
                rank,
                2,
                MeetingPoint::Exchange {
                    exchange: x.clone(),
                    prefix: "names".into(),
                },
            )
            .timeout(Duration::from_secs(10))
        };
        let mut ranks = [
            Rendezvous::new(config(0)).unwrap(),
            Rendezvous::new(config(1)).unwrap(),
        ];
        let formed: Vec<FormedGroup> = std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter_mut()
                .map(|r| s.spawn(move || r.form()))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        let w = &formed[0].welcome;
        let names: Vec<&str> = w.members.iter().filter_map(|m| m.unix.as_deref()).collect();
        if names.is_empty() {
            return; // No Unix sockets here: nothing is named.
        }
        for nonce in &w.nonces {
            let hex = format!("{nonce:016x}");
            assert!(names.iter().all(|n| !n.contains(&hex)), "{names:?} {hex}");
        }
    }
}
