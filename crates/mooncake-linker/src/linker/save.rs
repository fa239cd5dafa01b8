//! Save: write a batch's pages from the pool to the store after prefill, each object with its
//! checksum companion (`kv_geometry::checksum_key`). What a put reads is typed
//! ([`SaveSource`], minted by kv-device: a host pool's slot rows read in place, or bytes the
//! put shares), so this module never handles an address. Every store call is bounded
//! (`LinkerConfig::store_call_timeout`); a put past its deadline holds its sources, and so
//! keeps the memory it reads allocated and a host pool's slots claimed for reading (the
//! engine waits with `SlotClaims::wait_free` before writing them; `write_slot` refuses them),
//! until it returns, and what it wrote then is discarded (the save failed for the engine).

use std::sync::Arc;

use kv_device::{Residence, SaveSource, SharedEvent};
use kv_geometry::{checksum_key, layer_checksum, ObjectChecksums};
use kv_loader::{BatchId, BatchPlan, KvLoadError, SaveReport};
use smallvec::SmallVec;
use tracing::{debug, info_span, warn};

use super::reader::{store_failure, ComponentKeys};
use super::save_read_back::ReadBack;
use super::Inner;
use crate::store::{Hold, PutOutcome, SourcePut};

impl Inner {
    /// [`save_pages`](Self::save_pages), counted in the metrics (`saves`, `saves_failed`).
    pub(crate) fn save(
        &self,
        plan: &BatchPlan,
        after: Option<&SharedEvent>,
    ) -> Result<SaveReport, KvLoadError> {
        let saved = self.save_pages(plan, after);
        self.metrics.saved(saved.is_err());
        saved
    }

    /// Writes every object of the plan this rank owns and the store lacks, each with its
    /// checksum companion in the same store call. Replicated components are written by TP
    /// rank 0 only; sharded ones by every rank. Objects already present are left as they
    /// are (and get no companion: an object SGLang wrote stays checked by length only).
    fn save_pages(
        &self,
        plan: &BatchPlan,
        after: Option<&SharedEvent>,
    ) -> Result<SaveReport, KvLoadError> {
        plan.validate_save(&self.geometry, self.pool.pages())?;
        let batch = plan.logical.batch;
        let rank = self.geometry.tp_rank();
        let pages = plan.logical.num_pages();
        let _span = info_span!("save_batch", %batch, rank, pages).entered();
        let mut report = SaveReport::default();
        if let (Some(ev), Residence::Host) = (after, self.pool.residence()) {
            // A host pool is read in place: wait (bounded) for the compute that wrote it.
            self.host_wait(ev)?;
        }
        let mut todo = Vec::new();
        for comp in self.component_keys(plan)? {
            if comp.layout.replicated && self.geometry.tp_rank() != 0 {
                report.objects_not_owned += comp.keys.len() as u32;
                continue;
            }
            let missing = self.missing_objects(plan, &comp, &mut report)?;
            todo.push((comp, missing));
        }
        let _reading = self.claim_for_save(plan, &todo)?;
        // Page by page, not component by component: round `r` puts every component's `r`th
        // chunk of missing objects, so a save that fails leaves the pages before the failing
        // chunk whole (every component), a shorter prefix a lookup still finds. Component by
        // component, a failure in the first component's chunks left no page with all its
        // components: a lookup hit nothing of the whole save.
        let per_call = self.save_per_call(&todo);
        let rounds = todo
            .iter()
            .map(|(_, missing)| missing.len().div_ceil(per_call))
            .max()
            .unwrap_or(0);
        for round in 0..rounds {
            for (comp, missing) in &todo {
                if let Some(chunk) = missing.chunks(per_call).nth(round) {
                    self.save_chunk_of(plan, comp, chunk, &mut report, after)
                        .map_err(|e| with_twins(plan, e))?;
                }
            }
        }
        not_saved_twins(plan, &mut report);
        report.settle_pages(plan.logical.num_pages());
        debug!(?report, "saved");
        Ok(report)
    }

    /// The slots of every page some component of `todo` saves, claimed for reading (beside
    /// other readers) until the save returns: its chunks read them one after the other, and
    /// an engine that writes one before the chunk that reads it (the block of a finished
    /// request handed to the next one while the save runs) is refused (`SlotBusy`: kvlink's
    /// `write_slot` and landings) rather than have its bytes saved under this plan's page
    /// hashes. `None` for a pool that keeps no claims.
    fn claim_for_save(
        &self,
        plan: &BatchPlan,
        todo: &[(ComponentKeys, Vec<usize>)],
    ) -> Result<Option<kv_device::ReadClaims>, KvLoadError> {
        if self.pool.slot_claims().is_none() {
            return Ok(None);
        }
        let mut slots: Vec<u32> = todo
            .iter()
            .flat_map(|(_, missing)| missing.iter().filter_map(|&page| plan.slots.get(page)))
            .copied()
            .collect();
        slots.sort_unstable();
        slots.dedup();
        kv_device::SlotClaims::read_all(&self.pool, &slots)
            .map(Some)
            .map_err(KvLoadError::from)
    }

    /// Objects per store call: `save_chunk`, and for a pool saved through staging no more than
    /// a stage holds of the widest component's layer (a gather of more failed every save of
    /// that many missing pages, `Device`, where the staging was sized for fewer).
    fn save_per_call(&self, todo: &[(ComponentKeys, Vec<usize>)]) -> usize {
        let chunk = self.config.save_chunk.max(1);
        // A host pool's landings go through no staging (`None`): its rows are read in place.
        let Some(stage) = self.landings.stage_bytes() else {
            return chunk;
        };
        let widest = todo
            .iter()
            .map(|(c, _)| c.layout.page_layer_bytes)
            .max()
            .unwrap_or(1)
            .max(1);
        chunk.min(
            usize::try_from(stage as u64 / widest)
                .unwrap_or(usize::MAX)
                .max(1),
        )
    }

    /// Saves plan pages `chunk` of one component (one store call of objects and companions):
    /// a host pool's slot rows read in place, another pool's gathered first.
    fn save_chunk_of(
        &self,
        plan: &BatchPlan,
        comp: &ComponentKeys,
        chunk: &[usize],
        report: &mut SaveReport,
        after: Option<&SharedEvent>,
    ) -> Result<(), KvLoadError> {
        if self.pool.residence() != Residence::Host {
            return self.save_gathered(plan, comp, chunk, report, after);
        }
        let mut puts = Vec::with_capacity(chunk.len());
        let mut sums = Vec::with_capacity(chunk.len());
        for &page in chunk {
            let slot = plan.slots[page];
            let mut parts: SmallVec<[SaveSource; 4]> = SmallVec::new();
            let mut layer_sums = Vec::with_capacity(comp.layout.layers.len());
            for &layer in &comp.layout.layers {
                let row = SaveSource::slot(&self.pool, comp.layout.id, layer, slot)
                    .map_err(KvLoadError::from)?;
                layer_sums.push(layer_checksum(row.bytes()));
                parts.push(row);
            }
            sums.push(ObjectChecksums {
                layer_bytes: comp.layout.page_layer_bytes,
                sums: layer_sums,
            });
            puts.push(SourcePut {
                key: &comp.keys[page],
                parts,
            });
        }
        // The sources keep the pool; a put past its deadline keeps its registration too.
        let hold: Hold = Arc::new(self.registered.lock().clone());
        let batch = plan.logical.batch;
        self.put_chunk(batch, comp, &puts, &sums, chunk, report, hold)
    }

    /// Waits on this thread, at most `store_call_timeout`, for `ev`.
    fn host_wait(&self, ev: &SharedEvent) -> Result<(), KvLoadError> {
        match ev.wait_until(self.store_deadline()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(KvLoadError::Device(
                format!(
                    "the engine's event before a save did not complete within {:?}",
                    self.config.store_call_timeout
                )
                .into(),
            )),
            Err(e) => Err(e.into()),
        }
    }

    /// The plan pages whose object of `comp` the store lacks (counting the others present).
    /// A lacking object's leftover companion (its object was evicted or discarded alone) is
    /// discarded first, so the new object gets a companion of its own bytes. A companion
    /// whose presence cannot be told, or a leftover that cannot be discarded, fails the save:
    /// the new object would be written beside checksums of other bytes (puts are first write
    /// wins), and every later load of it would fail and discard it.
    fn missing_objects(
        &self,
        plan: &BatchPlan,
        comp: &ComponentKeys,
        report: &mut SaveReport,
    ) -> Result<Vec<usize>, KvLoadError> {
        let companions: Vec<String> = comp.keys.iter().map(|k| checksum_key(k)).collect();
        let keys: Vec<&str> = comp
            .keys
            .iter()
            .chain(&companions)
            .map(String::as_str)
            .collect();
        let present = self.calls.exists(&keys, self.store_deadline());
        let (objects, sums) = present.split_at(comp.keys.len());
        let mut todo = Vec::new();
        let mut stale: Vec<(usize, &String)> = Vec::new();
        // A plan may name one page twice (two requests of one prefix on other slots): its
        // object is put once, the later pages count it present.
        let mut queued = std::collections::HashSet::new();
        for (i, p) in objects.iter().enumerate() {
            match p {
                Ok(true) => report.objects_present += 1,
                Ok(false) if !queued.insert(comp.keys[i].as_str()) => report.objects_present += 1,
                Ok(false) => {
                    // Evicted: checksums kept from an earlier load of it say nothing now.
                    self.checksums.remove(&comp.keys[i]);
                    todo.push(i);
                    match &sums[i] {
                        Ok(true) => stale.push((i, &companions[i])),
                        Ok(false) => {}
                        Err(e) => {
                            return Err(store_failure(plan.logical.batch, None, vec![i as u32], e))
                        }
                    }
                }
                Err(e) => return Err(store_failure(plan.logical.batch, None, vec![i as u32], e)),
            }
        }
        if !stale.is_empty() {
            let keys: Vec<&str> = stale.iter().map(|&(_, k)| k.as_str()).collect();
            let gone = self.calls.discard(&keys, self.store_deadline());
            for (&(i, key), r) in stale.iter().zip(gone) {
                match r {
                    // Gone already (a load that found its object bad discarded it, or the
                    // store evicted it): what the discard was for.
                    Ok(()) | Err(crate::store::StoreError::NotFound { .. }) => {}
                    Err(e) => {
                        warn!(key, error = %e, "a leftover checksum companion stays: the save fails");
                        return Err(store_failure(plan.logical.batch, None, vec![i as u32], &e));
                    }
                }
            }
        }
        Ok(todo)
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
        after: Option<&SharedEvent>,
    ) -> Result<(), KvLoadError> {
        let batch = plan.logical.batch;
        let slots: Vec<u32> = chunk.iter().map(|&p| plan.slots[p]).collect();
        let mut gather = match after {
            // The gather starts, device-side, after the engine's compute that wrote the pages.
            Some(ev) => self.landings.begin_save_after(slots.into(), ev),
            None => self.landings.begin_save(slots.into()),
        }
        .map_err(KvLoadError::from)?;
        let row = comp.layout.page_layer_bytes as usize;
        let object = comp.layout.object_bytes() as usize;
        let mut objects = objects_buffer(batch, &comp.layout.name, chunk, object)?;
        // What a failed gather names: the component, layer and plan pages it was saving.
        let pages = match (chunk.first(), chunk.last()) {
            (Some(a), Some(b)) if a != b => format!("plan pages {a}..={b}"),
            (Some(a), _) => format!("plan page {a}"),
            _ => "no pages".into(),
        };
        let what = |layer: u32| {
            format!(
                "{batch}: saving `{}` layer {layer}, {pages}",
                comp.layout.name
            )
        };
        for (pos, &layer) in comp.layout.layers.iter().enumerate() {
            let rows = gather.gather(comp.layout.id, layer).map_err(|e| {
                KvLoadError::Device(kv_loader::Cause::with_source(
                    format!("{}: {e}", what(layer)),
                    e,
                ))
            })?;
            if rows.len() < chunk.len() * row {
                return Err(KvLoadError::Device(
                    format!(
                        "{}: a gather brought {} bytes for {} rows of {row}",
                        what(layer),
                        rows.len(),
                        chunk.len()
                    )
                    .into(),
                ));
            }
            for (i, src) in rows.chunks(row.max(1)).take(chunk.len()).enumerate() {
                objects[i * object + pos * row..][..row].copy_from_slice(src);
            }
        }
        // Every row is copied out: the slots are free for loads while the objects are put.
        drop(gather);
        let sums = objects
            .chunks(object.max(1))
            .take(chunk.len())
            .map(|o| ObjectChecksums::of_object(o, comp.layout.page_layer_bytes))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                KvLoadError::internal(
                    batch,
                    kv_loader::Cause::with_source(format!("checksums: {e}"), e),
                )
            })?;
        // Shared with a put past its deadline, which keeps it until it returns.
        let objects: Arc<Vec<u8>> = Arc::new(objects);
        let puts: Vec<SourcePut<'_>> = chunk
            .iter()
            .enumerate()
            .map(|(i, &page)| {
                let part = SaveSource::from_bytes(objects.clone(), i * object..(i + 1) * object)?;
                Ok(SourcePut {
                    key: &comp.keys[page],
                    parts: smallvec::smallvec![part],
                })
            })
            .collect::<Result<_, kv_device::DeviceError>>()?;
        self.put_chunk(
            batch,
            comp,
            &puts,
            &sums,
            chunk,
            report,
            crate::store::no_hold(),
        )
    }

    /// Puts one chunk's objects (plan pages `chunk`) with their checksum companions in one
    /// store call (which holds the sources, and `hold`, until it returns), and counts the
    /// objects' outcome. A companion that fails to land leaves its object checked by length
    /// only (logged, not an error of the save). Pairs whose object put said `Written` beside
    /// a companion that said `Written` or was already there are read back
    /// (save_read_back.rs): the save's own counts written and keeps its checksums; one
    /// another writer won counts present and keeps that writer's checksums (checked against
    /// the object); a mixed one is discarded and counts neither; one that could not be read
    /// back stays, counted written when both puts said `Written` and the companion was not
    /// read back as another writer's, else present, with no checksums kept.
    #[allow(clippy::too_many_arguments)]
    fn put_chunk(
        &self,
        batch: kv_loader::BatchId,
        comp: &ComponentKeys,
        puts: &[SourcePut<'_>],
        sums: &[ObjectChecksums],
        chunk: &[usize],
        report: &mut SaveReport,
        hold: Hold,
    ) -> Result<(), KvLoadError> {
        let companions: Vec<(String, SaveSource)> = chunk
            .iter()
            .zip(sums)
            .map(|(&page, s)| {
                let bytes = Arc::new(s.encode());
                let len = bytes.len();
                Ok((
                    checksum_key(&comp.keys[page]),
                    SaveSource::from_bytes(bytes, 0..len)?,
                ))
            })
            .collect::<Result<_, kv_device::DeviceError>>()?;
        let mut all: Vec<SourcePut<'_>> = puts.to_vec();
        all.extend(companions.iter().map(|(key, bytes)| SourcePut {
            key,
            parts: smallvec::smallvec![bytes.clone()],
        }));
        let results = self.calls.put(&all, hold, self.store_deadline());
        let (objects, companion_results) = results.split_at(puts.len());
        self.unpair_foreign_companions(comp, chunk, sums, objects, companion_results);
        // Pairs whose object said `Written`: read back, as another writer's put between the
        // save's look and its own is reported `Written` too.
        let mut read_back = self.read_back_pairs(comp, chunk, sums, (objects, companion_results));
        // The objects that failed fail the save (the first one's error, naming every failed
        // page), once every pair's outcome is counted and kept.
        let mut failed: Option<(&crate::store::StoreError, Vec<u32>)> = None;
        for (i, (put, (r, &page))) in puts.iter().zip(objects.iter().zip(chunk)).enumerate() {
            match (r, read_back[i].take()) {
                // Written, then discarded with a companion that is not its own: not in the
                // store, so neither written nor skipped.
                (Ok(PutOutcome::Written), Some(ReadBack::Discarded)) => {
                    report.objects_discarded += 1;
                    report.pages_not_saved.push(page as u32);
                }
                (Ok(PutOutcome::Written), Some(ReadBack::Theirs(theirs))) => {
                    report.objects_present += 1;
                    self.keep_checksums(&comp.keys[page], theirs);
                }
                // Not known to be the save's: its companion is another writer's.
                (Ok(PutOutcome::Written), Some(ReadBack::Unchecked)) => {
                    report.objects_present += 1;
                }
                (Ok(PutOutcome::Written), verdict) => {
                    report.objects_written += 1;
                    report.bytes_written += put.len();
                    // Counted as written, also when a later chunk fails the save.
                    self.metrics.written(put.len());
                    report.pages_written.push(page as u32);
                    if verdict == Some(ReadBack::Ours) {
                        // A later load of this object knows its checksums already.
                        self.keep_checksums(&comp.keys[page], sums[i].clone());
                    }
                }
                (Ok(PutOutcome::AlreadyPresent), _) => report.objects_present += 1,
                (Err(e), _) => {
                    debug!(key = put.key, error = %e, "object not saved");
                    failed
                        .get_or_insert_with(|| (e, Vec::new()))
                        .1
                        .push(page as u32);
                }
            }
        }
        // One line per store call, not per key: a full or hung store fails every key of every
        // save, hundreds a call; at `warn` once a minute (the save's error says it each time).
        if let Some((e, pages)) = &failed {
            match self.failed_log.due_after("save: objects not saved") {
                Some(skipped) => warn!(
                    %batch,
                    component = %comp.layout.name,
                    objects = pages.len(),
                    first_error = %e,
                    skipped,
                    "objects not saved (`skipped`: such lines since the last, logged at debug)"
                ),
                None => debug!(%batch, component = %comp.layout.name, objects = pages.len(),
                               first_error = %e, "objects not saved"),
            }
        }
        let missing: Vec<(&String, &crate::store::StoreError)> = companions
            .iter()
            .zip(companion_results)
            .filter_map(|((key, _), r)| r.as_ref().err().map(|e| (key, e)))
            .collect();
        if let Some((key, e)) = missing.first() {
            match self.failed_log.due_after("save: companions not written") {
                Some(skipped) => warn!(
                    %batch,
                    companions = missing.len(),
                    first_key = %key,
                    first_error = %e,
                    skipped,
                    "checksum companions not written: their objects are checked by length only \
                     (`skipped`: such lines since the last, logged at debug)"
                ),
                None => debug!(%batch, companions = missing.len(), first_key = %key,
                               first_error = %e, "checksum companions not written"),
            }
        }
        failed.map_or(Ok(()), |(e, pages)| {
            Err(store_failure(batch, None, pages, e))
        })
    }

    /// An object and its companion that are not a pair are split up (best effort, logged), so
    /// that no load checks an object against checksums of other bytes (an object this save
    /// wrote beside a companion already there is read back instead, see
    /// [`read_back_pairs`](Inner::read_back_pairs): when another writer raced the save the
    /// object kept may be that writer's, matching its companion):
    /// - a companion this save wrote whose object was already there (another writer, such as
    ///   SGLang, wrote it since the save looked, with bytes of its own): the companion is read
    ///   back and discarded when it holds the save's bytes (or cannot be read), and the object
    ///   stays, checked by length only as any without one, unless the object holds the save's
    ///   bytes too (a second save of the same page: the pair is whole and stays); a companion
    ///   of other bytes is
    ///   another writer's, put with its object (the store answered this save `Written` for it
    ///   all the same), and stays with it;
    /// - a companion this save wrote whose object's put failed: the object (which the store
    ///   may have taken all the same) is discarded, then the companion.
    fn unpair_foreign_companions(
        &self,
        comp: &ComponentKeys,
        chunk: &[usize],
        sums: &[ObjectChecksums],
        objects: &[Result<PutOutcome, crate::store::StoreError>],
        companions: &[Result<PutOutcome, crate::store::StoreError>],
    ) {
        let beside_foreign: Vec<(String, Vec<u8>)> = chunk
            .iter()
            .zip(sums)
            .zip(objects.iter().zip(companions))
            .filter(|(_, pair)| {
                matches!(
                    pair,
                    (Ok(PutOutcome::AlreadyPresent), Ok(PutOutcome::Written))
                )
            })
            .map(|((&page, s), _)| (checksum_key(&comp.keys[page]), s.encode()))
            .collect();
        let companions_beside_foreign_objects =
            self.unless_objects_match(comp, &beside_foreign, self.own_companions(&beside_foreign));
        self.discard_unpaired(
            &companions_beside_foreign_objects,
            "companions written beside an object another writer wrote first",
        );
        // An object whose put failed may still have been written (a call that timed out
        // after the store took it, a transfer given up while it ran): it goes first, and its
        // companion only once it is gone, so no object is left to pass by length alone nor a
        // companion to vouch for whatever comes under that key.
        let failed_objects: Vec<&str> = chunk
            .iter()
            .zip(objects.iter().zip(companions))
            .filter(|(_, pair)| matches!(pair, (Err(_), Ok(PutOutcome::Written))))
            .map(|(&page, _)| comp.keys[page].as_str())
            .collect();
        if !failed_objects.is_empty() {
            warn!(
                objects = failed_objects.len(),
                "objects whose put failed beside a written companion: discarded with it"
            );
            super::replace::discard_objects(&self.calls, &failed_objects, self.store_deadline());
        }
    }

    /// The keys of `companions` (each with the bytes this save put under it) that hold the
    /// save's bytes, read back in one bounded call, or that could not be read (kept as the
    /// save's: the store said it wrote them); one holding other bytes, or gone, is not.
    fn own_companions(&self, companions: &[(String, Vec<u8>)]) -> Vec<String> {
        if companions.is_empty() {
            return Vec::new();
        }
        let refs: Vec<&str> = companions.iter().map(|(k, _)| k.as_str()).collect();
        let lens: Vec<usize> = companions.iter().map(|(_, b)| b.len()).collect();
        let read = self
            .calls
            .read_whole_owned(&refs, &lens, self.store_deadline());
        companions
            .iter()
            .zip(read)
            .filter(|((key, ours), got)| match got {
                Ok(bytes) => bytes == ours,
                Err(crate::store::StoreError::NotFound { .. }) => false,
                Err(e) => {
                    warn!(key, error = %e, "a companion beside another writer's object could not be read back: taken as the save's");
                    true
                }
            })
            .map(|((key, _), _)| key.clone())
            .collect()
    }

    /// Of `own` (companion keys among `written`, each with the checksums this save put under
    /// it), those whose object does not hold the bytes the checksums describe: the object
    /// another writer put first may be the same bytes (a second save of the same page), and
    /// then the companion is its own and stays. An object that cannot be read is taken as
    /// not matching (the companion goes, as before: the object stays, checked by length).
    fn unless_objects_match(
        &self,
        comp: &ComponentKeys,
        written: &[(String, Vec<u8>)],
        own: Vec<String>,
    ) -> Vec<String> {
        if own.is_empty() {
            return own;
        }
        // A companion's key is its object's with the suffix.
        let pairs: Vec<(String, String)> = own
            .into_iter()
            .filter_map(|c| {
                let object = c.strip_suffix(kv_geometry::CHECKSUM_KEY_SUFFIX)?.to_owned();
                Some((c, object))
            })
            .collect();
        let keys: Vec<&str> = pairs.iter().map(|(_, o)| o.as_str()).collect();
        let lens = vec![comp.layout.object_bytes() as usize; keys.len()];
        let read = self
            .calls
            .read_whole_owned(&keys, &lens, self.store_deadline());
        pairs
            .into_iter()
            .zip(read)
            .filter(|((companion, _), object)| {
                let ours = written.iter().find(|(k, _)| k == companion).map(|(_, b)| b);
                let matches = object.as_ref().ok().and_then(|o| {
                    ObjectChecksums::of_object(o, comp.layout.page_layer_bytes).ok()
                });
                match (ours, matches) {
                    (Some(ours), Some(sums)) if sums.encode() == *ours => {
                        debug!(companion, "the object another writer put first holds this save's bytes: its companion stays");
                        false
                    }
                    _ => true,
                }
            })
            .map(|((companion, _), _)| companion)
            .collect()
    }

    /// Discards `keys`, which are `what` (best effort: a key that cannot be discarded stays,
    /// logged).
    fn discard_unpaired(&self, keys: &[String], what: &str) {
        if keys.is_empty() {
            return;
        }
        warn!(keys = keys.len(), "{what}: discarded");
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let results = self.calls.discard(&refs, self.store_deadline());
        let mut failed = refs
            .iter()
            .zip(&results)
            .filter_map(|(k, r)| r.as_ref().err().map(|e| (k, e)));
        if let Some((key, e)) = failed.next() {
            warn!(stay = 1 + failed.count(), first = key, error = %e,
                "{what}: these could not be discarded and stay");
        }
    }
}

/// A page the plan names twice (two requests of one prefix) shares its objects with its twin,
/// which counted them present: where one is not saved (its object discarded after its put),
/// neither is the other.
fn not_saved_twins(plan: &BatchPlan, report: &mut SaveReport) {
    if report.pages_not_saved.is_empty() {
        return;
    }
    let hashes: Vec<_> = plan.logical.pages().collect();
    let lost: std::collections::HashSet<_> = report
        .pages_not_saved
        .iter()
        .filter_map(|&p| hashes.get(p as usize).copied())
        .collect();
    for (q, h) in hashes.iter().enumerate() {
        if lost.contains(h) {
            report.pages_not_saved.push(q as u32);
        }
    }
}

/// The zeroed buffer a chunk's objects are gathered into (`object` bytes a page); an
/// `Internal` failure naming the chunk's pages when the allocator cannot give it (host
/// memory, not the store's: not `NoSpace`), where `vec!` would abort the process
/// (`save_chunk` objects of a large model are hundreds of MB).
fn objects_buffer(
    batch: BatchId,
    component: &str,
    chunk: &[usize],
    object: usize,
) -> Result<Vec<u8>, KvLoadError> {
    let len = object.saturating_mul(chunk.len());
    kv_device::zeroed_bytes(len).ok_or_else(|| {
        KvLoadError::internal(
            batch,
            format!(
                "{len} bytes of host memory to gather `{component}` objects (plan pages \
                 {chunk:?}) for saving could not be allocated"
            ),
        )
    })
}

/// A store failure of a save naming plan pages also names their twins (the same page named
/// again: it counted the object present, and the store lacks it as well).
fn with_twins(plan: &BatchPlan, e: KvLoadError) -> KvLoadError {
    match e {
        KvLoadError::Store {
            batch,
            layer,
            pages,
            kind,
            detail,
        } => {
            let hashes: Vec<_> = plan.logical.pages().collect();
            let named: std::collections::HashSet<_> = pages
                .iter()
                .filter_map(|&p| hashes.get(p as usize).copied())
                .collect();
            let pages: Vec<u32> = (0..hashes.len() as u32)
                .filter(|&q| pages.contains(&q) || named.contains(hashes[q as usize]))
                .collect();
            KvLoadError::Store {
                batch,
                layer,
                pages: pages.into(),
                kind,
                detail,
            }
        }
        e => e,
    }
}

#[cfg(test)]
mod objects_buffer_tests {
    use super::*;

    /// Before, `vec!` aborted the process when a chunk's objects could not be allocated (a
    /// large `save_chunk` of a large model): now the save fails `Internal`, naming the pages.
    #[test]
    fn a_chunk_past_what_can_be_allocated_fails_its_pages() {
        let e = objects_buffer(BatchId(3), "k", &[4, 5], usize::MAX / 2).unwrap_err();
        assert!(
            matches!(e, KvLoadError::Internal { .. }) && e.to_string().contains("[4, 5]"),
            "{e}"
        );
        assert_eq!(
            objects_buffer(BatchId(3), "k", &[4, 5], 8).unwrap(),
            vec![0; 16]
        );
    }
}
