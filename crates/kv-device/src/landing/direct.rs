//! The host landing: reads go straight into a host pool's slots; a layer is resident when its
//! reads (and its collective) return.

use std::any::Any;
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Instant;

use kv_geometry::ComponentId;
use kv_loader::{LayerReady, TransferBytes};

use super::{
    next_landing_id, BatchShape, HostRows, HostShare, LandingFactory, LayerLanding, LayerStage,
    ReadTarget, RowBlock, SharePath, ShareSide, StageLent, StageLoan, TransferLog,
};
use crate::{DeviceError, HostRow, KvPool, Residence, SlotClaims, StoreRegion};

/// Reads straight into a host pool's slots; a layer is resident when its reads return. Shared
/// rows are read into this rank's own slots too, and a host collective moves them slot to
/// slot ([`HostRows`]).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{BatchShape, DirectLanding, HostKvPool, KvPool, LayerLanding};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 8).unwrap());
/// let shape = BatchShape::own_only(vec![ComponentId(0)]);
/// let mut landing = DirectLanding::new(pool.clone(), vec![5, 2].into(), shape).unwrap();
/// let mut stages = landing.take_stages();
/// let deadline = kv_loader::deadline_after(std::time::Duration::from_secs(1));
/// landing.open(&mut stages[0], 0, deadline).unwrap();
/// let loan = landing.lend(&mut stages[0]).unwrap();
/// let target = landing.target(&loan, ComponentId(0), 1).unwrap();
/// assert_eq!(target.addr(), pool.slot_addr(ComponentId(0), 0, 2).unwrap());
/// ```
pub struct DirectLanding {
    id: u64,
    pool: Arc<dyn KvPool>,
    slots: Arc<[u32]>,
    shape: BatchShape,
    stages: Vec<LayerStage>,
    /// Per stage of the ring, whether it is lent to a store read.
    lent: Vec<StageLent>,
    /// Per stage of the ring, the layer open in it: no two stages hold one layer.
    open: Mutex<Vec<Option<u32>>>,
    /// What a loan keeps: the claim on this batch's slots (which holds the pool).
    owner: Arc<dyn Any + Send + Sync>,
    log: TransferLog,
}

impl std::fmt::Debug for DirectLanding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLanding").finish_non_exhaustive()
    }
}

impl DirectLanding {
    /// Landing of a batch whose plan page `i` goes to page slot `slots[i]` of `pool` (a host
    /// pool that keeps [`SlotClaims`](crate::SlotClaims)), for the components of `shape`.
    /// It claims the slots for writing until it and every loan of it are dropped: refused
    /// ([`DeviceError::SlotBusy`]) while a save reads one of them, another landing writes
    /// one, or a slot is named twice.
    pub fn new(
        pool: Arc<dyn KvPool>,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Self, DeviceError> {
        if pool.residence() != Residence::Host {
            return Err(DeviceError::Unsupported(
                "a direct landing writes host pools only",
            ));
        }
        let claim = SlotClaims::write(&pool, &slots)?;
        let id = next_landing_id();
        let layers = pool.geometry().num_layers();
        Ok(DirectLanding {
            id,
            // The claim holds the pool too: it keeps the memory and the slots.
            owner: Arc::new(claim),
            open: Mutex::new(vec![None; layers as usize + 1]),
            pool,
            slots,
            shape,
            // A stage is a token here (no staging memory): one per layer and one more, so a
            // group of every layer can be read in one call.
            stages: LayerStage::ring(id, layers as usize + 1),
            lent: (0..=layers).map(|_| StageLent::default()).collect(),
            log: TransferLog::new(layers),
        })
    }

    fn slot_addr(
        &self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        let err = |reason| DeviceError::OutOfPool {
            component: component.0,
            layer,
            slot: u32::MAX,
            reason,
        };
        if !self.shape.plans(component) {
            return Err(err("component not planned in this batch"));
        }
        let slot = *self
            .slots
            .get(plan_page)
            .ok_or(err("plan page without a slot"))?;
        self.pool.slot_addr(component, layer, slot)
    }

    /// Bytes of one row of `component`.
    fn row_len(&self, component: ComponentId) -> Result<usize, DeviceError> {
        Ok(self
            .pool
            .geometry()
            .component(component)
            .map_err(|_| DeviceError::InvalidStage("an unknown component"))?
            .page_layer_bytes as usize)
    }

    /// Stage `h`'s lent flag.
    fn lent(&self, h: usize) -> Result<&StageLent, DeviceError> {
        self.lent
            .get(h)
            .ok_or(DeviceError::InvalidStage("a stage past the ring"))
    }
}

impl LayerLanding for DirectLanding {
    fn take_stages(&mut self) -> Vec<LayerStage> {
        std::mem::take(&mut self.stages)
    }

    fn open(
        &self,
        stage: &mut LayerStage,
        layer: u32,
        _deadline: Instant,
    ) -> Result<(), DeviceError> {
        let h = stage.index(self.id)?;
        self.lent(h)?.check("reopening a stage")?;
        if layer >= self.pool.geometry().num_layers() {
            return Err(DeviceError::InvalidStage("layer past the model"));
        }
        // The slots of a layer are one stage's at a time: its rows are lent, read and shared
        // through that stage only.
        let mut open = self.open.lock();
        if open
            .iter()
            .enumerate()
            .any(|(other, l)| other != h && *l == Some(layer))
        {
            return Err(DeviceError::InvalidStage(
                "the layer is open in another stage",
            ));
        }
        if let Some(entry) = open.get_mut(h) {
            *entry = Some(layer);
        }
        stage.set_layer(Some(layer));
        Ok(())
    }

    fn lend(&self, stage: &mut LayerStage) -> Result<StageLoan, DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        let lent = self.lent(h)?.lend()?;
        // SAFETY: the loan's targets are whole slot slices of this batch's slots at `layer`
        // (`target` checks them), in pool buffers the owner (the pool) keeps allocated; while
        // `lent` is set this landing touches none of them (`target_bytes`, `rows` and `land`
        // check it) and lends the stage to no one else; no other stage holds `layer` (`open`
        // refuses it), and the owner holds this landing's write claim on the slots, so no
        // save source reads them and no other landing writes them while the loan lives.
        Ok(unsafe { StageLoan::new(self.id, h, layer, lent, self.owner.clone()) })
    }

    fn target(
        &self,
        loan: &StageLoan,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError> {
        let (_, layer) = loan.stage_of(self.id)?;
        let addr = self.slot_addr(component, layer, plan_page)?;
        let len = self.row_len(component)?;
        // SAFETY: a whole slot slice of this batch at the loan's layer (checked above).
        Ok(unsafe { loan.target(addr, len) })
    }

    fn target_bytes<'s>(
        &'s self,
        stage: &'s LayerStage,
        component: ComponentId,
        plan_page: usize,
    ) -> Result<&'s [u8], DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.lent(h)?.check("reading a stage's bytes")?;
        let addr = self.slot_addr(component, layer, plan_page)?;
        let len = self.row_len(component)?;
        // SAFETY: `addr` is a whole slot slice (`page_layer_bytes`) of the host pool, which
        // `self` keeps alive for 's; the stage is not lent (checked above: no store call may
        // still write it, and whatever the last one wrote is visible), and it is borrowed for
        // 's, so it cannot be lent nor shared meanwhile (both need it exclusively); the reader
        // works on other stages, and the engine leaves slots of a batch in flight alone.
        Ok(unsafe { std::slice::from_raw_parts(addr as *const u8, len) })
    }

    fn land(&self, stage: &mut LayerStage) -> Result<LayerReady, DeviceError> {
        let (h, _) = stage.open_layer(self.id)?;
        self.lent(h)?.check("landing a stage")?;
        if let Some(entry) = self.open.lock().get_mut(h) {
            *entry = None;
        }
        stage.set_layer(None);
        Ok(LayerReady::Resident)
    }

    fn poison(&self, _stage: &mut LayerStage) {
        // Host collectives complete before they return: nothing can still write the slots.
    }

    fn transfers(&self) -> Vec<TransferBytes> {
        self.log.all()
    }

    fn share(&self) -> ShareSide<'_> {
        ShareSide::Host(self)
    }
}

impl HostShare for DirectLanding {
    fn rows<'s>(
        &'s self,
        stage: &'s mut LayerStage,
        blocks: &[RowBlock],
    ) -> Result<HostRows<'s>, DeviceError> {
        let (h, layer) = stage.open_layer(self.id)?;
        self.lent(h)?.check("sharing a stage's rows")?;
        let mut rows = Vec::new();
        for b in blocks {
            let len = self
                .pool
                .geometry()
                .component(b.component)
                .map_err(|_| DeviceError::InvalidStage("a row block of an unknown component"))?
                .page_layer_bytes as usize;
            let end = b.first_page.checked_add(b.pages);
            if end.is_none_or(|e| e > self.slots.len()) {
                return Err(DeviceError::InvalidStage("a row block past the plan"));
            }
            for page in b.first_page..b.first_page + b.pages {
                let addr = self.slot_addr(b.component, layer, page)?;
                rows.push(HostRow { addr, len });
            }
        }
        if overlapping(&rows) {
            return Err(DeviceError::InvalidStage("row blocks name a slot twice"));
        }
        // SAFETY: every row is a whole slot slice (`page_layer_bytes`) of the host pool, which
        // `self` keeps alive for 's; no two rows overlap (checked above). The stage is not lent
        // to a store read (checked above) and is borrowed exclusively for 's, and nothing else of this batch touches this layer's
        // slots meanwhile (the reader works on other layers' stages; the engine leaves slots of a
        // batch in flight alone).
        Ok(unsafe { HostRows::new(rows, layer, &self.log, stage) })
    }
}

/// True when two rows share a byte.
fn overlapping(rows: &[HostRow]) -> bool {
    crate::first_overlap_by(rows, |r| *r).is_some()
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
/// let regions: Vec<(usize, usize)> =
///     f.store_regions().iter().map(|r| (r.addr(), r.len())).collect();
/// assert_eq!(regions, pool.regions());
/// ```
pub struct DirectLandingFactory {
    pool: Arc<dyn KvPool>,
}

impl std::fmt::Debug for DirectLandingFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectLandingFactory")
            .finish_non_exhaustive()
    }
}

impl DirectLandingFactory {
    /// Landings into `pool`.
    pub fn new(pool: Arc<dyn KvPool>) -> Self {
        DirectLandingFactory { pool }
    }
}

impl LandingFactory for DirectLandingFactory {
    fn begin(
        &self,
        slots: Arc<[u32]>,
        shape: BatchShape,
    ) -> Result<Box<dyn LayerLanding>, DeviceError> {
        Ok(Box::new(DirectLanding::new(
            self.pool.clone(),
            slots,
            shape,
        )?))
    }

    fn store_regions(&self) -> Vec<StoreRegion> {
        let owner: Arc<dyn Any + Send + Sync> = Arc::new(self.pool.clone());
        self.pool
            .regions()
            .into_iter()
            // SAFETY: a pool's buffers are its own for as long as it lives (`KvPool::regions`),
            // and `owner` keeps the pool alive.
            .map(|(addr, len)| unsafe { StoreRegion::new(addr, len, owner.clone()) })
            .collect()
    }

    fn share_path(&self) -> SharePath {
        SharePath::Host
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::{CpuDevice, Device, HostKvPool};
    use kv_geometry::{KvGeometry, ModelKvSpec};

    /// A host pool has no save gatherer: `begin_save_after` says so at once, not after
    /// waiting for the engine's event (up to a minute) first.
    #[test]
    fn begin_save_after_on_a_host_pool_is_unsupported_at_once() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 4).unwrap());
        let factory = DirectLandingFactory::new(pool);
        let dev = CpuDevice::new(0).unwrap();
        dev.stall_for(Duration::from_secs(5));
        let ev = dev.new_stream().unwrap().record().unwrap();
        let t0 = Instant::now();
        let got = factory.begin_save_after(vec![0, 1].into(), &ev);
        assert!(matches!(got, Err(DeviceError::Unsupported(_))));
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
        dev.resume();
    }
}
