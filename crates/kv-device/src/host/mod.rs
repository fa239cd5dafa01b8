//! The host backend: pools in host memory; a layer lands the moment its reads return.

mod buffer;
mod pool;
mod zeroed;

pub(crate) use buffer::HostBuffer;
pub use pool::HostKvPool;
pub use zeroed::zeroed_bytes;
