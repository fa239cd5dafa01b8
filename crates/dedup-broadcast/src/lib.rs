//! How the TP ranks of a group share replicated KV (MLA latent, DSA KV and indexer): each byte
//! is read from the store once and moved between ranks over the fabric.
//!
//! The building blocks, one idea per module:
//! - [`Collective`]: a TP group's collective operations (host rows, event-ordered device
//!   regions, small host values), issued in the same order on every rank, each bounded by a
//!   deadline. [`InProcessCollective`] (built by [`InProcessGroup`]) implements it for ranks
//!   that are threads of one process (host memory, or device memory with
//!   [`InProcessGroup::on_devices`]: N ranks may share one GPU);
//!   [`nccl::NcclCollective`] (feature `nccl`) over NCCL; `SocketCollective` (Linux) for
//!   ranks that are processes, host rows over a socket mesh, formed at a `Rendezvous`
//!   (`RendezvousFormation` forms and re-forms such groups, over sockets or NCCL).
//!   [`share_rows`] and [`share_stage`] are the safe entry points over the typed handles a
//!   landing lends ([`kv_device::HostRows`], [`kv_device::DeviceStage`]). After an abort, a
//!   [`GroupFormation`] re-forms the group: both its handles ([`GroupHandles`]).
//! - The plan gate ([`plan_digest`], [`check_plan`]): every rank checks that all ranks hold the
//!   same logical plan before a batch shares anything; any difference and that batch falls
//!   back to every rank reading its own copy.
//! - Shares and staging ([`page_shares`], [`padded_share`], [`StagingLayout`]): which pages a
//!   rank reads, and where each page's rows of a layer sit in the staging buffer that is
//!   broadcast (`Rank0Broadcast`) or all-gathered (`SplitAllGather`).
//! - The status exchange ([`LayerStatus`], [`GroupStatus`]): after every layer every rank
//!   all-gathers a status word, so a failure anywhere fails the batch on every rank, alike.
//! - Mode choice ([`ModeChoice`], [`choose_mode`]): fixed, or from measured bandwidths.
//!
//! Two ranks as threads, rank 0 broadcasting a layer's bytes:
//!
//! ```
//! use std::time::Duration;
//! use dedup_broadcast::{broadcast_slice, Collective, InProcessGroup};
//!
//! let ranks = InProcessGroup::new(2);
//! let deadline = kv_loader::deadline_after(Duration::from_secs(10));
//! let results: Vec<Vec<u8>> = std::thread::scope(|s| {
//!     let handles: Vec<_> = ranks
//!         .iter()
//!         .map(|coll| {
//!             s.spawn(move || {
//!                 let fill = if coll.rank() == 0 { 7u8 } else { 0u8 };
//!                 let mut layer = vec![fill; 4096];
//!                 broadcast_slice(coll, &mut layer, 0, deadline).unwrap();
//!                 layer
//!             })
//!         })
//!         .collect();
//!     handles.into_iter().map(|h| h.join().unwrap()).collect()
//! });
//! assert!(results.iter().all(|layer| layer == &vec![7u8; 4096]));
//! ```

mod alone;
mod collective;
mod formation;
mod gate;
mod in_process;
mod kept;
mod mode;
#[cfg(feature = "nccl")]
pub mod nccl;
mod ops;
#[cfg(target_os = "linux")]
mod process;
mod share;
mod status;

pub use alone::{AloneLoads, RanksAhead, ALONE_RUNS};
pub use collective::{
    all_gather_in_place, all_gather_slices, broadcast_slice, Collective, CollectiveError,
    FormationFailure, MemorySupport, SocketError,
};
pub use formation::{GroupFormation, GroupHandles, InProcessFormation};
pub use gate::{
    agree_lookup, check_batch, check_digest, check_plan, judge_gate, lookup_digest, plan_digest,
    plan_digest_in, BatchGate, GateStep, GateVerdict, GateWord, LookupAgreement, PLAN_DIGEST_SEED,
};
pub use in_process::{InProcessCollective, InProcessGroup};
pub use kept::{memory_kept, MemoryKept};
pub use mode::{choose_mode, layer_times, Bandwidths, ModeChoice, ModeTimes};
pub use ops::{share_rows, share_stage, RowsShare, StageShare};
#[cfg(target_os = "linux")]
pub use process::{
    AddressLookups, Algorithm, ExchangeError, FileExchange, FormedGroup, KeyValueExchange, Meeting,
    MeetingPoint, MemoryExchange, NcclIds, Rendezvous, RendezvousConfig, RendezvousError,
    RendezvousFormation, ResolveFailure, SocketCollective, Transport, TransportChoice,
    DEFAULT_REFORM_TIMEOUT, KVLINK_VERSION, MIN_REFORM_TIMEOUT,
};
pub use share::{
    padded_share, page_shares, pages_read, ShareError, StagedComponent, StagedRow, StagingLayout,
};
pub use status::{
    code_name, exchange_status, fail_code, is_out_of_step, GroupStatus, LayerStatus,
    CODE_LAYER_MISMATCH, CODE_MALFORMED, CODE_OTHER, CODE_OUT_OF_STEP,
};
