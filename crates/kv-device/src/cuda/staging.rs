//! A reusable pool of staging buffers: pinned host memory (what the store writes into) paired
//! with device memory of the same size (where a whole layer lands contiguously before the
//! scatter kernel, or where a broadcast delivers rows). Allocated once (`cuMemHostAlloc` is
//! slow and synchronizing), leased per batch, returned on drop.

use std::sync::Arc;

use parking_lot::Mutex;

use super::device::CudaDevice;
use super::memory::{DeviceBuffer, PinnedBuffer};
use crate::DeviceError;

/// One staging buffer pair, each split in two halves (even and odd layers).
#[derive(Debug)]
pub(crate) struct StagingPair {
    pub(crate) host: PinnedBuffer,
    pub(crate) dev: DeviceBuffer,
}

/// Staging buffers of one GPU, allocated once and reused.
///
/// Each buffer holds two halves of [`half_bytes`](StagingPool::half_bytes): a batch's layer
/// `l` is staged in half `l % 2`, so the read of `l + 1` fills one half while the copies of
/// `l` drain the other.
#[derive(Debug)]
pub struct StagingPool {
    device: Arc<CudaDevice>,
    half_bytes: usize,
    free: Mutex<Vec<StagingPair>>,
    host_regions: Vec<(usize, usize)>,
    count: usize,
}

impl StagingPool {
    /// `count` staging buffers whose halves hold `half_bytes` each (at least one layer of the
    /// largest batch: pages × the bytes of every component carried on a layer).
    pub fn new(
        device: &Arc<CudaDevice>,
        half_bytes: usize,
        count: usize,
    ) -> Result<Arc<Self>, DeviceError> {
        let total = half_bytes.checked_mul(2).ok_or(DeviceError::Alloc {
            bytes: u64::MAX,
            what: "staging buffer",
        })?;
        let mut free = Vec::with_capacity(count);
        let mut host_regions = Vec::with_capacity(count);
        for _ in 0..count {
            let host = PinnedBuffer::zeroed(device.context(), total, "pinned staging")?;
            let dev = DeviceBuffer::alloc(device.context(), total, "device staging")?;
            host_regions.push((host.addr(), host.len()));
            free.push(StagingPair { host, dev });
        }
        Ok(Arc::new(StagingPool {
            device: device.clone(),
            half_bytes,
            free: Mutex::new(free),
            host_regions,
            count,
        }))
    }

    /// Bytes per half.
    pub fn half_bytes(&self) -> usize {
        self.half_bytes
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.device
    }

    /// Every pinned host region (address, length), leased or not: register them with the
    /// store once, at start.
    pub fn host_regions(&self) -> Vec<(usize, usize)> {
        self.host_regions.clone()
    }

    /// Buffers in the pool.
    pub fn capacity(&self) -> usize {
        self.count
    }

    /// Buffers not leased now.
    pub fn available(&self) -> usize {
        self.free.lock().len()
    }

    /// Leases a buffer; [`DeviceError::Alloc`] when every buffer is leased (the caller limits
    /// batches in flight to the pool's capacity).
    pub fn lease(self: &Arc<Self>) -> Result<StagingLease, DeviceError> {
        let pair = self.free.lock().pop().ok_or(DeviceError::Alloc {
            bytes: (self.half_bytes * 2) as u64,
            what: "staging buffer (every buffer of the pool is leased)",
        })?;
        Ok(StagingLease {
            pool: self.clone(),
            pair: Some(pair),
        })
    }
}

/// A leased staging buffer; returns to its pool on drop. The holder must have waited for the
/// device work that uses it before dropping (a [`StagedLanding`](super::StagedLanding) does).
#[derive(Debug)]
pub struct StagingLease {
    pool: Arc<StagingPool>,
    pair: Option<StagingPair>,
}

impl StagingLease {
    fn pair(&self) -> &StagingPair {
        self.pair
            .as_ref()
            .expect("a lease holds its pair until dropped")
    }

    /// Bytes per half.
    pub fn half_bytes(&self) -> usize {
        self.pool.half_bytes
    }

    /// Host address of half `parity` (0 or 1).
    pub fn host_half(&self, parity: usize) -> usize {
        self.pair().host.addr() + (parity & 1) * self.pool.half_bytes
    }

    /// Device address of half `parity` (0 or 1).
    pub fn device_half(&self, parity: usize) -> u64 {
        self.pair().dev.ptr() + ((parity & 1) * self.pool.half_bytes) as u64
    }

    /// The pinned buffer (both halves).
    pub fn host(&self) -> &PinnedBuffer {
        &self.pair().host
    }

    /// The GPU.
    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.pool.device
    }
}

impl Drop for StagingLease {
    fn drop(&mut self) {
        if let Some(pair) = self.pair.take() {
            self.pool.free.lock().push(pair);
        }
    }
}
