//! NCCL: one rank end to end, an initialisation that times out, two ranks when possible, and
//! the dedup path (stage → broadcast → land from device) on one rank.

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{
    nccl_unique_id, nccl_version, NcclCollective, NcclConfig, NcclGroup,
};
use kvlink::dedup_broadcast::{
    all_gather_slices, broadcast_slice, share_stage, Collective, CollectiveError, StageShare,
};
use kvlink::kv_device::cuda::cudarc::driver::result;
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool, DeviceBuffer};
use kvlink::kv_device::{
    BatchShape, DeviceRegion, DeviceShare, DirectLanding, HostKvPool, KvPool, LayerLanding,
    RowBlock, SharedEvent, StagedLanding, StagingPool,
};
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::LayerReady;

use super::checks::{compare_pools, glm, half_bytes, own_all};
use super::util::{de, fill_row, Report, Rng, Status};
use super::Args;

const SEC: &str = "nccl";

fn ce(e: CollectiveError) -> String {
    e.to_string()
}

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

pub fn run(args: &Args, gpus: u32, report: &mut Report) {
    match nccl_version() {
        Ok(v) => report.info(SEC, "NCCL library version", v.to_string()),
        Err(e) => {
            report.push(SEC, "NCCL library", Status::Fail, ce(e));
            return;
        }
    }
    let ranks = match NcclGroup::new_in_process(&[0]) {
        Ok(r) => {
            report.push(
                SEC,
                "1 rank: communicator set-up",
                Status::Pass,
                "non-blocking communicator on GPU 0",
            );
            r
        }
        Err(e) => {
            report.push(SEC, "1 rank: communicator set-up", Status::Fail, ce(e));
            return;
        }
    };
    let coll = &ranks[0];
    report.check(
        SEC,
        "1 rank: broadcast + all_gather (device buffers)",
        || device_ops(coll),
    );
    report.check(
        SEC,
        "1 rank: host buffers, all_gather_u64/bytes, min",
        || host_ops(coll),
    );
    report.check(
        SEC,
        "1 rank: misuse refused (root, lengths, other GPU)",
        || misuse(coll),
    );
    report.check(
        SEC,
        "1 rank dedup path: upload → broadcast_device → scatter (share_stage)",
        || dedup_path(coll, args),
    );
    drop(ranks);
    if gpus >= 2 {
        report.check(
            SEC,
            "2 ranks: broadcast, all_gather, u64 exchange",
            two_ranks,
        );
    } else {
        report.push(
            SEC,
            "2 ranks",
            Status::Skip,
            format!("{gpus} GPU visible; needs 2"),
        );
    }
}

/// The checks that abort communicators: run last, after the benchmarks, so an abort cannot
/// disturb them.
pub fn run_aborts(gpus: u32, report: &mut Report) {
    report.check(
        SEC,
        "init with a rank that never joins: Timeout, no hang",
        init_timeout,
    );
    if gpus >= 2 {
        report.check(
            SEC,
            "2 ranks: rank 1 never issues: Timeout then Aborted",
            two_ranks_timeout,
        );
    } else {
        report.push(
            SEC,
            "2 ranks: a rank that never issues",
            Status::Skip,
            format!("{gpus} GPU visible; needs 2"),
        );
    }
}

fn region(ordinal: u32, b: &DeviceBuffer) -> DeviceRegion {
    DeviceRegion {
        ordinal,
        addr: b.ptr(),
        len: b.len(),
    }
}

fn device_ops(coll: &NcclCollective) -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    let n = 1 << 20;
    let mut host = vec![0u8; n];
    fill_row(&mut host, 3, 0, 0);
    let d = DeviceBuffer::zeroed(dev.context(), n, "test").map_err(de)?;
    dev.bind().map_err(de)?;
    // SAFETY: synchronous copy into our buffer of `n` bytes.
    unsafe { result::memcpy_htod_sync(d.ptr(), &host) }.map_err(|e| e.to_string())?;
    // The device operations: ordered after an event of the load stream, completion as an event.
    let before: SharedEvent =
        kvlink::kv_device::cuda::CudaLayerEvent::record_on(dev.cuda_load_stream(), 0)
            .map_err(de)?;
    // SAFETY: `d` is our device buffer on GPU 0, untouched by other work until the event.
    let ev =
        unsafe { coll.broadcast_device(region(0, &d), Some(before), 0, soon()) }.map_err(ce)?;
    if !ev.wait_until(soon()).map_err(de)? {
        return Err("broadcast_device did not complete".into());
    }
    // SAFETY: as above; in place (one rank: the chunk is the whole buffer).
    let ev = unsafe { coll.all_gather_device(region(0, &d), Some(ev), soon()) }.map_err(ce)?;
    if !ev.wait_until(soon()).map_err(de)? {
        return Err("all_gather_device did not complete".into());
    }
    let mut out = vec![0u8; n];
    dev.bind().map_err(de)?;
    // SAFETY: synchronous copy out of our buffer after the events completed.
    unsafe { result::memcpy_dtoh_sync(&mut out, d.ptr()) }.map_err(|e| e.to_string())?;
    if out != host {
        return Err("device operations changed the bytes".into());
    }
    Ok("1 MiB broadcast_device, all_gather_device (event-ordered): bytes equal".into())
}

fn host_ops(coll: &NcclCollective) -> Result<String, String> {
    let mut buf = vec![7u8; 4096];
    broadcast_slice(coll, &mut buf, 0, soon()).map_err(ce)?;
    let send = vec![5u8; 100];
    let mut recv = vec![0u8; 100];
    all_gather_slices(coll, &send, &mut recv, soon()).map_err(ce)?;
    if recv != send || buf != vec![7u8; 4096] {
        return Err("host broadcast / all_gather wrong".into());
    }
    let v = coll.all_gather_u64(0xdead_beef_1234, soon()).map_err(ce)?;
    let b = coll.all_gather_bytes(b"plan-digest", soon()).map_err(ce)?;
    let m = coll.all_reduce_min_u64(42, soon()).map_err(ce)?;
    let e = coll.all_gather_bytes(b"", soon()).map_err(ce)?;
    if v != vec![0xdead_beef_1234]
        || b != vec![b"plan-digest".to_vec()]
        || m != 42
        || e != vec![Vec::<u8>::new()]
    {
        return Err(format!("small exchanges wrong: {v:?} {b:?} {m} {e:?}"));
    }
    Ok("u64, bytes, min, empty all as expected".into())
}

fn misuse(coll: &NcclCollective) -> Result<String, String> {
    let mut seen = Vec::new();
    let mut buf = vec![0u8; 64];
    match broadcast_slice(coll, &mut buf, 3, soon()) {
        Err(e @ CollectiveError::InvalidArgument { .. }) => seen.push(e.to_string()),
        other => return Err(format!("root 3 of 1 rank: {other:?}")),
    }
    let send = vec![0u8; 10];
    let mut recv = vec![0u8; 11];
    match all_gather_slices(coll, &send, &mut recv, soon()) {
        Err(e @ CollectiveError::InvalidArgument { .. }) => seen.push(e.to_string()),
        other => return Err(format!("bad recv length: {other:?}")),
    }
    let other = DeviceRegion {
        ordinal: 7,
        addr: 0x1000,
        len: 16,
    };
    // SAFETY: refused before any memory is touched (another GPU's region).
    match unsafe { coll.broadcast_device(other, None, 0, soon()) } {
        Err(e @ CollectiveError::InvalidArgument { .. }) => seen.push(e.to_string()),
        other => return Err(format!("other GPU: {other:?}")),
    }
    // The communicator is still usable after refusals.
    coll.all_gather_u64(1, soon()).map_err(ce)?;
    Ok(seen.join(" | "))
}

/// Rank0Broadcast's share area of `layer`: one block per component carried, pages in plan
/// order.
fn blocks(g: &KvGeometry, layer: u32, n: usize) -> Vec<RowBlock> {
    let mut off = 0;
    g.components()
        .iter()
        .filter(|c| c.position(layer).is_some())
        .map(|c| {
            let b = RowBlock {
                component: c.id,
                first_page: 0,
                pages: n,
                offset: off,
            };
            off += n * c.page_layer_bytes as usize;
            b
        })
        .collect()
}

/// The dedup path on one rank: the reader's rows go to the share area of pinned staging, one
/// upload to device staging, NCCL broadcasts it on the comm stream (ordered after the upload
/// by an event), the load stream waits for the broadcast and scatters into the slots; the pool
/// must equal the host reference.
fn dedup_path(coll: &NcclCollective, args: &Args) -> Result<String, String> {
    let dev = CudaDevice::new(0).map_err(de)?;
    let g = glm();
    let pages = if args.quick { 48 } else { 128 };
    let n = if args.quick { 16 } else { 48 };
    let slots: Arc<[u32]> = Rng(77).scattered_slots(n, pages).into();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let host = Arc::new(HostKvPool::new(g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
    let share_bytes: Vec<usize> = (0..g.num_layers())
        .map(|l| {
            blocks(&g, l, n)
                .iter()
                .map(|b| {
                    b.pages
                        * g.component(b.component)
                            .map_or(0, |c| c.page_layer_bytes as usize)
                })
                .sum()
        })
        .collect();
    let shape = BatchShape {
        own: Vec::new(),
        shared: g.components().iter().map(|c| c.id).collect(),
        share_bytes: share_bytes.clone(),
    };
    let mut staged = StagedLanding::new(
        pool.clone(),
        staging.lease().map_err(de)?,
        slots.clone(),
        shape,
    )
    .map_err(de)?;
    let host_dyn: Arc<dyn KvPool> = host.clone();
    let mut direct = DirectLanding::new(host_dyn, slots.clone(), own_all(&g)).map_err(de)?;
    let (mut ss, mut ds) = (staged.take_stages(), direct.take_stages());
    let compute = dev.context().new_stream().map_err(|e| e.to_string())?;
    for layer in 0..g.num_layers() {
        let (s, d) = (&mut ss[layer as usize % 2], &mut ds[layer as usize % 2]);
        staged.open(s, layer, soon()).map_err(de)?;
        direct.open(d, layer, soon()).map_err(de)?;
        let bl = blocks(&g, layer, n);
        // This check stands in for the store: it fills both stages through their loans.
        let (mut sloan, mut dloan) = (staged.lend(s).map_err(de)?, direct.lend(d).map_err(de)?);
        for b in &bl {
            let len = g
                .component(b.component)
                .map_err(|e| e.to_string())?
                .page_layer_bytes as usize;
            let mut row = vec![0u8; len];
            for page in 0..n {
                fill_row(&mut row, u64::from(b.component.0) + 1, layer, page as u64);
                let t = staged
                    .share_target(&sloan, b.offset + page * len, len)
                    .map_err(de)?;
                let h = direct.target(&dloan, b.component, page).map_err(de)?;
                sloan.write(t, &row).map_err(de)?;
                dloan.write(h, &row).map_err(de)?;
            }
        }
        drop((sloan, dloan));
        staged
            .upload(s, 0..share_bytes[layer as usize])
            .map_err(de)?;
        let bcast = {
            let mut stage = staged.device_stage(s).map_err(de)?;
            share_stage(coll, &mut stage, StageShare::Broadcast { root: 0 }, soon()).map_err(ce)?
        };
        staged.scatter(s, &bl, &bcast).map_err(de)?;
        match staged.land(s).map_err(de)? {
            LayerReady::Event(ev) => {
                // SAFETY: `compute` is a live stream of this context, alive past this call.
                let raw =
                    unsafe { kvlink::kv_loader::RawStream::from_raw(compute.cu_stream() as usize) };
                ev.wait_on_stream(raw).map_err(|e| e.to_string())?
            }
            LayerReady::Resident => return Err("Resident from a device landing".into()),
        }
        let _ = direct.land(d);
    }
    compute.synchronize().map_err(|e| e.to_string())?;
    let t = staged.transfers();
    drop(staged);
    let bytes = compare_pools(&pool, &host)?;
    let h2d: u64 = t.iter().map(|t| t.host_to_device).sum();
    let d2d: u64 = t.iter().map(|t| t.device_to_device).sum();
    Ok(format!(
        "{} layers, {:.0} MB compared; {:.0} MB host→device (one upload per layer), {:.0} MB device→device (scatter)",
        g.num_layers(),
        bytes as f64 / 1e6,
        h2d as f64 / 1e6,
        d2d as f64 / 1e6
    ))
}

fn init_timeout() -> Result<String, String> {
    let id = nccl_unique_id().map_err(ce)?;
    let cfg = NcclConfig {
        init_timeout: Duration::from_secs(3),
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let t0 = Instant::now();
    let r = NcclCollective::join(id, 0, 2, 0, cfg);
    let took = t0.elapsed();
    match r {
        Err(CollectiveError::Timeout { .. }) if took < Duration::from_secs(20) => Ok(format!(
            "Timeout after {:.1} s (limit 3 s + abort)",
            took.as_secs_f64()
        )),
        Err(e) => Err(format!("expected Timeout, got {e} after {took:?}")),
        Ok(_) => Err("a group of 2 with one rank formed".into()),
    }
}

fn two_ranks() -> Result<String, String> {
    let ranks = NcclGroup::new_in_process(&[0, 1]).map_err(ce)?;
    let n = 8 << 20;
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|coll| {
                s.spawn(move || -> Result<(), String> {
                    let r = coll.rank();
                    let dev = CudaDevice::new(r).map_err(de)?;
                    let mut want = vec![0u8; n];
                    fill_row(&mut want, 4, 0, 0);
                    let d = DeviceBuffer::zeroed(dev.context(), n, "test").map_err(de)?;
                    if r == 0 {
                        dev.bind().map_err(de)?;
                        // SAFETY: synchronous copy into our buffer.
                        unsafe { result::memcpy_htod_sync(d.ptr(), &want) }
                            .map_err(|e| e.to_string())?;
                    }
                    // SAFETY: `d` is this rank's device buffer, idle until the event completes.
                    let ev = unsafe { coll.broadcast_device(region(r, &d), None, 0, soon()) }
                        .map_err(ce)?;
                    if !ev.wait_until(soon()).map_err(de)? {
                        return Err(format!("rank {r}: broadcast_device did not complete"));
                    }
                    let mut got = vec![0u8; n];
                    dev.bind().map_err(de)?;
                    // SAFETY: synchronous copy out of our buffer after the broadcast completed.
                    unsafe { result::memcpy_dtoh_sync(&mut got, d.ptr()) }
                        .map_err(|e| e.to_string())?;
                    if got != want {
                        return Err(format!("rank {r}: broadcast bytes differ"));
                    }
                    let mine = vec![r as u8 + 1; 1000];
                    let mut all = vec![0u8; 2000];
                    all_gather_slices(coll, &mine, &mut all, soon()).map_err(ce)?;
                    if all[..1000] != [1u8; 1000][..] || all[1000..] != [2u8; 1000][..] {
                        return Err(format!("rank {r}: all_gather wrong"));
                    }
                    let v = coll
                        .all_gather_u64(u64::from(r) * 10 + 5, soon())
                        .map_err(ce)?;
                    if v != vec![5, 15] {
                        return Err(format!("rank {r}: u64 exchange {v:?}"));
                    }
                    Ok(())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("rank thread panicked".into()))
            })
            .collect()
    });
    for r in results {
        r?;
    }
    Ok("8 MiB broadcast, all_gather, u64 exchange on GPUs 0 and 1".into())
}

fn two_ranks_timeout() -> Result<String, String> {
    let cfg = NcclConfig {
        abort_grace: Duration::from_secs(10),
        ..NcclConfig::default()
    };
    let ranks = NcclGroup::new_in_process_with(&[0, 1], cfg).map_err(ce)?;
    // Both ranks once (so connections exist), then rank 0 alone.
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for coll in &ranks {
            let b = &barrier;
            s.spawn(move || {
                let _ = coll.all_gather_u64(1, soon());
                b.wait();
            });
        }
    });
    let t0 = Instant::now();
    let r = ranks[0].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    let took = t0.elapsed();
    let first = match r {
        Err(e @ CollectiveError::Timeout { .. }) => e.to_string(),
        other => return Err(format!("expected Timeout, got {other:?}")),
    };
    let next = match ranks[0].all_gather_u64(3, soon()) {
        Err(e @ CollectiveError::Aborted { .. }) => e.to_string(),
        other => return Err(format!("expected Aborted after the abort, got {other:?}")),
    };
    // Rank 1 issues late: its peer aborted, so it must fail by its own deadline, not hang.
    let t1 = Instant::now();
    let late =
        ranks[1].all_gather_u64(2, kvlink::kv_loader::deadline_after(Duration::from_secs(2)));
    if late.is_ok() {
        return Err("rank 1 completed against an aborted peer".into());
    }
    Ok(format!(
        "rank 0: {first} after {:.1} s; then {next}; rank 1 late: failed after {:.1} s",
        took.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    ))
}
