//! [`SocketCollective`]: the [`Collective`] of a TP group whose ranks are processes, over
//! stream sockets (Unix sockets when every rank is on one host, TCP otherwise).
//!
//! # Topology
//! Every pair of ranks holds one connection (a full mesh, made when the group forms). Bulk
//! rows move along a **ring** over that mesh by default ([`Algorithm::Ring`]): a broadcast is
//! a chain from the root (each rank relays to the next what it receives, while it arrives),
//! an all-gather passes every rank's block once around the ring. Every rank then sends and
//! receives each byte at most once, so the copies through the kernel are spread over all
//! ranks' cores instead of piling up on the root. [`Algorithm::Direct`] sends from the root
//! (or from each owner) to every peer at once instead: fewer hops, all the work on the
//! sender. Small values (`all_gather_bytes`, the status words) always go direct.
//!
//! # Ordering, deadlines, failures
//! The trait's rules, as the in-process group has them, with one difference that follows
//! from bytes in flight between processes: **an operation that fails breaks the handle**.
//! - Every stream starts with a header naming the operation (sequence number, kind, root,
//!   bytes, a digest of the row layout); a rank whose header differs fails the operation
//!   with [`CollectiveError::Mismatch`] or [`CollectiveError::SizeMismatch`] on the ranks
//!   that receive it.
//! - A peer that hangs up (its process died: the kernel closes its sockets) while this rank
//!   still has bytes to move with it: [`CollectiveError::RankGone`], at once, naming it (and
//!   any other peer seen hanging up). A peer that never arrives:
//!   [`CollectiveError::Timeout`] at the deadline.
//! - Whatever the error, this rank then shuts every connection of the handle, so every peer
//!   still waiting fails at once too (its stream from this rank ends), instead of at its own
//!   deadline; [`broken`](Collective::broken) reports why; every later operation returns
//!   [`CollectiveError::Aborted`] at once. The group is re-formed (a new epoch, new
//!   connections) before the next batch shares. Bytes half-sent cannot be resynchronised,
//!   which is why the in-process group's "a late rank rejoins at the next operation" does
//!   not carry over.
//! - Arguments the operation cannot take ([`CollectiveError::InvalidArgument`]) fail it the
//!   same way. [`CollectiveError::Unsupported`] (device operations) does no I/O and does not
//!   advance the sequence number.
//!
//! On `Ok`, the bytes are in every receiving row and the sending rows are no longer read.
//!
//! **Shared fate of rows operations.** A rank that only sends (a broadcast root) would be
//! done as soon as its bytes sit in socket buffers, and a ring rank once it has what it
//! needs, while a peer may still fail. So every rows operation ends with a **completion
//! round**: each rank tells every peer it has all its bytes (a header, no body) and waits to
//! hear the same from every peer. `Ok` from `broadcast_rows`/`all_gather_rows` on one rank
//! thus means every rank received every byte; a rank that failed shuts its sockets instead
//! of confirming, and every other rank fails too. The round costs one small message each
//! way per pair, nothing next to a layer of rows. `all_gather_bytes` (status words, digests:
//! latency-bound) has no such round: its `Ok` means this rank's result is right, and a peer
//! that failed it has broken the group, which the next operation reports on every rank. The
//! one gather no operation follows, a batch's verdict word
//! ([`Collective::all_gather_u64_settled`]), ends with the completion round too: without it a
//! rank that gave up at its deadline after sending its word left a peer that came later with
//! every word and `Ok`. So does a batch's gate ([`Collective::all_gather_bytes_settled`]):
//! with `GroupFallback::ReadAlone` a rank whose gate failed loads alone and reports `Ok`,
//! while a peer whose gate succeeded went on with the group, found it broken, and failed.

use std::time::Instant;

use kv_device::HostRow;
use parking_lot::{Mutex, MutexGuard};

use super::engine::{Failure, Gate, Inbound, Outbound, Run};
use super::link::{Link, Span};
use super::op_header::{layout_digest, OpHeader, OpKind};
use crate::collective::counts_cover;
use crate::{Collective, CollectiveError};

/// How a socket group moves bulk rows (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Algorithm {
    /// Chain broadcast from the root, ring all-gather: each rank moves each byte once.
    #[default]
    Ring,
    /// Root (or each owner) sends to every peer directly.
    Direct,
}

impl Algorithm {
    /// Parses `ring` or `direct` (any case).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "ring" => Some(Algorithm::Ring),
            "direct" => Some(Algorithm::Direct),
            _ => None,
        }
    }
}

/// One rank's handle of a group of processes over sockets (see the module docs).
///
/// Built by a formed rendezvous ([`FormedGroup::connect`](super::FormedGroup::connect)) or,
/// for ranks that are threads of one process (tests, benchmarks of the socket path), by
/// [`SocketCollective::over_socket_pairs`]:
///
/// ```
/// use std::time::{Duration, Instant};
/// use dedup_broadcast::{broadcast_slice, Collective, SocketCollective, Algorithm};
/// let ranks = SocketCollective::over_socket_pairs(3, Algorithm::Ring).unwrap();
/// let deadline = kv_loader::deadline_after(Duration::from_secs(10));
/// let layers: Vec<Vec<u8>> = std::thread::scope(|s| {
///     let hs: Vec<_> = ranks
///         .iter()
///         .map(|c| s.spawn(move || {
///             let mut layer = vec![c.rank() as u8; 1 << 16];
///             broadcast_slice(c, &mut layer, 1, deadline).unwrap();
///             layer
///         }))
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert!(layers.iter().all(|l| l.iter().all(|&b| b == 1)));
/// ```
pub struct SocketCollective {
    rank: u32,
    size: u32,
    epoch: u64,
    algorithm: Algorithm,
    /// Index = peer rank; `None` at this rank's own index.
    links: Vec<Option<Link>>,
    op: Mutex<OpState>,
    /// The number the next operation takes (`OpState::seq`, readable while another
    /// operation holds `op`: an operation that cannot start reports the number it would have).
    next_seq: std::sync::atomic::AtomicU64,
    broken: Mutex<Option<String>>,
}

struct OpState {
    seq: u64,
    /// Peers seen hanging up, kept across operations.
    hung: Vec<bool>,
}

impl std::fmt::Debug for SocketCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SocketCollective")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("epoch", &self.epoch)
            .field("algorithm", &self.algorithm)
            .finish()
    }
}

fn spans(rows: &[HostRow]) -> Vec<Span> {
    rows.iter()
        .map(|r| Span {
            addr: r.addr,
            len: r.len,
        })
        .collect()
}

/// The first pair of rows that overlap, if any.
fn overlapping(rows: &[HostRow]) -> Option<(HostRow, HostRow)> {
    kv_device::first_overlap_by(rows, |r| *r)
}

impl SocketCollective {
    pub(crate) fn new(
        rank: u32,
        size: u32,
        epoch: u64,
        algorithm: Algorithm,
        links: Vec<Option<Link>>,
    ) -> Self {
        SocketCollective {
            rank,
            size,
            epoch,
            algorithm,
            links,
            op: Mutex::new(OpState {
                seq: 0,
                hung: vec![false; size as usize],
            }),
            next_seq: std::sync::atomic::AtomicU64::new(0),
            broken: Mutex::new(None),
        }
    }

    /// A group of `size` ranks for threads of this process, over Unix socket pairs: the same
    /// code path as ranks in separate processes (tests, benchmarks).
    pub fn over_socket_pairs(
        size: u32,
        algorithm: Algorithm,
    ) -> std::io::Result<Vec<SocketCollective>> {
        let n = size as usize;
        let mut links: Vec<Vec<Option<Link>>> =
            (0..n).map(|_| (0..n).map(|_| None).collect()).collect();
        for (a, b) in (0..n).flat_map(|a| (a + 1..n).map(move |b| (a, b))) {
            let (x, y) = std::os::unix::net::UnixStream::pair()?;
            let (x, y) = (Link::Unix(x), Link::Unix(y));
            x.prepare()?;
            y.prepare()?;
            links[a][b] = Some(x);
            links[b][a] = Some(y);
        }
        Ok(links
            .into_iter()
            .enumerate()
            .map(|(r, l)| SocketCollective::new(r as u32, size, 0, algorithm, l))
            .collect())
    }

    /// The group's epoch (which formation made it).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// How this handle moves bulk rows.
    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// Takes the handle for one operation and numbers it; a broken handle answers `Aborted`.
    fn begin(
        &self,
        op: &'static str,
        deadline: Instant,
    ) -> Result<(MutexGuard<'_, OpState>, u64), CollectiveError> {
        let Some(mut st) = self.op.try_lock_until(deadline) else {
            // Another thread's operation held the handle to this one's deadline: as after any
            // error, the handle breaks, so that peers waiting on this rank fail at once.
            self.break_with(&format!(
                "{op} could not start by its deadline: another operation held the handle"
            ));
            return Err(CollectiveError::Timeout {
                op,
                seq: self.next_seq.load(std::sync::atomic::Ordering::Acquire),
                missing: Vec::new(),
            });
        };
        let seq = st.seq;
        st.seq += 1;
        self.next_seq
            .store(st.seq, std::sync::atomic::Ordering::Release);
        if let Some(cause) = self.broken() {
            return Err(CollectiveError::Aborted {
                op,
                seq,
                missing: Vec::new(),
                cause,
            });
        }
        Ok((st, seq))
    }

    /// Marks the handle broken (first cause wins) and shuts every connection, so that peers
    /// waiting on this rank fail now rather than at their deadline.
    fn break_with(&self, cause: &str) {
        {
            let mut b = self.broken.lock();
            if b.is_none() {
                tracing::warn!(
                    rank = self.rank,
                    epoch = self.epoch,
                    cause,
                    "socket group broken"
                );
                *b = Some(cause.to_string());
            }
        }
        for l in self.links.iter().flatten() {
            l.shut();
        }
    }

    fn fail(&self, err: CollectiveError) -> CollectiveError {
        self.break_with(&err.to_string());
        err
    }

    fn invalid(&self, op: &'static str, seq: u64, reason: String) -> CollectiveError {
        self.fail(CollectiveError::InvalidArgument {
            op,
            seq,
            rank: self.rank,
            reason,
        })
    }

    /// Runs one operation's streams; on failure breaks the handle.
    ///
    /// # Safety
    /// As for [`Run::run`].
    unsafe fn run(
        &self,
        st: &mut OpState,
        op: &'static str,
        header: OpHeader,
        inbound: Vec<Inbound>,
        outbound: Vec<Outbound>,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let mut run = Run {
            links: &self.links,
            hung: &mut st.hung,
            inbound,
            outbound,
        };
        let me = self.rank;
        // SAFETY: forwarded from this function's contract.
        let result = unsafe { run.run(deadline, &mut |peer, h| header.check(op, me, peer, h)) };
        let Err(failure) = result else {
            return Ok(());
        };
        if let Some(cause) = self.broken() {
            // `abort` from another thread shut the sockets under this operation.
            return Err(CollectiveError::Aborted {
                op,
                seq: header.seq,
                missing: Vec::new(),
                cause,
            });
        }
        Err(self.fail(self.failure_error(op, header.seq, &st.hung, failure)))
    }

    /// The error a run that ended in `failure` reports (the handle not broken by `abort`);
    /// `hung` marks the peers known to have hung up before.
    fn failure_error(
        &self,
        op: &'static str,
        seq: u64,
        hung: &[bool],
        failure: Failure,
    ) -> CollectiveError {
        let me = self.rank;
        match failure {
            Failure::Gone(peers) => {
                let mut gone: Vec<u32> = (0..self.size)
                    .filter(|&r| hung.get(r as usize).copied().unwrap_or(false))
                    .chain(peers)
                    .collect();
                gone.sort_unstable();
                gone.dedup();
                CollectiveError::RankGone { op, seq, gone }
            }
            Failure::Timeout(missing) => CollectiveError::Timeout { op, seq, missing },
            Failure::Refused(e) => e,
            Failure::Io { peer, error } => CollectiveError::Socket {
                op,
                seq,
                rank: me,
                peer,
                source: error.into(),
            },
            Failure::Wait(error) => CollectiveError::Wait {
                op,
                seq,
                rank: me,
                source: error.into(),
            },
        }
    }

    /// The completion round of rows operation `seq`: a bare header to and from every peer.
    ///
    /// One window stays open: a rank that sent its confirmation and then reached its deadline
    /// waiting for a late peer's fails the operation, while that peer, within its own later
    /// deadline, reads the confirmation and ends `Ok` (over TCP its own confirmation still
    /// goes out to a socket only shut; over Unix sockets that send fails, and so does the
    /// peer). Failing on a peer's hang-up would close it, but a peer that ended the round `Ok`
    /// and then closed its sockets looks the same on the wire, and the slower rank would then
    /// fail a round every other rank completed. Deadlines far apart across ranks widen it.
    fn confirm(
        &self,
        st: &mut OpState,
        op: &'static str,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        if Instant::now() >= deadline {
            // The operation's data came in at its deadline (a poll returns up to a
            // millisecond past it): this rank confirms nothing, so every peer fails the round
            // too (at once, as the handle breaks). Sent, then timed out in the wait, the
            // confirmation would let peers whose own had already come end `Ok`.
            return Err(self.fail(CollectiveError::Timeout {
                op,
                seq,
                missing: Vec::new(),
            }));
        }
        let header = OpHeader {
            seq,
            kind: OpKind::Confirm,
            root: 0,
            len: 0,
            layout: 0,
        };
        let hdr = header.encode();
        let peers = (0..self.size).filter(|&p| p != self.rank);
        let inbound = peers.clone().map(|p| Inbound::new(p, Vec::new())).collect();
        let outbound = peers
            .map(|p| Outbound::new(p, hdr, Vec::new(), None))
            .collect();
        // SAFETY: no body spans: only the streams' own header arrays are read and written.
        unsafe { self.run(st, op, header, inbound, outbound, deadline) }
    }

    /// Every rank's `value`, in rank order; with `settle`, followed by a completion round, so
    /// that `Ok` here means every rank has every value.
    fn gather_bytes(
        &self,
        value: &[u8],
        settle: bool,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let op = OpKind::GatherBytes.name();
        let (mut st, seq) = self.begin(op, deadline)?;
        let (me, n) = (self.rank, self.size);
        let header = OpHeader {
            seq,
            kind: OpKind::GatherBytes,
            root: 0,
            len: value.len() as u64,
            layout: 0,
        };
        let mut all: Vec<Vec<u8>> = (0..n).map(|_| vec![0u8; value.len()]).collect();
        all[me as usize].copy_from_slice(value);
        let hdr = header.encode();
        let mine = vec![Span {
            addr: value.as_ptr() as usize,
            len: value.len(),
        }];
        let mut inbound = Vec::new();
        let mut outbound = Vec::new();
        for p in (0..n).filter(|&p| p != me) {
            outbound.push(Outbound::new(p, hdr, mine.clone(), None));
            let buf = &mut all[p as usize];
            inbound.push(Inbound::new(
                p,
                vec![Span {
                    addr: buf.as_mut_ptr() as usize,
                    len: buf.len(),
                }],
            ));
        }
        // SAFETY: `value` is borrowed (read-only) and each peer's buffer is a distinct Vec
        // owned by this call, alive and untouched by anything else until `run` returns.
        unsafe { self.run(&mut st, op, header, inbound, outbound, deadline)? };
        if settle {
            self.confirm(&mut st, op, seq, deadline)?;
        }
        Ok(all)
    }

    /// Broadcast of `rows` from `root` (reported as `op`).
    ///
    /// # Safety
    /// As for [`Collective::broadcast_rows`].
    unsafe fn broadcast_rows_as(
        &self,
        op: &'static str,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (mut st, seq) = self.begin(op, deadline)?;
        let size = self.size;
        let problem = (root >= size)
            .then(|| format!("root {root} is not a rank of a group of {size}"))
            .or_else(|| overlapping(rows).map(|(a, b)| format!("rows {a:?} and {b:?} overlap")));
        if let Some(reason) = problem {
            return Err(self.invalid(op, seq, reason));
        }
        let header = OpHeader {
            seq,
            kind: OpKind::BroadcastRows,
            root,
            len: rows.iter().map(|r| r.len as u64).sum(),
            layout: layout_digest(rows.iter().map(|r| r.len), &[]),
        };
        if size == 1 {
            return Ok(());
        }
        let body = spans(rows);
        let hdr = header.encode();
        let (me, n) = (self.rank, size);
        let (mut inbound, mut outbound) = (Vec::new(), Vec::new());
        match self.algorithm {
            Algorithm::Ring => {
                let pos = (me + n - root) % n;
                if pos > 0 {
                    inbound.push(Inbound::new((me + n - 1) % n, body.clone()));
                }
                if pos < n - 1 {
                    let gate = (pos > 0).then_some(Gate {
                        inbound: 0,
                        head: 0,
                    });
                    outbound.push(Outbound::new((me + 1) % n, hdr, body, gate));
                }
            }
            Algorithm::Direct if me == root => {
                for p in (0..n).filter(|&p| p != me) {
                    outbound.push(Outbound::new(p, hdr, body.clone(), None));
                }
            }
            Algorithm::Direct => inbound.push(Inbound::new(root, body)),
        }
        // SAFETY: the caller's contract (broadcast_rows): on the root every row is valid for
        // reads, elsewhere for writes, untouched by others, and rows do not overlap (checked
        // above). A relaying rank's outbound rows are its gated inbound rows.
        unsafe { self.run(&mut st, op, header, inbound, outbound, deadline)? };
        self.confirm(&mut st, op, seq, deadline)
    }

    /// In-place all-gather of `rows` split by `counts` (reported as `op`).
    ///
    /// # Safety
    /// As for [`Collective::all_gather_rows`].
    unsafe fn all_gather_rows_as(
        &self,
        op: &'static str,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let (mut st, seq) = self.begin(op, deadline)?;
        let (me, n) = (self.rank, self.size);
        let problem = (counts.len() != n as usize)
            .then(|| format!("{} per-rank counts for a group of {n}", counts.len()))
            .or_else(|| {
                (!counts_cover(counts, rows.len()))
                    .then(|| format!("counts {counts:?} do not add up to the {} rows", rows.len()))
            })
            .or_else(|| overlapping(rows).map(|(a, b)| format!("rows {a:?} and {b:?} overlap")));
        if let Some(reason) = problem {
            return Err(self.invalid(op, seq, reason));
        }
        let header = OpHeader {
            seq,
            kind: OpKind::AllGatherRows,
            root: 0,
            len: rows.iter().map(|r| r.len as u64).sum(),
            layout: layout_digest(rows.iter().map(|r| r.len), counts),
        };
        if n == 1 {
            return Ok(());
        }
        let mut start = vec![0usize; n as usize + 1];
        for (q, &c) in counts.iter().enumerate() {
            start[q + 1] = start[q] + c;
        }
        let block = |q: u32| spans(&rows[start[q as usize]..start[q as usize + 1]]);
        let hdr = header.encode();
        let (mut inbound, mut outbound) = (Vec::new(), Vec::new());
        match self.algorithm {
            Algorithm::Ring => {
                let (prev, next) = ((me + n - 1) % n, (me + 1) % n);
                // From prev: blocks me-1, me-2, ..., me-(n-1). To next: my block, then the
                // first n-2 of those, each relayed once it has arrived.
                let recv: Vec<Span> = (1..n).flat_map(|k| block((me + n - k) % n)).collect();
                let own = block(me);
                let head = own.iter().map(|s| s.len).sum();
                let send: Vec<Span> = own
                    .into_iter()
                    .chain((1..n - 1).flat_map(|k| block((me + n - k) % n)))
                    .collect();
                inbound.push(Inbound::new(prev, recv));
                outbound.push(Outbound::new(
                    next,
                    hdr,
                    send,
                    Some(Gate { inbound: 0, head }),
                ));
            }
            Algorithm::Direct => {
                for p in (0..n).filter(|&p| p != me) {
                    outbound.push(Outbound::new(p, hdr, block(me), None));
                    inbound.push(Inbound::new(p, block(p)));
                }
            }
        }
        // SAFETY: the caller's contract (all_gather_rows): this rank's rows are valid for
        // reads, every other row for writes, untouched by others, no two rows overlap
        // (checked above); relayed rows are sent only once they have arrived (the gate).
        unsafe { self.run(&mut st, op, header, inbound, outbound, deadline)? };
        self.confirm(&mut st, op, seq, deadline)
    }
}

// SAFETY: host memory only (the device operations keep the default `Unsupported`, which
// enqueues nothing); rows are read and written by this call's own non-blocking socket I/O on
// the calling thread, which ends with the call (returned or unwound).
unsafe impl Collective for SocketCollective {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.size
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.gather_bytes(value, false, deadline)
    }

    /// The gather, then a completion round (see the module docs).
    fn all_gather_bytes_settled(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.gather_bytes(value, true, deadline)
    }

    /// The gather, then a completion round (see the module docs).
    fn all_gather_u64_settled(
        &self,
        value: u64,
        deadline: Instant,
    ) -> Result<Vec<u64>, CollectiveError> {
        let all = self.gather_bytes(&value.to_le_bytes(), true, deadline)?;
        Ok(crate::collective::u64_words(&all))
    }

    unsafe fn broadcast_rows(
        &self,
        rows: &[HostRow],
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract, forwarded.
        unsafe { self.broadcast_rows_as("broadcast_rows", rows, root, deadline) }
    }

    unsafe fn all_gather_rows(
        &self,
        rows: &[HostRow],
        counts: &[usize],
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        // SAFETY: the caller's contract, forwarded.
        unsafe { self.all_gather_rows_as("all_gather_rows", rows, counts, deadline) }
    }

    fn abort(&self, cause: &str) {
        self.break_with(cause);
    }

    fn broken(&self) -> Option<String> {
        self.broken.lock().clone()
    }
}

#[cfg(test)]
mod confirm_tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A rank that comes to the completion round past its deadline confirms nothing: its peer,
    /// which confirmed in time and waits for it, fails too. Before, it sent its confirmation and
    /// only then timed out, and the peer ended `Ok`.
    #[test]
    fn a_rank_past_its_deadline_confirms_nothing_and_its_peer_fails_too() {
        let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Direct).unwrap();
        let confirm = |c: &SocketCollective, deadline: Instant| {
            let (mut st, seq) = c.begin("confirm test", deadline)?;
            c.confirm(&mut st, "confirm test", seq, deadline)
        };
        let (early, late) = std::thread::scope(|s| {
            let early = s.spawn(|| confirm(&ranks[1], Instant::now() + Duration::from_secs(5)));
            std::thread::sleep(Duration::from_millis(50));
            let late = confirm(&ranks[0], Instant::now());
            (early.join().unwrap(), late)
        });
        assert!(
            matches!(late, Err(CollectiveError::Timeout { .. })),
            "{late:?}"
        );
        assert!(early.is_err(), "the peer that confirmed in time: {early:?}");
    }

    /// A failed wait on the sockets (`poll`) is this rank's own typed failure with the wait's
    /// error as the source; it was `Backend` text.
    #[test]
    fn a_failed_wait_keeps_its_error_as_the_source() {
        use std::error::Error as _;
        let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Direct).unwrap();
        let wait = std::io::Error::from_raw_os_error(libc::EINVAL);
        let err = ranks[1].failure_error("gather", 7, &[false, false], Failure::Wait(wait));
        assert!(
            matches!(
                &err,
                CollectiveError::Wait {
                    op: "gather",
                    seq: 7,
                    rank: 1,
                    ..
                }
            ),
            "{err:?}"
        );
        assert_eq!(err.seq(), Some(7));
        let source = err.source().expect("the wait's error is kept");
        let io = source
            .downcast_ref::<crate::SocketError>()
            .expect("a socket error");
        assert_eq!(io.io().kind(), std::io::ErrorKind::InvalidInput, "{io}");
    }

    /// An operation that cannot take the handle by its deadline (another thread's operation
    /// holds it) breaks the handle, as any other error does, so peers fail at once. Before,
    /// it returned `Timeout` and left the handle whole.
    #[test]
    fn an_operation_that_cannot_start_breaks_the_handle() {
        let ranks = SocketCollective::over_socket_pairs(2, Algorithm::Direct).unwrap();
        std::thread::scope(|s| {
            // Rank 1 never joins: this gather holds rank 0's handle for 2 s.
            let holder =
                s.spawn(|| ranks[0].all_gather_u64(1, Instant::now() + Duration::from_secs(2)));
            std::thread::sleep(Duration::from_millis(100));
            let second = ranks[0].all_gather_u64(2, Instant::now() + Duration::from_millis(100));
            // The number it would have had: the holder took 0 (it was u64::MAX).
            assert!(
                matches!(second, Err(CollectiveError::Timeout { seq: 1, .. })),
                "{second:?}"
            );
            assert!(ranks[0].broken().is_some());
            let _ = holder.join().unwrap();
        });
    }
}
