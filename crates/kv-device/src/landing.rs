//! Landing: where a batch's layer reads go and how a layer becomes resident.
//!
//! The host backend reads straight into pool slots and a layer is resident when its reads
//! return ([`DirectLanding`]). A device backend reads into pinned staging and lands a layer
//! with async host→device copies on a load stream, handing back an event; both are
//! implementations of [`LayerLanding`], so the linker does not change between them.

use std::sync::Arc;

use kv_geometry::ComponentId;
use kv_loader::LayerReady;

use crate::{DeviceError, KvPool};

/// One batch's landing on one rank.
pub trait LayerLanding: Send {
    /// The address the store should write plan page `plan_page`'s slice of
    /// (`component`, `layer`) to.
    fn target(
        &mut self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError>;

    /// Every read of `layer` has returned: make the layer resident (or enqueue that) and
    /// say how the engine waits for it.
    fn land(&mut self, layer: u32) -> Result<LayerReady, DeviceError>;
}

/// Reads straight into the pool's slots; a layer is resident when its reads return.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{DirectLanding, HostKvPool, KvPool, LayerLanding};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 8).unwrap());
/// let mut landing = DirectLanding::new(pool.clone(), vec![5, 2].into());
/// let addr = landing.target(ComponentId(0), 0, 1).unwrap();
/// assert_eq!(addr, pool.slot_addr(ComponentId(0), 0, 2).unwrap());
/// ```
pub struct DirectLanding {
    pool: Arc<dyn KvPool>,
    slots: Arc<[u32]>,
}

impl DirectLanding {
    /// Landing of a batch whose plan page `i` goes to page slot `slots[i]` of `pool`.
    pub fn new(pool: Arc<dyn KvPool>, slots: Arc<[u32]>) -> Self {
        DirectLanding { pool, slots }
    }
}

impl LayerLanding for DirectLanding {
    fn target(
        &mut self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        let slot = *self.slots.get(plan_page).ok_or(DeviceError::OutOfPool {
            component: component.0,
            layer,
            slot: u32::MAX,
            reason: "plan page without a slot",
        })?;
        self.pool.slot_addr(component, layer, slot)
    }

    fn land(&mut self, _layer: u32) -> Result<LayerReady, DeviceError> {
        Ok(LayerReady::Resident)
    }
}

/// Makes the landing of each batch: what a linker holds instead of knowing the backend.
pub trait LandingFactory: Send + Sync {
    /// A landing for one batch whose plan page `i` goes to slot `slots[i]`.
    fn begin(&self, slots: Arc<[u32]>) -> Result<Box<dyn LayerLanding>, DeviceError>;

    /// The host memory a store writes into for this backend (pool buffers, or pinned
    /// staging), as (address, length): register it with the store once. It must be memory
    /// the factory owns (or keeps alive) for as long as the factory lives: a linker
    /// registers it with its store on that promise and keeps the factory until the store
    /// has let go.
    fn store_regions(&self) -> Vec<(usize, usize)>;

    /// For saving from a pool the store cannot read directly (device memory): a gatherer of
    /// the slices of plan page `i` (slot `slots[i]`) into host memory. Host pools are read in
    /// place and need none.
    fn begin_save(&self, slots: Arc<[u32]>) -> Result<Box<dyn SaveGather>, DeviceError> {
        let _ = slots;
        Err(DeviceError::Unavailable(
            "this backend's pool is read in place; it has no save gatherer".into(),
        ))
    }
}

/// Brings a batch's slices to host memory for a save.
pub trait SaveGather: Send {
    /// Gathers (`component`, `layer`) of every plan page and waits for it: the rows, in plan
    /// order, `page_layer_bytes` each, start at the returned host address and stay valid
    /// until the next call.
    fn gather(&mut self, component: ComponentId, layer: u32) -> Result<usize, DeviceError>;
}

/// Landings straight into a host pool ([`DirectLanding`]).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{DirectLandingFactory, HostKvPool, KvPool, LandingFactory};
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 2).unwrap());
/// let f = DirectLandingFactory::new(pool.clone());
/// assert_eq!(f.store_regions(), pool.regions());
/// ```
pub struct DirectLandingFactory {
    pool: Arc<dyn KvPool>,
}

impl DirectLandingFactory {
    /// Landings into `pool`.
    pub fn new(pool: Arc<dyn KvPool>) -> Self {
        DirectLandingFactory { pool }
    }
}

impl LandingFactory for DirectLandingFactory {
    fn begin(&self, slots: Arc<[u32]>) -> Result<Box<dyn LayerLanding>, DeviceError> {
        Ok(Box::new(DirectLanding::new(self.pool.clone(), slots)))
    }

    fn store_regions(&self) -> Vec<(usize, usize)> {
        self.pool.regions()
    }
}
