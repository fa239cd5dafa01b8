//! The device KV pool.

use std::sync::Arc;

use cudarc::driver::result;
use kv_geometry::{ComponentId, KvGeometry};

use super::device::{drv, CudaDevice};
use super::memory::DeviceBuffer;
use crate::pool::{locate, locate_slice};
use crate::{DeviceError, KvPool, Residence};

/// A KV pool in the memory of one GPU: one zeroed device buffer per (component, carried
/// layer), laid out exactly as [`HostKvPool`](crate::HostKvPool) (slot `s` at
/// `s * page_layer_bytes`). [`KvPool::slot_addr`] returns device addresses.
///
/// A store reached over TCP cannot write these; loads go through
/// [`StagedLanding`](super::StagedLanding) (pinned staging, then async copies).
pub struct CudaKvPool {
    device: Arc<CudaDevice>,
    geometry: KvGeometry,
    pages: u32,
    buffers: Vec<DeviceBuffer>,
}

impl CudaKvPool {
    /// A zeroed pool of `pages` page slots for `geometry` on `device`.
    pub fn new(
        device: &Arc<CudaDevice>,
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
                buffers.push(DeviceBuffer::zeroed(
                    device.context(),
                    len,
                    "device pool buffer",
                )?);
            }
        }
        Ok(CudaKvPool {
            device: device.clone(),
            geometry,
            pages,
            buffers,
        })
    }

    /// The GPU it lives on.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// The device buffer of (`component`, `layer`): (address, bytes).
    pub fn buffer(&self, component: ComponentId, layer: u32) -> Result<(u64, usize), DeviceError> {
        let (buf, _) = locate(&self.geometry, self.pages, component, layer, 0)?;
        Ok((self.buffers[buf].ptr(), self.buffers[buf].len()))
    }

    fn slice(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        len: usize,
    ) -> Result<u64, DeviceError> {
        let (buf, off) = locate_slice(&self.geometry, self.pages, component, layer, slot, len)?;
        Ok(self.buffers[buf].ptr() + off)
    }

    /// Copies one slot's slice out to the host, synchronously: waits for the load stream first
    /// (so copies enqueued by landings are in), then copies. For tests and checks.
    pub fn read_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        out: &mut [u8],
    ) -> Result<(), DeviceError> {
        let src = self.slice(component, layer, slot, out.len())?;
        self.device.synchronize_load_stream()?;
        self.device.bind()?;
        // SAFETY: `src` is inside our buffer with `out.len()` bytes available (checked by
        // `slice`); the load stream is idle, and the caller orders this after any other writer.
        unsafe { result::memcpy_dtoh_sync(out, src) }.map_err(drv("cuMemcpyDtoH"))
    }

    /// Copies `data` into one slot's slice, synchronously (as an engine's attention would
    /// write new KV). The caller owns the slot (no load targets it).
    pub fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError> {
        let dst = self.slice(component, layer, slot, data.len())?;
        self.device.bind()?;
        // SAFETY: `dst` is inside our buffer with `data.len()` bytes available; the caller owns
        // the slot; the copy is synchronous, so `data` outlives it.
        unsafe { result::memcpy_htod_sync(dst, data) }.map_err(drv("cuMemcpyHtoD"))
    }

    /// Zeroes every buffer (synchronously, after the load stream drains).
    pub fn clear(&self) -> Result<(), DeviceError> {
        self.device.synchronize_load_stream()?;
        self.device.bind()?;
        for b in &self.buffers {
            // SAFETY: our own buffer, `len` bytes; the load stream is idle and the caller
            // guarantees no other device work uses the pool.
            unsafe { result::memset_d8_sync(b.ptr(), 0, b.len()) }.map_err(drv("cuMemsetD8"))?;
        }
        Ok(())
    }
}

impl KvPool for CudaKvPool {
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
        Ok((self.buffers[buf].ptr() + off) as usize)
    }

    fn regions(&self) -> Vec<(usize, usize)> {
        self.buffers
            .iter()
            .map(|b| (b.ptr() as usize, b.len()))
            .collect()
    }
}
