//! Save: write a batch's pages from the pool to the store after prefill.

use kv_device::Residence;
use kv_loader::{BatchPlan, KvLoadError, SaveReport};
use smallvec::SmallVec;
use tracing::{debug, info_span};

use super::reader::{store_failure, ComponentKeys};
use super::Shared;
use crate::store::{checked_results, ObjectPut, PutOutcome};

impl Shared {
    /// Writes every object of the plan this rank owns and the store lacks. Replicated
    /// components are written by TP rank 0 only; sharded ones by every rank.
    pub(crate) fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        plan.validate(&self.geometry, self.pool.pages())?;
        let batch = plan.logical.batch;
        let _span = info_span!("save_batch", %batch, pages = plan.logical.num_pages()).entered();
        let mut report = SaveReport::default();
        for comp in self.component_keys(plan)? {
            if comp.layout.replicated && self.geometry.tp_rank != 0 {
                report.objects_not_owned += comp.keys.len() as u32;
                continue;
            }
            let refs: Vec<&str> = comp.keys.iter().map(String::as_str).collect();
            let present = checked_results(&refs, self.store.exists(&refs));
            let mut todo: Vec<usize> = Vec::new();
            for (i, p) in present.iter().enumerate() {
                match p {
                    Ok(true) => report.objects_present += 1,
                    Ok(false) => todo.push(i),
                    Err(e) => return Err(store_failure(batch, None, vec![i as u32], e)),
                }
            }
            for chunk in todo.chunks(self.config.save_chunk.max(1)) {
                if self.pool.residence() != Residence::Host {
                    self.save_gathered(plan, &comp, chunk, &mut report)?;
                    continue;
                }
                let mut puts = Vec::with_capacity(chunk.len());
                for &page in chunk {
                    let slot = plan.slots[page];
                    let mut parts: SmallVec<[(*const u8, usize); 4]> = SmallVec::new();
                    for &layer in &comp.layout.layers {
                        let addr = self
                            .pool
                            .slot_addr(comp.layout.id, layer, slot)
                            .map_err(KvLoadError::from)?;
                        parts.push((addr as *const u8, comp.layout.page_layer_bytes as usize));
                    }
                    puts.push(ObjectPut {
                        key: &comp.keys[page],
                        parts,
                    });
                }
                // SAFETY: every part is a slice of a host pool buffer, valid for its length;
                // the engine owns these slots and does not write them while it saves.
                unsafe { self.put_chunk(batch, &puts, chunk, &mut report) }?;
            }
        }
        self.metrics.written(report.bytes_written);
        debug!(?report, "saved");
        Ok(report)
    }

    /// Saves plan pages `chunk` of one component from a pool the store cannot read in place:
    /// each layer is gathered to host staging by the backend, copied into whole objects, and
    /// the objects are put.
    fn save_gathered(
        &self,
        plan: &BatchPlan,
        comp: &ComponentKeys,
        chunk: &[usize],
        report: &mut SaveReport,
    ) -> Result<(), KvLoadError> {
        let batch = plan.logical.batch;
        let slots: Vec<u32> = chunk.iter().map(|&p| plan.slots[p]).collect();
        let mut gather = self
            .landings
            .begin_save(slots.into())
            .map_err(KvLoadError::from)?;
        let row = comp.layout.page_layer_bytes as usize;
        let object = comp.layout.object_bytes() as usize;
        let mut objects = vec![0u8; object * chunk.len()];
        for (pos, &layer) in comp.layout.layers.iter().enumerate() {
            let rows = gather
                .gather(comp.layout.id, layer)
                .map_err(KvLoadError::from)?;
            for i in 0..chunk.len() {
                let dst = &mut objects[i * object + pos * row..][..row];
                // SAFETY: the gatherer's rows for this layer are `chunk.len()` rows of `row`
                // bytes at `rows`, host memory valid until its next call; `dst` is ours.
                let src = unsafe { std::slice::from_raw_parts((rows + i * row) as *const u8, row) };
                dst.copy_from_slice(src);
            }
        }
        let puts: Vec<ObjectPut<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, &page)| ObjectPut {
                key: &comp.keys[page],
                parts: smallvec::smallvec![(objects[i * object..].as_ptr(), object)],
            })
            .collect();
        // SAFETY: every part is a slice of `objects`, alive and unchanged during the call.
        unsafe { self.put_chunk(batch, &puts, chunk, report) }
    }

    /// Puts one chunk's objects (plan pages `chunk`) and counts the outcome.
    ///
    /// # Safety
    /// Every part of every put is valid for reads of its length and not written during the
    /// call (the [`KvStore`](crate::store::KvStore) buffer contract).
    unsafe fn put_chunk(
        &self,
        batch: kv_loader::BatchId,
        puts: &[ObjectPut<'_>],
        chunk: &[usize],
        report: &mut SaveReport,
    ) -> Result<(), KvLoadError> {
        let keys: Vec<&str> = puts.iter().map(|p| p.key).collect();
        // SAFETY: the caller's promise covers `puts`.
        let results = checked_results(&keys, unsafe { self.store.put(puts) });
        for (put, (r, &page)) in puts.iter().zip(results.iter().zip(chunk)) {
            match r {
                Ok(PutOutcome::Written) => {
                    report.objects_written += 1;
                    report.bytes_written += put.len();
                }
                Ok(PutOutcome::AlreadyPresent) => report.objects_present += 1,
                Err(e) => return Err(store_failure(batch, None, vec![page as u32], e)),
            }
        }
        Ok(())
    }
}
