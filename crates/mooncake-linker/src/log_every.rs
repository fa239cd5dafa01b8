//! Log lines that repeat while a condition lasts (the group down, the group refused): each
//! batch and lookup meets the condition again, so the same line is logged at its own level at
//! most once a minute, and at `debug` in between.

use std::time::{Duration, Instant};

use parking_lot::Mutex;

/// How often the same line is logged at its own level while its condition lasts.
pub(crate) const LOG_EVERY: Duration = Duration::from_secs(60);

/// The last line logged at its own level (by its key), and when.
#[derive(Debug, Default)]
pub(crate) struct LogEvery {
    last: Mutex<Option<(String, Instant)>>,
}

impl LogEvery {
    /// Forgets the line logged last: the next is due at once (its condition ended, and a new
    /// one starts).
    pub(crate) fn clear(&self) {
        *self.last.lock() = None;
    }

    /// Whether the line keyed `key` is due at its own level now: not logged in the last
    /// [`LOG_EVERY`] (under this key). When due, it counts as logged from now. One key at a
    /// time: lines that alternate need one `LogEvery` each.
    pub(crate) fn due(&self, key: &str) -> bool {
        let now = Instant::now();
        let mut last = self.last.lock();
        if logged_lately(last.as_ref(), key, now) {
            return false;
        }
        *last = Some((key.to_owned(), now));
        true
    }
}

/// Whether `key` is the line `last` logged, less than [`LOG_EVERY`] before `now`.
fn logged_lately(last: Option<&(String, Instant)>, key: &str, now: Instant) -> bool {
    last.is_some_and(|(k, at)| k == key && now.saturating_duration_since(*at) < LOG_EVERY)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, every batch and lookup of a group down or refused logged its line at its level.
    #[test]
    fn the_same_line_is_due_once_a_minute() {
        let t0 = Instant::now();
        let last = ("refused: world 4 against 8".to_string(), t0);
        assert!(!logged_lately(None, &last.0, t0));
        assert!(logged_lately(Some(&last), &last.0, t0 + LOG_EVERY / 2));
        assert!(!logged_lately(Some(&last), &last.0, t0 + LOG_EVERY));
        assert!(!logged_lately(Some(&last), "another refusal", t0));
        let every = LogEvery::default();
        assert!(every.due("down"));
        assert!(!every.due("down"));
        assert!(every.due("refused"));
        // A new condition after the last one ended: due at once.
        every.clear();
        assert!(every.due("refused"));
    }
}
