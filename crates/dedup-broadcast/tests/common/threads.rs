//! Ranks as threads of one test.

use std::thread;
use std::time::{Duration, Instant};

/// A deadline no healthy operation of these tests comes near (a minute away).
pub fn far() -> Instant {
    kv_loader::deadline_after(Duration::from_secs(60))
}

/// Runs `f` on every rank of `ranks`, one thread each; results in rank order. A rank that
/// panics fails the test.
pub fn on_threads<C: Sync, T: Send>(ranks: &[C], f: impl Fn(&C) -> T + Sync) -> Vec<T> {
    let f = &f;
    thread::scope(|s| {
        let hs: Vec<_> = ranks.iter().map(|c| s.spawn(move || f(c))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank panicked"))
            .collect()
    })
}
