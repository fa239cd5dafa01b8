//! KV pools: one buffer per (component, carried layer), rows = tokens or pages, the way
//! engines keep them; addressed by page slot.

use kv_geometry::{ComponentId, KvGeometry};

use crate::DeviceError;

/// Where a pool's memory lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Residence {
    /// Host memory the CPU (and a TCP store) can write directly.
    Host,
    /// Device memory of GPU `ordinal`.
    Device {
        /// CUDA device ordinal.
        ordinal: u32,
    },
}

/// One rank's KV pool: for every component and every layer it carries, a buffer of
/// `pages()` page slots of `page_layer_bytes` each. Slot `s` of a buffer is the page whose
/// rows start at token `s * page_size` (token-row components) or row `s` (page-row ones).
///
/// # Safety
/// Landings, save sources and stores write and read the memory [`slot_addr`](Self::slot_addr)
/// and [`regions`](Self::regions) name, trusting it. An implementation promises that:
/// - `slot_addr(c, l, s)`, when `Ok`, is the first byte of `page_layer_bytes` of component
///   `c` that lie inside one of `regions()`, and distinct (component, layer, slot) triples
///   never share a byte;
/// - every region stays allocated, at the same address, for as long as the pool lives, and
///   is memory of the pool's [`residence`](Self::residence) (host memory the CPU may read
///   and write for `Residence::Host`);
/// - the geometry and page count never change;
/// - [`slot_claims`](Self::slot_claims) answers the same on every call for as long as the
///   pool lives: always `None`, or always the same [`SlotClaims`](crate::SlotClaims) of
///   `pages()` slots (the exclusion between a landing's writes and a save's reads, and a
///   claim's release on drop, rest on it);
/// - no other `KvPool` names any byte of `regions()` under other slot claims (two pools over
///   the same memory, say one for a loading linker and one for a saving one, would each claim
///   the same slot apart: a landing could write it while a save reads it). Share one pool
///   (`Arc`), or have a wrapper answer the wrapped pool's `slot_claims`.
pub unsafe trait KvPool: Send + Sync {
    /// The geometry this pool is laid out for.
    fn geometry(&self) -> &KvGeometry;

    /// Page slots per buffer.
    fn pages(&self) -> u32;

    /// Where the memory lives.
    fn residence(&self) -> Residence;

    /// Address of slot `slot` in the buffer of (`component`, model layer `layer`); the slice
    /// is `page_layer_bytes` of that component long.
    fn slot_addr(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
    ) -> Result<usize, DeviceError>;

    /// Every buffer as (address, length), e.g. to register them with a store once.
    fn regions(&self) -> Vec<(usize, usize)>;

    /// The pool's slot claims ([`SlotClaims`](crate::SlotClaims)): which slots a landing
    /// writes and which a save reads. A host pool kvlink lands into directly
    /// ([`DirectLanding`](crate::DirectLanding)) or saves from in place
    /// ([`SaveSource::slot`](crate::SaveSource::slot)) must keep them; `None` (the default)
    /// refuses both. [`DeviceKvPool`](crate::DeviceKvPool) keeps them too: its staged
    /// landings claim their slots for writing, its saves' gathers for reading.
    fn slot_claims(&self) -> Option<&crate::SlotClaims> {
        None
    }

    /// Copies one page slot's slice of (`component`, model layer `layer`) into `out`, which
    /// must be exactly the slice's length (`page_layer_bytes` of the component). Every input
    /// is checked: an unknown component, a layer the component does not carry, a slot past
    /// the pool or a wrong length is a [`DeviceError::OutOfPool`]. Device pools copy after
    /// the work already enqueued on their load stream.
    ///
    /// # Safety
    /// Nothing writes this slice during the call: no `write_slot` of it on another thread,
    /// and no load whose plan lands in `slot` still in flight (wait for the layer, or the
    /// batch, first). Concurrent reads are fine.
    unsafe fn read_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        out: &mut [u8],
    ) -> Result<(), DeviceError>;

    /// Copies `data` (exactly the slice's length, checked as in
    /// [`read_slot`](Self::read_slot)) into one page slot's slice of (`component`, `layer`),
    /// as an engine's attention writes new KV.
    ///
    /// # Safety
    /// Nothing else reads or writes this slice during the call: no `read_slot` or
    /// `write_slot` of it on another thread, no load whose plan lands in `slot` in flight,
    /// and no save of it in progress.
    unsafe fn write_slot(
        &self,
        component: ComponentId,
        layer: u32,
        slot: u32,
        data: &[u8],
    ) -> Result<(), DeviceError>;
}

/// Checks (component, layer, slot) against a geometry and a pool size; returns the buffer
/// index of the (component, layer) and the byte offset of the slot in it.
pub(crate) fn locate(
    geometry: &KvGeometry,
    pages: u32,
    component: ComponentId,
    layer: u32,
    slot: u32,
) -> Result<(usize, u64), DeviceError> {
    let err = |reason| DeviceError::OutOfPool {
        component: component.0,
        layer,
        slot,
        reason,
    };
    let c = geometry
        .component(component)
        .map_err(|_| err("unknown component"))?;
    if slot >= pages {
        return Err(err("slot past the pool"));
    }
    let pos = c
        .position(layer)
        .ok_or(err("component not on this layer"))?;
    let first: usize = geometry.components()[..usize::from(component.0)]
        .iter()
        .map(|c| c.layers.len())
        .sum();
    Ok((first + pos as usize, c.slot_range(slot).start))
}

/// Like [`locate`], and checks that `len` is exactly the slice's length (one layer of one
/// page of the component): the buffer index and the slot's byte offset in it.
pub(crate) fn locate_slice(
    geometry: &KvGeometry,
    pages: u32,
    component: ComponentId,
    layer: u32,
    slot: u32,
    len: usize,
) -> Result<(usize, u64), DeviceError> {
    let (buf, off) = locate(geometry, pages, component, layer, slot)?;
    let slice = geometry
        .component(component)
        .map(|c| c.page_layer_bytes)
        .unwrap_or(0);
    if len as u64 != slice {
        return Err(DeviceError::OutOfPool {
            component: component.0,
            layer,
            slot,
            reason: "buffer length is not the slice length",
        });
    }
    Ok((buf, off))
}
