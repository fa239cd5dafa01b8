//! Staging of shared layers: where a rank's reads of replicated components go, and how the
//! staged rows reach its own slots.

use dedup_broadcast::StagingLayout;

use super::Shared;
use kv_device::{DeviceError, LayerLanding};
use kv_geometry::ComponentId;
use kv_loader::LayerReady;

/// Targets inside one layer's staging buffer (rows in the layout's order).
pub(crate) struct StagingLanding<'a> {
    pub(crate) base: usize,
    pub(crate) layout: &'a StagingLayout,
}

impl LayerLanding for StagingLanding<'_> {
    fn target(
        &mut self,
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

    fn land(&mut self, _layer: u32) -> Result<LayerReady, DeviceError> {
        Ok(LayerReady::Resident)
    }
}

/// One batch's landing, shared by the reader (targets) and the load thread (scatter, land).
pub(crate) struct SharedLanding<'a>(pub(crate) &'a parking_lot::Mutex<Box<dyn LayerLanding>>);

impl LayerLanding for SharedLanding<'_> {
    fn target(
        &mut self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        self.0.lock().target(component, layer, plan_page)
    }

    fn land(&mut self, layer: u32) -> Result<LayerReady, DeviceError> {
        self.0.lock().land(layer)
    }
}

/// Copies every staged row of the layer from `staging` into its slot, as `landing` places
/// plan pages. Returns the bytes copied.
pub(crate) fn scatter_rows(
    staging: &[u8],
    layout: &StagingLayout,
    landing: &mut dyn LayerLanding,
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
        let dst = landing.target(row.component, layout.layer(), row.plan_page)?;
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
                    self.free_staging(std::mem::take(&mut b));
                    b = vec![0; len];
                    self.register_staging(&b);
                }
                b
            })
            .collect()
    }

    /// Registers a staging buffer with the store; a store that refuses only costs a warning
    /// here (a TCP store reads into any memory).
    fn register_staging(&self, b: &[u8]) {
        if b.is_empty() {
            return;
        }
        let region = crate::store::MemoryRegion {
            addr: b.as_ptr() as usize,
            len: b.len(),
        };
        // SAFETY: every registered staging buffer is freed only by `free_staging`, after the
        // store has let go of it (or never, when it does not).
        if let Err(e) = unsafe { self.store.register(region) } {
            tracing::warn!(error = %e, bytes = b.len(), "staging registration");
        }
    }

    /// Unregisters a staging buffer and frees it; one the store will not let go is kept
    /// (leaked) instead, as `KvStore::unregister` asks.
    fn free_staging(&self, b: Vec<u8>) {
        if b.is_empty() {
            return;
        }
        let region = crate::store::MemoryRegion {
            addr: b.as_ptr() as usize,
            len: b.len(),
        };
        if let Err(e) = self.store.unregister(region) {
            tracing::error!(error = %e, bytes = b.len(), "staging stays registered: kept, never freed");
            std::mem::forget(b);
        }
    }

    /// Unregisters and frees the kept staging buffers (on close).
    pub(crate) fn drop_staging(&self) {
        for b in self.staging_cache.lock().drain(..) {
            self.free_staging(b);
        }
    }

    /// Gives staging buffers back for the next batch.
    pub(crate) fn return_staging(&self, bufs: Vec<Vec<u8>>) {
        let mut cache = self.staging_cache.lock();
        cache.extend(bufs.into_iter().filter(|b| !b.is_empty()));
        while cache.len() > 2 {
            if let Some(b) = cache.pop() {
                self.free_staging(b);
            }
        }
    }
}
