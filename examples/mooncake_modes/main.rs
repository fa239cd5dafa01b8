//! `mooncake_modes`: the reference table of the dedup modes against a real Mooncake Store.
//!
//! For each prefix size (`--tokens`), a GLM-5.2 FP8 prefix is saved by rank 0 (objects and
//! checksum companions) to the storage node(s) the master runs with; then for each pool kind
//! (`--pools`: host pools; device pools on GPU 0 with every rank on it; one rank per GPU over
//! NCCL; CPU devices as a dry run) and each TP size (`--tp`), the ranks (threads of this
//! process, one Mooncake client each, no segment of their own: every byte crosses TCP from a
//! storage node) load it in every mode: `AllRanks`, `Rank0Broadcast`, `SplitAllGather`
//! (`--reps` measured batches each), and `Auto` (`--auto-runs` fresh runs, each measuring until
//! it keeps a mode, then measured). Each rank's engine thread waits for each layer and then
//! computes it for a MODELLED time (compute.rs). Every pool is zeroed before each mode's last
//! batch and verified row by row against the saved bytes' checksums afterwards.
//!
//! Per (pools, size) a markdown file goes to `--out` (default `$OUT`):
//! `mooncake_modes_<machine>_<pools>_<tokens>_n<storage nodes>.md`, with the table, the
//! seed's table beside it at 128K, Auto's picks, and the result rows ending in
//! `N passed, N failed`. Exit status 0 when every check passed (and one at least), 1 otherwise
//! (a run whose every size was skipped included), 2 when the store or the pools are not
//! available.

#![allow(clippy::print_stdout, clippy::print_stderr)]

mod args;
mod compute;
mod prefix;
mod report;
mod rig;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_loader::ShareMode;
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::KvStore;
use tracing_subscriber::EnvFilter;

use args::{Args, Pools};
use kvlink_rig::measure::{fmt_bytes, fmt_tokens};
use kvlink_rig::report::{Report, Status};
use prefix::Prefix;
use report::{AutoRun, ModeResult, SizeTables};
use rig::{close_all, LinkersNotClosed, Rig};

const FIXED: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

fn mode_name(m: ShareMode) -> &'static str {
    match m {
        ShareMode::AllRanks => "all-ranks",
        ShareMode::Rank0Broadcast => "rank0-broadcast",
        ShareMode::SplitAllGather => "split-all-gather",
    }
}

/// Storage nodes the master runs with (what scripts/with-mooncake.sh started).
fn storage_nodes() -> u32 {
    std::env::var("MOONCAKE_STORAGE_NODES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

/// How each mode of one rig runs: `warmup` unreported batches (fixed modes), then `reps`
/// measured batches with `compute` per layer, rows labelled `label`.
struct ModeRuns<'a> {
    warmup: usize,
    reps: usize,
    compute: Duration,
    label: &'a str,
}

/// One fixed mode on one rig: `runs.warmup` batches not reported, then `runs.reps` batches
/// (the pools zeroed before the last, and verified after it).
fn fixed_mode(
    rig: &Rig,
    prefix: &Prefix,
    mode: ShareMode,
    runs: &ModeRuns<'_>,
    report: &mut Report,
) -> Result<ModeResult> {
    let ModeRuns {
        warmup,
        reps,
        compute,
        label,
    } = *runs;
    let linkers = rig.linkers(prefix, ModeChoice::Fixed(mode), compute)?;
    let mut result = ModeResult::new(format!("{mode:?}"), mode);
    let mut failure = None;
    // Batch ids after the measured ones' (1..=reps), so none is reused.
    for w in 0..warmup {
        if let Err(e) = rig.run_batch(&linkers, prefix, (reps + 1 + w) as u64, compute) {
            failure = Some(e.context("warm-up batch"));
            break;
        }
    }
    for rep in (0..reps).take_while(|_| failure.is_none()) {
        if rep + 1 == reps {
            if let Err(e) = rig.clear() {
                failure = Some(e);
                break;
            }
        }
        match rig.run_batch(&linkers, prefix, 1 + rep as u64, compute) {
            Ok(runs) => result.add(&runs),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    // A close that failed wins: it says the pools may still be written.
    let closed = close_all(linkers);
    if let Some(e) = failure {
        return Err(match closed {
            Err(c) => c.context(format!("after a failed batch: {e:#}")),
            Ok(()) => e,
        });
    }
    closed?;
    let wrong = result.off_mode();
    report.push(
        "modes",
        format!("{label} {mode:?}: ran as configured"),
        if wrong.is_empty() {
            Status::Pass
        } else {
            Status::Fail
        },
        if wrong.is_empty() {
            format!("every rank, {reps} batches")
        } else {
            wrong.join(", ")
        },
    );
    let t = Instant::now();
    let verified = rig.verify(prefix);
    report.push(
        "verify",
        format!("{label} {mode:?}: every rank's pool"),
        if verified.is_ok() {
            Status::Pass
        } else {
            Status::Fail
        },
        match &verified {
            Ok(b) => format!(
                "{} ranks × every row equal to the saved bytes ({} compared in {:.1} s)",
                rig.tp,
                fmt_bytes(*b),
                t.elapsed().as_secs_f64()
            ),
            Err(e) => format!("{e:#}"),
        },
    );
    let one_copy = (prefix.bytes, prefix.pages.len() as u64);
    result.store_check(rig.tp, one_copy, report, label);
    Ok(result)
}

/// One fresh `Auto` run: batches until rank 0's linker keeps a mode (it keeps one within 19
/// batches; the loop stops at 22), then `reps` measured batches (the last verified).
fn auto_run(
    rig: &Rig,
    prefix: &Prefix,
    reps: usize,
    compute: Duration,
    report: &mut Report,
    label: &str,
) -> Result<AutoRun> {
    let linkers = rig.linkers(prefix, ModeChoice::Auto, compute)?;
    let mut measured = Vec::new();
    let mut timed = Vec::new();
    let mut batch = 100u64;
    let mut outcome = Ok(());
    // Auto keeps a mode within 19 batches (6 per mode in a close call, one more while the last
    // time travels); 3 more to spare.
    while linkers[0].auto_decision().is_none() && measured.len() < 22 {
        match rig.run_batch(&linkers, prefix, batch, compute) {
            Ok(runs) => {
                measured.push(runs[0].stats.mode);
                timed.push(runs.iter().map(|r| r.last).fold(0.0, f64::max));
            }
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
        batch += 1;
    }
    let kept = linkers[0].auto_decision();
    let mut result = ModeResult::new("Auto".into(), kept.unwrap_or(ShareMode::AllRanks));
    if outcome.is_ok() {
        for rep in 0..reps {
            if rep + 1 == reps {
                if let Err(e) = rig.clear() {
                    outcome = Err(e);
                    break;
                }
            }
            match rig.run_batch(&linkers, prefix, batch, compute) {
                Ok(runs) => result.add(&runs),
                Err(e) => {
                    outcome = Err(e);
                    break;
                }
            }
            batch += 1;
        }
    }
    let closed = close_all(linkers);
    if let Err(e) = outcome {
        return Err(match closed {
            Err(c) => c.context(format!("after a failed batch: {e:#}")),
            Ok(()) => e,
        });
    }
    closed?;
    let verified = rig.verify(prefix);
    report.push(
        "verify",
        format!("{label} Auto: every rank's pool"),
        if verified.is_ok() {
            Status::Pass
        } else {
            Status::Fail
        },
        match &verified {
            Ok(b) => format!("{} compared", fmt_bytes(*b)),
            Err(e) => format!("{e:#}"),
        },
    );
    Ok(AutoRun {
        measuring: measured,
        measured_last: timed,
        kept,
        result,
    })
}

/// Ends one rig's modes early: a linker could not be closed, so a batch may still write its
/// pools and no later mode may clear or check them. The modes that ran keep their rows.
fn stop_rig(
    label: &str,
    results: Vec<ModeResult>,
    tables: &mut SizeTables,
    report: &mut Report,
    tp: u32,
) -> Result<()> {
    report.push(
        "modes",
        format!("{label}: the later modes"),
        Status::Skip,
        "not run: a linker could not be closed, its pools may still be written".to_string(),
    );
    tables.add(tp, results, Vec::new(), report, label);
    Ok(())
}

/// Every mode on one (pools, TP) rig.
#[allow(clippy::too_many_arguments)]
fn one_rig(
    a: &Args,
    pools: Pools,
    tp: u32,
    stores: &[Arc<dyn KvStore>],
    prefix: &Prefix,
    compute: Duration,
    tables: &mut SizeTables,
    report: &mut Report,
) -> Result<()> {
    let label = format!("{} TP{tp} {}", pools.name(), fmt_tokens(prefix.tokens));
    let rig = Rig::new(pools, tp, stores, prefix, a.staging_mib << 20, a.seed)
        .with_context(|| format!("{label}: setting up the ranks"))?;
    if rig.stages > 0 {
        report.info(
            "setup",
            format!("{label}: staging ring"),
            format!(
                "{} stages per rank (groups of up to {} layers per store call)",
                rig.stages,
                rig.stages - 1
            ),
        );
    }
    let mut results = Vec::new();
    for mode in FIXED
        .iter()
        .copied()
        .filter(|m| a.modes.iter().any(|x| x == mode_name(*m)))
    {
        let runs = ModeRuns {
            warmup: a.warmup,
            reps: a.reps,
            compute,
            label: &label,
        };
        match fixed_mode(&rig, prefix, mode, &runs, report) {
            Ok(r) => results.push(r),
            Err(e) => {
                report.push(
                    "modes",
                    format!("{label} {mode:?}"),
                    Status::Fail,
                    format!("{e:#}"),
                );
                if e.downcast_ref::<LinkersNotClosed>().is_some() {
                    return stop_rig(&label, results, tables, report, tp);
                }
            }
        }
    }
    let mut autos = Vec::new();
    if a.modes.iter().any(|m| m == "auto") {
        for run in 0..a.auto_runs.max(1) {
            match auto_run(&rig, prefix, a.reps, compute, report, &label) {
                Ok(r) => autos.push(r),
                Err(e) => {
                    report.push(
                        "auto",
                        format!("{label} Auto run {}", run + 1),
                        Status::Fail,
                        format!("{e:#}"),
                    );
                    if e.downcast_ref::<LinkersNotClosed>().is_some() {
                        break;
                    }
                }
            }
        }
    }
    tables.add(tp, results, autos, report, &label);
    Ok(())
}

/// Bytes of host memory the rigs of one size need at most (host pools of the largest TP, or
/// the device ranks' pinned staging), and the store's copy.
fn host_need(a: &Args, pools: Pools, prefix_bytes: u64) -> u64 {
    let tp = u64::from(a.tp.iter().copied().max().unwrap_or(1));
    let per_rank = match pools {
        Pools::Host => prefix_bytes,
        _ => a.staging_mib << 20,
    };
    tp * per_rank + prefix_bytes / 8 + (2 << 30)
}

fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn run(a: &Args, report: &mut Report) -> Result<Vec<(String, String)>> {
    let started = Instant::now();
    let config = MooncakeConfig::from_env()
        .context("run under scripts/with-mooncake.sh --storage-nodes N")?
        .global_segment_size(0);
    let nodes = storage_nodes();
    let tp_max = a.tp.iter().copied().max().unwrap_or(1);
    let stores: Vec<Arc<dyn KvStore>> = (0..tp_max)
        .map(|r| {
            MooncakeStore::connect(config.clone())
                .map(|s| Arc::new(s) as Arc<dyn KvStore>)
                .with_context(|| format!("rank {r}'s Mooncake client"))
        })
        .collect::<Result<_>>()?;
    report.info(
        "env",
        "store",
        format!(
            "Mooncake over {} (master {}), {nodes} storage node(s); one client per rank, no \
             segment of its own; read_streams {}, staged merge {}",
            config.protocol_name(),
            config.master_addr(),
            config.read_streams_count(),
            if config.staged_merge_enabled() {
                "on"
            } else {
                "off"
            }
        ),
    );
    report.info(
        "env",
        "CPUs",
        std::thread::available_parallelism()
            .map_or(0, usize::from)
            .to_string(),
    );
    let mut files = Vec::new();
    let mut last_cost: Option<(u64, f64)> = None;
    for &tokens in &a.tokens {
        let label = format!("{} tokens", fmt_tokens(tokens));
        let g = prefix::geometry(1, 0)?;
        let bytes = g.bytes_per_page() * (tokens / u64::from(g.page_size()));
        let spent = started.elapsed().as_secs_f64();
        if let Some((t0, s0)) = last_cost {
            let est = s0 * tokens as f64 / t0 as f64 * 1.1;
            if spent + est > a.budget_s {
                report.push(
                    "budget",
                    label,
                    Status::Skip,
                    format!(
                        "out of time: {spent:.0} s spent, about {est:.0} s more needed, budget \
                         {:.0} s (--budget-s)",
                        a.budget_s
                    ),
                );
                continue;
            }
        }
        let need = a
            .pools
            .iter()
            .map(|&p| host_need(a, p, bytes))
            .max()
            .unwrap_or(0);
        let avail = std::env::var("KVLINK_HOST_MEM_GIB")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map(|g| g << 30)
            .or_else(mem_available);
        if let Some(avail) = avail.filter(|&m| m < need) {
            report.push(
                "budget",
                label,
                Status::Skip,
                format!(
                    "host memory: {} available, about {} needed",
                    fmt_bytes(avail),
                    fmt_bytes(need)
                ),
            );
            continue;
        }
        let t_size = Instant::now();
        let prefix = match Prefix::save(&config, tokens, a.savers, a.seed) {
            Ok(p) => p,
            Err(e) => {
                // The sizes already run keep their tables; this one has none.
                report.push(
                    "prefix",
                    format!("{label}: saved"),
                    Status::Fail,
                    format!("{e:#}"),
                );
                continue;
            }
        };
        report.info(
            "prefix",
            label.clone(),
            format!(
                "{} pages, {} per copy, saved by rank 0 ({} saver clients) in {:.1} s",
                prefix.pages.len(),
                fmt_bytes(prefix.bytes),
                a.savers,
                prefix.save_s
            ),
        );
        let compute = if a.no_compute {
            Duration::ZERO
        } else {
            compute::per_layer(prefix.tokens, a.suffix_tokens)
        };
        for &pools in &a.pools {
            let mut tables = SizeTables::new(pools, &prefix, nodes, compute, a);
            for &tp in &a.tp {
                if pools == Pools::Nccl && tp > gpus() {
                    report.push(
                        "setup",
                        format!("nccl TP{tp} {}", fmt_tokens(prefix.tokens)),
                        Status::Skip,
                        format!("{} GPU(s) visible: NCCL needs one per rank", gpus()),
                    );
                    continue;
                }
                if let Err(e) =
                    one_rig(a, pools, tp, &stores, &prefix, compute, &mut tables, report)
                {
                    report.push(
                        "setup",
                        format!("{} TP{tp} {}", pools.name(), fmt_tokens(prefix.tokens)),
                        Status::Fail,
                        format!("{e:#}"),
                    );
                }
            }
            let name = format!(
                "mooncake_modes_{}_{}_{}_n{nodes}.md",
                machine(a),
                pools.name(),
                fmt_tokens(prefix.tokens).to_lowercase()
            );
            let text = tables.render();
            // Written now, with the checks so far, so that a run stopped later (a time limit)
            // keeps this size's table; rewritten at the end with the whole run's checks.
            write_table(a, &name, &text, report, false);
            files.push((name, text));
        }
        let removed = prefix.discard(stores[0].as_ref());
        report.info(
            "prefix",
            format!("{label}: removed"),
            format!("{removed} objects and companions discarded"),
        );
        last_cost = Some((tokens, t_size.elapsed().as_secs_f64()));
    }
    report.info(
        "env",
        "total run time",
        format!("{:.1} s", started.elapsed().as_secs_f64()),
    );
    Ok(files)
}

/// GPUs visible (0 without the `cuda` feature).
fn gpus() -> u32 {
    #[cfg(feature = "cuda")]
    {
        kvlink::kv_device::cuda::cuda_device_count().unwrap_or(0)
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

fn machine(a: &Args) -> String {
    a.machine.clone().unwrap_or_else(|| {
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "local".into())
    })
}

/// One size's table with the run's checks so far, written under `--out` when given;
/// returns the text.
fn write_table(a: &Args, name: &str, text: &str, report: &Report, ended: bool) -> String {
    let results = report.table();
    let summary = results.lines().last().unwrap_or_default();
    let heading = if ended {
        "Checks of the whole run"
    } else {
        "Checks of the run so far (it had not ended when this file was written)"
    };
    let body = format!("{text}\n## {heading}\n\n```\n{results}```\n\n{summary}\n");
    if let Some(dir) = &a.out {
        let _ = std::fs::create_dir_all(dir);
        if let Err(e) = std::fs::write(dir.join(name), &body) {
            eprintln!("writing {name}: {e}");
        }
    }
    body
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    let a = match args::parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut report = Report::default();
    let files = match run(&a, &mut report) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("mooncake_modes: {e:#}");
            report.push("env", "run", Status::Fail, format!("{e:#}"));
            println!("{}", report.table());
            return ExitCode::from(2);
        }
    };
    if !report.failed() && report.passed() == 0 {
        // Every size skipped (the budget, the host's memory): nothing was measured or
        // verified, which must not read as a pass, in the tables as in the exit status.
        report.push(
            "env",
            "measured",
            Status::Fail,
            "nothing passed (every size was skipped)",
        );
    }
    let results = report.table();
    for (name, text) in &files {
        let body = write_table(&a, name, text, &report, true);
        println!("==== {name}\n{body}");
    }
    if files.is_empty() {
        println!("{results}");
    }
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
