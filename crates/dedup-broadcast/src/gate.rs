//! The plan gate: before a batch shares any byte, every rank checks that all ranks hold the
//! same logical plan (docs/architecture.md, "Sharing among TP ranks"). Any difference and
//! the batch falls back to every rank reading its own copy.
//!
//! # The digest
//! [`plan_digest`] is XXH3-128 (seeded with [`PLAN_DIGEST_SEED`]) over the length-prefixed
//! key space the ranks read in ([`plan_digest_in`]; empty for `plan_digest`), then
//! [`LogicalPlan::write_canonical`]'s encoding: version, batch id, components, then every
//! request's id and page hashes, integers little-endian, variable parts length-prefixed. The
//! encoding is injective, so two plans digest alike only through a hash collision. The key
//! space (the linker's resolved namespace and its context- and pipeline-parallel ranks) is
//! in: ranks configured with different namespaces read different objects for the same page
//! hashes, and a receiver must not land a peer's.
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

use crate::alone::{AloneLoads, RanksAhead, ALONE_WIRE};
use crate::{Collective, CollectiveError};

/// Seed of the plan digest; changing the digest's definition changes the seed, so ranks that
/// run different versions disagree (and fall back) rather than compare unlike digests.
pub const PLAN_DIGEST_SEED: u64 = 0x6b76_6c69_6e6b_0002; // "kvlink" v2: the key space in

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
    plan_digest_in(plan, b"")
}

/// [`plan_digest`] of `plan` read in `key_space` (whatever names the objects the ranks read
/// for its page hashes: a namespace, with the context- and pipeline-parallel ranks): plans
/// read in different key spaces differ.
///
/// ```
/// use kv_geometry::{ComponentId, PageHash};
/// use kv_loader::{BatchId, LogicalPlan, RequestPages};
/// use dedup_broadcast::{plan_digest, plan_digest_in};
/// let plan = LogicalPlan {
///     batch: BatchId(1),
///     requests: vec![RequestPages { request: "r".into(), pages: vec![PageHash([7; 32])] }],
///     components: vec![ComponentId(0)],
/// };
/// assert_eq!(plan_digest_in(&plan, b"glm/a"), plan_digest_in(&plan, b"glm/a"));
/// assert_ne!(plan_digest_in(&plan, b"glm/a"), plan_digest_in(&plan, b"glm/b"));
/// assert_eq!(plan_digest_in(&plan, b""), plan_digest(&plan));
/// ```
pub fn plan_digest_in(plan: &LogicalPlan, key_space: &[u8]) -> [u8; 16] {
    let mut hasher = Xxh3::with_seed(PLAN_DIGEST_SEED);
    hasher.update(&(key_space.len() as u64).to_le_bytes());
    hasher.update(key_space);
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

/// What a batch gate word says: the plan digest, the batch, how many gates this rank has held
/// on its handle before this one, the rank's share-mode proposal, how long its previous batch
/// took, and which of its batches it loaded alone. 344 bytes on the wire: `"KVG3"`,
/// `last_batch_us` as a little-endian `u32`, the digest, then batch, count and proposal as
/// little-endian `u64`, then the [`AloneLoads`] record (296 bytes).
///
/// ```
/// use dedup_broadcast::GateWord;
/// let mut word = GateWord {
///     digest: [7; 16], batch: 3, count: 2, proposal: 1, last_batch_us: 812_345,
///     alone: Default::default(),
/// };
/// word.alone.settled(1, true);
/// assert_eq!(GateWord::decode(&word.encode()), Some(word));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GateWord {
    /// [`plan_digest`] of the batch's plan.
    pub digest: [u8; 16],
    /// The batch id.
    pub batch: u64,
    /// Gates this rank held on this handle before (every rank's count is the same while the
    /// ranks are in step).
    pub count: u64,
    /// This rank's share-mode proposal (rank 0's wins): the mode's wire code, and in the top
    /// bit whatever flag the caller adds (kvlink's linker: rank 0's `Auto` keeps that mode).
    pub proposal: u64,
    /// How long this rank's previous batch on this handle took, from its gate until the rank
    /// was done with it (its last layer ready, the closing status exchange, its read session
    /// ended), in microseconds (saturated at `u32::MAX`, about
    /// 71 minutes). 0 says there is no sample: no batch before this gate on the handle, or
    /// that batch failed, was refused, was cancelled or landed too little to measure (or was
    /// not the one gated just before). The group's time of a batch is the slowest rank's: the
    /// group's next batch waits for it at its gate.
    pub last_batch_us: u32,
    /// Which of the batches this rank settled it loaded alone (without the group; the
    /// default, none). A rank the group went past learns from it whether the ranks ahead
    /// loaded its batch ([`GateStep::Behind`]).
    pub alone: AloneLoads,
}

pub(crate) const GATE_MAGIC: &[u8; 4] = b"KVG3";
pub(crate) const GATE_WORD: usize = 48 + ALONE_WIRE;

impl GateWord {
    /// The wire bytes.
    pub fn encode(&self) -> [u8; GATE_WORD] {
        let mut w = [0u8; GATE_WORD];
        w[..4].copy_from_slice(GATE_MAGIC);
        w[4..8].copy_from_slice(&self.last_batch_us.to_le_bytes());
        w[8..24].copy_from_slice(&self.digest);
        w[24..32].copy_from_slice(&self.batch.to_le_bytes());
        w[32..40].copy_from_slice(&self.count.to_le_bytes());
        w[40..48].copy_from_slice(&self.proposal.to_le_bytes());
        w[48..].copy_from_slice(&self.alone.encode());
        w
    }

    /// The word of `bytes`, or `None` when they are not one.
    pub fn decode(bytes: &[u8]) -> Option<GateWord> {
        if bytes.len() != GATE_WORD || &bytes[..4] != GATE_MAGIC {
            return None;
        }
        let u = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[at..at + 8]);
            u64::from_le_bytes(b)
        };
        let mut digest = [0u8; 16];
        digest.copy_from_slice(&bytes[8..24]);
        let mut us = [0u8; 4];
        us.copy_from_slice(&bytes[4..8]);
        Some(GateWord {
            digest,
            batch: u(24),
            count: u(32),
            proposal: u(40),
            last_batch_us: u32::from_le_bytes(us),
            alone: AloneLoads::decode(&bytes[48..])?,
        })
    }
}

/// Whether the ranks met at the same batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateStep {
    /// Every rank gated the same batch, after the same number of gates: in step.
    InStep,
    /// Another rank gated a later batch (batch ids increase): this rank is behind, so it
    /// settles this batch with no further collective (fails it, or loads it alone where the
    /// ranks ahead did), and gates its next batch next.
    Behind {
        /// The latest batch another rank gated.
        latest: u64,
        /// Every rank at a later batch whose [`GateWord::alone`] tells of this one loaded it
        /// alone, and one at least does ([`RanksAhead::settled_alone`]): a rank that may load
        /// alone loads it alone too, so that no rank fails a batch another loaded, nor loads
        /// one the others failed (a rank whose record no longer tells of the batch, as one
        /// that started again, is not heard).
        settled_alone: bool,
    },
    /// Another rank gated an earlier batch: it is behind and moves on to its next batch; this
    /// rank gates the same batch again.
    Ahead {
        /// The earliest batch another rank gated.
        earliest: u64,
    },
    /// The ranks' collectives no longer line up (a word that is not a gate word, or equal
    /// batches after different numbers of gates): every rank fails the batch, and the group
    /// must be re-formed.
    Lost {
        /// What did not match.
        detail: String,
    },
}

/// What a batch gate found: whether the ranks are in step, and when they are, whether their
/// plans agree, every rank's proposal and every rank's previous batch time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchGate {
    /// In step, behind, ahead or lost.
    pub step: GateStep,
    /// The plans' verdict (meaningful when in step).
    pub verdict: GateVerdict,
    /// Every rank's proposal, in rank order (meaningful when in step; empty otherwise).
    pub proposals: Vec<u64>,
    /// Every rank's [`GateWord::last_batch_us`], in rank order (meaningful when in step;
    /// empty otherwise).
    pub last_batch_us: Vec<u32>,
    /// The ranks at a later batch than this rank's (none unless [`GateStep::Behind`]).
    pub ahead: RanksAhead,
}

/// The batch gate: one [`Collective::all_gather_bytes`] of every rank's [`GateWord`], which
/// checks that the ranks are at the same batch after the same number of gates (a rank whose
/// collectives shifted is caught here and the group resynchronises, see [`GateStep`]), that
/// their plans agree ([`GateVerdict`]), and carries the share-mode proposals. Every rank gets
/// the same words, so every rank reaches the same decision.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{check_batch, GateStep, GateWord, InProcessGroup};
/// let ranks = InProcessGroup::new(1);
/// let word = GateWord {
///     digest: [7; 16], batch: 3, count: 0, proposal: 1, last_batch_us: 0,
///     alone: Default::default(),
/// };
/// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
/// let gate = check_batch(&ranks[0], &word, deadline).unwrap();
/// assert_eq!(gate.step, GateStep::InStep);
/// assert_eq!(gate.proposals, vec![1]);
/// assert_eq!(gate.last_batch_us, vec![0]);
/// ```
pub fn check_batch(
    coll: &dyn Collective,
    word: &GateWord,
    deadline: Instant,
) -> Result<BatchGate, CollectiveError> {
    // Settled: ranks act on the gate apart (a rank whose gate failed may load alone), so an
    // `Ok` here must mean every rank has every word.
    let all = coll.all_gather_bytes_settled(&word.encode(), deadline)?;
    Ok(judge_gate(word, &all))
}

/// The decision of a gate from every rank's words (pure: what [`check_batch`] decides).
pub fn judge_gate(mine: &GateWord, all: &[Vec<u8>]) -> BatchGate {
    let lost = |detail: String| BatchGate {
        step: GateStep::Lost { detail },
        verdict: GateVerdict::Agreed,
        proposals: Vec::new(),
        last_batch_us: Vec::new(),
        ahead: RanksAhead::default(),
    };
    let words: Option<Vec<GateWord>> = all.iter().map(|b| GateWord::decode(b)).collect();
    let Some(words) = words.filter(|w| !w.is_empty()) else {
        return lost("a rank's gate word is not one (its collectives are shifted)".into());
    };
    let earliest = words.iter().map(|w| w.batch).min().unwrap_or(mine.batch);
    let latest = words.iter().map(|w| w.batch).max().unwrap_or(mine.batch);
    if words.iter().any(|w| w.count != words[0].count) {
        let counts: Vec<u64> = words.iter().map(|w| w.count).collect();
        return lost(format!(
            "ranks have held different numbers of gates: {counts:?}"
        ));
    }
    if earliest != latest {
        let ahead = RanksAhead {
            ranks: words
                .iter()
                .filter(|w| w.batch > mine.batch)
                .map(|w| (w.batch, w.alone))
                .collect(),
        };
        let step = match ahead.settled_alone(mine.batch) {
            Some(settled_alone) => GateStep::Behind {
                latest,
                settled_alone,
            },
            None => GateStep::Ahead { earliest },
        };
        return BatchGate {
            step,
            verdict: GateVerdict::Agreed,
            proposals: Vec::new(),
            last_batch_us: Vec::new(),
            ahead,
        };
    }
    let differing: Vec<u32> = words
        .iter()
        .enumerate()
        .filter(|(_, w)| w.digest != words[0].digest)
        .map(|(r, _)| r as u32)
        .collect();
    BatchGate {
        step: GateStep::InStep,
        verdict: if differing.is_empty() {
            GateVerdict::Agreed
        } else {
            GateVerdict::Mismatch { differing }
        },
        proposals: words.iter().map(|w| w.proposal).collect(),
        last_batch_us: words.iter().map(|w| w.last_batch_us).collect(),
        ahead: RanksAhead::default(),
    }
}

/// What the ranks agreed on a lookup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupAgreement {
    /// Every rank looked up the same pages: the hit the group can load (the minimum; a rank
    /// whose own lookup failed counts 0).
    Hit(u64),
    /// Some ranks looked up other pages than rank 0 (an engine that called `lookup` in another
    /// order on some rank, or a control channel whose collectives shifted): no rank may load
    /// anything, and the channel must be re-formed.
    Mismatch {
        /// Ranks whose candidates (or word) differ from rank 0's.
        differing: Vec<u32>,
    },
}

pub(crate) const LOOKUP_WORD: usize = 24;

/// Seed of [`lookup_digest`]: the plan digest's first seed with "look" mixed in, kept when
/// the plan digest's definition (and seed) changed, as the lookup digest's did not.
pub(crate) const LOOKUP_DIGEST_SEED: u64 = 0x6b76_6c69_6e6b_0001 ^ 0x6c6f_6f6b; // "look"

/// The digest of a lookup's candidate pages (after the engine's own `first_page`).
pub fn lookup_digest(first_page: u64, candidates: &[kv_geometry::PageHash]) -> [u8; 16] {
    let mut h = Xxh3::with_seed(LOOKUP_DIGEST_SEED);
    h.update(&first_page.to_le_bytes());
    h.update(&(candidates.len() as u64).to_le_bytes());
    for p in candidates {
        h.update(&p.0);
    }
    h.digest128().to_le_bytes()
}

/// Every rank's lookup over the group in one [`Collective::all_gather_bytes_settled`]: a
/// digest of the candidate pages and this rank's hit (`None`: its own lookup failed). Every
/// rank that gets `Ok` gets the same words, so reaches the same [`LookupAgreement`]; the
/// gather is settled because each rank acts on the agreed hit alone (its engine plans that
/// many cached tokens): a rank that gave up before confirming fails every other rank's lookup
/// too, rather than leaving them with a hit it does not share. Every rank issues the same
/// collective per lookup whatever its own lookup did.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{agree_lookup, InProcessGroup, LookupAgreement};
/// let ranks = InProcessGroup::new(1);
/// let deadline = kv_loader::deadline_after(Duration::from_secs(5));
/// let a = agree_lookup(&ranks[0], &[1; 16], Some(3), deadline).unwrap();
/// assert_eq!(a, LookupAgreement::Hit(3));
/// ```
pub fn agree_lookup(
    coll: &dyn Collective,
    digest: &[u8; 16],
    hit: Option<u64>,
    deadline: Instant,
) -> Result<LookupAgreement, CollectiveError> {
    let mut word = [0u8; LOOKUP_WORD];
    word[..16].copy_from_slice(digest);
    word[16..].copy_from_slice(&hit.unwrap_or(u64::MAX).to_le_bytes());
    let all = coll.all_gather_bytes_settled(&word, deadline)?;
    let digest_of = |w: &Vec<u8>| w.get(..16).map(<[u8]>::to_vec);
    let reference = all.first().and_then(digest_of);
    let differing: Vec<u32> = all
        .iter()
        .enumerate()
        .filter(|(_, w)| w.len() != LOOKUP_WORD || digest_of(w) != reference)
        .map(|(r, _)| r as u32)
        .collect();
    if !differing.is_empty() {
        return Ok(LookupAgreement::Mismatch { differing });
    }
    let min = all
        .iter()
        .map(|w| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&w[16..24]);
            match u64::from_le_bytes(b) {
                u64::MAX => 0,
                h => h,
            }
        })
        .min()
        .unwrap_or(0);
    Ok(LookupAgreement::Hit(min))
}
