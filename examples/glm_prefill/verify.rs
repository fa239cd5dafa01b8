//! Step 3: a rank's pool compared, slot by slot, with the bytes that were saved.

use super::*;

/// Compares one rank's pool, slot by slot, with the generator. Returns the bytes compared.
pub(super) fn verify_pool(
    ctx: &Ctx,
    rank: usize,
    pool: &HostKvPool,
    slots: &[u32],
    progress: &Progress,
) -> Result<u64, String> {
    let g = pool.geometry().clone();
    let mut want = Vec::new();
    let mut got = Vec::new();
    let mut compared = 0;
    for (i, (page, &slot)) in ctx.pages.iter().zip(slots).enumerate() {
        for c in g.components() {
            let len = c.page_layer_bytes as usize;
            want.resize(len, 0);
            got.resize(len, 0);
            for &l in &c.layers {
                ctx.pattern.fill(page, c.id.0, l, &mut want);
                // SAFETY: compared after the batch's outcome was taken: no load writes it.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }
                    .map_err(|e| format!("rank {rank}: reading slot {slot}: {e}"))?;
                if want != got {
                    let b = want.iter().zip(&got).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(format!(
                        "rank {rank}: page {i} (slot {slot}), component {}, layer {l}: byte {b} \
                         differs from the saved bytes ({} B slice)",
                        c.name, len
                    ));
                }
                compared += len as u64;
            }
        }
        progress.inc(1);
    }
    Ok(compared)
}
