//! Verifying what a load read, before it is reported loaded.
//!
//! Once per batch, beside the first reads: the checksum companions (`{key}_kvsum`, written by
//! kvlink's save) of the objects this rank reads, read whole in one call (absent ones come
//! back `NotFound`), except those an earlier load kept (`checksum_cache`; rows failing
//! against those are checked again against fresh ones: `fresh_companion`). Per layer, on the
//! exchange loop (beside the reader, which reads the next layer meanwhile: off its critical
//! path), before the layer's status word: every
//! (object, layer) range this rank read is checked (`ObjectChecksums::verify_layer`: the
//! checksum where a companion exists, the length only where none does, e.g. objects SGLang
//! wrote). A range that fails is this rank's failure in that layer's status word, so every
//! rank fails the batch alike; its object and companion are discarded, so the next save writes
//! them again.

use kv_device::{LayerLanding, LayerStage, ShareSide};
use kv_geometry::{ChecksumError, ObjectChecksums, Verified};
use kv_loader::{BatchId, KvLoadError};

use super::batch::BatchLayers;
use super::companion::{companion_of, CompanionGot, CompanionRead};
use super::fresh_companion::{first_disagreement, written_again_twice, StaleRow};
use super::landed::LandedSums;
use super::reader::{check_object_sizes, store_failure, ComponentKeys, WrongSizeAction};
use super::Inner;

/// The companions of one batch's objects this rank reads: per component (own, then shared, in
/// [`BatchLayers`] order), per plan page; `None` where the object has none (checked by length
/// only) or this rank does not read it.
#[derive(Debug, Default)]
pub(crate) struct BatchChecksums {
    /// Verification is on.
    pub(crate) enabled: bool,
    own: Vec<Vec<Option<Companion>>>,
    shared: Vec<Vec<Option<Companion>>>,
}

/// One object's checksums for a batch, and whether an earlier load kept them (else this batch
/// read them). A layer that fails against them is checked again against the companion read
/// afresh either way.
#[derive(Debug, Clone)]
struct Companion {
    sums: std::sync::Arc<ObjectChecksums>,
    kept: bool,
    /// Checksums of the object written again since `sums` were taken, that the batch's later
    /// layers of it are checked against: set (once a batch) where a layer failed against
    /// `sums` and passed against its companion read afresh (or one another batch read), and
    /// those agree with `sums` on every layer the batch checked before.
    moved: std::sync::OnceLock<std::sync::Arc<ObjectChecksums>>,
}

impl Companion {
    fn new(sums: std::sync::Arc<ObjectChecksums>, kept: bool) -> Self {
        Companion {
            sums,
            kept,
            moved: std::sync::OnceLock::new(),
        }
    }

    /// The checksums every layer of the object this batch checked so far matched.
    fn published(&self) -> &std::sync::Arc<ObjectChecksums> {
        self.moved.get().unwrap_or(&self.sums)
    }
}

/// One companion this rank wants: which component list, which component, which page (its
/// key and length are made only for those not kept: [`companion_of`]).
struct Wanted {
    shared: bool,
    comp: usize,
    page: usize,
}

impl BatchChecksums {
    fn slot(&mut self, shared: bool, comp: usize, page: usize) -> Option<&mut Option<Companion>> {
        let list = if shared {
            &mut self.shared
        } else {
            &mut self.own
        };
        list.get_mut(comp)?.get_mut(page)
    }

    fn get(&self, shared: bool, comp: usize, page: usize) -> Option<&Companion> {
        let list = if shared { &self.shared } else { &self.own };
        list.get(comp)?.get(page)?.as_ref()
    }

    /// Verification is on and some object this rank reads has a companion: some range will
    /// be checked by its checksum.
    pub(crate) fn has_companions(&self) -> bool {
        self.enabled
            && self
                .own
                .iter()
                .chain(&self.shared)
                .flatten()
                .any(Option::is_some)
    }
}

impl Inner {
    /// The companions this rank wants for `layers` (own components: every page; shared ones:
    /// this rank's share): the bookkeeping to read them into. No store call.
    pub(crate) fn wanted_companions(&self, layers: &BatchLayers) -> CompanionPlan {
        let mut plan = CompanionPlan {
            sums: BatchChecksums {
                enabled: self.config.verify_checksums,
                own: vec![vec![None; layers.pages]; layers.own.len()],
                shared: vec![vec![None; layers.pages]; layers.shared.len()],
            },
            wanted: Vec::new(),
            absent: 0,
        };
        if !self.config.verify_checksums {
            return plan;
        }
        let mine = layers.my_pages();
        let lists = [
            (false, &layers.own, 0..layers.pages),
            (true, &layers.shared, mine),
        ];
        for (shared, comps, pages) in lists {
            for comp in 0..comps.len() {
                let wanted = pages.clone().map(|page| Wanted { shared, comp, page });
                plan.wanted.extend(wanted);
            }
        }
        plan
    }

    /// Reads the wanted companions (each once, whole, in one call: no read session, so no
    /// request to a master beyond the read, and no wait on the sessions the load's data reads
    /// use; no `exists` first either, since a companion the store does not hold comes back
    /// `NotFound` and its object is then checked by length only) and decodes them. A companion
    /// that is not one (malformed, another layout, cut short) makes its object bad: both are
    /// discarded and the batch fails on this rank. A newer writer's (another format version)
    /// is checked as none: its object by length only. Sets `plan`'s count of absent companions.
    pub(crate) fn read_companions(
        &self,
        layers: &BatchLayers,
        batch: BatchId,
        plan: &mut CompanionPlan,
    ) -> Result<(), KvLoadError> {
        self.take_kept_companions(layers, plan);
        if plan.wanted.is_empty() {
            return Ok(());
        }
        let (keys, lens): (Vec<String>, Vec<usize>) = plan
            .wanted
            .iter()
            .map(|w| companion_of(object_key(layers, w), &wanted_component(layers, w).layout))
            .collect();
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let got = self
            .calls
            .read_whole_owned(&refs, &lens, self.store_deadline());
        let reads = (plan.wanted.iter().zip(got).zip(refs.iter().zip(&lens)))
            .map(|((w, got), (key, &len))| CompanionGot {
                key,
                len,
                layout: &wanted_component(layers, w).layout,
                got,
            })
            .collect();
        let judged = self.judge_companions(reads, self.store_deadline());
        for (w, judged) in plan.wanted.iter().zip(judged) {
            let comp = wanted_component(layers, w);
            let detail = match judged {
                CompanionRead::Sums(sums) => {
                    let sums = std::sync::Arc::new(sums);
                    self.checksums.insert(&comp.keys[w.page], sums.clone());
                    if let Some(slot) = plan.sums.slot(w.shared, w.comp, w.page) {
                        *slot = Some(Companion::new(sums, false));
                    }
                    continue;
                }
                // A newer writer's companion: checked as one with none (logged by the judge).
                CompanionRead::Absent | CompanionRead::Unsupported(_) => {
                    plan.absent += 1;
                    continue;
                }
                CompanionRead::Failed(e) => {
                    return Err(store_failure(batch, None, vec![w.page as u32], &e))
                }
                CompanionRead::Bad(detail) => detail,
            };
            // A companion that does not fit the geometry most often means the object itself
            // was written for another one: say so, as the size check would.
            let deadline = self.store_deadline();
            if let Some(e) = self.wrong_size_of_bad_object(batch, comp, w.page, deadline) {
                return Err(e);
            }
            let deadline = self.store_deadline();
            return Err(self.bad_object(batch, comp, w.page, (None, detail), deadline));
        }
        Ok(())
    }

    /// Takes the companions an earlier load kept out of `plan`'s reads, into its checksums.
    fn take_kept_companions(&self, layers: &BatchLayers, plan: &mut CompanionPlan) {
        let wanted = plan.wanted.len();
        self.take_kept(layers, plan);
        // Companions a lookup is still reading ahead: waited for (within that read's own
        // deadline), not read twice.
        let pending: Vec<&str> = plan.wanted.iter().map(|w| object_key(layers, w)).collect();
        if !pending.is_empty() {
            let limit = kv_loader::deadline_after(super::prefetch::read_ahead_wait(
                self.config.store_call_timeout,
            ));
            self.prefetch
                .wait_for(&pending, limit, || self.metrics.read_ahead_wait());
            // Also when it did not wait: a read ahead may have ended since the first pass.
            self.take_kept(layers, plan);
        }
        self.metrics
            .companions_kept((wanted - plan.wanted.len()) as u64);
    }

    /// One pass of [`take_kept_companions`](Self::take_kept_companions).
    fn take_kept(&self, layers: &BatchLayers, plan: &mut CompanionPlan) {
        let sums = &mut plan.sums;
        plan.wanted.retain(|w| {
            let Some(kept) = self.checksums.get(object_key(layers, w)) else {
                return true;
            };
            if let Some(slot) = sums.slot(w.shared, w.comp, w.page) {
                *slot = Some(Companion::new(kept, true));
            }
            false
        });
    }

    /// With `verify_object_sizes`, the size check of one object (`comp` at plan page `page`,
    /// see [`check_object_sizes`]), bounded by `deadline`: before an object is called bad, so
    /// that a wrong-sized one says so.
    pub(crate) fn check_object_size(
        &self,
        batch: BatchId,
        comp: &ComponentKeys,
        page: usize,
        deadline: std::time::Instant,
    ) -> Result<(), KvLoadError> {
        if !self.config.verify_object_sizes {
            return Ok(());
        }
        let comps = std::slice::from_ref(comp);
        check_object_sizes(
            &self.calls,
            (&self.checksums, &self.wrong_sized),
            batch,
            WrongSizeAction::under(&self.config.namespace),
            comps,
            page..page + 1,
            deadline,
        )
    }

    /// Before a bad object's discard: its size checked ([`check_object_size`]), the error
    /// when that check found it wrong (and discarded it: that is the verdict). A size that
    /// could not be had (a query not sent by a spent deadline, a transient store error) does
    /// not spare a bad object its discard: `None`, logged.
    ///
    /// [`check_object_size`]: Self::check_object_size
    pub(crate) fn wrong_size_of_bad_object(
        &self,
        batch: BatchId,
        comp: &ComponentKeys,
        page: usize,
        deadline: std::time::Instant,
    ) -> Option<KvLoadError> {
        match self.check_object_size(batch, comp, page, deadline) {
            Err(e @ KvLoadError::InvalidPlan { .. }) => Some(e),
            Err(e) => {
                tracing::warn!(%batch, key = comp.keys[page], error = %e, "size of a bad object not known: discarded anyway");
                None
            }
            Ok(()) => None,
        }
    }

    /// An object found bad: discarded with its companion (the discard bounded by `deadline`),
    /// counted, and the batch's error.
    pub(crate) fn bad_object(
        &self,
        batch: BatchId,
        comp: &ComponentKeys,
        page: usize,
        (layer, detail): (Option<u32>, String),
        deadline: std::time::Instant,
    ) -> KvLoadError {
        let key = comp.keys[page].clone();
        tracing::error!(%batch, key, ?layer, detail, "object failed verification: discarding it");
        self.checksums.remove(&key);
        self.metrics.bad_object();
        super::replace::discard_objects(&self.calls, &[key.as_str()], deadline);
        KvLoadError::BadObject {
            batch,
            key,
            layer,
            detail,
        }
    }
}

/// The component whose object's companion `w` wants.
fn wanted_component<'a>(layers: &'a BatchLayers, w: &Wanted) -> &'a ComponentKeys {
    if w.shared {
        &layers.shared[w.comp]
    } else {
        &layers.own[w.comp]
    }
}

/// The object key of the companion `w` wants.
fn object_key<'a>(layers: &'a BatchLayers, w: &Wanted) -> &'a str {
    &wanted_component(layers, w).keys[w.page]
}

/// Companions to read for one batch (see [`Inner::wanted_companions`]).
pub(crate) struct CompanionPlan {
    sums: BatchChecksums,
    wanted: Vec<Wanted>,
    /// Objects this rank reads that have no companion (checked by length only).
    absent: usize,
}

impl CompanionPlan {
    /// Verification is on and every object this rank reads has a companion (known once they
    /// were read): each layer's bytes are checked against their checksums.
    pub(crate) fn covers_every_object(&self) -> bool {
        self.sums.enabled && self.absent == 0
    }

    /// The companions read, for the layers' checks.
    pub(crate) fn into_sums(self) -> BatchChecksums {
        self.sums
    }
}

/// Checks layer `layer` of what this rank read for a batch, in the stage the reader handed
/// over (see the module docs).
pub(crate) struct LayerCheck<'a> {
    pub(crate) inner: &'a Inner,
    pub(crate) batch: BatchId,
    pub(crate) layers: &'a BatchLayers,
    pub(crate) sums: &'a BatchChecksums,
    /// When the check's store calls must have ended (in a TP group: before the peers stop
    /// waiting for the layer's status word), besides their own bounds.
    pub(crate) by: Option<std::time::Instant>,
}

impl LayerCheck<'_> {
    /// `deadline`, or the check's own bound where that is sooner.
    fn bounded(&self, deadline: std::time::Instant) -> std::time::Instant {
        self.by.map_or(deadline, |by| deadline.min(by))
    }

    /// Every range this rank read at `layer`, checked; the first that fails (in component,
    /// then page order; rows that failed against kept checksums only after the others, once
    /// their companions read afresh fail them too) is the error. A row whose checksum the
    /// store took as it landed (`landed`) is checked against that, without reading its bytes
    /// again; the others are hashed, on up to `verify_threads` threads when the layer is large
    /// enough to gain from them: it sits on the load thread between the reader and the
    /// landing, so one core hashing a fast store's layer would bound the load.
    pub(crate) fn run(
        &self,
        landing: &dyn LayerLanding,
        stage: &LayerStage,
        layer: u32,
        landed: Option<&LandedSums>,
    ) -> Result<(), KvLoadError> {
        if !self.sums.enabled {
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let rows = self.rows(landing, stage, layer, landed)?;
        let verdicts =
            verify_rows(&rows, layer, self.inner.config.verify_threads).map_err(|what| {
                KvLoadError::internal(
                    self.batch,
                    what.context(format!("a layer {layer} verification thread panicked")),
                )
            })?;
        // (by checksum, of those against a landed checksum, by length only)
        let mut counts = (0u64, 0u64, 0u64);
        let mut count = |v: Verified, landed: Option<u64>| match v {
            Verified::Checksum => {
                counts.0 += 1;
                counts.1 += u64::from(landed.is_some());
            }
            Verified::LengthOnly => counts.2 += 1,
        };
        // Rows that failed against their checksums may only be stale (their object written
        // again with other bytes since those were read: an earlier load kept them, or this
        // batch read them before its pin took): their companions read afresh decide.
        let (mut stale, mut moving) = (Vec::new(), Vec::new());
        for (row, verdict) in rows.iter().zip(verdicts) {
            let e = match verdict {
                Ok(v) => {
                    count(v, row.landed);
                    continue;
                }
                Err(e) => e,
            };
            if landing_misfit(&e) {
                // The read returned the object's bytes in full (checked as it returned): a
                // slice that does not fit the layout is this rank's landing's doing, and the
                // object is kept.
                return Err(KvLoadError::internal(
                    self.batch,
                    kv_loader::Cause::with_source(
                        format!(
                            "layer {layer}: the landed slice of `{}` does not fit its layout \
                             (a defect of the landing; the object is kept)",
                            row.component.keys.get(row.page).map_or("?", String::as_str)
                        ),
                        e,
                    ),
                ));
            }
            let Some(companion) = row.companion else {
                return Err(self.inner.bad_object(
                    self.batch,
                    row.component,
                    row.page,
                    (Some(layer), e.to_string()),
                    self.bounded(self.inner.store_deadline()),
                ));
            };
            match self.renewed(row, companion, layer) {
                // Another batch's recheck already kept fresh checksums that pass.
                Some(v) => count(v, row.landed),
                None => {
                    moving.push(companion);
                    stale.push(StaleRow {
                        component: row.component,
                        page: row.page,
                        bytes: row.bytes,
                        landed: row.landed,
                        kept: companion.kept,
                        published: companion.published(),
                    });
                }
            }
        }
        if !stale.is_empty() {
            let verdicts = self
                .inner
                .recheck_fresh(self.batch, layer, &stale, self.by)?;
            for (((v, fresh), row), companion) in verdicts.into_iter().zip(&stale).zip(moving) {
                if companion.moved.set(fresh).is_err() {
                    return Err(written_again_twice(self.batch, layer, row));
                }
                count(v, row.landed);
            }
        }
        let (checksummed, as_landed, length_only) = counts;
        self.inner.metrics.verified(checksummed, length_only);
        self.inner.metrics.checksummed_as_landed(as_landed);
        tracing::trace!(layer, checksummed, as_landed, length_only, took = ?t0.elapsed(), "layer verified");
        Ok(())
    }

    /// A row that failed against the checksums this batch has for it (kept, or read), checked
    /// against those the cache holds now when another batch's recheck replaced them (so a
    /// rewritten object is read afresh once, not once per batch), and moved to them when they
    /// pass and agree with the ones the batch's earlier layers of the object matched; `None`:
    /// to be rechecked.
    fn renewed(&self, row: &Row<'_>, companion: &Companion, layer: u32) -> Option<Verified> {
        let published = companion.published();
        let now = self.inner.checksums.get(&row.component.keys[row.page])?;
        if std::sync::Arc::ptr_eq(&now, published) {
            return None;
        }
        let layout = &row.component.layout;
        if first_disagreement(published, &now, layout, layer).is_some() {
            return None;
        }
        let v =
            ObjectChecksums::verify_layer_landed(Some(&now), layout, layer, row.bytes, row.landed)
                .ok()?;
        companion.moved.set(now).ok()?;
        Some(v)
    }

    /// The rows this rank read at `layer`: its own components on every page, and its share
    /// of the replicated ones, each with its checksums (when the object has them).
    fn rows<'s>(
        &'s self,
        landing: &'s dyn LayerLanding,
        stage: &'s LayerStage,
        layer: u32,
        landed: Option<&LandedSums>,
    ) -> Result<Vec<Row<'s>>, KvLoadError> {
        let layers = self.layers;
        let mut rows = Vec::new();
        for (ci, c) in layers.own.iter().enumerate() {
            if c.layout.position(layer).is_none() {
                continue;
            }
            for page in 0..layers.pages {
                let bytes = landing
                    .target_bytes(stage, c.layout.id, page)
                    .map_err(KvLoadError::from)?;
                rows.push(Row {
                    component: c,
                    companion: self.sums.get(false, ci, page),
                    page,
                    bytes,
                    landed: landed.and_then(|l| l.get(false, ci, page)),
                });
            }
        }
        if let Some(layout) = layers.layouts[layer as usize].as_ref() {
            for (ci, c) in layers.shared.iter().enumerate() {
                if c.layout.position(layer).is_none() {
                    continue;
                }
                for page in layout.share(layers.rank) {
                    let bytes = match landing.share() {
                        ShareSide::Host(_) => landing.target_bytes(stage, c.layout.id, page),
                        ShareSide::Device(d) => {
                            let off = layout.offset(c.layout.id, page).ok_or(
                                kv_device::DeviceError::InvalidStage("a shared row not staged"),
                            )?;
                            d.share_bytes(stage, off, c.layout.page_layer_bytes as usize)
                        }
                    }
                    .map_err(KvLoadError::from)?;
                    rows.push(Row {
                        component: c,
                        companion: self.sums.get(true, ci, page),
                        page,
                        bytes,
                        landed: landed.and_then(|l| l.get(true, ci, page)),
                    });
                }
            }
        }
        Ok(rows)
    }
}

/// One row of a layer to verify.
struct Row<'a> {
    component: &'a ComponentKeys,
    /// Its object's checksums, if it has a companion.
    companion: Option<&'a Companion>,
    page: usize,
    bytes: &'a [u8],
    /// The checksum the store took of `bytes` as they landed, if it took one.
    landed: Option<u64>,
}

impl<'a> Row<'a> {
    /// Its object's checksums, if it has a companion: those its earlier layers in the batch
    /// matched.
    fn sums(&self) -> Option<&'a ObjectChecksums> {
        self.companion.map(|c| &**c.published())
    }
}

/// Whether a row's check failed on the slice the landing gave (its length, or a layer its
/// component's layout does not carry), not on the object's bytes: the store read returned
/// every byte it was asked for, so such a failure is never the object's.
fn landing_misfit(e: &ChecksumError) -> bool {
    matches!(e, ChecksumError::Length { .. } | ChecksumError::NoLayer(_))
}

/// Most threads one layer's check starts, whatever `verify_threads` says.
const MAX_VERIFY_THREADS: usize = 64;

/// Bytes of a layer below which its rows are hashed on the calling thread alone.
const PARALLEL_VERIFY_BYTES: usize = 8 << 20;

/// Threads a layer of `rows` rows and `bytes` bytes is checked on, when `verify_threads` says
/// `threads`: one under [`PARALLEL_VERIFY_BYTES`], else at most one per row and
/// [`MAX_VERIFY_THREADS`].
fn verify_threads_for(threads: usize, rows: usize, bytes: usize) -> usize {
    if bytes < PARALLEL_VERIFY_BYTES {
        return 1;
    }
    threads.clamp(1, rows.clamp(1, MAX_VERIFY_THREADS))
}

/// Each row's verdict, in row order: on the calling thread, or split in contiguous parts over
/// up to `threads` threads, the calling one and scoped ones for the others (a part whose
/// thread cannot start is verified inline); the panic's words when a verification thread
/// panicked (the batch then fails; nothing is re-run).
fn verify_rows(
    rows: &[Row<'_>],
    layer: u32,
    threads: usize,
) -> Result<Vec<Result<Verified, ChecksumError>>, kv_loader::Cause> {
    let verify = |r: &Row<'_>| {
        ObjectChecksums::verify_layer_landed(
            r.sums(),
            &r.component.layout,
            layer,
            r.bytes,
            r.landed,
        )
    };
    // Only the rows to hash count towards splitting the work over threads.
    let total: usize = rows
        .iter()
        .filter(|r| r.sums().is_some() && r.landed.is_none())
        .map(|r| r.bytes.len())
        .sum();
    let threads = verify_threads_for(threads, rows.len(), total);
    if threads == 1 {
        return Ok(rows.iter().map(verify).collect());
    }
    let chunk = rows.len().div_ceil(threads);
    let (first, rest) = rows.split_at(chunk.min(rows.len()));
    std::thread::scope(|s| {
        let parts: Vec<_> = rest
            .chunks(chunk)
            .map(|part| {
                let handle = std::thread::Builder::new()
                    .name("kvlink-verify".into())
                    .spawn_scoped(s, move || part.iter().map(verify).collect::<Vec<_>>());
                (part, handle)
            })
            .collect();
        // The first part on this thread while the others run; a panic in it fails the batch
        // as one on a thread does.
        let mine = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            first.iter().map(verify).collect::<Vec<_>>()
        }))
        .map_err(|p| kv_loader::Cause::from_panic(p.as_ref()));
        // Every thread is joined before deciding, so a second panicked part cannot re-panic
        // when the scope ends.
        let joined: Vec<Result<Vec<_>, _>> = parts
            .into_iter()
            .map(|(part, handle)| match handle {
                Ok(h) => h
                    .join()
                    .map_err(|p| kv_loader::Cause::from_panic(p.as_ref())),
                Err(_) => Ok(part.iter().map(verify).collect()),
            })
            .collect();
        let mut all = Vec::with_capacity(rows.len());
        all.extend(mine?);
        for part in joined {
            all.extend(part?);
        }
        Ok(all)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_geometry::{KvGeometry, ModelKvSpec};

    #[test]
    fn rows_verified_on_threads_keep_their_order_and_their_verdicts() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let k = g.component_by_name("k").unwrap().clone();
        let object: Vec<u8> = (0..k.object_bytes()).map(|i| (i * 7 + 3) as u8).collect();
        let sums = ObjectChecksums::of_object(&object, k.page_layer_bytes).unwrap();
        let companion_of_sums = Companion::new(std::sync::Arc::new(sums.clone()), false);
        let range = k.layer_range(3).unwrap();
        let good = &object[range.start as usize..range.end as usize];
        let mut bad = good.to_vec();
        bad[17] ^= 1;
        let component = ComponentKeys {
            layout: k.clone(),
            keys: Vec::new(),
        };
        // 300 rows of 41,984 B (12.6 MB: over the parallel threshold); row 211 corrupt, row
        // 40 without checksums.
        let rows: Vec<Row<'_>> = (0..300)
            .map(|page| Row {
                component: &component,
                companion: (page != 40).then_some(&companion_of_sums),
                page,
                bytes: if page == 211 { &bad } else { good },
                landed: None,
            })
            .collect();
        assert!(rows.iter().map(|r| r.bytes.len()).sum::<usize>() >= PARALLEL_VERIFY_BYTES);
        let inline = verify_rows(&rows, 3, 1).unwrap();
        let threaded = verify_rows(&rows, 3, 4).unwrap();
        assert_eq!(threaded, inline);
        // A hostile thread count is capped (MAX_VERIFY_THREADS), not 300 threads or a panic.
        assert_eq!(verify_rows(&rows, 3, usize::MAX).unwrap(), inline);
        assert_eq!(verify_rows(&rows, 3, 0).unwrap(), inline);
        let big = PARALLEL_VERIFY_BYTES;
        assert_eq!(verify_threads_for(usize::MAX, 300, big), MAX_VERIFY_THREADS);
        assert_eq!(verify_threads_for(usize::MAX, 5, big), 5);
        assert_eq!(verify_threads_for(0, 300, big), 1);
        assert_eq!(verify_threads_for(4, 300, big), 4);
        assert_eq!(verify_threads_for(4, 300, big - 1), 1);
        assert_eq!(verify_threads_for(4, 0, big), 1);
        assert_eq!(threaded.len(), 300);
        for (page, v) in threaded.iter().enumerate() {
            match page {
                211 => assert!(matches!(v, Err(ChecksumError::Mismatch { layer: 3, .. }))),
                40 => assert_eq!(v, &Ok(Verified::LengthOnly)),
                _ => assert_eq!(v, &Ok(Verified::Checksum)),
            }
        }
    }

    #[test]
    fn a_checksum_taken_as_the_bytes_landed_is_checked_without_hashing_them_again() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let k = g.component_by_name("k").unwrap().clone();
        let object: Vec<u8> = (0..k.object_bytes()).map(|i| (i * 5 + 1) as u8).collect();
        let sums = ObjectChecksums::of_object(&object, k.page_layer_bytes).unwrap();
        let companion_of_sums = Companion::new(std::sync::Arc::new(sums), false);
        let range = k.layer_range(2).unwrap();
        let good = &object[range.start as usize..range.end as usize];
        let right = kv_geometry::layer_checksum(good);
        let component = ComponentKeys {
            layout: k.clone(),
            keys: Vec::new(),
        };
        // Row 0: hashed here; row 1: its landed checksum, right; row 2: a landed checksum
        // that is not the companion's (the store saw other bytes land), though the bytes in
        // the pool now hash right: the landed one decides; row 3: no companion, a landed
        // checksum ignored (length only).
        let landed = [None, Some(right), Some(right ^ 1), Some(0)];
        let rows: Vec<Row<'_>> = (0..4)
            .map(|page| Row {
                component: &component,
                companion: (page != 3).then_some(&companion_of_sums),
                page,
                bytes: good,
                landed: landed[page],
            })
            .collect();
        let got = verify_rows(&rows, 2, 1).unwrap();
        assert_eq!(got[0], Ok(Verified::Checksum));
        assert_eq!(got[1], Ok(Verified::Checksum));
        assert!(
            matches!(got[2], Err(ChecksumError::Mismatch { layer: 2, actual, .. }) if actual == right ^ 1),
            "{:?}",
            got[2]
        );
        assert_eq!(got[3], Ok(Verified::LengthOnly));
        // A landed checksum does not excuse a wrong length.
        let short = Row {
            bytes: &good[1..],
            ..rows[1]
        };
        assert!(matches!(
            verify_rows(std::slice::from_ref(&short), 2, 1).unwrap()[0],
            Err(ChecksumError::Length { .. })
        ));
    }

    #[test]
    fn checksums_are_wanted_as_the_rows_land_only_while_some_object_has_a_companion() {
        let companion = Companion::new(
            std::sync::Arc::new(ObjectChecksums {
                layer_bytes: 8,
                sums: vec![1],
            }),
            false,
        );
        let mut sums = BatchChecksums {
            enabled: true,
            own: vec![vec![None; 3]],
            shared: vec![vec![None; 3]],
        };
        assert!(!sums.has_companions(), "every companion absent");
        *sums.slot(true, 0, 2).unwrap() = Some(companion);
        assert!(sums.has_companions(), "one shared object has one");
        sums.enabled = false;
        assert!(!sums.has_companions(), "checks off");
        assert!(sums.slot(true, 1, 0).is_none() && sums.slot(false, 0, 3).is_none());
    }
}
