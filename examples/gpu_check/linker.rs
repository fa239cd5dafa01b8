//! The Linker on a device pool: layer-wise loads through `KvLoader` into a `CudaKvPool`
//! (StagedLandingFactory), checked against the saved bytes, a failure at a layer, and the
//! time to the last layer against its parts.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_device::{StagedLandingFactory, StagingPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, PageHash};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, LayerReady, RequestPages};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, RangedGet, ReadRange, StoreError,
};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

use super::checks::{glm, half_bytes};
use super::util::{de, fill_row, Report, Rng, Status};
use super::Args;

const SEC: &str = "linker";

struct Prefix {
    g: KvGeometry,
    store: Arc<EmbeddedStore>,
    pages: Vec<PageHash>,
}

/// Saves `n` pages of GLM-5.2 through a host-pool linker (as a previous request would have).
fn saved_prefix(n: usize, seed: u32) -> Result<Prefix, String> {
    let g = glm();
    let store = Arc::new(EmbeddedStore::new(
        g.bytes_per_page() * n as u64 + (1 << 30),
    ));
    let tokens: Vec<u32> = (0..n as u32 * g.page_size()).map(|i| i ^ seed).collect();
    let pages = page_hashes(&tokens, g.page_size(), None);
    let src = Arc::new(HostKvPool::new(g.clone(), n as u32).map_err(de)?);
    let mut row = Vec::new();
    for c in g.components() {
        row.resize(c.page_layer_bytes as usize, 0);
        for &l in &c.layers {
            for p in 0..n {
                fill_row(&mut row, u64::from(c.id.0) + 1, l, p as u64);
                // SAFETY: `src` is filled here, on one thread, before the saver shares it.
                unsafe { src.write_slot(c.id, l, p as u32, &row) }.map_err(de)?;
            }
        }
    }
    let saver = Linker::new(g.clone(), store.clone(), src, LinkerConfig::default())
        .map_err(|e| e.to_string())?;
    saver
        .save(&plan(&g, 0, &pages, (0..n as u32).collect()))
        .map_err(|e| e.to_string())?;
    saver.close().map_err(|e| e.to_string())?;
    Ok(Prefix { g, store, pages })
}

fn plan(g: &KvGeometry, batch: u64, pages: &[PageHash], slots: Vec<u32>) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: "gpu".into(),
            pages: pages.to_vec(),
        }],
        slots,
    )
}

/// A linker over `store` landing into a fresh device pool of `pool_pages`.
fn device_linker(
    read_parallelism: usize,
    dev: &Arc<CudaDevice>,
    g: &KvGeometry,
    store: Arc<dyn KvStore>,
    pool_pages: u32,
    pages: usize,
) -> Result<(Linker, Arc<CudaKvPool>), String> {
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(g, pages), 2).map_err(de)?;
    let landings = Arc::new(StagedLandingFactory::new(pool.clone(), staging));
    let config = LinkerConfig {
        wait_deadline: Duration::from_secs(60),
        read_parallelism,
        ..LinkerConfig::default()
    };
    let linker = Linker::with_landings(g.clone(), store, pool.clone(), landings, config, None)
        .map_err(|e| e.to_string())?;
    Ok((linker, pool))
}

/// Waits every layer as an engine would: the event each wait hands back, synchronized.
fn wait_layers(linker: &Linker, t: &kvlink::kv_loader::LoadTicket) -> Result<Vec<f64>, String> {
    let t0 = Instant::now();
    let mut at = Vec::new();
    for l in 0..linker.num_layers() {
        match linker.wait_layer(t, l).map_err(|e| e.to_string())? {
            LayerReady::Event(ev) => ev.synchronize().map_err(|e| e.to_string())?,
            LayerReady::Resident => {
                return Err(format!("layer {l}: a device pool must hand back an event"))
            }
        }
        at.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok(at)
}

/// Every layer of every page equals the saved bytes.
fn compare(pool: &CudaKvPool, g: &KvGeometry, slots: &[u32], upto: u32) -> Result<u64, String> {
    let (mut want, mut got, mut bytes) = (Vec::new(), Vec::new(), 0);
    for c in g.components() {
        want.resize(c.page_layer_bytes as usize, 0);
        got.resize(c.page_layer_bytes as usize, 0);
        for &l in c.layers.iter().filter(|&&l| l < upto) {
            for (p, &s) in slots.iter().enumerate() {
                fill_row(&mut want, u64::from(c.id.0) + 1, l, p as u64);
                pool.read_slot(c.id, l, s, &mut got).map_err(de)?;
                if got != want {
                    return Err(format!(
                        "component {} layer {l} page {p} (slot {s}) differs",
                        c.name
                    ));
                }
                bytes += got.len() as u64;
            }
        }
    }
    Ok(bytes)
}

/// The Linker into a device pool: loaded bytes, a save from the device, a failure (the check
/// rows).
pub fn run(args: &Args, report: &mut Report) {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => return report.push(SEC, "CUDA device", Status::Fail, de(e)),
    };
    let n = if args.quick { 32 } else { 128 };
    let r = correctness(&dev, n);
    report.push(
        SEC,
        "Linker → CudaKvPool = saved bytes (scattered slots, events)",
        status(&r),
        r.unwrap_or_else(|e| e),
    );
    let r = save_from_device(&dev, n);
    report.push(
        SEC,
        "Linker: save from a device pool, reload into another = saved bytes",
        status(&r),
        r.unwrap_or_else(|e| e),
    );
    let r = failure(&dev, n);
    report.push(
        SEC,
        "Linker: failure at layer 40 on a device pool, next batch loads",
        status(&r),
        r.unwrap_or_else(|e| e),
    );
}

/// The Linker's layer-wise load into a device pool, timed (the benchmark rows).
pub fn run_bench(args: &Args, report: &mut Report) {
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
        let r = bench(&dev, tokens);
        report.push(
            "bench",
            format!(
                "Linker layer-wise load {}K tokens → device pool (embedded store)",
                tokens / 1024
            ),
            status(&r),
            r.unwrap_or_else(|e| e),
        );
    }
}

fn status(r: &Result<String, String>) -> Status {
    if r.is_ok() {
        Status::Pass
    } else {
        Status::Fail
    }
}

fn correctness(dev: &Arc<CudaDevice>, n: usize) -> Result<String, String> {
    let p = saved_prefix(n, 7)?;
    let pool_pages = 2 * n as u32 + 8;
    let (linker, pool) = device_linker(1, dev, &p.g, p.store.clone(), pool_pages, n)?;
    let slots = Rng(99).scattered_slots(n, pool_pages);
    let t = linker
        .start_load(plan(&p.g, 1, &p.pages, slots.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&linker, &t)?;
    let stats = linker
        .wait_batch(&t)
        .map_err(|e| e.to_string())?
        .result
        .map_err(|e| e.to_string())?;
    let bytes = compare(&pool, &p.g, &slots, p.g.num_layers())?;
    linker.close().map_err(|e| e.to_string())?;
    Ok(format!(
        "{n} pages, 78 layer events, {:.0} MB compared, {} B read",
        bytes as f64 / 1e6,
        stats.bytes_read
    ))
}

/// A prefix loaded into one device pool is saved from it into a fresh store (the save
/// direction: device slots → pinned staging → objects), then loaded into a second device pool
/// with other slots and compared with the original bytes.
fn save_from_device(dev: &Arc<CudaDevice>, n: usize) -> Result<String, String> {
    let p = saved_prefix(n, 13)?;
    let pool_pages = 2 * n as u32 + 8;
    let (first, pool_a) = device_linker(1, dev, &p.g, p.store.clone(), pool_pages, n)?;
    let slots_a = Rng(3).scattered_slots(n, pool_pages);
    let t = first
        .start_load(plan(&p.g, 1, &p.pages, slots_a.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&first, &t)?;
    first
        .wait_batch(&t)
        .map_err(|e| e.to_string())?
        .result
        .map_err(|e| e.to_string())?;
    // The same pool, saved through a linker over a fresh store.
    let fresh = Arc::new(EmbeddedStore::new(
        p.g.bytes_per_page() * n as u64 + (1 << 30),
    ));
    let staging = StagingPool::new(dev.clone(), half_bytes(&p.g, n), 1).map_err(de)?;
    let saver = Linker::with_landings(
        p.g.clone(),
        fresh.clone(),
        pool_a.clone(),
        Arc::new(StagedLandingFactory::new(pool_a.clone(), staging)),
        LinkerConfig::default(),
        None,
    )
    .map_err(|e| e.to_string())?;
    let t0 = Instant::now();
    let report = saver
        .save(&plan(&p.g, 2, &p.pages, slots_a))
        .map_err(|e| e.to_string())?;
    let save_ms = t0.elapsed().as_secs_f64() * 1e3;
    let expected = n * p.g.components().len();
    if report.objects_written as usize != expected {
        return Err(format!(
            "{} objects written, {expected} expected",
            report.objects_written
        ));
    }
    let (second, pool_b) = device_linker(1, dev, &p.g, fresh.clone(), pool_pages, n)?;
    let slots_b: Vec<u32> = (0..n as u32).map(|i| pool_pages - 1 - 2 * i).collect();
    let t = second
        .start_load(plan(&p.g, 3, &p.pages, slots_b.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&second, &t)?;
    second
        .wait_batch(&t)
        .map_err(|e| e.to_string())?
        .result
        .map_err(|e| e.to_string())?;
    let bytes = compare(&pool_b, &p.g, &slots_b, p.g.num_layers())?;
    Ok(format!(
        "{} objects ({:.0} MB) saved from device slots in {save_ms:.0} ms; reloaded elsewhere, {:.0} MB compared",
        report.objects_written,
        report.bytes_written as f64 / 1e6,
        bytes as f64 / 1e6
    ))
}

fn failure(dev: &Arc<CudaDevice>, n: usize) -> Result<String, String> {
    let p = saved_prefix(n, 11)?;
    let faulty = Arc::new(FaultyStore::new(p.store.clone()));
    let k =
        p.g.component_by_name("k")
            .map_err(|e| e.to_string())?
            .clone();
    faulty.inject(
        FaultRule {
            key_contains: Some("_k".into()),
            offset: k.layer_range(40).map(|r| r.start),
            times: Some(1),
        },
        Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
    );
    let pool_pages = n as u32 + 4;
    let (linker, pool) = device_linker(1, dev, &p.g, faulty.clone(), pool_pages, n)?;
    let slots: Vec<u32> = (0..n as u32).rev().collect();
    let t = linker
        .start_load(plan(&p.g, 1, &p.pages, slots.clone()))
        .map_err(|e| e.to_string())?;
    for l in 0..40 {
        if let LayerReady::Event(ev) = linker.wait_layer(&t, l).map_err(|e| e.to_string())? {
            ev.synchronize().map_err(|e| e.to_string())?;
        }
    }
    let err = match linker.wait_layer(&t, 40) {
        Err(e) => e,
        Ok(_) => return Err("layer 40 was reported ready".into()),
    };
    if linker
        .wait_batch(&t)
        .map_err(|e| e.to_string())?
        .result
        .is_ok()
    {
        return Err("the batch was reported loaded".into());
    }
    compare(&pool, &p.g, &slots, 40)?;
    faulty.clear();
    let t = linker
        .start_load(plan(&p.g, 2, &p.pages, slots.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&linker, &t)?;
    linker
        .wait_batch(&t)
        .map_err(|e| e.to_string())?
        .result
        .map_err(|e| e.to_string())?;
    compare(&pool, &p.g, &slots, 78)?;
    Ok(format!(
        "layer 40: {err}; layers 0..40 were right; the next batch loaded all 78"
    ))
}

fn bench(dev: &Arc<CudaDevice>, tokens: u64) -> Result<String, String> {
    let n = (tokens / 64) as usize;
    let t_fill = Instant::now();
    let p = saved_prefix(n, 3)?;
    let fill = t_fill.elapsed().as_secs_f64();
    let slots: Vec<u32> = Rng(5).scattered_slots(n, n as u32);
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
            let at = wait_layers(&linker, &t)?;
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
    // The parts, same run: the same ranged reads into pinned host memory on one thread
    // (the store's share), and the bytes' H2D at the ceiling measured by the h2d bench.
    let bytes = p.g.bytes_per_page() * n as u64;
    let mut host = vec![0u8; (half_bytes(&p.g, n)).max(1)];
    let t0 = Instant::now();
    for l in 0..p.g.num_layers() {
        let mut off = 0;
        for (c, ks) in p.g.components().iter().zip(&keys) {
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
    let read_ms = t0.elapsed().as_secs_f64() * 1e3;
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
        "{:.2} GB: {}; raw single-thread store reads of the same bytes {read_ms:.0} ms (bound for 1 reader ≈ reads + one layer = {:.0} ms); store fill {fill:.1} s",
        bytes as f64 / 1e9,
        runs.join("; "),
        read_ms + per_layer
    ))
}
