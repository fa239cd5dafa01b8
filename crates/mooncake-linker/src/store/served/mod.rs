//! The embedded store, shared by the rank processes of one host with no setup: one process
//! (rank 0, or a launcher) keeps the [`EmbeddedStore`](crate::store::EmbeddedStore) and
//! serves it ([`StoreServer`]); every other process reaches it through a [`SocketStore`], a
//! [`KvStore`](crate::store::KvStore) whose reads land straight in the caller's memory. The
//! server's address travels in the group's rendezvous ([`STORE_ATTRIBUTE`]).
//!
//! Why a socket server rather than shared memory: a process that dies (`kill -9`) holding a
//! lock inside a shared segment would wedge every other rank, and an LRU with pins across
//! processes would need such locks. Over a socket the store stays one process's memory with
//! its own locks; a client that dies simply closes its connections (its pins are released),
//! and the price is the socket's copy on each side. Mooncake remains the store for real
//! deployments (several hosts, RDMA, persistence).
//!
//! Linux only (abstract Unix sockets).

mod client;
mod protocol;
mod server;

pub use client::{SocketStore, DEFAULT_REQUEST_TIMEOUT};
pub(crate) use protocol::split_address;
pub use server::{ServeAt, StoreServer};

/// The rendezvous attribute under which rank 0 announces the address of the store it serves.
pub const STORE_ATTRIBUTE: &str = "kvlink.store";

#[cfg(test)]
mod session_tag_tests;
#[cfg(test)]
mod tests;
