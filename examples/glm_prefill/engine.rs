//! The load on every rank at once: a load thread per rank (the linker's), an engine thread
//! per rank waiting for each layer and "computing" it (a SIMULATED sleep), and a watcher
//! thread per rank that notes when each layer becomes ready.

use super::*;

/// Every rank's load of the agreed prefix, as batch `batch`; what each rank's threads saw.
pub(super) fn run_ranks(
    ctx: &Ctx,
    rigs: &[RankRig],
    agreed: usize,
    mode: ModeArg,
    batch: u64,
) -> Vec<RankRaw> {
    let tp = ctx.tp();
    let layers = ctx.layers();
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
                        BatchId(batch),
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
                    let read_before = linker.metrics().bytes_read;
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
                        // Counted as each call landed: what this batch read before it failed.
                        Err(_) => linker.metrics().bytes_read.saturating_sub(read_before),
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
    raws
}
