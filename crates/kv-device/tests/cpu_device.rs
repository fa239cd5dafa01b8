//! The CPU device: events order work across streams, stalls and failed waits are bounded and
//! visible, faults can be injected.

use std::any::Any;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_device::cpu::{CpuOp, TraceOp};
use kv_device::{
    CpuDevice, CpuDeviceConfig, Device, DeviceError, DeviceEvent, RowCopy, SharedEvent, Transfer,
};
use kv_loader::{KvLoadError, RawStream, StreamWaitable};

fn soon() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(10))
}

fn jittery(trace: bool) -> Arc<CpuDevice> {
    CpuDevice::with_config(
        0,
        CpuDeviceConfig {
            max_op_delay: Duration::from_millis(2),
            trace,
            ..CpuDeviceConfig::default()
        },
    )
    .unwrap()
}

fn read(addr: u64, len: usize) -> Vec<u8> {
    // SAFETY: callers pass memory of a finished copy that they own.
    unsafe { std::slice::from_raw_parts(addr as usize as *const u8, len) }.to_vec()
}

#[test]
fn events_order_work_across_streams() {
    let dev = jittery(true);
    let load = dev.load_stream();
    let comm = dev.new_stream().unwrap();
    let n = 4096;
    let src = dev.alloc_pinned(n, "t").unwrap();
    let a = dev.alloc(n, "t").unwrap();
    let b = dev.alloc(n, "t").unwrap();
    for round in 0..20u8 {
        // SAFETY: `src` is ours and no copy reads it now (the previous round finished).
        unsafe { std::ptr::write_bytes(src.addr() as *mut u8, round, n) };
        // SAFETY: all three buffers are ours and live past the final event of this round.
        unsafe {
            load.transfer(Transfer::ToDevice {
                dst: a.addr(),
                src: src.addr(),
                len: n,
            })
            .unwrap();
        }
        let filled = load.record().unwrap();
        comm.wait(&filled).unwrap();
        // SAFETY: as above.
        unsafe {
            comm.transfer(Transfer::OnDevice {
                dst: b.addr(),
                src: a.addr(),
                len: n,
            })
            .unwrap();
        }
        let done = comm.record().unwrap();
        assert!(done.wait_until(soon()).unwrap());
        assert_eq!(read(b.addr(), n), vec![round; n], "round {round}");
    }
    // Every copy on the comm stream started after the load copy of its round finished.
    let t = dev.trace();
    let loads: Vec<&TraceOp> = t.iter().filter(|o| o.op == CpuOp::ToDevice).collect();
    let copies: Vec<&TraceOp> = t.iter().filter(|o| o.op == CpuOp::OnDevice).collect();
    assert_eq!((loads.len(), copies.len()), (20, 20));
    for (l, c) in loads.iter().zip(&copies) {
        assert!(c.started >= l.finished);
        assert_ne!(c.stream, l.stream);
    }
}

#[test]
fn row_copies_follow_their_index_tables() {
    let dev = CpuDevice::new(3).unwrap();
    let row = 24usize;
    let src = dev.alloc(4 * row, "t").unwrap();
    let dst = dev.alloc(8 * row, "t").unwrap();
    let table = dev.alloc(16, "t").unwrap();
    let slots: [u32; 4] = [6, 1, 3, 7];
    // SAFETY: our own allocations, idle.
    unsafe {
        for r in 0..4 {
            std::ptr::write_bytes((src.addr() as usize + r * row) as *mut u8, r as u8 + 1, row);
        }
        std::ptr::copy_nonoverlapping(slots.as_ptr() as *const u8, table.addr() as *mut u8, 16);
        dev.load_stream()
            .copy_rows(RowCopy {
                src: src.addr(),
                dst: dst.addr(),
                src_rows: 0,
                dst_rows: table.addr(),
                n_rows: 4,
                row_bytes: row as u64,
            })
            .unwrap();
    }
    assert!(dev
        .load_stream()
        .record()
        .unwrap()
        .wait_until(soon())
        .unwrap());
    let out = read(dst.addr(), 8 * row);
    for (r, &s) in slots.iter().enumerate() {
        assert_eq!(out[s as usize * row..][..row], vec![r as u8 + 1; row][..]);
    }
    assert!(out[0..row].iter().all(|&b| b == 0), "slot 0 untouched");
}

#[test]
fn a_stalled_device_holds_its_events_until_it_resumes() {
    let dev = CpuDevice::new(0).unwrap();
    dev.stall_for(Duration::from_millis(300));
    let t0 = Instant::now();
    let ev = dev.load_stream().record().unwrap();
    assert!(!ev
        .wait_until(kv_loader::deadline_after(Duration::from_millis(50)))
        .unwrap());
    assert!(ev.wait_until(soon()).unwrap());
    assert!(t0.elapsed() >= Duration::from_millis(250));
    dev.stall_for(Duration::from_secs(30));
    let ev = dev.load_stream().record().unwrap();
    dev.resume();
    assert!(ev.wait_until(soon()).unwrap(), "resume ends a stall early");
}

#[test]
fn a_wait_that_runs_out_fails_the_stream_and_skips_its_work() {
    let slow = CpuDevice::new(1).unwrap();
    let dev = CpuDevice::with_config(
        0,
        CpuDeviceConfig {
            wait_limit: Duration::from_millis(100),
            ..CpuDeviceConfig::default()
        },
    )
    .unwrap();
    slow.stall_for(Duration::from_millis(500));
    let never_in_time = slow.load_stream().record().unwrap();
    let stream = dev.new_stream().unwrap();
    let (src, dst) = (dev.alloc(64, "t").unwrap(), dev.alloc(64, "t").unwrap());
    // SAFETY: our own memory, idle.
    unsafe { std::ptr::write_bytes(src.addr() as usize as *mut u8, 9, 64) };
    // The foreign-backend check passes: both are CPU events.
    stream.wait(&never_in_time).unwrap();
    // SAFETY: our own memory, which outlives the stream's work (checked below).
    unsafe {
        stream
            .transfer(Transfer::OnDevice {
                dst: dst.addr(),
                src: src.addr(),
                len: 64,
            })
            .unwrap();
    }
    let after = stream.record().unwrap();
    let t0 = Instant::now();
    let r = after.wait_until(soon());
    assert!(matches!(r, Err(DeviceError::Driver(_))), "{r:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "bounded by the wait limit"
    );
    assert_eq!(read(dst.addr(), 64), vec![0u8; 64], "the copy was skipped");
    // The stream stays failed: later events report it too.
    assert!(stream.record().unwrap().wait_until(soon()).is_err());
    // Its engine-facing wait is bounded and typed.
    let e = dev.load_stream().record().unwrap();
    assert!(e.synchronize().is_ok());
    assert!(matches!(
        StreamWaitable::synchronize(after_as_cpu(&after)),
        Err(KvLoadError::Device(_))
    ));
    assert!(never_in_time.wait_until(soon()).unwrap());
}

fn after_as_cpu(e: &SharedEvent) -> &kv_device::cpu::CpuEvent {
    e.as_any().downcast_ref().expect("a CPU event")
}

#[derive(Debug)]
struct Foreign;

impl StreamWaitable for Foreign {
    fn wait_on_stream(&self, _: RawStream) -> Result<(), KvLoadError> {
        Ok(())
    }
    fn synchronize(&self) -> Result<(), KvLoadError> {
        Ok(())
    }
}

impl DeviceEvent for Foreign {
    fn is_complete(&self) -> Result<bool, DeviceError> {
        Ok(true)
    }
    fn wait_until(&self, _: Instant) -> Result<bool, DeviceError> {
        Ok(true)
    }
    fn as_any(&self) -> &dyn Any {
        self
    }
}

#[test]
fn foreign_events_and_injected_faults_are_typed_errors() {
    let dev = CpuDevice::new(0).unwrap();
    let foreign: SharedEvent = Arc::new(Foreign);
    assert!(matches!(
        dev.load_stream().wait(&foreign),
        Err(DeviceError::ForeignEvent(_))
    ));
    dev.fail_enqueue(CpuOp::Record, 1);
    assert!(dev.load_stream().record().is_ok());
    assert!(matches!(
        dev.load_stream().record(),
        Err(DeviceError::Driver(_))
    ));
    assert!(dev.load_stream().record().is_ok(), "a fault fires once");
}
