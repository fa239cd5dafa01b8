//! InProcessGroup: correctness under random interleavings, matching errors on every rank,
//! deadlines, late arrivers, departed ranks.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::threads::{far, on_threads};
use dedup_broadcast::{
    all_gather_in_place, all_gather_slices, broadcast_slice, Collective, CollectiveError,
    InProcessCollective, InProcessGroup,
};
use kv_device::{DeviceRegion, HostRow};

/// xorshift64*: deterministic per-rank randomness without a dependency.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    /// Nothing, a yield, or a short sleep: shakes up the interleaving.
    fn jitter(&mut self) {
        match self.below(8) {
            0..=3 => {}
            4 | 5 => thread::yield_now(),
            6 => thread::sleep(Duration::from_micros(self.below(50))),
            _ => thread::sleep(Duration::from_micros(self.below(400))),
        }
    }
}

/// Runs `f` on every rank of a fresh group of `size`, one thread each; results in rank order.
fn run_group<T: Send>(size: u32, f: impl Fn(&InProcessCollective) -> T + Sync) -> Vec<T> {
    on_threads(&InProcessGroup::new(size), f)
}

/// The byte rank `rank` contributes at position `i` of op `op`.
fn pattern(op: u64, rank: u32, i: usize) -> u8 {
    (op as usize * 31 + rank as usize * 7 + i * 13) as u8
}

#[test]
fn broadcast_every_size_and_root_under_jitter() {
    for size in 1..=8u32 {
        let results = run_group(size, |c| {
            let mut rng = Rng::new(u64::from(c.rank()) + 100 * u64::from(size));
            let mut buf = Vec::new();
            for op in 0..60u64 {
                let root = (op % u64::from(size)) as u32;
                let len = [0usize, 1, 7, 4096, 65_537][(op % 5) as usize];
                rng.jitter();
                buf.clear();
                buf.resize(len, 0xEE);
                if c.rank() == root {
                    for (i, b) in buf.iter_mut().enumerate() {
                        *b = pattern(op, root, i);
                    }
                }
                broadcast_slice(c, &mut buf, root, far()).unwrap();
                for (i, b) in buf.iter().enumerate() {
                    assert_eq!(*b, pattern(op, root, i), "op {op} size {size} byte {i}");
                }
                // The root's buffer is reusable at once: scribble on it. A receiver still
                // copying from it would see this and fail the check above.
                buf.fill(0xAB);
            }
            c.rank()
        });
        assert_eq!(results, (0..size).collect::<Vec<_>>());
    }
}

#[test]
fn all_gather_every_size_in_place_and_not_under_jitter() {
    for size in 1..=8u32 {
        run_group(size, |c| {
            let mut rng = Rng::new(7 + u64::from(c.rank()) * 13 + u64::from(size));
            let (rank, n_ranks) = (c.rank(), c.size() as usize);
            for op in 0..60u64 {
                let n = [0usize, 1, 3, 1000, 8192][(op % 5) as usize];
                rng.jitter();
                let mut recv = vec![0xEEu8; n * n_ranks];
                if op % 2 == 0 {
                    let mut send: Vec<u8> = (0..n).map(|i| pattern(op, rank, i)).collect();
                    all_gather_slices(c, &send, &mut recv, far()).unwrap();
                    send.fill(0xAB); // reusable at once
                } else {
                    for i in 0..n {
                        recv[rank as usize * n + i] = pattern(op, rank, i);
                    }
                    all_gather_in_place(c, &mut recv, far()).unwrap();
                }
                for r in 0..n_ranks {
                    for i in 0..n {
                        assert_eq!(
                            recv[r * n + i],
                            pattern(op, r as u32, i),
                            "op {op} from {r}"
                        );
                    }
                }
                recv.fill(0xAB); // reusable at once: peers copied out of it already
            }
        });
    }
}

#[test]
fn thousands_of_mixed_ops_never_deadlock() {
    for size in [2u32, 3, 5, 8] {
        let results = run_group(size, |c| {
            let mut rng = Rng::new(99 + u64::from(c.rank()));
            let size = c.size();
            let mut checksum = 0u64;
            for op in 0..2000u64 {
                if op % 16 == 0 {
                    rng.jitter();
                } else if rng.below(4) == 0 {
                    thread::yield_now();
                }
                match op % 5 {
                    0 => {
                        let all = c
                            .all_gather_u64(op * 10 + u64::from(c.rank()), far())
                            .unwrap();
                        assert_eq!(
                            all,
                            (0..u64::from(size))
                                .map(|r| op * 10 + r)
                                .collect::<Vec<_>>()
                        );
                    }
                    1 => {
                        let min = c
                            .all_reduce_min_u64(1000 - u64::from(c.rank()), far())
                            .unwrap();
                        assert_eq!(min, 1000 - u64::from(size - 1));
                    }
                    2 => {
                        let mut b = [c.rank() as u8; 64];
                        let root = (op % u64::from(size)) as u32;
                        broadcast_slice(c, &mut b, root, far()).unwrap();
                        assert_eq!(b, [root as u8; 64]);
                    }
                    3 => {
                        let v = [c.rank() as u8; 3];
                        let all = c.all_gather_bytes(&v, far()).unwrap();
                        assert_eq!(all.len(), size as usize);
                        assert!(all.iter().enumerate().all(|(r, v)| v == &vec![r as u8; 3]));
                    }
                    _ => {
                        let mut recv = vec![0u8; 16 * size as usize];
                        all_gather_slices(c, &[c.rank() as u8 + 1; 16], &mut recv, far()).unwrap();
                        checksum += recv.iter().map(|&b| u64::from(b)).sum::<u64>();
                    }
                }
            }
            checksum
        });
        assert!(results.windows(2).all(|w| w[0] == w[1]));
    }
}

#[test]
fn length_mismatch_fails_every_rank_and_the_next_op_works() {
    let results = run_group(4, |c| {
        let mut rng = Rng::new(u64::from(c.rank()));
        rng.jitter();
        let mut buf = vec![1u8; if c.rank() == 2 { 9 } else { 8 }];
        let first = broadcast_slice(c, &mut buf, 0, far());
        rng.jitter();
        let next = c.all_gather_u64(u64::from(c.rank()), far());
        (first, next)
    });
    for (rank, (first, next)) in results.into_iter().enumerate() {
        match first {
            Err(CollectiveError::SizeMismatch {
                seq: 0,
                op: "broadcast_rows",
                ..
            })
            | Err(CollectiveError::Aborted { seq: 0, .. }) => {}
            other => panic!("rank {rank}: {other:?}"),
        }
        assert_eq!(next.unwrap(), vec![0, 1, 2, 3], "rank {rank}");
    }
}

#[test]
fn bytes_length_mismatch_and_op_mismatch_fail_every_rank() {
    let results = run_group(3, |c| {
        let v = vec![0u8; 4 + c.rank() as usize / 2];
        let a = c.all_gather_bytes(&v, far());
        let b = if c.rank() == 1 {
            c.all_gather_u64(1, far()).map(|_| ())
        } else {
            let mut x = [0u8; 4];
            broadcast_slice(c, &mut x, 0, far())
        };
        let after = c.all_reduce_min_u64(5 + u64::from(c.rank()), far());
        (a, b, after)
    });
    for (a, b, after) in results {
        assert!(matches!(
            a,
            Err(CollectiveError::SizeMismatch { .. }) | Err(CollectiveError::Aborted { .. })
        ));
        assert!(matches!(
            b,
            Err(CollectiveError::Mismatch { .. }) | Err(CollectiveError::Aborted { .. })
        ));
        assert_eq!(after.unwrap(), 5);
    }
}

#[test]
fn bad_arguments_fail_every_rank() {
    let results = run_group(3, |c| {
        // Root out of range on every rank.
        let mut b = [0u8; 4];
        let bad_root = broadcast_slice(c, &mut b, 3, far());
        // recv of the wrong length on rank 1 only.
        let mut recv = vec![0u8; if c.rank() == 1 { 11 } else { 12 }];
        let bad_recv = all_gather_slices(c, &[1u8; 4], &mut recv, far());
        // Device memory is not for a host-only group (never dereferenced: refused first, on
        // every rank, without using a sequence number).
        let region = DeviceRegion {
            ordinal: 0,
            addr: 0x1000,
            len: 4,
        };
        // SAFETY: the region is refused before any access; nothing is read or written.
        let device = unsafe { c.broadcast_device(region, None, 0, far()) };
        assert!(matches!(device, Err(CollectiveError::Unsupported { .. })));
        let ok = c.all_gather_u64(1, far());
        (bad_root, bad_recv, device, ok)
    });
    for (bad_root, bad_recv, device, ok) in results {
        assert!(bad_root.is_err() && bad_recv.is_err() && device.is_err());
        assert_eq!(ok.unwrap(), vec![1, 1, 1]);
    }
}

#[test]
fn overlapping_rows_and_bad_or_overflowing_counts_are_refused_on_every_rank() {
    let r = run_group(2, |c| {
        let mut buf = vec![0u8; 8];
        let base = buf.as_mut_ptr() as usize;
        // Rank 0's second row starts one byte into its first.
        let second = if c.rank() == 0 { base + 1 } else { base + 4 };
        let rows = [
            HostRow { addr: base, len: 4 },
            HostRow {
                addr: second,
                len: 4,
            },
        ];
        // SAFETY: both rows lie inside `buf`, exclusively owned by this thread for the call.
        let overlap = unsafe { c.all_gather_rows(&rows, &[1, 1], far()) };
        let proper = [
            HostRow { addr: base, len: 4 },
            HostRow {
                addr: base + 4,
                len: 4,
            },
        ];
        // SAFETY: as above.
        let counts = unsafe { c.all_gather_rows(&proper, &[2, 1], far()) };
        // Counts whose sum overflows (and would wrap to the 2 rows): refused, not a panic.
        // SAFETY: as above.
        let wrapping = unsafe { c.all_gather_rows(&proper, &[usize::MAX, 3], far()) };
        // SAFETY: as above.
        let ok = unsafe { c.all_gather_rows(&proper, &[1, 1], far()) };
        (overlap, counts, wrapping, ok)
    });
    for (overlap, counts, wrapping, ok) in r {
        assert!(
            overlap.is_err() && counts.is_err() && wrapping.is_err(),
            "{overlap:?} {counts:?} {wrapping:?}"
        );
        ok.unwrap();
    }
}

#[test]
fn a_rank_that_stops_makes_the_others_time_out_and_can_catch_up_later() {
    let ranks = InProcessGroup::new(4);
    let deadline_after = Duration::from_millis(200);
    let results = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    if c.rank() == 3 {
                        // Misses op 0 entirely, then arrives late for it.
                        thread::sleep(Duration::from_millis(600));
                    }
                    let t0 = Instant::now();
                    let mut b = [c.rank() as u8; 16];
                    let r = broadcast_slice(c, &mut b, 0, t0 + deadline_after);
                    out.push((r, t0.elapsed(), b));
                    // Everyone, the late rank included, goes on in order.
                    let next = c.all_gather_u64(u64::from(c.rank()), far());
                    (out, next)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    for (rank, (out, next)) in results.into_iter().enumerate() {
        let (r, elapsed, b) = &out[0];
        if rank == 3 {
            match r {
                Err(CollectiveError::Aborted {
                    seq: 0, missing, ..
                }) => {
                    assert_eq!(missing, &vec![3])
                }
                other => panic!("late rank: {other:?}"),
            }
            // At once (well under the others' timeout), with room for a loaded machine.
            assert!(
                *elapsed < Duration::from_secs(1),
                "late rank waited {elapsed:?}"
            );
            assert_eq!(b, &[3u8; 16], "a late rank's buffer is left alone");
        } else {
            match r {
                Err(CollectiveError::Timeout {
                    seq: 0,
                    missing,
                    op: "broadcast_rows",
                }) => {
                    assert_eq!(missing, &vec![3])
                }
                other => panic!("rank {rank}: {other:?}"),
            }
            assert!(
                *elapsed >= Duration::from_millis(150),
                "rank {rank}: {elapsed:?}"
            );
            assert!(
                *elapsed < Duration::from_secs(5),
                "rank {rank} waited {elapsed:?}"
            );
        }
        assert_eq!(next.unwrap(), vec![0, 1, 2, 3], "rank {rank}");
    }
}

#[test]
fn survivors_keep_erroring_at_their_deadline_while_a_rank_is_away() {
    let ranks = InProcessGroup::new(3);
    thread::scope(|s| {
        let mut it = ranks.iter();
        let (a, b, away) = (it.next().unwrap(), it.next().unwrap(), it.next().unwrap());
        let survivors: Vec<_> = [a, b]
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    for _ in 0..5 {
                        let t0 = Instant::now();
                        let r = c.all_gather_u64(1, t0 + Duration::from_millis(30));
                        assert!(
                            matches!(&r, Err(CollectiveError::Timeout { missing, .. }) if missing == &vec![2]),
                            "{r:?}"
                        );
                        assert!(t0.elapsed() < Duration::from_secs(5));
                    }
                    // The away rank catches up: it has issued the five aborted ops by then.
                    c.all_gather_u64(7, far())
                })
            })
            .collect();
        let away = s.spawn(move || {
            thread::sleep(Duration::from_millis(400));
            for _ in 0..5 {
                assert!(matches!(
                    away.all_gather_u64(1, far()),
                    Err(CollectiveError::Aborted { .. })
                ));
            }
            away.all_gather_u64(7, far())
        });
        for h in survivors {
            assert_eq!(h.join().unwrap().unwrap(), vec![7, 7, 7]);
        }
        assert_eq!(away.join().unwrap().unwrap(), vec![7, 7, 7]);
    });
}

#[test]
fn a_dropped_rank_fails_the_others_at_once() {
    let mut ranks = InProcessGroup::new(3);
    let gone = ranks.pop().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let dropper = thread::spawn(move || {
        rx.recv().unwrap();
        drop(gone);
    });
    let results = thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let t0 = Instant::now();
                    let mut b = [0u8; 8];
                    let r = broadcast_slice(c, &mut b, 0, t0 + Duration::from_secs(30));
                    (r, t0.elapsed())
                })
            })
            .collect();
        thread::sleep(Duration::from_millis(50));
        tx.send(()).unwrap();
        hs.into_iter()
            .map(|h| h.join().unwrap())
            .collect::<Vec<_>>()
    });
    dropper.join().unwrap();
    for (r, elapsed) in &results {
        assert!(
            matches!(r, Err(CollectiveError::RankGone { gone, .. }) if gone == &vec![2]),
            "{r:?}"
        );
        assert!(*elapsed < Duration::from_secs(10));
    }
    // Later ops fail at once too, without waiting for their deadline (the first survivor to
    // arrive fails the round; one arriving after that finds it given up).
    let t0 = Instant::now();
    let r = on_threads(&ranks, |c| c.all_gather_u64(0, far()));
    assert!(
        r.iter().all(|r| matches!(
            r,
            Err(CollectiveError::RankGone { .. }) | Err(CollectiveError::Aborted { .. })
        )),
        "{r:?}"
    );
    assert!(t0.elapsed() < Duration::from_secs(10));
}

#[test]
fn random_timeouts_give_every_rank_the_same_answer() {
    // Random per-rank delays against short deadlines: each op either succeeds on every rank
    // that issued it in time or fails on every rank; never a wrong value.
    for trial in 0..30u64 {
        let size = 2 + (trial % 4) as u32;
        let results = run_group(size, |c| {
            let mut rng = Rng::new(trial * 1000 + u64::from(c.rank()));
            let mut outcomes = Vec::new();
            for op in 0..20u64 {
                if rng.below(6) == 0 {
                    thread::sleep(Duration::from_millis(rng.below(15)));
                }
                let deadline = kv_loader::deadline_after(Duration::from_millis(5));
                let mut b = [c.rank() as u8; 32];
                let r = broadcast_slice(c, &mut b, (op % u64::from(c.size())) as u32, deadline);
                if r.is_ok() {
                    assert_eq!(b, [(op % u64::from(c.size())) as u8; 32]);
                }
                outcomes.push(r.is_ok());
            }
            outcomes
        });
        for w in results.windows(2) {
            assert_eq!(
                w[0], w[1],
                "trial {trial}: ranks disagree on which ops succeeded"
            );
        }
    }
}

/// A device of another backend than the CPU device: its stream refuses events it did not
/// make, as every backend does (`DeviceError::ForeignEvent`), and does nothing else.
mod other_backend {
    use std::any::Any;
    use std::sync::Arc;
    use std::time::Instant;

    use kv_device::{
        Device, DeviceError, DeviceEvent, DeviceMemory, PinnedMemory, RowCopy, SharedEvent, Stream,
        Transfer,
    };

    #[derive(Debug)]
    struct Done;

    impl kv_loader::StreamWaitable for Done {
        fn wait_on_stream(
            &self,
            _stream: kv_loader::RawStream,
        ) -> Result<(), kv_loader::KvLoadError> {
            Ok(())
        }

        fn synchronize(&self) -> Result<(), kv_loader::KvLoadError> {
            Ok(())
        }
    }

    impl DeviceEvent for Done {
        fn is_complete(&self) -> Result<bool, DeviceError> {
            Ok(true)
        }

        fn wait_until(&self, _deadline: Instant) -> Result<bool, DeviceError> {
            Ok(true)
        }

        fn as_any(&self) -> &dyn Any {
            self
        }
    }

    #[derive(Debug)]
    struct Inert;

    // SAFETY: it moves no memory at all (every copy is refused).
    unsafe impl Stream for Inert {
        unsafe fn transfer(&self, _t: Transfer) -> Result<(), DeviceError> {
            Err(DeviceError::Driver("another backend".into()))
        }

        unsafe fn copy_rows(&self, _c: RowCopy) -> Result<(), DeviceError> {
            Err(DeviceError::Driver("another backend".into()))
        }

        fn record(&self) -> Result<SharedEvent, DeviceError> {
            Ok(Arc::new(Done))
        }

        fn wait(&self, event: &SharedEvent) -> Result<(), DeviceError> {
            match event.as_any().downcast_ref::<Done>() {
                Some(_) => Ok(()),
                None => Err(DeviceError::ForeignEvent(format!("{event:?}"))),
            }
        }
    }

    #[derive(Debug)]
    pub struct OtherDevice(Arc<Inert>);

    impl OtherDevice {
        pub fn new() -> Self {
            OtherDevice(Arc::new(Inert))
        }
    }

    // SAFETY: it allocates nothing; its load stream is the one it was made with; no other
    // device is "another backend".
    unsafe impl Device for OtherDevice {
        fn ordinal(&self) -> u32 {
            0
        }

        fn name(&self) -> String {
            "another backend".into()
        }

        fn alloc(&self, _len: usize, _what: &'static str) -> Result<DeviceMemory, DeviceError> {
            Err(DeviceError::Driver("another backend".into()))
        }

        fn alloc_pinned(
            &self,
            _len: usize,
            _what: &'static str,
        ) -> Result<PinnedMemory, DeviceError> {
            Err(DeviceError::Driver("another backend".into()))
        }

        fn load_stream(&self) -> Arc<dyn Stream> {
            self.0.clone()
        }

        fn new_stream(&self) -> Result<Arc<dyn Stream>, DeviceError> {
            Ok(Arc::new(Inert))
        }
    }
}

/// Ranks on devices of two backends are refused when the group is made (a comm stream would
/// copy from a peer's device address with its own backend); one backend is accepted.
#[test]
fn devices_of_two_backends_are_refused() {
    use kv_device::{CpuDevice, Device};
    use std::sync::Arc;
    let cpu: Arc<dyn Device> = CpuDevice::new(0).unwrap();
    let other: Arc<dyn Device> = Arc::new(other_backend::OtherDevice::new());
    for devices in [
        vec![cpu.clone(), other.clone()],
        vec![other.clone(), cpu.clone()],
    ] {
        match InProcessGroup::on_devices(devices) {
            Err(CollectiveError::Device { what, .. }) => {
                assert!(what.contains("backend"), "{what}")
            }
            other => panic!("two backends accepted: {:?}", other.map(|r| r.len())),
        }
    }
    assert_eq!(
        InProcessGroup::on_devices(vec![cpu.clone(), cpu])
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        InProcessGroup::on_devices(vec![other.clone(), other])
            .unwrap()
            .len(),
        2
    );
}
