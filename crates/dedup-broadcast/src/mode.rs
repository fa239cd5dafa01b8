//! Choosing how replicated components are shared: fixed by configuration, or `Auto` from
//! bandwidths through each mode's time model.
//!
//! The modes, the engine's choice and the time model live in `kv_loader`'s share-mode table
//! ([`ShareMode::spec`], [`ShareMode::layer_secs`]); they are re-exported here. This module
//! decides from them.

use kv_loader::ShareMode;
pub use kv_loader::{Bandwidths, ModeChoice};

/// The model's time for one layer in each mode, seconds (infinite where a bandwidth it needs
/// is unknown).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModeTimes([f64; ShareMode::COUNT]);

impl ModeTimes {
    /// The time of `mode`.
    pub fn of(&self, mode: ShareMode) -> f64 {
        self.0[mode.index()]
    }
}

/// The time model ([`ShareMode::layer_secs`]) of every mode for `bytes_per_layer` replicated
/// bytes per layer on each of `tp_size` ranks.
pub fn layer_times(bw: &Bandwidths, tp_size: u32, bytes_per_layer: u64) -> ModeTimes {
    ModeTimes(ShareMode::ALL.map(|m| m.layer_secs(bw, tp_size, bytes_per_layer)))
}

/// The mode for a linker: `Fixed` as given, `Auto` the fastest by [`layer_times`] (ties go to
/// the simpler mode, the first in [`ShareMode::ALL`]). With one
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
    // Debug: decided for every batch.
    tracing::debug!(
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
    let mut best = ShareMode::ALL[0];
    for mode in ShareMode::ALL {
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
    let times = ShareMode::ALL
        .iter()
        .map(|m| format!("{m:?} {}", ms(t.of(*m))))
        .collect::<Vec<_>>()
        .join(", ");
    let why = format!(
        "Auto: per layer of {:.1} MB at TP {tp_size}: {times} (store {} GB/s per rank, {} \
         GB/s aggregate; fabric broadcast {} GB/s, all-gather {} GB/s) -> {best:?}",
        bytes_per_layer as f64 / 1e6,
        bw.store_per_rank_gbps,
        bw.store_aggregate_gbps,
        bw.fabric_broadcast_gbps,
        bw.fabric_all_gather_gbps,
    );
    (best, why)
}
