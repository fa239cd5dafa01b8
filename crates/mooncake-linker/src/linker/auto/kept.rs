//! A kept mode that goes bad (the module docs of `auto`): after [`AUTO_KEPT_STRIKES`] of its
//! batches failed in a row, one batch probes another mode; a probe that loads makes the kept
//! mode's next failure its own.
//!
//! [`AUTO_KEPT_STRIKES`]: super::AUTO_KEPT_STRIKES

use kv_loader::ShareMode;

use super::measured::{slot, Measured, AUTO_MODES};

impl Measured {
    /// A batch of `mode` loaded (as it ends, whether or not its time is measured): while a
    /// mode is kept, the kept mode's batch clears its failures, and a probe's says the kept
    /// mode's failures are its own (see [`kept_failure`](Self::kept_failure)).
    pub(crate) fn record_loaded(&mut self, mode: ShareMode) {
        self.parole();
        let Some(k) = self.kept else {
            return;
        };
        if mode == k {
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.probe_failed = [false; ShareMode::COUNT];
        } else if self.kept_failing > 0 {
            self.probe_loaded = true;
        }
    }

    /// A batch of `mode` failed while `k` is kept: the kept mode's count goes up, and it fails
    /// on its own account when a probe loaded since its last batch; a probe that fails clears
    /// the count (the store or the group fails every mode).
    pub(super) fn kept_failure(&mut self, k: ShareMode, mode: ShareMode) {
        if mode != k {
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.probe_failed[slot(mode)] = true;
            return;
        }
        self.kept_failing = self.kept_failing.saturating_add(1);
        if self.probe_loaded {
            self.fail_out(k);
            self.kept = None;
            self.kept_failing = 0;
            self.probe_loaded = false;
            self.suspect = None;
            self.last_failed = None;
            // A fresh patience for the measuring that resumes.
            self.proposals = 0;
        }
    }

    /// The mode a probe runs in while the kept mode `k` fails: of the other modes not failed
    /// out, those whose probe has not failed since `k` last loaded (all of them again once
    /// every one's has), the fastest measured, else the first (`None`: no other mode).
    pub(super) fn probe_for(&self, k: ShareMode) -> Option<ShareMode> {
        let others = |untried: bool| {
            AUTO_MODES.into_iter().filter(move |m| {
                *m != k && !self.failed_out[slot(*m)] && !(untried && self.probe_failed[slot(*m)])
            })
        };
        let fastest = |untried: bool| {
            others(untried)
                .filter_map(|m| self.median(m).map(|t| (m, t)))
                .min_by(|a, b| a.1.total_cmp(&b.1))
                .map(|(m, _)| m)
                .or_else(|| others(untried).next())
        };
        fastest(true).or_else(|| fastest(false))
    }
}
