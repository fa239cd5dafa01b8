//! Reading a group of layers of a batch: one batched ranged read for every component the rank
//! reads, straight into the landing's targets (one range per layer per object: consecutive in
//! the object, so a store can read them as one). The targets are typed: each layer's stage is
//! lent to the read as a [`StageLoan`], the targets are minted in the loans, and the loans
//! move into the store call ([`StoreCalls::read_targets`], which checks them), so this module
//! never handles an address. Every store call is bounded: one that does not return within
//! `LinkerConfig::layer_read_timeout` fails the group at once, and the loans (with the
//! batch's memory hold they keep) keep what it writes allocated and away from others until it
//! returns.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::StagingLayout;
use kv_device::{DeviceError, DeviceShare, LayerLanding, ReadTarget, StageLoan};
use kv_geometry::{checksum_key, ComponentId, ComponentLayout, Namespace, ObjectChecksums};
use kv_loader::{BatchId, KvLoadError, PlanError, StoreFailure};
use smallvec::SmallVec;

use super::checksum_cache::ChecksumCache;
use super::companion::MAX_COMPANION_BYTES;
use super::landed::LandedSums;
use super::wrong_sized::WrongSized;

use crate::store::{
    checked_results, Hold, RangeChecksums, StoreCalls, StoreError, TargetRange, TargetRead,
};

/// Where the store writes a row of the layer lent in a stage's loan.
pub(crate) trait RowTarget {
    /// Plan page `plan_page`'s slice of `component`, as a target of the loan.
    fn row(&self, component: &ComponentLayout, plan_page: usize)
        -> Result<ReadTarget, DeviceError>;
}

/// The landing's own targets: pool slots (host pools) or the stage's own area (device pools).
pub(crate) struct OwnRows<'a> {
    pub(crate) landing: &'a dyn LayerLanding,
    pub(crate) loan: &'a StageLoan,
}

impl RowTarget for OwnRows<'_> {
    fn row(
        &self,
        component: &ComponentLayout,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError> {
        self.landing.target(self.loan, component.id, plan_page)
    }
}

/// The share area of a device stage, as the layer's share layout places rows in it.
pub(crate) struct ShareArea<'a> {
    pub(crate) share: &'a dyn DeviceShare,
    pub(crate) loan: &'a StageLoan,
    pub(crate) layout: &'a StagingLayout,
}

impl RowTarget for ShareArea<'_> {
    fn row(
        &self,
        component: &ComponentLayout,
        plan_page: usize,
    ) -> Result<ReadTarget, DeviceError> {
        let off = self
            .layout
            .offset(component.id, plan_page)
            .ok_or(row_not_staged(component.id))?;
        self.share
            .share_target(self.loan, off, component.page_layer_bytes as usize)
    }
}

fn row_not_staged(c: ComponentId) -> DeviceError {
    DeviceError::OutOfPool {
        component: c.0,
        layer: u32::MAX,
        slot: u32::MAX,
        reason: "row not staged at this layer",
    }
}

/// One planned component and its object keys, in plan page order (built once per batch).
pub(crate) struct ComponentKeys {
    pub(crate) layout: ComponentLayout,
    pub(crate) keys: Vec<String>,
}

/// A store error as a batch failure at `layer` on plan page `page`.
pub(crate) fn store_failure(
    batch: BatchId,
    layer: Option<u32>,
    pages: Vec<u32>,
    e: &StoreError,
) -> KvLoadError {
    KvLoadError::Store {
        batch: Some(batch),
        layer,
        pages: pages.into(),
        kind: e.failure(),
        detail: kv_loader::Cause::from_error(e.clone()),
    }
}

/// One part of a group read: `components` at plan pages `pages`, the row of layer
/// `group.start + i` landing where `targets[i]` (that layer's loan) says.
pub(crate) struct ReadPart<'k, 't> {
    /// The components are the batch's shared ones (else its own), for the landed checksums.
    pub(crate) shared: bool,
    pub(crate) components: &'k [ComponentKeys],
    pub(crate) pages: Range<usize>,
    pub(crate) targets: Vec<&'t dyn RowTarget>,
}

/// A group read, planned: per object, its ranges, the bytes it must return and its plan page.
pub(crate) struct GroupReads<'k> {
    reads: Vec<TargetRead<'k>>,
    expected: Vec<u64>,
    pages: Vec<u32>,
    /// Per object, where its ranges' landed checksums go.
    rows: Vec<RowsOf>,
    /// One layer's landed checksums with none set, sized for the parts' components and pages.
    no_sums: LandedSums,
}

impl GroupReads<'_> {
    /// Bytes the planned reads ask for, all told.
    pub(crate) fn expected_bytes(&self) -> u64 {
        self.expected.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// Which rows one planned object's ranges are: its component (shared or own, its index) and,
/// per range, the layer's place in the group.
struct RowsOf {
    shared: bool,
    comp: usize,
    layers: SmallVec<[u32; 2]>,
}

/// A group read done: the bytes read, and per layer of the group the checksums the store
/// took of its rows as they landed (empty when not asked for).
pub(crate) struct GroupRead {
    pub(crate) bytes: u64,
    pub(crate) landed: Vec<LandedSums>,
    /// A store call was made (false: this rank had nothing to read in the group).
    pub(crate) called: bool,
}

impl GroupReads<'_> {
    /// Per layer of a group of `layers`, the landed checksums in `sums` (per planned object,
    /// per range, as the store gave them) placed at their rows.
    fn landed(&self, layers: usize, sums: &[RangeChecksums]) -> Vec<LandedSums> {
        // None taken (a store without staging, or one keeping the trait's default): no tables.
        if sums.iter().flatten().all(Option::is_none) {
            return Vec::new();
        }
        let mut out = vec![self.no_sums.clone(); layers];
        for ((rows, &page), sums) in self.rows.iter().zip(&self.pages).zip(sums) {
            for (&i, sum) in rows.layers.iter().zip(sums) {
                if let (Some(l), Some(sum)) = (out.get_mut(i as usize), sum) {
                    l.set(rows.shared, rows.comp, page as usize, *sum);
                }
            }
        }
        out
    }
}

/// Reads groups of layers of one batch on one rank.
#[derive(Clone, Copy)]
pub(crate) struct LayerReader<'a> {
    pub(crate) calls: &'a StoreCalls,
    pub(crate) batch: BatchId,
    /// Store calls one group's reads are split into, run at once (1: one call).
    pub(crate) parallelism: usize,
    /// What keeps the batch's memory alive (and away from others) while a read that
    /// outlived its deadline may still write it.
    pub(crate) hold: &'a Hold,
    /// When every store call of this read must have returned.
    pub(crate) deadline: Instant,
}

impl LayerReader<'_> {
    /// Plans layers `group` of every part as one batched ranged read: per object, one range
    /// per layer of the group it carries (consecutive in the object, so a store merges them),
    /// each into that layer's target.
    pub(crate) fn plan<'k>(
        &self,
        parts: &[ReadPart<'k, '_>],
        group: Range<u32>,
    ) -> Result<GroupReads<'k>, KvLoadError> {
        let mut planned = GroupReads {
            reads: Vec::new(),
            expected: Vec::new(),
            pages: Vec::new(),
            rows: Vec::new(),
            no_sums: LandedSums::default(),
        };
        let (mut pages, mut own, mut shared) = (0, 0, 0);
        for part in parts {
            if part.targets.len() < group.len() {
                return Err(KvLoadError::internal(
                    self.batch,
                    format!(
                        "{} targets for a group of {} layers",
                        part.targets.len(),
                        group.len()
                    ),
                ));
            }
            pages = pages.max(part.pages.end);
            let comps = if part.shared { &mut shared } else { &mut own };
            *comps = (*comps).max(part.components.len());
            for (ci, comp) in part.components.iter().enumerate() {
                let layers: Vec<(usize, u64)> = group
                    .clone()
                    .enumerate()
                    .filter_map(|(i, l)| comp.layout.layer_range(l).map(|r| (i, r.start)))
                    .collect();
                if layers.is_empty() {
                    continue;
                }
                for page in part.pages.clone() {
                    let mut ranges = SmallVec::with_capacity(layers.len());
                    let mut want = 0u64;
                    for &(i, offset) in &layers {
                        let target = part.targets[i]
                            .row(&comp.layout, page)
                            .map_err(KvLoadError::from)?;
                        want += target.len() as u64;
                        ranges.push(TargetRange { target, offset });
                    }
                    planned.expected.push(want);
                    planned.pages.push(page as u32);
                    planned.rows.push(RowsOf {
                        shared: part.shared,
                        comp: ci,
                        layers: layers.iter().map(|&(i, _)| i as u32).collect(),
                    });
                    planned.reads.push(TargetRead {
                        key: &comp.keys[page],
                        ranges,
                    });
                }
            }
        }
        planned.no_sums = LandedSums::new(pages, own, shared);
        Ok(planned)
    }

    /// Reads a planned group into the targets of `loans` (which the store call owns until it
    /// returns, each keeping the batch's memory hold), `parallelism` calls at once. Returns
    /// the bytes read, and with `hash` the checksums the store took of the rows as they
    /// landed. Any failed or short key fails the whole group, at its first layer, naming the
    /// pages.
    pub(crate) fn read(
        &self,
        planned: GroupReads<'_>,
        mut loans: Vec<StageLoan>,
        group: Range<u32>,
        hash: bool,
    ) -> Result<GroupRead, KvLoadError> {
        if planned.reads.is_empty() {
            return Ok(GroupRead {
                bytes: 0,
                landed: Vec::new(),
                called: false,
            });
        }
        for loan in &mut loans {
            loan.keep(self.hold.clone());
        }
        let (results, sums) = if hash {
            let r = self.calls.read_targets_checksummed(
                &planned.reads,
                loans,
                self.parallelism,
                self.deadline,
            );
            (r.results, r.sums)
        } else {
            let r = self
                .calls
                .read_targets(&planned.reads, loans, self.parallelism, self.deadline);
            (r, Vec::new())
        };
        let keys: Vec<&str> = planned.reads.iter().map(|r| r.key).collect();
        let results = checked_results(&keys, results);
        let mut total = 0;
        let mut failed: Vec<u32> = Vec::new();
        let mut first: Option<KvLoadError> = None;
        let outcomes = results.iter().zip(&planned.expected).zip(&planned.pages);
        for (((r, want), &page), key) in outcomes.zip(&keys) {
            match r {
                Ok(n) if n == want => total += n,
                Ok(n) => {
                    failed.push(page);
                    first.get_or_insert_with(|| KvLoadError::Store {
                        batch: Some(self.batch),
                        layer: Some(group.start),
                        pages: Arc::from(Vec::new()),
                        kind: StoreFailure::ShortRead,
                        detail: format!(
                            "`{key}`: short read: {n} of {want} bytes (layers {group:?})"
                        )
                        .into(),
                    });
                }
                Err(e) => {
                    failed.push(page);
                    first.get_or_insert_with(|| {
                        store_failure(self.batch, Some(group.start), Vec::new(), e)
                    });
                }
            }
        }
        if let Some(mut e) = first {
            if let KvLoadError::Store { pages, .. } = &mut e {
                failed.sort_unstable();
                failed.dedup();
                *pages = failed.into();
            }
            return Err(e);
        }
        let landed = if hash {
            planned.landed(group.len(), &sums)
        } else {
            Vec::new()
        };
        Ok(GroupRead {
            bytes: total,
            landed,
            called: true,
        })
    }

    /// Checks that the objects of `components` at plan pages `pages` hold exactly the bytes
    /// the geometry expects (see [`check_object_sizes`]).
    pub(crate) fn verify_sizes(
        &self,
        components: &[ComponentKeys],
        pages: Range<usize>,
        (kept, wrong): (&ChecksumCache, &WrongSized),
        on_wrong: WrongSizeAction,
    ) -> Result<(), KvLoadError> {
        check_object_sizes(
            self.calls,
            (kept, wrong),
            self.batch,
            on_wrong,
            components,
            pages,
            self.deadline,
        )
    }
}

/// What a size check does with an object of the wrong size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WrongSizeAction {
    /// Discard it, so the next save writes it again: its key is in the model's namespace
    /// (`Namespace::Model`), which names the geometry, so every writer of the key agrees on
    /// its bytes and a wrong size is a broken object.
    Discard,
    /// Discard it only if it is a broken object of kvlink's (its checksum companion is there
    /// and does not describe it): its key is in a namespace other writers may share
    /// (SGLang's, or any `Namespace::Exact`), and one whose geometry differs writes other
    /// sizes: SGLang with MTP draft layers packed after the model's (no companion), or
    /// another kvlink deployment (another TP size, another indexer layer count) whose
    /// companion describes its object whole. Removing theirs destroyed their cache, under
    /// their own reads too (the removal is forced), and the two deployments took turns
    /// removing each other's; it is left in place, and the batch fails all the same.
    DiscardOwn,
}

impl WrongSizeAction {
    /// The action for objects under `namespace`.
    pub(crate) fn under(namespace: &Namespace) -> Self {
        match namespace {
            Namespace::Model => WrongSizeAction::Discard,
            Namespace::Exact(_) => WrongSizeAction::DiscardOwn,
        }
    }

    /// Whether `key`, found at `actual` bytes (the wrong size), is to be discarded. Where
    /// only kvlink's broken objects go, its companion is asked for (its size, then a read at
    /// it): none, one that describes `actual` bytes whole (another kvlink deployment's
    /// object of another geometry), a newer writer's (a format this version cannot read), or
    /// one whose state cannot be told (a store error) spares the object.
    fn discards(self, calls: &StoreCalls, key: &str, actual: u64, deadline: Instant) -> bool {
        match self {
            WrongSizeAction::Discard => true,
            WrongSizeAction::DiscardOwn => {
                let companion = checksum_key(key);
                let size = match calls.object_size(&[companion.as_str()], deadline).pop() {
                    Some(Ok(size)) => size,
                    _ => return false,
                };
                if size > MAX_COMPANION_BYTES {
                    return true;
                }
                let read =
                    calls.read_whole_owned(&[companion.as_str()], &[size as usize], deadline);
                match read.into_iter().next() {
                    Some(Ok(bytes)) => match ObjectChecksums::decode(&bytes) {
                        // Another deployment's whole object (its geometry), or a newer
                        // writer's companion this version cannot read: left in place (the
                        // caller says so).
                        Ok(sums) => !describes(&sums, actual),
                        Err(kv_geometry::ChecksumError::Unsupported { .. }) => false,
                        Err(_) => true,
                    },
                    _ => false,
                }
            }
        }
    }
}

/// Whether `sums` describe an object of `bytes` bytes whole (its layers end to end).
fn describes(sums: &ObjectChecksums, bytes: u64) -> bool {
    (sums.sums.len() as u64).checked_mul(sums.layer_bytes) == Some(bytes)
}

/// Checks that the objects of `components` at plan pages `pages` hold exactly the bytes the
/// geometry expects; a wrong one fails the batch with [`PlanError::ObjectSize`] and, where
/// `on_wrong` says so, is discarded (the next save writes it again), its kept checksums with
/// it, recorded in `wrong`. An object gone that this batch discarded for its size (another
/// check of the batch got there first) fails with that same error.
pub(crate) fn check_object_sizes(
    calls: &StoreCalls,
    (kept, wrong): (&ChecksumCache, &WrongSized),
    batch: BatchId,
    on_wrong: WrongSizeAction,
    components: &[ComponentKeys],
    pages: Range<usize>,
    deadline: Instant,
) -> Result<(), KvLoadError> {
    for comp in components {
        let Some(keys) = comp.keys.get(pages.clone()) else {
            continue;
        };
        let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
        let expected = comp.layout.object_bytes();
        let sizes = calls.object_size(&keys, deadline);
        for (i, r) in sizes.into_iter().enumerate() {
            match r {
                Ok(actual) if actual == expected => {}
                Ok(actual) => {
                    let error = KvLoadError::InvalidPlan {
                        batch,
                        reason: PlanError::ObjectSize {
                            key: keys[i].to_string(),
                            expected,
                            actual,
                        },
                    };
                    kept.remove(keys[i]);
                    if !on_wrong.discards(calls, keys[i], actual, deadline) {
                        tracing::warn!(
                            %batch,
                            key = keys[i],
                            expected,
                            actual,
                            "an object of the wrong size, not a broken one of kvlink's (no \
                             companion, or one that describes it whole or is a newer writer's), \
                             in a namespace other writers may share: left in place (its writer's \
                             geometry may differ, e.g. SGLang with MTP draft layers, or another \
                             kvlink deployment's TP size); the batch fails and its pages are \
                             recomputed"
                        );
                        return Err(error);
                    }
                    // Recorded before the discard: a check that finds it gone knows why.
                    wrong.record(batch, keys[i], &error);
                    super::replace::discard_objects(calls, &[keys[i]], deadline);
                    return Err(error);
                }
                Err(e) => {
                    // Gone because this batch discarded it for its size: that is why.
                    let discarded = (e.failure() == StoreFailure::NotFound)
                        .then(|| wrong.of(batch, keys[i]))
                        .flatten();
                    let page = (pages.start + i) as u32;
                    return Err(
                        discarded.unwrap_or_else(|| store_failure(batch, None, vec![page], &e))
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{no_hold, EmbeddedStore, SourcePut};
    use kv_device::SaveSource;
    use kv_geometry::{KvGeometry, ModelKvSpec, ObjectChecksums};
    use std::time::Duration;

    #[test]
    fn a_wrong_sized_object_goes_with_its_kept_checksums() {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let layout = g.component_by_name("indexer").unwrap().clone();
        let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(4 << 20)));
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        let keys = vec!["good".to_string(), "short".to_string()];
        let right = vec![7u8; layout.object_bytes() as usize];
        let kept = ChecksumCache::new(8);
        for (key, len) in [("good", right.len()), ("short", right.len() - 1)] {
            let put = SourcePut {
                key,
                parts: [SaveSource::from_bytes(Arc::new(right.clone()), 0..len).unwrap()]
                    .into_iter()
                    .collect(),
            };
            assert!(calls.put(&[put], no_hold(), soon())[0].is_ok());
            let sums = ObjectChecksums::of_object(&right, layout.page_layer_bytes).unwrap();
            kept.insert(key, Arc::new(sums));
        }
        let comp = ComponentKeys { layout, keys };
        let wrong = WrongSized::default();
        let r = check_object_sizes(
            &calls,
            (&kept, &wrong),
            BatchId(1),
            WrongSizeAction::Discard,
            std::slice::from_ref(&comp),
            0..2,
            soon(),
        );
        assert!(
            matches!(
                r,
                Err(KvLoadError::InvalidPlan {
                    reason: PlanError::ObjectSize { ref key, .. },
                    ..
                }) if key == "short"
            ),
            "{r:?}"
        );
        // Whichever rank found it, the object and what it kept of it are gone; the good one
        // stays.
        assert!(kept.get("short").is_none());
        assert!(kept.get("good").is_some());
        // Another check of the same batch asks after the discard: the object is gone, and it
        // fails with the same wrong size, not NotFound; another batch hears NotFound.
        let again = |batch| {
            let comps = std::slice::from_ref(&comp);
            check_object_sizes(
                &calls,
                (&kept, &wrong),
                batch,
                WrongSizeAction::Discard,
                comps,
                1..2,
                soon(),
            )
        };
        assert!(matches!(
            again(BatchId(1)),
            Err(KvLoadError::InvalidPlan {
                reason: PlanError::ObjectSize { ref key, .. },
                ..
            }) if key == "short"
        ));
        assert!(matches!(
            again(BatchId(2)),
            Err(KvLoadError::Store {
                kind: StoreFailure::NotFound,
                ..
            })
        ));
    }
}
