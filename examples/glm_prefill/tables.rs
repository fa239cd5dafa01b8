//! The report's tables: one load per rank, its per-layer timeline, the modes side by side.

use super::*;

pub(super) fn report_run(ctx: &Ctx, run: &LoadRun, out: &mut dyn Write) -> Result<()> {
    if let Some(reason) = &run.auto_reason {
        say!(
            out,
            "  Auto chose {:?} (LoadStats.mode). {reason}",
            run.effective
        );
    }
    say!(
        out,
        "  per rank (times from that rank's start_load; store: {}; compute SIMULATED):",
        ctx.store_label()
    );
    let mut t = Table::new(&[
        "rank",
        "bytes landed in pool",
        "store bytes read",
        "first layer ready",
        "last layer ready",
        "forward done (SIM. compute)",
        "engine waited after layer 0",
    ]);
    for (rank, r) in run.ranks.iter().enumerate() {
        t.row(vec![
            rank.to_string(),
            bytes(r.stats.bytes_landed),
            bytes(r.store_bytes_read),
            ms(r.stats.first_layer),
            ms(r.stats.last_layer),
            ms(r.forward_done),
            ms(r.stalled),
        ]);
    }
    t.write(out, "  ")?;
    let one_copy = ctx.bytes_per_rank()?;
    say!(
        out,
        "  store bytes read: {} in total = {:.2} × one copy of the prefix ({}) [{}]",
        bytes(run.store_bytes_total()),
        run.store_bytes_total() as f64 / one_copy as f64,
        bytes(one_copy),
        ctx.store_label()
    );
    // Pipelining, on the rank that finished last.
    if let Some(slow) = run.ranks.iter().max_by_key(|r| r.forward_done) {
        let l = f64::from(ctx.layers());
        let read = slow.stats.last_layer.as_secs_f64() * 1e3;
        let comp = slow.compute.as_secs_f64() * 1e3;
        let ideal = (read + comp / l).max(comp + read / l);
        say!(
            out,
            "  pipelining (slowest rank): forward done {:.1} ms; the load took {read:.1} ms (to \
             its last layer ready) and the {l} layers' compute {comp:.1} ms (measured sleeps): \
             {:.1} ms if one waited for the other; ideal overlap ≈ max(load + one layer's \
             compute, compute + one layer's load) = {ideal:.1} ms",
            slow.forward_done.as_secs_f64() * 1e3,
            read + comp
        );
    }
    if ctx.args.mode == ModeSel::Compare && !ctx.args.full_timeline {
        say!(
            out,
            "  per-layer timeline: in the picture (--full-timeline prints it here too)"
        );
    } else {
        timeline_table(ctx, &run.timeline, out)?;
    }
    Ok(())
}

pub(super) fn timeline_table(ctx: &Ctx, tl: &RunTimeline, out: &mut dyn Write) -> Result<()> {
    let layers = ctx.layers() as usize;
    let shown: Vec<usize> = if tl.ranks.len() <= 4 {
        (0..tl.ranks.len()).collect()
    } else {
        vec![0, 1, tl.ranks.len() - 1]
    };
    say!(
        out,
        "  per-layer timeline, ms since {} (ready: when a thread blocked in wait_layer saw it; \
         compute: SIMULATED sleep){}:",
        tl.origin(),
        if shown.len() < tl.ranks.len() {
            format!(" — ranks {shown:?} of {}", tl.ranks.len())
        } else {
            String::new()
        }
    );
    let mut head = vec!["layer".to_string()];
    for &r in &shown {
        head.push(format!("r{r} ready"));
        head.push(format!("r{r} compute"));
    }
    let mut t = Table::new(&head);
    let rows: Vec<Option<usize>> = if ctx.args.full_timeline || layers <= 10 {
        (0..layers).map(Some).collect()
    } else {
        (0..5)
            .map(Some)
            .chain([None])
            .chain((layers - 5..layers).map(Some))
            .collect()
    };
    for row in rows {
        match row {
            None => t.row(
                std::iter::once("…".to_string())
                    .chain(
                        shown
                            .iter()
                            .flat_map(|_| ["…".to_string(), "…".to_string()]),
                    )
                    .collect(),
            ),
            Some(l) => {
                let mut cells = vec![l.to_string()];
                for &r in &shown {
                    let k = &tl.ranks[r];
                    cells.push(format!("{:.2}", k.ready[l]));
                    cells.push(format!("{:.2} – {:.2}", k.seen[l], k.done[l]));
                }
                t.row(cells);
            }
        }
    }
    t.write(out, "  ")?;
    Ok(())
}

pub(super) fn compare_table(
    ctx: &Ctx,
    results: &[(ModeArg, ModeOutcome)],
    out: &mut dyn Write,
) -> Result<()> {
    let tokens = ctx.pages.len() as u64 * u64::from(ctx.spec.page_size);
    let base = results.iter().find_map(|(m, o)| match (m, o) {
        (ModeArg::AllRanks, ModeOutcome::Loaded(r)) => Some(r),
        _ => None,
    });
    say!(out);
    say!(
        out,
        "modes on the same saved prefix — GLM-5.2 FP8 KV, TP {}, compute SIMULATED {} µs/layer, \
         store: {}{}",
        ctx.tp(),
        thousands(ctx.args.compute_us),
        ctx.store_label(),
        if ctx.store.embedded.is_some() {
            " (no network: a store read here is a memory copy)"
        } else {
            ""
        }
    );
    let mut t = Table::new(&[
        "cached tokens",
        "mode",
        "store",
        "last layer ready",
        "forward done (SIM.)",
        "store bytes read per rank",
        "store bytes read total",
        "reduction vs AllRanks: last layer ready",
        "reduction vs AllRanks: store bytes",
    ]);
    let mut notes = Vec::new();
    for (m, o) in results {
        let name = match o {
            ModeOutcome::Loaded(r) => mode_label(*m, r.effective),
            _ => m.name().to_string(),
        };
        let mut row = vec![thousands(tokens), name, ctx.store_label().to_string()];
        match o {
            ModeOutcome::Loaded(r) => {
                let per: Vec<String> = r.ranks.iter().map(|x| bytes(x.store_bytes_read)).collect();
                row.push(ms(r.last_ready()));
                row.push(ms(r.forward_done()));
                row.push(per.join(" / "));
                row.push(bytes(r.store_bytes_total()));
                match base {
                    Some(b) if *m != ModeArg::AllRanks => {
                        let dt = 1.0 - r.last_ready().as_secs_f64() / b.last_ready().as_secs_f64();
                        let db = 1.0 - r.store_bytes_total() as f64 / b.store_bytes_total() as f64;
                        row.push(signed_percent(dt));
                        row.push(signed_percent(db));
                    }
                    Some(_) => row.extend(["baseline", "baseline"].map(String::from)),
                    None => row.extend(["no baseline", "no baseline"].map(String::from)),
                }
            }
            ModeOutcome::RanAs(other, why) => {
                notes.push(format!("{}: {why}", m.name()));
                row.push(format!("ran as {other:?} [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
            ModeOutcome::Unsupported(why) => {
                notes.push(format!("{}: {why}", m.name()));
                row.push(format!("not supported yet [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
            ModeOutcome::Failed(why) => {
                notes.push(format!("{}: FAILED: {why}", m.name()));
                row.push(format!("FAILED [{}]", notes.len()));
                row.extend(["—", "—", "—", "—", "—"].map(String::from));
            }
        }
        t.row(row);
    }
    t.write(out, "")?;
    say!(
        out,
        "reduction = 1 − mode / AllRanks: positive is better, negative is slower (or more bytes) \
         than every rank reading its own copy. Times: the slowest rank, from its start_load."
    );
    for (i, n) in notes.iter().enumerate() {
        say!(out, "[{}] {n}", i + 1);
    }
    let rows: Vec<ModeRow> = results
        .iter()
        .filter_map(|(m, o)| match o {
            ModeOutcome::Loaded(r) => Some(ModeRow {
                mode: r.effective,
                auto: *m == ModeArg::Auto,
                last_ready: r.last_ready(),
                per_rank: r.ranks.iter().map(|x| x.store_bytes_read).collect(),
            }),
            _ => None,
        })
        .collect();
    let auto_reason = results.iter().find_map(|(_, o)| match o {
        ModeOutcome::Loaded(r) => r.auto_reason.as_deref(),
        _ => None,
    });
    Shows {
        rows: &rows,
        auto_reason,
        embedded: ctx.store.embedded.is_some(),
    }
    .write(out)?;
    Ok(())
}

/// A mode's name in tables and the picture; `Auto` says what it chose.
pub(super) fn mode_label(mode: ModeArg, effective: ShareMode) -> String {
    match mode {
        ModeArg::Auto => format!("Auto → {effective:?}"),
        m => m.name().to_string(),
    }
}

/// `0.248` → `+24.8 %`; values that round to zero print as `0.0 %`.
pub(super) fn signed_percent(x: f64) -> String {
    let p = x * 100.0;
    if p.abs() < 0.05 {
        "0.0 %".to_string()
    } else {
        format!("{p:+.1} %")
    }
}
