//! The Linker's layer-wise load into a device pool, timed against its parts: the same ranged
//! reads on one thread, and the bytes' host→device copy.

use std::sync::Arc;
use std::time::Instant;

use kvlink::kv_device::cuda::CudaDevice;
use kvlink::kv_loader::KvLoader;
use kvlink::mooncake_linker::store::{KvStore, RangedGet, ReadRange};
use kvlink_rig::device_linker::{device_linker, plan, saved_prefix, wait_layers, SavedPrefix};
use kvlink_rig::glm::half_bytes;
use kvlink_rig::pattern::Rng;
use kvlink_rig::report::{de, Report, Status};

use super::Args;

/// The Linker's layer-wise load into a device pool, timed (the benchmark rows).
pub fn run(args: &Args, report: &mut Report) {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => return report.push("bench", "CUDA device", Status::Fail, de(e)),
    };
    let sizes: &[u64] = if args.quick {
        &[8192]
    } else if args.no_128k {
        &[32768]
    } else {
        &[32768, 131072]
    };
    for &tokens in sizes {
        let name = format!(
            "Linker layer-wise load {}K tokens → device pool (embedded store)",
            tokens / 1024
        );
        report.check("bench", &name, || bench(&dev, tokens));
    }
}

fn bench(dev: &Arc<CudaDevice>, tokens: u64) -> Result<String, String> {
    let n = (tokens / 64) as usize;
    let t_fill = Instant::now();
    let p = saved_prefix(n, 3)?;
    let fill = t_fill.elapsed().as_secs_f64();
    let slots: Vec<u32> = Rng(5).scattered_slots(n, n as u32)?;
    // Last-layer times (best of 3) with 1 and with 8 store calls per layer at once.
    let mut timed = Vec::new();
    let mut keys = Vec::new();
    for par in [1usize, 8] {
        let (linker, _pool) = device_linker(par, dev, &p.g, p.store.clone(), n as u32, n)?;
        let mut best = f64::MAX;
        let mut first = 0.0;
        for rep in 0..3u64 {
            let t0 = Instant::now();
            let t = linker
                .start_load(plan(&p.g, 10 + rep, &p.pages, slots.clone()))
                .map_err(|e| e.to_string())?;
            let at = wait_layers(&linker, &t, t0)?;
            let total = t0.elapsed().as_secs_f64() * 1e3;
            linker
                .wait_batch(&t)
                .map_err(|e| e.to_string())?
                .result
                .map_err(|e| e.to_string())?;
            if total < best {
                best = total;
                first = at.first().copied().unwrap_or(0.0);
            }
        }
        keys = linker
            .object_keys(&plan(&p.g, 0, &p.pages, vec![0; n]))
            .map_err(|e| e.to_string())?;
        linker.close().map_err(|e| e.to_string())?;
        timed.push((par, best, first));
    }
    // The parts, same run: the same ranged reads into (pageable) host memory on one thread
    // (the store's share), and the bytes' H2D at the ceiling measured by the h2d bench.
    let bytes = p.g.bytes_per_page() * n as u64;
    // Written before the clock starts (not zero pages the reads would fault in as they go).
    let mut host = vec![1u8; (half_bytes(&p.g, n)).max(1)];
    // Best of 3, as the Linker's runs above: the same statistic on both sides.
    let mut read_ms = f64::MAX;
    for _ in 0..3 {
        read_ms = read_ms.min(raw_reads(&p, &keys, &mut host)?);
    }
    let per_layer = read_ms / f64::from(p.g.num_layers());
    let runs: Vec<String> = timed
        .iter()
        .map(|(par, best, first)| {
            format!(
                "{par} reader(s): last layer {best:.0} ms, first {first:.1} ms ({:.1} GB/s)",
                bytes as f64 / best / 1e6
            )
        })
        .collect();
    Ok(format!(
        "{:.2} GB, best of 3 runs each: {}; raw single-thread store reads of the same bytes {read_ms:.0} ms (bound for 1 reader ≈ reads + one layer = {:.0} ms); store fill {fill:.1} s",
        bytes as f64 / 1e9,
        runs.join("; "),
        read_ms + per_layer
    ))
}

/// One pass of the Linker's ranged reads, layer by layer, on this thread into `host`; its
/// milliseconds.
fn raw_reads(p: &SavedPrefix, keys: &[Vec<String>], host: &mut [u8]) -> Result<f64, String> {
    let t0 = Instant::now();
    for l in 0..p.g.num_layers() {
        let mut off = 0;
        for (c, ks) in p.g.components().iter().zip(keys) {
            let Some(range) = c.layer_range(l) else {
                continue;
            };
            let len = c.page_layer_bytes as usize;
            let gets: Vec<RangedGet<'_>> = ks
                .iter()
                .enumerate()
                .map(|(i, k)| RangedGet {
                    key: k,
                    ranges: [ReadRange {
                        dst: host[off + i * len..].as_mut_ptr(),
                        len,
                        offset: range.start,
                    }]
                    .into_iter()
                    .collect(),
                })
                .collect();
            // SAFETY: distinct slices of our own `host` buffer, untouched during the call.
            let r = unsafe { p.store.get_ranges(&gets) };
            if r.iter().any(|x| x.is_err()) {
                return Err("raw read failed".into());
            }
            off += ks.len() * len;
        }
    }
    Ok(t0.elapsed().as_secs_f64() * 1e3)
}
