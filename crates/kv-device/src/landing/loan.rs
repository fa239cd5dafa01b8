//! What a landing lends a store read: a [`StageLoan`] (one stage's memory, for one store call)
//! and the [`ReadTarget`]s inside it (one row each), the typed regions the store writes into.
//!
//! A loan vouches, in its type, for what an `unsafe` store read needs:
//! - **allocated**: it owns what keeps the stage's memory allocated (the pool, or the staging
//!   pool behind the lease), so a store call that holds it past its deadline (a stray worker)
//!   never writes freed memory, whoever drops what meanwhile;
//! - **not re-lent**: while it lives the landing refuses everything else that touches the
//!   stage's memory ([`DeviceError::Lent`]): reopening the stage for another layer, borrowing
//!   its bytes for a check, sharing, uploading or landing it; a staged landing dropped while a
//!   loan is out quarantines its lease for good instead of handing it to another batch;
//! - **unique**: a stage has at most one loan at a time, and a loan is not `Clone`, so the
//!   call that owns it is the only writer. A target names its loan; a store call checks that
//!   it owns the loan of every target it writes and that no two targets overlap.
//!
//! The slots of a host pool are the engine's between batches: a landing cannot see a later
//! batch planned into the same slots. What keeps those slots from being handed back while a
//! loan is out is what the loan [`keep`](StageLoan::keep)s: the linker's batch hold (which
//! holds the batch's outcome back until every call that may write its slots has returned).

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::{DeviceError, HostRow};

/// Whether one stage is lent (shared between the landing and the stage's loan).
#[derive(Debug, Default)]
pub(crate) struct StageLent(Arc<AtomicBool>);

impl StageLent {
    /// Marks the stage lent; refuses a stage already lent.
    pub(crate) fn lend(&self) -> Result<Arc<AtomicBool>, DeviceError> {
        self.0
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .map_err(|_| DeviceError::Lent("lending a stage again"))?;
        Ok(self.0.clone())
    }

    /// `Ok` when no loan of the stage is out: whatever a store call wrote is then visible here.
    pub(crate) fn check(&self, what: &'static str) -> Result<(), DeviceError> {
        if self.0.load(Ordering::Acquire) {
            return Err(DeviceError::Lent(what));
        }
        Ok(())
    }

    /// True while a loan of the stage is out.
    pub(crate) fn is_lent(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }

    /// The flag itself (cleared when the stage's loan drops), for whoever must wait for it.
    pub(crate) fn flag(&self) -> Arc<AtomicBool> {
        self.0.clone()
    }
}

/// A fresh loan id (what ties targets to their loan).
fn next_loan_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// One stage's memory lent to one store read (see the module docs): minted by the landing
/// ([`LayerLanding::lend`](crate::LayerLanding::lend)), it mints the stage's
/// [`ReadTarget`]s (through the landing), and is moved into the store call that writes them;
/// the stage is the landing's again when the loan drops.
///
/// ```
/// use std::sync::Arc;
/// use kv_device::{BatchShape, DeviceError, DirectLanding, HostKvPool, KvPool, LayerLanding};
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let pool: Arc<dyn KvPool> = Arc::new(HostKvPool::new(g, 8).unwrap());
/// let shape = BatchShape::own_only(vec![ComponentId(0)]);
/// let mut landing = DirectLanding::new(pool.clone(), vec![5, 2].into(), shape).unwrap();
/// let mut stages = landing.take_stages();
/// let deadline = kv_loader::deadline_after(std::time::Duration::from_secs(1));
/// landing.open(&mut stages[0], 0, deadline).unwrap();
/// let loan = landing.lend(&mut stages[0]).unwrap();
/// let target = landing.target(&loan, ComponentId(0), 1).unwrap();
/// assert!(target.belongs_to(&loan));
/// // While the loan is out, the stage's bytes are the store call's, not the landing's.
/// assert!(matches!(
///     landing.target_bytes(&stages[0], ComponentId(0), 1),
///     Err(DeviceError::Lent(_))
/// ));
/// drop(loan);
/// assert!(landing.target_bytes(&stages[0], ComponentId(0), 1).is_ok());
/// ```
#[must_use = "a loan dropped at once returns its stages unused"]
pub struct StageLoan {
    id: u64,
    landing: u64,
    index: usize,
    layer: u32,
    lent: Arc<AtomicBool>,
    _owner: Arc<dyn Any + Send + Sync>,
    kept: Vec<Arc<dyn Any + Send + Sync>>,
}

impl StageLoan {
    /// A loan of stage `index` (layer `layer`) of landing `landing`, marked in `lent`.
    ///
    /// # Safety
    /// `owner` keeps every byte the landing mints targets of for this loan allocated; the
    /// landing touches none of them (and lends them to no one else) while `lent` is set.
    pub(crate) unsafe fn new(
        landing: u64,
        index: usize,
        layer: u32,
        lent: Arc<AtomicBool>,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Self {
        StageLoan {
            id: next_loan_id(),
            landing,
            index,
            layer,
            lent,
            _owner: owner,
            kept: Vec::new(),
        }
    }

    /// The loan's id (what its targets name).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The layer open in the lent stage.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Keeps `hold` alive as long as the loan (e.g. what holds a batch's outcome back until
    /// every call that may write its slots has returned).
    pub fn keep(&mut self, hold: Arc<dyn Any + Send + Sync>) {
        self.kept.push(hold);
    }

    /// Writes `bytes` (exactly the target's length) into `target`, the way a store read
    /// would: for a test or a backend that fills a stage itself. Safe: the loan is the only
    /// way to the stage's memory while it lives (its landing holds the layer in this stage
    /// alone, and a direct landing's slots are claimed for writing: no save reads them, no
    /// other landing writes them), and `&mut self` makes this the only writer.
    pub fn write(&mut self, target: ReadTarget, bytes: &[u8]) -> Result<(), DeviceError> {
        if !target.belongs_to(self) {
            return Err(DeviceError::InvalidStage("a target of another loan"));
        }
        if bytes.len() != target.len {
            return Err(DeviceError::InvalidStage(
                "bytes of another length than the target",
            ));
        }
        // SAFETY: the target was minted in this loan (checked), so its bytes lie in memory the
        // loan keeps allocated and that nothing but its holder touches while it lives; the
        // holder is borrowed exclusively here, and `bytes` (a shared borrow) cannot be those
        // bytes' only alias being written: nothing else may write them meanwhile.
        unsafe {
            std::ptr::copy(bytes.as_ptr(), target.addr as *mut u8, bytes.len());
        }
        Ok(())
    }

    /// The stage of `landing` this loan lends, checked.
    pub(crate) fn stage_of(&self, landing: u64) -> Result<(usize, u32), DeviceError> {
        if self.landing != landing {
            return Err(DeviceError::InvalidStage("a loan of another landing"));
        }
        Ok((self.index, self.layer))
    }

    /// A target of `len` bytes at `addr` in this loan.
    ///
    /// # Safety
    /// The bytes lie in the memory the loan vouches for (see [`new`](Self::new)).
    pub(crate) unsafe fn target(&self, addr: usize, len: usize) -> ReadTarget {
        ReadTarget {
            addr,
            len,
            loan: self.id,
        }
    }
}

impl Drop for StageLoan {
    fn drop(&mut self) {
        // Release: what the store wrote through this loan is visible to the landing's next
        // (Acquire) check of the stage. The owner and holds drop after this.
        self.lent.store(false, Ordering::Release);
    }
}

impl std::fmt::Debug for StageLoan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageLoan")
            .field("id", &self.id)
            .field("stage", &self.index)
            .field("layer", &self.layer)
            .finish_non_exhaustive()
    }
}

/// One row of a [`StageLoan`]: `len` bytes at host address `addr` that a store read writes.
/// Only a landing mints one (inside a loan it made); it is written only by a store call that
/// owns its loan, and is plain data otherwise (a stale target is refused by the call: its
/// loan is not among the call's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadTarget {
    addr: usize,
    len: usize,
    loan: u64,
}

impl ReadTarget {
    /// First byte (host address).
    pub fn addr(&self) -> usize {
        self.addr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a target of no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// One past the last byte (saturating).
    pub fn end(&self) -> usize {
        self.row().end()
    }

    /// Its bytes as a plain row.
    pub fn row(&self) -> HostRow {
        HostRow {
            addr: self.addr,
            len: self.len,
        }
    }

    /// The id of the loan it was minted in.
    pub fn loan(&self) -> u64 {
        self.loan
    }

    /// True when it was minted in `loan`.
    pub fn belongs_to(&self, loan: &StageLoan) -> bool {
        self.loan == loan.id
    }

    /// True when the two targets share at least one byte.
    pub fn overlaps(&self, other: &ReadTarget) -> bool {
        self.row().overlaps(&other.row())
    }
}

/// The first two of `targets` that share a byte, if any (sorts by address: `n log n` over the
/// targets, nothing per byte).
///
/// ```
/// use kv_device::{first_overlap, ReadTarget};
/// let none: [ReadTarget; 0] = [];
/// assert_eq!(first_overlap(&none), None);
/// ```
pub fn first_overlap(targets: &[ReadTarget]) -> Option<(ReadTarget, ReadTarget)> {
    crate::first_overlap_by(targets, ReadTarget::row)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loan(lent: &StageLent) -> StageLoan {
        // SAFETY: no target of this loan is ever written.
        unsafe { StageLoan::new(1, 0, 0, lent.lend().unwrap(), Arc::new(())) }
    }

    #[test]
    fn a_stage_has_one_loan_at_a_time_and_is_free_when_it_drops() {
        let lent = StageLent::default();
        let first = loan(&lent);
        assert!(matches!(lent.lend(), Err(DeviceError::Lent(_))));
        assert!(lent.check("a check").is_err());
        drop(first);
        assert!(lent.check("a check").is_ok());
        let _again = loan(&lent);
    }

    #[test]
    fn overlapping_targets_are_found_whatever_their_order() {
        let lent = StageLent::default();
        let l = loan(&lent);
        // SAFETY: plain numbers, never written through.
        let t = |addr, len| unsafe { l.target(addr, len) };
        assert_eq!(first_overlap(&[t(100, 10), t(110, 10), t(90, 10)]), None);
        assert_eq!(
            first_overlap(&[t(200, 8), t(100, 10), t(109, 4)]),
            Some((t(100, 10), t(109, 4)))
        );
        assert_eq!(first_overlap(&[t(100, 0), t(100, 4)]), None);
        assert!(first_overlap(&[t(100, 4), t(100, 4)]).is_some());
    }
}
