//! The engine-facing API of kvlink: the [`KvLoader`] trait, plans, tickets, outcomes and
//! errors, and (feature `mock`) a scriptable [`mock::MockKvLoader`] for engines' own tests.
//!
//! A plan has two parts: the [`LogicalPlan`] (requests, page hashes, components), which every
//! TP rank must agree on, and the per-rank slots where each page lands.
//!
//! ```
//! use kv_geometry::{page_hashes, KvGeometry, ModelKvSpec};
//! use kv_loader::{BatchId, BatchPlan, RequestPages};
//! let g = KvGeometry::new(ModelKvSpec::deepseek_v3(kv_geometry::ElementType::Bf16), 1, 0).unwrap();
//! let tokens: Vec<u32> = (0..256).collect();
//! let pages = page_hashes(&tokens, g.page_size(), None);
//! let plan = BatchPlan::all_components(&g, BatchId(3),
//!     vec![RequestPages { request: "req-a".into(), pages }], vec![7, 6, 2, 5]);
//! assert!(plan.validate(&g, 8).is_ok());
//! assert_eq!(plan.logical.num_pages(), 4);
//! ```

mod action;
mod cause;
mod deadline;
mod error;
mod handle;
mod ids;
mod loader;
mod lookup;
#[cfg(feature = "mock")]
pub mod mock;
#[cfg(feature = "mock")]
mod mock_event;
mod outcome;
mod plan;
mod share_mode;
mod ticket;
mod transfer;

pub use action::EngineAction;
pub use cause::Cause;
pub use deadline::{deadline_after, deadline_from, MAX_WAIT};
pub use error::{KvLoadError, PlanError, StoreFailure};
pub use handle::LoadHandle;
pub use ids::{BatchId, RequestId};
pub use loader::KvLoader;
pub use lookup::{LookupHit, LookupRequest};
pub use outcome::{BatchOutcome, LoadStats, SaveReport};
pub use plan::{
    slots_from_token_rows, BatchPlan, LogicalPlan, RequestPages, CANONICAL_PLAN_VERSION,
};
pub use share_mode::{Bandwidths, FabricOp, ModeChoice, ShareMode, ShareModeSpec, StoreReads};
pub use ticket::{LayerReady, LoadTicket, RawStream, StreamWaitable};
pub use transfer::TransferBytes;

/// Re-exported so engines name one crate.
pub use layerwise_counter;

/// An async engine moves these between tasks and threads (`Arc<dyn KvLoader>` across tasks, a
/// handle held across an `.await`, an error sent on a channel): checked when this crate builds.
const _: fn() = || {
    fn movable<T: Send + Sync + 'static>() {}
    movable::<std::sync::Arc<dyn KvLoader>>();
    movable::<LoadHandle>();
    movable::<LoadTicket>();
    movable::<KvLoadError>();
    movable::<BatchOutcome>();
    movable::<LayerReady>();
};
