//! What one store call costs, and its estimate from calls already made.

use std::time::Duration;

/// The time one store call takes to read a group of layers:
/// `per_call + layers × per_layer + bytes × seconds_per_byte`.
///
/// - `per_call`: the store's fixed work per call and, over Mooncake's TCP transport, the
///   round trips of its ranges when each object is read as one range (one per object per call:
///   the wheel runs a call's ranges one after another).
/// - `per_layer`: what each layer adds beyond its bytes when a group's layers are read as
///   separate ranges (a round trip per object per layer); zero when a group of layers is one
///   range per object.
/// - `seconds_per_byte`: one over the read bandwidth of one call.
///
/// ```
/// use std::time::Duration;
/// use mooncake_linker::read_plan::ReadCost;
/// let cost = ReadCost::from_gbps(Duration::from_millis(2), Duration::ZERO, 2.0);
/// // 21.5 MB (one GLM-5.2 layer of 512 pages) at 2 GB/s, plus the call: 12.75 ms.
/// assert_eq!(cost.call_time(1, 21_495_808).as_micros(), 12_747);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReadCost {
    /// Fixed time of one call.
    pub per_call: Duration,
    /// Extra time per layer in a call.
    pub per_layer: Duration,
    /// Seconds per byte read.
    pub seconds_per_byte: f64,
}

impl ReadCost {
    /// A cost from a bandwidth in GB/s (10⁹ bytes per second).
    pub fn from_gbps(per_call: Duration, per_layer: Duration, gbps: f64) -> Self {
        Self {
            per_call,
            per_layer,
            seconds_per_byte: 1.0 / (gbps * 1e9),
        }
    }

    /// Whether every term is finite and non-negative.
    pub fn is_valid(&self) -> bool {
        self.seconds_per_byte.is_finite() && self.seconds_per_byte >= 0.0
    }

    /// Seconds one call reading `layers` layers of `bytes` bytes takes.
    pub(crate) fn seconds(&self, layers: u32, bytes: u64) -> f64 {
        self.per_call.as_secs_f64()
            + f64::from(layers) * self.per_layer.as_secs_f64()
            + bytes as f64 * self.seconds_per_byte
    }

    /// The time of one call reading `layers` layers of `bytes` bytes.
    pub fn call_time(&self, layers: u32, bytes: u64) -> Duration {
        Duration::try_from_secs_f64(self.seconds(layers, bytes)).unwrap_or(Duration::MAX)
    }
}

/// Running estimate of [`ReadCost`] from the calls a reader makes: a least-squares line of
/// call time over bytes (after the known `per_layer` part), weighted towards recent calls.
///
/// Until calls of at least two clearly different sizes were seen (the adaptive plan makes
/// them: a small first group, larger ones after), the prior's split is returned, scaled so
/// that a call of the calls' mean size takes what they took (the prior itself before any
/// call); a fit that comes out negative or non-finite is clamped to stay usable.
///
/// ```
/// use std::time::Duration;
/// use mooncake_linker::read_plan::{ReadCost, ReadCostEstimator};
/// let prior = ReadCost::from_gbps(Duration::from_millis(1), Duration::ZERO, 1.0);
/// let mut est = ReadCostEstimator::new(prior);
/// assert_eq!(est.estimate(), prior);
/// // Calls that took 3 ms + 1 ns per byte (1 GB/s).
/// for bytes in [1u64 << 20, 8 << 20, 32 << 20] {
///     est.observe(1, bytes, Duration::from_nanos(3_000_000 + bytes));
/// }
/// let c = est.estimate();
/// assert!((c.per_call.as_secs_f64() - 0.003).abs() < 1e-6);
/// assert!((c.seconds_per_byte - 1e-9).abs() < 1e-12);
/// ```
#[derive(Debug, Clone)]
pub struct ReadCostEstimator {
    prior: ReadCost,
    /// Weight kept by older calls at each new one.
    keep: f64,
    w: f64,
    x: f64,
    y: f64,
    xx: f64,
    xy: f64,
}

/// Calls whose sizes differ by less than this fraction of their mean do not separate the
/// per-call and per-byte terms.
const MIN_SPREAD: f64 = 0.05;

impl ReadCostEstimator {
    /// Starts from `prior`, remembering calls with a weight that halves every 32 calls.
    pub fn new(prior: ReadCost) -> Self {
        Self {
            prior,
            keep: 0.5f64.powf(1.0 / 32.0),
            w: 0.0,
            x: 0.0,
            y: 0.0,
            xx: 0.0,
            xy: 0.0,
        }
    }

    /// A call read `layers` layers, `bytes` bytes, in `took`.
    pub fn observe(&mut self, layers: u32, bytes: u64, took: Duration) {
        let x = bytes as f64;
        let y =
            (took.as_secs_f64() - f64::from(layers) * self.prior.per_layer.as_secs_f64()).max(0.0);
        self.w = self.w * self.keep + 1.0;
        self.x = self.x * self.keep + x;
        self.y = self.y * self.keep + y;
        self.xx = self.xx * self.keep + x * x;
        self.xy = self.xy * self.keep + x * y;
    }

    /// True once a call was observed (before, [`estimate`](Self::estimate) is the prior).
    pub fn has_calls(&self) -> bool {
        self.w > 0.0
    }

    /// Calls too alike to separate the terms: the prior's split, scaled so that a call of the
    /// calls' mean size takes what they took on average. Without it a prior far off (e.g. a
    /// fixed cost that makes the plan read everything in one call, so that every call is
    /// alike) would never be corrected.
    fn scaled_prior(&self, mean_bytes: f64, mean_secs: f64) -> ReadCost {
        let p = self.prior;
        let predicted = p.seconds(0, mean_bytes as u64);
        let k = mean_secs / predicted;
        if !(k.is_finite() && k > 0.0) {
            return p;
        }
        ReadCost {
            per_call: Duration::try_from_secs_f64(p.per_call.as_secs_f64() * k)
                .unwrap_or(p.per_call),
            per_layer: p.per_layer,
            seconds_per_byte: p.seconds_per_byte * k,
        }
    }

    /// The cost now: fitted when the calls seen allow it; when they are too alike, the
    /// prior scaled to them; before any, the prior.
    pub fn estimate(&self) -> ReadCost {
        if self.w <= 0.0 {
            return self.prior;
        }
        let (mx, my) = (self.x / self.w, self.y / self.w);
        let var = self.xx / self.w - mx * mx;
        if !(var.is_finite() && mx > 0.0 && var.sqrt() >= MIN_SPREAD * mx) {
            return self.scaled_prior(mx, my);
        }
        let slope = (self.xy / self.w - mx * my) / var;
        // A negative or non-finite slope says the calls were noise: keep the prior's rate.
        let per_byte = if slope.is_finite() && slope > 0.0 {
            slope
        } else {
            self.prior.seconds_per_byte
        };
        let per_call = (my - per_byte * mx).max(0.0);
        ReadCost {
            per_call: Duration::try_from_secs_f64(per_call).unwrap_or(self.prior.per_call),
            per_layer: self.prior.per_layer,
            seconds_per_byte: per_byte,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn a_noiseless_line_is_recovered(
            per_call_us in 0u64..50_000,
            ns_per_kb in 1u64..10_000,
            sizes in prop::collection::vec((1u64 << 20)..(64 << 20), 2..20),
        ) {
            let prior = ReadCost::from_gbps(Duration::from_millis(7), Duration::ZERO, 0.5);
            let mut est = ReadCostEstimator::new(prior);
            for &b in &sizes {
                let ns = per_call_us * 1000 + b * ns_per_kb / 1024;
                est.observe(1, b, Duration::from_nanos(ns));
            }
            let c = est.estimate();
            let mean = sizes.iter().sum::<u64>() as f64 / sizes.len() as f64;
            let spread = (sizes.iter().map(|&b| (b as f64 - mean).powi(2)).sum::<f64>()
                / sizes.len() as f64).sqrt();
            if spread < 0.2 * mean {
                return Ok(()); // too alike to separate the terms (prior or a rough fit)
            }
            let want = ns_per_kb as f64 / 1024.0 * 1e-9;
            prop_assert!((c.seconds_per_byte - want).abs() <= want * 1e-2);
            prop_assert!((c.per_call.as_secs_f64() - per_call_us as f64 * 1e-6).abs() < 1e-4);
        }

        #[test]
        fn estimates_stay_usable(
            calls in prop::collection::vec((0u32..80, 0u64..1 << 30, 0u64..10_000_000_000), 0..30),
        ) {
            let prior = ReadCost::from_gbps(Duration::from_millis(1), Duration::from_micros(50), 1.0);
            let mut est = ReadCostEstimator::new(prior);
            for (layers, bytes, ns) in calls {
                est.observe(layers, bytes, Duration::from_nanos(ns));
                let c = est.estimate();
                prop_assert!(c.is_valid());
                prop_assert!(c.seconds_per_byte > 0.0);
                prop_assert_eq!(c.per_layer, prior.per_layer);
            }
        }
    }

    #[test]
    fn same_sized_calls_scale_the_prior_to_what_they_took() {
        // Prior: 1 ms + 1 GB/s, so a 1 MiB call "takes" 2.05 ms; the calls took 5 ms.
        let prior = ReadCost::from_gbps(Duration::from_millis(1), Duration::ZERO, 1.0);
        let mut est = ReadCostEstimator::new(prior);
        for _ in 0..10 {
            est.observe(1, 1 << 20, Duration::from_millis(5));
        }
        let c = est.estimate();
        // The prior's split (fixed cost : per byte) is kept, scaled by 5 / 2.05.
        let k = 0.005 / (0.001 + 1e-9 * f64::from(1u32 << 20));
        assert!((c.per_call.as_secs_f64() - 0.001 * k).abs() < 1e-9, "{c:?}");
        assert!((c.seconds_per_byte - 1e-9 * k).abs() < 1e-15, "{c:?}");
        assert!((c.call_time(1, 1 << 20).as_secs_f64() - 0.005).abs() < 1e-6);
        // A prior whose fixed cost outweighs everything, and one big call per batch that is
        // much faster: the estimate follows the calls (so a plan built on it changes, and the
        // calls that follow differ in size and separate the terms).
        let slow = ReadCost::from_gbps(Duration::from_millis(600), Duration::ZERO, 2.0);
        let mut est = ReadCostEstimator::new(slow);
        for _ in 0..4 {
            est.observe(78, 1_770_000_000, Duration::from_millis(500));
        }
        assert!(
            est.estimate().per_call < Duration::from_millis(300),
            "{:?}",
            est.estimate()
        );
    }
}
