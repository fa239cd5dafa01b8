//! Auto measures before it chooses: the calibration batches before Auto's measured load.

use super::*;

/// Auto measures before it chooses: batches in each mode on the same linkers (no simulated
/// compute, not timed here) until rank 0's linker keeps a mode (at most [`CALIBRATION_CAP`]),
/// so the measured load that follows runs the mode Auto kept. Returns the batches with the
/// slowest rank's time (what Auto decides from), for the reason.
pub(super) fn calibrate_auto(
    rigs: &[RankRig],
    pages: &[PageHash],
    out: &mut dyn Write,
) -> Result<Calibration> {
    let mut seen = Calibration::default();
    for batch in 100..100 + CALIBRATION_CAP {
        if rigs[0].linker.auto_decision().is_some() {
            break;
        }
        let stats: Vec<Result<LoadStats>> = std::thread::scope(|s| {
            let hs: Vec<_> = rigs
                .iter()
                .map(|rig| {
                    s.spawn(move || calibration_batch(&rig.linker, pages, &rig.slots, batch))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow!("calibration panicked")))
                })
                .collect()
        });
        let stats: Vec<LoadStats> = stats.into_iter().collect::<Result<_>>()?;
        let slowest = stats.iter().map(|s| s.last_layer).max().unwrap_or_default();
        seen.record(stats[0].mode, stats[0].bytes_landed, slowest);
    }
    say!(
        out,
        "  Auto: {} calibration batches (timed on the slowest rank, as Auto does) ran {}; {}",
        seen.batches(),
        seen.order().join(", "),
        match rigs[0].linker.auto_decision() {
            Some(mode) => format!("it keeps {mode:?}"),
            None => "it has not decided yet".to_string(),
        }
    );
    Ok(seen)
}

/// Most calibration batches Auto gets: 3 per mode is 9 at most, 6 per mode (18) when the pick
/// is a close call, and Auto decides one batch later (a batch's time on the slowest rank
/// reaches the linkers at the next gate), so 19; the rest is slack.
pub(super) const CALIBRATION_CAP: u64 = 22;

/// One calibration batch of `pages` into `slots` on `linker`, waited for layer by layer (no
/// simulated compute): what every rank runs while Auto measures, in both shapes.
pub(super) fn calibration_batch(
    linker: &Linker,
    pages: &[PageHash],
    slots: &[u32],
    batch: u64,
) -> Result<LoadStats> {
    let plan = BatchPlan::all_components(
        linker.geometry(),
        BatchId(batch),
        vec![RequestPages {
            request: "auto-calibration".into(),
            pages: pages.to_vec(),
        }],
        slots.to_vec(),
    );
    let t = linker.start_load(plan)?;
    for l in 0..linker.num_layers() {
        linker.wait_layer(&t, l)?;
    }
    Ok(linker.wait_batch(&t)?.result?)
}
