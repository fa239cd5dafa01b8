//! The load thread's part of a batch: per layer, this rank's check of what it read, the status
//! exchange, then the share step, landing and publishing; after the last layer, the verdict
//! (see the [pipeline](super) docs for the protocol and its bounds).

use std::time::{Duration, Instant};

use dedup_broadcast::{GroupStatus, LayerStatus};
use kv_device::LayerStage;
use kv_loader::{BatchId, KvLoadError, StoreFailure};
use tracing::{debug, warn};

use super::{alone_verdicts_bound, check_bound, reader_bound, LayerPipeline, ReadLayer};
use crate::linker::batch::collective_failure;
use crate::linker::handoff::{Handoff, Wait};
use crate::linker::share::{step_for, LayerCx, ShareStep, StepError};
use crate::linker::verify::LayerCheck;
use crate::log_every::LogEvery;

/// The group's failure of a batch, on rank `rank` whose own failure was `own`: a
/// `PeerFailed` naming this rank carries `own`'s words after its code.
fn with_own_words(group: KvLoadError, rank: u32, own: &KvLoadError) -> KvLoadError {
    match group {
        KvLoadError::PeerFailed {
            batch,
            rank: first,
            layer,
            detail,
        } if first == rank => KvLoadError::PeerFailed {
            batch,
            rank: first,
            layer,
            detail: format!("{detail}: {own}"),
        },
        e => e,
    }
}

/// Logs this rank's own failure of `batch` where the group reports another rank's: the one
/// line at `warn` that names this cause (on no rank else), once a minute per kind (a store
/// down fails every rank's batch alike: one line each was TP - 1 lines a request), at `debug`
/// in between; a cancellation (a request aborted, a reset: the engine's doing) always at
/// `debug`.
fn log_own_beside_the_groups(log: &LogEvery, batch: BatchId, own: &KvLoadError) {
    if matches!(own, KvLoadError::Cancelled { .. }) {
        debug!(%batch, error = %own, "this rank's batch was cancelled (the group reports more)");
        return;
    }
    match log.due_after(&format!("own:{}", own.kind_name())) {
        Some(skipped) => warn!(%batch, error = %own, kind = own.kind_name(), skipped,
            "this rank's own failure of the batch (the group reports another's; `skipped`: \
             failures of this kind at debug since the last such line)"),
        None => debug!(%batch, error = %own, "this rank's own failure of the batch"),
    }
}

/// What the load thread knows of its batch so far, carried from layer to layer.
#[derive(Default)]
struct Progress {
    /// Every rank's status words, as exchanged.
    status: GroupStatus,
    /// This rank's failure of the previous layer's share step, to report next.
    carried: Option<KvLoadError>,
    /// This rank's first failure (what a rank alone reports).
    own: Option<KvLoadError>,
    /// Bytes of the layers landed in this rank's pool.
    landed: u64,
    /// From `start_load` to the first layer published.
    first_layer: Duration,
    /// Time in the share steps (collective, scatter, land), for the read plan.
    share_time: Duration,
    /// When the last status exchange returned: the earliest the peers may begin waiting for
    /// the next layer's status word.
    exchanged_at: Option<Instant>,
}

/// Why the layers stopped before the last.
enum Stop {
    /// A status word was not ok: every rank stops at this layer.
    Group,
    /// A collective failed, a share step's wait ran out, or a layer agreed ok had no stage:
    /// the ranks may no longer be in step on this handle.
    Fatal(KvLoadError),
}

impl LayerPipeline<'_> {
    /// One status word for `layer`: exchanged with the group, or recorded alone.
    fn exchange(
        &self,
        status: &mut GroupStatus,
        layer: u32,
        mine: LayerStatus,
    ) -> Result<(), KvLoadError> {
        let batch = self.job.plan.logical.batch;
        match self.coll {
            Some(c) => {
                let deadline = kv_loader::deadline_after(self.inner.config.collective_timeout);
                // The word after the last layer is the batch's verdict: nothing comes after
                // it to bring a rank that gave up back in step, so it is settled on every rank.
                let exchanged = if layer == self.inner.geometry.num_layers() {
                    status.exchange_verdict_tagged(c, layer, mine, self.tag, deadline)
                } else {
                    status.exchange_tagged(c, layer, mine, self.tag, deadline)
                };
                exchanged
                    .map(drop)
                    .map_err(|e| collective_failure(batch, kv_loader::Cause::from_error(e)))
            }
            None => {
                status.record(layer, &[mine]);
                Ok(())
            }
        }
    }

    /// The layer `layer` message from the reader (bounded); one without a stage, carrying this
    /// rank's error, where none came in time or the reader sent another layer or left.
    ///
    /// In a TP group the wait ends by [`reader_bound`] of `peers_from` (the batch's gate for
    /// layer 0, else the end of the previous layer's status exchange): a rank whose pin or
    /// session renewal, stage opening and read each keep within their own bounds but together
    /// run past what its peers wait then reports a timeout in its status word, which every
    /// rank reads, instead of leaving its peers to time out and abort the group. (A layer that
    /// slow on every rank fails the batch cleanly too, where it could pass before.)
    fn receive(
        &self,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
        layer: u32,
        peers_from: Instant,
    ) -> ReadLayer {
        let batch = self.job.plan.logical.batch;
        let c = &self.inner.config;
        // Before the first group the reader pins the objects (a wait for a lookup's pin under
        // way, a quarter of a store call at most, then one store call) and opens the
        // landing's stages; before a group's read it may renew the read session (one store
        // call); then the read itself (`layer_read_timeout`); the preflight's verdicts are
        // waited for until four fifths of `collective_timeout` after the read's start (the
        // gate, for the first group), or, alone, `alone_verdicts_bound` after the batch's
        // start. One store call more as slack.
        let limit = c
            .layer_read_timeout
            .max(c.collective_timeout)
            .saturating_add(c.collective_timeout)
            .saturating_add(c.store_call_timeout.saturating_mul(2))
            .saturating_add(crate::linker::prefetch::read_ahead_wait(
                c.store_call_timeout,
            ))
            .max(alone_verdicts_bound(c.store_call_timeout).saturating_add(c.store_call_timeout));
        let waited_from = Instant::now();
        let mut deadline = kv_loader::deadline_after(limit);
        if self.coll.is_some() {
            deadline = deadline.min(reader_bound(peers_from, c.collective_timeout));
        }
        let error = match h.next_layer(deadline) {
            Wait::Got(m) if m.layer == layer => return m,
            Wait::Got(m) => KvLoadError::internal(
                batch,
                format!("the reader sent layer {} for layer {layer}", m.layer),
            ),
            Wait::TimedOut => KvLoadError::Store {
                batch: Some(batch),
                layer: Some(layer),
                pages: Vec::new().into(),
                kind: StoreFailure::RpcTimeout,
                detail: format!(
                    "the reader did not finish layer {layer} within {:?}",
                    deadline.saturating_duration_since(waited_from)
                )
                .into(),
            },
            Wait::Closed => KvLoadError::internal(
                batch,
                format!(
                    "the reader stopped before layer {layer}: {}",
                    h.why_reader_stopped()
                        .unwrap_or_else(|| "it gave no reason".into())
                ),
            ),
        };
        ReadLayer {
            layer,
            stage: None,
            error: Some(error),
            landed: None,
        }
    }

    /// The load thread's part: per layer, the status exchange, then the share step, landing and
    /// publishing; then the verdict. Returns (bytes landed, time to the first layer).
    pub(super) fn exchange_loop(
        &self,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
    ) -> Result<(u64, Duration), KvLoadError> {
        let batch = self.job.plan.logical.batch;
        let num_layers = self.inner.geometry.num_layers();
        let step = step_for(self.layers.mode);
        tracing::debug!(%batch, rank = self.layers.rank, mode = ?step.mode(), "exchange loop");
        let mut progress = Progress::default();
        let mut stopped = None;
        for layer in 0..num_layers {
            if let Err(stop) = self.layer_step(h, step, layer, &mut progress) {
                stopped = Some(stop);
                break;
            }
        }
        // The reader's waits end at once; what is left in the hand-off goes with it.
        drop(h.exchange_done());
        if stopped.is_none() && num_layers > 0 {
            // What the next batch's read plan overlaps its reads with, beside the compute.
            self.inner
                .reads
                .observe_share(self.layers.mode, progress.share_time / num_layers);
        }
        self.verdict(progress, stopped)
    }

    /// One layer: receive it from the reader, check it, exchange its status word, and when
    /// every rank is ok, share, land and publish it. A failure of this rank's share step is
    /// carried to the next status word.
    fn layer_step(
        &self,
        h: &Handoff<Option<LayerStage>, ReadLayer>,
        step: &dyn ShareStep,
        layer: u32,
        progress: &mut Progress,
    ) -> Result<(), Stop> {
        let batch = self.job.plan.logical.batch;
        let waited_at = Instant::now();
        let peers_from = progress.exchanged_at.unwrap_or(self.opened);
        let mut read = self.receive(h, layer, peers_from);
        let verify_at = Instant::now();
        let cx = self.landing.map(|landing| LayerCx {
            coll: self.coll,
            landing,
            layout: self.layers.layouts[layer as usize].as_ref(),
            rank: self.layers.rank,
            batch,
            collective_timeout: self.inner.config.collective_timeout,
            auto: &self.inner.auto,
        });
        // What this rank read for the layer is verified, and on device pools its part of the
        // share area uploaded, before it says "ok" for it: a failed upload stops every rank
        // here, before anything is shared.
        let verified = self.check_read(&read, layer, peers_from);
        let mine = progress
            .carried
            .take()
            .or(read.error.take())
            .or(verified)
            .or_else(|| match (&cx, read.stage.as_mut()) {
                (Some(cx), Some(stage)) => cx.upload(step, stage).err(),
                _ => None,
            });
        if let Some(e) = &mine {
            progress.own.get_or_insert_with(|| e.clone());
        }
        let word = mine
            .as_ref()
            .map_or(LayerStatus::Ok, LayerStatus::from_error);
        let exchange_at = Instant::now();
        self.exchange(&mut progress.status, layer, word)
            .map_err(Stop::Fatal)?;
        progress.exchanged_at = Some(Instant::now());
        if !progress.status.is_ok() {
            return Err(Stop::Group);
        }
        let (Some(cx), Some(mut stage)) = (cx, read.stage) else {
            return Err(Stop::Fatal(KvLoadError::internal(
                batch,
                format!("layer {layer} has no stage"),
            )));
        };
        let shared_at = Instant::now();
        let ran = cx.run(step, &mut stage);
        let shared = shared_at.elapsed();
        progress.share_time += shared;
        tracing::trace!(
            %batch,
            rank = self.layers.rank,
            layer,
            read_wait = ?(verify_at - waited_at),
            verify = ?(exchange_at - verify_at),
            status = ?(shared_at - exchange_at),
            share = ?shared,
            "layer steps"
        );
        match ran {
            Ok(ready) => {
                let num_layers = self.inner.geometry.num_layers();
                self.inner
                    .outcomes
                    .publish(batch, self.counter, layer, ready, num_layers);
                progress.landed += self.layers.layer_bytes(layer);
                if layer == 0 {
                    progress.first_layer = self.job.started.elapsed();
                }
            }
            Err(StepError::Local(e)) => {
                // Debug: the batch's failure carries it (logged once a minute per kind).
                debug!(%batch, layer, error = %e, "share step failed on this rank");
                progress.carried = Some(e);
            }
            Err(StepError::Fatal(e)) => return Err(Stop::Fatal(e)),
        }
        h.give_back(Some(stage));
        Ok(())
    }

    /// This rank's check of what it read for `layer` (checksums, or lengths), when the read
    /// itself succeeded. A layer without a stage or a landing fails here, in its own status
    /// word, so that every rank stops at it together (never after an ok word, which would skip
    /// this layer's collective).
    fn check_read(&self, read: &ReadLayer, layer: u32, peers_from: Instant) -> Option<KvLoadError> {
        let batch = self.job.plan.logical.batch;
        if read.error.is_some() {
            return None;
        }
        let (Some(stage), Some(landing)) = (&read.stage, self.landing) else {
            return Some(KvLoadError::internal(
                batch,
                format!("layer {layer} has no stage or no landing"),
            ));
        };
        let Some(sums) = self.sums.get() else {
            return Some(KvLoadError::internal(
                batch,
                format!("layer {layer} arrived before its checksums were read"),
            ));
        };
        LayerCheck {
            inner: self.inner,
            batch,
            layers: self.layers,
            sums,
            // In a group the check's store calls (a companion read afresh, a bad object's
            // discard) end before the peers stop waiting for this layer's status word.
            by: self
                .coll
                .map(|_| check_bound(peers_from, self.inner.config.collective_timeout)),
        }
        .run(landing, stage, layer, read.landed.as_ref())
        .err()
    }

    /// Waits for the copies this rank's landing queued into the slots before a verdict says
    /// every layer landed: an engine that frees the slots after an `Ok` outcome (an aborted
    /// request) reuses them on a stream nothing orders after those copies. Bounded by the
    /// landing's drain limit, and in a group by half `collective_timeout` (the peers wait for
    /// the verdict word that long from their own arrival, about now): copies that did not
    /// finish by then are this rank's failure, carried by the verdict word to every rank; the
    /// slots stay claimed until the copies end.
    fn settle_loaded(&self) -> Result<(), KvLoadError> {
        let Some(landing) = self.landing else {
            return Ok(());
        };
        let batch = self.job.plan.logical.batch;
        let settled = match self.coll {
            Some(c) if c.size() > 1 => landing.settle_by(kv_loader::deadline_after(
                self.inner.config.collective_timeout / 2,
            )),
            _ => landing.settle(),
        };
        settled.map_err(|d| {
            tracing::error!(%batch, device = %d,
                "every layer of the batch was queued, but its copies into the slots did not \
                 finish in time");
            KvLoadError::Device(kv_loader::Cause::from_error(d).context(format!(
                "{batch}: copies queued into its slots did not finish"
            )))
        })
    }

    /// The batch's end on this rank. After every layer, one more status exchange carries the
    /// last layer's share-step failure to every rank. A fatal stop, or a failure of that last
    /// exchange, aborts the data group if there is one (every rank re-forms it at its next
    /// batch); status words out of step mark the group failed. A failed status gives, alone,
    /// this rank's own error and, in a group, the same error on every rank.
    fn verdict(
        &self,
        mut progress: Progress,
        stopped: Option<Stop>,
    ) -> Result<(u64, Duration), KvLoadError> {
        let batch = self.job.plan.logical.batch;
        let fatal = match stopped {
            Some(Stop::Fatal(e)) => Some(e),
            Some(Stop::Group) => None,
            None => {
                if progress.carried.is_none() {
                    progress.carried = self.settle_loaded().err();
                }
                if let Some(e) = &progress.carried {
                    progress.own.get_or_insert_with(|| e.clone());
                }
                let word = progress
                    .carried
                    .as_ref()
                    .map_or(LayerStatus::Ok, LayerStatus::from_error);
                let num_layers = self.inner.geometry.num_layers();
                self.exchange(&mut progress.status, num_layers, word).err()
            }
        };
        // A cancellation (a reset or close) is the engine's doing, not this rank's failure.
        if let Some(own) = progress
            .own
            .as_ref()
            .filter(|e| !matches!(e, KvLoadError::Cancelled { .. }))
        {
            self.inner.metrics.own_failure(own.kind_name());
        }
        if let Some(e) = fatal {
            if let Some(c) = self.coll {
                c.abort(&e.to_string());
                warn!(%batch, error = %e, "data group aborted: every rank re-forms it at its next batch");
            }
            return Err(e);
        }
        let status = &progress.status;
        if status.out_of_step {
            if let Some(c) = self.coll {
                self.inner
                    .group_failed(c, batch, "status words out of step");
            }
        }
        if !status.is_ok() {
            // One rank alone: its own error says most. A group: every rank reports the same
            // failure, the first (lowest layer, then rank); the rank it was carries its own
            // error's words, which the others do not have.
            let group = status
                .to_error(batch)
                .unwrap_or(KvLoadError::Cancelled { batch });
            return Err(match (self.coll, progress.own) {
                (None, Some(own)) => own,
                (Some(c), Some(own)) => {
                    let rank = c.rank();
                    let first =
                        matches!(&group, KvLoadError::PeerFailed { rank: r, .. } if *r == rank);
                    if first {
                        // Its words go into the group's error, logged once a minute per kind.
                        debug!(%batch, error = %own, "this rank's own failure of the batch");
                    } else {
                        log_own_beside_the_groups(&self.inner.failed_log, batch, &own);
                    }
                    with_own_words(group, rank, &own)
                }
                (_, None) => group,
            });
        }
        Ok((progress.landed, progress.first_layer))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store down fails every rank's batch alike; the ranks the group does not report log
    /// their own cause at `warn` once a minute per kind, not once a batch, and a cancelled
    /// batch (a request aborted) never at `warn`.
    #[test]
    fn a_ranks_own_failure_beside_the_groups_warns_once_a_minute_and_never_for_a_cancel() {
        let log = LogEvery::new();
        let failed = |b: u64| KvLoadError::Store {
            batch: Some(BatchId(b)),
            layer: Some(0),
            pages: vec![0].into(),
            kind: StoreFailure::RpcTimeout,
            detail: "the master did not answer".into(),
        };
        let ((), lines) = crate::test_logs::logged(|| {
            for b in 0..20 {
                log_own_beside_the_groups(&log, BatchId(b), &failed(b));
            }
            for b in 20..30 {
                let cancelled = KvLoadError::Cancelled { batch: BatchId(b) };
                log_own_beside_the_groups(&log, BatchId(b), &cancelled);
            }
        });
        let warns = lines.iter().filter(|l| l.level == tracing::Level::WARN);
        assert_eq!(warns.count(), 1, "{lines:?}");
        let debugs = lines.iter().filter(|l| l.level == tracing::Level::DEBUG);
        assert_eq!(debugs.count(), 29);
    }
}
