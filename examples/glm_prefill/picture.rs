//! The timeline picture of every mode that loaded.

use super::*;

pub(super) fn write_svg(ctx: &Ctx, runs: &[RunTimeline], out: &mut dyn Write) -> Result<()> {
    let title = format!(
        "kvlink glm_prefill — {} FP8 KV, {} cached tokens ({} per rank), TP {}",
        ctx.spec.model,
        thousands(ctx.pages.len() as u64 * u64::from(ctx.spec.page_size)),
        bytes(ctx.bytes_per_rank()?),
        ctx.tp()
    );
    let subtitle = format!(
        "store: {} · attention compute SIMULATED: {} µs/layer (sleep) · each rank: own pool, own linker, \
         different scattered slots · layer ready = seen by a thread blocked in wait_layer",
        ctx.store_label(),
        thousands(ctx.args.compute_us)
    );
    let svg = timeline_svg::render(&title, &subtitle, runs);
    let path = &ctx.args.svg;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    say!(out);
    say!(out, "timeline picture: {}", path.display());
    Ok(())
}
