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
mod hello;
mod protocol;
mod server;

pub use client::{SocketStore, DEFAULT_REQUEST_TIMEOUT};
pub(crate) use protocol::split_address;
pub use server::{ServeAt, StoreServer};

/// A served store's address ([`StoreServer::address`]) without its key: what logs and
/// reports may print (the key lets any process that has it use the store).
///
/// ```
/// use mooncake_linker::store::served_location;
/// assert_eq!(served_location("unix:@kvlink-store-1#key=00ff"), "unix:@kvlink-store-1");
/// assert_eq!(served_location("tcp:10.0.0.1:7000"), "tcp:10.0.0.1:7000");
/// ```
pub fn served_location(address: &str) -> &str {
    protocol::location(address)
}

/// The rendezvous attribute under which rank 0 announces the address of the store it serves.
pub const STORE_ATTRIBUTE: &str = "kvlink.store";

#[cfg(test)]
mod session_tag_tests;
#[cfg(test)]
mod tests;
