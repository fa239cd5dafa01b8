//! Choosing how replicated components are shared: fixed by configuration, or `Auto` from
//! measured bandwidths through a per-layer time model.
//!
//! The model, for `B` bytes of replicated KV per layer on each rank and `N` ranks (all
//! bandwidths in GB/s = 1e9 bytes per second):
//! - `AllRanks`: every rank reads `B`; the ranks share the store path, so the layer takes
//!   `max(N·B / aggregate, B / per_rank)`.
//! - `Rank0Broadcast`: rank 0 reads `B` (`max(B / per_rank, B / aggregate)`) while the previous
//!   layer is broadcast (`B / broadcast`): pipelined, so the slower of the two.
//! - `SplitAllGather`: each rank reads `B/N` (`max(B/N / per_rank, B / aggregate)`) while the
//!   previous layer is all-gathered (`B / all_gather`): the slower of the two.
//!
//! Fabric bandwidths are *algorithm* bandwidths: bytes of the whole buffer (`B`) per second,
//! as `nccl-tests` reports `algbw`. Sharded components are never shared; the caller reads
//! them per rank whatever the mode.

use kv_loader::ShareMode;

/// How the linker picks the share mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModeChoice {
    /// Always this mode.
    Fixed(ShareMode),
    /// The fastest mode by the time model, from measured bandwidths.
    Auto,
}

/// Measured bandwidths, GB/s (1e9 bytes per second). A value that is not a positive finite
/// number means "unknown": a mode that needs it is not chosen by `Auto`.
#[derive(Debug, Clone, Copy, PartialEq)]
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

/// The model's time for one layer in each mode, seconds (infinite where a bandwidth it needs
/// is unknown).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModeTimes {
    /// `AllRanks`.
    pub all_ranks: f64,
    /// `Rank0Broadcast`.
    pub rank0_broadcast: f64,
    /// `SplitAllGather`.
    pub split_all_gather: f64,
}

impl ModeTimes {
    /// The time of `mode`.
    pub fn of(&self, mode: ShareMode) -> f64 {
        match mode {
            ShareMode::AllRanks => self.all_ranks,
            ShareMode::Rank0Broadcast => self.rank0_broadcast,
            ShareMode::SplitAllGather => self.split_all_gather,
        }
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

/// The time model (see the module docs) for `bytes_per_layer` replicated bytes per layer on
/// each of `tp_size` ranks.
pub fn layer_times(bw: &Bandwidths, tp_size: u32, bytes_per_layer: u64) -> ModeTimes {
    let n = f64::from(tp_size.max(1));
    let b = bytes_per_layer as f64;
    let per_rank = |x: f64| secs(x, bw.store_per_rank_gbps);
    let aggregate = |x: f64| secs(x, bw.store_aggregate_gbps);
    ModeTimes {
        all_ranks: aggregate(n * b).max(per_rank(b)),
        rank0_broadcast: per_rank(b)
            .max(aggregate(b))
            .max(secs(b, bw.fabric_broadcast_gbps)),
        split_all_gather: per_rank(b / n)
            .max(aggregate(b))
            .max(secs(b, bw.fabric_all_gather_gbps)),
    }
}

/// The mode for a linker: `Fixed` as given, `Auto` the fastest by [`layer_times`] (ties go to
/// the simpler mode: `AllRanks`, then `Rank0Broadcast`, then `SplitAllGather`). With one
/// rank, or nothing to move, there is nothing to share: `AllRanks`. Returns the mode and why;
/// the reason is also logged (`tracing::info`).
///
/// ```
/// use dedup_broadcast::{choose_mode, Bandwidths, ModeChoice};
/// use kv_loader::ShareMode;
/// // A shared 10 GB/s store path, NVLink-class fabric: split reads win.
/// let bw = Bandwidths { store_per_rank_gbps: 5.0, store_aggregate_gbps: 10.0,
///                       fabric_broadcast_gbps: 300.0, fabric_all_gather_gbps: 300.0 };
/// let (mode, why) = choose_mode(ModeChoice::Auto, &bw, 8, 100_000_000);
/// assert_eq!(mode, ShareMode::SplitAllGather);
/// assert!(why.contains("SplitAllGather"));
/// ```
pub fn choose_mode(
    choice: ModeChoice,
    bw: &Bandwidths,
    tp_size: u32,
    bytes_per_layer: u64,
) -> (ShareMode, String) {
    let (mode, why) = decide(choice, bw, tp_size, bytes_per_layer);
    tracing::info!(
        ?choice,
        ?mode,
        tp_size,
        bytes_per_layer,
        "share mode: {why}"
    );
    (mode, why)
}

fn decide(
    choice: ModeChoice,
    bw: &Bandwidths,
    tp_size: u32,
    bytes_per_layer: u64,
) -> (ShareMode, String) {
    if tp_size <= 1 {
        return (
            ShareMode::AllRanks,
            format!("TP size {tp_size}: one rank, nothing to share"),
        );
    }
    if let ModeChoice::Fixed(mode) = choice {
        return (mode, format!("{mode:?} fixed by configuration"));
    }
    if bytes_per_layer == 0 {
        return (
            ShareMode::AllRanks,
            "no replicated bytes per layer: nothing to share".to_string(),
        );
    }
    let t = layer_times(bw, tp_size, bytes_per_layer);
    let mut best = ShareMode::AllRanks;
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        if t.of(mode) < t.of(best) {
            best = mode;
        }
    }
    let ms = |x: f64| {
        if x.is_finite() {
            format!("{:.3} ms", x * 1e3)
        } else {
            "unknown".to_string()
        }
    };
    let why = format!(
        "Auto: per layer of {:.1} MB at TP {tp_size}: AllRanks {}, Rank0Broadcast {}, \
         SplitAllGather {} (store {} GB/s per rank, {} GB/s aggregate; fabric broadcast {} \
         GB/s, all-gather {} GB/s) -> {best:?}",
        bytes_per_layer as f64 / 1e6,
        ms(t.all_ranks),
        ms(t.rank0_broadcast),
        ms(t.split_all_gather),
        bw.store_per_rank_gbps,
        bw.store_aggregate_gbps,
        bw.fabric_broadcast_gbps,
        bw.fabric_all_gather_gbps,
    );
    (best, why)
}
