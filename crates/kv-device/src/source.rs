//! What a save reads: [`SaveSource`], a typed read-only region the store copies an object's
//! bytes from, minted by kv-device from memory it can vouch for.

use std::any::Any;
use std::ops::Range;
use std::sync::Arc;

use kv_geometry::ComponentId;

use crate::{DeviceError, KvPool, Residence, SlotClaims};

/// `len` bytes a store put reads, bound to the owner that keeps them allocated (the way
/// cudarc's `CudaSlice` keeps its context): a put that outlives its deadline holds the source,
/// so the bytes stay allocated until it returns, whoever drops what meanwhile.
///
/// Two kinds, each minted here:
/// - [`from_bytes`](Self::from_bytes): bytes of a buffer the source owns a share of and that
///   nothing writes again (an `Arc<Vec<u8>>`): sound whatever happens.
/// - [`slot`](Self::slot): one slot row of a host pool, read in place (zero-copy). Its bytes
///   are the engine's: they are not written while a save of them is in progress (the
///   contract of [`KvPool::write_slot`]).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::SaveSource;
/// let bytes = Arc::new(vec![1u8, 2, 3, 4]);
/// let s = SaveSource::from_bytes(bytes, 1..3).unwrap();
/// assert_eq!(s.bytes(), &[2, 3]);
/// assert!(SaveSource::from_bytes(Arc::new(vec![0u8; 2]), 1..3).is_err());
/// ```
#[derive(Clone)]
pub struct SaveSource {
    addr: usize,
    len: usize,
    /// Keeps the bytes allocated (never read: held).
    _owner: Arc<dyn Any + Send + Sync>,
}

impl SaveSource {
    /// Bytes `range` of `bytes` (checked to lie inside it).
    pub fn from_bytes(bytes: Arc<Vec<u8>>, range: Range<usize>) -> Result<Self, DeviceError> {
        let slice = bytes
            .get(range)
            .ok_or(DeviceError::InvalidStage("a save source outside its bytes"))?;
        let (addr, len) = (slice.as_ptr() as usize, slice.len());
        Ok(SaveSource {
            addr,
            len,
            _owner: bytes,
        })
    }

    /// Slot `slot`'s row of (`component`, model layer `layer`) of `pool`, a host pool that
    /// keeps [`SlotClaims`] (a device pool is gathered to host memory first:
    /// [`LandingFactory::begin_save`]). The source claims the slot for reading while it (or a
    /// clone) lives: refused ([`DeviceError::SlotBusy`]) while a landing writes the slot.
    ///
    /// [`LandingFactory::begin_save`]: crate::LandingFactory::begin_save
    pub fn slot(
        pool: &Arc<dyn KvPool>,
        component: ComponentId,
        layer: u32,
        slot: u32,
    ) -> Result<Self, DeviceError> {
        if pool.residence() != Residence::Host {
            return Err(DeviceError::Unsupported(
                "a save reads slots in place in host pools only",
            ));
        }
        let addr = pool.slot_addr(component, layer, slot)?;
        let len = pool
            .geometry()
            .component(component)
            .map_err(|_| DeviceError::InvalidStage("an unknown component"))?
            .page_layer_bytes as usize;
        let claim = SlotClaims::read(pool, slot)?;
        Ok(SaveSource {
            addr,
            len,
            // The claim holds the pool: it keeps the memory and the slot.
            _owner: Arc::new(claim),
        })
    }

    /// First byte (host address).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a source of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes (what a save checksums before it puts them).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the `len` bytes at `addr` lie in memory `owner` keeps allocated while `self`
        // lives (a buffer this source shares, checked in `from_bytes`; or a whole slot row of
        // a host pool, checked by `slot_addr`, which the pool keeps for its life). Nothing
        // writes them meanwhile: owned bytes are never written again; a slot row is claimed
        // for reading (no landing of kvlink writes it: `SlotClaims`), and the engine does not
        // write a slot while a save of it is in progress (`KvPool::write_slot`, `unsafe`).
        unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len) }
    }
}

impl std::fmt::Debug for SaveSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SaveSource")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::HostKvPool;
    use kv_geometry::{KvGeometry, ModelKvSpec};

    #[test]
    fn a_slot_source_is_the_slot_row_and_keeps_the_pool() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let host = HostKvPool::new(g, 4).unwrap();
        let row = vec![7u8; host.geometry().components()[0].page_layer_bytes as usize];
        // SAFETY: nothing else uses the pool.
        unsafe { host.write_slot(ComponentId(0), 0, 2, &row) }.unwrap();
        let pool: Arc<dyn KvPool> = Arc::new(host);
        let s = SaveSource::slot(&pool, ComponentId(0), 0, 2).unwrap();
        drop(pool);
        assert_eq!(s.bytes(), &row[..]);
        let pool: Arc<dyn KvPool> = Arc::new(
            HostKvPool::new(
                KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap(),
                1,
            )
            .unwrap(),
        );
        assert!(SaveSource::slot(&pool, ComponentId(0), 0, 1).is_err());
    }
}
