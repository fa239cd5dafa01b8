//! The KV pool in device memory.

use std::fmt;
use std::sync::Arc;

use kv_geometry::{ComponentId, KvGeometry};

use super::sync::{self, Bounce, SYNC_LIMIT};
use crate::pool::{locate, locate_slice};
use crate::{Device, DeviceError, DeviceMemory, KvPool, Residence, SlotClaims, Transfer};

/// A KV pool in the memory of one device: one zeroed buffer per (component, carried layer),
/// laid out exactly as [`HostKvPool`](crate::HostKvPool) (slot `s` at `s * page_layer_bytes`).
/// [`KvPool::slot_addr`] returns device addresses.
///
/// A store cannot write it directly; loads go through a [`StagedLanding`](super::StagedLanding)
/// (pinned staging, then copies on the device's load stream). `read_slot` / `write_slot` copy
/// synchronously through the load stream (after the landings' work enqueued there).
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{CpuDevice, DeviceKvPool, KvPool};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool = DeviceKvPool::new(CpuDevice::new(0).unwrap(), g, 4).unwrap();
/// // SAFETY: the pool is this example's alone, used from one thread, with no load in flight.
/// unsafe { pool.write_slot(ComponentId(1), 0, 3, &[9u8; 8448]) }.unwrap();
/// let mut out = vec![0u8; 8448];
/// // SAFETY: as above.
/// unsafe { pool.read_slot(ComponentId(1), 0, 3, &mut out) }.unwrap();
/// assert_eq!(out, vec![9u8; 8448]);
/// ```
pub struct DeviceKvPool {
    device: Arc<dyn Device>,
    geometry: KvGeometry,
    pages: u32,
    buffers: Vec<DeviceMemory>,
    /// Pinned memory of the synchronous copies (reads, writes, clears).
    bounce: Bounce,
    /// Which slots a staged landing writes and which a save's gather reads.
    claims: SlotClaims,
}

impl fmt::Debug for DeviceKvPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceKvPool")
            .field("device", &self.device)
            .field("pages", &self.pages)
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

impl DeviceKvPool {
    /// A zeroed pool of `pages` page slots for `geometry` on `device`.
    pub fn new(
        device: Arc<dyn Device>,
        geometry: KvGeometry,
        pages: u32,
    ) -> Result<Self, DeviceError> {
        let mut buffers = Vec::new();
        for c in geometry.components() {
            let bytes = c.page_layer_bytes.saturating_mul(u64::from(pages));
            let len = usize::try_from(bytes).map_err(|_| DeviceError::Alloc {
                bytes,
                what: "device pool buffer",
            })?;
            for _ in &c.layers {
                buffers.push(device.alloc(len, "device pool buffer")?);
            }
        }
        Ok(DeviceKvPool {
            device,
            geometry,
            pages,
            buffers,
            bounce: Bounce::default(),
            claims: SlotClaims::new(pages),
        })
    }

    /// The pinned bounce of the pool's synchronous copies (slot-table uploads use it too).
    pub(crate) fn bounce(&self) -> &Bounce {
        &self.bounce
    }

    /// The device it lives on.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The device buffer of (`component`, `layer`): (address, bytes).
    pub fn buffer(&self, component: ComponentId, layer: u32) -> Result<(u64, usize), DeviceError> {
        let (buf, _) = locate(&self.geometry, self.pages, component, layer, 0)?;
        Ok((self.buffers[buf].addr(), self.buffers[buf].len()))
    }

    fn slice(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        len: usize,
    ) -> Result<u64, DeviceError> {
        let (buf, off) = locate_slice(&self.geometry, self.pages, component, layer, slot, len)?;
        Ok(self.buffers[buf].addr() + off)
    }

    /// Copies one slot's slice out, after everything enqueued on the load stream so far (so a
    /// landing's copies are in). `out` must be exactly the slice's length.
    ///
    /// # Safety
    /// As [`HostKvPool::read_slot`](crate::HostKvPool::read_slot): nothing writes this slot's
    /// slice during the call other than work already enqueued on the load stream (no
    /// [`write_slot`](Self::write_slot) of it on another thread, no load of it on another
    /// stream). On the CPU device the copies are plain memory copies by its stream threads,
    /// so a race would be a data race. A copy that ran past its limit (an error) stays queued
    /// on the load stream and may still read the slice after the call: nothing may write it
    /// until that work has run (a later slot copy of this pool returning `Ok` shows it has:
    /// each waits for everything queued before it).
    pub unsafe fn read_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let src = self.slice(component, layer, slot, out.len())?;
        // SAFETY: `src` lies in our buffer with `out.len()` bytes (checked by `slice`); the
        // caller's promise orders this after any writer other than the load stream.
        unsafe { sync::read(&*self.device, &self.bounce, src, out) }
    }

    /// Copies `data` into one slot's slice (as an engine's attention would write new KV).
    ///
    /// # Safety
    /// As [`HostKvPool::write_slot`](crate::HostKvPool::write_slot): nothing else reads or
    /// writes this slot's slice during the call (no read or write of it on another thread, no
    /// load of it in flight, no save of it in progress). A copy that ran past its limit (an
    /// error) stays queued on the load stream and may still write the slice after the call:
    /// nothing may read or write it until that work has run (as for
    /// [`read_slot`](Self::read_slot)).
    pub unsafe fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let dst = self.slice(component, layer, slot, data.len())?;
        // SAFETY: `dst` lies in our buffer with `data.len()` bytes; the caller's promise: no
        // one else touches the slice meanwhile.
        unsafe { sync::write(&*self.device, &self.bounce, dst, data) }
    }

    /// Copies buffer `index` (in [`KvPool::regions`] order) out, after the load stream's work.
    ///
    /// # Safety
    /// Nothing writes the buffer during the call other than work already enqueued on the load
    /// stream.
    pub unsafe fn read_buffer(&self, index: usize, out: &mut [u8]) -> Result<(), DeviceError> {
        let b = self.buffers.get(index).ok_or(DeviceError::OutOfPool {
            component: u16::MAX,
            layer: u32::MAX,
            slot: u32::MAX,
            reason: "no such buffer",
        })?;
        if out.len() != b.len() {
            return Err(DeviceError::OutOfPool {
                component: u16::MAX,
                layer: u32::MAX,
                slot: u32::MAX,
                reason: "buffer length differs",
            });
        }
        // SAFETY: the whole buffer, ours; the caller's promise orders this after other writers.
        unsafe { sync::read(&*self.device, &self.bounce, b.addr(), out) }
    }

    /// Zeroes every buffer (after the load stream's work): copies from one zeroed pinned
    /// chunk, then one bounded wait.
    ///
    /// # Safety
    /// As [`HostKvPool::clear`](crate::HostKvPool::clear): nothing else reads or writes the
    /// pool during the call (no slot copy on another thread, no load or save of it in flight).
    pub unsafe fn clear(&self) -> Result<(), DeviceError> {
        let chunk = self
            .buffers
            .iter()
            .map(DeviceMemory::len)
            .max()
            .unwrap_or(0)
            .min(sync::BOUNCE_MAX);
        if chunk == 0 {
            return Ok(());
        }
        let zeros = self.bounce.take(&*self.device, chunk)?;
        // SAFETY: `zeros` is ours (taken from the bounce) and idle, at least `chunk` bytes.
        unsafe { std::ptr::write_bytes(zeros.addr() as *mut u8, 0, chunk) };
        let stream = self.device.load_stream();
        let enqueued = self.buffers.iter().try_for_each(|b| {
            let mut off = 0;
            while off < b.len() {
                let n = chunk.min(b.len() - off);
                let t = Transfer::ToDevice {
                    dst: b.addr() + off as u64,
                    src: zeros.addr(),
                    len: n,
                };
                // SAFETY: `off..off + n` lies in our buffer, the source in `zeros`, which
                // lives until the drain below (or is leaked); the caller keeps others away.
                unsafe { stream.transfer(t)? };
                off += n;
            }
            Ok(())
        });
        // On a timeout the zero chunk is parked in the bounce until the copies end. A copy
        // that failed to enqueue is the error to report, before the wait's own.
        match self.bounce.finished(&stream, zeros) {
            Ok(zeros) => {
                self.bounce.give(zeros);
                enqueued
            }
            Err(e) => enqueued.and(Err(e)),
        }
    }
}

// SAFETY: see the pool's docs: every slot lies inside one buffer the pool owns for its
// whole life (`locate` checks the triple, slots of distinct triples are disjoint by the
// geometry's layout), the geometry and page count are fixed at construction, and
// `slot_claims` is always the pool's own field, sized to its pages.
unsafe impl KvPool for DeviceKvPool {
    fn geometry(&self) -> &KvGeometry {
        &self.geometry
    }

    fn pages(&self) -> u32 {
        self.pages
    }

    fn residence(&self) -> Residence {
        Residence::Device {
            ordinal: self.device.ordinal(),
        }
    }

    fn slot_addr(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
    ) -> Result<usize, DeviceError> {
        let (buf, off) = locate(&self.geometry, self.pages, component, layer, slot)?;
        Ok((self.buffers[buf].addr() + off) as usize)
    }

    fn regions(&self) -> Vec<(usize, usize)> {
        self.buffers
            .iter()
            .map(|b| (b.addr() as usize, b.len()))
            .collect()
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
        // SAFETY: the trait's contract for `read_slot` is the inherent one's.
        unsafe { DeviceKvPool::read_slot(self, component, layer, slot, out) }
    }

    unsafe fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        // SAFETY: the trait's contract for `write_slot` is the inherent one's.
        unsafe { DeviceKvPool::write_slot(self, component, layer, slot, data) }
    }
}

impl Drop for DeviceKvPool {
    fn drop(&mut self) {
        // Landings wait for their copies before they go; a stream that never finished (a
        // stalled device) may still write the buffers: keep them rather than free them. A copy
        // of the pool already known stuck (parked in its bounce) is not waited for again: the
        // stream is behind it, so the wait would only spend its whole limit.
        let bytes: usize = self.buffers.iter().map(|b| b.len()).sum();
        let ordinal = self.device.ordinal();
        if self.bounce.stuck() {
            tracing::error!(
                bytes,
                ordinal,
                "device pool dropped while one of its copies is stuck; leaking its buffers"
            );
            for b in self.buffers.drain(..) {
                std::mem::forget(b);
            }
            return;
        }
        if let Err(e) = sync::drain(&self.device.load_stream(), SYNC_LIMIT) {
            tracing::error!(error = %e, bytes, ordinal,
                "device pool dropped with load-stream work pending; leaking its buffers");
            for b in self.buffers.drain(..) {
                std::mem::forget(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{CpuDevice, LandingFactory, StagedLandingFactory, StagingPool};
    use kv_geometry::ModelKvSpec;
    use std::time::Duration;

    /// While a copy of the pool is stuck past its limit, a save's slot-table upload fails at
    /// once (it goes through the pool's bounce): before, each save waited the 60 s limit out
    /// again on the stuck stream and leaked a pinned buffer. Dropping the pool then does not
    /// wait either.
    #[test]
    fn a_save_beside_a_stuck_copy_of_the_pool_fails_at_once() {
        let dev = CpuDevice::new(0).unwrap();
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let mut pool = DeviceKvPool::new(dev.clone(), g.clone(), 4).unwrap();
        pool.bounce = Bounce::with_limit(Duration::from_millis(200));
        let pool = Arc::new(pool);
        let c = &g.components()[0];
        let row = vec![1u8; c.page_layer_bytes as usize];
        dev.stall_for(Duration::from_secs(3));
        // SAFETY: the test's own pool, one thread, no load or save of it.
        let stuck = unsafe { pool.write_slot(c.id, c.layers[0], 0, &row) };
        assert!(
            matches!(stuck, Err(DeviceError::Timeout { .. })),
            "{stuck:?}"
        );
        let staging =
            StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, 4, 1), 2).unwrap();
        let factory = StagedLandingFactory::new(pool.clone(), staging);
        let t0 = std::time::Instant::now();
        for _ in 0..3 {
            let save = factory.begin_save(vec![1u32, 2].into()).map(drop);
            assert!(matches!(save, Err(DeviceError::Poisoned(_))), "{save:?}");
        }
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        // Refused before a slot table was had: none allocated (and none leaked) meanwhile.
        assert_eq!(dev.allocations("slot table"), 0);
        drop(factory);
        // Dropping the pool does not wait the 60 s limit out on the stream its copy is stuck
        // on (it keeps its buffers instead).
        let t1 = std::time::Instant::now();
        drop(Arc::into_inner(pool).expect("the test holds the pool's last handle"));
        assert!(t1.elapsed() < Duration::from_secs(1), "{:?}", t1.elapsed());
        dev.resume();
    }

    /// A save whose slot-table copy fails to enqueue queued nothing: the table is kept and the
    /// next save uses it. Before, it was leaked, and the next save allocated another.
    #[test]
    fn a_slot_table_copy_that_failed_to_enqueue_keeps_its_table() {
        let dev = CpuDevice::new(0).unwrap();
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 4).unwrap());
        let staging =
            StagingPool::new(dev.clone(), StagingPool::half_bytes_for(&g, 4, 1), 1).unwrap();
        let factory = StagedLandingFactory::new(pool, staging);
        dev.fail_enqueue(crate::cpu::CpuOp::ToDevice, 0);
        let failed = factory.begin_save(vec![1u32, 2].into()).map(drop);
        assert!(matches!(failed, Err(DeviceError::Driver(_))), "{failed:?}");
        factory.begin_save(vec![3u32, 0].into()).unwrap();
        assert_eq!(dev.allocations("slot table"), 1, "the table was kept");
    }

    /// A clear whose copy fails to enqueue, behind a stalled stream it then waits out,
    /// reports the enqueue's error (what went wrong), not the wait's timeout.
    #[test]
    fn a_clear_whose_copy_fails_to_enqueue_says_so_before_the_waits_timeout() {
        let dev = CpuDevice::new(0).unwrap();
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let mut pool = DeviceKvPool::new(dev.clone(), g, 4).unwrap();
        assert!(pool.buffers.len() >= 2, "a copy before the failing one");
        pool.bounce = Bounce::with_limit(Duration::from_millis(200));
        dev.stall_for(Duration::from_secs(3));
        dev.fail_enqueue(crate::cpu::CpuOp::ToDevice, 1);
        // SAFETY: the test's own pool, one thread, no load or save of it.
        let cleared = unsafe { pool.clear() };
        assert!(
            matches!(cleared, Err(DeviceError::Driver(_))),
            "{cleared:?}"
        );
        dev.resume();
    }
}
