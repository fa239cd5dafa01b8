//! Properties of the read plan, checked against an independent simulation and, for few
//! layers, against every possible grouping.

use std::ops::Range;
use std::time::Duration;

use proptest::prelude::*;

use super::*;

/// Forward-done and layer-0-ready times of `groups`, simulated independently of the planner.
fn simulate(bytes: &[u64], cost: &ReadCost, compute: f64, groups: &[Range<u32>]) -> (f64, f64) {
    let mut ready = vec![0.0; bytes.len()];
    let mut t = 0.0;
    for g in groups {
        let b: u64 = bytes[g.start as usize..g.end as usize].iter().sum();
        t += cost.per_call.as_secs_f64()
            + (g.end - g.start) as f64 * cost.per_layer.as_secs_f64()
            + b as f64 * cost.seconds_per_byte;
        for l in g.start..g.end {
            ready[l as usize] = t;
        }
    }
    let mut start: f64 = 0.0;
    for (l, r) in ready.iter().enumerate() {
        start = if l == 0 { *r } else { r.max(start + compute) };
    }
    (start + compute, ready.first().copied().unwrap_or(0.0))
}

/// Every grouping of `n` layers into consecutive groups of at most `max`.
fn all_groupings(n: u32, max: u32) -> Vec<Vec<Range<u32>>> {
    if n == 0 {
        return vec![Vec::new()];
    }
    let mut out = Vec::new();
    for first in 1..=max.min(n) {
        for rest in all_groupings(n - first, max) {
            let g: Vec<Range<u32>> = std::iter::once(0..first)
                .chain(rest.into_iter().map(|r| r.start + first..r.end + first))
                .collect();
            out.push(g);
        }
    }
    out
}

fn tiles(groups: &[Range<u32>], n: u32, max: u32) -> bool {
    let mut next = 0;
    for g in groups {
        if g.start != next || g.end <= g.start || g.end - g.start > max {
            return false;
        }
        next = g.end;
    }
    next == n
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * a.abs().max(b.abs()) + 1e-9
}

fn cost_strategy() -> impl Strategy<Value = ReadCost> {
    (0u64..5_000, 0u64..500, 1u32..100).prop_map(|(call_us, layer_us, dgbps)| {
        ReadCost::from_gbps(
            Duration::from_micros(call_us),
            Duration::from_micros(layer_us),
            f64::from(dgbps) / 10.0,
        )
    })
}

/// No compute and no per-call cost: every grouping ends the reads at once, and the plan takes
/// the fewest calls (the documented order without compute). The property test's oracle
/// ranked layer 0's ready time first here and would have failed on this input.
#[test]
fn without_compute_or_per_call_cost_the_fewest_calls_win() {
    let bytes = [1_000_000u64, 1_000_000];
    let req = ReadPlanRequest {
        layer_bytes: &bytes,
        cost: ReadCost::from_gbps(Duration::ZERO, Duration::from_micros(100), 1.0),
        compute_per_layer: Duration::ZERO,
        max_layers_per_call: 2,
    };
    let plan = plan_reads(&req).unwrap();
    assert_eq!(plan.groups().len(), 1);
    assert_eq!(plan.groups()[0], 0..2);
}

proptest! {
    /// Few layers: the plan is optimal among all groupings (with compute: those reading layer 0
    /// alone), in the planner's order of goals: forward done, then layer 0 ready, then calls
    /// (without compute: forward done, then calls, then layer 0 ready).
    #[test]
    fn optimal_against_every_grouping(
        bytes in prop::collection::vec(0u64..50_000_000, 1..9),
        cost in cost_strategy(),
        compute_us in 0u64..20_000,
        max in 1u32..10,
    ) {
        let compute = Duration::from_micros(compute_us);
        let req = ReadPlanRequest {
            layer_bytes: &bytes,
            cost,
            compute_per_layer: compute,
            max_layers_per_call: max,
        };
        let plan = plan_reads(&req).unwrap();
        let n = bytes.len() as u32;
        prop_assert!(tiles(plan.groups(), n, max));
        let c = compute.as_secs_f64();
        let (done, first) = simulate(&bytes, &cost, c, plan.groups());
        prop_assert!(close(done, plan.forward_done().as_secs_f64()));
        // With compute, layer 0 is read alone; without, any grouping competes.
        if c > 0.0 {
            prop_assert_eq!(plan.groups()[0].clone(), 0..1);
        }
        let all: Vec<(f64, f64, usize)> = all_groupings(n, max)
            .iter()
            .filter(|g| c == 0.0 || g[0] == (0..1))
            .map(|g| {
                let (d, f) = simulate(&bytes, &cost, c, g);
                (d, f, g.len())
            })
            .collect();
        let best_done = all.iter().map(|a| a.0).fold(f64::INFINITY, f64::min);
        prop_assert!(done <= best_done + 1e-6 * best_done + 1e-9, "{done} > {best_done}");
        let done_best: Vec<&(f64, f64, usize)> =
            all.iter().filter(|a| close(a.0, best_done)).collect();
        let earliest = |of: &[&(f64, f64, usize)]| {
            of.iter().map(|a| a.1).fold(f64::INFINITY, f64::min)
        };
        if c > 0.0 {
            // Then layer 0 ready, then calls.
            let best_first = earliest(&done_best);
            prop_assert!(first <= best_first + 1e-6 * best_first + 1e-9);
            let fewest = done_best
                .iter()
                .filter(|a| close(a.1, best_first))
                .map(|a| a.2)
                .min()
                .unwrap();
            prop_assert!(plan.groups().len() <= fewest);
        } else {
            // No compute to overlap: then calls (the fewest), then layer 0 ready. (With a
            // per-call cost of zero every grouping ends at once, and the two orders differ.)
            let fewest = done_best.iter().map(|a| a.2).min().unwrap();
            prop_assert!(plan.groups().len() <= fewest);
            let of_fewest: Vec<&(f64, f64, usize)> =
                done_best.iter().copied().filter(|a| a.2 == fewest).collect();
            let best_first = earliest(&of_fewest);
            prop_assert!(first <= best_first + 1e-6 * best_first + 1e-9);
        }
    }

    /// GLM-5.2's 78 layers (indexer on 21): the groups tile the layers in order; when one-layer
    /// reads keep ahead of compute, the first group is one layer and no layer is late.
    #[test]
    fn reads_stay_ahead_of_compute_when_they_can(
        pages in 1u64..2048,
        cost in cost_strategy(),
        compute_us in 0u64..50_000,
        max in 1u32..=78,
    ) {
        let bytes: Vec<u64> = (0..78u64)
            .map(|l| pages * (41_984 + if l % 4 == 0 { 8_448 } else { 0 }))
            .collect();
        let compute = Duration::from_micros(compute_us);
        let plan = plan_reads(&ReadPlanRequest {
            layer_bytes: &bytes,
            cost,
            compute_per_layer: compute,
            max_layers_per_call: max,
        })
        .unwrap();
        prop_assert!(tiles(plan.groups(), 78, max));
        let c = compute.as_secs_f64();
        let single = |b: u64| cost.per_call.as_secs_f64()
            + cost.per_layer.as_secs_f64()
            + b as f64 * cost.seconds_per_byte;
        let lower = single(bytes[0]) + 78.0 * c;
        let done = plan.forward_done().as_secs_f64();
        prop_assert!(done >= lower * (1.0 - 1e-9) - 1e-9);
        let keeps_up = bytes.iter().all(|&b| single(b) <= c);
        if keeps_up {
            prop_assert_eq!(plan.groups()[0].clone(), 0..1);
            prop_assert!(close(done, lower));
            prop_assert_eq!(plan.stall(), Duration::ZERO);
            let r0 = plan.ready(0).unwrap().as_secs_f64();
            for l in 0..78u32 {
                let ready = plan.ready(l).unwrap().as_secs_f64();
                prop_assert!(ready <= r0 + f64::from(l) * c + 1e-9, "layer {l} late");
            }
        }
        // Never worse than reading layer 0 alone (with compute), then the largest groups.
        let head = if c > 0.0 { 1 } else { max };
        let largest: Vec<Range<u32>> = std::iter::once(0..head)
            .chain((head..78u32).step_by(max as usize).map(|s| s..(s + max).min(78)))
            .collect();
        let (naive, _) = simulate(&bytes, &cost, c, &largest);
        prop_assert!(done <= naive * (1.0 + 1e-9) + 1e-9);
    }

    /// No compute: only the total read time counts, so the fewest calls.
    #[test]
    fn zero_compute_reads_in_the_largest_groups(
        pages in 1u64..2048,
        cost in cost_strategy(),
        max in 1u32..=78,
    ) {
        let bytes = vec![pages * 41_984; 78];
        let plan = plan_reads(&ReadPlanRequest {
            layer_bytes: &bytes,
            cost,
            compute_per_layer: Duration::ZERO,
            max_layers_per_call: max,
        })
        .unwrap();
        prop_assert!(tiles(plan.groups(), 78, max));
        prop_assert_eq!(plan.groups().len() as u32, 78u32.div_ceil(max));
    }
}

#[test]
fn edge_cases() {
    let cost = ReadCost::from_gbps(Duration::from_millis(1), Duration::ZERO, 1.0);
    let req = |bytes: &'static [u64], max| ReadPlanRequest {
        layer_bytes: bytes,
        cost,
        compute_per_layer: Duration::from_millis(1),
        max_layers_per_call: max,
    };
    assert_eq!(
        plan_reads(&req(&[1, 2], 0)),
        Err(ReadPlanError::NoLayersPerCall)
    );
    let empty = plan_reads(&req(&[], 4)).unwrap();
    assert!(empty.groups().is_empty());
    assert_eq!(empty.forward_done(), Duration::ZERO);
    assert_eq!(empty.ready(0), None);
    let mut bad = req(&[1], 1);
    bad.cost.seconds_per_byte = f64::NAN;
    assert_eq!(plan_reads(&bad), Err(ReadPlanError::InvalidCost));
    bad.cost.seconds_per_byte = -1.0;
    assert_eq!(plan_reads(&bad), Err(ReadPlanError::InvalidCost));
}

#[test]
fn glm_prefix_groups_follow_compute() {
    // 512 pages of GLM-5.2 KV per layer (21.5 MB); 20 ms per call, 2 GB/s: 30.7 ms per
    // single-layer call.
    let bytes = vec![512 * 41_984u64; 78];
    let cost = ReadCost::from_gbps(Duration::from_millis(20), Duration::ZERO, 2.0);
    let plan = |compute_ms: u64| {
        plan_reads(&ReadPlanRequest {
            layer_bytes: &bytes,
            cost,
            compute_per_layer: Duration::from_millis(compute_ms),
            max_layers_per_call: 78,
        })
        .unwrap()
    };
    let sizes = |p: &ReadPlan| -> Vec<u32> { p.groups().iter().map(|g| g.end - g.start).collect() };
    // Compute slower than a one-layer read: one layer first, growing groups, nothing late.
    let slow = plan(40);
    let s = sizes(&slow);
    assert_eq!(s[0], 1);
    assert!(s.windows(2).all(|w| w[0] <= w[1]), "{s:?}");
    assert_eq!(slow.stall(), Duration::ZERO);
    assert_eq!(slow.ready(0), Some(cost.call_time(1, bytes[0])));
    // Compute faster than reads can follow: still one layer first, then few calls.
    let fast = plan(5);
    assert_eq!(sizes(&fast)[0], 1);
    assert!(fast.groups().len() < 10, "{:?}", sizes(&fast));
    // No compute: one call for everything.
    assert_eq!(sizes(&plan(0)), vec![78]);
}
