//! The trait's default settled gathers over a transport whose gather is not settled: a rank's
//! value lands on its peers as soon as it arrives and stays there when the rank then gives up
//! (as an NCCL gather's share does). The plain gather then leaves a late peer `Ok` beside a rank
//! that timed out; the settled ones fail both.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use dedup_broadcast::{Collective, CollectiveError};

/// What every rank of one [`EarlyLanding`] group sees: each operation's values so far.
struct Board {
    size: u32,
    values: Mutex<HashMap<u64, Vec<Option<Vec<u8>>>>>,
    arrived: Condvar,
}

/// A rank of a group whose gather puts this rank's value on the board at once and returns
/// once every value is there, or fails at its deadline leaving its own value behind.
struct EarlyLanding {
    rank: u32,
    board: Arc<Board>,
    next: AtomicU64,
}

fn group(size: u32) -> Vec<EarlyLanding> {
    let board = Arc::new(Board {
        size,
        values: Mutex::new(HashMap::new()),
        arrived: Condvar::new(),
    });
    (0..size)
        .map(|rank| EarlyLanding {
            rank,
            board: board.clone(),
            next: AtomicU64::new(0),
        })
        .collect()
}

// SAFETY: it moves owned byte vectors only: the row and device operations keep the trait's
// defaults, `Unsupported`, which touch no memory.
unsafe impl Collective for EarlyLanding {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn size(&self) -> u32 {
        self.board.size
    }

    fn all_gather_bytes(
        &self,
        value: &[u8],
        deadline: Instant,
    ) -> Result<Vec<Vec<u8>>, CollectiveError> {
        let seq = self.next.fetch_add(1, Ordering::Relaxed);
        let mut values = self.board.values.lock().unwrap();
        values
            .entry(seq)
            .or_insert_with(|| vec![None; self.board.size as usize])[self.rank as usize] =
            Some(value.to_vec());
        self.board.arrived.notify_all();
        loop {
            let row = &values[&seq];
            if row.iter().all(Option::is_some) {
                return Ok(row.iter().flatten().cloned().collect());
            }
            let now = Instant::now();
            if now >= deadline {
                let missing = (0..self.board.size)
                    .filter(|&r| row[r as usize].is_none())
                    .collect();
                return Err(CollectiveError::Timeout {
                    op: "all_gather_bytes",
                    seq,
                    missing,
                });
            }
            values = self
                .board
                .arrived
                .wait_timeout(values, deadline - now)
                .unwrap()
                .0;
        }
    }
}

/// Rank 0 comes first with a short deadline and gives up; rank 1 comes after that deadline,
/// within its own. `gather` is the operation both run; what each got.
fn early_then_late<T: Send>(
    gather: impl Fn(&EarlyLanding, Instant) -> Result<T, CollectiveError> + Sync,
) -> [Result<T, CollectiveError>; 2] {
    let ranks = group(2);
    std::thread::scope(|s| {
        let first = s.spawn(|| gather(&ranks[0], Instant::now() + Duration::from_millis(100)));
        let first = first.join().unwrap();
        let late = s.spawn(|| gather(&ranks[1], Instant::now() + Duration::from_millis(500)));
        [first, late.join().unwrap()]
    })
}

#[test]
fn a_plain_gather_over_early_landing_leaves_a_late_rank_ok_beside_one_that_gave_up() {
    let [first, late] = early_then_late(|c, d| c.all_gather_u64(7, d));
    assert!(
        matches!(first, Err(CollectiveError::Timeout { .. })),
        "{first:?}"
    );
    // What the default settled gathers are for: this is the asymmetry they close.
    assert_eq!(late.unwrap(), vec![7, 7]);
}

#[test]
fn the_default_settled_u64_gather_fails_the_late_rank_too() {
    let [first, late] = early_then_late(|c, d| c.all_gather_u64_settled(7, d));
    assert!(
        matches!(first, Err(CollectiveError::Timeout { .. })),
        "{first:?}"
    );
    assert!(
        matches!(late, Err(CollectiveError::Timeout { ref missing, .. }) if missing == &[0]),
        "{late:?}"
    );
}

#[test]
fn the_default_settled_bytes_gather_fails_the_late_rank_too() {
    let [first, late] = early_then_late(|c, d| c.all_gather_bytes_settled(b"gate", d));
    assert!(first.is_err(), "{first:?}");
    assert!(
        matches!(late, Err(CollectiveError::Timeout { ref missing, .. }) if missing == &[0]),
        "{late:?}"
    );
}

/// Each rank acts on its lookup's agreed hit alone (its engine plans that many cached tokens):
/// before, `agree_lookup` used the plain gather, so a late rank got a hit beside a rank whose
/// lookup failed (and looked up alone, or failed the request).
#[test]
fn a_lookup_agreement_is_settled_a_late_rank_fails_too() {
    let [first, late] =
        early_then_late(|c, d| dedup_broadcast::agree_lookup(c, &[3; 16], Some(4), d));
    assert!(first.is_err(), "{first:?}");
    assert!(
        matches!(late, Err(CollectiveError::Timeout { ref missing, .. }) if missing == &[0]),
        "{late:?}"
    );
}

#[test]
fn settled_gathers_of_ranks_that_all_come_in_time_return_every_value() {
    let ranks = group(3);
    let deadline = Instant::now() + Duration::from_secs(5);
    let got: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let words = c.all_gather_u64_settled(u64::from(c.rank()) + 10, deadline);
                    let bytes = c.all_gather_bytes_settled(&[c.rank() as u8], deadline);
                    (words.unwrap(), bytes.unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (words, bytes) in got {
        assert_eq!(words, vec![10, 11, 12]);
        assert_eq!(bytes, vec![vec![0], vec![1], vec![2]]);
    }
}
