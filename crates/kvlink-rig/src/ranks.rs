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
/// it (and so never arrives) makes the others fail instead of hang.
pub struct TimedBarrier {
    n: usize,
    state: std::sync::Mutex<(usize, u64)>,
    cv: std::sync::Condvar,
}

impl TimedBarrier {
    /// A barrier for `n` ranks.
    pub fn new(n: usize) -> Self {
        TimedBarrier {
            n,
            state: std::sync::Mutex::new((0, 0)),
            cv: std::sync::Condvar::new(),
        }
    }

    /// Waits until all `n` ranks arrived, or `Err` after `timeout`.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<(), String> {
        let mut s = self.state.lock().map_err(|_| "barrier poisoned")?;
        let generation = s.1;
        s.0 += 1;
        if s.0 == self.n {
            s.0 = 0;
            s.1 += 1;
            self.cv.notify_all();
            return Ok(());
        }
        let (s, r) = self
            .cv
            .wait_timeout_while(s, timeout, |s| s.1 == generation)
            .map_err(|_| "barrier poisoned")?;
        if r.timed_out() && s.1 == generation {
            return Err(format!(
                "a peer rank did not arrive within {timeout:?} (it failed earlier)"
            ));
        }
        Ok(())
    }
}
