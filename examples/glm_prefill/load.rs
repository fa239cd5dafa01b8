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
    /// The engine's waits for layers 1.. after computing the one before (the wait for layer
    /// 0 is the first layer's ready time).
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
    // SAFETY: cleared between runs, when no batch of this pool is in flight.
    unsafe { pool.clear() };
    progress.inc(u64::from(pool.pages()));
    Ok(())
}

/// One mode's load, start to check: rigs, lookup, (Auto's calibration), the load on every
/// rank, the outcome.
pub(super) fn load_mode(ctx: &Ctx, mode: ModeArg, out: &mut dyn Write) -> Result<ModeOutcome> {
    let rigs = match build_rigs(ctx, mode, out)? {
        Ok(r) => r,
        Err(refused) => return Ok(refused),
    };
    let agreed = lookup_all(ctx, &rigs, out)?;
    let (calibration, zeroed) = if mode == ModeArg::Auto {
        let seen = calibrate_auto(&rigs, &ctx.pages[..agreed], out)?;
        for rig in &rigs {
            // SAFETY: every calibration batch loaded (`calibrate_auto` fails otherwise) and was
            // waited for to its outcome (`wait_batch`), so no load of this pool is in flight;
            // zeroed, the measured batch's check sees only what it landed.
            unsafe { rig.pool.clear() };
        }
        (Some(seen), true)
    } else {
        (None, warm_up(ctx, &rigs, agreed, mode, out)?)
    };
    let raws = run_ranks(ctx, &rigs, agreed, mode, 1);
    if !zeroed {
        // The pools keep what a warm-up landed: the measured batch's check could pass on
        // those bytes, so the mode fails rather than reads as verified.
        let why = "a warm-up batch failed, so the pools were not zeroed before the measured \
                   batch and its check cannot tell what it landed"
            .to_string();
        say!(out, "  FAILED: {why}");
        close_all(&rigs);
        return Ok(ModeOutcome::Failed(why));
    }
    mode_outcome(ctx, mode, &rigs, &raws, calibration, out)
}

/// A fixed mode's warm-up batches (`--warmup`), each as the measured load is run: the slowest
/// rank's last layer of each is printed, nothing else is kept. When every one loaded, the pools
/// are zeroed after them, so the measured batch's check sees only what it landed. Whether the
/// pools are zeroed (or there was no warm-up).
fn warm_up(
    ctx: &Ctx,
    rigs: &[RankRig],
    agreed: usize,
    mode: ModeArg,
    out: &mut dyn Write,
) -> Result<bool> {
    let mut all_loaded = true;
    for w in 0..u64::from(ctx.args.warmup) {
        let raws = run_ranks(ctx, rigs, agreed, mode, 50 + w);
        all_loaded &= raws.iter().all(|r| r.stats.is_ok());
        let slowest = raws
            .iter()
            .map(|r| r.stats.as_ref().map(|s| s.last_layer))
            .try_fold(Duration::ZERO, |m, l| l.map(|l| m.max(l)));
        match slowest {
            Ok(l) => say!(
                out,
                "  warm-up batch {} of {} (not reported below): last layer ready {:.1} ms on the slowest rank",
                w + 1,
                ctx.args.warmup,
                l.as_secs_f64() * 1e3
            ),
            Err(e) => say!(out, "  warm-up batch {} failed: {e}", w + 1),
        }
    }
    if ctx.args.warmup > 0 {
        if all_loaded {
            for rig in rigs {
                // SAFETY: every warm-up batch of this pool was waited for to its outcome
                // (`run_ranks` takes `wait_batch` on every rank), so no load or save of it is
                // in flight, and nothing else touches it between batches.
                unsafe { rig.pool.clear() };
            }
        } else {
            say!(out, "  (a warm-up batch failed: the pools keep its bytes)");
        }
    }
    Ok(all_loaded)
}

/// Each rank: a fresh pool (touched), a linker in one in-process TP group, its own scattered
/// slots. `Ok(Err(_))`: the linker refused the mode.
fn build_rigs(
    ctx: &Ctx,
    mode: ModeArg,
    out: &mut dyn Write,
) -> Result<std::result::Result<Vec<RankRig>, ModeOutcome>> {
    let tp = ctx.tp();
    let n = ctx.pages.len();
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
                return Ok(Err(ModeOutcome::Unsupported(why)));
            }
            Err(e) => return Err(anyhow!(e).context(format!("rank {rank}: Linker::with_group"))),
        };
        rigs.push(RankRig {
            pool,
            linker,
            slots: scattered_slots(ctx.args.seed, rank, n, ctx.pool_pages),
        });
    }
    Ok(Ok(rigs))
}

/// Lookup on every rank at once (in a TP group the ranks agree on the shortest hit); the
/// agreed prefix in pages, which must be the whole saved prefix.
fn lookup_all(ctx: &Ctx, rigs: &[RankRig], out: &mut dyn Write) -> Result<usize> {
    let n = ctx.pages.len();
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
        close_all(rigs);
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
    Ok(agreed)
}

pub(super) fn close_all(rigs: &[RankRig]) {
    for r in rigs {
        // Closing is best effort here: the report already has the outcome.
        let _ = r.linker.close();
    }
}
