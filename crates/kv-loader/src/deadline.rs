//! Deadlines from configured waits, without `Instant + Duration` overflow.
//!
//! `Instant::now() + wait` panics when the sum does not fit the clock (`Duration::MAX`, or any
//! wait of centuries). Every deadline kvlink derives from a configured wait goes through
//! [`deadline_after`] instead: a wait too long for the clock means "as long as the clock can
//! say" ([`MAX_WAIT`]), which no process outlives.

use std::time::{Duration, Instant};

/// The longest wait a deadline stands for: 100 years. Longer waits (up to `Duration::MAX`)
/// are cut to it, which changes nothing a running process can observe.
pub const MAX_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// The instant `wait` from now, saturating: never panics, whatever the wait.
///
/// ```
/// use std::time::{Duration, Instant};
/// use kv_loader::deadline_after;
/// let soon = deadline_after(Duration::from_millis(10));
/// assert!(soon > Instant::now() - Duration::from_millis(1));
/// let never = deadline_after(Duration::MAX); // no overflow panic
/// assert!(never > Instant::now() + Duration::from_secs(3600 * 24 * 365));
/// ```
pub fn deadline_after(wait: Duration) -> Instant {
    deadline_from(Instant::now(), wait)
}

/// The instant `wait` after `start`, saturating as [`deadline_after`] does.
pub fn deadline_from(start: Instant, wait: Duration) -> Instant {
    let mut wait = wait.min(MAX_WAIT);
    loop {
        // A clock that cannot reach 100 years ahead gets the furthest power-of-two fraction
        // of it that it can; the loop ends at a zero wait, which always fits.
        if let Some(at) = start.checked_add(wait) {
            return at;
        }
        wait /= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_waits_are_exact_and_long_ones_saturate() {
        let t0 = Instant::now();
        assert_eq!(
            deadline_from(t0, Duration::from_secs(5)),
            t0 + Duration::from_secs(5)
        );
        assert_eq!(deadline_from(t0, Duration::ZERO), t0);
        assert_eq!(deadline_from(t0, Duration::MAX), t0 + MAX_WAIT);
        assert_eq!(
            deadline_from(t0, MAX_WAIT + Duration::from_nanos(1)),
            t0 + MAX_WAIT
        );
        // Stacking a saturated deadline's remaining time with another huge wait still holds.
        let far = deadline_after(Duration::MAX);
        let again = deadline_from(far, Duration::MAX);
        assert!(again >= far);
    }
}
