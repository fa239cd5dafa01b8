//! Reading one layer of a batch: one batched ranged read per component, straight into the
//! landing's targets. Every store call is bounded ([`StoreCalls`]): one that does not return
//! within `LinkerConfig::layer_read_timeout` fails the layer at once, and the batch's memory
//! hold keeps what it writes alive and away from others until it returns.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::StagingLayout;
use kv_device::{DeviceError, DeviceShare, LayerLanding, LayerStage};
use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::{BatchId, KvLoadError, PlanError, StoreFailure};
use smallvec::smallvec;

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
        detail: e.to_string(),
    }
}

/// Reads layers of one batch on one rank.
pub(crate) struct LayerReader<'a> {
    pub(crate) calls: &'a StoreCalls,
    pub(crate) batch: BatchId,
    pub(crate) components: &'a [ComponentKeys],
    /// Store calls one layer's reads are split into, run at once (1: one call).
    pub(crate) parallelism: usize,
    /// What keeps the batch's memory alive (and away from others) while a read that
    /// outlived its deadline may still write it.
    pub(crate) hold: &'a Hold,
    /// When every store call of this read must have returned.
    pub(crate) deadline: Instant,
}

impl LayerReader<'_> {
    /// Reads layer `layer` of plan pages `pages` into `landing`'s targets. Returns the bytes
    /// read. Any failed or short key fails the whole layer, naming the pages.
    pub(crate) fn read_layer(
        &self,
        landing: &dyn RowTarget,
        layer: u32,
        pages: Range<usize>,
    ) -> Result<u64, KvLoadError> {
        let mut total = 0;
        for comp in self.components {
            let Some(range) = comp.layout.layer_range(layer) else {
                continue;
            };
            let len = comp.layout.page_layer_bytes as usize;
            let mut gets = Vec::with_capacity(pages.len());
            for page in pages.clone() {
                let dst = landing.row(&comp.layout, page).map_err(KvLoadError::from)?;
                gets.push(RangedGet {
                    key: &comp.keys[page],
                    ranges: smallvec![ReadRange {
                        dst: dst as *mut u8,
                        len,
                        offset: range.start,
                    }],
                });
            }
            // SAFETY: every destination is a distinct slice of `len` bytes handed out by the
            // landing for this batch (distinct slots: the plan was validated for duplicates),
            // which nothing else reads or writes until the layer is marked ready.
            let results = unsafe { self.get_ranges(&gets) };
            let keys: Vec<&str> = gets.iter().map(|g| g.key).collect();
            let results = checked_results(&keys, results);
            let mut failed: Vec<u32> = Vec::new();
            let mut first: Option<KvLoadError> = None;
            for (i, r) in results.iter().enumerate() {
                let page = (pages.start + i) as u32;
                match r {
                    Ok(n) if *n == len as u64 => total += n,
                    Ok(n) => {
                        failed.push(page);
                        first.get_or_insert_with(|| KvLoadError::Store {
                            batch: Some(self.batch),
                            layer: Some(layer),
                            pages: Arc::from(Vec::new()),
                            kind: StoreFailure::ShortRead,
                            detail: format!(
                                "`{}`: short read: {n} of {len} bytes",
                                comp.keys[page as usize]
                            ),
                        });
                    }
                    Err(e) => {
                        failed.push(page);
                        first.get_or_insert_with(|| {
                            store_failure(self.batch, Some(layer), Vec::new(), e)
                        });
                    }
                }
            }
            if let Some(mut e) = first {
                if let KvLoadError::Store { pages, .. } = &mut e {
                    *pages = failed.into();
                }
                return Err(e);
            }
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

    /// Checks that the objects of plan pages `pages` hold exactly the bytes the geometry
    /// expects; a wrong one is discarded (the next save writes it again).
    pub(crate) fn verify_sizes(&self, pages: Range<usize>) -> Result<(), KvLoadError> {
        for comp in self.components {
            let Some(keys) = comp.keys.get(pages.clone()) else {
                continue;
            };
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let expected = comp.layout.object_bytes();
            let sizes = self.calls.object_size(&keys, self.deadline);
            for (i, r) in sizes.into_iter().enumerate() {
                match r {
                    Ok(actual) if actual == expected => {}
                    Ok(actual) => {
                        super::replace::discard_objects(self.calls, &[keys[i]], self.deadline);
                        return Err(KvLoadError::InvalidPlan {
                            batch: self.batch,
                            reason: PlanError::ObjectSize {
                                key: keys[i].to_string(),
                                expected,
                                actual,
                            },
                        });
                    }
                    Err(e) => {
                        let page = (pages.start + i) as u32;
                        return Err(store_failure(self.batch, None, vec![page], &e));
                    }
                }
            }
        }
        Ok(())
    }
}
