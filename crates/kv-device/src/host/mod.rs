//! The host backend: pools in host memory; a layer lands the moment its reads return.

mod buffer;
mod pool;

pub(crate) use buffer::HostBuffer;
pub use pool::HostKvPool;
