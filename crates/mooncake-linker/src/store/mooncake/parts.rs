//! One store call split into parts that run at once: the read streams of a ranged read, the
//! size queries of a large batch. A part's thread is started where the system gives one and
//! the part runs on the caller's thread where it does not, so a call never fails, or panics,
//! for want of a thread; a part that panicked (on its own thread or on the caller's) gets its
//! keys' errors, not the caller's panic.

use tracing::warn;

/// Runs `work` on every part, the first on this thread and each other on a scoped thread of
/// its own (on this thread, after the first, when no thread can be started), and returns the
/// results in part order. A part that panicked gets `panicked(part)`, wherever it ran.
pub(super) fn run_parts<P: Sync, R: Send>(
    what: &'static str,
    parts: &[P],
    work: impl Fn(&P) -> R + Sync,
    panicked: impl Fn(&P) -> R,
) -> Vec<R> {
    let Some((first, rest)) = parts.split_first() else {
        return Vec::new();
    };
    // A part run on this thread: its panic is its result too, as on a thread of its own.
    let here = |p: &P| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(p))).unwrap_or_else(|_| {
            warn!(part = what, "a part panicked on the caller's thread");
            panicked(p)
        })
    };
    if rest.is_empty() {
        return vec![here(first)];
    }
    let work = &work;
    std::thread::scope(|s| {
        let started: Vec<_> = rest
            .iter()
            .map(|p| {
                std::thread::Builder::new()
                    .name(format!("kvlink-{what}"))
                    .spawn_scoped(s, move || work(p))
                    .map_err(|e| {
                        warn!(part = what, error = %e, "no thread for a part: it runs on the caller's");
                    })
                    .ok()
            })
            .collect();
        let mut out = Vec::with_capacity(parts.len());
        out.push(here(first));
        for (p, h) in rest.iter().zip(started) {
            out.push(match h {
                Some(h) => h.join().unwrap_or_else(|_| panicked(p)),
                None => here(p),
            });
        }
        out
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_part_runs_once_and_the_results_come_in_part_order() {
        let runs = AtomicUsize::new(0);
        let parts: Vec<std::ops::Range<u32>> = vec![0..10, 10..11, 11..40, 40..41, 41..100];
        let sums = run_parts(
            "sum",
            &parts,
            |r| {
                runs.fetch_add(1, Ordering::Relaxed);
                r.clone().sum::<u32>()
            },
            |_| u32::MAX,
        );
        let want: Vec<u32> = parts.iter().map(|r| r.clone().sum()).collect();
        assert_eq!(sums, want);
        assert_eq!(runs.load(Ordering::Relaxed), parts.len());
        assert!(run_parts("none", &[] as &[u32], |_| 1, |_| 0).is_empty());
        assert_eq!(run_parts("one", &[7u32], |p| p + 1, |_| 0), [8]);
    }

    #[test]
    fn a_part_whose_thread_panics_gets_its_own_error_and_the_others_their_results() {
        // The panic of the middle part (on a thread of its own) is its result, not the
        // caller's: the parts before and after it keep theirs.
        let out = run_parts(
            "panics",
            &[1u32, 2, 3],
            |&p| {
                if p == 2 {
                    panic!("part 2 fails");
                }
                Ok(p)
            },
            |&p| Err(p),
        );
        assert_eq!(out, [Ok(1), Err(2), Ok(3)]);
    }

    #[test]
    fn a_part_that_panics_on_the_callers_thread_gets_its_own_error_too() {
        // The first part runs on the caller's thread: its panic does not unwind the call (it
        // used to, taking every other part's results with it).
        let work = |&p: &u32| {
            if p == 1 {
                panic!("part 1 fails");
            }
            Ok(p)
        };
        assert_eq!(
            run_parts("first", &[1u32, 2], work, |&p| Err(p)),
            [Err(1), Ok(2)]
        );
        assert_eq!(run_parts("only", &[1u32], work, |&p| Err(p)), [Err(1)]);
    }
}
