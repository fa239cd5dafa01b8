//! The host KV pool.

use kv_geometry::{ComponentId, KvGeometry};

use super::buffer::HostBuffer;
use crate::pool::{locate, locate_slice};
use crate::{DeviceError, KvPool, Residence, SlotClaims};

/// A KV pool in host memory: one zeroed, page-aligned buffer per (component, carried layer).
///
/// ```
/// use kv_device::{HostKvPool, KvPool};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool = HostKvPool::new(g, 4).unwrap();
/// assert_eq!(pool.regions().len(), 78 + 21);
/// let mut page = vec![0xff; 41_984];
/// // SAFETY: no load and no other thread touches this fresh pool.
/// unsafe { pool.read_slot(ComponentId(0), 5, 3, &mut page) }.unwrap();
/// assert!(page.iter().all(|&b| b == 0));
/// ```
///
/// The slot copies are `unsafe`: the pool is shared (`Sync`, and a linker writes it through
/// the store), so only the caller can know that no one writes a slot while it copies it.
///
/// ```compile_fail,E0133
/// # use kv_device::HostKvPool;
/// # use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// # let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool = HostKvPool::new(g, 4).unwrap();
/// pool.write_slot(ComponentId(0), 5, 3, &[0u8; 41_984]).unwrap(); // needs `unsafe`
/// ```
pub struct HostKvPool {
    geometry: KvGeometry,
    pages: u32,
    buffers: Vec<HostBuffer>,
    claims: SlotClaims,
}

impl std::fmt::Debug for HostKvPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostKvPool")
            .field("model", &self.geometry.spec().model)
            .field("tp_rank", &self.geometry.tp_rank())
            .field("pages", &self.pages)
            .field("buffers", &self.buffers.len())
            .finish_non_exhaustive()
    }
}

impl HostKvPool {
    /// A zeroed pool of `pages` page slots for `geometry`.
    pub fn new(geometry: KvGeometry, pages: u32) -> Result<Self, DeviceError> {
        let mut buffers = Vec::new();
        for c in geometry.components() {
            let bytes = c.page_layer_bytes.saturating_mul(u64::from(pages));
            let len = usize::try_from(bytes).map_err(|_| DeviceError::Alloc {
                bytes,
                what: "host pool buffer",
            })?;
            for _ in &c.layers {
                buffers.push(HostBuffer::zeroed(len, "host pool buffer")?);
            }
        }
        Ok(HostKvPool {
            geometry,
            pages,
            buffers,
            claims: SlotClaims::new(pages),
        })
    }

    fn slice_ptr(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        len: usize,
    ) -> Result<*mut u8, DeviceError> {
        let (buf, off) = locate_slice(&self.geometry, self.pages, component, layer, slot, len)?;
        Ok((self.buffers[buf].addr() + off as usize) as *mut u8)
    }

    /// Copies one page slot's slice of (component, layer) out. `out` must be exactly the
    /// slice's length (else an error).
    ///
    /// # Safety
    /// Nothing writes this slot's slice during the call: no
    /// [`write_slot`](Self::write_slot) of it on another thread, and no load whose plan lands
    /// in `slot` still in flight (wait for the layer, or the batch, first). Concurrent reads
    /// are fine.
    pub unsafe fn read_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let src = self.slice_ptr(component, layer, slot, out.len())?;
        // SAFETY: `src` points inside our own buffer with `out.len()` bytes available
        // (checked by `slice_ptr`); `out` is a distinct, exclusive slice; nobody writes the
        // source during the copy (the caller's promise).
        unsafe { std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Copies `data` into one page slot's slice of (component, layer), as an engine's
    /// attention would write new KV. `data` must be exactly the slice's length (else an
    /// error). Refused ([`DeviceError::SlotBusy`]) while a save reads the slot (a put past
    /// its deadline keeps reading it until it returns: [`SlotClaims::wait_free`] waits for
    /// it) or a landing writes it; two `write_slot`s of one slot on two threads refuse each
    /// other likewise, also of different layers or components (claims are per slot: write a
    /// slot's rows from one thread).
    ///
    /// # Safety
    /// Nothing else reads or writes this slot's slice during the call: no
    /// [`read_slot`](Self::read_slot) of it on another thread, no load whose plan lands in
    /// `slot` in flight, and no save of it in progress (the claims catch those they see:
    /// kvlink's own landings and saves).
    pub unsafe fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let dst = self.slice_ptr(component, layer, slot, data.len())?;
        // A save's source or a landing holds the slot's claim: refused, not raced.
        let _held = self.claims.hold_write(slot)?;
        // SAFETY: `dst` points inside our own buffer with `data.len()` bytes available; no
        // one else touches the slice during the copy (kvlink's landings and saves hold the
        // slot's claim, which `_held` excludes; the rest is the caller's promise); `data` is a
        // distinct slice.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len()) };
        Ok(())
    }
}

impl HostKvPool {
    /// Writes zeros over every slot of every buffer, as [`DeviceKvPool::clear`] does on a
    /// device: between runs that must not see each other's bytes, or once at startup so that
    /// no load pays the buffers' first-touch page faults.
    ///
    /// # Safety
    /// Nothing else reads or writes the pool during the call: no slot copy on another
    /// thread, and no load or save of it in flight.
    ///
    /// [`DeviceKvPool::clear`]: crate::DeviceKvPool::clear
    pub unsafe fn clear(&self) {
        for b in &self.buffers {
            // SAFETY: the buffer is ours, `len` bytes at `addr`; nothing else touches it
            // during the call (the caller's promise).
            unsafe { std::ptr::write_bytes(b.addr() as *mut u8, 0, b.len()) };
        }
    }
}

// SAFETY: see the pool's docs: every slot lies inside one buffer the pool owns for its
// whole life (`locate` checks the triple, slots of distinct triples are disjoint by the
// geometry's layout), the geometry and page count are fixed at construction, and
// `slot_claims` is always the pool's own field, sized to its pages.
unsafe impl KvPool for HostKvPool {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    fn pages(&self) -> u32 {
        self.pages
    }

    fn residence(&self) -> Residence {
        Residence::Host
    }

    fn slot_addr(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
    ) -> Result<usize, DeviceError> {
        let (buf, off) = locate(&self.geometry, self.pages, component, layer, slot)?;
        Ok(self.buffers[buf].addr() + off as usize)
    }

    fn regions(&self) -> Vec<(usize, usize)> {
        self.buffers.iter().map(|b| (b.addr(), b.len())).collect()
    }

    fn slot_claims(&self) -> Option<&SlotClaims> {
        Some(&self.claims)
    }

    unsafe fn read_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the same contract as the inherent method, forwarded from our caller.
        unsafe { HostKvPool::read_slot(self, component, layer, slot, out) }
    }

    unsafe fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the same contract as the inherent method, forwarded from our caller.
        unsafe { HostKvPool::write_slot(self, component, layer, slot, data) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_geometry::{ComponentSpec, ElementType, ModelKvSpec, RowUnit, MAX_PAGE_SIZE};

    #[test]
    fn a_pool_too_large_to_size_is_an_error_not_an_overflow() {
        // 2^16 tokens x 2^24 B rows: 2^40 B per slot, times 2^32 slots overflows u64.
        let row = ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 1 << 24);
        let spec = ModelKvSpec::new("huge", 1, MAX_PAGE_SIZE, vec![row]).unwrap();
        let g = KvGeometry::new(spec, 1, 0).unwrap();
        assert!(matches!(
            HostKvPool::new(g, u32::MAX),
            Err(DeviceError::Alloc { .. })
        ));
    }

    /// Before, `write_slot` wrote a slot a save's source still read (a put past its deadline).
    #[test]
    fn write_slot_refuses_a_slot_a_save_or_a_landing_holds() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool: std::sync::Arc<dyn KvPool> = std::sync::Arc::new(HostKvPool::new(g, 4).unwrap());
        let row = vec![1u8; 41_984];
        let source = crate::SaveSource::slot(&pool, ComponentId(0), 0, 2).unwrap();
        // SAFETY: the pool is this test's alone; the source only holds the claim here.
        let got = unsafe { pool.write_slot(ComponentId(0), 0, 2, &row) };
        assert!(
            matches!(got, Err(DeviceError::SlotBusy { slot: 2, .. })),
            "{got:?}"
        );
        // SAFETY: as above (another slot).
        unsafe { pool.write_slot(ComponentId(0), 0, 1, &row) }.unwrap();
        drop(source);
        let landing = SlotClaims::write(&pool, &[2]).unwrap();
        // SAFETY: as above.
        let got = unsafe { pool.write_slot(ComponentId(0), 0, 2, &row) };
        assert!(
            matches!(got, Err(DeviceError::SlotBusy { slot: 2, .. })),
            "{got:?}"
        );
        drop(landing);
        // SAFETY: as above; nothing holds the slot now.
        unsafe { pool.write_slot(ComponentId(0), 0, 2, &row) }.unwrap();
        // The write's own hold ended with it.
        assert!(SlotClaims::read(&pool, 2).is_ok());
    }

    #[test]
    fn clear_zeroes_every_slot() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 2, 1).unwrap();
        let pool = HostKvPool::new(g, 3).unwrap();
        let (ix, row) = (ComponentId(1), 8448);
        // SAFETY: the pool is this test's alone, used from one thread.
        unsafe { pool.write_slot(ix, 3, 2, &vec![7u8; row]) }.unwrap();
        // SAFETY: as above.
        unsafe { pool.clear() };
        let mut out = vec![1u8; row];
        // SAFETY: as above.
        unsafe { pool.read_slot(ix, 3, 2, &mut out) }.unwrap();
        assert!(out.iter().all(|&b| b == 0));
    }

    #[test]
    fn slots_are_distinct_and_round_trip() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 2, 1).unwrap();
        let pool = HostKvPool::new(g, 3).unwrap();
        let ix = ComponentId(1);
        let a = vec![7u8; 8448];
        // SAFETY: the pool is this test's alone, used from one thread.
        unsafe { pool.write_slot(ix, 3, 2, &a) }.unwrap();
        let mut out = vec![0u8; 8448];
        // SAFETY: as above.
        unsafe { pool.read_slot(ix, 3, 2, &mut out) }.unwrap();
        assert_eq!(out, a);
        // SAFETY: as above.
        unsafe { pool.read_slot(ix, 3, 1, &mut out) }.unwrap();
        assert!(out.iter().all(|&b| b == 0), "neighbouring slot untouched");
        assert_eq!(
            pool.slot_addr(ix, 3, 2).unwrap() - pool.slot_addr(ix, 3, 1).unwrap(),
            8448
        );
        // Layer 1 carries no indexer; slot 3 is past the pool; wrong length refused.
        assert!(matches!(
            pool.slot_addr(ix, 1, 0),
            Err(DeviceError::OutOfPool { .. })
        ));
        assert!(matches!(
            pool.slot_addr(ix, 0, 3),
            Err(DeviceError::OutOfPool { .. })
        ));
        // SAFETY: as above.
        assert!(unsafe { pool.write_slot(ix, 0, 0, &a[..10]) }.is_err());
    }
}
