//! What rank 0 prints in the processes shape: the header, and each mode's tables from every
//! rank's report (the same tables as the threads shape); what the other ranks print.

use std::io::Write;
use std::time::Duration;

use anyhow::{bail, Result};
use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_loader::{LoadStats, ShareMode};
use kvlink::mooncake_linker::FormedTpGroup;

use super::super::{
    compare_table, fail_on_failed_modes, loaded, mode_label, picture_loaded, report_run,
    scattered_slots, Ctx, LoadRun, ModeOutcome, RankDone,
};
use super::gather::RankReport;
use super::stores;
use crate::args::{ModeArg, ModeSel};
use crate::report::{bytes, ms, thousands, Table};
use crate::timeline_svg::{RankTimeline, RunTimeline};

/// Rank 0's header: the model, the prefix, the group, the store.
pub(super) fn header(
    ctx: &Ctx,
    formed: &FormedTpGroup,
    meet: &str,
    out: &mut dyn Write,
) -> Result<()> {
    let g = ctx.geometry(0)?;
    let transport = formed
        .formation
        .last()
        .map_or("?".to_string(), |m| format!("{:?}", m.transport));
    writeln!(out, "{}", ctx.title_line())?;
    writeln!(out, "{}", ctx.prefix_line(&g)?)?;
    writeln!(
        out,
        "  TP ranks: {} PROCESSES (this one is rank 0); each has its own HostKvPool of {} page \
         slots and its own Linker; the group formed at the rendezvous {meet} (epoch {}, socket \
         collectives over {transport})",
        ctx.tp(),
        ctx.pool_pages,
        formed.epoch
    )?;
    writeln!(
        out,
        "  store: {}; {}",
        ctx.store_label(),
        stores::whereabouts(&ctx.args, formed)
    )?;
    writeln!(
        out,
        "  attention compute: SIMULATED, {} µs per layer (the engine thread sleeps: stands for \
         GPU work, uses no CPU)",
        thousands(ctx.args.compute_us)
    )?;
    Ok(())
}

/// Rank 0: every rank's report of one mode, checked and printed as the threads shape does.
pub(super) fn assemble(
    ctx: &Ctx,
    mode: ModeArg,
    reports: &[RankReport],
    out: &mut dyn Write,
) -> Result<ModeOutcome> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    let hits: Vec<u64> = reports.iter().map(|r| r.hit).collect();
    let agreed = hits.iter().copied().min().unwrap_or(0);
    writeln!(
        out,
        "  lookup: pages found per rank {hits:?}; agreed prefix {agreed} pages ({} tokens)",
        thousands(agreed * u64::from(ctx.spec.page_size))
    )?;
    for rank in 0..tp {
        let shown: Vec<String> = scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages)
            .iter()
            .take(6)
            .map(|s| s.to_string())
            .collect();
        writeln!(
            out,
            "  rank {rank} slots (page i → slot): [{}, ...] (scattered, differs per rank; its own \
             process and pool)",
            shown.join(", ")
        )?;
    }
    for (rank, r) in reports.iter().enumerate() {
        let failed = r
            .start_err
            .as_ref()
            .or(r.batch_err.as_ref())
            .or(r.layer_err.as_ref());
        if let Some(e) = failed {
            let why = format!("rank {rank}: {e}");
            writeln!(out, "  FAILED: {why}")?;
            return Ok(ModeOutcome::Failed(why));
        }
        // A rank that reported no verification (a truncated or mismatched report) has not
        // shown its pool right: a failure, not 0 bytes compared.
        // Every byte of the rank's share of the prefix compared: pages × its bytes per page.
        let whole = kvlink::kv_geometry::KvGeometry::new(ctx.spec.clone(), tp, rank as u32)?
            .bytes_per_page()
            * n as u64;
        match &r.verified {
            Some(Ok(b)) if *b == whole => {}
            Some(Ok(b)) => {
                let why = format!("rank {rank}: compared {b} bytes of its {whole}");
                writeln!(out, "  FAILED: {why}")?;
                return Ok(ModeOutcome::Failed(why));
            }
            Some(Err(e)) => {
                writeln!(out, "  FAILED: {e}")?;
                return Ok(ModeOutcome::Failed(e.clone()));
            }
            None => {
                let why = format!("rank {rank}: its report has no verification");
                writeln!(out, "  FAILED: {why}")?;
                return Ok(ModeOutcome::Failed(why));
            }
        }
    }
    let compared: u64 = reports
        .iter()
        .map(|r| r.verified.clone().and_then(Result::ok).unwrap_or(0))
        .sum();
    let verify_time = reports
        .iter()
        .map(|r| r.verify_time)
        .max()
        .unwrap_or_default();
    let stats: Vec<LoadStats> = reports.iter().map(|r| stats_of(ctx, r)).collect();
    let effective = stats[0].mode;
    if let ModeChoice::Fixed(share) = mode.choice() {
        if stats.iter().any(|s| s.mode != share) {
            let modes: Vec<String> = stats.iter().map(|s| format!("{:?}", s.mode)).collect();
            let why = format!(
                "the linker was configured with {share:?} but loaded the batch as [{}] \
                 (LoadStats.mode per rank); its numbers are not shown as {}",
                modes.join(", "),
                mode.name()
            );
            writeln!(out, "  not run as {}: {why}", mode.name())?;
            return Ok(ModeOutcome::RanAs(effective, why));
        }
    }
    let ms_of = |d: &Duration| d.as_secs_f64() * 1e3;
    let mut ranks = Vec::new();
    // Each rank's times are its own process's, from its own start_load.
    let mut timeline = RunTimeline {
        label: mode_label(mode, effective),
        own_starts: true,
        ..RunTimeline::default()
    };
    for (rank, (r, st)) in reports.iter().zip(&stats).enumerate() {
        let ready: Vec<f64> = r
            .ready
            .iter()
            .zip(&r.seen)
            .map(|(a, b)| ms_of(a.min(b)))
            .collect();
        let stalled: Duration = (1..r.seen.len())
            .map(|l| r.seen[l].saturating_sub(r.done[l - 1]))
            .sum();
        let compute: Duration = r.seen.iter().zip(&r.done).map(|(a, b)| *b - *a).sum();
        timeline.ranks.push(RankTimeline {
            rank: rank as u32,
            start: 0.0,
            ready,
            seen: r.seen.iter().map(ms_of).collect(),
            done: r.done.iter().map(ms_of).collect(),
        });
        ranks.push(RankDone {
            stats: st.clone(),
            store_bytes_read: r.store_bytes_read,
            forward_done: r.done.last().copied().unwrap_or_default(),
            stalled,
            compute,
        });
    }
    let run = LoadRun {
        effective,
        ranks,
        timeline,
        auto_reason: (mode == ModeArg::Auto).then(|| {
            reports
                .first()
                .and_then(|r| r.auto_reason.clone())
                .unwrap_or_else(|| {
                    "rank 0 reported no Auto reason: its calibration or its load did not finish \
                     (its error is above)"
                        .to_string()
                })
        }),
    };
    report_run(ctx, &run, out)?;
    writeln!(
        out,
        "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (each rank process \
         checked its own pool; {} compared, slowest rank {})",
        bytes(compared),
        ms(verify_time)
    )?;
    Ok(loaded(run))
}

fn stats_of(ctx: &Ctx, r: &RankReport) -> LoadStats {
    LoadStats {
        pages: r.pages,
        layers: ctx.layers(),
        bytes_read: r.bytes_read,
        bytes_landed: r.bytes_landed,
        mode: r.mode.unwrap_or(ShareMode::AllRanks),
        first_layer: r.first_layer,
        last_layer: r.last_layer,
        transfers: Default::default(),
        layer_transfers: Vec::new(),
        alone: None,
        read_groups: Vec::new(),
        plans_differ: Vec::new(),
    }
}

/// Rank 0's end: the picture, the comparison, the verdict.
pub(super) fn finish(
    ctx: &Ctx,
    results: &[(ModeArg, ModeOutcome)],
    out: &mut dyn Write,
) -> Result<()> {
    picture_loaded(ctx, results, out)?;
    if ctx.args.mode == ModeSel::Compare {
        compare_table(ctx, results, out)?;
        writeln!(
            out,
            "(TP ranks as PROCESSES: each rank's store reads and the group's collectives cross \
             process boundaries over Unix sockets; times are the slowest rank's, from its own \
             start_load, every rank starting after a barrier)"
        )?;
    }
    fail_on_failed_modes(results, ctx.tp(), out)
}

/// A rank other than 0: one line per mode about its own pool (rank 0 prints the tables).
pub(super) fn own_summary(
    ctx: &Ctx,
    rank: u32,
    mine: &[(ModeArg, Result<u64, String>)],
    out: &mut dyn Write,
) -> Result<()> {
    let mut t = Table::new(&["rank", "mode", "own pool"]);
    for (mode, v) in mine {
        t.row(vec![
            rank.to_string(),
            mode.name().to_string(),
            match v {
                Ok(b) => format!(
                    "verified: {} pages byte-identical to the saved bytes ({} compared)",
                    ctx.pages.len(),
                    bytes(*b)
                ),
                Err(e) => format!("FAILED: {e}"),
            },
        ]);
    }
    writeln!(
        out,
        "glm_prefill rank {rank} of {}: rank 0 prints the report; this process's own pool:",
        ctx.tp()
    )?;
    t.write(out, "  ")?;
    let failed: Vec<String> = mine
        .iter()
        .filter_map(|(m, v)| v.as_ref().err().map(|e| format!("{}: {e}", m.name())))
        .collect();
    if !failed.is_empty() {
        bail!("rank {rank}: {}", failed.join("; "));
    }
    Ok(())
}
