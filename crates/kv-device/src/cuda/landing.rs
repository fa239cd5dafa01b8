//! Staged landing: the store writes a layer into pinned staging (plan order), `land` moves it
//! into the device pool's slots with async copies on the load stream and hands back an event.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{result, sys};
use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::LayerReady;

use super::device::drv;
use super::event::CudaLayerEvent;
use super::kernels::RowCopy;
use super::memory::DeviceBuffer;
use super::pool::CudaKvPool;
use super::staging::{StagingLease, StagingPool};
use crate::{DeviceError, KvPool, LayerLanding};

/// How `land` moves a staged layer into scattered slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScatterStrategy {
    /// Runs when the slots form at most [`DIRECT_RUNS_MAX`] contiguous runs, else Kernel.
    #[default]
    Auto,
    /// One host→device copy per contiguous run of slots, straight into the pool.
    Runs,
    /// One host→device copy of the whole component into device staging, then one launch of
    /// the scatter kernel (row `i` → slot `slots[i]`).
    Kernel,
}

/// With [`ScatterStrategy::Auto`], slot runs up to this count are copied directly.
pub const DIRECT_RUNS_MAX: usize = 8;

/// Counters of one landing (what it enqueued).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LandingStats {
    /// Layers landed.
    pub layers: u64,
    /// Copy calls enqueued (host→device, device→host).
    pub copies: u64,
    /// Kernel launches enqueued.
    pub kernel_launches: u64,
    /// Bytes moved into (or out of) the pool.
    pub bytes: u64,
    /// Times `target` had to block until a staging half's previous copies finished.
    pub reuse_waits: u64,
}

/// A contiguous run: plan pages `page..page+len` go to slots `slot..slot+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    page: u32,
    slot: u32,
    len: u32,
}

fn slot_runs(slots: &[u32]) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (i, &s) in slots.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.slot.checked_add(r.len) == Some(s) => r.len += 1,
            _ => runs.push(Run {
                page: i as u32,
                slot: s,
                len: 1,
            }),
        }
    }
    runs
}

#[derive(Debug, Default)]
struct Half {
    /// The layer staged in this half (being filled, or landed).
    layer: Option<u32>,
    landed: bool,
    /// Components written for `layer` (ids).
    targeted: Vec<u16>,
    /// Recorded after the last copies out of (or into) this half.
    event: Option<Arc<CudaLayerEvent>>,
}

/// One batch's landing into a [`CudaKvPool`] through a leased staging buffer.
///
/// Layout: layer `l` is staged in half `l % 2`; inside a half the components carried on `l`
/// follow in geometry order, each as `pages` rows of its `page_layer_bytes` in **plan order**
/// (row `i` is plan page `i`). [`target`](LayerLanding::target) returns host addresses there;
/// [`land`](LayerLanding::land) enqueues the copies of the targeted components on the load
/// stream (contiguous slot runs as one copy each, or, for scattered slots, one copy into
/// device staging and one scatter-kernel launch per component), records a
/// [`CudaLayerEvent`] and returns it as [`LayerReady::Event`].
///
/// Reuse: the first `target` of layer `l` waits for the event of the layer last landed in the
/// same half (`l - 2`), so the store never overwrites bytes still being copied. Drop waits
/// for both halves before the lease returns to its pool.
///
/// The dedup path uses the same staging: [`stage_to_device`](StagedLanding::stage_to_device)
/// (the reader's rows → device staging, to broadcast from),
/// [`layer_region`](StagedLanding::layer_region) (what to broadcast), and
/// [`land_from_device`](StagedLanding::land_from_device) (scatter rows that arrived in
/// device staging into this rank's slots). [`gather`](StagedLanding::gather) is the save
/// direction.
pub struct StagedLanding {
    pool: Arc<CudaKvPool>,
    lease: StagingLease,
    slots: Arc<[u32]>,
    dev_slots: Option<DeviceBuffer>,
    runs: Vec<Run>,
    strategy: ScatterStrategy,
    halves: [Half; 2],
    stats: LandingStats,
}

impl StagedLanding {
    /// A landing of a batch whose plan page `i` goes to slot `slots[i]` of `pool`, staged in
    /// `lease`. Checks that every slot is inside the pool and that a half holds the largest
    /// layer of the batch; uploads the slots for the scatter kernel.
    pub fn new(
        pool: Arc<CudaKvPool>,
        lease: StagingLease,
        slots: Arc<[u32]>,
    ) -> Result<Self, DeviceError> {
        if lease.device().ordinal() != pool.device().ordinal() {
            return Err(DeviceError::Driver(format!(
                "staging of GPU {} used for a pool on GPU {}",
                lease.device().ordinal(),
                pool.device().ordinal()
            )));
        }
        if let Some((i, &s)) = slots.iter().enumerate().find(|(_, &s)| s >= pool.pages()) {
            return Err(DeviceError::OutOfPool {
                component: u16::MAX,
                layer: u32::MAX,
                slot: s,
                reason: if i == 0 {
                    "slot past the pool (plan page 0)"
                } else {
                    "slot past the pool"
                },
            });
        }
        let g = pool.geometry();
        let pages = slots.len() as u64;
        let need = (0..g.num_layers())
            .map(|l| {
                g.components()
                    .iter()
                    .filter(|c| c.position(l).is_some())
                    .map(|c| c.page_layer_bytes * pages)
                    .sum::<u64>()
            })
            .max()
            .unwrap_or(0);
        if need > lease.half_bytes() as u64 {
            return Err(DeviceError::Alloc {
                bytes: need * 2,
                what: "staging buffer (a half is smaller than one layer of this batch)",
            });
        }
        let dev_slots = if slots.is_empty() {
            None
        } else {
            let buf = DeviceBuffer::alloc(pool.device().context(), slots.len() * 4, "slot table")?;
            // SAFETY: `buf` is ours and holds exactly `slots.len()` u32; the copy is
            // synchronous, so `slots` outlives it.
            unsafe { result::memcpy_htod_sync(buf.ptr(), &slots[..]) }
                .map_err(drv("cuMemcpyHtoD (slot table)"))?;
            Some(buf)
        };
        let runs = slot_runs(&slots);
        if runs.len() > DIRECT_RUNS_MAX {
            // Compile/load the scatter kernel now (once per device), not inside the first
            // `land`; a failure surfaces there, where the kernel is needed.
            if let Err(e) = pool.device().kernels() {
                tracing::warn!(error = %e, "copy kernels unavailable");
            }
        }
        Ok(StagedLanding {
            runs,
            pool,
            lease,
            slots,
            dev_slots,
            strategy: ScatterStrategy::Auto,
            halves: [Half::default(), Half::default()],
            stats: LandingStats::default(),
        })
    }

    /// Chooses how scattered slots are copied (benchmarks compare them).
    pub fn with_strategy(mut self, strategy: ScatterStrategy) -> Self {
        self.strategy = strategy;
        self
    }

    /// What was enqueued so far.
    pub fn stats(&self) -> LandingStats {
        self.stats
    }

    /// Contiguous slot runs of the batch.
    pub fn num_runs(&self) -> usize {
        self.runs.len()
    }

    /// The staging lease (host regions, halves).
    pub fn lease(&self) -> &StagingLease {
        &self.lease
    }

    fn pages(&self) -> u64 {
        self.slots.len() as u64
    }

    /// Byte offset of `component` inside a half for `layer`, and its layout.
    fn locate(
        &self,
        component: ComponentId,
        layer: u32,
    ) -> Result<(u64, &ComponentLayout), DeviceError> {
        let err = |reason| DeviceError::OutOfPool {
            component: component.0,
            layer,
            slot: u32::MAX,
            reason,
        };
        let mut off = 0u64;
        for c in self.pool.geometry().components() {
            if c.position(layer).is_none() {
                continue;
            }
            if c.id == component {
                return Ok((off, c));
            }
            off += c.page_layer_bytes * self.pages();
        }
        if self.pool.geometry().component(component).is_err() {
            Err(err("unknown component"))
        } else {
            Err(err("component not on this layer"))
        }
    }

    /// Bytes of every component carried on `layer`, i.e. the used prefix of its half.
    fn layer_bytes(&self, layer: u32) -> u64 {
        self.pool
            .geometry()
            .components()
            .iter()
            .filter(|c| c.position(layer).is_some())
            .map(|c| c.page_layer_bytes * self.pages())
            .sum()
    }

    /// Makes half `layer % 2` hold `layer`: waits for the copies of the layer it held before.
    fn open(&mut self, layer: u32) -> Result<usize, DeviceError> {
        let h = (layer % 2) as usize;
        let half = &mut self.halves[h];
        match half.layer {
            Some(l) if l == layer && !half.landed => return Ok(h),
            Some(l) if l == layer => {
                return Err(DeviceError::OutOfPool {
                    component: u16::MAX,
                    layer,
                    slot: u32::MAX,
                    reason: "layer already landed in this batch",
                })
            }
            Some(_) if !half.landed => {
                return Err(DeviceError::OutOfPool {
                    component: u16::MAX,
                    layer,
                    slot: u32::MAX,
                    reason: "staging half still holds a layer that was not landed",
                })
            }
            _ => {}
        }
        if let Some(ev) = half.event.take() {
            if !ev.is_complete()? {
                self.stats.reuse_waits += 1;
                ev.wait()?;
            }
        }
        half.layer = Some(layer);
        half.landed = false;
        half.targeted.clear();
        Ok(h)
    }

    /// Makes half `layer % 2` hold gathered rows of `layer`: gathers of several components of
    /// one layer share the half; a gather of another layer of the same parity first waits for
    /// the previous gathers (whose rows the caller must have consumed by then).
    fn open_for_gather(&mut self, layer: u32) -> Result<usize, DeviceError> {
        let h = (layer % 2) as usize;
        let half = &mut self.halves[h];
        if half.layer == Some(layer) && half.landed {
            return Ok(h);
        }
        if half.layer.is_some() && !half.landed {
            return Err(DeviceError::OutOfPool {
                component: u16::MAX,
                layer,
                slot: u32::MAX,
                reason: "staging half still holds a layer that was not landed",
            });
        }
        if let Some(ev) = half.event.take() {
            ev.wait()?;
        }
        half.layer = Some(layer);
        half.landed = true;
        half.targeted.clear();
        Ok(h)
    }

    fn mark(&mut self, h: usize, component: ComponentId) {
        let t = &mut self.halves[h].targeted;
        if !t.contains(&component.0) {
            t.push(component.0);
        }
    }

    fn check_page(
        &self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<(), DeviceError> {
        if plan_page >= self.slots.len() {
            return Err(DeviceError::OutOfPool {
                component: component.0,
                layer,
                slot: u32::MAX,
                reason: "plan page without a slot",
            });
        }
        Ok(())
    }

    /// Device-staging address of plan page `plan_page`'s row of (`component`, `layer`): where a
    /// collective delivers rows before [`land_from_device`](Self::land_from_device).
    pub fn device_target(
        &mut self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<u64, DeviceError> {
        self.check_page(component, layer, plan_page)?;
        let (off, c) = self.locate(component, layer)?;
        let row = c.page_layer_bytes;
        let h = self.open(layer)?;
        self.mark(h, component);
        Ok(self.lease.device_half(h) + off + plan_page as u64 * row)
    }

    /// The staged bytes of `layer` (every component carried on it, in plan order):
    /// (host address, device address, length). Opens the layer's half (waiting for its reuse)
    /// and counts every carried component as targeted.
    pub fn layer_region(&mut self, layer: u32) -> Result<(usize, u64, usize), DeviceError> {
        let h = self.open(layer)?;
        let ids: Vec<ComponentId> = self
            .pool
            .geometry()
            .components()
            .iter()
            .filter(|c| c.position(layer).is_some())
            .map(|c| c.id)
            .collect();
        for id in ids {
            self.mark(h, id);
        }
        Ok((
            self.lease.host_half(h),
            self.lease.device_half(h),
            self.layer_bytes(layer) as usize,
        ))
    }

    /// Enqueues one host→device copy of `layer`'s staged rows (pinned half → device half) and
    /// returns its event: the rows a reader got, ready to be broadcast or all-gathered from
    /// device staging. Does not land the layer.
    pub fn stage_to_device(&mut self, layer: u32) -> Result<Arc<CudaLayerEvent>, DeviceError> {
        let h = self.open(layer)?;
        let len = self.layer_bytes(layer) as usize;
        let dev = self.pool.device().clone();
        dev.bind()?;
        let stream = dev.load_stream().cu_stream();
        // SAFETY: both halves are ours and hold at least `len` bytes (checked in `new`); the
        // store finished writing the host half (the caller stages after the layer's reads);
        // the half is not reused before this copy's event (recorded below) completes.
        unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                self.lease.device_half(h),
                self.lease.host_half(h) as *const c_void,
                len,
                stream,
            )
        }
        .result()
        .map_err(drv("cuMemcpyHtoDAsync (stage to device)"))?;
        self.stats.copies += 1;
        let ev = CudaLayerEvent::record_on(dev.load_stream(), layer)?;
        self.halves[h].event = Some(ev.clone());
        Ok(ev)
    }

    /// Lands `layer` from **device** staging: the load stream waits for `after` (e.g. the
    /// broadcast's completion event on the comm stream), then one scatter-kernel launch per
    /// component in `components` moves row `i` into slot `slots[i]`.
    pub fn land_from_device(
        &mut self,
        layer: u32,
        components: &[ComponentId],
        after: Option<&CudaLayerEvent>,
    ) -> Result<LayerReady, DeviceError> {
        let h = self.open(layer)?;
        let dev = self.pool.device().clone();
        if let Some(ev) = after {
            ev.wait_on(dev.load_stream())?;
        }
        for &c in components {
            self.mark(h, c);
            self.scatter_component(h, c, layer, true)?;
        }
        self.finish(h, layer)
    }

    /// Copies one component of a staged layer into the pool. `from_device`: the rows are in
    /// device staging already (no host→device copy).
    fn scatter_component(
        &mut self,
        h: usize,
        component: ComponentId,
        layer: u32,
        from_device: bool,
    ) -> Result<(), DeviceError> {
        let pages = self.slots.len();
        if pages == 0 {
            return Ok(());
        }
        let (off, c) = self.locate(component, layer)?;
        let row = c.page_layer_bytes;
        let (dst_base, _) = self.pool.buffer(component, layer)?;
        let dev = self.pool.device().clone();
        dev.bind()?;
        let stream = dev.load_stream().cu_stream();
        let host = self.lease.host_half(h) as u64 + off;
        let dstage = self.lease.device_half(h) + off;
        let use_runs = match self.strategy {
            ScatterStrategy::Runs => true,
            ScatterStrategy::Kernel => false,
            ScatterStrategy::Auto => self.runs.len() <= DIRECT_RUNS_MAX,
        };
        if use_runs {
            for r in &self.runs {
                let dst = dst_base + u64::from(r.slot) * row;
                let src = u64::from(r.page) * row;
                let len = (u64::from(r.len) * row) as usize;
                // SAFETY: source rows lie in our staging half (checked size in `new`),
                // destination slots in the pool buffer (slots checked < pages in `new`); the
                // store finished writing the half; the half and the pool outlive the copy
                // (Drop waits for the event recorded after it).
                let res = unsafe {
                    if from_device {
                        sys::cuMemcpyDtoDAsync_v2(dst, dstage + src, len, stream)
                    } else {
                        sys::cuMemcpyHtoDAsync_v2(
                            dst,
                            (host + src) as usize as *const c_void,
                            len,
                            stream,
                        )
                    }
                };
                res.result().map_err(drv("cuMemcpyAsync (slot run)"))?;
                self.stats.copies += 1;
            }
        } else {
            if !from_device {
                // SAFETY: as above; one copy of the component's rows into device staging.
                unsafe {
                    sys::cuMemcpyHtoDAsync_v2(
                        dstage,
                        host as usize as *const c_void,
                        pages * row as usize,
                        stream,
                    )
                }
                .result()
                .map_err(drv("cuMemcpyHtoDAsync (to device staging)"))?;
                self.stats.copies += 1;
            }
            let kernels = dev.kernels()?;
            let dev_slots = self.dev_slots.as_ref().map_or(0, |b| b.ptr());
            // SAFETY: source rows `0..pages` lie in device staging, destination rows
            // `slots[i] < pool pages` in the pool buffer (checked in `new`), the slot table
            // holds `pages` u32 on the device; staging and pool outlive the launch (Drop
            // waits for the event recorded after it); distinct plan slots write distinct rows.
            unsafe {
                kernels.copy_rows(
                    stream,
                    RowCopy {
                        src: dstage,
                        dst: dst_base,
                        src_rows: 0,
                        dst_rows: dev_slots,
                        n_rows: pages as u32,
                        row_bytes: row,
                    },
                )?;
            }
            self.stats.kernel_launches += 1;
        }
        self.stats.bytes += pages as u64 * row;
        Ok(())
    }

    fn finish(&mut self, h: usize, layer: u32) -> Result<LayerReady, DeviceError> {
        let ev = CudaLayerEvent::record_on(self.pool.device().load_stream(), layer)?;
        let half = &mut self.halves[h];
        half.event = Some(ev.clone());
        half.landed = true;
        self.stats.layers += 1;
        Ok(LayerReady::Event(ev))
    }

    /// The save direction: enqueues the gather of (`component`, `layer`) from the batch's
    /// slots into the pinned half of `layer` (plan order, the layout `target` uses) and
    /// returns (host address of the rows, event). The host bytes are valid once the event
    /// completes, until the next gather of a layer of the same parity (gathers of several
    /// components of one layer share the half). A landing used for gathers is for saving only.
    pub fn gather(
        &mut self,
        component: ComponentId,
        layer: u32,
    ) -> Result<(usize, Arc<CudaLayerEvent>), DeviceError> {
        let h = self.open_for_gather(layer)?;
        let (off, c) = self.locate(component, layer)?;
        let row = c.page_layer_bytes;
        let pages = self.slots.len();
        let (src_base, _) = self.pool.buffer(component, layer)?;
        let dev = self.pool.device().clone();
        dev.bind()?;
        let stream = dev.load_stream().cu_stream();
        let host = self.lease.host_half(h) + off as usize;
        let dstage = self.lease.device_half(h) + off;
        let use_runs = match self.strategy {
            ScatterStrategy::Runs => true,
            ScatterStrategy::Kernel => false,
            ScatterStrategy::Auto => self.runs.len() <= DIRECT_RUNS_MAX,
        };
        if pages > 0 && use_runs {
            for r in &self.runs {
                let src = src_base + u64::from(r.slot) * row;
                let dst = host + (u64::from(r.page) * row) as usize;
                let len = (u64::from(r.len) * row) as usize;
                // SAFETY: source slots lie in the pool buffer, the destination in our pinned
                // half; nothing reads the half until the returned event completes.
                unsafe { sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len, stream) }
                    .result()
                    .map_err(drv("cuMemcpyDtoHAsync (slot run)"))?;
                self.stats.copies += 1;
            }
        } else if pages > 0 {
            let kernels = dev.kernels()?;
            let dev_slots = self.dev_slots.as_ref().map_or(0, |b| b.ptr());
            // SAFETY: source rows `slots[i]` lie in the pool buffer, destination rows
            // `0..pages` in device staging; the slot table holds `pages` u32.
            unsafe {
                kernels.copy_rows(
                    stream,
                    RowCopy {
                        src: src_base,
                        dst: dstage,
                        src_rows: dev_slots,
                        dst_rows: 0,
                        n_rows: pages as u32,
                        row_bytes: row,
                    },
                )?;
            }
            self.stats.kernel_launches += 1;
            // SAFETY: device staging → our pinned half, `pages * row` bytes (inside both).
            unsafe {
                sys::cuMemcpyDtoHAsync_v2(host as *mut c_void, dstage, pages * row as usize, stream)
            }
            .result()
            .map_err(drv("cuMemcpyDtoHAsync (from device staging)"))?;
            self.stats.copies += 1;
        }
        self.stats.bytes += pages as u64 * row;
        let ev = CudaLayerEvent::record_on(dev.load_stream(), layer)?;
        self.halves[h].event = Some(ev.clone());
        Ok((host, ev))
    }

    /// Waits (host) for every copy this landing enqueued.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        for h in &self.halves {
            if let Some(ev) = &h.event {
                ev.wait()?;
            }
        }
        Ok(())
    }
}

impl LayerLanding for StagedLanding {
    fn target(
        &mut self,
        component: ComponentId,
        layer: u32,
        plan_page: usize,
    ) -> Result<usize, DeviceError> {
        self.check_page(component, layer, plan_page)?;
        let (off, c) = self.locate(component, layer)?;
        let row = c.page_layer_bytes;
        let h = self.open(layer)?;
        self.mark(h, component);
        Ok(self.lease.host_half(h) + (off + plan_page as u64 * row) as usize)
    }

    fn land(&mut self, layer: u32) -> Result<LayerReady, DeviceError> {
        if self.slots.is_empty() {
            return Ok(LayerReady::Resident);
        }
        let h = self.open(layer)?;
        let targeted: Vec<u16> = self.halves[h].targeted.clone();
        for id in targeted {
            self.scatter_component(h, ComponentId(id), layer, false)?;
        }
        self.finish(h, layer)
    }
}

impl Drop for StagedLanding {
    fn drop(&mut self) {
        // The lease returns to its pool when we are gone: no copy may still use it.
        if let Err(e) = self.synchronize() {
            tracing::warn!(error = %e, "staged landing: waiting for copies before release failed");
        }
    }
}

/// Staged landings into a device pool, each batch leasing a staging buffer of `staging`.
pub struct StagedLandingFactory {
    pool: Arc<CudaKvPool>,
    staging: Arc<StagingPool>,
}

impl StagedLandingFactory {
    /// Landings into `pool` through `staging` (the same GPU).
    pub fn new(pool: Arc<CudaKvPool>, staging: Arc<StagingPool>) -> Self {
        StagedLandingFactory { pool, staging }
    }
}

impl crate::LandingFactory for StagedLandingFactory {
    fn begin(&self, slots: Arc<[u32]>) -> Result<Box<dyn crate::LayerLanding>, DeviceError> {
        let lease = self.staging.lease()?;
        Ok(Box::new(StagedLanding::new(
            self.pool.clone(),
            lease,
            slots,
        )?))
    }

    fn store_regions(&self) -> Vec<(usize, usize)> {
        self.staging.host_regions()
    }

    fn begin_save(&self, slots: Arc<[u32]>) -> Result<Box<dyn crate::SaveGather>, DeviceError> {
        let lease = self.staging.lease()?;
        Ok(Box::new(StagedGather(StagedLanding::new(
            self.pool.clone(),
            lease,
            slots,
        )?)))
    }
}

/// A staged landing used the save way: device slots → pinned staging, synchronously.
struct StagedGather(StagedLanding);

impl crate::SaveGather for StagedGather {
    fn gather(&mut self, component: ComponentId, layer: u32) -> Result<usize, DeviceError> {
        let (host, event) = self.0.gather(component, layer)?;
        event.wait()?;
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_coalesce_consecutive_slots() {
        let r = slot_runs(&[4, 5, 6, 9, 2, 3]);
        assert_eq!(
            r,
            vec![
                Run {
                    page: 0,
                    slot: 4,
                    len: 3
                },
                Run {
                    page: 3,
                    slot: 9,
                    len: 1
                },
                Run {
                    page: 4,
                    slot: 2,
                    len: 2
                },
            ]
        );
        assert!(slot_runs(&[]).is_empty());
        assert_eq!(slot_runs(&[u32::MAX, 0]).len(), 2);
    }
}
