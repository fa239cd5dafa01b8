//! The planner: which layers each store call reads.

use std::ops::Range;
use std::time::Duration;

use super::cost::ReadCost;

/// What the planner needs to know about one batch on one rank.
#[derive(Debug, Clone)]
pub struct ReadPlanRequest<'a> {
    /// Bytes this rank reads for each layer of the batch, in layer order (every component
    /// present on that layer, every page). Zero for a layer with nothing to read.
    pub layer_bytes: &'a [u64],
    /// What a store call costs (measured: [`ReadCostEstimator`](super::ReadCostEstimator)).
    pub cost: ReadCost,
    /// The engine's compute time per layer, measured (zero: the reads are not overlapped with
    /// anything, so only their total time counts).
    pub compute_per_layer: Duration,
    /// Most layers one call may cover (staging space, or a call's time against the layer read
    /// timeout). At least 1.
    pub max_layers_per_call: u32,
}

/// Why no plan was made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadPlanError {
    /// `max_layers_per_call` is 0.
    #[error("max_layers_per_call must be at least 1")]
    NoLayersPerCall,
    /// The cost has a negative or non-finite rate.
    #[error("the read cost has a negative or non-finite rate")]
    InvalidCost,
}

/// The groups of layers to read, one store call each, in order, and what the model predicts.
///
/// ```
/// use std::time::Duration;
/// use mooncake_linker::read_plan::{plan_reads, ReadCost, ReadPlanRequest};
/// // 78 layers of 21.5 MB; 20 ms per call, 2 GB/s (30.7 ms per one-layer call); 40 ms of
/// // compute per layer.
/// let bytes = vec![21_495_808u64; 78];
/// let plan = plan_reads(&ReadPlanRequest {
///     layer_bytes: &bytes,
///     cost: ReadCost::from_gbps(Duration::from_millis(20), Duration::ZERO, 2.0),
///     compute_per_layer: Duration::from_millis(40),
///     max_layers_per_call: 78,
/// })
/// .unwrap();
/// assert_eq!(plan.groups()[0], 0..1); // attention starts after one layer's read
/// assert!(plan.groups().len() < 10); // later layers share calls: 1 1 2 5 15 54
/// assert_eq!(plan.stall(), Duration::ZERO); // and arrive before compute needs them
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ReadPlan {
    groups: Vec<Range<u32>>,
    ready: Vec<f64>,
    compute: f64,
}

impl ReadPlan {
    /// The layer groups, tiling `0..layers` in order; one store call each.
    pub fn groups(&self) -> &[Range<u32>] {
        &self.groups
    }

    /// Predicted time from the first call's start until `layer` is ready (its group's call
    /// returned).
    pub fn ready(&self, layer: u32) -> Option<Duration> {
        self.ready.get(layer as usize).map(|&s| secs(s))
    }

    /// Predicted time until the engine may compute `layer`: after layer 0 is ready, one layer
    /// of compute each, waiting where a layer is late.
    pub fn compute_start(&self, layer: u32) -> Option<Duration> {
        self.starts().get(layer as usize).map(|&s| secs(s))
    }

    /// Predicted time until the last layer's compute ends.
    pub fn forward_done(&self) -> Duration {
        secs(self.starts().last().map_or(0.0, |s| s + self.compute))
    }

    /// Predicted time the engine waits for reads after layer 0 is ready.
    pub fn stall(&self) -> Duration {
        let starts = self.starts();
        let ideal = starts.first().copied().unwrap_or(0.0);
        let stall = starts
            .iter()
            .enumerate()
            .map(|(l, s)| s - (ideal + l as f64 * self.compute))
            .fold(0.0, f64::max);
        secs(stall)
    }

    fn starts(&self) -> Vec<f64> {
        let mut out = Vec::with_capacity(self.ready.len());
        let mut prev: Option<f64> = None;
        for &r in &self.ready {
            let s = prev.map_or(r, |p| r.max(p + self.compute));
            out.push(s);
            prev = Some(s);
        }
        out
    }
}

fn secs(s: f64) -> Duration {
    Duration::try_from_secs_f64(s.max(0.0)).unwrap_or(Duration::MAX)
}

/// Relative tolerance of time comparisons (floating-point sums).
const EPS: f64 = 1e-9;

/// Chooses the layer groups of one batch's reads.
///
/// Model: calls run one after another from time 0; layer *l* is ready when its group's call
/// returns; the engine computes layer 0 as soon as it is ready, then one layer per
/// `compute_per_layer`, waiting for any layer not yet ready.
///
/// - With compute to overlap (`compute_per_layer > 0`), layer 0 is read alone, so the first
///   layer is ready within one layer's read and attention starts at once. The later groups
///   then finish the forward pass (the last layer's compute) as early as the model allows,
///   with the fewest calls that do: they grow while the reads stay ahead of compute, and
///   whenever reads can keep ahead at all, no layer is predicted ready later than compute
///   needs it.
/// - With no compute, only the reads' total time counts: the fewest calls, as large as
///   `max_layers_per_call` allows (the first group takes the remainder, so it is the smallest).
pub fn plan_reads(req: &ReadPlanRequest<'_>) -> Result<ReadPlan, ReadPlanError> {
    if req.max_layers_per_call == 0 {
        return Err(ReadPlanError::NoLayersPerCall);
    }
    if !req.cost.is_valid() {
        return Err(ReadPlanError::InvalidCost);
    }
    let model = Model::new(req);
    let n = model.layers();
    let compute = req.compute_per_layer.as_secs_f64();
    if n == 0 {
        return Ok(ReadPlan {
            groups: Vec::new(),
            ready: Vec::new(),
            compute,
        });
    }
    let groups = if compute > 0.0 {
        let best = model.min_forward_done(Some(1));
        let limit = best * (1.0 + EPS) + EPS;
        model
            .cheapest(limit, Some(1))
            .or_else(|| model.cheapest(f64::INFINITY, Some(1)))
    } else {
        Some(model.fastest_reads())
    }
    // Not reached (a plan without a deadline always exists): groups of the most layers a call
    // may read, should it ever be.
    .unwrap_or_else(|| {
        (0..n)
            .step_by(model.max)
            .map(|s| s as u32..(s + model.max).min(n) as u32)
            .collect()
    });
    let mut ready = vec![0.0; n];
    let mut t = 0.0;
    for g in &groups {
        t += model.call(g.start as usize, g.end as usize);
        for r in &mut ready[g.start as usize..g.end as usize] {
            *r = t;
        }
    }
    Ok(ReadPlan {
        groups,
        ready,
        compute,
    })
}

/// Prefix sums of the request, for O(1) call times.
struct Model {
    /// `prefix[l]`: bytes of layers `0..l`.
    prefix: Vec<u64>,
    cost: ReadCost,
    compute: f64,
    max: usize,
}

impl Model {
    fn new(req: &ReadPlanRequest<'_>) -> Self {
        let mut prefix = Vec::with_capacity(req.layer_bytes.len() + 1);
        let mut acc = 0u64;
        prefix.push(0);
        for &b in req.layer_bytes {
            acc = acc.saturating_add(b);
            prefix.push(acc);
        }
        Self {
            prefix,
            cost: req.cost,
            compute: req.compute_per_layer.as_secs_f64(),
            // At least one layer a call, and no more than there are (so that `s + max` stays
            // within twice the layer count on any target).
            max: (req.max_layers_per_call as usize).clamp(1, req.layer_bytes.len().max(1)),
        }
    }

    fn layers(&self) -> usize {
        self.prefix.len() - 1
    }

    /// Seconds of one call reading layers `s..e`.
    fn call(&self, s: usize, e: usize) -> f64 {
        self.cost
            .seconds((e - s) as u32, self.prefix[e] - self.prefix[s])
    }

    /// Latest a group starting at layer `s` may return for the forward pass to end by `limit`
    /// (its first layer's compute, and all after it, must still fit).
    fn deadline(&self, limit: f64, s: usize) -> f64 {
        limit - (self.layers() - s) as f64 * self.compute
    }

    /// The fewest-calls plan whose forward pass ends by `limit`, with a first group of exactly
    /// `first` layers (any first group: `None`); `None` if there is no such plan.
    ///
    /// Dynamic programming over group boundaries: `best[e]` is the earliest the reads of layers
    /// `0..e` can be done (fewest calls on ties) with every group so far returning by its
    /// deadline. With a positive per-call cost, earlier is fewer calls: the same bytes, fewer
    /// call costs.
    fn cheapest(&self, limit: f64, first: Option<usize>) -> Option<Vec<Range<u32>>> {
        let n = self.layers();
        // best[e] = (reads done at, calls, previous boundary) for layers 0..e read.
        let mut best: Vec<Option<(f64, usize, usize)>> = vec![None; n + 1];
        best[0] = Some((0.0, 0, 0));
        for s in 0..n {
            let Some((at, calls, _)) = best[s] else {
                continue;
            };
            let deadline = self.deadline(limit, s) * (1.0 + EPS) + EPS;
            let ends = match (s, first) {
                (0, Some(f)) if f <= n => f..f + 1,
                (0, Some(_)) => return None,
                _ => s + 1..(s + self.max).min(n) + 1,
            };
            for e in ends {
                let done = at + self.call(s, e);
                if done > deadline {
                    break; // longer groups only return later
                }
                let better = match best[e] {
                    None => true,
                    Some((t, c, _)) => {
                        done < t * (1.0 - EPS) - EPS
                            || (done <= t * (1.0 + EPS) + EPS && calls + 1 < c)
                    }
                };
                if better {
                    best[e] = Some((done, calls + 1, s));
                }
            }
        }
        let mut groups = Vec::new();
        let mut e = n;
        while e > 0 {
            let (_, _, s) = best[e]?;
            groups.push(s as u32..e as u32);
            e = s;
        }
        groups.reverse();
        Some(groups)
    }

    /// No compute: the groups with the least total read time (fewest calls on ties), and among
    /// those the smallest first group. `rest[s]` is the least time (and calls) to read layers
    /// `s..n`, computed backwards.
    fn fastest_reads(&self) -> Vec<Range<u32>> {
        let n = self.layers();
        let mut rest: Vec<(f64, usize, usize)> = vec![(f64::INFINITY, usize::MAX, n); n + 1];
        rest[n] = (0.0, 0, n);
        for s in (0..n).rev() {
            for e in s + 1..=(s + self.max).min(n) {
                let (t, c, _) = rest[e];
                let cand = (t + self.call(s, e), c + 1, e);
                let (bt, bc, _) = rest[s];
                if cand.0 < bt * (1.0 - EPS) - EPS
                    || (cand.0 <= bt * (1.0 + EPS) + EPS && cand.1 < bc)
                {
                    rest[s] = cand;
                }
            }
        }
        let best = rest[0].0 * (1.0 + EPS) + EPS;
        let calls = rest[0].1;
        // The smallest first group that keeps both the best time and the fewest calls.
        let first = (1..=self.max.min(n))
            .find(|&f| {
                let (t, c, _) = rest[f];
                self.call(0, f) + t <= best && c < calls
            })
            .unwrap_or(rest[0].2);
        let mut groups: Vec<Range<u32>> = std::iter::once(0..first as u32).collect();
        let mut s = first;
        while s < n {
            let e = rest[s].2;
            groups.push(s as u32..e as u32);
            s = e;
        }
        groups
    }

    /// The earliest the forward pass can end with a first group of `first` layers (any:
    /// `None`), by bisection over finishing times.
    fn min_forward_done(&self, first: Option<usize>) -> f64 {
        let n = self.layers();
        // Lower bound: layer 0 read alone, then every layer computed without a wait.
        let mut lo = self.call(0, 1) + n as f64 * self.compute;
        // Upper bound (feasible): the first group, then the largest groups, then all compute.
        let head = first.unwrap_or(self.max).min(n);
        let all_reads: f64 = self.call(0, head)
            + (head..n)
                .step_by(self.max)
                .map(|s| self.call(s, (s + self.max).min(n)))
                .sum::<f64>();
        let mut hi = all_reads + n as f64 * self.compute;
        if self.cheapest(lo, first).is_some() {
            return lo;
        }
        for _ in 0..60 {
            let mid = 0.5 * (lo + hi);
            if self.cheapest(mid, first).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
            if hi - lo <= hi * 1e-10 {
                break;
            }
        }
        hi
    }
}
