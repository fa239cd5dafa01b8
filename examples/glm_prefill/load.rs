//! Step 2: one mode's load on every rank at once (threads), each with its own pool, linker
//! and scattered slots, a simulated attention pass waiting for each layer; then the check.

use super::*;

/// What one rank's thread brings back from a load.
pub(super) struct RankRaw {
    pub(super) start: Instant,
    pub(super) ready: Vec<Instant>,
    pub(super) seen: Vec<Instant>,
    pub(super) done: Vec<Instant>,
    pub(super) start_err: Option<String>,
    pub(super) layer_err: Option<String>,
    pub(super) stats: Result<LoadStats, String>,
    pub(super) store_bytes_read: u64,
}

/// One rank's numbers of a finished load.
pub(super) struct RankDone {
    pub(super) stats: LoadStats,
    pub(super) store_bytes_read: u64,
    pub(super) forward_done: Duration,
    pub(super) stalled: Duration,
    pub(super) compute: Duration,
}

/// A load that ran in the mode asked for and was verified.
pub(super) struct LoadRun {
    pub(super) effective: ShareMode,
    pub(super) ranks: Vec<RankDone>,
    pub(super) timeline: RunTimeline,
    /// Auto's pick and why (Auto only).
    pub(super) auto_reason: Option<String>,
}

impl LoadRun {
    pub(super) fn last_ready(&self) -> Duration {
        self.ranks
            .iter()
            .map(|r| r.stats.last_layer)
            .max()
            .unwrap_or_default()
    }

    pub(super) fn forward_done(&self) -> Duration {
        self.ranks
            .iter()
            .map(|r| r.forward_done)
            .max()
            .unwrap_or_default()
    }

    pub(super) fn store_bytes_total(&self) -> u64 {
        self.ranks.iter().map(|r| r.store_bytes_read).sum()
    }
}

pub(super) enum ModeOutcome {
    Loaded(Box<LoadRun>),
    Unsupported(String),
    /// The linker took the mode but loaded the batch in another one.
    RanAs(ShareMode, String),
    Failed(String),
}

pub(super) struct RankRig {
    pub(super) pool: Arc<HostKvPool>,
    pub(super) linker: Linker,
    pub(super) slots: Vec<u32>,
}

/// Writes zeros over every slot once, so the load does not pay first-touch page faults (a
/// server's pools are allocated and touched at startup).
pub(super) fn pretouch(pool: &HostKvPool, progress: &Progress) -> Result<()> {
    let g = pool.geometry().clone();
    let zeros = vec![
        0u8;
        g.components()
            .iter()
            .map(|c| c.page_layer_bytes as usize)
            .max()
            .unwrap_or(0)
    ];
    for slot in 0..pool.pages() {
        for c in g.components() {
            for &l in &c.layers {
                // SAFETY: cleared between runs, when no batch of this pool is in flight.
                unsafe { pool.write_slot(c.id, l, slot, &zeros[..c.page_layer_bytes as usize]) }?;
            }
        }
        progress.inc(1);
    }
    Ok(())
}

pub(super) fn load_mode(ctx: &Ctx, mode: ModeArg, out: &mut dyn Write) -> Result<ModeOutcome> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
    let layers = ctx.layers();

    // Each rank: a fresh pool (touched), a linker in one in-process TP group, its own
    // scattered slots.
    let pools: Vec<Arc<HostKvPool>> = (0..tp)
        .map(|r| Ok(Arc::new(HostKvPool::new(ctx.geometry(r)?, ctx.pool_pages)?)))
        .collect::<Result<_>>()?;
    let touch = Progress::new(
        "allocate + touch pools",
        u64::from(tp) * u64::from(ctx.pool_pages),
        "rank-slots",
    );
    std::thread::scope(|s| {
        let hs: Vec<_> = pools
            .iter()
            .map(|p| {
                let touch = &touch;
                s.spawn(move || pretouch(p, touch))
            })
            .collect();
        hs.into_iter()
            .try_for_each(|h| h.join().map_err(|_| anyhow!("pretouch panicked"))?)
    })?;
    touch.finish();
    let mut rigs: Vec<RankRig> = Vec::new();
    for ((rank, pool), group) in (0..tp).zip(pools).zip(TpGroup::in_process(tp)) {
        let linker = match Linker::with_group(
            ctx.geometry(rank)?,
            ctx.store.per_rank[rank as usize].clone(),
            pool.clone(),
            ctx.config(mode.choice()),
            group,
        ) {
            Ok(l) => l,
            Err(e) if mode != ModeArg::AllRanks => {
                let why = format!("Linker::with_group refused mode {}: {e}", mode.name());
                say!(out, "  not supported yet: {why}");
                return Ok(ModeOutcome::Unsupported(why));
            }
            Err(e) => return Err(anyhow!(e).context(format!("rank {rank}: Linker::with_group"))),
        };
        rigs.push(RankRig {
            pool,
            linker,
            slots: scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages),
        });
    }

    // Lookup on every rank at once (in a TP group the ranks agree on the shortest hit).
    let hits: Vec<Result<usize>> = std::thread::scope(|s| {
        let hs: Vec<_> = rigs
            .iter()
            .enumerate()
            .map(|(rank, rig)| {
                s.spawn(move || {
                    rig.linker
                        .lookup(&LookupRequest {
                            tokens: &ctx.tokens,
                            skip_pages: 0,
                        })
                        .map(|h| h.pages.len())
                        .with_context(|| format!("rank {rank}: lookup"))
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("lookup panicked"))))
            .collect()
    });
    let hits: Vec<usize> = hits.into_iter().collect::<Result<_>>()?;
    let agreed = hits.iter().copied().min().unwrap_or(0);
    say!(
        out,
        "  lookup: pages found per rank {:?}; agreed prefix {} pages ({} tokens)",
        hits,
        agreed,
        thousands(agreed as u64 * u64::from(ctx.spec.page_size))
    );
    if agreed < n {
        close_all(&rigs);
        bail!("the store holds only {agreed} of the {n} saved pages (evicted?)");
    }
    for (rank, rig) in rigs.iter().enumerate() {
        let shown: Vec<String> = rig.slots.iter().take(6).map(|s| s.to_string()).collect();
        say!(
            out,
            "  rank {rank} slots (page i → slot): [{}, ...] (scattered, differs per rank)",
            shown.join(", ")
        );
    }

    let calibration = if mode == ModeArg::Auto {
        Some(calibrate_auto(&rigs, &ctx.pages[..agreed], out)?)
    } else {
        None
    };

    // Load on every rank at once: a load thread per rank (the linker's), an engine thread per
    // rank waiting for each layer and "computing" it, and a watcher thread per rank that
    // notes when each layer becomes ready.
    let compute = Duration::from_micros(ctx.args.compute_us);
    let barrier = Barrier::new(tp as usize);
    let progress = Progress::new(
        &format!("load {}", mode.name()),
        u64::from(tp) * u64::from(layers),
        "rank-layers",
    );
    let raws: Vec<RankRaw> = std::thread::scope(|s| {
        let handles: Vec<_> = rigs
            .iter()
            .map(|rig| {
                let (barrier, progress) = (&barrier, &progress);
                s.spawn(move || {
                    let linker = &rig.linker;
                    let plan = BatchPlan::all_components(
                        linker.geometry(),
                        BatchId(1),
                        vec![RequestPages {
                            request: "new-request".into(),
                            pages: ctx.pages[..agreed].to_vec(),
                        }],
                        rig.slots.clone(),
                    );
                    barrier.wait();
                    let start = Instant::now();
                    let mut raw = RankRaw {
                        start,
                        ready: Vec::new(),
                        seen: Vec::new(),
                        done: Vec::new(),
                        start_err: None,
                        layer_err: None,
                        stats: Err("not started".into()),
                        store_bytes_read: 0,
                    };
                    let ticket = match linker.start_load(plan) {
                        Ok(t) => t,
                        Err(e) => {
                            raw.start_err = Some(e.to_string());
                            return raw;
                        }
                    };
                    std::thread::scope(|s2| {
                        let watcher = s2.spawn(|| {
                            let mut ready = Vec::with_capacity(layers as usize);
                            for l in 0..layers {
                                if linker.wait_layer(&ticket, l).is_err() {
                                    break;
                                }
                                ready.push(Instant::now());
                                progress.inc(1);
                            }
                            ready
                        });
                        for l in 0..layers {
                            if let Err(e) = linker.wait_layer(&ticket, l) {
                                raw.layer_err = Some(format!("layer {l}: {e}"));
                                break;
                            }
                            raw.seen.push(Instant::now());
                            if !compute.is_zero() {
                                std::thread::sleep(compute);
                            }
                            raw.done.push(Instant::now());
                        }
                        raw.ready = watcher.join().unwrap_or_default();
                    });
                    raw.stats = match linker.wait_batch(&ticket) {
                        Ok(o) => o.result.map_err(|e| e.to_string()),
                        Err(e) => Err(e.to_string()),
                    };
                    // This batch's own reads (Auto ran calibration batches before it).
                    raw.store_bytes_read = match &raw.stats {
                        Ok(stats) => stats.bytes_read,
                        Err(_) => linker.metrics().bytes_read,
                    };
                    raw
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    });
    progress.finish();

    // Not supported, or failed?
    if let Some((rank, e)) = raws
        .iter()
        .enumerate()
        .find_map(|(r, x)| x.start_err.as_ref().map(|e| (r, e)))
    {
        let why = format!("rank {rank}: start_load: {e}");
        close_all(&rigs);
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
                close_all(&rigs);
                return Ok(ModeOutcome::Failed(why));
            }
        }
    }
    let effective = stats[0].mode;
    // Check every rank's pool against the generator.
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
    close_all(&rigs);
    let mut compared = 0;
    for c in checks {
        match c {
            Ok(b) => compared += b,
            Err(e) => {
                say!(out, "  FAILED: {e}");
                return Ok(ModeOutcome::Failed(e));
            }
        }
    }
    let verify_time = t.elapsed();

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
    for (rank, (raw, st)) in raws.iter().zip(&stats).enumerate() {
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
    let mut run = run;
    run.timeline.note = format!(
        "last layer ready {} · forward done {} · store bytes read {} total",
        ms(run.last_ready()),
        ms(run.forward_done()),
        bytes(run.store_bytes_total())
    );
    Ok(ModeOutcome::Loaded(Box::new(run)))
}

pub(super) fn close_all(rigs: &[RankRig]) {
    for r in rigs {
        // Closing is best effort here: the report already has the outcome.
        let _ = r.linker.close();
    }
}
