//! The Linker on a device pool: layer-wise loads through `KvLoader` into a `CudaKvPool`
//! (StagedLandingFactory), checked against the saved bytes, a failure at a layer, and the
//! time to the last layer against its parts.

use std::sync::Arc;
use std::time::Instant;

use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{StagedLandingFactory, StagingPool};
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::{KvLoader, LayerReady};
use kvlink::mooncake_linker::store::{EmbeddedStore, Fault, FaultRule, FaultyStore, StoreError};
use kvlink::mooncake_linker::{Linker, LinkerConfig};

use super::Args;
use kvlink_rig::device_linker::{device_linker, plan, saved_prefix, wait_layers};
use kvlink_rig::glm::{half_bytes, tag};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::{de, Report, Status};

const SEC: &str = "linker";

/// Every layer of every page equals the saved bytes.
fn compare(pool: &CudaKvPool, g: &KvGeometry, slots: &[u32], upto: u32) -> Result<u64, String> {
    let (mut want, mut got, mut bytes) = (Vec::new(), Vec::new(), 0);
    for c in g.components() {
        want.resize(c.page_layer_bytes as usize, 0);
        got.resize(c.page_layer_bytes as usize, 0);
        for &l in c.layers.iter().filter(|&&l| l < upto) {
            for (p, &s) in slots.iter().enumerate() {
                fill_row(&mut want, tag(c), l, p as u64);
                // SAFETY: the batch's outcome was taken: nothing writes the pool meanwhile.
                unsafe { pool.read_slot(c.id, l, s, &mut got) }.map_err(de)?;
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
    let r = save_after_the_engines_stream(&dev);
    report.push(
        SEC,
        "Linker: a save through the trait named the engine's stream: pages its kernels wrote late",
        status(&r),
        r.unwrap_or_else(|e| e),
    );
}

/// An engine's compute stream writes two pages into a device pool behind about a hundred
/// milliseconds of other work (memsets of a scratch buffer); the engine then saves through the
/// trait it holds, naming that stream (`KvLoader::save_after_stream`). Every saved object must
/// hold the late bytes: the gather waited for the stream device-side. The same with plain
/// `save` is the control, in the same run: it shows the race the ordering closes (a saved
/// object of the slots' zeros), reported, not checked (a fast device may finish first).
fn save_after_the_engines_stream(dev: &Arc<CudaDevice>) -> Result<String, String> {
    let ordered = late_save(dev, true)?;
    if ordered.stale > 0 {
        return Err(format!(
            "{} of {} objects hold bytes the engine's stream had not written yet: the save \
             read the slots before the stream's work ran ({})",
            ordered.stale, ordered.objects, ordered.timing
        ));
    }
    let control = match late_save(dev, false) {
        Ok(c) => format!(
            "{} of {} objects stored before the engine wrote them ({})",
            c.stale, c.objects, c.timing
        ),
        Err(e) => format!("not shown: {e}"),
    };
    Ok(format!(
        "{} objects hold the late bytes ({}); control, plain `save` in the same set-up: \
         {control}",
        ordered.objects, ordered.timing
    ))
}

/// What one [`late_save`] stored.
struct LateSave {
    objects: usize,
    /// Objects that do not hold the engine's late bytes.
    stale: usize,
    timing: String,
}

/// The byte page `page` of a late save holds in every layer: not the zeros the pool starts
/// with.
fn late_byte(page: usize) -> u8 {
    0xa0 + page as u8
}

/// Two pages written into a fresh device pool by an engine stream (device-side memsets)
/// behind ~300 memsets of 1 GiB, then saved (`ordered`: through `save_after_stream` naming
/// that stream; else plain `save`) into a fresh store; how many saved objects hold the late
/// bytes.
fn late_save(dev: &Arc<CudaDevice>, ordered: bool) -> Result<LateSave, String> {
    use kvlink::kv_device::cuda::cudarc::driver::result as cu;
    let err = |e: kvlink::kv_device::cuda::cudarc::driver::DriverError| e.to_string();
    let n = 2;
    let p = saved_prefix(n, 17)?;
    let fresh = Arc::new(EmbeddedStore::new(
        p.g.bytes_per_page() * n as u64 + (1 << 30),
    ));
    let (saver, pool) = device_linker(1, dev, &p.g, fresh.clone(), 8, n)?;
    let slots = vec![5u32, 2];
    let ctx = dev.context();
    let engine = ctx.new_stream().map_err(err)?;
    let mut scratch = engine.alloc_zeros::<u8>(1 << 30).map_err(err)?;
    let t0 = Instant::now();
    for _ in 0..300 {
        engine.memset_zeros(&mut scratch).map_err(err)?;
    }
    ctx.bind_to_thread().map_err(err)?;
    for (page, &slot) in slots.iter().enumerate() {
        for c in p.g.components() {
            let row = c.page_layer_bytes as usize;
            for &l in &c.layers {
                let (buf, len) = pool.buffer(c.id, l).map_err(de)?;
                let at = slot as usize * row;
                if at + row > len {
                    return Err(format!("slot {slot} past the pool buffer"));
                }
                // SAFETY: the destination is slot `slot`'s row of this pool buffer (inside it,
                // checked above), which nothing else writes until the save below (this check
                // is the engine). A device-side memset: no host memory whose staging could
                // make the driver wait for the stream here.
                unsafe {
                    cu::memset_d8_async(buf + at as u64, late_byte(page), row, engine.cu_stream())
                }
                .map_err(err)?;
            }
        }
    }
    // The engine's writes must still be queued when the save starts, or the run shows
    // nothing (a device that ran the memsets before this point): inconclusive, not a pass.
    let written = engine.record_event(None).map_err(err)?;
    let queued_ms = t0.elapsed().as_secs_f64() * 1e3;
    let plan = plan(&p.g, 1, &p.pages, slots);
    let keys = saver.object_keys(&plan).map_err(|e| e.to_string())?;
    let loader: Arc<dyn KvLoader> = Arc::new(saver);
    // SAFETY: `engine` is a live stream of this process's context, kept past the save.
    let stream = unsafe { kvlink::kv_loader::RawStream::from_raw(engine.cu_stream() as usize) };
    if written.try_is_complete().map_err(err)? {
        return Err(format!(
            "inconclusive: the engine's writes had run before the save started ({:.0} ms)",
            t0.elapsed().as_secs_f64() * 1e3
        ));
    }
    let report = if ordered {
        loader.save_after_stream(&plan, stream)
    } else {
        loader.save(&plan)
    }
    .map_err(|e| e.to_string())?;
    let saved_ms = t0.elapsed().as_secs_f64() * 1e3;
    engine.synchronize().map_err(err)?;
    let done_ms = t0.elapsed().as_secs_f64() * 1e3;
    let objects = n * p.g.components().len();
    if report.objects_written as usize != objects {
        return Err(format!(
            "{} objects written, {objects} expected",
            report.objects_written
        ));
    }
    let mut stale = 0;
    for (c, keys) in p.g.components().iter().zip(&keys) {
        for (page, key) in keys.iter().enumerate() {
            let object = get_object(fresh.as_ref(), key, c.object_bytes() as usize)?;
            if object.iter().any(|&b| b != late_byte(page)) {
                stale += 1;
            }
        }
    }
    loader.close().map_err(|e| e.to_string())?;
    Ok(LateSave {
        objects,
        stale,
        timing: format!(
            "the engine's work queued in {queued_ms:.0} ms, the save returned at \
             {saved_ms:.0} ms, the stream's work ended by {done_ms:.0} ms"
        ),
    })
}

/// Object `key` of `store`, `len` bytes.
fn get_object(store: &EmbeddedStore, key: &str, len: usize) -> Result<Vec<u8>, String> {
    use kvlink::mooncake_linker::store::{KvStore, ObjectGet};
    let mut buf = vec![0u8; len];
    let g = ObjectGet {
        key,
        dst: buf.as_mut_ptr(),
        len,
    };
    // SAFETY: `buf` is ours, valid for `len` bytes and untouched during the call.
    match unsafe { store.get_into(&[g]) }.pop() {
        Some(Ok(n)) if n == len as u64 => Ok(buf),
        other => Err(format!("{key}: {other:?}")),
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
    let slots = Rng(99).scattered_slots(n, pool_pages)?;
    let t = linker
        .start_load(plan(&p.g, 1, &p.pages, slots.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&linker, &t, Instant::now())?;
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
    let slots_a = Rng(3).scattered_slots(n, pool_pages)?;
    let t = first
        .start_load(plan(&p.g, 1, &p.pages, slots_a.clone()))
        .map_err(|e| e.to_string())?;
    wait_layers(&first, &t, Instant::now())?;
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
    wait_layers(&second, &t, Instant::now())?;
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
            ..FaultRule::default()
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
    wait_layers(&linker, &t, Instant::now())?;
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
