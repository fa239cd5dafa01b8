//! Ranks as threads of one process: one thread per rank, all at once, and a barrier that
//! gives up instead of hanging when a rank failed before reaching it.

use crate::report::panic_msg;

/// Runs `f(rank)` on one thread per rank, all at once, and returns every rank's result in
/// rank order (a panicking rank gives an `Err`).
pub fn on_ranks<T, F>(n: usize, f: F) -> Vec<Result<T, String>>
where
    T: Send,
    F: Fn(usize) -> Result<T, String> + Sync,
{
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                std::thread::Builder::new()
                    .name(format!("tp_gpu-r{r}"))
                    .spawn_scoped(s, move || f(r))
            })
            .collect();
        hs.into_iter()
            .map(|h| match h {
                Ok(h) => h
                    .join()
                    .unwrap_or_else(|p| Err(format!("rank thread panicked: {}", panic_msg(&*p)))),
                Err(e) => Err(format!("spawning a rank thread: {e}")),
            })
            .collect()
    })
}

/// Every rank's `Ok`, or the first error prefixed with its rank.
pub fn all_ok<T>(v: Vec<Result<T, String>>) -> Result<Vec<T>, String> {
    v.into_iter()
        .enumerate()
        .map(|(r, x)| x.map_err(|e| format!("rank {r}: {e}")))
        .collect()
}

/// A barrier whose wait gives up after a timeout, so that a rank that failed before reaching
/// it (and so never arrives) makes the others fail instead of hang. A wait that times out
/// breaks the barrier: every rank waiting then, and every later wait, fails at once, so a
/// rank that arrives late never passes it alone.
///
/// ```
/// use kvlink_rig::ranks::TimedBarrier;
/// use std::time::Duration;
/// let b = TimedBarrier::new(2);
/// assert!(b.wait(Duration::from_millis(10)).is_err(), "the other rank never came");
/// assert!(b.wait(Duration::from_secs(1)).is_err(), "broken for good");
/// ```
pub struct TimedBarrier {
    n: usize,
    state: std::sync::Mutex<BarrierState>,
    cv: std::sync::Condvar,
}

#[derive(Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: bool,
}

impl TimedBarrier {
    /// A barrier for `n` ranks.
    pub fn new(n: usize) -> Self {
        TimedBarrier {
            n,
            state: std::sync::Mutex::new(BarrierState::default()),
            cv: std::sync::Condvar::new(),
        }
    }

    /// Waits until all `n` ranks arrived, or `Err` after `timeout` (which breaks the
    /// barrier) or at once when it is broken.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<(), String> {
        let broken = || "the barrier broke: a rank timed out waiting at it".to_string();
        let mut s = self.state.lock().map_err(|_| "barrier poisoned")?;
        if s.broken {
            return Err(broken());
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.n {
            s.arrived = 0;
            s.generation += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let (mut s, _) = self
            .cv
            .wait_timeout_while(s, timeout, |s| s.generation == generation && !s.broken)
            .map_err(|_| "barrier poisoned")?;
        if s.generation != generation {
            return Ok(());
        }
        if s.broken {
            return Err(broken());
        }
        s.broken = true;
        self.cv.notify_all();
        Err(format!(
            "a peer rank did not arrive within {timeout:?} (it failed earlier)"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::TimedBarrier;
    use std::time::Duration;

    #[test]
    fn ranks_that_all_arrive_pass_again_and_again() {
        let b = TimedBarrier::new(3);
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|_| s.spawn(|| (0..20).all(|_| b.wait(Duration::from_secs(10)).is_ok())))
                .collect();
            assert!(hs.into_iter().all(|h| h.join().unwrap()));
        });
    }

    #[test]
    fn a_rank_arriving_after_a_timeout_does_not_pass_alone() {
        // One rank times out (its peer failed); before, its arrival stayed counted, so the
        // peer arriving late completed the barrier alone and went on into a collective.
        let b = TimedBarrier::new(2);
        assert!(b.wait(Duration::from_millis(20)).is_err());
        assert!(
            b.wait(Duration::from_secs(5)).is_err(),
            "broken, not completed"
        );
    }
}
