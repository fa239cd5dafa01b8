//! Log lines that repeat while a condition lasts (the group down, the group refused): each
//! batch and lookup meets the condition again, so the same line is logged at its own level at
//! most once a minute, and at `debug` in between.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often the same line is logged at its own level while its condition lasts.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

/// Most keys a [`LogEvery`] remembers: past them the one logged longest ago is forgotten
/// (its next line is due at once).
const KEYS: usize = 16;

/// The lines logged at their own level lately (by key), and when: each key is due once a
/// [`LOG_EVERY`], apart from the others.
#[derive(Debug)]
pub(crate) struct LogEvery {
    last: Mutex<Vec<(String, Instant)>>,
}

impl Default for LogEvery {
    fn default() -> Self {
        Self::new()
    }
}

impl LogEvery {
    /// Nothing logged yet (`const`: usable in a `static`).
    pub(crate) const fn new() -> Self {
        LogEvery {
            last: parking_lot::const_mutex(Vec::new()),
        }
    }

    /// Forgets the lines logged: the next of each is due at once (its condition ended, and a
    /// new one starts).
    pub(crate) fn clear(&self) {
        self.last.lock().clear();
    }

    /// Whether the line keyed `key` is due at its own level now: not logged in the last
    /// [`LOG_EVERY`] under this key. When due, it counts as logged from now.
    pub(crate) fn due(&self, key: &str) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock();
        match last.iter_mut().find(|(k, _)| k == key) {
            Some((_, at)) if logged_lately(*at, now) => false,
            Some((_, at)) => {
                *at = now;
                true
            }
            None => {
                if last.len() >= KEYS {
                    if let Some(oldest) = (0..last.len()).min_by_key(|&i| last[i].1) {
                        last.swap_remove(oldest);
                    }
                }
                last.push((key.to_owned(), now));
                true
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
}
