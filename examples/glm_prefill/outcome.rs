//! What one mode's load came to: not supported, failed, ran as another mode, or loaded; every
//! pool checked against the saved bytes first; the per-layer timeline of a load.

use super::*;

/// The outcome of the load whose threads brought back `raws`; closes the rigs.
pub(super) fn mode_outcome(
    ctx: &Ctx,
    mode: ModeArg,
    rigs: &[RankRig],
    raws: &[RankRaw],
    calibration: Option<Calibration>,
    out: &mut dyn Write,
) -> Result<ModeOutcome> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    // Not supported, or failed?
    if let Some((rank, e)) = raws
        .iter()
        .enumerate()
        .find_map(|(r, x)| x.start_err.as_ref().map(|e| (r, e)))
    {
        let why = format!("rank {rank}: start_load: {e}");
        close_all(rigs);
        if mode != ModeArg::AllRanks {
            say!(out, "  not supported yet: {why}");
            return Ok(ModeOutcome::Unsupported(why));
        }
        say!(out, "  FAILED: {why}");
        return Ok(ModeOutcome::Failed(why));
    }
    let mut stats = Vec::new();
    for (rank, raw) in raws.iter().enumerate() {
        match (&raw.stats, &raw.layer_err) {
            (Ok(s), None) => stats.push(s.clone()),
            (Err(e), _) | (Ok(_), Some(e)) => {
                let why = format!("rank {rank}: {e}");
                say!(out, "  FAILED: {why}");
                close_all(rigs);
                return Ok(ModeOutcome::Failed(why));
            }
        }
    }
    let effective = stats[0].mode;
    let (compared, verify_time) = match verify_all(ctx, rigs, out)? {
        Ok(v) => v,
        Err(failed) => return Ok(failed),
    };
    // Did it run in the mode asked for? (Checked after the pools: they must be right anyway.)
    if let ModeChoice::Fixed(share) = mode.choice() {
        if stats.iter().any(|s| s.mode != share) {
            let modes: Vec<String> = stats.iter().map(|s| format!("{:?}", s.mode)).collect();
            let reason = if tp == 1 {
                "with one rank there is nothing to share"
            } else {
                "a per-batch fallback (the linker logs why), or the mode is not implemented"
            };
            let why = format!(
                "the linker was configured with {share:?} but loaded the batch as [{}] \
                 (LoadStats.mode per rank): {reason}; its numbers are not shown as {}",
                modes.join(", "),
                mode.name()
            );
            say!(out, "  not run as {}: {why}", mode.name());
            say!(
                out,
                "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (as loaded \
                 by {effective:?}; {} compared in {})",
                bytes(compared),
                ms(verify_time)
            );
            return Ok(ModeOutcome::RanAs(effective, why));
        }
    }
    let (ranks, timeline) = timeline_of(mode, effective, raws, &stats);
    let run = LoadRun {
        effective,
        ranks,
        timeline,
        auto_reason: calibration.map(|c| c.reason(effective)),
    };
    report_run(ctx, &run, out)?;
    let slices_per_page: usize = ctx
        .geometry(0)?
        .components()
        .iter()
        .map(|c| c.layers.len())
        .sum();
    say!(
        out,
        "  verified: {tp} ranks × {n} pages byte-identical to the saved bytes (each page: \
         {slices_per_page} (component, layer) slices at the rank's own slot; {} compared in {})",
        bytes(compared),
        ms(verify_time)
    );
    Ok(loaded(run))
}

/// A loaded run, its timeline noting when the last layer was ready, when the forward was done
/// and the store bytes read.
pub(super) fn loaded(mut run: LoadRun) -> ModeOutcome {
    run.timeline.note = format!(
        "last layer ready {} · forward done {} · store bytes read {} total",
        ms(run.last_ready()),
        ms(run.forward_done()),
        bytes(run.store_bytes_total())
    );
    ModeOutcome::Loaded(Box::new(run))
}

/// Every rank's pool against the generator (then the rigs are closed): bytes compared and the
/// time it took, or the failure.
fn verify_all(
    ctx: &Ctx,
    rigs: &[RankRig],
    out: &mut dyn Write,
) -> Result<std::result::Result<(u64, Duration), ModeOutcome>> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    let t = Instant::now();
    let verify = Progress::new("verify pools", u64::from(tp) * n as u64, "rank-pages");
    let checks: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let hs: Vec<_> = rigs
            .iter()
            .enumerate()
            .map(|(rank, rig)| {
                let verify = &verify;
                s.spawn(move || verify_pool(ctx, rank, &rig.pool, &rig.slots, verify))
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("verify panicked".into())))
            .collect()
    });
    verify.finish();
    close_all(rigs);
    let mut compared = 0;
    for c in checks {
        match c {
            Ok(b) => compared += b,
            Err(e) => {
                say!(out, "  FAILED: {e}");
                return Ok(Err(ModeOutcome::Failed(e)));
            }
        }
    }
    Ok(Ok((compared, t.elapsed())))
}

/// Each rank's numbers and the run's timeline, in ms since the first `start_load` of any rank.
fn timeline_of(
    mode: ModeArg,
    effective: ShareMode,
    raws: &[RankRaw],
    stats: &[LoadStats],
) -> (Vec<RankDone>, RunTimeline) {
    // Times, relative to the first start_load of any rank.
    let t0 = raws
        .iter()
        .map(|r| r.start)
        .min()
        .unwrap_or_else(Instant::now);
    let rel = |i: Instant| i.saturating_duration_since(t0).as_secs_f64() * 1e3;
    let mut ranks = Vec::new();
    let mut timeline = RunTimeline {
        label: mode_label(mode, effective),
        ..RunTimeline::default()
    };
    for (rank, (raw, st)) in raws.iter().zip(stats).enumerate() {
        // A layer was ready no later than either thread saw it.
        let ready: Vec<f64> = raw
            .ready
            .iter()
            .zip(&raw.seen)
            .map(|(&a, &b)| rel(a.min(b)))
            .collect();
        let mut stalled = Duration::ZERO;
        for l in 1..raw.seen.len() {
            stalled += raw.seen[l].saturating_duration_since(raw.done[l - 1]);
        }
        let compute: Duration = raw.seen.iter().zip(&raw.done).map(|(a, b)| *b - *a).sum();
        timeline.ranks.push(RankTimeline {
            rank: rank as u32,
            start: rel(raw.start),
            ready,
            seen: raw.seen.iter().map(|&i| rel(i)).collect(),
            done: raw.done.iter().map(|&i| rel(i)).collect(),
        });
        ranks.push(RankDone {
            stats: st.clone(),
            store_bytes_read: raw.store_bytes_read,
            forward_done: raw
                .done
                .last()
                .map(|d| d.saturating_duration_since(raw.start))
                .unwrap_or_default(),
            stalled,
            compute,
        });
    }
    (ranks, timeline)
}
