//! Read granularity: how many layers each store call of a layer-wise load reads.
//!
//! Reading one layer per call makes the first layer ready soonest but pays a store call per
//! layer; over Mooncake's TCP transport a call also pays a round trip per range it reads,
//! one after another, so per-layer calls spend most of their time on round trips rather than
//! bytes (docs/benchmarks.md). Reading several layers of a page in one call costs one range
//! where the layers are adjacent in the object (they are: an object is its layers in order).
//!
//! [`plan_reads`] chooses the groups from what was measured: the store's per-call and per-byte
//! cost ([`ReadCost`], estimated by [`ReadCostEstimator`] from the calls already made) and the
//! engine's compute time per layer. The first layer is read alone so attention can start at
//! once; the groups then grow as long as the reads stay ahead of compute; with no compute to
//! hide behind, the groups are as large as allowed.
//!
//! Pure: no I/O, no clock, no threads.

mod cost;
mod plan;
#[cfg(test)]
mod tests;

pub use cost::{ReadCost, ReadCostEstimator};
pub use plan::{plan_reads, ReadPlan, ReadPlanError, ReadPlanRequest};
