//! The copy kernel, compiled by NVRTC and from the shipped PTX: rows scattered into slots and
//! gathered back, for row sizes from GLM-5.2's widest down to 3 bytes.

use std::sync::Arc;

use kvlink::kv_device::cuda::cudarc::driver::result;
use kvlink::kv_device::cuda::{CudaDevice, DeviceBuffer, KernelSource};
use kvlink::kv_device::{Device, RowCopy};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::{de, Report, Status};

const SEC: &str = "correctness";

/// On GPU 0: both kernel sources, and the one the landings use.
pub fn run(report: &mut Report) {
    match CudaDevice::new(0) {
        Ok(dev) => {
            report.info("env", "GPU 0", dev.name());
            kernels(&dev, report);
            report.check(
                SEC,
                "new device memory is zeroed before the load stream writes it (legacy stream busy)",
                || zeroed_before_first_write(&dev),
            );
        }
        Err(e) => report.push(SEC, "open GPU 0", Status::Fail, de(e)),
    }
}

fn kernels(dev: &Arc<CudaDevice>, report: &mut Report) {
    for source in [KernelSource::Nvrtc, KernelSource::EmbeddedPtx] {
        let name = format!("copy kernel from {source:?}");
        let k = match dev.load_kernels(source) {
            Ok(k) => k,
            Err(e) if e.is_unavailable() && source == KernelSource::Nvrtc => {
                report.push(
                    SEC,
                    name,
                    Status::Skip,
                    format!("{e} (the shipped PTX is used instead)"),
                );
                continue;
            }
            Err(e) => {
                report.push(SEC, name, Status::Fail, de(e));
                continue;
            }
        };
        report.check(SEC, &name, || {
            let mut detail = Vec::new();
            for row in [41_984u64, 8_448, 1_000, 3] {
                detail.push(kernel_case(dev, &k, row)?);
            }
            Ok(detail.join("; "))
        });
    }
    match dev.kernels() {
        Ok(k) => report.info(SEC, "kernels used by landings", format!("{:?}", k.source())),
        Err(e) => report.push(SEC, "kernels used by landings", Status::Fail, de(e)),
    }
}

/// Scatter 37 rows into 53 slots and gather them back, with `row` bytes per row.
fn kernel_case(
    dev: &Arc<CudaDevice>,
    k: &kvlink::kv_device::cuda::Kernels,
    row: u64,
) -> Result<String, String> {
    let rows = 37usize;
    let slots_n = 53u32;
    let mut rng = Rng(row ^ 0xabc);
    let slots = rng.scattered_slots(rows, slots_n)?;
    let r = row as usize;
    let mut src = vec![0u8; rows * r];
    for (i, chunk) in src.chunks_mut(r).enumerate() {
        fill_row(chunk, 9, 1, i as u64);
    }
    let ctx = dev.context();
    let d_src = DeviceBuffer::zeroed(ctx, src.len(), "test").map_err(de)?;
    let d_dst = DeviceBuffer::zeroed(ctx, slots_n as usize * r, "test").map_err(de)?;
    let d_back = DeviceBuffer::zeroed(ctx, src.len(), "test").map_err(de)?;
    let d_slots = DeviceBuffer::zeroed(ctx, rows * 4, "test").map_err(de)?;
    dev.bind().map_err(de)?;
    // SAFETY: events and raw copies of this crate's memory on the load stream: no
    // `CudaSlice` is made through it.
    let stream = unsafe { dev.cuda_load_stream() }.cu_stream();
    // SAFETY: every buffer is ours with the sizes used; copies are synchronous; the kernels
    // write rows inside d_dst (slots < slots_n) and d_back (rows < rows); the stream is
    // synchronized before the buffers are read or dropped.
    unsafe {
        result::memcpy_htod_sync(d_src.ptr(), &src).map_err(|e| e.to_string())?;
        result::memcpy_htod_sync(d_slots.ptr(), &slots).map_err(|e| e.to_string())?;
        k.copy_rows(
            stream,
            RowCopy {
                src: d_src.ptr(),
                dst: d_dst.ptr(),
                src_rows: 0,
                dst_rows: d_slots.ptr(),
                n_rows: rows as u32,
                row_bytes: row,
            },
        )
        .map_err(de)?;
        k.copy_rows(
            stream,
            RowCopy {
                src: d_dst.ptr(),
                dst: d_back.ptr(),
                src_rows: d_slots.ptr(),
                dst_rows: 0,
                n_rows: rows as u32,
                row_bytes: row,
            },
        )
        .map_err(de)?;
    }
    dev.synchronize_load_stream().map_err(de)?;
    let mut dst = vec![0u8; slots_n as usize * r];
    let mut back = vec![0u8; src.len()];
    // SAFETY: synchronous copies out of our buffers into Vecs of the same sizes.
    unsafe {
        result::memcpy_dtoh_sync(&mut dst, d_dst.ptr()).map_err(|e| e.to_string())?;
        result::memcpy_dtoh_sync(&mut back, d_back.ptr()).map_err(|e| e.to_string())?;
    }
    for (i, &s) in slots.iter().enumerate() {
        if dst[s as usize * r..(s as usize + 1) * r] != src[i * r..(i + 1) * r] {
            return Err(format!("row {i} → slot {s} wrong (row {row} B)"));
        }
    }
    let untouched = (0..slots_n).filter(|s| !slots.contains(s)).all(|s| {
        dst[s as usize * r..(s as usize + 1) * r]
            .iter()
            .all(|&b| b == 0)
    });
    if !untouched {
        return Err(format!("a slot outside the list was written (row {row} B)"));
    }
    if back != src {
        return Err(format!("gather back differs (row {row} B)"));
    }
    Ok(format!("{row} B rows ok"))
}

/// `Device::alloc` zeroes new memory, and the zeroing must not land after the load stream's
/// first write into it: with the legacy default stream busy (a long copy queued on it), a
/// zeroing queued there would run after the write below and wipe it.
fn zeroed_before_first_write(dev: &Arc<CudaDevice>) -> Result<String, String> {
    let busy_len = 2usize << 30;
    let ctx = dev.context();
    let a = DeviceBuffer::alloc(ctx, busy_len, "busy src").map_err(de)?;
    let b = DeviceBuffer::alloc(ctx, busy_len, "busy dst").map_err(de)?;
    let len = 1usize << 20;
    let pattern: Vec<u8> = (0..len).map(|i| (i % 251) as u8 | 1).collect();
    let pinned = dev.alloc_pinned(len, "pattern").map_err(de)?;
    let mut rounds_wiped = 0;
    let rounds = 8;
    for _ in 0..rounds {
        dev.bind().map_err(de)?;
        // SAFETY: both buffers are ours, `busy_len` bytes each; the copy runs on the legacy
        // stream and is waited for (ctx.synchronize) before they are freed.
        unsafe { result::memcpy_dtod_async(b.ptr(), a.ptr(), busy_len, std::ptr::null_mut()) }
            .map_err(|e| format!("legacy-stream copy: {e}"))?;
        let mem = dev.alloc(len, "zeroed").map_err(de)?;
        // SAFETY: `pinned` is ours, `len` bytes, idle.
        unsafe { std::ptr::copy_nonoverlapping(pattern.as_ptr(), pinned.addr() as *mut u8, len) };
        let t = kvlink::kv_device::Transfer::ToDevice {
            dst: mem.addr(),
            src: pinned.addr(),
            len,
        };
        // SAFETY: `mem` and `pinned` are ours with `len` bytes; waited for below.
        unsafe { dev.load_stream().transfer(t) }.map_err(de)?;
        dev.synchronize_load_stream().map_err(de)?;
        ctx.synchronize()
            .map_err(|e| format!("cuCtxSynchronize: {e}"))?;
        let mut back = vec![0u8; len];
        // SAFETY: `mem` holds `len` bytes; everything before is done (synchronized above).
        unsafe { result::memcpy_dtoh_sync(&mut back, mem.addr()) }
            .map_err(|e| format!("read back: {e}"))?;
        if back != pattern {
            rounds_wiped += 1;
        }
    }
    if rounds_wiped > 0 {
        return Err(format!(
            "{rounds_wiped} of {rounds} rounds: the write was wiped by a late zeroing"
        ));
    }
    Ok(format!(
        "{rounds} rounds: the pattern written on the load stream survived a 2 GiB copy queued on the legacy stream"
    ))
}
