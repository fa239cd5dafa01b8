//! Store reads into typed targets: the safe, checked way to read into a landing's memory.
//! [`StoreCalls::read_targets`] takes the [`StageLoan`]s the targets were minted in (by
//! value: the call, and a worker that outlives its deadline, owns them until the store
//! returns), refuses targets it cannot vouch for, and only then makes the `unsafe`
//! [`KvStore::get_ranges`](super::KvStore::get_ranges) call.

use std::sync::Arc;
use std::time::Instant;

use kv_device::{first_overlap, ReadTarget, StageLoan};
use smallvec::SmallVec;

use super::bounded::{failed_all, unanswered_all, Pending, Unanswered};
use super::{
    checked_results, KvStore, RangeChecksums, RangedGet, ReadRange, StoreCalls, StoreError,
};

/// One range of a read into a typed target: `target.len()` bytes at byte `offset` of the
/// object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TargetRange {
    /// Where the bytes go.
    pub target: ReadTarget,
    /// Byte offset inside the object.
    pub offset: u64,
}

/// A ranged read of one object into typed targets (one range per layer read; usually one).
#[derive(Debug, Clone)]
pub struct TargetRead<'k> {
    /// The object's key.
    pub key: &'k str,
    /// Ranges of it to read.
    pub ranges: SmallVec<[TargetRange; 2]>,
}

impl TargetRead<'_> {
    /// Bytes this read asks for.
    pub fn expected(&self) -> u64 {
        self.ranges.iter().map(|r| r.target.len() as u64).sum()
    }
}

/// Why the call cannot write `reads`' targets, if it cannot: a target whose loan is not among
/// `loans` (stale, or another call's), or two targets that share a byte. Sorting the targets
/// by address is the whole cost (nothing per byte).
pub(crate) fn refusal(reads: &[TargetRead<'_>], loans: &[StageLoan]) -> Option<&'static str> {
    let mut ids: SmallVec<[u64; 16]> = loans.iter().map(StageLoan::id).collect();
    ids.sort_unstable();
    let targets: Vec<ReadTarget> = reads
        .iter()
        .flat_map(|r| r.ranges.iter().map(|x| x.target))
        .collect();
    if targets
        .iter()
        .any(|t| ids.binary_search(&t.loan()).is_err())
    {
        return Some("a target whose loan is not the call's");
    }
    first_overlap(&targets).map(|_| "two targets share bytes")
}

/// One part of a read as its worker owns it: the keys and the raw ranges.
type Part = (Arc<[String]>, Vec<SmallVec<[ReadRange; 2]>>);

fn part(reads: &[TargetRead<'_>]) -> Part {
    let keys: Arc<[String]> = reads.iter().map(|r| r.key.to_owned()).collect();
    let ranges = reads
        .iter()
        .map(|r| {
            r.ranges
                .iter()
                .map(|x| ReadRange {
                    dst: x.target.addr() as *mut u8,
                    len: x.target.len(),
                    offset: x.offset,
                })
                .collect()
        })
        .collect();
    (keys, ranges)
}

impl StoreCalls {
    /// Reads byte ranges of objects into typed targets, as `parallelism` store calls at once
    /// over contiguous parts of `reads` (1: one call), each bounded by `deadline`; per key,
    /// in `reads` order, the bytes read (less than [`TargetRead::expected`] is a short read),
    /// or [`StoreError::Overdue`] for a part still running at `deadline`.
    ///
    /// The call owns `loans` until the store returns, past `deadline` if it hangs: while a
    /// loan lives its landing lends the memory to no one else and keeps it allocated (and so
    /// does whatever the loan [`keep`](StageLoan::keep)s). Every target must be of one of
    /// `loans`, and no two may share a byte; otherwise nothing is read and every key fails
    /// with [`StoreError::InvalidTarget`]. Where the store needs registered memory (RDMA),
    /// the landings' memory must be registered with it ([`KvStore::register`]; the `Linker`
    /// registers its pool and staging memory when it is built).
    ///
    /// ```
    /// use std::sync::Arc;
    /// use std::time::Duration;
    /// use kv_device::{BatchShape, DirectLanding, HostKvPool, KvPool, LayerLanding};
    /// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
    /// use mooncake_linker::store::{EmbeddedStore, StoreCalls, StoreError, TargetRange, TargetRead};
    /// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    /// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 4).unwrap());
    /// let shape = BatchShape::own_only(vec![ComponentId(0)]);
    /// let mut landing = DirectLanding::new(pool, vec![0, 1].into(), shape).unwrap();
    /// let mut stages = landing.take_stages();
    /// let soon = || kv_loader::deadline_after(Duration::from_secs(5));
    /// landing.open(&mut stages[0], 0, soon()).unwrap();
    /// let loan = landing.lend(&mut stages[0]).unwrap();
    /// let row = landing.target(&loan, ComponentId(0), 0).unwrap();
    /// // The same row twice in one read: refused before any store sees it.
    /// let twice = TargetRead {
    ///     key: "k",
    ///     ranges: [row, row].map(|target| TargetRange { target, offset: 0 }).into_iter().collect(),
    /// };
    /// let calls = StoreCalls::new(Arc::new(EmbeddedStore::new(1 << 20)));
    /// let r = calls.read_targets(&[twice], vec![loan], 1, soon());
    /// assert!(matches!(&r[..], [Err(StoreError::InvalidTarget { .. })]));
    /// ```
    pub fn read_targets(
        &self,
        reads: &[TargetRead<'_>],
        loans: Vec<StageLoan>,
        parallelism: usize,
        deadline: Instant,
    ) -> Vec<Result<u64, StoreError>> {
        self.read_targets_with(reads, loans, parallelism, deadline, false)
            .results
    }

    /// [`read_targets`](Self::read_targets), and the checksums the store took of the ranges it
    /// copied itself as they landed ([`KvStore::get_ranges_checksummed`]): per read, per
    /// range, `None` where it took none (hash those targets' bytes to check them) and for a
    /// part past its deadline. The sums of a key that failed mean nothing (a store may have
    /// set some before it failed): a caller reads them only for keys that succeeded.
    ///
    /// [`KvStore::get_ranges_checksummed`]: super::KvStore::get_ranges_checksummed
    pub fn read_targets_checksummed(
        &self,
        reads: &[TargetRead<'_>],
        loans: Vec<StageLoan>,
        parallelism: usize,
        deadline: Instant,
    ) -> TargetReadResults {
        self.read_targets_with(reads, loans, parallelism, deadline, true)
    }

    fn read_targets_with(
        &self,
        reads: &[TargetRead<'_>],
        loans: Vec<StageLoan>,
        parallelism: usize,
        deadline: Instant,
        hash: bool,
    ) -> TargetReadResults {
        if let Some(reason) = refusal(reads, &loans) {
            tracing::error!(reason, "a read's targets were refused");
            return refused(reads, reason);
        }
        if Instant::now() >= deadline {
            // As `StoreCalls::run`: the caller's bound is spent, and the call would only be
            // given up at once, a worker and the loans held until the store answered.
            tracing::warn!(
                call = "get_ranges",
                "a store call's deadline passed before it started: not sent"
            );
            let keys: Vec<String> = reads.iter().map(|r| r.key.to_owned()).collect();
            return TargetReadResults {
                results: unanswered_all(&keys, "get_ranges", &Unanswered::NotStarted),
                sums: reads.iter().map(no_sums).collect(),
            };
        }
        let parts = parallelism.clamp(1, reads.len().max(1));
        let chunk = reads.len().div_ceil(parts).max(1);
        // Every part's worker holds the loans until its store call returned; the last one to
        // let go gives the stages back.
        let loans = Arc::new(loans);
        type Started = Result<Pending<TargetReadResults>, StoreError>;
        /// One part's reads, its keys, and its call.
        type PartCall<'p, 'k> = (&'p [TargetRead<'k>], Arc<[String]>, Started);
        let pending: Vec<PartCall<'_, '_>> = reads
            .chunks(chunk)
            .map(|p| {
                let (keys, ranges) = part(p);
                let mine = keys.clone();
                let loans = loans.clone();
                let started = self.submit(
                    "get_ranges",
                    move |s| {
                        // SAFETY: every destination is a `ReadTarget` of one of `loans`
                        // (checked by `refusal` above), so its bytes lie in memory the loan
                        // keeps allocated and that its landing touches and lends to no one else
                        // while the loan lives (one stage per layer; a direct landing's slots
                        // claimed for writing: no save source reads them, no other landing
                        // writes them); `read_part` holds the loans until the call has
                        // returned, and for good where the store gave up on a transfer. No
                        // two destinations of the whole read share a byte (checked), so the
                        // parts, run at once, write disjoint memory too. Registration, where
                        // the store needs it, is this call's caller's (see its doc).
                        unsafe { read_part(s, &mine, ranges, loans, hash) }
                    },
                    |_, _| {},
                );
                (p, keys, started)
            })
            .collect();
        drop(loans);
        pending
            .into_iter()
            .flat_map(|(p, keys, started)| {
                let results = match started.map(|s| s.wait(deadline)) {
                    Ok(Ok(r)) => return r,
                    Ok(Err(why)) => unanswered_all(&keys, "get_ranges", &why),
                    Err(e) => failed_all(&keys, &e),
                };
                TargetReadResults {
                    sums: p.iter().map(no_sums).collect(),
                    results,
                }
            })
            .collect()
    }
}

/// One `None` checksum per range of `read` (none taken).
fn no_sums(read: &TargetRead<'_>) -> RangeChecksums {
    smallvec::smallvec![None; read.ranges.len()]
}

/// Every read of a call whose targets were refused fails with `reason`.
fn refused(reads: &[TargetRead<'_>], reason: &'static str) -> TargetReadResults {
    reads
        .iter()
        .map(|r| {
            let e = StoreError::InvalidTarget {
                key: r.key.to_owned(),
                reason,
            };
            (Err(e), no_sums(r))
        })
        .collect()
}

/// One part's store call, on a store-call worker: `keys[i]` read at `ranges[i]`, with the
/// checksums the store takes as the ranges land when `hash`. Drops `loans` once the store has
/// returned, or keeps them for good when it gave up on a transfer that may still write their
/// memory.
///
/// # Safety
///
/// For the whole call (for good where a key fails [`StoreError::Abandoned`]), every
/// destination of `ranges` must be valid for writes of its length, neither read nor written by
/// anyone else, and of memory `s` can access (registered with it where it needs that); the
/// loans in `loans` must keep it so while they live (the targets minted in them, checked by
/// [`refusal`]); and no two destinations may share a byte.
unsafe fn read_part(
    s: &dyn KvStore,
    keys: &[String],
    ranges: Vec<SmallVec<[ReadRange; 2]>>,
    loans: Arc<Vec<StageLoan>>,
    hash: bool,
) -> TargetReadResults {
    let gets: Vec<RangedGet<'_>> = keys
        .iter()
        .zip(ranges)
        .map(|(key, ranges)| RangedGet { key, ranges })
        .collect();
    // One entry per read either way (empty ones, which do not allocate, when none are asked
    // for).
    let mut sums: Vec<RangeChecksums> = if hash {
        gets.iter()
            .map(|g| smallvec::smallvec![None; g.ranges.len()])
            .collect()
    } else {
        vec![RangeChecksums::new(); gets.len()]
    };
    // SAFETY: the caller's promise (this function's contract) for every destination; the
    // loans live until the store call has returned (dropped or kept below).
    let r = unsafe {
        if hash {
            s.get_ranges_checksummed(&gets, &mut sums)
        } else {
            s.get_ranges(&gets)
        }
    };
    if r.iter()
        .any(|r| r.as_ref().is_err_and(StoreError::may_still_transfer))
    {
        // The store gave up on a transfer that may still write these targets: their loans
        // (and the batch's memory hold with them) are kept for good, so nothing is handed on
        // or freed.
        let bytes = gets
            .iter()
            .flat_map(|g| g.ranges.iter())
            .map(|r| r.len as u64)
            .sum();
        super::keep_for_good(bytes, "read targets (staging or pool rows)");
        std::mem::forget(loans);
    } else {
        drop(loans);
    }
    let refs: Vec<&str> = keys.iter().map(String::as_str).collect();
    let results = checked_results(&refs, r);
    TargetReadResults { results, sums }
}

/// What [`StoreCalls::read_targets_checksummed`] returns: per read, in order, the bytes read
/// (or the error) and the checksums the store took of its ranges as they landed.
#[derive(Debug, Default)]
pub struct TargetReadResults {
    /// Per read, the bytes read (less than [`TargetRead::expected`] is a short read).
    pub results: Vec<Result<u64, StoreError>>,
    /// Per read, per range: the checksum the store took of its bytes as they landed, if any.
    pub sums: Vec<RangeChecksums>,
}

impl IntoIterator for TargetReadResults {
    type Item = (Result<u64, StoreError>, RangeChecksums);
    type IntoIter = std::iter::Zip<
        std::vec::IntoIter<Result<u64, StoreError>>,
        std::vec::IntoIter<RangeChecksums>,
    >;

    fn into_iter(self) -> Self::IntoIter {
        self.results.into_iter().zip(self.sums)
    }
}

impl FromIterator<(Result<u64, StoreError>, RangeChecksums)> for TargetReadResults {
    fn from_iter<I: IntoIterator<Item = (Result<u64, StoreError>, RangeChecksums)>>(
        iter: I,
    ) -> Self {
        let (results, sums) = iter.into_iter().unzip();
        TargetReadResults { results, sums }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use kv_device::{BatchShape, DirectLanding, HostKvPool, KvPool, LayerLanding};
    use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};

    use super::*;
    use crate::store::{EmbeddedStore, KvStore};

    fn read<'k>(key: &'k str, targets: &[ReadTarget]) -> TargetRead<'k> {
        TargetRead {
            key,
            ranges: targets
                .iter()
                .map(|&target| TargetRange { target, offset: 0 })
                .collect(),
        }
    }

    /// A direct landing of GLM-5.2's first component into slots 0 and 1 of a host pool, its
    /// stages, the first open for layer 0.
    fn landing_with_layer_0_open() -> (DirectLanding, Vec<kv_device::LayerStage>) {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 4).unwrap());
        let shape = BatchShape::own_only(vec![ComponentId(0)]);
        let mut landing = DirectLanding::new(pool, vec![0, 1].into(), shape).unwrap();
        let mut stages = landing.take_stages();
        let soon = kv_loader::deadline_after(Duration::from_secs(5));
        landing.open(&mut stages[0], 0, soon).unwrap();
        (landing, stages)
    }

    /// A read whose deadline passed before it started is not sent (as every other bounded
    /// call): before, it went to the store anyway and was given up at once, a worker and the
    /// loans held until the store answered (against a hung store, one more worker each time).
    #[test]
    fn a_read_past_its_deadline_is_not_sent() {
        use crate::store::faulty::{Fault, FaultRule, FaultyStore, Stall};
        let (landing, mut stages) = landing_with_layer_0_open();
        let stall = Stall::new();
        let faulty = Arc::new(FaultyStore::new(Arc::new(EmbeddedStore::new(1 << 22))));
        faulty.inject(FaultRule::default(), Fault::Stall(stall.clone()));
        let calls = StoreCalls::new(faulty.clone() as Arc<dyn KvStore>);
        let loan = landing.lend(&mut stages[0]).unwrap();
        let a = landing.target(&loan, ComponentId(0), 0).unwrap();
        let t0 = Instant::now();
        let passed = t0.checked_sub(Duration::from_millis(1)).unwrap_or(t0);
        let r = calls.read_targets(&[read("x", &[a])], vec![loan], 1, passed);
        assert!(
            matches!(&r[..], [Err(StoreError::RpcTimeout { .. })]),
            "{r:?}"
        );
        assert_eq!(calls.workers(), 0, "nothing went to the store");
        assert_eq!(stall.hits(), 0);
        stall.release();
    }

    #[test]
    fn overlapping_or_foreign_targets_are_refused_and_nothing_is_written() {
        let (landing, mut stages) = landing_with_layer_0_open();
        let soon = || kv_loader::deadline_after(Duration::from_secs(5));
        landing.open(&mut stages[1], 1, soon()).unwrap();
        let store = Arc::new(EmbeddedStore::new(1 << 22));
        let calls = StoreCalls::new(store.clone() as Arc<dyn KvStore>);
        // Two reads of one row, in two objects: refused, whatever the order.
        let loan = landing.lend(&mut stages[0]).unwrap();
        let a = landing.target(&loan, ComponentId(0), 0).unwrap();
        let b = landing.target(&loan, ComponentId(0), 1).unwrap();
        let r = calls.read_targets(
            &[read("x", &[b]), read("y", &[a, b])],
            vec![loan],
            2,
            soon(),
        );
        assert!(
            r.iter().all(|r| matches!(
                r,
                Err(StoreError::InvalidTarget {
                    reason: "two targets share bytes",
                    ..
                })
            )),
            "{r:?}"
        );
        // A target of a loan the call does not own (a stale one: that loan has gone).
        let other = landing.lend(&mut stages[1]).unwrap();
        let r = calls.read_targets(&[read("x", &[a])], vec![other], 1, soon());
        assert!(matches!(
            &r[..],
            [Err(StoreError::InvalidTarget {
                reason: "a target whose loan is not the call's",
                ..
            })]
        ));
        // Distinct targets of the call's own loans reach the store (which lacks the keys).
        let loan = landing.lend(&mut stages[0]).unwrap();
        let a = landing.target(&loan, ComponentId(0), 0).unwrap();
        let r = calls.read_targets(&[read("x", &[a])], vec![loan], 1, soon());
        assert!(
            matches!(&r[..], [Err(StoreError::NotFound { .. })]),
            "{r:?}"
        );
        // And the stage is the landing's again once the call returned.
        assert!(landing.target_bytes(&stages[0], ComponentId(0), 0).is_ok());
    }
}
