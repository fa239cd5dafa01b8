//! NCCL: one rank end to end, an initialisation that times out, two ranks when possible, and
//! the dedup path (stage → broadcast → land from device) on one rank.

use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{nccl_version, NcclCollective, NcclGroup};
use kvlink::dedup_broadcast::{all_gather_slices, broadcast_slice, Collective, CollectiveError};
use kvlink::kv_device::cuda::cudarc::driver::result;
use kvlink::kv_device::cuda::{CudaDevice, DeviceBuffer};
use kvlink::kv_device::{DeviceRegion, SharedEvent};

use kvlink_rig::pattern::fill_row;
use kvlink_rig::report::{de, Report, Status};

use super::nccl_share_step::dedup_path;
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
        // SAFETY: events and raw copies of this crate's memory on the load stream: no
        // `CudaSlice` is made through it.
        kvlink::kv_device::cuda::CudaLayerEvent::record_on(unsafe { dev.cuda_load_stream() }, 0)
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
    // Empty regions: NCCL discards an empty collective without meeting any peer, so kvlink
    // moves one byte of its scratch instead (with one rank, this runs that path).
    let empty = DeviceRegion {
        ordinal: 0,
        addr: 0,
        len: 0,
    };
    // SAFETY: an empty region: no memory of the caller's is touched.
    let ev = unsafe { coll.broadcast_device(empty, None, 0, soon()) }.map_err(ce)?;
    // SAFETY: as above.
    let ev = unsafe { coll.all_gather_device(empty, Some(ev), soon()) }.map_err(ce)?;
    if !ev.wait_until(soon()).map_err(de)? {
        return Err("empty device operations did not complete".into());
    }
    Ok("1 MiB broadcast_device, all_gather_device (event-ordered): bytes equal; empty ones complete".into())
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
    // Fresh bytes each round, gathered back through the scratch: the copy in must be ordered
    // before the NCCL call on the comm stream (a copy on another stream would let the call
    // send the previous round's bytes).
    let rounds = 200usize;
    for i in 0..rounds {
        let send: Vec<u8> = (0..(1usize << 20))
            .map(|j| (i * 31 + j * 7 + (j >> 12)) as u8)
            .collect();
        let mut recv = vec![0u8; send.len()];
        all_gather_slices(coll, &send, &mut recv, soon()).map_err(ce)?;
        if recv != send {
            let at = recv.iter().zip(&send).position(|(a, b)| a != b);
            return Err(format!("round {i}: gathered bytes differ from byte {at:?}"));
        }
    }
    let v = coll.all_gather_u64(0xdead_beef_1234, soon()).map_err(ce)?;
    let b = coll.all_gather_bytes(b"plan-digest", soon()).map_err(ce)?;
    let m = coll.all_reduce_min_u64(42, soon()).map_err(ce)?;
    let e = coll.all_gather_bytes(b"", soon()).map_err(ce)?;
    broadcast_slice(coll, &mut [], 0, soon()).map_err(ce)?;
    if v != vec![0xdead_beef_1234]
        || b != vec![b"plan-digest".to_vec()]
        || m != 42
        || e != vec![Vec::<u8>::new()]
    {
        return Err(format!("small exchanges wrong: {v:?} {b:?} {m} {e:?}"));
    }
    Ok(format!(
        "u64, bytes, min, empty all as expected; {rounds} rounds of 1 MiB fresh host bytes gathered back intact"
    ))
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
