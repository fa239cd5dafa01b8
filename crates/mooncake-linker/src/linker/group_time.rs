//! The group's time of a batch, for `Auto`: the slowest rank's, since an engine's forward
//! waits for every rank. A rank knows only its own time when its batch ends, so it keeps it
//! as a pending sample; its next gate word on the same handle carries it
//! (`GateWord::last_batch_us`), and once that gate is in step every rank has every rank's time
//! and records the maximum. A sample travels only in the gate right after its own batch's, on
//! the same data handle: a batch that failed, was refused or was cancelled leaves none, and a
//! group re-formed in between (a new handle epoch) drops it.

use std::time::Duration;

use kv_loader::ShareMode;

/// One batch this rank loaded with the group: its mode, the bytes it landed and its time from
/// the batch's gate until the rank was done with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchSample {
    pub(crate) mode: ShareMode,
    pub(crate) landed: u64,
    pub(crate) took: Duration,
}

impl BatchSample {
    /// What this rank's gate word carries: the time in whole microseconds, saturated at
    /// `u32::MAX` and at least 1 (0 says "no sample").
    pub(crate) fn word_us(&self) -> u32 {
        u32::try_from(self.took.as_micros())
            .unwrap_or(u32::MAX)
            .max(1)
    }
}

/// The group's time of a batch from every rank's word (in rank order): the slowest rank's,
/// when every rank sent a sample; `None` when any rank sent none (its batch failed, or its
/// sample was stale), since the slowest rank may be the one missing.
pub(crate) fn group_time(every_rank: &[u32]) -> Option<Duration> {
    if every_rank.contains(&0) {
        return None;
    }
    every_rank
        .iter()
        .max()
        .map(|&us| Duration::from_micros(u64::from(us)))
}

/// The sample of this rank's last batch, waiting for its next gate.
#[derive(Debug, Default)]
pub(crate) struct PendingSample {
    waiting: Option<Waiting>,
}

/// A sample and the gate of its batch.
#[derive(Debug)]
struct Waiting {
    /// The data handle's formation epoch.
    epoch: u64,
    /// The number of the batch's gate on that handle.
    gate: u64,
    sample: BatchSample,
}

impl PendingSample {
    /// The batch gated as gate `gate` on the handle of `epoch` ended well: its sample waits
    /// for the next gate (replacing any older one).
    pub(crate) fn record(&mut self, epoch: u64, gate: u64, sample: BatchSample) {
        self.waiting = Some(Waiting {
            epoch,
            gate,
            sample,
        });
    }

    /// The last batch left no sample (it failed, or loaded without the group).
    pub(crate) fn clear(&mut self) {
        self.waiting = None;
    }

    /// Takes the sample out for gate `gate` on the handle of `epoch`: the sample, when its
    /// batch's gate was the one just before on the same handle; `None` (and the sample is
    /// dropped) otherwise. Every gate takes it, so it is sent at most once.
    pub(crate) fn take_for(&mut self, epoch: u64, gate: u64) -> Option<BatchSample> {
        let w = self.waiting.take()?;
        let next = w.gate.checked_add(1);
        if w.epoch == epoch && next == Some(gate) {
            return Some(w.sample);
        }
        tracing::debug!(
            sample_epoch = w.epoch,
            sample_gate = w.gate,
            epoch,
            gate,
            "Auto: the last batch's time is stale (the group was re-formed or gated between): dropped"
        );
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(ms: u64) -> BatchSample {
        BatchSample {
            mode: ShareMode::Rank0Broadcast,
            landed: 8 << 20,
            took: Duration::from_millis(ms),
        }
    }

    #[test]
    fn the_next_gate_on_the_same_handle_takes_the_sample_once() {
        let mut p = PendingSample::default();
        assert_eq!(p.take_for(1, 0), None, "nothing recorded yet");
        p.record(1, 4, sample(250));
        let s = p.take_for(1, 5).expect("the gate right after");
        assert_eq!(s, sample(250));
        assert_eq!(s.word_us(), 250_000);
        assert_eq!(p.take_for(1, 6), None, "sent once");
    }

    #[test]
    fn a_new_epoch_or_a_gate_in_between_drops_the_sample() {
        let mut p = PendingSample::default();
        p.record(1, 4, sample(250));
        assert_eq!(p.take_for(2, 0), None, "the group was re-formed");
        assert_eq!(p.take_for(2, 1), None, "and it is gone");
        p.record(2, 1, sample(250));
        assert_eq!(p.take_for(2, 3), None, "gate 2 was held without it");
        p.record(2, 3, sample(250));
        assert_eq!(p.take_for(3, 4), None, "same number, other epoch");
        p.record(2, u64::MAX, sample(250));
        assert_eq!(p.take_for(2, 0), None, "no wrap-around");
    }

    #[test]
    fn a_failed_batch_clears_the_sample() {
        let mut p = PendingSample::default();
        p.record(1, 0, sample(250));
        p.clear();
        assert_eq!(p.take_for(1, 1), None);
    }

    #[test]
    fn the_group_time_is_the_slowest_ranks_when_every_rank_has_one() {
        assert_eq!(
            group_time(&[250_000, 900_000, 300_000]),
            Some(Duration::from_millis(900))
        );
        assert_eq!(group_time(&[250_000, 0, 300_000]), None);
        assert_eq!(group_time(&[0]), None);
    }

    #[test]
    fn the_word_value_is_never_zero_and_saturates() {
        let at = |took| BatchSample { took, ..sample(0) }.word_us();
        assert_eq!(at(Duration::ZERO), 1);
        assert_eq!(at(Duration::from_nanos(400)), 1);
        assert_eq!(at(Duration::from_micros(7)), 7);
        assert_eq!(at(Duration::from_secs(5_000)), u32::MAX);
        assert_eq!(at(Duration::MAX), u32::MAX);
    }
}
