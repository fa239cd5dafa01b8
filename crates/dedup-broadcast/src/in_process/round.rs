//! The round machinery of the in-process group: how the n-th operation of every rank meets,
//! and how its fate is decided once for all of them.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kv_device::{DeviceRegion, HostRow, SharedEvent};
use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::CollectiveError;

/// How long past its deadline an owner waits for peers of a committed round to copy out of
/// its rows (they start at once; this only bounds a peer thread that never runs again). Then
/// the round is given up, unless a copy is running: a running copy is a bounded memory copy,
/// not anyone's progress, so the owner waits for it and the round can still end `Ok`.
const COPY_GRACE: Duration = Duration::from_secs(10);

/// The wait between checks of copies already running.
pub(super) const COPY_POLL: Duration = Duration::from_millis(5);

/// State every handle of one group shares.
pub(super) struct Group {
    pub(super) size: u32,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    /// [`COPY_GRACE`], shorter in tests.
    pub(super) copy_grace: Duration,
    /// Tests: a rank that sleeps this long inside its host copy (a copy still running at the
    /// grace's end).
    #[cfg(test)]
    pub(super) copy_pause: Mutex<Option<(u32, Duration)>>,
}

impl Group {
    pub(super) fn new(size: u32) -> Self {
        Group {
            size,
            state: Mutex::new(State::new(size)),
            cv: Condvar::new(),
            copy_grace: COPY_GRACE,
            #[cfg(test)]
            copy_pause: Mutex::new(None),
        }
    }

    /// An owner's wait for peers of a committed round to copy out of its rows, until `limit`
    /// (its deadline plus the copy grace). True when the round is to be given up: the limit
    /// has passed and no copy is running (`running`, read under the lock). A copy running at
    /// the limit is waited for instead, a short poll at a time: it is a bounded memory copy,
    /// and giving the round up under it would fail that peer after others returned `Ok`.
    pub(super) fn wait_for_copies(
        &self,
        st: &mut MutexGuard<'_, State>,
        limit: Instant,
        running: bool,
    ) -> bool {
        if Instant::now() < limit {
            self.cv.wait_until(st, limit);
            return false;
        }
        if running {
            self.cv.wait_for(st, COPY_POLL);
            return false;
        }
        true
    }

    /// Tests: sleeps inside `rank`'s host copy when a pause is set for it.
    pub(super) fn pause_in_copy(&self, _rank: u32) {
        #[cfg(test)]
        if let Some((rank, pause)) = *self.copy_pause.lock() {
            if rank == _rank {
                std::thread::sleep(pause);
            }
        }
    }
}

pub(super) struct State {
    /// Rounds that some rank has issued and not every rank has left.
    pub(super) rounds: HashMap<u64, Round>,
    /// Ranks whose handle was dropped.
    pub(super) gone: Vec<bool>,
    /// Set by `abort` (host and device groups), or by a device round that failed after its
    /// commit: every later operation fails at once.
    pub(super) broken: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum OpKind {
    BroadcastRows,
    AllGatherRows,
    BroadcastDevice,
    AllGatherDevice,
    GatherU64,
    GatherBytes,
}

impl OpKind {
    pub(super) fn name(self) -> &'static str {
        match self {
            OpKind::BroadcastRows => "broadcast_rows",
            OpKind::AllGatherRows => "all_gather_rows",
            OpKind::BroadcastDevice => "broadcast_device",
            OpKind::AllGatherDevice => "all_gather_device",
            OpKind::GatherU64 => "all_gather_u64",
            OpKind::GatherBytes => "all_gather_bytes",
        }
    }
}

/// What every rank must agree on for a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Desc {
    pub(super) kind: OpKind,
    /// Bytes (of the value, the rows, or the region).
    pub(super) len: usize,
    pub(super) root: u32,
    /// A digest of the rest of the arguments that must match (row lengths, counts).
    pub(super) shape: u64,
}

/// What a rank brings to a round.
pub(super) enum Arrival {
    /// Its rows (peers copy from or into them).
    Rows(Vec<HostRow>),
    /// Its device region and the event after which it may be read or written.
    Device {
        region: DeviceRegion,
        after: Option<SharedEvent>,
    },
    /// A host value, owned by the round.
    Value(Vec<u8>),
}

pub(super) enum Fate {
    Open,
    Committed,
    Failed {
        error: CollectiveError,
        missing: Vec<u32>,
    },
}

pub(super) struct Round {
    pub(super) desc: Desc,
    first: u32,
    /// Ranks that issued this round (arrived, or were turned away).
    touched: Vec<bool>,
    pub(super) arrivals: Vec<Option<Arrival>>,
    arrived: u32,
    pub(super) fate: Fate,
    /// Host copies started and not finished.
    pub(super) copying: u32,
    /// Ranks whose host copies are finished.
    pub(super) copied: u32,
    /// Device rounds: each rank's copy event once enqueued (or why it could not be).
    pub(super) posted: Vec<Option<Result<SharedEvent, CollectiveError>>>,
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
            posted: (0..size).map(|_| None).collect(),
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
    pub(super) fn new(size: u32) -> Self {
        State {
            rounds: HashMap::new(),
            gone: vec![false; size as usize],
            broken: None,
        }
    }

    /// Fails an open round.
    pub(super) fn fail(&mut self, seq: u64, error: CollectiveError) {
        if let Some(round) = self.rounds.get_mut(&seq) {
            if matches!(round.fate, Fate::Open) {
                let missing = round.untouched();
                round.fate = Fate::Failed { error, missing };
            }
        }
    }

    /// Gives up a round whose copies outlived their grace (committed or not): every rank that
    /// has not returned from it gets `error`; a rank that has not started its copies never
    /// will. Copies already running finish (owners wait for them, not for anyone's progress).
    pub(super) fn abandon(&mut self, seq: u64, error: CollectiveError) {
        if let Some(round) = self.rounds.get_mut(&seq) {
            if !matches!(round.fate, Fate::Failed { .. }) {
                round.fate = Fate::Failed {
                    error,
                    missing: Vec::new(),
                };
            }
        }
    }

    /// Marks the group broken and fails every open round with `cause`.
    pub(super) fn break_group(&mut self, cause: &str) {
        self.broken.get_or_insert_with(|| cause.to_string());
        let open: Vec<u64> = self
            .rounds
            .iter()
            .filter(|(_, r)| matches!(r.fate, Fate::Open))
            .map(|(s, _)| *s)
            .collect();
        for seq in open {
            let op = self.rounds[&seq].desc.kind.name();
            self.fail(
                seq,
                CollectiveError::Aborted {
                    op,
                    seq,
                    missing: Vec::new(),
                    cause: format!("the group was aborted: {cause}"),
                },
            );
        }
    }

    /// This rank is done with round `seq`.
    pub(super) fn leave(&mut self, seq: u64) {
        if let Some(round) = self.rounds.get_mut(&seq) {
            round.left += 1;
        }
        self.collect(seq);
    }

    /// Drops round `seq` once every rank has left it or is gone without having issued it.
    pub(super) fn collect(&mut self, seq: u64) {
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

pub(super) fn internal(seq: u64) -> CollectiveError {
    CollectiveError::Backend(format!("in-process group lost round {seq}"))
}

pub(super) fn round_mut(st: &mut State, seq: u64) -> Result<&mut Round, CollectiveError> {
    st.rounds.get_mut(&seq).ok_or_else(|| internal(seq))
}

impl Group {
    /// Issues `rank`'s operation number `seq`: returns the locked state once this rank has
    /// arrived, or the round's error when this rank is turned away (the round already failed,
    /// the group is broken, or this rank's arguments fail it).
    pub(super) fn arrive(
        &self,
        rank: u32,
        seq: u64,
        desc: Desc,
        invalid: Option<String>,
        arrival: Arrival,
    ) -> Result<MutexGuard<'_, State>, CollectiveError> {
        let (size, op) = (self.size, desc.kind.name());
        let mut st = self.state.lock();
        if let Some(cause) = st.broken.clone() {
            // A round its peers issued before the abort is left by this rank too, so that it
            // can be dropped (its arrivals' values and events were kept until every handle
            // was dropped).
            if let Some(round) = st.rounds.get_mut(&seq) {
                if let Some(t) = round.touched.get_mut(rank as usize) {
                    *t = true;
                }
                st.leave(seq);
            }
            return Err(CollectiveError::Aborted {
                op,
                seq,
                missing: Vec::new(),
                cause: format!("the group was aborted: {cause}"),
            });
        }
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
        } else if round.desc.shape != desc.shape {
            Some(CollectiveError::Mismatch {
                op,
                seq,
                rank,
                detail: format!("rows or counts that differ from rank {}'s", round.first),
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
            self.cv.notify_all();
            return Err(err);
        }
        round.arrivals[rank as usize] = Some(arrival);
        round.arrived += 1;
        if round.arrived == size {
            round.fate = Fate::Committed;
        }
        // Every arrival wakes the waiters, not only the commit: a rows-broadcast receiver
        // that came before the root starts copying as soon as the root is here.
        self.cv.notify_all();
        Ok(st)
    }

    /// Waits on an open round until something changes or `deadline`; fails the round when the
    /// deadline has passed or a missing rank is gone.
    pub(super) fn wait_open(
        &self,
        rank: u32,
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
                tracing::warn!(rank, error = %err, "collective round failed");
                st.fail(seq, err);
                self.cv.notify_all();
            }
            None => {
                self.cv.wait_until(st, deadline);
            }
        }
    }

    /// Waits until round `seq` is committed (`Ok`) or failed (its error, after leaving it).
    pub(super) fn committed(
        &self,
        rank: u32,
        st: &mut MutexGuard<'_, State>,
        seq: u64,
        op: &'static str,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        loop {
            let round = round_mut(st, seq)?;
            match &round.fate {
                Fate::Committed => return Ok(()),
                Fate::Failed { error, .. } => {
                    let e = error.clone();
                    st.leave(seq);
                    return Err(e);
                }
                Fate::Open => self.wait_open(rank, st, seq, op, deadline),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use crate::{Collective, InProcessGroup};

    /// Before, a rank that came to a round after the group was aborted was turned away
    /// without leaving it: the round (its arrivals' values, a device round's events) stayed
    /// until every handle was dropped.
    #[test]
    fn a_round_an_abort_failed_is_dropped_once_the_late_rank_comes() {
        let ranks = InProcessGroup::new(3);
        let deadline = kv_loader::deadline_after(Duration::from_secs(20));
        std::thread::scope(|s| {
            let early: Vec<_> = ranks[..2]
                .iter()
                .map(|c| s.spawn(move || c.all_gather_u64(u64::from(c.rank()), deadline)))
                .collect();
            while ranks[0].group.state.lock().rounds.is_empty() {
                std::thread::sleep(Duration::from_millis(5));
            }
            ranks[0].abort("test");
            for h in early {
                assert!(h.join().unwrap().is_err(), "aborted");
            }
        });
        let late = ranks[2].all_gather_u64(2, deadline).unwrap_err();
        assert!(
            matches!(late, crate::CollectiveError::Aborted { .. }),
            "{late}"
        );
        assert!(ranks[0].group.state.lock().rounds.is_empty());
    }
}
