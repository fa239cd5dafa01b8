//! Correctness on N ranks of a fabric (N ranks on one GPU with the in-process device group, or
//! one rank per GPU over NCCL), through the Linker into device pools: every mode lands the
//! saved bytes in every rank's device pool at that rank's own scattered slots; a plan that
//! differs on one rank falls back to `AllRanks`; a read failure on rank 0, a middle rank or
//! the last rank at a middle layer fails the batch on every rank with the same error, within
//! the deadline, and the next batch loads.

use std::sync::Arc;
use std::time::Duration;

use kvlink::kv_loader::{KvLoadError, LoadStats, ShareMode};
use kvlink::mooncake_linker::store::{Fault, FaultRule, FaultyStore, KvStore, StoreError};
use kvlink::mooncake_linker::Linker;

use super::Args;
use kvlink_rig::measure::{fmt_bytes, fmt_tokens};
use kvlink_rig::pattern::Rng;
use kvlink_rig::ranks::all_ok;
use kvlink_rig::report::{Report, Status};
use kvlink_rig::tp::{
    clear_pools, close_all, compare_all, config, effective, linkers, plan, rank_devs, run_batch,
    save_prefix, Fabric, Groups, Prefix, RankDev, RankRun, MODES,
};

const SEC: &str = "correctness";

/// Longest a rank may take to learn that a batch failed: well under the collective timeout,
/// so no rank waited for a deadline.
const FAIL_WITHIN_MS: f64 = 10_000.0;

struct Ctx<'a> {
    tp: u32,
    devs: &'a [RankDev],
    slots: &'a [Vec<u32>],
    prefix: &'a Prefix,
    faults: Vec<Arc<FaultyStore>>,
    linkers: Vec<Linker>,
    layers: u32,
    batch: u64,
}

impl Ctx<'_> {
    fn next_batch(&mut self) -> u64 {
        self.batch += 1;
        self.batch
    }

    /// Every rank's plan of the whole prefix into its own slots.
    fn plans(&self, batch: u64, odd_rank: Option<usize>) -> Vec<kvlink::kv_loader::BatchPlan> {
        self.devs
            .iter()
            .enumerate()
            .map(|(r, d)| {
                let request = if odd_rank == Some(r) {
                    "another-request-id"
                } else {
                    "tp-gpu"
                };
                plan(
                    &d.g,
                    batch,
                    request,
                    &self.prefix.pages,
                    self.slots[r].clone(),
                )
            })
            .collect()
    }

    fn run(&mut self, odd_rank: Option<usize>) -> Result<Vec<RankRun>, String> {
        // SAFETY: before the batch; the previous batch's outcomes were taken by `run_batch`
        // (a failure ends the check).
        unsafe { clear_pools(self.devs) }?;
        let b = self.next_batch();
        all_ok(run_batch(&self.linkers, self.plans(b, odd_rank)))
    }

    /// Every rank loaded in `want` mode and landed one whole copy; returns the stats.
    fn loaded(&self, runs: &[RankRun], want: ShareMode) -> Result<Vec<LoadStats>, String> {
        let mut out = Vec::new();
        for (r, run) in runs.iter().enumerate() {
            let stats = run
                .outcome
                .result
                .as_ref()
                .map_err(|e| format!("rank {r}: batch failed: {e}"))?;
            if let Some((l, e)) = &run.wait_error {
                return Err(format!("rank {r}: wait on layer {l}: {e}"));
            }
            if stats.mode != want {
                return Err(format!(
                    "rank {r}: mode {:?}, expected {want:?}",
                    stats.mode
                ));
            }
            if stats.bytes_landed != self.prefix.bytes {
                return Err(format!(
                    "rank {r}: {} B landed, expected one copy = {} B",
                    stats.bytes_landed, self.prefix.bytes
                ));
            }
            out.push(stats.clone());
        }
        Ok(out)
    }

    fn compare(&self, upto: u32) -> Result<u64, String> {
        // SAFETY: called after `run` took every rank's outcome: nothing writes the pools.
        unsafe { compare_all(self.devs, self.slots, upto, &|_| true) }
    }
}

/// Store bytes read per rank as each mode must: every rank one copy (`AllRanks`); rank 0 one
/// copy, the others none (`Rank0Broadcast`); shares that add up to one copy
/// (`SplitAllGather`).
fn check_reads(mode: ShareMode, reads: &[u64], one_copy: u64) -> Result<(), String> {
    let total: u64 = reads.iter().sum();
    let ok = match mode {
        ShareMode::AllRanks => reads.iter().all(|&b| b == one_copy),
        ShareMode::Rank0Broadcast => {
            reads.first() == Some(&one_copy) && reads.iter().skip(1).all(|&b| b == 0)
        }
        ShareMode::SplitAllGather => {
            total == one_copy && (reads.len() == 1 || reads.iter().all(|&b| b < one_copy))
        }
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{mode:?}: store bytes read per rank {reads:?} (total {total}); one copy is {one_copy}"
        ))
    }
}

/// The correctness checks of one fabric.
pub fn run(args: &Args, fabric: Fabric, report: &mut Report) {
    let tp = fabric.tp();
    let label = fabric.label();
    let n = if args.quick { 32 } else { 64 };
    let pool_pages = 2 * n as u32 + 8;
    let prefix = match save_prefix(tp, n, 7, args.threads) {
        Ok(p) => p,
        Err(e) => return report.push(SEC, format!("{label}: save the prefix"), Status::Fail, e),
    };
    report.info(
        SEC,
        format!("{label}: prefix saved by rank 0 into ONE embedded store (in-process)"),
        format!(
            "{n} pages = {} tokens, {} per copy, {:.1} s",
            fmt_tokens(n as u64 * 64),
            fmt_bytes(prefix.bytes),
            prefix.fill_s
        ),
    );
    let devs = match rank_devs(false, fabric, pool_pages, n) {
        Ok(d) => d,
        Err(e) => return report.push(SEC, format!("{label}: device pools"), Status::Fail, e),
    };
    let mut groups = Groups::new(fabric, devs.iter().map(|d| d.dev.clone()).collect());
    let groups = &mut groups;
    // Every rank its own scattered slots (different on every rank).
    let slots: Vec<Vec<u32>> = (0..tp)
        .map(|r| {
            Rng(0x5eed + 7919 * u64::from(r))
                .scattered_slots(n, pool_pages)
                .expect("fewer slots than pages")
        })
        .collect();
    let layers = devs[0].g.num_layers();
    for mode in MODES {
        let name = format!("{label}, {mode:?}");
        let faults: Vec<Arc<FaultyStore>> = (0..tp)
            .map(|_| Arc::new(FaultyStore::new(prefix.store.clone())))
            .collect();
        let stores: Vec<Arc<dyn KvStore>> = faults
            .iter()
            .map(|f| f.clone() as Arc<dyn KvStore>)
            .collect();
        let cfg = config(mode, Duration::from_secs(20), Duration::from_secs(60));
        let built = groups.get().and_then(|g| linkers(&devs, &stores, g, &cfg));
        let ls = match built {
            Ok(l) => l,
            Err(e) => {
                report.push(SEC, format!("{name}: linkers"), Status::Fail, e);
                groups.reset();
                continue;
            }
        };
        let mut ctx = Ctx {
            tp,
            devs: &devs,
            slots: &slots,
            prefix: &prefix,
            faults,
            linkers: ls,
            layers,
            batch: 0,
        };
        let mut ok = report.check(
            SEC,
            &format!("{name}: every rank's device pool = saved bytes (own scattered slots)"),
            || load(&mut ctx, mode),
        );
        if mode != ShareMode::AllRanks {
            ok &= report.check(
                SEC,
                &format!(
                    "{name}: rank {}'s request id differs → AllRanks on every rank, bytes right",
                    tp - 1
                ),
                || mismatch(&mut ctx, mode),
            );
        }
        // Rank 0, a middle rank, the last rank.
        let mut fail_ranks = vec![0u32, tp / 2, tp - 1];
        fail_ranks.dedup();
        for fr in fail_ranks {
            // A rank that reads nothing in this mode (not rank 0 in Rank0Broadcast) is not a
            // failure case: the row says what it checks (the fault armed there is never
            // reached, and every rank loads).
            let what = if reads_in(effective(mode, tp), fr) {
                format!(
                    "{name}: read failure on rank {fr} at layer {} → same outcome on every rank",
                    layers / 2
                )
            } else {
                format!(
                    "{name}: a read fault armed on rank {fr}, which reads nothing in this mode \
                     → never reached, every rank loads"
                )
            };
            ok &= report.check(SEC, &what, || failure(&mut ctx, mode, fr));
        }
        if let Err(e) = close_all(std::mem::take(&mut ctx.linkers)) {
            report.push(SEC, format!("{name}: close"), Status::Fail, e);
            // A batch may still write the pools: no later mode may clear or compare them.
            report.push(
                SEC,
                format!("{name}: the modes after it"),
                Status::Skip,
                "not run: the linkers could not be closed",
            );
            break;
        }
        if !ok {
            // A failed check may have left a communicator aborted: start the next mode on
            // fresh ones.
            groups.reset();
        }
    }
    groups.reset();
}

fn load(ctx: &mut Ctx<'_>, mode: ShareMode) -> Result<String, String> {
    let want = effective(mode, ctx.tp);
    let runs = ctx.run(None)?;
    let stats = ctx.loaded(&runs, want)?;
    let reads: Vec<u64> = stats.iter().map(|s| s.bytes_read).collect();
    check_reads(want, &reads, ctx.prefix.bytes)?;
    let compared = ctx.compare(ctx.layers)?;
    let slowest = runs
        .iter()
        .map(|r| r.ready_ms.last().copied().unwrap_or(f64::NAN))
        .fold(0.0, f64::max);
    let total: u64 = reads.iter().sum();
    Ok(format!(
        "{} rank(s) × {} pages, mode {want:?}{}; {} compared; store read per rank [{}] = {} (AllRanks: {}); slowest rank {slowest:.0} ms",
        ctx.tp,
        ctx.prefix.pages.len(),
        if want != mode { " (one rank reads alone)" } else { "" },
        fmt_bytes(compared),
        reads.iter().map(|&b| fmt_bytes(b)).collect::<Vec<_>>().join(", "),
        fmt_bytes(total),
        fmt_bytes(ctx.prefix.bytes * u64::from(ctx.tp)),
    ))
}

fn mismatch(ctx: &mut Ctx<'_>, mode: ShareMode) -> Result<String, String> {
    let odd = ctx.tp as usize - 1;
    let runs = ctx.run(Some(odd))?;
    ctx.loaded(&runs, ShareMode::AllRanks)
        .map_err(|e| format!("plans differ: {e}"))?;
    let compared = ctx.compare(ctx.layers)?;
    // The next batch, with agreeing plans, shares again.
    let want = effective(mode, ctx.tp);
    let runs = ctx.run(None)?;
    ctx.loaded(&runs, want)
        .map_err(|e| format!("next batch, plans agree: {e}"))?;
    ctx.compare(ctx.layers)?;
    Ok(format!(
        "every rank AllRanks, {} compared; the next batch (plans agree) ran {want:?}{}",
        fmt_bytes(compared),
        if ctx.tp == 1 {
            " (one rank: no peer to differ from; trivially)"
        } else {
            ""
        }
    ))
}

/// Does `rank` read any replicated bytes in `mode`?
fn reads_in(mode: ShareMode, rank: u32) -> bool {
    match mode {
        ShareMode::AllRanks | ShareMode::SplitAllGather => true,
        ShareMode::Rank0Broadcast => rank == 0,
    }
}

fn failure(ctx: &mut Ctx<'_>, mode: ShareMode, fail_rank: u32) -> Result<String, String> {
    let mid = ctx.layers / 2;
    let want = effective(mode, ctx.tp);
    let k = ctx.devs[0]
        .g
        .component_by_name("k")
        .map_err(|e| e.to_string())?
        .clone();
    // The first read of any page's `k` at layer `mid` on that rank's store fails.
    ctx.faults[fail_rank as usize].inject(
        FaultRule {
            key_contains: Some("_k".into()),
            offset: k.layer_range(mid).map(|r| r.start),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
    );
    let runs = ctx.run(None);
    let hit = ctx.faults[fail_rank as usize].faults_hit();
    for f in &ctx.faults {
        f.clear();
    }
    let runs = runs?;
    let slowest_ms = runs.iter().map(|r| r.outcome_ms).fold(0.0, f64::max);
    let verdict = if reads_in(want, fail_rank) {
        if hit == 0 {
            return Err(format!(
                "rank {fail_rank}'s injected read failure was never hit"
            ));
        }
        let mut errs = Vec::new();
        for (r, run) in runs.iter().enumerate() {
            match &run.outcome.result {
                Ok(_) => return Err(format!("rank {r}: the batch was reported loaded")),
                Err(e) => errs.push(e.clone()),
            }
            match &run.wait_error {
                Some((l, _)) if *l == mid => {}
                other => {
                    return Err(format!(
                        "rank {r}: expected the wait on layer {mid} to fail, got {other:?} after {} ready layers",
                        run.ready_ms.len()
                    ))
                }
            }
        }
        let first = errs[0].to_string();
        if let Some((r, e)) = errs
            .iter()
            .enumerate()
            .find(|(_, e)| !same_failure(e, &errs[0]))
        {
            return Err(format!(
                "outcomes differ: rank 0 \"{first}\", rank {r} \"{e}\""
            ));
        }
        if errs[0].layer() != Some(mid) {
            return Err(format!(
                "the error names layer {:?}, not {mid}: {first}",
                errs[0].layer()
            ));
        }
        if ctx.tp > 1 {
            match &errs[0] {
                KvLoadError::PeerFailed { rank, .. } if *rank == fail_rank => {}
                other => {
                    return Err(format!(
                        "expected PeerFailed naming rank {fail_rank}, got {other}"
                    ))
                }
            }
        }
        if slowest_ms > FAIL_WITHIN_MS {
            return Err(format!(
                "the last rank learned of the failure after {slowest_ms:.0} ms (limit {FAIL_WITHIN_MS:.0} ms): a rank waited for a deadline"
            ));
        }
        // What landed before the failure is right on every rank.
        ctx.compare(mid)
            .map_err(|e| format!("layers below {mid}: {e}"))?;
        format!("every rank within {slowest_ms:.0} ms: \"{first}\"; layers 0..{mid} right on every rank")
    } else {
        // Rank `fail_rank` reads nothing in this mode: the armed fault is never reached.
        if hit != 0 {
            return Err(format!(
                "rank {fail_rank} reads nothing in {want:?}, yet its fault was hit {hit} times"
            ));
        }
        ctx.loaded(&runs, want).map_err(|e| {
            format!("rank {fail_rank} reads nothing in {want:?}, yet the batch failed: {e}")
        })?;
        ctx.compare(ctx.layers)?;
        format!("rank {fail_rank} reads nothing in {want:?}: the fault is never reached, every rank loaded ({slowest_ms:.0} ms)")
    };
    // The next batch loads on every rank.
    let runs = ctx.run(None)?;
    ctx.loaded(&runs, want)
        .map_err(|e| format!("next batch after the failure: {e}"))?;
    ctx.compare(ctx.layers)
        .map_err(|e| format!("next batch after the failure: {e}"))?;
    Ok(format!(
        "{verdict}; the next batch loaded all {} layers",
        ctx.layers
    ))
}

/// Two ranks' outcomes of one failed batch say the same: for `PeerFailed`, the same rank,
/// layer and code (the rank that failed adds its own error's words to the code).
fn same_failure(a: &KvLoadError, b: &KvLoadError) -> bool {
    match (a, b) {
        (
            KvLoadError::PeerFailed {
                rank: ra,
                layer: la,
                detail: da,
                ..
            },
            KvLoadError::PeerFailed {
                rank: rb,
                layer: lb,
                detail: db,
                ..
            },
        ) => ra == rb && la == lb && (da.starts_with(db.as_str()) || db.starts_with(da.as_str())),
        _ => a.to_string() == b.to_string(),
    }
}
