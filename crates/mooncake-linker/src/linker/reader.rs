//! Reading a group of layers of a batch: one batched ranged read for every component the rank
//! reads, straight into the landing's targets (one range per layer per object: consecutive in
//! the object, so a store can read them as one). Every store call is bounded
//! ([`StoreCalls`]): one that does not return within `LinkerConfig::layer_read_timeout` fails
//! the group at once, and the batch's memory hold keeps what it writes alive and away from
//! others until it returns.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::StagingLayout;
use kv_device::{DeviceError, DeviceShare, LayerLanding, LayerStage};
use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::{BatchId, KvLoadError, PlanError, StoreFailure};
use smallvec::SmallVec;

use crate::store::{checked_results, Hold, RangedGet, ReadRange, StoreCalls, StoreError};

/// Where the store writes a row of the layer open in a stage.
pub(crate) trait RowTarget {
    /// The host address of plan page `plan_page`'s slice of `component`.
    fn row(&self, component: &ComponentLayout, plan_page: usize) -> Result<usize, DeviceError>;
}

/// The landing's own targets: pool slots (host pools) or the stage's own area (device pools).
pub(crate) struct OwnRows<'a> {
    pub(crate) landing: &'a dyn LayerLanding,
    pub(crate) stage: &'a LayerStage,
}

impl RowTarget for OwnRows<'_> {
    fn row(&self, component: &ComponentLayout, plan_page: usize) -> Result<usize, DeviceError> {
        self.landing.target(self.stage, component.id, plan_page)
    }
}

/// The share area of a device stage, as the layer's share layout places rows in it.
pub(crate) struct ShareArea<'a> {
    pub(crate) share: &'a dyn DeviceShare,
    pub(crate) stage: &'a LayerStage,
    pub(crate) layout: &'a StagingLayout,
}

impl RowTarget for ShareArea<'_> {
    fn row(&self, component: &ComponentLayout, plan_page: usize) -> Result<usize, DeviceError> {
        let off = self
            .layout
            .offset(component.id, plan_page)
            .ok_or(row_not_staged(component.id))?;
        self.share
            .share_target(self.stage, off, component.page_layer_bytes as usize)
    }
}

fn row_not_staged(c: ComponentId) -> DeviceError {
    DeviceError::OutOfPool {
        component: c.0,
        layer: u32::MAX,
        slot: u32::MAX,
        reason: "row not staged at this layer",
    }
}

/// One planned component and its object keys, in plan page order (built once per batch).
pub(crate) struct ComponentKeys {
    pub(crate) layout: ComponentLayout,
    pub(crate) keys: Vec<String>,
}

/// A store error as a batch failure at `layer` on plan page `page`.
pub(crate) fn store_failure(
    batch: BatchId,
    layer: Option<u32>,
    pages: Vec<u32>,
    e: &StoreError,
) -> KvLoadError {
    KvLoadError::Store {
        batch: Some(batch),
        layer,
        pages: pages.into(),
        kind: e.failure(),
        detail: kv_loader::Cause::from_error(e.clone()),
    }
}

/// One part of a group read: `components` at plan pages `pages`, the row of layer
/// `group.start + i` landing where `targets[i]` (that layer's stage) says.
pub(crate) struct ReadPart<'a> {
    pub(crate) components: &'a [ComponentKeys],
    pub(crate) pages: Range<usize>,
    pub(crate) targets: Vec<&'a dyn RowTarget>,
}

/// Which component and plan page a ranged get of a group read is.
#[derive(Clone, Copy)]
struct GetOf {
    part: usize,
    component: usize,
    page: usize,
}

/// Reads groups of layers of one batch on one rank.
pub(crate) struct LayerReader<'a> {
    pub(crate) calls: &'a StoreCalls,
    pub(crate) batch: BatchId,
    /// Store calls one group's reads are split into, run at once (1: one call).
    pub(crate) parallelism: usize,
    /// What keeps the batch's memory alive (and away from others) while a read that
    /// outlived its deadline may still write it.
    pub(crate) hold: &'a Hold,
    /// When every store call of this read must have returned.
    pub(crate) deadline: Instant,
}

impl LayerReader<'_> {
    /// Reads layers `group` of every part in one batched ranged read: per object, one range
    /// per layer of the group it carries (consecutive in the object, so a store merges them),
    /// each into that layer's target. Returns the bytes read. Any failed or short key fails
    /// the whole group, at its first layer, naming the pages.
    pub(crate) fn read_group(
        &self,
        parts: &[ReadPart<'_>],
        group: Range<u32>,
    ) -> Result<u64, KvLoadError> {
        let mut gets: Vec<RangedGet<'_>> = Vec::new();
        let mut of: Vec<GetOf> = Vec::new();
        let mut expected: Vec<u64> = Vec::new();
        for (pi, part) in parts.iter().enumerate() {
            if part.targets.len() < group.len() {
                return Err(KvLoadError::internal(
                    self.batch,
                    format!(
                        "{} targets for a group of {} layers",
                        part.targets.len(),
                        group.len()
                    ),
                ));
            }
            for (ci, comp) in part.components.iter().enumerate() {
                let len = comp.layout.page_layer_bytes as usize;
                let layers: Vec<(usize, u64)> = group
                    .clone()
                    .enumerate()
                    .filter_map(|(i, l)| comp.layout.layer_range(l).map(|r| (i, r.start)))
                    .collect();
                if layers.is_empty() {
                    continue;
                }
                for page in part.pages.clone() {
                    let mut ranges = SmallVec::with_capacity(layers.len());
                    for &(i, offset) in &layers {
                        let dst = part.targets[i]
                            .row(&comp.layout, page)
                            .map_err(KvLoadError::from)?;
                        ranges.push(ReadRange {
                            dst: dst as *mut u8,
                            len,
                            offset,
                        });
                    }
                    expected.push((len * layers.len()) as u64);
                    gets.push(RangedGet {
                        key: &comp.keys[page],
                        ranges,
                    });
                    of.push(GetOf {
                        part: pi,
                        component: ci,
                        page,
                    });
                }
            }
        }
        if gets.is_empty() {
            return Ok(0);
        }
        // SAFETY: every destination is a distinct slice of `len` bytes handed out by the
        // landing for this batch (distinct slots or stage rows: the plan was validated for
        // duplicates, and each layer of the group has its own stage), which nothing else reads
        // or writes until the layer is marked ready.
        let results = unsafe { self.get_ranges(&gets) };
        let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();
        let results = checked_results(&keys, results);
        let mut total = 0;
        let mut failed: Vec<u32> = Vec::new();
        let mut first: Option<KvLoadError> = None;
        for ((r, want), o) in results.iter().zip(&expected).zip(&of) {
            let page = o.page as u32;
            match r {
                Ok(n) if n == want => total += n,
                Ok(n) => {
                    failed.push(page);
                    first.get_or_insert_with(|| KvLoadError::Store {
                        batch: Some(self.batch),
                        layer: Some(group.start),
                        pages: Arc::from(Vec::new()),
                        kind: StoreFailure::ShortRead,
                        detail: format!(
                            "`{}`: short read: {n} of {want} bytes (layers {group:?})",
                            parts[o.part].components[o.component].keys[o.page]
                        )
                        .into(),
                    });
                }
                Err(e) => {
                    failed.push(page);
                    first.get_or_insert_with(|| {
                        store_failure(self.batch, Some(group.start), Vec::new(), e)
                    });
                }
            }
        }
        if let Some(mut e) = first {
            if let KvLoadError::Store { pages, .. } = &mut e {
                failed.sort_unstable();
                failed.dedup();
                *pages = failed.into();
            }
            return Err(e);
        }
        Ok(total)
    }

    /// One batched read, or `parallelism` of them at once over contiguous parts of `gets`,
    /// each a bounded store call; results in `gets` order.
    ///
    /// # Safety
    /// As [`StoreCalls::get_ranges`]: every destination valid for writes of its length,
    /// distinct, and untouched by anyone else until `self.hold` lets go (after the call
    /// returns, which may be after its deadline).
    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let parts = self.parallelism.clamp(1, gets.len().max(1));
        let chunk = gets.len().div_ceil(parts).max(1);
        let parts: Vec<&[RangedGet<'_>]> = gets.chunks(chunk).collect();
        // SAFETY: the caller's promise covers every part (disjoint sub-slices of `gets`).
        let results = unsafe {
            self.calls
                .get_ranges_parts(&parts, self.hold, self.deadline)
        };
        // Each part on its own: one part's extra result must not shift the next part's
        // results onto the wrong keys.
        parts
            .iter()
            .zip(results)
            .flat_map(|(part, r)| {
                let keys: Vec<&str> = part.iter().map(|g| g.key).collect();
                checked_results(&keys, r)
            })
            .collect()
    }

    /// Checks that the objects of `components` at plan pages `pages` hold exactly the bytes
    /// the geometry expects.
    pub(crate) fn verify_sizes(
        &self,
        components: &[ComponentKeys],
        pages: Range<usize>,
    ) -> Result<(), KvLoadError> {
        check_object_sizes(self.calls, self.batch, components, pages, self.deadline)
    }
}

/// Checks that the objects of `components` at plan pages `pages` hold exactly the bytes the
/// geometry expects; a wrong one is discarded (the next save writes it again) and fails the
/// batch with [`PlanError::ObjectSize`].
pub(crate) fn check_object_sizes(
    calls: &StoreCalls,
    batch: BatchId,
    components: &[ComponentKeys],
    pages: Range<usize>,
    deadline: Instant,
) -> Result<(), KvLoadError> {
    for comp in components {
        let Some(keys) = comp.keys.get(pages.clone()) else {
            continue;
        };
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let expected = comp.layout.object_bytes();
        let sizes = calls.object_size(&keys, deadline);
        for (i, r) in sizes.into_iter().enumerate() {
            match r {
                Ok(actual) if actual == expected => {}
                Ok(actual) => {
                    super::replace::discard_objects(calls, &[keys[i]], deadline);
                    return Err(KvLoadError::InvalidPlan {
                        batch,
                        reason: PlanError::ObjectSize {
                            key: keys[i].to_string(),
                            expected,
                            actual,
                        },
                    });
                }
                Err(e) => {
                    let page = (pages.start + i) as u32;
                    return Err(store_failure(batch, None, vec![page], &e));
                }
            }
        }
    }
    Ok(())
}
