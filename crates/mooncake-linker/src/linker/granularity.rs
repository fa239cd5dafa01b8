//! How many layers each store call of a load reads ([`ReadGranularity`], configured), and the
//! per-linker state the adaptive plan decides from: a [`ReadCostEstimator`] per share mode fed
//! by every group call in that mode, and the engine's compute per layer (configured, or
//! measured by [`ComputeMeter`]).

use std::ops::Range;
use std::time::Duration;

use kv_loader::ShareMode;
use parking_lot::Mutex;
use tracing::debug;

use super::compute::ComputeMeter;
use crate::read_plan::{plan_reads, ReadCost, ReadCostEstimator, ReadPlanRequest};

/// How many layers each store call of a load reads (`LinkerConfig::read_granularity`).
///
/// Whatever it says, a call never covers more layers than the landing lends stages at once
/// minus one (the layer the exchange loop is landing): host pools lend one per layer, device
/// pools as many as their staging buffer has stages
/// ([`StagingPool::with_stages`](kv_device::StagingPool::with_stages)).
///
/// ```
/// use std::time::Duration;
/// use mooncake_linker::{LinkerConfig, ReadGranularity};
/// // The default: groups planned per batch from measured costs and compute.
/// assert!(matches!(LinkerConfig::default().read_granularity, ReadGranularity::Adaptive { .. }));
/// // One layer per call (how every load read before layer groups).
/// let one = LinkerConfig { read_granularity: ReadGranularity::Fixed { layers_per_call: 1 }, ..LinkerConfig::default() };
/// // Adaptive, with the engine's compute known (a device engine's compute runs on its stream,
/// // where the linker cannot time it) and calls of at most 16 layers.
/// let known = ReadGranularity::Adaptive {
///     max_layers_per_call: 16,
///     compute_per_layer: Some(Duration::from_millis(6)),
///     prior: ReadGranularity::DEFAULT_PRIOR,
/// };
/// # let _ = (one, known);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReadGranularity {
    /// Each batch's groups are planned by [`read_plan::plan_reads`](crate::read_plan::plan_reads)
    /// on each rank: from the bytes this rank reads per layer in the batch's mode, the
    /// linker's estimate of a call's cost (fitted from every group call it made), and the
    /// engine's compute per layer (or the share step's time per layer, the larger). Layer 0 is
    /// read alone (attention starts after one layer's read) unless that time over the whole
    /// forward pass is below one call's fixed cost (nothing worth overlapping: the reads alone
    /// count, in the fewest calls); the groups then grow while the reads stay ahead of
    /// compute.
    Adaptive {
        /// Most layers one call may read. Also capped by the stages (above) and so that a
        /// call's predicted time stays under a quarter of `layer_read_timeout`.
        max_layers_per_call: u32,
        /// The engine's compute per layer; `None`: measured from the gaps between the
        /// engine's `wait_layer` calls (before any was measured, almost none is assumed:
        /// layer 0 alone, then the fastest reads). A whole forward pass of compute shorter
        /// than one call's fixed cost counts as none: the fewest calls, no layer read alone.
        compute_per_layer: Option<Duration>,
        /// What a call costs one client reading alone, before this linker has timed any call
        /// in a mode. A batch where several ranks read at once (every rank in `AllRanks` and
        /// `SplitAllGather`) plans with its per-byte cost taken that many times, since they
        /// share the store's bandwidth. An earlier linker's fit can serve where it read alone
        /// ([`Linker::read_cost`](crate::Linker::read_cost) of `Rank0Broadcast`, or of
        /// `AllRanks` without a group).
        prior: ReadCost,
    },
    /// Every call reads `layers_per_call` consecutive layers (1: one call per layer).
    Fixed {
        /// Layers per call (at least 1).
        layers_per_call: u32,
    },
}

impl ReadGranularity {
    /// The prior of the default: 2 ms per call and 2 GB/s (a Mooncake client over TCP on a
    /// busy host reads between 0.7 and 3.5 GB/s; the first batch's calls correct it).
    pub const DEFAULT_PRIOR: ReadCost = ReadCost {
        per_call: Duration::from_millis(2),
        per_layer: Duration::ZERO,
        seconds_per_byte: 0.5e-9,
    };

    /// The default: adaptive, no cap of its own, compute measured.
    pub const ADAPTIVE: ReadGranularity = ReadGranularity::Adaptive {
        max_layers_per_call: u32::MAX,
        compute_per_layer: None,
        prior: Self::DEFAULT_PRIOR,
    };
}

impl Default for ReadGranularity {
    fn default() -> Self {
        Self::ADAPTIVE
    }
}

/// The compute assumed before any was measured: positive, so layer 0 is read alone, and
/// small, so the rest is read as fast as the store allows.
const UNMEASURED_COMPUTE: Duration = Duration::from_micros(1);

/// Weight of a new batch in the running mean of a mode's share step per layer.
const SHARE_EWMA: f64 = 0.5;

/// How many times its predicted time a call that failed for time is taken at, raised to the
/// power of such failures in a row ([`ReadGroups::observe_failed`]).
const CENSORED_FACTOR: u32 = 4;

/// The per-linker state of read granularity: each mode's cost estimate, the compute meter, and
/// each mode's share step per layer.
///
/// A call's cost is estimated per share mode because it depends on how many ranks read at
/// once: in `AllRanks` at TP 8 every rank's call shares one storage node with seven others,
/// and a fit over those calls (hundreds of ms of fixed cost each) made a later
/// `SplitAllGather` batch of the same linker read all 78 layers in one call, its first layer
/// ready only with the last (`Auto` measures every mode on one linker).
#[derive(Debug)]
pub(crate) struct ReadGroups {
    granularity: ReadGranularity,
    /// By [`ShareMode::index`].
    estimators: Mutex<[ReadCostEstimator; ShareMode::COUNT]>,
    /// Calls that failed for time in a row since the last that landed, by
    /// [`ShareMode::index`] (under the estimators' lock's order: taken after it).
    failed_in_a_row: Mutex<[u32; ShareMode::COUNT]>,
    pub(crate) compute: ComputeMeter,
    /// Seconds per layer the exchange loop spent in each mode's share step (collective,
    /// scatter, land): a running mean over batches, by [`ShareMode::index`].
    share: Mutex<[Option<f64>; ShareMode::COUNT]>,
}

impl ReadGroups {
    pub(crate) fn new(granularity: ReadGranularity) -> Self {
        let prior = match granularity {
            ReadGranularity::Adaptive { prior, .. } if prior.is_valid() => prior,
            _ => ReadGranularity::DEFAULT_PRIOR,
        };
        ReadGroups {
            granularity,
            estimators: Mutex::new(std::array::from_fn(|_| ReadCostEstimator::new(prior))),
            failed_in_a_row: Mutex::new([0; ShareMode::COUNT]),
            compute: ComputeMeter::default(),
            share: Mutex::new([None; ShareMode::COUNT]),
        }
    }

    /// A batch in `mode` spent `per_layer` in each layer's share step.
    pub(crate) fn observe_share(&self, mode: ShareMode, per_layer: Duration) {
        let mut share = self.share.lock();
        let s = &mut share[mode.index()];
        let v = per_layer.as_secs_f64();
        *s = Some(s.map_or(v, |old| old * (1.0 - SHARE_EWMA) + v * SHARE_EWMA));
    }

    /// The share step per layer last measured in `mode`.
    fn share_per_layer(&self, mode: ShareMode) -> Option<Duration> {
        self.share.lock()[mode.index()].and_then(|s| Duration::try_from_secs_f64(s).ok())
    }

    /// A group call of a batch in `mode` read `layers` layers, `bytes` bytes, in `took`.
    pub(crate) fn observe(&self, mode: ShareMode, layers: u32, bytes: u64, took: Duration) {
        if bytes > 0 {
            let mut estimators = self.estimators.lock();
            estimators[mode.index()].observe(layers, bytes, took);
            self.failed_in_a_row.lock()[mode.index()] = 0;
        }
    }

    /// A group call of a batch in `mode` that failed for time (ran into its limit `limit`,
    /// returned past it, or answered "RPC timeout"): a censored sample, its true time unknown,
    /// taken at [`CENSORED_FACTOR`] times the call's predicted time, and, for a call that ran
    /// into or past the limit (`ran_long`), at [`CENSORED_FACTOR`]`^n`, `n` the mode's calls in
    /// a row that did (at most `n` = 10; a call that lands resets it); never past `limit`.
    /// Taken at the limit, one such call (20 s by default, or "forever") raised the fit's
    /// fixed cost so far that the plan read in the fewest, largest groups (layer 0 no longer
    /// alone) for hundreds of calls after it; a single hiccup now counts four times the
    /// prediction, while a store grown slow for good, its calls running into the limit one
    /// after another, is learned within a few (4, 16, 64, ... times). Early "RPC timeout"
    /// answers (an outage of the master) stay at four times: they say nothing of how slow a
    /// read is.
    pub(crate) fn observe_failed(
        &self,
        mode: ShareMode,
        (layers, bytes): (u32, u64),
        limit: Duration,
        ran_long: bool,
    ) {
        if bytes == 0 {
            return;
        }
        let mut estimators = self.estimators.lock();
        let n = if ran_long {
            let mut row = self.failed_in_a_row.lock();
            let n = &mut row[mode.index()];
            *n = n.saturating_add(1);
            (*n).min(10)
        } else {
            1
        };
        let est = &mut estimators[mode.index()];
        let predicted = est.estimate().call_time(layers, bytes);
        let factor = CENSORED_FACTOR.saturating_pow(n);
        est.observe(layers, bytes, predicted.saturating_mul(factor).min(limit));
    }

    /// The cost of a call in `mode` now.
    pub(crate) fn cost(&self, mode: ShareMode) -> ReadCost {
        self.estimators.lock()[mode.index()].estimate()
    }

    /// The cost a batch in `mode` plans from, with `readers` ranks reading at once: the mode's
    /// fit; before this linker has timed a call in `mode`, the prior, which is what a call
    /// costs one client reading alone, with its per-byte cost taken `readers` times (the
    /// ranks share the store's bandwidth). Without that, the first `SplitAllGather` batch at
    /// TP 8 planned its reads as 8 times faster than they were: its last call read 40 layers,
    /// whose share steps then all came after the reads (190–250 ms more than the later
    /// batches on the GPU host).
    pub(crate) fn cost_planned(&self, mode: ShareMode, readers: u64) -> ReadCost {
        let est = &self.estimators.lock()[mode.index()];
        let cost = est.estimate();
        if est.has_calls() || readers <= 1 {
            return cost;
        }
        ReadCost {
            seconds_per_byte: cost.seconds_per_byte * readers as f64,
            ..cost
        }
    }

    /// The compute per layer the plan uses: configured, else measured.
    pub(crate) fn compute_per_layer(&self) -> Option<Duration> {
        match self.granularity {
            ReadGranularity::Adaptive {
                compute_per_layer: Some(c),
                ..
            } => Some(c),
            _ => self.compute.estimate(),
        }
    }

    /// The groups of one batch on this rank in `mode`: `layer_bytes[l]` bytes read for layer
    /// `l`, at most `stages - 1` layers per group (the stages the landing lends), calls
    /// predicted to take at most `limits.time` and reading at most `limits.bytes` (adaptive
    /// granularity), with `readers` ranks of the group reading at once in this mode (they
    /// share the store: see [`cost_planned`](Self::cost_planned)). The groups tile
    /// `0..layer_bytes.len()` in order.
    ///
    /// What the reads overlap with is the slower of the engine's compute and the exchange
    /// loop's share step per layer (measured in this mode's last batches): a layer is ready
    /// for the engine only after its share step, so with no compute but a broadcast to
    /// make, one big group would leave every broadcast until after the whole read.
    pub(crate) fn plan(
        &self,
        layer_bytes: &[u64],
        stages: usize,
        limits: CallLimits,
        mode: ShareMode,
        readers: u64,
    ) -> Vec<Range<u32>> {
        let n = layer_bytes.len() as u32;
        let by_stages = u32::try_from(stages.saturating_sub(1))
            .unwrap_or(u32::MAX)
            .max(1);
        match self.granularity {
            ReadGranularity::Fixed { layers_per_call } => {
                fixed(n, layers_per_call.clamp(1, by_stages))
            }
            ReadGranularity::Adaptive {
                max_layers_per_call,
                ..
            } => {
                let cost = self.cost_planned(mode, readers);
                let by_time = max_by_time(layer_bytes, &cost, limits.time);
                let by_bytes = max_by_bytes(layer_bytes, limits.bytes);
                let max = max_layers_per_call
                    .min(by_stages)
                    .min(by_time)
                    .min(by_bytes)
                    .max(1);
                let share = self.share_per_layer(mode).unwrap_or(Duration::ZERO);
                let compute = match self.compute_per_layer().map(|c| c.max(share)) {
                    None if share.is_zero() => UNMEASURED_COMPUTE,
                    None => share,
                    // A forward pass shorter than one call's fixed cost has nothing worth
                    // overlapping (an engine that waits for the layers back to back, no share
                    // step to speak of): the reads alone count, in the fewest calls.
                    Some(c) if c.saturating_mul(n) < cost.per_call => Duration::ZERO,
                    Some(c) => c,
                };
                let req = ReadPlanRequest {
                    layer_bytes,
                    cost,
                    compute_per_layer: compute,
                    max_layers_per_call: max,
                };
                match plan_reads(&req) {
                    Ok(plan) => {
                        debug!(
                            ?compute,
                            max,
                            groups = plan.groups().len(),
                            predicted_last = ?plan.ready(n.saturating_sub(1)),
                            "read plan"
                        );
                        plan.groups().to_vec()
                    }
                    // Unreachable with a valid cost and max >= 1; one layer per call is safe.
                    Err(_) => fixed(n, 1),
                }
            }
        }
    }
}

/// What one store call of a batch may take: its predicted time and its bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallLimits {
    pub(crate) time: Duration,
    pub(crate) bytes: u64,
}

/// The most layers a call may read within `max_bytes` (the widest layers; at least one).
fn max_by_bytes(layer_bytes: &[u64], max_bytes: u64) -> u32 {
    let widest = layer_bytes.iter().copied().max().unwrap_or(0).max(1);
    u32::try_from(max_bytes / widest).unwrap_or(u32::MAX).clamp(
        1,
        u32::try_from(layer_bytes.len()).unwrap_or(u32::MAX).max(1),
    )
}

/// Groups of `k` layers from layer 0 (the last one shorter).
fn fixed(n: u32, k: u32) -> Vec<Range<u32>> {
    (0..n)
        .step_by(k.max(1) as usize)
        .map(|s| s..s.saturating_add(k).min(n))
        .collect()
}

/// The most layers a call may read for its predicted time (the widest layers, at `cost`) to
/// stay within `limit`; at least 1.
fn max_by_time(layer_bytes: &[u64], cost: &ReadCost, limit: Duration) -> u32 {
    let widest = layer_bytes.iter().copied().max().unwrap_or(0);
    let mut k = 1u32;
    while (k as usize) < layer_bytes.len()
        && cost.call_time(k + 1, widest.saturating_mul(u64::from(k + 1))) <= limit
    {
        k += 1;
    }
    k
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glm(pages: u64) -> Vec<u64> {
        (0..78u64)
            .map(|l| pages * (41_984 + if l % 4 == 0 { 8_448 } else { 0 }))
            .collect()
    }

    fn unlimited() -> CallLimits {
        timed(Duration::MAX)
    }

    fn timed(time: Duration) -> CallLimits {
        CallLimits {
            time,
            bytes: u64::MAX,
        }
    }

    #[test]
    fn adaptive_calls_respect_the_byte_cap() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::ZERO),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        let bytes = glm(2048);
        let widest = *bytes.iter().max().unwrap();
        let cap = 10 * widest + 1;
        let g = r.plan(
            &bytes,
            79,
            CallLimits {
                time: Duration::MAX,
                bytes: cap,
            },
            ShareMode::AllRanks,
            1,
        );
        assert!(sizes(&g).iter().all(|&s| (1..=10).contains(&s)), "{g:?}");
        assert_eq!(g.last().map(|r| r.end), Some(78));
        // A cap under one layer still reads one layer per call.
        assert_eq!(max_by_bytes(&bytes, 1), 1);
    }

    fn sizes(g: &[Range<u32>]) -> Vec<u32> {
        g.iter().map(|r| r.end - r.start).collect()
    }

    #[test]
    fn fixed_groups_respect_the_stages() {
        let r = ReadGroups::new(ReadGranularity::Fixed { layers_per_call: 8 });
        assert_eq!(
            sizes(&r.plan(&glm(4), 79, unlimited(), ShareMode::AllRanks, 1))[..3],
            [8, 8, 8]
        );
        // Two stages: one layer per call, whatever was asked.
        assert!(
            sizes(&r.plan(&glm(4), 2, unlimited(), ShareMode::AllRanks, 1))
                .iter()
                .all(|&s| s == 1)
        );
        let one = ReadGroups::new(ReadGranularity::Fixed { layers_per_call: 1 });
        assert_eq!(
            one.plan(&glm(4), 79, unlimited(), ShareMode::AllRanks, 1)
                .len(),
            78
        );
    }

    #[test]
    fn adaptive_reads_layer_0_alone_and_respects_every_cap() {
        let r = ReadGroups::new(ReadGranularity::ADAPTIVE);
        let g = r.plan(
            &glm(512),
            79,
            timed(Duration::from_secs(5)),
            ShareMode::AllRanks,
            1,
        );
        assert_eq!(g[0], 0..1);
        assert!(g.len() < 10, "{:?}", sizes(&g));
        // Stages cap the groups.
        let g = r.plan(
            &glm(512),
            9,
            timed(Duration::from_secs(5)),
            ShareMode::AllRanks,
            1,
        );
        assert!(sizes(&g).iter().all(|&s| s <= 8));
        // So does a call's predicted time: 21.5 MB layers at the prior's 2 GB/s are ~13 ms.
        let g = r.plan(
            &glm(512),
            79,
            timed(Duration::from_millis(60)),
            ShareMode::AllRanks,
            1,
        );
        assert!(sizes(&g).iter().all(|&s| s <= 5), "{:?}", sizes(&g));
    }

    #[test]
    fn configured_zero_compute_reads_the_fewest_calls() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: 26,
            compute_per_layer: Some(Duration::ZERO),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        assert_eq!(
            r.plan(&glm(512), 79, unlimited(), ShareMode::AllRanks, 1)
                .len(),
            3
        );
    }

    #[test]
    fn negligible_compute_counts_as_none() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::from_micros(1)),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        // 78 µs of compute in all, against 2 ms per call: one call for everything.
        assert_eq!(
            r.plan(&glm(512), 79, unlimited(), ShareMode::AllRanks, 1),
            vec![0..78]
        );
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::from_millis(1)),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        assert_eq!(
            r.plan(&glm(512), 79, unlimited(), ShareMode::AllRanks, 1)[0],
            0..1
        );
    }

    #[test]
    fn a_measured_share_step_is_overlapped_like_compute() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::ZERO),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        let plan = |r: &ReadGroups, m| r.plan(&glm(512), 79, unlimited(), m, 1);
        assert_eq!(plan(&r, ShareMode::Rank0Broadcast), vec![0..78]);
        // A broadcast of 5 ms per layer: layer 0 alone, then groups that keep ahead of it.
        r.observe_share(ShareMode::Rank0Broadcast, Duration::from_millis(5));
        let g = plan(&r, ShareMode::Rank0Broadcast);
        assert_eq!(g[0], 0..1);
        assert!(g.len() > 2, "{g:?}");
        // Another mode's share step says nothing about this one.
        assert_eq!(plan(&r, ShareMode::AllRanks), vec![0..78]);
    }

    #[test]
    fn one_modes_slow_calls_do_not_plan_anothers_reads() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::from_micros(5760)),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        // AllRanks at TP 8 on one storage node: every call (10 layers, 226 MB) took 700 ms,
        // a one-layer call 500 ms; a fit over those has a fixed cost above the whole
        // forward pass's compute.
        for _ in 0..20 {
            r.observe(
                ShareMode::AllRanks,
                10,
                226_000_000,
                Duration::from_millis(700),
            );
            r.observe(
                ShareMode::AllRanks,
                1,
                22_600_000,
                Duration::from_millis(500),
            );
        }
        assert!(r.cost(ShareMode::AllRanks).per_call > Duration::from_millis(449));
        assert_eq!(
            r.cost(ShareMode::SplitAllGather),
            ReadGranularity::DEFAULT_PRIOR,
            "another mode's calls leave this mode's fit alone"
        );
        // SplitAllGather of the same linker still plans from its own calls (the prior here):
        // layer 0 alone, so the engine starts after one layer's read.
        let g = r.plan(&glm(512), 79, unlimited(), ShareMode::SplitAllGather, 1);
        assert_eq!(g[0], 0..1, "{:?}", sizes(&g));
        // AllRanks itself reads in the fewest calls: its fixed cost outweighs the compute.
        assert_eq!(
            r.plan(&glm(512), 79, unlimited(), ShareMode::AllRanks, 1),
            vec![0..78]
        );
    }

    #[test]
    fn before_its_first_call_a_mode_that_every_rank_reads_in_plans_with_a_share_of_the_store() {
        let r = ReadGroups::new(ReadGranularity::Adaptive {
            max_layers_per_call: u32::MAX,
            compute_per_layer: Some(Duration::from_micros(5760)),
            prior: ReadGranularity::DEFAULT_PRIOR,
        });
        // SplitAllGather at TP 8, 32K tokens: each rank reads an eighth of 512 pages.
        let bytes = glm(64);
        let plan =
            |readers| sizes(&r.plan(&bytes, 41, unlimited(), ShareMode::SplitAllGather, readers));
        // Read alone at the prior's 2 GB/s the reads outrun the compute: the groups grow to
        // the last, which takes as many layers as the stages allow.
        assert_eq!(plan(1).last(), Some(&40), "{:?}", plan(1));
        // Eight ranks at once, an eighth of the store each: the reads are the slower, so the
        // groups shrink again towards the end and the last layers' share steps overlap them.
        let eight = plan(8);
        assert_eq!(eight[0], 1);
        assert!(*eight.last().unwrap() <= 2, "{eight:?}");
        assert!(
            eight.windows(2).rev().take(3).all(|w| w[0] >= w[1]),
            "{eight:?}"
        );
        assert_eq!(
            r.cost_planned(ShareMode::SplitAllGather, 8)
                .seconds_per_byte,
            8.0 * ReadGranularity::DEFAULT_PRIOR.seconds_per_byte
        );
        // A rank reading alone (rank 0 in Rank0Broadcast) plans from the prior as it is.
        assert_eq!(
            r.cost_planned(ShareMode::Rank0Broadcast, 1),
            ReadGranularity::DEFAULT_PRIOR
        );
        // Once a call in the mode was timed, its fit is what counts, whoever read at once.
        r.observe(
            ShareMode::SplitAllGather,
            10,
            bytes[..10].iter().sum(),
            Duration::from_millis(90),
        );
        assert_eq!(
            r.cost_planned(ShareMode::SplitAllGather, 8),
            r.cost(ShareMode::SplitAllGather)
        );
    }

    /// One call that failed for time, on a store otherwise healthy (2 ms a call, 0.4 ns a
    /// byte), leaves the plan reading layer 0 alone: it is taken at a few times its predicted
    /// time. Taken at its limit (20 s, or `Duration::MAX` for "forever"), it raised the fit's
    /// fixed cost to about 0.4 s (to about 10^14 s with `MAX`), and the plan read everything
    /// in one call, the first layer ready only with the last.
    #[test]
    fn one_call_that_failed_for_time_leaves_the_plan_reading_layer_0_alone() {
        for limit in [Duration::from_secs(20), Duration::MAX] {
            let r = ReadGroups::new(ReadGranularity::Adaptive {
                max_layers_per_call: u32::MAX,
                compute_per_layer: Some(Duration::from_millis(5)),
                prior: ReadGranularity::DEFAULT_PRIOR,
            });
            let healthy = |layers: u32, bytes: u64| {
                Duration::from_nanos(2_000_000 + bytes * 2 / 5)
                    + Duration::from_secs_f64(
                        f64::from(layers) * ReadGranularity::DEFAULT_PRIOR.per_layer.as_secs_f64(),
                    )
            };
            let layer = 21_495_808u64;
            for i in 0..300u32 {
                let layers = 1 + i % 8;
                let bytes = layer * u64::from(layers);
                r.observe(ShareMode::AllRanks, layers, bytes, healthy(layers, bytes));
            }
            let before = r.cost(ShareMode::AllRanks);
            r.observe_failed(ShareMode::AllRanks, (1, layer), limit, true);
            let after = r.cost(ShareMode::AllRanks);
            assert!(
                after.per_call < Duration::from_millis(20),
                "{limit:?}: {after:?}"
            );
            assert!(
                after.call_time(1, layer) > before.call_time(1, layer),
                "the failed call taught the fit something: {before:?} → {after:?}"
            );
            let g = r.plan(&glm(512), 79, unlimited(), ShareMode::AllRanks, 1);
            assert_eq!(g[0], 0..1, "{limit:?}: {:?}", sizes(&g));
        }
    }

    /// Calls that run into their limit one after another are taken at 4, 16, 64, ... times
    /// their prediction (at most the limit), so a store grown slow for good is learned within
    /// a few failed calls; a call that lands starts the count again. Early "RPC timeout"
    /// answers (an outage) stay at four times: they say nothing of a read's speed.
    #[test]
    fn calls_failing_for_time_in_a_row_are_taken_ever_slower_up_to_the_limit() {
        let healthy = |r: &ReadGroups| {
            for i in 0..300u32 {
                let layers = 1 + i % 8;
                let bytes = 21_495_808u64 * u64::from(layers);
                r.observe(
                    ShareMode::AllRanks,
                    layers,
                    bytes,
                    Duration::from_nanos(2_000_000 + bytes * 2 / 5),
                );
            }
        };
        let early = ReadGroups::new(ReadGranularity::ADAPTIVE);
        healthy(&early);
        let before = early.cost(ShareMode::AllRanks).call_time(1, 21_495_808);
        for _ in 0..6 {
            let call = (1, 21_495_808);
            early.observe_failed(ShareMode::AllRanks, call, Duration::from_secs(20), false);
        }
        let after = early.cost(ShareMode::AllRanks).call_time(1, 21_495_808);
        assert!(after < before * 4, "early answers: {before:?} → {after:?}");
        let r = ReadGroups::new(ReadGranularity::ADAPTIVE);
        let layer = 21_495_808u64;
        let limit = Duration::from_secs(20);
        // A healthy history first (2 ms a call, 0.4 ns a byte): one failure weighs little.
        healthy(&r);
        let predicted = |r: &ReadGroups| r.cost(ShareMode::AllRanks).call_time(1, layer);
        let start = predicted(&r);
        for _ in 0..6 {
            r.observe_failed(ShareMode::AllRanks, (1, layer), limit, true);
        }
        let after_six = predicted(&r);
        // Four times the prediction each (not escalating), the fit had moved by about half.
        assert!(
            after_six > start * 10,
            "six failures in a row: {start:?} → {after_six:?}"
        );
        assert!(after_six <= limit, "{after_six:?}");
        // A call that lands: the next failure counts four times its prediction again.
        r.observe(ShareMode::AllRanks, 1, layer, start);
        assert_eq!(r.failed_in_a_row.lock()[ShareMode::AllRanks.index()], 0);
        r.observe_failed(ShareMode::AllRanks, (1, layer), limit, true);
        assert_eq!(r.failed_in_a_row.lock()[ShareMode::AllRanks.index()], 1);
    }

    #[test]
    fn a_rank_that_reads_nothing_still_gets_groups_within_its_stages() {
        let r = ReadGroups::new(ReadGranularity::ADAPTIVE);
        let g = r.plan(&[0; 78], 4, unlimited(), ShareMode::AllRanks, 1);
        assert!(sizes(&g).iter().all(|&s| (1..=3).contains(&s)));
        assert_eq!(g.last().map(|r| r.end), Some(78));
    }
}
