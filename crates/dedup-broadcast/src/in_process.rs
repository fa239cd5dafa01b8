//! [`InProcessGroup`]: a TP group whose ranks are threads of one process. Data moves through
//! shared memory: a rank copies straight from the root's (broadcast) or its peers'
//! (all-gather) buffers into its own.
//!
//! # How an operation runs
//! Each rank numbers its operations `0, 1, 2, ...` (its sequence number); the operations with
//! the same number form a *round*. A round is decided exactly once, under the group's lock:
//! - **committed** when the last rank arrives with matching arguments: every rank then copies
//!   what it needs and returns `Ok` (a broadcast receiver may start copying as soon as the root
//!   has arrived, but returns only once the round is committed);
//! - **failed** when, before that, a rank arrives with a different operation, root or length
//!   ([`CollectiveError::Mismatch`], [`CollectiveError::SizeMismatch`]) or with arguments the
//!   operation cannot take ([`CollectiveError::InvalidArgument`]), when a waiting rank's
//!   deadline passes ([`CollectiveError::Timeout`], naming the ranks that had not arrived), or
//!   when a rank that has not arrived has dropped its handle ([`CollectiveError::RankGone`]).
//!
//! So every rank that issues a round gets the same answer: `Ok` on all of them, or an error on
//! all of them. Ranks already waiting in a failed round get the error that failed it. A rank
//! that arrives **late**, after its round failed, gets [`CollectiveError::Aborted`] at once
//! (naming the ranks that were missing, itself among them): it never copies, and its receiving
//! memory is left as it was. Its sequence number still advances, so if the ranks keep issuing
//! operations in order, the late rank's next operation meets the survivors' next operation and
//! the group works again.
//!
//! # Memory
//! A root (broadcast) or any rank (all-gather) returns only after every peer has finished
//! copying out of its memory, so the caller may reuse its buffers as soon as the call returns,
//! whatever the outcome. Copies run outside the lock, in parallel; a wait for a copy already
//! in progress is not cut short by the deadline (a memory copy cannot block, so it is short).

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kv_device::Residence;
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::{Buffer, Collective, CollectiveError};

/// Builds the ranks of an in-process TP group.
///
/// ```
/// use std::time::Duration;
/// use dedup_broadcast::{Collective, InProcessGroup};
/// let ranks = InProcessGroup::new(3);
/// let deadline = kv_loader::deadline_after(Duration::from_secs(10));
/// let mins: Vec<u64> = std::thread::scope(|s| {
///     let hs: Vec<_> = ranks
///         .iter()
///         .map(|c| s.spawn(move || c.all_reduce_min_u64(10 + u64::from(c.rank()), deadline)))
///         .collect();
///     hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
/// });
/// assert_eq!(mins, vec![10, 10, 10]);
/// ```
#[derive(Debug)]
pub struct InProcessGroup;

impl InProcessGroup {
    /// One handle per rank, rank `r` at index `r`; move each into its rank's thread. A size of
    /// 0 gives no ranks.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(size: u32) -> Vec<InProcessCollective> {
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(State {
                rounds: HashMap::new(),
                gone: vec![false; size as usize],
            }),
            cv: Condvar::new(),
        });
        (0..size)
            .map(|rank| InProcessCollective {
                shared: shared.clone(),
                rank,
                seq: AtomicU64::new(0),
            })
            .collect()
    }
}

/// One rank's handle of an [`InProcessGroup`]. Dropping it tells the group this rank is gone:
/// operations waiting for it fail at once with [`CollectiveError::RankGone`].
pub struct InProcessCollective {
    shared: Arc<Shared>,
    rank: u32,
    seq: AtomicU64,
}

impl fmt::Debug for InProcessCollective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InProcessCollective")
            .field("rank", &self.rank)
            .field("size", &self.shared.size)
            .field("next_seq", &self.seq.load(Ordering::Relaxed))
            .finish()
    }
}

struct Shared {
    size: u32,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    /// Rounds that some rank has issued and not every rank has left.
    rounds: HashMap<u64, Round>,
    /// Ranks whose handle was dropped.
    gone: Vec<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Broadcast,
    AllGather,
    GatherU64,
    GatherBytes,
}

impl OpKind {
    fn name(self) -> &'static str {
        match self {
            OpKind::Broadcast => "broadcast",
            OpKind::AllGather => "all_gather",
            OpKind::GatherU64 => "all_gather_u64",
            OpKind::GatherBytes => "all_gather_bytes",
        }
    }
}

/// What every rank must agree on for a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Desc {
    kind: OpKind,
    len: usize,
    root: u32,
}

enum Arrival {
    /// Address of the rank's send region (broadcast: its buffer), which peers copy from.
    Mem { send: usize },
    /// A host value, owned by the round.
    Value(Vec<u8>),
}

enum Fate {
    Open,
    Committed,
    Failed {
        error: CollectiveError,
        missing: Vec<u32>,
    },
}

struct Round {
    desc: Desc,
    first: u32,
    /// Ranks that issued this round (arrived, or were turned away).
    touched: Vec<bool>,
    arrivals: Vec<Option<Arrival>>,
    arrived: u32,
    fate: Fate,
    /// Copies started and not finished.
    copying: u32,
    /// Ranks whose copies are finished.
    copied: u32,
    /// Ranks that have returned from this round.
    left: u32,
}

impl Round {
    fn new(desc: Desc, first: u32, size: u32) -> Self {
        Round {
            desc,
            first,
            touched: vec![false; size as usize],
            arrivals: (0..size).map(|_| None).collect(),
            arrived: 0,
            fate: Fate::Open,
            copying: 0,
            copied: 0,
            left: 0,
        }
    }

    fn untouched(&self) -> Vec<u32> {
        (0..self.touched.len() as u32)
            .filter(|&r| !self.touched[r as usize])
            .collect()
    }
}

impl State {
    /// Fails an open round, waking every waiter.
    fn fail(&mut self, seq: u64, error: CollectiveError) {
        if let Some(round) = self.rounds.get_mut(&seq) {
            if matches!(round.fate, Fate::Open) {
                let missing = round.untouched();
                round.fate = Fate::Failed { error, missing };
            }
        }
    }

    /// This rank is done with round `seq`.
    fn leave(&mut self, seq: u64) {
        if let Some(round) = self.rounds.get_mut(&seq) {
            round.left += 1;
        }
        self.collect(seq);
    }

    /// Drops round `seq` once every rank has left it or is gone without having issued it.
    fn collect(&mut self, seq: u64) {
        let Some(round) = self.rounds.get(&seq) else {
            return;
        };
        let gone_untouched = round
            .touched
            .iter()
            .zip(&self.gone)
            .filter(|(t, g)| !**t && **g)
            .count() as u32;
        if round.left + gone_untouched == round.touched.len() as u32 {
            self.rounds.remove(&seq);
        }
    }
}

fn internal(seq: u64) -> CollectiveError {
    CollectiveError::Backend(format!("in-process group lost round {seq}"))
}

fn round_mut(st: &mut State, seq: u64) -> Result<&mut Round, CollectiveError> {
    st.rounds.get_mut(&seq).ok_or_else(|| internal(seq))
}

fn host_only(op: &str, buffers: &[Buffer]) -> Option<String> {
    buffers
        .iter()
        .find(|b| b.residence != Residence::Host)
        .map(|b| {
            format!(
                "{op} of the in-process group moves host memory only, got {:?}",
                b.residence
            )
        })
}

/// Copies `len` bytes from `src` to `dst`; nothing when `len` is 0.
///
/// # Safety
/// `src` must be valid for reads and `dst` for writes of `len` bytes, not overlapping, with no
/// concurrent writer of `src` nor any concurrent access to `dst`.
unsafe fn copy_bytes(src: usize, dst: usize, len: usize) {
    if len == 0 || src == dst {
        return;
    }
    // SAFETY: guaranteed by this function's contract.
    unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, len) }
}

impl InProcessCollective {
    /// Issues this rank's next operation: returns the locked state and the round's sequence
    /// number once this rank has arrived, or the round's error when this rank is turned away
    /// (the round already failed, or this rank's arguments fail it).
    fn arrive(
        &self,
        desc: Desc,
        invalid: Option<String>,
        arrival: Arrival,
    ) -> Result<(MutexGuard<'_, State>, u64), CollectiveError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed);
        let (size, rank, op) = (self.shared.size, self.rank, desc.kind.name());
        let mut st = self.shared.state.lock();
        let round = st
            .rounds
            .entry(seq)
            .or_insert_with(|| Round::new(desc, rank, size));
        round.touched[rank as usize] = true;
        if let Fate::Failed { error, missing } = &round.fate {
            let err = CollectiveError::Aborted {
                op,
                seq,
                missing: missing.clone(),
                cause: error.to_string(),
            };
            st.leave(seq);
            return Err(err);
        }
        let turned_away = if round.desc.kind != desc.kind || round.desc.root != desc.root {
            Some(CollectiveError::Mismatch {
                op: round.desc.kind.name(),
                seq,
                rank,
                detail: format!(
                    "{op} (root {}) where rank {} issued {} (root {})",
                    desc.root,
                    round.first,
                    round.desc.kind.name(),
                    round.desc.root
                ),
            })
        } else if round.desc.len != desc.len {
            Some(CollectiveError::SizeMismatch {
                op,
                seq,
                rank,
                expected: round.desc.len,
                got: desc.len,
                first: round.first,
            })
        } else {
            invalid.map(|reason| CollectiveError::InvalidArgument {
                op,
                seq,
                rank,
                reason,
            })
        };
        if let Some(err) = turned_away {
            tracing::warn!(rank, error = %err, "collective round failed");
            st.fail(seq, err.clone());
            st.leave(seq);
            self.shared.cv.notify_all();
            return Err(err);
        }
        round.arrivals[rank as usize] = Some(arrival);
        round.arrived += 1;
        if round.arrived == size {
            round.fate = Fate::Committed;
            self.shared.cv.notify_all();
        }
        Ok((st, seq))
    }

    /// Waits on an open round until something changes or `deadline`; fails the round when the
    /// deadline has passed or a missing rank is gone.
    fn wait_open(
        &self,
        st: &mut MutexGuard<'_, State>,
        seq: u64,
        op: &'static str,
        deadline: Instant,
    ) {
        let Some(round) = st.rounds.get(&seq) else {
            return;
        };
        let missing = round.untouched();
        let gone: Vec<u32> = missing
            .iter()
            .copied()
            .filter(|&r| st.gone[r as usize])
            .collect();
        let err = if !gone.is_empty() {
            Some(CollectiveError::RankGone { op, seq, gone })
        } else if Instant::now() >= deadline {
            Some(CollectiveError::Timeout { op, seq, missing })
        } else {
            None
        };
        match err {
            Some(err) => {
                tracing::warn!(rank = self.rank, error = %err, "collective round failed");
                st.fail(seq, err);
                self.shared.cv.notify_all();
            }
            None => {
                self.shared.cv.wait_until(st, deadline);
            }
        }
    }

    /// Leaves round `seq` with `result`.
    fn finish<T>(
        &self,
        st: &mut MutexGuard<'_, State>,
        seq: u64,
        result: Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        st.leave(seq);
        result
    }

    /// A host-value round: every rank's `value`, in rank order.
    fn gather_values(
        &self,
        kind: OpKind,
        value: Vec<u8>,
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let desc = Desc {
            kind,
            len: value.len(),
            root: 0,
        };
        let (mut st, seq) = self.arrive(desc, None, Arrival::Value(value))?;
        loop {
            let round = round_mut(&mut st, seq)?;
            match &round.fate {
                Fate::Failed { error, .. } => {
                    let e = error.clone();
                    return self.finish(&mut st, seq, Err(e));
                }
                Fate::Committed => {
                    let values = round
                        .arrivals
                        .iter()
                        .map(|a| match a {
                            Some(Arrival::Value(v)) => v.clone(),
                            _ => Vec::new(),
                        })
                        .collect();
                    return self.finish(&mut st, seq, Ok(values));
                }
                Fate::Open => self.wait_open(&mut st, seq, kind.name(), deadline),
            }
        }
    }
}

impl Drop for InProcessCollective {
    fn drop(&mut self) {
        let mut st = self.shared.state.lock();
        if let Some(g) = st.gone.get_mut(self.rank as usize) {
            *g = true;
        }
        let seqs: Vec<u64> = st.rounds.keys().copied().collect();
        for seq in seqs {
            st.collect(seq);
        }
        self.shared.cv.notify_all();
    }
}

impl Collective for InProcessCollective {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.shared.size
    }

    unsafe fn broadcast(
        &self,
        buf: Buffer,
        root: u32,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let op = OpKind::Broadcast.name();
        let size = self.shared.size;
        let invalid = host_only(op, &[buf]).or_else(|| {
            (root >= size).then(|| format!("root {root} is not a rank of a group of {size}"))
        });
        let desc = Desc {
            kind: OpKind::Broadcast,
            len: buf.len,
            root,
        };
        let arrival = Arrival::Mem { send: buf.addr };
        let (mut st, seq) = self.arrive(desc, invalid, arrival)?;
        let is_root = self.rank == root;
        let mut copied = false;
        loop {
            let round = round_mut(&mut st, seq)?;
            match (&round.fate, is_root) {
                // The root waits for copies out of its buffer, whatever the fate.
                (Fate::Failed { .. }, true) if round.copying > 0 => {
                    self.shared.cv.wait(&mut st);
                }
                (Fate::Failed { error, .. }, _) => {
                    let e = error.clone();
                    return self.finish(&mut st, seq, Err(e));
                }
                (Fate::Committed, true) if round.copied + 1 >= size => {
                    return self.finish(&mut st, seq, Ok(()));
                }
                (Fate::Committed, true) => self.shared.cv.wait(&mut st),
                (_, false) if !copied && round.arrivals[root as usize].is_some() => {
                    let src = match &round.arrivals[root as usize] {
                        Some(Arrival::Mem { send }) => *send,
                        _ => return Err(internal(seq)),
                    };
                    round.copying += 1;
                    MutexGuard::unlocked(&mut st, || {
                        // SAFETY: the root's `buf` stays valid and unwritten until this copy is
                        // counted finished (the root waits for `copying == 0` and `copied`);
                        // this rank's `buf` is valid for writes and touched by nothing else for
                        // the call; ranks' buffers do not overlap (trait contract), and both
                        // are `len` bytes (the round's lengths matched).
                        unsafe { copy_bytes(src, buf.addr, buf.len) }
                    });
                    let round = round_mut(&mut st, seq)?;
                    round.copying -= 1;
                    round.copied += 1;
                    copied = true;
                    self.shared.cv.notify_all();
                }
                // Committed means the root has arrived, so the copy arm above has run.
                (Fate::Committed, false) => return self.finish(&mut st, seq, Ok(())),
                (Fate::Open, _) => self.wait_open(&mut st, seq, op, deadline),
            }
        }
    }

    unsafe fn all_gather(
        &self,
        send: Buffer,
        recv: Buffer,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let op = OpKind::AllGather.name();
        let (size, rank, n) = (self.shared.size, self.rank, send.len);
        let in_place = recv.addr.checked_add(rank as usize * n) == Some(send.addr);
        let invalid = host_only(op, &[send, recv]).or_else(|| {
            if (size as usize).checked_mul(n) != Some(recv.len) {
                Some(format!(
                    "recv holds {} bytes, {size} ranks of {n} need {}",
                    recv.len,
                    n.saturating_mul(size as usize)
                ))
            } else if send.overlaps(&recv) && !in_place {
                Some("send overlaps recv other than at this rank's chunk".to_string())
            } else {
                None
            }
        });
        let desc = Desc {
            kind: OpKind::AllGather,
            len: n,
            root: 0,
        };
        let arrival = Arrival::Mem { send: send.addr };
        let (mut st, seq) = self.arrive(desc, invalid, arrival)?;
        let mut copied = false;
        loop {
            let round = round_mut(&mut st, seq)?;
            match &round.fate {
                // Nobody copies before a round commits, so a failed one has no copy in flight.
                Fate::Failed { error, .. } => {
                    let e = error.clone();
                    return self.finish(&mut st, seq, Err(e));
                }
                Fate::Committed if !copied => {
                    let sources: Vec<usize> = round
                        .arrivals
                        .iter()
                        .map(|a| match a {
                            Some(Arrival::Mem { send }) => *send,
                            _ => 0,
                        })
                        .collect();
                    round.copying += 1;
                    MutexGuard::unlocked(&mut st, || {
                        for (peer, &src) in sources.iter().enumerate() {
                            // SAFETY: every rank arrived with a send region of `n` bytes (the
                            // round's lengths matched) that stays valid and unwritten until
                            // every rank has counted its copies finished (each waits for
                            // `copied == size`); `recv` holds `size * n` bytes (checked on
                            // arrival), so chunk `peer` is in it, and only this rank writes
                            // it. A peer's send region does not overlap this rank's recv
                            // (trait contract); this rank's own send is either exactly its
                            // chunk (skipped by `copy_bytes`, src == dst) or disjoint from
                            // recv (checked on arrival).
                            unsafe { copy_bytes(src, recv.addr + peer * n, n) }
                        }
                    });
                    let round = round_mut(&mut st, seq)?;
                    round.copying -= 1;
                    round.copied += 1;
                    copied = true;
                    self.shared.cv.notify_all();
                }
                Fate::Committed if round.copied >= size => {
                    return self.finish(&mut st, seq, Ok(()));
                }
                Fate::Committed => self.shared.cv.wait(&mut st),
                Fate::Open => self.wait_open(&mut st, seq, op, deadline),
            }
        }
    }

    fn all_gather_u64(&self, value: u64, deadline: Instant) -> Result<Vec<u64>, CollectiveError> {
        let all = self.gather_values(OpKind::GatherU64, value.to_le_bytes().to_vec(), deadline)?;
        Ok(crate::collective::u64_words(&all))
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        self.gather_values(OpKind::GatherBytes, value.to_vec(), deadline)
    }
}
