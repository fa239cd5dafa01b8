//! A deterministic script of collective operations that every rank of a group runs, and a
//! runner that records every byte each operation leaves on the rank: the same script run on
//! the in-process group (the reference) and on the socket group (threads or processes) must
//! leave the same bytes.

use std::time::Instant;

use dedup_broadcast::{
    all_gather_in_place, all_gather_slices, broadcast_slice, Collective, CollectiveError,
};
use kv_device::HostRow;

/// One operation of a script.
#[derive(Debug, Clone)]
pub enum Op {
    Broadcast {
        root: u32,
        len: usize,
    },
    AllGather {
        n: usize,
        in_place: bool,
    },
    GatherU64,
    GatherBytes {
        len: usize,
    },
    MinU64,
    BroadcastRows {
        root: u32,
        rows: Vec<usize>,
    },
    AllGatherRows {
        rows: Vec<usize>,
        counts: Vec<usize>,
    },
}

/// xorshift64*: deterministic randomness without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// `count` operations for a group of `size`, from `seed`; sizes up to about `max_bytes` per
/// operation. Every kind appears, with zero lengths, zero-row ranks and odd row lengths.
pub fn script(seed: u64, size: u32, count: usize, max_bytes: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let len = |rng: &mut Rng| match rng.below(6) {
        0 => 0,
        1 => 1 + rng.below(7) as usize,
        _ => rng.below(max_bytes as u64 + 1) as usize,
    };
    (0..count)
        .map(|i| {
            let root = rng.below(u64::from(size)) as u32;
            match i % 7 {
                0 => Op::Broadcast {
                    root,
                    len: len(&mut rng),
                },
                1 => Op::AllGather {
                    n: len(&mut rng) / size as usize,
                    in_place: rng.below(2) == 0,
                },
                2 => Op::GatherU64,
                3 => Op::GatherBytes {
                    len: rng.below(64) as usize,
                },
                4 => Op::MinU64,
                5 => {
                    let n = rng.below(40) as usize;
                    let each = (max_bytes / n.max(1)).max(1) as u64;
                    Op::BroadcastRows {
                        root,
                        rows: (0..n).map(|_| rng.below(each + 1) as usize).collect(),
                    }
                }
                _ => {
                    let n = rng.below(40) as usize;
                    let each = (max_bytes / n.max(1)).max(1) as u64;
                    let rows: Vec<usize> = (0..n).map(|_| rng.below(each + 1) as usize).collect();
                    // Random split of the rows over the ranks, some ranks owning none.
                    let mut counts = vec![0usize; size as usize];
                    for _ in 0..n {
                        counts[rng.below(u64::from(size)) as usize] += 1;
                    }
                    Op::AllGatherRows { rows, counts }
                }
            }
        })
        .collect()
}

/// The byte rank `rank` puts at position `i` for operation `op`.
pub fn pattern(op: usize, rank: u32, i: usize) -> u8 {
    (op * 31 + rank as usize * 7 + i * 13 + (i >> 8)) as u8
}

/// Rows of the given lengths inside one buffer, in reverse address order with a gap before
/// each (so they are neither contiguous nor sorted): `(buffer, rows)`.
pub fn scattered_rows(lens: &[usize]) -> (Vec<u8>, Vec<HostRow>) {
    let total: usize = lens.iter().map(|l| l + 3).sum();
    let mut buf = vec![0xEEu8; total];
    let base = buf.as_mut_ptr() as usize;
    let mut end = total;
    let rows = lens
        .iter()
        .map(|&l| {
            end -= l + 3;
            HostRow {
                addr: base + end + 3,
                len: l,
            }
        })
        .collect();
    (buf, rows)
}

/// Runs `ops` on `coll`, returning every byte each operation left on this rank, in order.
/// With `rows_as_flat`, the rows operations are done with the old flat operations instead
/// (the reference, for a group that has no rows operations).
pub fn run(
    coll: &dyn Collective,
    ops: &[Op],
    rows_as_flat: bool,
    deadline: Instant,
) -> Result<Vec<u8>, (usize, CollectiveError)> {
    let mut log = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        run_one(coll, i, op, rows_as_flat, deadline, &mut log).map_err(|e| (i, e))?;
    }
    Ok(log)
}

/// Runs operation number `i` of a script, appending what it left to `log`.
pub fn run_one(
    coll: &dyn Collective,
    i: usize,
    op: &Op,
    rows_as_flat: bool,
    deadline: Instant,
    log: &mut Vec<u8>,
) -> Result<(), CollectiveError> {
    let (rank, size) = (coll.rank(), coll.size() as usize);
    let fill = |rank: u32, len: usize| (0..len).map(|k| pattern(i, rank, k)).collect::<Vec<u8>>();
    match op {
        Op::Broadcast { root, len } => {
            let mut buf = if rank == *root {
                fill(rank, *len)
            } else {
                vec![0; *len]
            };
            broadcast_slice(coll, &mut buf, *root, deadline)?;
            log.extend_from_slice(&buf);
        }
        Op::AllGather { n, in_place } => {
            let mut recv = vec![0u8; n * size];
            if *in_place {
                recv[rank as usize * n..][..*n].copy_from_slice(&fill(rank, *n));
                all_gather_in_place(coll, &mut recv, deadline)?;
            } else {
                all_gather_slices(coll, &fill(rank, *n), &mut recv, deadline)?;
            }
            log.extend_from_slice(&recv);
        }
        Op::GatherU64 => {
            let v = coll.all_gather_u64(u64::from(rank) * 1_000_003 + i as u64, deadline)?;
            v.iter()
                .for_each(|x| log.extend_from_slice(&x.to_le_bytes()));
        }
        Op::GatherBytes { len } => {
            for v in coll.all_gather_bytes(&fill(rank, *len), deadline)? {
                log.extend_from_slice(&v);
            }
        }
        Op::MinU64 => {
            let m =
                coll.all_reduce_min_u64(1000 + (u64::from(rank) * 7919 + i as u64) % 97, deadline)?;
            log.extend_from_slice(&m.to_le_bytes());
        }
        Op::BroadcastRows { root, rows } => {
            let total: usize = rows.iter().sum();
            if rows_as_flat {
                let mut buf = if rank == *root {
                    fill(rank, total)
                } else {
                    vec![0; total]
                };
                broadcast_slice(coll, &mut buf, *root, deadline)?;
                log.extend_from_slice(&buf);
            } else {
                let (mut buf, hrows) = scattered_rows(rows);
                if rank == *root {
                    write_rows(&mut buf, &hrows, &fill(rank, total));
                }
                // SAFETY: every row lies inside `buf`, which this call owns; rows do not
                // overlap.
                unsafe { coll.broadcast_rows(&hrows, *root, deadline)? };
                log.extend_from_slice(&read_rows(&buf, &hrows));
            }
        }
        Op::AllGatherRows { rows, counts } => {
            let starts: Vec<usize> = counts
                .iter()
                .scan(0, |s, &c| {
                    let v = *s;
                    *s += c;
                    Some(v)
                })
                .collect();
            let block_len = |q: usize| rows[starts[q]..starts[q] + counts[q]].iter().sum::<usize>();
            if rows_as_flat {
                // Pad every block to the longest and gather the padded blocks.
                let width = (0..size).map(block_len).max().unwrap_or(0);
                let mut mine = fill(rank, block_len(rank as usize));
                mine.resize(width, 0);
                let all = coll.all_gather_bytes(&mine, deadline)?;
                for (q, v) in all.iter().enumerate() {
                    log.extend_from_slice(&v[..block_len(q)]);
                }
            } else {
                let (mut buf, hrows) = scattered_rows(rows);
                let r = rank as usize;
                let own = &hrows[starts[r]..starts[r] + counts[r]];
                write_rows(&mut buf, own, &fill(rank, block_len(r)));
                // SAFETY: every row lies inside `buf`, which this call owns; rows do not
                // overlap.
                unsafe { coll.all_gather_rows(&hrows, counts, deadline)? };
                log.extend_from_slice(&read_rows(&buf, &hrows));
            }
        }
    }
    Ok(())
}

fn write_rows(buf: &mut [u8], rows: &[HostRow], bytes: &[u8]) {
    let base = buf.as_ptr() as usize;
    let mut k = 0;
    for r in rows {
        buf[r.addr - base..][..r.len].copy_from_slice(&bytes[k..k + r.len]);
        k += r.len;
    }
}

fn read_rows(buf: &[u8], rows: &[HostRow]) -> Vec<u8> {
    let base = buf.as_ptr() as usize;
    rows.iter()
        .flat_map(|r| buf[r.addr - base..][..r.len].iter().copied())
        .collect()
}
