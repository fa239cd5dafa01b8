//! TP groups whose ranks are processes: the [`Rendezvous`] where they meet (and meet again
//! after one of them died and restarted), and the [`SocketCollective`] they share bytes over
//! when no NCCL is at hand (CPU-only engines, hosts without NCCL, the CI tests). Linux only
//! (abstract Unix sockets, `poll` with `POLLRDHUP`).

mod engine;
mod formation;
mod link;
mod mesh;
mod op_header;
pub(crate) mod rendezvous;
mod socket_collective;
mod wire;

pub use formation::{Meeting, RendezvousFormation, DEFAULT_REFORM_TIMEOUT, MIN_REFORM_TIMEOUT};
pub use rendezvous::{
    AddressLookups, ExchangeError, FileExchange, FormedGroup, KeyValueExchange, MeetingPoint,
    MemoryExchange, NcclIds, Rendezvous, RendezvousConfig, RendezvousError, ResolveFailure,
    Transport, TransportChoice, KVLINK_VERSION,
};
pub use socket_collective::{Algorithm, SocketCollective};
