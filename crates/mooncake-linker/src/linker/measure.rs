//! What `Auto` decides from: configured bandwidths, refined by what this rank measures.

use std::time::Duration;

use dedup_broadcast::Bandwidths;
use kv_loader::ShareMode;

use super::Shared;

/// Weight of a new observation in the running averages.
const EWMA: f64 = 0.2;
/// Reads or exchanges smaller than this say more about latency than bandwidth: ignored.
const MIN_BYTES: u64 = 1 << 20;

fn blend(old: f64, new: f64) -> f64 {
    if old.is_finite() && old > 0.0 {
        old * (1.0 - EWMA) + new * EWMA
    } else {
        new
    }
}

fn gbps(bytes: u64, took: Duration) -> Option<f64> {
    let secs = took.as_secs_f64();
    (bytes >= MIN_BYTES && secs > 0.0).then(|| bytes as f64 / secs / 1e9)
}

impl Shared {
    /// The bandwidths now: configured, with the store's per-rank figure and the fabric's
    /// refined from this rank's own layer reads and exchanges.
    pub(crate) fn bandwidths(&self) -> Bandwidths {
        *self.measured.lock()
    }

    /// A layer read of `bytes` took `took` on this rank.
    pub(crate) fn observe_store_read(&self, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            let mut m = self.measured.lock();
            m.store_per_rank_gbps = blend(m.store_per_rank_gbps, g);
        }
    }

    /// A collective moved a `bytes` buffer in `took`.
    pub(crate) fn observe_fabric(&self, mode: ShareMode, bytes: u64, took: Duration) {
        if let Some(g) = gbps(bytes, took) {
            let mut m = self.measured.lock();
            match mode {
                ShareMode::Rank0Broadcast => {
                    m.fabric_broadcast_gbps = blend(m.fabric_broadcast_gbps, g)
                }
                ShareMode::SplitAllGather => {
                    m.fabric_all_gather_gbps = blend(m.fabric_all_gather_gbps, g)
                }
                ShareMode::AllRanks => {}
            }
        }
    }
}
