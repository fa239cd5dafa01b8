//! A batch's preflight: the checks that run on helper threads beside the reader's first
//! reads, and the point of the batch each one must have passed by.
//!
//! - **The checksum companions** are read before the first group is handed over: no layer
//!   arrives before its checksums.
//! - **The object sizes** (when `verify_object_sizes`) are one master query per key (Mooncake
//!   has no batched size query), the slowest store work before layer 0. Where every object
//!   this rank reads has a companion, each layer's bytes are checked against their checksums
//!   anyway, so the sizes need not hold layer 0 back: they start once the first group is read
//!   (their queries do not slow it; beside it when it is the only group), and their verdict is taken as soon as it is in (checked
//!   between groups) and at the latest before the last group is handed over, so a batch with a
//!   wrong-sized object still never completes. Where some object has no
//!   companion (checksums off, or objects another writer saved), the sizes are what guards
//!   its bytes, and they are checked before the first group, as the companions are.
//!
//! Every verdict is waited for only until a bound the reader gives (see
//! [`PreflightChecks::due`]): the TP peers wait for this rank's next status word no longer
//! than their collective timeout, so a check still running on a hung store fails the batch
//! here in time (or, after a failed read, leaves the read's own error standing) and every
//! rank reads the failure from the status word instead of timing out and re-forming the group.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::thread::{Scope, ScopedJoinHandle};
use std::time::Instant;

use kv_loader::{BatchId, KvLoadError, StoreFailure};
use parking_lot::Mutex;
use tracing::debug;

/// One preflight check running on a helper thread (or already done inline, when no thread
/// could be started), joined once.
pub(crate) struct Check<'scope> {
    state: CheckState<'scope>,
    batch: BatchId,
    what: &'static str,
}

enum CheckState<'scope> {
    /// On its thread; `finished` hangs up when the check returns (or unwinds).
    Running {
        handle: ScopedJoinHandle<'scope, Result<(), KvLoadError>>,
        finished: Receiver<()>,
    },
    Done(Result<(), KvLoadError>),
    Taken,
}

impl Drop for Check<'_> {
    /// A check whose verdict was not taken (the batch failed, or a bound passed) is joined
    /// here, its verdict dropped: every check ends before the reader's scope does, and a
    /// panic in one stays in it.
    fn drop(&mut self) {
        if let CheckState::Running { handle, .. } =
            std::mem::replace(&mut self.state, CheckState::Taken)
        {
            let _ = handle.join();
        }
    }
}

impl<'scope> Check<'scope> {
    /// Runs `check` on a thread named `name` in `scope`; inline if no thread can be started.
    /// `check` is told which (`true`: on its own thread), so that inline it waits for nothing
    /// that only the rest of the batch, which it now holds back, would bring.
    pub(crate) fn spawn<'env, F>(
        scope: &'scope Scope<'scope, 'env>,
        name: String,
        batch: BatchId,
        what: &'static str,
        check: F,
    ) -> Self
    where
        F: FnOnce(bool) -> Result<(), KvLoadError> + Send + 'scope,
    {
        // The closure goes to the thread, or stays here when none starts.
        let cell = Arc::new(Mutex::new(Some(check)));
        let theirs = cell.clone();
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let run = move || {
            // Dropped when the check returns or unwinds: a bounded wait wakes then.
            let _done = done;
            match theirs.lock().take() {
                Some(check) => check(true),
                None => Ok(()),
            }
        };
        let state = match std::thread::Builder::new()
            .name(name)
            .spawn_scoped(scope, run)
        {
            Ok(handle) => CheckState::Running { handle, finished },
            Err(_) => match cell.lock().take() {
                Some(check) => return Self::inline(batch, what, check),
                None => CheckState::Taken,
            },
        };
        Check { state, batch, what }
    }

    /// Runs `check` here, now (told it is not on a thread of its own).
    fn inline<F>(batch: BatchId, what: &'static str, check: F) -> Self
    where
        F: FnOnce(bool) -> Result<(), KvLoadError>,
    {
        Check {
            state: CheckState::Done(check(false)),
            batch,
            what,
        }
    }

    /// A check with nothing to do.
    pub(crate) fn passed(batch: BatchId, what: &'static str) -> Self {
        Check {
            state: CheckState::Taken,
            batch,
            what,
        }
    }

    /// Whether the verdict is in (waiting for it would not block).
    pub(crate) fn is_done(&self) -> bool {
        match &self.state {
            CheckState::Running { handle, .. } => handle.is_finished(),
            CheckState::Done(_) | CheckState::Taken => true,
        }
    }

    /// The verdict, waiting for it if need be; `Ok` once it was taken. A check that panicked
    /// fails the batch.
    pub(crate) fn verdict(&mut self) -> Result<(), KvLoadError> {
        match std::mem::replace(&mut self.state, CheckState::Taken) {
            CheckState::Running { handle, .. } => handle.join().unwrap_or_else(|payload| {
                let what = kv_loader::Cause::from_panic(payload.as_ref());
                Err(KvLoadError::internal(
                    self.batch,
                    what.context(format!("the preflight's {} check panicked", self.what)),
                ))
            }),
            CheckState::Done(r) => r,
            CheckState::Taken => Ok(()),
        }
    }

    /// The verdict if it is in by `by` (waiting until then at most; `Ok` once it was taken),
    /// or `None`: the check runs on, its verdict is left for a later call.
    pub(crate) fn verdict_by(&mut self, by: Instant) -> Option<Result<(), KvLoadError>> {
        if let CheckState::Running { finished, .. } = &self.state {
            let left = by.saturating_duration_since(Instant::now());
            if let Err(RecvTimeoutError::Timeout) = finished.recv_timeout(left) {
                return None;
            }
        }
        // Finished (or never on a thread): joining does not block.
        Some(self.verdict())
    }

    /// [`verdict_by`](Self::verdict_by), a verdict not in by `by` failing the batch (the
    /// check runs on; its verdict is never taken).
    fn required_by(&mut self, by: Instant) -> Result<(), KvLoadError> {
        self.verdict_by(by).unwrap_or_else(|| {
            Err(KvLoadError::Store {
                batch: Some(self.batch),
                layer: None,
                pages: Vec::new().into(),
                kind: StoreFailure::RpcTimeout,
                detail: format!(
                    "the preflight's {} check did not end in time: the TP peers wait no \
                     longer for this rank's next layer",
                    self.what
                )
                .into(),
            })
        })
    }
}

/// When the reader takes the preflight's verdicts: the companions before the first group;
/// the sizes before the first group too unless every object has a companion, else as soon
/// as they are in and at the latest before the last group.
pub(crate) struct PreflightChecks<'scope> {
    /// The checksum companions.
    pub(crate) companions: Check<'scope>,
    /// The object sizes.
    pub(crate) sizes: Check<'scope>,
    /// Every object this rank reads has a companion (its bytes are checked per layer): set by
    /// the companions' check before it ends, read once its verdict is taken.
    pub(crate) covered: &'scope AtomicBool,
    /// Dropped once the first group is read: a size check that need not hold layer 0 back
    /// waits for it, so that its queries do not slow layer 0's read.
    pub(crate) first_read: Option<std::sync::mpsc::Sender<()>>,
}

impl Drop for PreflightChecks<'_> {
    /// The first read's sender goes before the checks are joined (fields drop in order, the
    /// sizes before `first_read`): a size check still waiting for the first read, when the
    /// reader left before it, starts at once instead of waiting out `layer_read_timeout`.
    fn drop(&mut self) {
        self.first_read.take();
    }
}

impl PreflightChecks<'_> {
    /// The verdicts due before handing over group `index` of `groups`, waited for until `by`
    /// at most (in a TP group: when the peers stop waiting for this group's first status
    /// word, less a margin; alone: when the checks' own store calls are over). A verdict the
    /// group needs that is not in by then fails the batch ([`StoreFailure::RpcTimeout`]).
    /// When the group's read failed (`read_failed`) the sizes, and on the first group the
    /// companions, are taken if they come in by `by` and name a bad object (a wrong-sized
    /// object explains a failed read better than the read does: [`names_an_object`]), else
    /// the read's error stands (a size query that merely failed says less than the read). The companions' error comes first:
    /// a companion that does not fit checks its object's size itself, and says
    /// [`PlanError::ObjectSize`](kv_loader::PlanError::ObjectSize) when that is why.
    pub(crate) fn due(
        &mut self,
        index: usize,
        groups: usize,
        read_failed: bool,
        by: Instant,
    ) -> Result<(), KvLoadError> {
        let first = index == 0;
        let last = index + 1 >= groups;
        // The first group is read (the reader asks for its verdicts right after the read).
        self.first_read.take();
        // After a failed read a verdict is taken only if it comes in by the bound (then it
        // says more than the read); else the read's own error stands.
        let companions = match (first, read_failed) {
            (false, _) => Ok(()),
            (true, true) => says_more(self.companions.verdict_by(by)),
            (true, false) => self.companions.required_by(by),
        };
        // Known once the companions' verdict is in (from the first group on, unless it
        // was not in time, and then the batch has failed).
        let covered = self.covered.load(Ordering::Acquire);
        let sizes = if read_failed {
            says_more(self.sizes.verdict_by(by))
        } else if (first && !covered) || last {
            self.sizes.required_by(by)
        } else if self.sizes.is_done() {
            self.sizes.verdict()
        } else {
            Ok(())
        };
        companions.and(sizes)
    }
}

/// A verdict taken after a failed read (`None`: not in by the bound): its failure when it
/// names a bad object, else `Ok` (the read's own error stands).
fn says_more(verdict: Option<Result<(), KvLoadError>>) -> Result<(), KvLoadError> {
    match verdict {
        Some(Err(e)) if names_an_object(&e) => Err(e),
        Some(Err(e)) => {
            debug!(error = %e, "preflight failure after a failed read: the read's error stands");
            Ok(())
        }
        Some(Ok(())) | None => Ok(()),
    }
}

/// Whether `e` says an object is bad (wrong-sized, or failing its checksum companion): that
/// explains a failed read of it better than the read's own error.
pub(crate) fn names_an_object(e: &KvLoadError) -> bool {
    matches!(
        e,
        KvLoadError::InvalidPlan {
            reason: kv_loader::PlanError::ObjectSize { .. },
            ..
        } | KvLoadError::BadObject { .. }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wrong_size() -> Result<(), KvLoadError> {
        Err(KvLoadError::InvalidPlan {
            batch: BatchId(1),
            reason: kv_loader::PlanError::ObjectSize {
                key: "k".into(),
                expected: 2,
                actual: 1,
            },
        })
    }

    static COVERED: AtomicBool = AtomicBool::new(true);

    fn failed(what: &str) -> Result<(), KvLoadError> {
        Err(KvLoadError::config(what))
    }

    /// A bound no check here comes near.
    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    /// A check that runs until `gate` is set (10 s at most), then fails with `what`.
    fn held<'a>(
        gate: &'a AtomicBool,
        what: &'static str,
    ) -> impl FnOnce(bool) -> Result<(), KvLoadError> + 'a {
        move |_| {
            let limit = Instant::now() + Duration::from_secs(10);
            while !gate.load(Ordering::Acquire) && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(1));
            }
            failed(what)
        }
    }

    fn timed_out(r: Result<(), KvLoadError>, what: &str) -> bool {
        matches!(r, Err(KvLoadError::Store { kind: StoreFailure::RpcTimeout, ref detail, .. })
            if detail.to_string().contains(what))
    }

    #[test]
    fn covered_sizes_hold_back_only_the_last_group() {
        let release = AtomicBool::new(false);
        std::thread::scope(|s| {
            let slow_sizes = |_| {
                let limit = Instant::now() + Duration::from_secs(10);
                while !release.load(Ordering::Acquire) && Instant::now() < limit {
                    std::thread::sleep(Duration::from_millis(1));
                }
                failed("wrong size")
            };
            let mut checks = PreflightChecks {
                companions: Check::spawn(s, "c".into(), BatchId(1), "companions", |_| Ok(())),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", slow_sizes),
                covered: &COVERED,
                first_read: None,
            };
            // The first and a middle group pass while the sizes are still being checked.
            assert!(checks.due(0, 3, false, far()).is_ok());
            assert!(checks.due(1, 3, false, far()).is_ok());
            release.store(true, Ordering::Release);
            // The last group waits for them and fails.
            assert!(
                matches!(checks.due(2, 3, false, far()), Err(KvLoadError::Config(m)) if m.detail() == "wrong size")
            );
        });
    }

    #[test]
    fn uncovered_sizes_hold_back_the_first_group() {
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::spawn(s, "c".into(), BatchId(1), "companions", |_| {
                    failed("bad companion")
                }),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", |_| failed("wrong size")),
                covered: &AtomicBool::new(false),
                first_read: None,
            };
            assert!(
                matches!(checks.due(0, 2, false, far()), Err(KvLoadError::Config(m)) if m.detail() == "bad companion")
            );
            // Both were taken (each once).
            assert!(checks.sizes.is_done() && checks.due(1, 2, false, far()).is_ok());
        });
    }

    #[test]
    fn a_finished_size_check_is_taken_at_once() {
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::passed(BatchId(1), "companions"),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", |_| failed("wrong size")),
                covered: &COVERED,
                first_read: None,
            };
            let limit = Instant::now() + Duration::from_secs(10);
            while !checks.sizes.is_done() && Instant::now() < limit {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert!(
                checks.due(0, 5, false, far()).is_err(),
                "taken as soon as it is in"
            );
            assert!(checks.due(1, 5, false, far()).is_ok(), "taken once");
        });
    }

    #[test]
    fn a_failed_read_leaves_sizes_still_running_at_the_bound_behind() {
        let gate = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::passed(BatchId(1), "companions"),
                sizes: Check::spawn(
                    s,
                    "s".into(),
                    BatchId(1),
                    "sizes",
                    held(&gate, "wrong size"),
                ),
                covered: &COVERED,
                first_read: None,
            };
            let t0 = Instant::now();
            let by = t0 + Duration::from_millis(100);
            // The read's own error stands: the group is handed over at the bound.
            assert!(checks.due(1, 5, true, by).is_ok());
            let took = t0.elapsed();
            assert!(
                took >= Duration::from_millis(100),
                "waited until the bound: {took:?}"
            );
            assert!(took < Duration::from_secs(5), "not for the check: {took:?}");
            gate.store(true, Ordering::Release);
            // Not taken: the last group still needs it, and gets it.
            let last = checks.due(4, 5, false, far());
            assert!(matches!(last, Err(KvLoadError::Config(m)) if m.detail() == "wrong size"));
        });
    }

    #[test]
    fn a_failed_last_or_first_read_keeps_its_error_over_checks_still_running() {
        let gate = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::spawn(s, "c".into(), BatchId(1), "companions", held(&gate, "c")),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", held(&gate, "s")),
                covered: &AtomicBool::new(false),
                first_read: None,
            };
            // The only group is both first and last; its read failed; neither check is in.
            let by = Instant::now() + Duration::from_millis(50);
            assert!(
                checks.due(0, 1, true, by).is_ok(),
                "the read's error stands"
            );
            gate.store(true, Ordering::Release);
        });
    }

    #[test]
    fn companions_not_read_by_the_bound_fail_the_first_group() {
        let gate = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::spawn(
                    s,
                    "c".into(),
                    BatchId(1),
                    "checksum companion",
                    held(&gate, "late"),
                ),
                sizes: Check::passed(BatchId(1), "sizes"),
                covered: &AtomicBool::new(false),
                first_read: None,
            };
            let t0 = Instant::now();
            let r = checks.due(0, 3, false, t0 + Duration::from_millis(100));
            assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
            assert!(
                timed_out(r, "checksum companion"),
                "a timeout naming the check"
            );
            gate.store(true, Ordering::Release);
        });
    }

    #[test]
    fn sizes_not_in_by_the_last_groups_bound_fail_it() {
        let gate = AtomicBool::new(false);
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::passed(BatchId(1), "companions"),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "object size", held(&gate, "x")),
                covered: &COVERED,
                first_read: None,
            };
            assert!(
                checks.due(0, 2, false, far()).is_ok(),
                "covered: not needed yet"
            );
            let r = checks.due(1, 2, false, Instant::now() + Duration::from_millis(50));
            assert!(timed_out(r, "object size"));
            gate.store(true, Ordering::Release);
        });
    }

    #[test]
    fn a_failed_read_takes_sizes_that_come_in_by_the_bound() {
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::passed(BatchId(1), "companions"),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", |_| {
                    std::thread::sleep(Duration::from_millis(50));
                    wrong_size()
                }),
                covered: &COVERED,
                first_read: None,
            };
            assert!(names_an_object(&checks.due(1, 5, true, far()).unwrap_err()));
        });
    }

    /// Before, any failure of the checks replaced a failed read's error: a size query that
    /// timed out turned a short read at layer 0 into an RPC timeout at no layer.
    #[test]
    fn a_failed_read_keeps_its_error_over_checks_that_merely_failed() {
        std::thread::scope(|s| {
            let mut checks = PreflightChecks {
                companions: Check::spawn(s, "c".into(), BatchId(1), "companions", |_| {
                    failed("companion read failed")
                }),
                sizes: Check::spawn(s, "s".into(), BatchId(1), "sizes", |_| {
                    failed("size query failed")
                }),
                covered: &COVERED,
                first_read: None,
            };
            assert!(
                checks.due(0, 2, true, far()).is_ok(),
                "the read's error stands"
            );
        });
    }

    #[test]
    fn the_first_groups_verdicts_say_it_was_read() {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let mut checks = PreflightChecks {
            companions: Check::passed(BatchId(1), "companions"),
            sizes: Check::passed(BatchId(1), "sizes"),
            covered: &COVERED,
            first_read: Some(tx),
        };
        assert!(rx.try_recv().is_err() && checks.first_read.is_some());
        checks.due(0, 3, false, far()).unwrap();
        // The sender is gone: a size check waiting for the first read goes on.
        assert!(matches!(
            rx.recv_timeout(Duration::from_secs(5)),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected)
        ));
    }

    #[test]
    fn a_check_is_told_whether_it_runs_on_its_own_thread() {
        std::thread::scope(|s| {
            let mut on = Check::spawn(s, "t".into(), BatchId(1), "sizes", |on_thread| {
                if on_thread {
                    Ok(())
                } else {
                    failed("inline")
                }
            });
            assert!(on.verdict().is_ok(), "spawned: on its own thread");
        });
        let mut here = Check::inline(BatchId(1), "sizes", |on_thread| {
            if on_thread {
                failed("on a thread")
            } else {
                Ok(())
            }
        });
        assert!(
            here.is_done() && here.verdict().is_ok(),
            "inline: told so, done at once"
        );
    }

    #[test]
    fn a_panicking_check_fails_the_batch() {
        std::thread::scope(|s| {
            let mut c = Check::spawn(s, "p".into(), BatchId(4), "sizes", |_| -> Result<(), _> {
                panic!("boom")
            });
            let e = c.verdict().unwrap_err();
            assert!(matches!(e, KvLoadError::Internal { .. }), "{e}");
            assert!(e.to_string().contains("sizes check panicked: boom"), "{e}");
        });
    }
}
