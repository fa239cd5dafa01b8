//! Log lines that repeat while a condition lasts (the group down, the group refused, staging
//! short): each batch and lookup meets the condition again, so the same line is logged at its
//! own level at most once a minute, and at `debug` in between. kvlink's own crates use it
//! (here, for the lowest of them that logs such lines); not part of its API.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often the same line is logged at its own level while its condition lasts.
pub const LOG_EVERY: Duration = Duration::from_secs(60);

/// Most keys a [`LogEvery`] remembers: past them the one logged longest ago is forgotten
/// (its next line is due at once).
const KEYS: usize = 16;

/// The lines logged at their own level lately (by key), when, and how many of each were
/// not due since: each key is due once a [`LOG_EVERY`], apart from the others.
#[derive(Debug)]
pub struct LogEvery {
    last: Mutex<Vec<Logged>>,
}

/// A key's line: when it was last logged at its own level, and how many times it was not due
/// since.
#[derive(Debug)]
struct Logged {
    key: String,
    at: Instant,
    skipped: u64,
}

impl Default for LogEvery {
    fn default() -> Self {
        Self::new()
    }
}

impl LogEvery {
    /// Nothing logged yet (`const`: usable in a `static`).
    pub const fn new() -> Self {
        LogEvery {
            last: parking_lot::const_mutex(Vec::new()),
        }
    }

    /// Forgets the lines logged: the next of each is due at once (its condition ended, and a
    /// new one starts).
    pub fn clear(&self) {
        self.last.lock().clear();
    }

    /// Whether the line keyed `key` is due at its own level now: not logged in the last
    /// [`LOG_EVERY`] under this key. When due, it counts as logged from now.
    pub fn due(&self, key: &str) -> bool {
        self.due_after(key).is_some()
    }

    /// [`due`](Self::due), telling when due how many times the key was not due since its
    /// last line at its own level (for that line to say how many went to `debug`).
    pub fn due_after(&self, key: &str) -> Option<u64> {
        let now = Instant::now();
        let mut last = self.last.lock();
        match last.iter_mut().find(|l| l.key == key) {
            Some(l) if logged_lately(l.at, now) => {
                l.skipped = l.skipped.saturating_add(1);
                None
            }
            Some(l) => {
                l.at = now;
                Some(std::mem::take(&mut l.skipped))
            }
            None => {
                if last.len() >= KEYS {
                    if let Some(oldest) = (0..last.len()).min_by_key(|&i| last[i].at) {
                        last.swap_remove(oldest);
                    }
                }
                last.push(Logged {
                    key: key.to_owned(),
                    at: now,
                    skipped: 0,
                });
                Some(0)
            }
        }
    }
}

/// Whether a line logged `at` was logged less than [`LOG_EVERY`] before `now`.
fn logged_lately(at: Instant, now: Instant) -> bool {
    now.saturating_duration_since(at) < LOG_EVERY
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, every batch and lookup of a group down or refused logged its line at its level.
    #[test]
    fn the_same_line_is_due_once_a_minute() {
        let t0 = Instant::now();
        assert!(logged_lately(t0, t0 + LOG_EVERY / 2));
        assert!(!logged_lately(t0, t0 + LOG_EVERY));
        let every = LogEvery::default();
        assert!(every.due("down"));
        assert!(!every.due("down"));
        assert!(every.due("refused"));
        // A new condition after the last one ended: due at once.
        every.clear();
        assert!(every.due("refused"));
    }

    /// Lines that alternate are each due once a minute (before, one key was remembered:
    /// each change of line logged at its level again).
    #[test]
    fn alternating_lines_are_each_limited() {
        let every = LogEvery::new();
        assert!(every.due("get"));
        assert!(every.due("exists"));
        assert!(!every.due("get"));
        assert!(!every.due("exists"));
        // Past the keys it remembers, the oldest is forgotten.
        for k in 0..KEYS {
            every.due(&format!("k{k}"));
        }
        assert!(every.due("get"));
    }

    /// A line that is due tells how many of its key were not due since it was last logged.
    #[test]
    fn a_due_line_counts_the_ones_skipped() {
        let every = LogEvery::new();
        assert_eq!(every.due_after("failed"), Some(0));
        assert_eq!(every.due_after("failed"), None);
        assert_eq!(every.due_after("failed"), None);
        // Due again (as a minute later): two went to debug meanwhile, and the count restarts.
        {
            let mut last = every.last.lock();
            last[0].at = last[0].at.checked_sub(LOG_EVERY).expect("up a minute");
        }
        assert_eq!(every.due_after("failed"), Some(2));
        assert_eq!(every.due_after("failed"), None);
    }
}
