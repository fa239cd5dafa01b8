//! How tensor-parallel ranks share replicated components, in one place: the modes
//! ([`ShareMode`]), what the engine configures ([`ModeChoice`], [`Bandwidths`]), and each
//! mode's facts as one row of a table ([`ShareModeSpec`]): its wire code, its measurement
//! slot, who reads from the store, which collective it runs, and from those its time model.
//!
//! A new mode is a new variant, one row in the table here, and its share step in the linker
//! (`mooncake-linker`'s `linker/share/`). Everything else (the ranks' proposal exchange, Auto's
//! measurements and its time model, the staging layout) reads the row.
//!
//! **The time model**, for `B` bytes of replicated KV per layer on each rank and `N` ranks
//! (bandwidths in GB/s = 1e9 bytes per second):
//! - store time, by who reads ([`StoreReads`]): every rank reads `B`, the ranks sharing the
//!   store path (`max(N·B / aggregate, B / per_rank)`); rank 0 reads `B`
//!   (`max(B / per_rank, B / aggregate)`); each rank reads `B/N`
//!   (`max(B/N / per_rank, B / aggregate)`);
//! - fabric time, by the collective ([`FabricOp`]): `B / broadcast` or `B / all_gather`;
//! - the layer takes the slower of the two: reading one layer overlaps sharing the previous.
//!
//! Fabric bandwidths are *algorithm* bandwidths: bytes of the whole buffer (`B`) per second,
//! as `nccl-tests` reports `algbw`. Sharded components are never shared; every rank reads its
//! own whatever the mode.

/// How the ranks shared replicated components for a batch.
///
/// ```
/// use kv_loader::ShareMode;
/// let m = ShareMode::SplitAllGather;
/// assert_eq!(ShareMode::from_wire_code(m.wire_code()), Some(m));
/// assert_eq!(ShareMode::ALL[m.index()], m);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ShareMode {
    /// Every rank read its own copy.
    AllRanks,
    /// Rank 0 read each layer and broadcast it.
    Rank0Broadcast,
    /// Each rank read a share of the pages; an all-gather completed every pool.
    SplitAllGather,
}

/// Who reads a layer's replicated pages from the store in a mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoreReads {
    /// Every rank reads all of them.
    EveryRank,
    /// Rank 0 reads all of them; the others none.
    RankZero,
    /// Each rank reads its share (`1/N` of the pages, in page order).
    SplitByRank,
}

/// The collective a mode runs on the fabric to complete every rank's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FabricOp {
    /// From rank 0 to every rank.
    Broadcast,
    /// Each rank's share to every rank.
    AllGather,
}

/// One mode's facts: the one place a mode is described (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareModeSpec {
    /// The mode.
    pub mode: ShareMode,
    /// Its code in the ranks' proposal exchange (stable across versions of a group).
    pub wire_code: u64,
    /// Who reads the replicated pages from the store.
    pub reads: StoreReads,
    /// The collective that completes the pools (`None`: nothing is shared).
    pub fabric: Option<FabricOp>,
    /// Among modes that `Auto`'s measurements find equally fast, the lowest wins: the mode
    /// reading the fewest store bytes on any rank. (The time model, which has no measurement,
    /// breaks its exact ties in [`ShareMode::ALL`] order instead, simplest first: with every
    /// bandwidth unknown it keeps `AllRanks`.)
    pub tie_rank: u8,
}

/// The table, in [`ShareMode::ALL`] order (a mode's row is `SPECS[mode.index()]`).
const SPECS: [ShareModeSpec; 3] = [
    ShareModeSpec {
        mode: ShareMode::AllRanks,
        wire_code: 0,
        reads: StoreReads::EveryRank,
        fabric: None,
        tie_rank: 2,
    },
    ShareModeSpec {
        mode: ShareMode::Rank0Broadcast,
        wire_code: 1,
        reads: StoreReads::RankZero,
        fabric: Some(FabricOp::Broadcast),
        tie_rank: 1,
    },
    ShareModeSpec {
        mode: ShareMode::SplitAllGather,
        wire_code: 2,
        reads: StoreReads::SplitByRank,
        fabric: Some(FabricOp::AllGather),
        tie_rank: 0,
    },
];

impl ShareMode {
    /// How many modes there are (the length of per-mode measurement arrays).
    pub const COUNT: usize = SPECS.len();

    /// Every mode, simplest first: the order `Auto` measures them in, and the order its time
    /// model breaks exact ties in.
    pub const ALL: [ShareMode; ShareMode::COUNT] = [
        ShareMode::AllRanks,
        ShareMode::Rank0Broadcast,
        ShareMode::SplitAllGather,
    ];

    /// The mode's row of the table.
    pub const fn spec(self) -> &'static ShareModeSpec {
        &SPECS[self as usize]
    }

    /// The mode's slot in per-mode arrays (`0..COUNT`, in [`ShareMode::ALL`] order).
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The mode's code in the ranks' proposal exchange.
    pub const fn wire_code(self) -> u64 {
        self.spec().wire_code
    }

    /// The mode with wire code `code`, if any.
    pub fn from_wire_code(code: u64) -> Option<ShareMode> {
        SPECS.iter().find(|s| s.wire_code == code).map(|s| s.mode)
    }

    /// True when the mode moves replicated rows between ranks (false for `AllRanks`).
    pub const fn shares(self) -> bool {
        self.spec().fabric.is_some()
    }

    /// The time model (module docs): seconds per layer of `bytes_per_layer` replicated bytes
    /// on each of `tp_size` ranks; infinite when a bandwidth it needs is unknown.
    pub fn layer_secs(self, bw: &Bandwidths, tp_size: u32, bytes_per_layer: u64) -> f64 {
        let n = f64::from(tp_size.max(1));
        let b = bytes_per_layer as f64;
        let per_rank = |x: f64| secs(x, bw.store_per_rank_gbps);
        let aggregate = |x: f64| secs(x, bw.store_aggregate_gbps);
        let store = match self.spec().reads {
            StoreReads::EveryRank => aggregate(n * b).max(per_rank(b)),
            StoreReads::RankZero => per_rank(b).max(aggregate(b)),
            StoreReads::SplitByRank => per_rank(b / n).max(aggregate(b)),
        };
        let fabric = self.spec().fabric.map_or(0.0, |op| secs(b, bw.fabric(op)));
        store.max(fabric)
    }
}

/// How the linker picks the share mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModeChoice {
    /// Always this mode.
    Fixed(ShareMode),
    /// The fastest mode: by the time model when every bandwidth is configured, else by
    /// measuring batches in each mode.
    Auto,
}

/// Measured bandwidths, GB/s (1e9 bytes per second). A value that is not a positive finite
/// number means "unknown": a mode that needs it is not chosen by `Auto`'s time model. Two
/// are equal when each bandwidth is the same number or unknown in both.
///
/// ```
/// use kv_loader::Bandwidths;
/// assert_eq!(Bandwidths::UNKNOWN, Bandwidths::UNKNOWN);
/// let known = Bandwidths { store_per_rank_gbps: 3.3, ..Bandwidths::UNKNOWN };
/// assert_ne!(known, Bandwidths::UNKNOWN);
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Bandwidths {
    /// What one rank reads from the store when it reads alone.
    pub store_per_rank_gbps: f64,
    /// What all ranks together read from the store at most (the shared bottleneck: NIC,
    /// network stack, storage node).
    pub store_aggregate_gbps: f64,
    /// Broadcast from one rank to the group.
    pub fabric_broadcast_gbps: f64,
    /// All-gather over the group.
    pub fabric_all_gather_gbps: f64,
}

impl PartialEq for Bandwidths {
    fn eq(&self, other: &Self) -> bool {
        let known = |x: f64| x.is_finite() && x > 0.0;
        let same = |a: f64, b: f64| match (known(a), known(b)) {
            (true, true) => a == b,
            (false, false) => true,
            _ => false,
        };
        same(self.store_per_rank_gbps, other.store_per_rank_gbps)
            && same(self.store_aggregate_gbps, other.store_aggregate_gbps)
            && same(self.fabric_broadcast_gbps, other.fabric_broadcast_gbps)
            && same(self.fabric_all_gather_gbps, other.fabric_all_gather_gbps)
    }
}

impl Bandwidths {
    /// Every bandwidth unknown.
    pub const UNKNOWN: Bandwidths = Bandwidths {
        store_per_rank_gbps: f64::NAN,
        store_aggregate_gbps: f64::NAN,
        fabric_broadcast_gbps: f64::NAN,
        fabric_all_gather_gbps: f64::NAN,
    };

    /// The bandwidth of collective `op`.
    pub fn fabric(&self, op: FabricOp) -> f64 {
        match op {
            FabricOp::Broadcast => self.fabric_broadcast_gbps,
            FabricOp::AllGather => self.fabric_all_gather_gbps,
        }
    }

    /// The bandwidth of collective `op`, to update it.
    pub fn fabric_mut(&mut self, op: FabricOp) -> &mut f64 {
        match op {
            FabricOp::Broadcast => &mut self.fabric_broadcast_gbps,
            FabricOp::AllGather => &mut self.fabric_all_gather_gbps,
        }
    }

    /// True when every bandwidth is a positive finite number.
    pub fn all_known(&self) -> bool {
        [
            self.store_per_rank_gbps,
            self.store_aggregate_gbps,
            self.fabric_broadcast_gbps,
            self.fabric_all_gather_gbps,
        ]
        .iter()
        .all(|v| v.is_finite() && *v > 0.0)
    }
}

/// Seconds to move `bytes` at `gbps`; infinite when the bandwidth is unknown.
fn secs(bytes: f64, gbps: f64) -> f64 {
    if gbps.is_finite() && gbps > 0.0 {
        bytes / (gbps * 1e9)
    } else {
        f64::INFINITY
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_rows_match_their_modes() {
        for (i, m) in ShareMode::ALL.into_iter().enumerate() {
            assert_eq!(m.spec().mode, m);
            assert_eq!(m.index(), i);
            assert_eq!(ShareMode::from_wire_code(m.wire_code()), Some(m));
        }
        let mut codes: Vec<u64> = SPECS.iter().map(|s| s.wire_code).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), ShareMode::COUNT, "wire codes are distinct");
        let mut ties: Vec<u8> = SPECS.iter().map(|s| s.tie_rank).collect();
        ties.sort_unstable();
        ties.dedup();
        assert_eq!(ties.len(), ShareMode::COUNT, "tie ranks are distinct");
        assert_eq!(ShareMode::from_wire_code(99), None);
    }

    #[test]
    fn sharing_modes_have_a_collective_and_all_ranks_has_none() {
        assert!(!ShareMode::AllRanks.shares());
        assert!(ShareMode::Rank0Broadcast.shares());
        assert!(ShareMode::SplitAllGather.shares());
    }

    #[test]
    fn unknown_fabric_makes_a_sharing_mode_infinite() {
        let bw = Bandwidths {
            store_per_rank_gbps: 5.0,
            store_aggregate_gbps: 10.0,
            ..Bandwidths::UNKNOWN
        };
        assert!(ShareMode::AllRanks.layer_secs(&bw, 4, 1 << 20).is_finite());
        assert!(ShareMode::Rank0Broadcast
            .layer_secs(&bw, 4, 1 << 20)
            .is_infinite());
        assert!(!Bandwidths::UNKNOWN.all_known());
    }
}
