//! Stores the linker reads from and writes to: the [`KvStore`] trait, the in-process
//! [`EmbeddedStore`], and Mooncake.

mod embedded;
mod error;
mod faulty;
mod kv_store;
pub mod mooncake;
mod simulated;

pub use embedded::EmbeddedStore;

pub use error::StoreError;
pub use faulty::{Fault, FaultRule, FaultyStore};
pub use kv_store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangedGet, ReadRange, ReadSession,
};
pub use simulated::{SimulatedLink, SimulatedRemoteStore};
