//! Stores the linker reads from and writes to: the [`KvStore`] trait, the in-process
//! [`EmbeddedStore`], and Mooncake.

mod bounded;
pub(crate) mod caller;
mod checked;
mod discard;
mod embedded;
mod error;
#[cfg(any(test, feature = "testing"))]
mod faulty;
mod forward;
mod kept;
mod kv_store;
pub mod mooncake;
mod registration;
#[cfg(target_os = "linux")]
mod served;
#[cfg(any(test, feature = "testing"))]
mod simulated;
mod source_puts;
mod target_reads;

pub use checked::checked_results;
pub(crate) use discard::objects_then_companions;
pub use embedded::EmbeddedStore;

pub use bounded::{no_hold, Hold, StoreCalls, MAX_WORKERS, WORKER_IDLE_RETIRE};
pub use error::StoreError;
/// Test doubles (feature `testing`): a store that injects faults, and one throttled like a
/// remote link.
#[cfg(any(test, feature = "testing"))]
pub use faulty::{Fault, FaultCall, FaultRule, FaultyStore, Stall, STALL_LIMIT};
pub(crate) use kept::{count_kept, keep_for_good};
pub use kept::{kept_for_good, KeptForGood};
pub use kv_store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangeChecksums, RangedGet, ReadRange,
    ReadSession,
};
pub use registration::{Registration, REGISTRATION_WAVE};
#[cfg(target_os = "linux")]
pub(crate) use served::split_address;
#[cfg(target_os = "linux")]
pub use served::{
    served_location, ServeAt, SocketStore, StoreServer, DEFAULT_REQUEST_TIMEOUT, STORE_ATTRIBUTE,
};
#[cfg(any(test, feature = "testing"))]
pub use simulated::{SimulatedLink, SimulatedRemoteStore};
pub use source_puts::SourcePut;
pub use target_reads::{TargetRange, TargetRead, TargetReadResults};
