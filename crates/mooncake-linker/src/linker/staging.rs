//! Staging of shared layers: where a rank's reads of replicated components go, and how the
//! staged rows reach its own slots.

use dedup_broadcast::StagingLayout;

use super::Shared;
use kv_device::{DeviceError, LayerLanding, LayerStage};
use kv_geometry::ComponentId;

/// Where the store writes a row of one layer.
pub(crate) trait RowTarget {
    /// The host address of plan page `plan_page`'s slice of (`component`, `layer`).
    fn row(
        &self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError>;
}

/// Targets inside one layer's staging buffer (rows in the layout's order).
pub(crate) struct StagingLanding<'a> {
    pub(crate) base: usize,
    pub(crate) layout: &'a StagingLayout,
}

impl RowTarget for StagingLanding<'_> {
    fn row(
        &self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        let off = self
            .layout
            .offset(component, plan_page)
            .ok_or(DeviceError::OutOfPool {
                component: component.0,
                layer,
                slot: plan_page as u32,
                reason: "row not staged at this layer",
            })?;
        Ok(self.base + off)
    }
}

/// The landing's targets of one open stage.
pub(crate) struct StageTargets<'a> {
    pub(crate) landing: &'a dyn LayerLanding,
    pub(crate) stage: &'a LayerStage,
}

impl RowTarget for StageTargets<'_> {
    fn row(
        &self,
        component: ComponentId,
        _layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        self.landing.target(self.stage, component, plan_page)
    }
}

/// Copies every staged row of the layer from `staging` into its slot, as `landing` places
/// plan pages. Returns the bytes copied.
pub(crate) fn scatter_rows(
    staging: &[u8],
    layout: &StagingLayout,
    landing: &dyn LayerLanding,
    stage: &LayerStage,
) -> Result<u64, DeviceError> {
    let mut bytes = 0;
    for row in layout.rows(0..layout.pages()) {
        let src = staging
            .get(row.offset..row.offset + row.len)
            .ok_or(DeviceError::OutOfPool {
                component: row.component.0,
                layer: layout.layer(),
                slot: row.plan_page as u32,
                reason: "row past the staging buffer",
            })?;
        let dst = landing.target(stage, row.component, row.plan_page)?;
        // SAFETY: `dst` is the pool slice of this plan page's slot for (component, layer),
        // `row.len` (= page_layer_bytes) long; slots of a plan are distinct and no one else
        // touches them before the layer is marked ready; `src` is our staging buffer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, row.len) };
        bytes += row.len as u64;
    }
    Ok(bytes)
}

impl Shared {
    /// Two staging buffers of at least `len` bytes, registered with the store (reused across
    /// batches, so registered once). Always two, empty when nothing is shared: the pipeline
    /// passes them between reader and load thread as its two tokens.
    pub(crate) fn take_staging(&self, len: usize) -> Vec<Vec<u8>> {
        if len == 0 {
            return vec![Vec::new(), Vec::new()];
        }
        let mut cache = self.staging_cache.lock();
        (0..2)
            .map(|_| {
                let mut b = cache.pop().unwrap_or_default();
                if b.len() < len {
                    self.register_staging(&b, false);
                    b = vec![0; len];
                    self.register_staging(&b, true);
                }
                b
            })
            .collect()
    }

    /// Registers (or unregisters) a staging buffer with the store; a store that refuses only
    /// costs a warning here (a TCP store reads into any memory).
    fn register_staging(&self, b: &[u8], register: bool) {
        if b.is_empty() {
            return;
        }
        let region = crate::store::MemoryRegion {
            addr: b.as_ptr() as usize,
            len: b.len(),
        };
        let r = if register {
            self.store.register(region)
        } else {
            self.store.unregister(region)
        };
        if let Err(e) = r {
            tracing::warn!(error = %e, register, bytes = b.len(), "staging registration");
        }
    }

    /// Unregisters and frees the kept staging buffers (on close).
    pub(crate) fn drop_staging(&self) {
        for b in self.staging_cache.lock().drain(..) {
            self.register_staging(&b, false);
        }
    }

    /// Gives staging buffers back for the next batch.
    pub(crate) fn return_staging(&self, bufs: Vec<Vec<u8>>) {
        let mut cache = self.staging_cache.lock();
        cache.extend(bufs.into_iter().filter(|b| !b.is_empty()));
        while cache.len() > 2 {
            if let Some(b) = cache.pop() {
                self.register_staging(&b, false);
            }
        }
    }
}
