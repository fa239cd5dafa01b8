//! Step 1: the report's header, then the prefix filled on rank 0 and saved.

use super::*;

pub(super) fn header(ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let g = ctx.geometry(0)?;
    let comps: Vec<String> = g
        .components()
        .iter()
        .map(|c| {
            let per = if c.rows_per_page == 1 {
                format!("{} B/page", thousands(u64::from(c.row_bytes)))
            } else {
                format!("{} B/token", thousands(u64::from(c.row_bytes)))
            };
            format!(
                "{} ({per} on {} layers, {})",
                c.name,
                c.layers.len(),
                if c.replicated {
                    "replicated"
                } else {
                    "sharded"
                }
            )
        })
        .collect();
    say!(out, "{}", ctx.title_line());
    say!(out, "  components: {}", comps.join(", "));
    say!(out, "{}", ctx.prefix_line(&g)?);
    if !ctx
        .args
        .tokens
        .is_multiple_of(u64::from(ctx.spec.page_size))
    {
        say!(
            out,
            "  (--tokens {} rounded down to whole pages: a partial page is never stored)",
            ctx.args.tokens
        );
    }
    say!(
        out,
        "  TP ranks: {} (threads of this process); each rank has its own HostKvPool of {} page \
         slots and {}",
        ctx.tp(),
        ctx.pool_pages,
        ctx.store.sharing
    );
    say!(out, "  store: {}", ctx.store_label());
    say!(
        out,
        "  attention compute: SIMULATED, {} µs per layer (the engine thread sleeps: stands for \
         GPU work, uses no CPU)",
        thousands(ctx.args.compute_us)
    );
    Ok(())
}

pub(super) fn save_step(ctx: &Ctx, out: &mut dyn Write) -> Result<()> {
    let n = ctx.pages.len();
    say!(out);
    say!(
        out,
        "step 1 — save the prefix as the request that computed it would have (store: {})",
        ctx.store_label()
    );
    // Every rank has a pool and a linker; rank 0's pool holds the prefill's KV in slots 0..n.
    let mut rigs = Vec::new();
    for rank in 0..ctx.tp() {
        let g = ctx.geometry(rank)?;
        let pool = Arc::new(HostKvPool::new(g.clone(), n as u32)?);
        let linker = Linker::new(
            g,
            ctx.store.per_rank[rank as usize].clone(),
            pool.clone(),
            ctx.config(ModeChoice::Fixed(ShareMode::AllRanks)),
        )
        .with_context(|| format!("rank {rank}: Linker::new"))?;
        rigs.push((pool, linker));
    }
    let t = Instant::now();
    let g = ctx.geometry(0)?;
    let fill = Progress::new("fill rank-0 pool", n as u64, "pages");
    // SAFETY: rank 0's pool is filled here, before any load or save uses it.
    unsafe { ctx.fill_prefix(&g, &rigs[0].0, || fill.inc(1)) }?;
    fill.finish();
    let fill_time = t.elapsed();

    let t = Instant::now();
    let save = Progress::new("save (rank 0 writes)", n as u64, "pages");
    let mut reports = Vec::new();
    for (rank, (_, linker)) in rigs.iter().enumerate() {
        let mut total = SaveReport::default();
        for plan in save_plans(linker.geometry(), &ctx.pages) {
            let pages = plan.logical.num_pages() as u64;
            let r = linker
                .save(&plan)
                .with_context(|| format!("rank {rank}: save"))?;
            total.objects_written += r.objects_written;
            total.objects_present += r.objects_present;
            total.objects_not_owned += r.objects_not_owned;
            total.bytes_written += r.bytes_written;
            if rank == 0 {
                save.inc(pages);
            }
        }
        reports.push(total);
    }
    save.finish();
    let save_time = t.elapsed();
    for (_, linker) in &rigs {
        linker.close()?;
    }
    drop(rigs);

    say!(
        out,
        "  rank 0's pool filled with deterministic pseudo-random bytes per (page hash, component, \
         layer), seed {}: {} pages in {}",
        ctx.args.seed,
        n,
        ms(fill_time)
    );
    say!(
        out,
        "  every rank calls save(); replicated objects are written by TP rank 0 only ({} in \
         total; {} save calls per rank of up to {} pages each, for the progress bar):",
        ms(save_time),
        n.div_ceil(SAVE_CHUNK_PAGES),
        SAVE_CHUNK_PAGES
    );
    let mut t = Table::new(&[
        "rank",
        "objects written",
        "already present",
        "not owned (replicated: rank 0 writes)",
        "bytes written",
    ]);
    for (rank, r) in reports.iter().enumerate() {
        t.row(vec![
            rank.to_string(),
            thousands(u64::from(r.objects_written)),
            thousands(u64::from(r.objects_present)),
            thousands(u64::from(r.objects_not_owned)),
            bytes(r.bytes_written),
        ]);
    }
    t.write(out, "  ")?;
    if let Some(e) = &ctx.store.embedded {
        say!(
            out,
            "  the store now holds {} objects ({} pages × {} components: all layers of one \
             component of one page per object), {} [{}]",
            thousands(e.len() as u64),
            n,
            ctx.geometry(0)?.components().len(),
            bytes(e.used_bytes()),
            ctx.store_label()
        );
    }
    Ok(())
}

/// The save plans of the whole prefix `pages`, in chunks of `SAVE_CHUNK_PAGES` pages, each
/// page `i` in slot `i` (the request the prefix came from).
pub(super) fn save_plans<'a>(
    geometry: &'a KvGeometry,
    pages: &'a [PageHash],
) -> impl Iterator<Item = BatchPlan> + 'a {
    pages
        .chunks(SAVE_CHUNK_PAGES)
        .enumerate()
        .map(move |(ci, chunk)| {
            let first = ci * SAVE_CHUNK_PAGES;
            BatchPlan::all_components(
                geometry,
                BatchId(0),
                vec![RequestPages {
                    request: "previous-request".into(),
                    pages: chunk.to_vec(),
                }],
                (first as u32..(first + chunk.len()) as u32).collect(),
            )
        })
}
