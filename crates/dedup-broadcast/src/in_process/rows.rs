//! Host rows: broadcast and in-place all-gather, one CPU copy per row per receiver.

use std::time::Instant;

use kv_device::HostRow;
use parking_lot::MutexGuard;
use xxhash_rust::xxh3::Xxh3;

use super::round::{round_mut, Arrival, Desc, Fate, OpKind, COPY_POLL};
use super::InProcessCollective;
use crate::CollectiveError;

fn copies_gave_up(op: &'static str, seq: u64) -> CollectiveError {
    CollectiveError::Timeout {
        op,
        seq,
        missing: Vec::new(),
    }
}

/// A digest of row lengths and counts: ranks whose rows differ in shape do not match.
fn shape(rows: &[HostRow], counts: &[usize]) -> u64 {
    let mut h = Xxh3::new();
    h.update(&(rows.len() as u64).to_le_bytes());
    for r in rows {
        h.update(&(r.len as u64).to_le_bytes());
    }
    for c in counts {
        h.update(&(*c as u64).to_le_bytes());
    }
    h.digest()
}

/// Why this rank's rows cannot be used: two of them overlap.
fn overlapping(rows: &[HostRow]) -> Option<String> {
    kv_device::first_overlap_by(rows, |r| *r).map(|_| "two of this rank's rows overlap".to_string())
}

/// Copies `src` into `dst` row by row (same count and lengths: the round matched them).
///
/// # Safety
/// Every `src` row is valid for reads and not written during the call, every `dst` row valid
/// for writes and touched by nothing else; no `src` row overlaps a `dst` row.
unsafe fn copy_rows(src: &[HostRow], dst: &[HostRow]) {
    for (s, d) in src.iter().zip(dst) {
        let len = s.len.min(d.len);
        if len == 0 || s.addr == d.addr {
            continue;
        }
        // SAFETY: the caller's promise, row by row.
        unsafe { std::ptr::copy_nonoverlapping(s.addr as *const u8, d.addr as *mut u8, len) }
    }
}

fn bytes(rows: &[HostRow]) -> usize {
    rows.iter().map(|r| r.len).sum()
}

impl InProcessCollective {
    /// [`Collective::broadcast_rows`](crate::Collective::broadcast_rows).
    ///
    /// # Safety
    /// As the trait method.
    pub(super) unsafe fn rows_broadcast(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (g, rank, size) = (&self.group, self.rank, self.group.size);
        let kind = OpKind::BroadcastRows;
        let invalid = (root >= size)
            .then(|| format!("root {root} is not a rank of a group of {size}"))
            .or_else(|| overlapping(rows));
        let desc = Desc {
            kind,
            len: bytes(rows),
            root,
            shape: shape(rows, &[]),
        };
        let seq = self.next_seq();
        let mut st = g.arrive(rank, seq, desc, invalid, Arrival::Rows(rows.to_vec()))?;
        let is_root = rank == root;
        let mut copied = false;
        let limit = kv_loader::deadline_from(deadline, g.copy_grace);
        loop {
            let round = round_mut(&mut st, seq)?;
            match (&round.fate, is_root) {
                // The root waits for copies out of its rows already running, whatever the fate
                // (a bounded memory copy each).
                (Fate::Failed { .. }, true) if round.copying > 0 => {
                    g.cv.wait_for(&mut st, COPY_POLL);
                }
                (Fate::Failed { error, .. }, _) => {
                    let e = error.clone();
                    st.leave(seq);
                    return Err(e);
                }
                (Fate::Committed, true) if round.copied + 1 >= size => {
                    st.leave(seq);
                    return Ok(());
                }
                (Fate::Committed, true) => {
                    let running = round.copying > 0;
                    if g.wait_for_copies(&mut st, limit, running) {
                        tracing::error!(rank, seq, "peers never copied a broadcast: given up");
                        st.abandon(seq, copies_gave_up(kind.name(), seq));
                        g.cv.notify_all();
                    }
                }
                (_, false) if !copied && round.arrivals[root as usize].is_some() => {
                    let src = match &round.arrivals[root as usize] {
                        Some(Arrival::Rows(r)) => r.clone(),
                        _ => return Err(super::round::internal(seq)),
                    };
                    round.copying += 1;
                    MutexGuard::unlocked(&mut st, || {
                        g.pause_in_copy(rank);
                        // SAFETY: the root's rows stay valid and unwritten until this copy is
                        // counted finished (the root waits for `copying == 0` and `copied`);
                        // this rank's rows are valid for writes and touched by nothing else
                        // for the call; ranks' rows do not overlap (trait contract), and the
                        // round matched every rank's row count and lengths.
                        unsafe { copy_rows(&src, rows) }
                    });
                    let round = round_mut(&mut st, seq)?;
                    round.copying -= 1;
                    round.copied += 1;
                    copied = true;
                    g.cv.notify_all();
                }
                // Committed means the root has arrived, so the copy arm above has run.
                (Fate::Committed, false) => {
                    st.leave(seq);
                    return Ok(());
                }
                (Fate::Open, _) => g.wait_open(rank, &mut st, seq, kind.name(), deadline),
            }
        }
    }

    /// [`Collective::all_gather_rows`](crate::Collective::all_gather_rows).
    ///
    /// # Safety
    /// As the trait method.
    pub(super) unsafe fn rows_all_gather(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (g, rank, size) = (&self.group, self.rank, self.group.size);
        let kind = OpKind::AllGatherRows;
        let invalid = if counts.len() != size as usize {
            Some(format!("{} counts for {size} ranks", counts.len()))
        } else if !crate::collective::counts_cover(counts, rows.len()) {
            Some(format!(
                "counts {counts:?} do not add up to the {} rows",
                rows.len()
            ))
        } else {
            overlapping(rows)
        };
        let desc = Desc {
            kind,
            len: bytes(rows),
            root: 0,
            shape: shape(rows, counts),
        };
        let seq = self.next_seq();
        let mut st = g.arrive(rank, seq, desc, invalid, Arrival::Rows(rows.to_vec()))?;
        let mut copied = false;
        let limit = kv_loader::deadline_from(deadline, g.copy_grace);
        loop {
            let round = round_mut(&mut st, seq)?;
            match &round.fate {
                // A round given up after it committed may have copies out of this rank's rows
                // still running (a bounded memory copy each): wait for those only.
                Fate::Failed { .. } if round.copying > 0 => {
                    g.cv.wait_for(&mut st, COPY_POLL);
                }
                Fate::Failed { error, .. } => {
                    let e = error.clone();
                    st.leave(seq);
                    return Err(e);
                }
                Fate::Committed if !copied => {
                    let peers: Vec<Vec<HostRow>> = round
                        .arrivals
                        .iter()
                        .map(|a| match a {
                            Some(Arrival::Rows(r)) => r.clone(),
                            _ => Vec::new(),
                        })
                        .collect();
                    round.copying += 1;
                    MutexGuard::unlocked(&mut st, || {
                        g.pause_in_copy(rank);
                        let mut start = 0;
                        for (peer, &n) in counts.iter().enumerate() {
                            let range = start..start + n;
                            start += n;
                            if peer == rank as usize {
                                continue;
                            }
                            // SAFETY: every rank arrived with rows of the same count and
                            // lengths (the round matched them) that stay valid until every
                            // rank has counted its copies finished (each waits for `copied ==
                            // size`); the owner's rows in `range` are only read, this rank's
                            // rows in `range` only written by this rank; ranks' rows do not
                            // overlap (trait contract).
                            unsafe { copy_rows(&peers[peer][range.clone()], &rows[range]) }
                        }
                    });
                    let round = round_mut(&mut st, seq)?;
                    round.copying -= 1;
                    round.copied += 1;
                    copied = true;
                    g.cv.notify_all();
                }
                Fate::Committed if round.copied >= size => {
                    st.leave(seq);
                    return Ok(());
                }
                Fate::Committed => {
                    let running = round.copying > 0;
                    if g.wait_for_copies(&mut st, limit, running) {
                        tracing::error!(rank, seq, "peers never copied an all-gather: given up");
                        st.abandon(seq, copies_gave_up(kind.name(), seq));
                        g.cv.notify_all();
                    }
                }
                Fate::Open => g.wait_open(rank, &mut st, seq, kind.name(), deadline),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use kv_device::HostRow;
    use parking_lot::Mutex;

    use super::super::round::Group;
    use super::super::{InProcessCollective, InProcessGroup};
    use crate::CollectiveError;

    /// A host-only group of `size` whose owners give up 100 ms past their deadline, and whose
    /// rank 1 spends `pause` inside its copy.
    fn group_with_slow_copy(size: u32, pause: Duration) -> Vec<InProcessCollective> {
        let group = Arc::new(Group {
            copy_grace: Duration::from_millis(100),
            copy_pause: Mutex::new(Some((1, pause))),
            ..Group::new(size)
        });
        InProcessGroup::ranks_of(group, (0..size).map(|_| None).collect())
    }

    fn row_of(buf: &mut [u8]) -> Vec<HostRow> {
        vec![HostRow {
            addr: buf.as_mut_ptr() as usize,
            len: buf.len(),
        }]
    }

    /// Runs `op` on every rank at once, each on its own buffer (rank `r`'s filled with `r + 1`),
    /// and returns each rank's outcome and buffer.
    fn run_ranks(
        ranks: &[InProcessCollective],
        len: usize,
        op: impl Fn(&InProcessCollective, &[HostRow]) -> Result<(), CollectiveError> + Sync,
    ) -> Vec<(Result<(), CollectiveError>, Vec<u8>)> {
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|c| {
                    let op = &op;
                    s.spawn(move || {
                        let mut buf = vec![c.rank as u8 + 1; len];
                        let rows = row_of(&mut buf);
                        (op(c, &rows), buf)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    /// A peer's copy still running when the owner's grace ends is waited for, not given up
    /// under it (600 ms for every rank to arrive and rank 1 to start its copy; that copy
    /// outlasts the deadline and the grace). Before, the root failed the round at its limit,
    /// so the slow peer failed after its copy while the quick one had returned `Ok`.
    #[test]
    fn a_broadcast_copy_running_at_the_grace_end_finishes_the_round_ok() {
        let ranks = group_with_slow_copy(3, Duration::from_millis(1500));
        let deadline = kv_loader::deadline_after(Duration::from_millis(600));
        let out = run_ranks(&ranks, 4096, |c, rows| {
            // SAFETY: each rank's row is its own live buffer, untouched by anything else
            // during the call; ranks' buffers do not overlap.
            unsafe { c.rows_broadcast(rows, 0, deadline) }
        });
        for (rank, (result, buf)) in out.iter().enumerate() {
            assert!(result.is_ok(), "rank {rank}: {result:?}");
            assert!(
                buf.iter().all(|&b| b == 1),
                "rank {rank} holds the root's row"
            );
        }
    }

    /// A rows-broadcast receiver that arrived before the root starts its copy when the root
    /// arrives, not when the last rank does: rank 1 (whose copy takes 1 s) waits from the
    /// start, the root comes at 50 ms and rank 2 at 1 s; rank 1 is done about 1.05 s in.
    /// Before, the root's arrival woke no one, so rank 1 copied only after the commit and was
    /// done at about 2 s.
    #[test]
    fn a_broadcast_receiver_copies_as_soon_as_the_root_arrives() {
        let ranks = group_with_slow_copy(3, Duration::from_millis(1000));
        let deadline = kv_loader::deadline_after(Duration::from_secs(10));
        let start = std::time::Instant::now();
        let out = run_ranks(&ranks, 4096, |c, rows| {
            match c.rank {
                0 => std::thread::sleep(Duration::from_millis(50)),
                2 => std::thread::sleep(Duration::from_millis(1000)),
                _ => {}
            }
            // SAFETY: each rank's row is its own live buffer, untouched by anything else
            // during the call; ranks' buffers do not overlap.
            let r = unsafe { c.rows_broadcast(rows, 0, deadline) };
            if c.rank == 1 {
                let took = start.elapsed();
                assert!(
                    took < Duration::from_millis(1600),
                    "rank 1 done after {took:?}"
                );
            }
            r
        });
        for (rank, (result, buf)) in out.iter().enumerate() {
            assert!(result.is_ok(), "rank {rank}: {result:?}");
            assert!(buf.iter().all(|&b| b == 1), "rank {rank}");
        }
    }

    /// The same for an all-gather: every rank waits for the slow copy and ends `Ok`.
    #[test]
    fn an_all_gather_copy_running_at_the_grace_end_finishes_the_round_ok() {
        let ranks = group_with_slow_copy(3, Duration::from_millis(1500));
        let deadline = kv_loader::deadline_after(Duration::from_millis(600));
        let out = run_ranks(&ranks, 3, |c, rows| {
            let split: Vec<HostRow> = (0..3)
                .map(|i| HostRow {
                    addr: rows[0].addr + i,
                    len: 1,
                })
                .collect();
            // SAFETY: as above; the three one-byte rows split the rank's own buffer.
            unsafe { c.rows_all_gather(&split, &[1, 1, 1], deadline) }
        });
        for (rank, (result, buf)) in out.iter().enumerate() {
            assert!(result.is_ok(), "rank {rank}: {result:?}");
            assert_eq!(buf, &[1, 2, 3], "rank {rank} holds every rank's row");
        }
    }
}
