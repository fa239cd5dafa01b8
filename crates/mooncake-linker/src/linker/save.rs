//! Save: write a batch's pages from the pool to the store after prefill.

use kv_device::Residence;
use kv_loader::{BatchPlan, KvLoadError, SaveReport};
use smallvec::SmallVec;
use tracing::{debug, info_span};

use super::reader::store_failure;
use super::Shared;
use crate::store::{ObjectPut, PutOutcome};

impl Shared {
    /// Writes every object of the plan this rank owns and the store lacks. Replicated
    /// components are written by TP rank 0 only; sharded ones by every rank.
    pub(crate) fn save(&self, plan: &BatchPlan) -> Result<SaveReport, KvLoadError> {
        plan.validate(&self.geometry, self.pool.pages())?;
        let batch = plan.logical.batch;
        let _span = info_span!("save_batch", %batch, pages = plan.logical.num_pages()).entered();
        if self.pool.residence() != Residence::Host {
            return Err(KvLoadError::Device(
                "saving from a device pool needs the device backend's staging".into(),
            ));
        }
        let mut report = SaveReport::default();
        for comp in self.component_keys(plan)? {
            if comp.layout.replicated && self.geometry.tp_rank != 0 {
                report.objects_not_owned += comp.keys.len() as u32;
                continue;
            }
            let refs: Vec<&str> = comp.keys.iter().map(String::as_str).collect();
            let present = self.store.exists(&refs);
            let mut todo: Vec<usize> = Vec::new();
            for (i, p) in present.iter().enumerate() {
                match p {
                    Ok(true) => report.objects_present += 1,
                    Ok(false) => todo.push(i),
                    Err(e) => return Err(store_failure(batch, None, vec![i as u32], e)),
                }
            }
            for chunk in todo.chunks(self.config.save_chunk.max(1)) {
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
                let results = unsafe { self.store.put(&puts) };
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
            }
        }
        self.metrics.written(report.bytes_written);
        debug!(?report, "saved");
        Ok(report)
    }
}
