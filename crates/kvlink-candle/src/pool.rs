//! A component of a KV pool, read and written as candle tensors of latent rows.

use std::sync::Arc;

use candle_core::{Device, Tensor};
use kv_device::KvPool;
use kv_geometry::ComponentId;

use crate::format::tensor_bytes;
use crate::{CandleKvError, LatentFormat};

/// One component of a rank's KV pool (the MLA latent), seen as candle tensors: a layer's
/// rows for a sequence's page table come out as `[tokens, kv_lora_rank + rope_dim]` (or
/// `[pages, page_size, ..]`), and freshly computed rows go back into the slots.
///
/// On the CPU a read **copies** the rows out of the pool into a new tensor (the pool's
/// pages are scattered and owned by the loader's protocol, not by candle); a write copies
/// in. This type does not wait for loads: [`PagedLatentCache`](crate::PagedLatentCache)
/// does that before it reads.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::HostKvPool;
/// use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
/// use kvlink_candle::candle_core::{DType, Device, Tensor};
/// use kvlink_candle::{LatentFormat, LatentPool};
///
/// let format = LatentFormat::new(4, 2, DType::F32).unwrap();
/// let spec = ModelKvSpec::new("tiny", 2, 4, vec![ComponentSpec::new(
///     "k", RowUnit::Token, ElementType::Bytes, format.row_bytes() as u32)]).unwrap();
/// let pool = Arc::new(HostKvPool::new(KvGeometry::new(spec, 1, 0).unwrap(), 8).unwrap());
/// let latents = LatentPool::new(pool, "k", format, Device::Cpu).unwrap();
///
/// // Six tokens of a sequence whose pages sit in slots 5 and 2.
/// let rows = Tensor::arange(0f32, 36., &Device::Cpu).unwrap().reshape((6, 6)).unwrap();
/// // SAFETY: one thread, no loader: nothing else touches slots 5 and 2.
/// unsafe { latents.write_tokens(1, &[5, 2], 0, &rows) }.unwrap();
/// // SAFETY: as above.
/// let back = unsafe { latents.read_tokens(1, &[5, 2], 6) }.unwrap();
/// assert_eq!(back.to_vec2::<f32>().unwrap(), rows.to_vec2::<f32>().unwrap());
/// // SAFETY: as above.
/// assert_eq!(unsafe { latents.read_pages(1, &[5, 2]) }.unwrap().dims(), &[2, 4, 6]);
/// ```
///
/// The reads and writes are `unsafe` (the caller vouches that no one writes the slots
/// meanwhile); [`PagedLatentCache`](crate::PagedLatentCache) takes that promise once per
/// sequence (and, with `load_starts_at`, that no load writes its pages before a token) and
/// then waits for the load itself.
#[derive(Clone)]
pub struct LatentPool {
    pool: Arc<dyn KvPool>,
    component: ComponentId,
    format: LatentFormat,
    page_size: usize,
    page_bytes: usize,
    device: Device,
}

impl std::fmt::Debug for LatentPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatentPool")
            .field("component", &self.component)
            .field("format", &self.format)
            .field("page_size", &self.page_size)
            .field("pages", &self.pool.pages())
            .finish_non_exhaustive()
    }
}

impl LatentPool {
    /// The component named `component` of `pool`, in `format`, with tensors made on
    /// `device`. Fails if the component is missing or its rows do not match the format.
    pub fn new(
        pool: Arc<dyn KvPool>,
        component: &str,
        format: LatentFormat,
        device: Device,
    ) -> Result<Self, CandleKvError> {
        let g = pool.geometry();
        let c = g.component_by_name(component)?;
        format.check(g, c)?;
        let page_bytes = usize::try_from(c.page_layer_bytes)
            .map_err(|_| CandleKvError::Format("page slice larger than memory".into()))?;
        Ok(LatentPool {
            component: c.id,
            format,
            page_size: g.page_size() as usize,
            page_bytes,
            device,
            pool,
        })
    }

    /// The row format.
    pub fn format(&self) -> &LatentFormat {
        &self.format
    }

    /// Tokens per page.
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// The component's id in the pool's geometry.
    pub fn component(&self) -> ComponentId {
        self.component
    }

    /// The device tensors are made on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The pool underneath.
    pub fn pool(&self) -> &Arc<dyn KvPool> {
        &self.pool
    }

    fn check_span(
        &self,
        page_table: &[u32],
        start: usize,
        end: usize,
    ) -> Result<(), CandleKvError> {
        let needed = end.div_ceil(self.page_size);
        if needed > page_table.len() {
            return Err(CandleKvError::PageTable {
                start,
                end,
                needed,
                have: page_table.len(),
            });
        }
        Ok(())
    }

    /// Layer `layer`'s rows of the first `tokens` tokens of a sequence whose page `i` sits
    /// in slot `page_table[i]`, as a `[tokens, width]` tensor (a copy).
    ///
    /// # Safety
    /// Nothing writes layer `layer` of those slots during the call: no load into them in
    /// flight (wait for the layer first) and no concurrent write.
    pub unsafe fn read_tokens(
        &self,
        layer: u32,
        page_table: &[u32],
        tokens: usize,
    ) -> Result<Tensor, CandleKvError> {
        self.check_span(page_table, 0, tokens)?;
        let rb = self.format.row_bytes();
        let mut buf = vec![0u8; tokens * rb];
        let mut partial: Vec<u8> = Vec::new();
        for (chunk, &slot) in buf.chunks_mut(self.page_bytes).zip(page_table) {
            if chunk.len() == self.page_bytes {
                // SAFETY: nothing writes the slot meanwhile (this function's contract).
                unsafe { self.pool.read_slot(self.component, layer, slot, chunk) }?;
            } else {
                partial.resize(self.page_bytes, 0);
                // SAFETY: as above.
                unsafe {
                    self.pool
                        .read_slot(self.component, layer, slot, &mut partial)
                }?;
                chunk.copy_from_slice(&partial[..chunk.len()]);
            }
        }
        Ok(Tensor::from_raw_buffer(
            &buf,
            self.format.dtype,
            &[tokens, self.format.width()],
            &self.device,
        )?)
    }

    /// Layer `layer` of whole pages in `slots`, as `[pages, page_size, width]` (the paged
    /// form an attention kernel indexes with a block table; a copy).
    ///
    /// # Safety
    /// As [`read_tokens`](Self::read_tokens).
    pub unsafe fn read_pages(&self, layer: u32, slots: &[u32]) -> Result<Tensor, CandleKvError> {
        // SAFETY: the same contract, forwarded from our caller.
        let t = unsafe { self.read_tokens(layer, slots, slots.len() * self.page_size) }?;
        Ok(t.reshape((slots.len(), self.page_size, self.format.width()))?)
    }

    /// Writes `rows` (`[n, width]`, converted to the pool's dtype) as layer `layer`'s rows
    /// of tokens `start..start + n` of the sequence whose page table is `page_table`. Pages
    /// only partly covered keep their other rows.
    ///
    /// A slot a save still reads (a put past its deadline) or a landing writes is refused
    /// with `DeviceError::SlotBusy` (as `CandleKvError::Pool`), possibly after earlier pages
    /// of the range were written: wait with `kv_device::SlotClaims::wait_free` and write the
    /// range again.
    ///
    /// # Safety
    /// The caller owns the slots written: during the call nobody else reads or writes layer
    /// `layer` of them (no load into them in flight, no concurrent read or write, no save).
    pub unsafe fn write_tokens(
        &self,
        layer: u32,
        page_table: &[u32],
        start: usize,
        rows: &Tensor,
    ) -> Result<(), CandleKvError> {
        let width = self.format.width();
        let n = match rows.dims() {
            [n, w] if *w == width => *n,
            other => {
                return Err(CandleKvError::Shape {
                    expected: format!("[tokens, {width}]"),
                    got: other.to_vec(),
                })
            }
        };
        let end = start.checked_add(n).ok_or(CandleKvError::PageTable {
            start,
            end: usize::MAX,
            needed: usize::MAX,
            have: page_table.len(),
        })?;
        self.check_span(page_table, start, end)?;
        if n == 0 {
            return Ok(());
        }
        let bytes = tensor_bytes(&rows.to_dtype(self.format.dtype)?)?;
        let rb = self.format.row_bytes();
        let mut page = vec![0u8; self.page_bytes];
        let mut token = start;
        while token < end {
            let p = token / self.page_size;
            let slot = page_table[p];
            let row = token - p * self.page_size;
            let take = (self.page_size - row).min(end - token);
            let src = &bytes[(token - start) * rb..(token - start + take) * rb];
            if take == self.page_size {
                // SAFETY: the caller owns this slot for the call (this function's contract).
                unsafe { self.pool.write_slot(self.component, layer, slot, src) }?;
            } else {
                // SAFETY: as above.
                unsafe { self.pool.read_slot(self.component, layer, slot, &mut page) }?;
                page[row * rb..(row + take) * rb].copy_from_slice(src);
                // SAFETY: as above.
                unsafe { self.pool.write_slot(self.component, layer, slot, &page) }?;
            }
            token += take;
        }
        Ok(())
    }
}
