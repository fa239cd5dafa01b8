//! Reading one layer of a batch: one batched ranged read per component, straight into the
//! landing's targets.

use std::ops::Range;
use std::sync::Arc;

use dedup_broadcast::StagingLayout;
use kv_device::{DeviceError, DeviceShare, LayerLanding, LayerStage};
use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::{BatchId, KvLoadError, PlanError, StoreFailure};
use smallvec::smallvec;

use crate::store::{checked_results, KvStore, RangedGet, ReadRange, StoreError};

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
    pub(crate) store: &'a dyn KvStore,
    pub(crate) batch: BatchId,
    pub(crate) components: &'a [ComponentKeys],
    /// Store calls one layer's reads are split into, run at once (1: one call).
    pub(crate) parallelism: usize,
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

    /// One batched read, or `parallelism` of them on scoped threads over contiguous parts
    /// of `gets`; results in `gets` order.
    ///
    /// # Safety
    /// As [`KvStore::get_ranges`]: every destination valid for writes of its length, distinct,
    /// and untouched by anyone else during the call.
    unsafe fn get_ranges(&self, gets: &[RangedGet<'_>]) -> Vec<Result<u64, StoreError>> {
        let parts = self.parallelism.clamp(1, gets.len().max(1));
        if parts == 1 {
            // SAFETY: the caller's promise covers `gets`.
            return unsafe { self.store.get_ranges(gets) };
        }
        let chunk = gets.len().div_ceil(parts);
        std::thread::scope(|s| {
            let handles: Vec<_> = gets
                .chunks(chunk)
                .map(|part| {
                    // SAFETY: `part` is a sub-slice of `gets`, covered by the caller's
                    // promise; parts are disjoint, so no two calls write the same memory.
                    s.spawn(move || unsafe { self.store.get_ranges(part) })
                })
                .collect();
            handles
                .into_iter()
                .zip(gets.chunks(chunk))
                .flat_map(|(h, part)| {
                    let results = h.join().unwrap_or_else(|_| {
                        part.iter()
                            .map(|g| {
                                Err(StoreError::Other {
                                    key: g.key.to_string(),
                                    code: -1,
                                })
                            })
                            .collect()
                    });
                    // Each part on its own: one part's extra result must not shift the
                    // next part's results onto the wrong keys.
                    let keys: Vec<&str> = part.iter().map(|g| g.key).collect();
                    checked_results(&keys, results)
                })
                .collect()
        })
    }

    /// Checks that the objects of plan pages `pages` hold exactly the bytes the geometry
    /// expects.
    pub(crate) fn verify_sizes(&self, pages: Range<usize>) -> Result<(), KvLoadError> {
        for comp in self.components {
            let Some(keys) = comp.keys.get(pages.clone()) else {
                continue;
            };
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            let expected = comp.layout.object_bytes();
            let sizes = checked_results(&keys, self.store.object_size(&keys));
            for (i, r) in sizes.into_iter().enumerate() {
                match r {
                    Ok(actual) if actual == expected => {}
                    Ok(actual) => {
                        super::replace::discard_objects(self.store, &[keys[i]]);
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
