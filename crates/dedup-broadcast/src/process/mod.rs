//! TP groups whose ranks are processes: the rendezvous where they meet, and the
//! [`SocketCollective`] they share bytes over when no NCCL is at hand (CPU-only engines,
//! hosts without NCCL, the CI tests). Linux only (abstract Unix sockets, `poll` with
//! `POLLRDHUP`).
//!
//! How the collective fails when a peer process dies: see [`SocketCollective`].

mod engine;
mod link;
mod op_header;
mod socket_collective;
mod wire;

pub use socket_collective::{Algorithm, SocketCollective};
