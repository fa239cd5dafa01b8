//! The plan gate: before a batch shares any byte, every rank checks that all ranks hold the
//! same logical plan (design.md §4.3). Any difference and the batch falls back to every rank
//! reading its own copy.
//!
//! # The digest
//! [`plan_digest`] is XXH3-128 (seeded with [`PLAN_DIGEST_SEED`]) over
//! [`LogicalPlan::write_canonical`]'s encoding: version, batch id, components, then every
//! request's id and page hashes, integers little-endian, variable parts length-prefixed. The
//! encoding is injective, so two plans digest alike only through a hash collision.
//!
//! Why not SHA-256: the ranks of a TP group are one server's threads or processes, trusted by
//! each other; the gate catches *accidental* divergence (different adoption of pages, allocator
//! drift), not forgery, so collision resistance against an adversary buys nothing. What it
//! needs is that different plans almost surely differ in digest, which a 128-bit XXH3 gives
//! (every page hash in the plan is itself a SHA-256 output, so the input is already
//! high-entropy), and speed: the gate sits on the scheduler's path for every batch. Measured
//! on this project's 2-core development machine (which has the SHA-NI instructions), for a
//! 512K-token plan (8192 pages of 32-byte hashes, 262 KB encoded): SHA-256 alone takes about
//! 190 µs (several times that on a CPU without SHA-NI), XXH3-128 alone about 16 µs, and
//! [`plan_digest`] as a whole, encoding callbacks included, 55–90 µs
//! (`cargo bench --bench plan_digest`).

use std::time::Instant;

use kv_loader::LogicalPlan;
use xxhash_rust::xxh3::Xxh3;

use crate::{Collective, CollectiveError};

/// Seed of the plan digest; changing the digest's definition changes the seed, so ranks that
/// run different versions disagree (and fall back) rather than compare unlike digests.
pub const PLAN_DIGEST_SEED: u64 = 0x6b76_6c69_6e6b_0001; // "kvlink" v1

/// Pieces of the canonical encoding are gathered into blocks of this many bytes before they
/// reach the hasher: XXH3's streaming update costs more per call than per byte, and the
/// encoding comes in 32-byte pieces.
const BLOCK: usize = 4096;

/// The 128-bit digest of `plan`'s canonical encoding, as 16 little-endian bytes.
///
/// ```
/// use kv_geometry::{ComponentId, PageHash};
/// use kv_loader::{BatchId, LogicalPlan, RequestPages};
/// use dedup_broadcast::plan_digest;
/// let plan = |page: u8| LogicalPlan {
///     batch: BatchId(1),
///     requests: vec![RequestPages { request: "r".into(), pages: vec![PageHash([page; 32])] }],
///     components: vec![ComponentId(0)],
/// };
/// assert_eq!(plan_digest(&plan(1)), plan_digest(&plan(1)));
/// assert_ne!(plan_digest(&plan(1)), plan_digest(&plan(2)));
/// ```
pub fn plan_digest(plan: &LogicalPlan) -> [u8; 16] {
    let mut hasher = Xxh3::with_seed(PLAN_DIGEST_SEED);
    let mut block = [0u8; BLOCK];
    let mut fill = 0usize;
    plan.write_canonical(&mut |piece: &[u8]| {
        if let Some(dst) = block.get_mut(fill..fill + piece.len()) {
            dst.copy_from_slice(piece);
            fill += piece.len();
            return;
        }
        // The block is full: hash it, then start the next one with this piece (or hash a
        // piece longer than a block straight away). XXH3's streaming state makes the digest
        // independent of where the blocks break.
        hasher.update(&block[..fill]);
        fill = 0;
        match block.get_mut(..piece.len()) {
            Some(dst) => {
                dst.copy_from_slice(piece);
                fill = piece.len();
            }
            None => hasher.update(piece),
        }
    });
    hasher.update(&block[..fill]);
    hasher.digest128().to_le_bytes()
}

/// What the gate found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateVerdict {
    /// Every rank holds the same plan: the batch may share.
    Agreed,
    /// Some ranks hold a different plan than rank 0: the batch runs `AllRanks`.
    Mismatch {
        /// Ranks whose digest differs from rank 0's, in order.
        differing: Vec<u32>,
    },
}

impl GateVerdict {
    /// True for [`GateVerdict::Agreed`].
    pub fn agreed(&self) -> bool {
        matches!(self, GateVerdict::Agreed)
    }
}

/// Gathers every rank's digest of `plan` and compares them with rank 0's. Every rank issues
/// one [`Collective::all_gather_bytes`] (also for an empty plan, so the group's operations
/// stay matched) and every rank gets the same verdict. A mismatch is logged as a warning that
/// names the differing ranks.
pub fn check_plan(
    coll: &dyn Collective,
    plan: &LogicalPlan,
    deadline: Instant,
) -> Result<GateVerdict, CollectiveError> {
    let verdict = check_digest(coll, &plan_digest(plan), deadline)?;
    if let GateVerdict::Mismatch { differing } = &verdict {
        tracing::warn!(
            rank = coll.rank(),
            batch = plan.batch.0,
            ?differing,
            "logical plans differ across TP ranks; this batch falls back to every rank reading its own copy"
        );
    }
    Ok(verdict)
}

/// [`check_plan`] for a digest computed beforehand (no warning is logged).
pub fn check_digest(
    coll: &dyn Collective,
    digest: &[u8; 16],
    deadline: Instant,
) -> Result<GateVerdict, CollectiveError> {
    let all = coll.all_gather_bytes(digest, deadline)?;
    let Some(reference) = all.first() else {
        return Ok(GateVerdict::Agreed);
    };
    let differing: Vec<u32> = all
        .iter()
        .enumerate()
        .filter(|(_, d)| *d != reference)
        .map(|(r, _)| r as u32)
        .collect();
    Ok(if differing.is_empty() {
        GateVerdict::Agreed
    } else {
        GateVerdict::Mismatch { differing }
    })
}
