//! Rows of a layer that failed against their checksums, checked again against their
//! companions read afresh before their object is taken as bad. Checksums go stale when their
//! object is evicted and written again with other bytes (prefill kernels need not be bitwise
//! deterministic): those an earlier load kept (`checksum_cache`), and those this batch read
//! beside its pin, before the pin took. A good object must not be discarded for that.

use std::sync::Arc;

use kv_geometry::{ComponentLayout, ObjectChecksums, Verified};
use kv_loader::{BatchId, KvLoadError, StoreFailure};

use super::companion::{companion_of, CompanionGot, CompanionRead};
use super::reader::{store_failure, ComponentKeys};
use super::Inner;

/// A row of a layer to check again: its component, plan page and bytes as read (and their
/// checksum, when the store took it as they landed).
pub(crate) struct StaleRow<'a> {
    pub(crate) component: &'a ComponentKeys,
    pub(crate) page: usize,
    pub(crate) bytes: &'a [u8],
    pub(crate) landed: Option<u64>,
    /// Its checksums were kept by an earlier load (else this batch read them).
    pub(crate) kept: bool,
    /// The checksums its object's layers this batch checked before matched.
    pub(crate) published: &'a ObjectChecksums,
}

/// The first model layer before `layer` of `layout` on which `a` and `b` disagree: the
/// batch's layers of an object checked so far (in model layer order, all before `layer`)
/// matched `a`; where `b`, of the object written again, disagrees on one, the batch holds two
/// versions of the object. Checksums of another layout disagree on their first layer.
pub(crate) fn first_disagreement(
    a: &ObjectChecksums,
    b: &ObjectChecksums,
    layout: &ComponentLayout,
    layer: u32,
) -> Option<u32> {
    let earlier = layout.layers.iter().enumerate().filter(|(_, &l)| l < layer);
    earlier
        .map(|(pos, &l)| (l, a.sums.get(pos), b.sums.get(pos)))
        .find(|(_, x, y)| x.is_none() || x != y)
        .map(|(l, _, _)| l)
}

/// The batch fails, retryable, with nothing discarded: `row`'s object was written again twice
/// while the batch read it (its layers moved to fresh checksums once already).
pub(crate) fn written_again_twice(batch: BatchId, layer: u32, row: &StaleRow<'_>) -> KvLoadError {
    let key = &row.component.keys[row.page];
    tracing::warn!(%batch, key, layer, "an object was written again twice while one batch read it: not loaded");
    let detail = format!(
        "`{key}` was written again twice while this batch read it: not loaded, nothing \
         discarded"
    );
    rewritten(batch, layer, row, detail)
}

/// A retryable store failure (`TransferFailed`) of `row`'s plan page at `layer`.
fn rewritten(batch: BatchId, layer: u32, row: &StaleRow<'_>, detail: String) -> KvLoadError {
    KvLoadError::Store {
        batch: Some(batch),
        layer: Some(layer),
        pages: vec![row.page as u32].into(),
        kind: StoreFailure::TransferFailed,
        detail: detail.into(),
    }
}

impl Inner {
    /// Layer `layer` of each row's object failed against its checksums (kept, or read by this
    /// batch): forgets any kept ones, reads
    /// the rows' companions afresh (one call for all) and checks each row against its own.
    /// Where the object has no companion now, or a bad one, its size is checked first (when
    /// `verify_object_sizes`): kept checksums let layer 0 go before the sizes were in, and a
    /// row's length alone cannot tell a wrong-sized object. Every row passes: their verdicts
    /// and fresh checksums (also kept in the cache), unless those disagree with the ones the
    /// batch's earlier layers of the object matched (`published`): the object was written
    /// again while the batch read it, and the batch would hold layers of both versions, so it
    /// fails as a store failure (`TransferFailed`, retryable) and nothing is discarded (the
    /// next load reads the new version whole). A row whose object has no companion now fails the batch as a
    /// store failure (`TransferFailed`, retryable) and nothing is discarded: its bytes
    /// disagree with the checksums this rank had, and with the companion gone nothing tells a
    /// rewrite by a writer that writes none (such as SGLang) from a bad transfer of the same
    /// object, so the engine recomputes, and the next load, finding no companion, checks the
    /// object by length as it checks any object without one. A row fails: the object's layer is
    /// read again (one whole read) and checked against the fresh companion before the object
    /// is taken as bad; where it passes, the row's bytes went wrong on their way (a bad
    /// transfer), so the batch fails as a store failure (`TransferFailed`, retryable) and
    /// nothing is discarded. A row fails again (or its read again fails), or its fresh
    /// companion is malformed: its object is bad (discarded, as any; `PlanError::ObjectSize`
    /// when its size is wrong). The companion's read fails: the batch fails as that store
    /// failure, and nothing is discarded.
    ///
    /// It runs on the exchange loop before this rank's status word, which the peers wait for
    /// at most `collective_timeout`: its store calls are bounded by half of that (and by
    /// `store_call_timeout`), and by `by`, when the peers stop waiting (in a TP group).
    pub(crate) fn recheck_fresh(
        &self,
        batch: BatchId,
        layer: u32,
        rows: &[StaleRow<'_>],
        by: Option<std::time::Instant>,
    ) -> Result<Vec<(Verified, Arc<ObjectChecksums>)>, KvLoadError> {
        let (keys, lens): (Vec<String>, Vec<usize>) = rows
            .iter()
            .map(|r| companion_of(&r.component.keys[r.page], &r.component.layout))
            .unzip();
        for r in rows {
            self.checksums.remove(&r.component.keys[r.page]);
        }
        let kept = rows.iter().filter(|r| r.kept).count() as u64;
        self.metrics.kept_checksums_stale(kept);
        self.metrics.companions_reread(rows.len() as u64 - kept);
        let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
        let bound = self
            .config
            .store_call_timeout
            .min(self.config.collective_timeout / 2);
        let deadline = kv_loader::deadline_after(bound);
        let deadline = by.map_or(deadline, |by| deadline.min(by));
        let sizes =
            |comp: &ComponentKeys, page: usize| self.check_object_size(batch, comp, page, deadline);
        let wrong_size = |comp: &ComponentKeys, page: usize| {
            self.wrong_size_of_bad_object(batch, comp, page, deadline)
        };
        let read = self.calls.read_whole_owned(&refs, &lens, deadline);
        let reads = (rows.iter().zip(read).zip(refs.iter().zip(&lens)))
            .map(|((r, got), (key, &len))| CompanionGot {
                key,
                len,
                layout: &r.component.layout,
                got,
            })
            .collect();
        let judged = self.judge_companions(reads, deadline);
        let mut verdicts = Vec::with_capacity(rows.len());
        for (r, judged) in rows.iter().zip(judged) {
            let (comp, page) = (r.component, r.page);
            let fresh = match judged {
                CompanionRead::Sums(s) => s,
                CompanionRead::Bad(e) => {
                    if let Some(e) = wrong_size(comp, page) {
                        return Err(e);
                    }
                    let detail = format!("checksum object read afresh: {e}");
                    let why = (Some(layer), detail);
                    return Err(self.bad_object(batch, comp, page, why, deadline));
                }
                gone @ (CompanionRead::Absent | CompanionRead::Unsupported(_)) => {
                    sizes(comp, page)?;
                    let since = match gone {
                        CompanionRead::Unsupported(why) => {
                            format!("was replaced since by a newer writer's ({why})")
                        }
                        _ => "is gone since".to_owned(),
                    };
                    return Err(KvLoadError::Store {
                        batch: Some(batch),
                        layer: Some(layer),
                        pages: vec![page as u32].into(),
                        kind: StoreFailure::TransferFailed,
                        detail: format!(
                            "`{}` does not match the checksums read for it, and its \
                             companion {since}: not loaded, nothing discarded (the next load \
                             checks the object by length)",
                            comp.keys[page]
                        )
                        .into(),
                    });
                }
                CompanionRead::Failed(e) => {
                    return Err(store_failure(batch, Some(layer), vec![page as u32], &e));
                }
            };
            let verdict = ObjectChecksums::verify_layer_landed(
                Some(&fresh),
                &comp.layout,
                layer,
                r.bytes,
                r.landed,
            );
            match verdict {
                Ok(v) => {
                    let key = &comp.keys[page];
                    let checksums = if r.kept { "kept" } else { "this batch's" };
                    tracing::info!(%batch, key, layer, checksums, "checksums were stale: the companion read afresh passes");
                    let fresh = Arc::new(fresh);
                    self.checksums.insert(key, fresh.clone());
                    let mixed = first_disagreement(r.published, &fresh, &comp.layout, layer);
                    if let Some(earlier) = mixed {
                        return Err(written_again_during(batch, layer, earlier, r));
                    }
                    verdicts.push((v, fresh));
                }
                Err(e) => {
                    if let Some(e) = wrong_size(comp, page) {
                        return Err(e);
                    }
                    self.read_again(batch, comp, page, layer, Some(&fresh), deadline)?;
                    let why = (Some(layer), e.to_string());
                    return Err(self.bad_object(batch, comp, page, why, deadline));
                }
            }
        }
        Ok(verdicts)
    }

    /// Reads the object of plan page `page` again, whole, and checks its layer `layer` against
    /// `fresh`: `TransferFailed`, with nothing discarded, when the layer now passes (the first
    /// read's bytes went wrong on their way, not the object's); else `Ok` (the object is bad):
    /// also when the read itself fails (a spent deadline, an unavailable store), which does not
    /// spare a bad object its discard, as a size that cannot be had does not.
    fn read_again(
        &self,
        batch: BatchId,
        comp: &ComponentKeys,
        page: usize,
        layer: u32,
        fresh: Option<&ObjectChecksums>,
        deadline: std::time::Instant,
    ) -> Result<(), KvLoadError> {
        let key = comp.keys[page].as_str();
        let len = comp.layout.object_bytes() as usize;
        let object = match self.calls.read_whole_owned(&[key], &[len], deadline).pop() {
            Some(Ok(object)) => object,
            Some(Err(e)) => {
                tracing::warn!(%batch, key, layer, error = %e, "a bad layer's object could not be read again: discarded anyway");
                return Ok(());
            }
            None => return Ok(()),
        };
        let row = comp
            .layout
            .layer_range(layer)
            .and_then(|r| object.get(r.start as usize..r.end as usize));
        let passes = row.is_some_and(|row| {
            ObjectChecksums::verify_layer_landed(fresh, &comp.layout, layer, row, None).is_ok()
        });
        if !passes {
            return Ok(());
        }
        tracing::warn!(%batch, key, layer, "a layer failed its checksums but passes when read again: a bad transfer, the object stays");
        Err(KvLoadError::Store {
            batch: Some(batch),
            layer: Some(layer),
            pages: vec![page as u32].into(),
            kind: StoreFailure::TransferFailed,
            detail: format!(
                "`{key}` layer {layer} failed its checksums as read, and passes read again: not \
                 loaded, nothing discarded"
            )
            .into(),
        })
    }
}

/// The batch fails, retryable, with nothing discarded: `row`'s object was written again while
/// the batch read it, with other bytes at layer `earlier`, which the batch holds of the
/// earlier version, and at `layer`, which it holds of the new one.
fn written_again_during(
    batch: BatchId,
    layer: u32,
    earlier: u32,
    row: &StaleRow<'_>,
) -> KvLoadError {
    let key = &row.component.keys[row.page];
    tracing::warn!(%batch, key, layer, earlier, "an object was written again while the batch read it: layers of two versions, not loaded");
    let detail = format!(
        "`{key}` was written again with other bytes while this batch read it: layer \
         {earlier} as read is of the earlier version, layer {layer} of the new one; not \
         loaded, nothing discarded (the next load reads the new version)"
    );
    rewritten(batch, layer, row, detail)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_geometry::{KvGeometry, ModelKvSpec};

    #[test]
    fn checksums_disagree_first_on_the_earliest_differing_layer_before_the_one_checked() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let k = g.component_by_name("k").unwrap();
        let n = k.layers.len();
        let a = ObjectChecksums {
            layer_bytes: k.page_layer_bytes,
            sums: (0..n as u64).collect(),
        };
        let mut b = a.clone();
        assert_eq!(
            first_disagreement(&a, &b, k, 78),
            None,
            "the same sums agree"
        );
        // Layers 5 and 9 differ: checked before layer 5, nothing disagrees yet.
        b.sums[5] += 100;
        b.sums[9] += 100;
        assert_eq!(first_disagreement(&a, &b, k, 0), None);
        assert_eq!(first_disagreement(&a, &b, k, 5), None);
        assert_eq!(first_disagreement(&a, &b, k, 6), Some(5));
        assert_eq!(first_disagreement(&a, &b, k, 40), Some(5));
        // Checksums cut short (another layout) disagree where they end.
        let short = ObjectChecksums {
            layer_bytes: k.page_layer_bytes,
            sums: a.sums[..3].to_vec(),
        };
        assert_eq!(first_disagreement(&a, &short, k, 2), None);
        assert_eq!(first_disagreement(&a, &short, k, 4), Some(3));
        assert_eq!(first_disagreement(&short, &a, k, 4), Some(3));
    }
}
