//! The share step of one layer: one strategy per mode, each in its own file with both of its
//! data paths (host rows for host pools, device stages for device pools), and the steps they
//! have in common here.
//!
//! A step runs on the exchange loop after every rank reported the layer read (the status
//! exchange). On device pools this rank's part of the share area is uploaded *before* that
//! exchange ([`LayerCx::upload`]), and an upload that fails to enqueue is this rank's status
//! word for the layer: its peers would otherwise share, scatter and publish what device staging held
//! before (an earlier layer's bytes) as this layer. A step ends in one of three ways: the
//! layer landed ([`LayerReady`], published by the pipeline), a **local** error (this rank's
//! scatter or land failed, which touches only its own pool: it still entered the layer's
//! collective, and reports the error in the next status word), or a **fatal** one (a
//! collective failed, or its event did not complete by the deadline: the group is aborted
//! where that can leave work behind, and the batch fails on every rank).

mod all_ranks;
mod rank0_broadcast;
mod split_all_gather;

use std::ops::Range;
use std::time::{Duration, Instant};

use dedup_broadcast::{share_stage, Collective, CollectiveError, StageShare, StagingLayout};
use kv_device::{DeviceShare, HostShare, LayerLanding, LayerStage, ShareSide, SharedEvent};
use kv_loader::{BatchId, KvLoadError, LayerReady, ShareMode};

use super::auto::AutoMode;

/// How a layer's step went wrong.
#[derive(Debug)]
pub(crate) enum StepError {
    /// This rank's own step failed after it entered the collective: report it next.
    Local(KvLoadError),
    /// A collective failed or never completed: stop; the batch fails on every rank.
    Fatal(KvLoadError),
}

/// The share step of one mode.
pub(crate) trait ShareStep: Send + Sync {
    /// The mode.
    fn mode(&self) -> ShareMode;

    /// Host pools: this rank's part of the replicated rows is in its slots; share them.
    fn host(
        &self,
        cx: &LayerCx<'_>,
        host: &dyn HostShare,
        layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError>;

    /// Device pools: the part of the stage's share area this rank uploads before the layer's
    /// status exchange (what it shares), or `None` when the mode shares nothing on the device.
    fn upload_range(&self, layout: &StagingLayout, rank: u32) -> Option<Range<usize>>;

    /// Device pools: this rank's part of the replicated rows is in the stage's share area,
    /// uploaded ([`upload_range`](Self::upload_range)); share it on the device and scatter it
    /// into the slots.
    fn device(
        &self,
        cx: &LayerCx<'_>,
        device: &dyn DeviceShare,
        layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError>;
}

/// The step for `mode`. A new mode adds its row to `kv_loader`'s share-mode table, its step
/// file here, and its arm below; nothing else matches on the mode.
pub(crate) fn step_for(mode: ShareMode) -> &'static dyn ShareStep {
    match mode {
        ShareMode::AllRanks => &all_ranks::AllRanks,
        ShareMode::Rank0Broadcast => &rank0_broadcast::Rank0Broadcast,
        ShareMode::SplitAllGather => &split_all_gather::SplitAllGather,
    }
}

/// What one layer's step works with.
pub(crate) struct LayerCx<'a> {
    /// The data group (absent for a rank alone: nothing is shared).
    pub(crate) coll: Option<&'a dyn Collective>,
    pub(crate) landing: &'a dyn LayerLanding,
    /// The layer's share layout, when it shares anything.
    pub(crate) layout: Option<&'a StagingLayout>,
    pub(crate) rank: u32,
    pub(crate) batch: BatchId,
    /// Bounds every collective call and every wait for a collective's event.
    pub(crate) collective_timeout: Duration,
    pub(crate) auto: &'a AutoMode,
}

impl LayerCx<'_> {
    /// Runs `step` on the layer open in `stage`.
    pub(crate) fn run(
        &self,
        step: &dyn ShareStep,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        let (Some(layout), Some(_)) = (self.layout.filter(|l| !l.is_empty()), self.coll) else {
            return self.land(stage);
        };
        match self.landing.share() {
            ShareSide::Host(host) => step.host(self, host, layout, stage),
            ShareSide::Device(device) => step.device(self, device, layout, stage),
        }
    }

    /// Device pools, before the layer's status exchange: enqueues the upload of this rank's
    /// part of the share area (`step`'s [`upload_range`](ShareStep::upload_range)), so that a
    /// failure stops every rank at this layer through the status words, before anything is
    /// shared. Nothing to do on host pools, for a rank alone, or for a layer that shares
    /// nothing.
    pub(crate) fn upload(
        &self,
        step: &dyn ShareStep,
        stage: &mut LayerStage,
    ) -> Result<(), KvLoadError> {
        let (Some(layout), Some(_)) = (self.layout.filter(|l| !l.is_empty()), self.coll) else {
            return Ok(());
        };
        let (ShareSide::Device(device), Some(range)) =
            (self.landing.share(), step.upload_range(layout, self.rank))
        else {
            return Ok(());
        };
        device.upload(stage, range).map_err(|e| {
            tracing::warn!(batch = %self.batch, rank = self.rank, error = %e, "upload failed");
            e.into()
        })
    }

    fn deadline(&self) -> Instant {
        kv_loader::deadline_after(self.collective_timeout)
    }

    fn coll(&self) -> Result<&dyn Collective, StepError> {
        self.coll.ok_or_else(|| {
            StepError::Fatal(KvLoadError::internal(None, "a share step without a group"))
        })
    }

    /// Lands the layer's own rows (and the scattered shared ones before them).
    pub(crate) fn land(&self, stage: &mut LayerStage) -> Result<LayerReady, StepError> {
        self.landing
            .land(stage)
            .map_err(|e| StepError::Local(e.into()))
    }

    fn collective_failed(&self, e: CollectiveError) -> StepError {
        StepError::Fatal(KvLoadError::Collective {
            batch: Some(self.batch),
            detail: kv_loader::Cause::from_error(e),
        })
    }

    fn misuse(&self, e: kv_device::DeviceError) -> StepError {
        let detail = format!("{}: {e}", self.batch);
        StepError::Fatal(KvLoadError::Device(kv_loader::Cause::with_source(
            detail, e,
        )))
    }

    /// Host path: shares this layer's rows (pool slots of `blocks`) with `how`.
    fn share_rows(
        &self,
        host: &dyn HostShare,
        stage: &mut LayerStage,
        layout: &StagingLayout,
        how: dedup_broadcast::RowsShare<'_>,
    ) -> Result<(), StepError> {
        let coll = self.coll()?;
        let t0 = Instant::now();
        let mut rows = host
            .rows(stage, &layout.blocks())
            .map_err(|e| self.misuse(e))?;
        dedup_broadcast::share_rows(coll, &mut rows, how, self.deadline())
            .map_err(|e| self.collective_failed(e))?;
        self.auto
            .observe_fabric(layout.mode(), layout.len() as u64, t0.elapsed());
        Ok(())
    }

    /// Device path: enqueues the collective on the stage's share area with `how`.
    fn share_stage(
        &self,
        device: &dyn DeviceShare,
        stage: &mut LayerStage,
        how: StageShare,
    ) -> Result<SharedEvent, StepError> {
        let coll = self.coll()?;
        let mut ds = device.device_stage(stage).map_err(|e| self.misuse(e))?;
        share_stage(coll, &mut ds, how, self.deadline()).map_err(|e| self.collective_failed(e))
    }

    /// Device path, after the collective was enqueued: waits, bounded, until the collective is
    /// known complete, then scatters the layout's blocks into this rank's slots after its
    /// event and lands the layer. A wait that runs out aborts the
    /// group and poisons the stage, and nothing that writes the slots has been enqueued: a
    /// scatter queued behind a collective that never completes in time would write the slots
    /// whenever it ends, after the batch's failure reached the engine (which may recompute
    /// into them), and hold the in-order load stream behind it meanwhile.
    fn wait_scatter_land(
        &self,
        device: &dyn DeviceShare,
        stage: &mut LayerStage,
        shared: SharedEvent,
        started: Instant,
        layout: &StagingLayout,
    ) -> Result<LayerReady, StepError> {
        let deadline = self.deadline();
        let done = shared.wait_until(deadline);
        if !matches!(done, Ok(true)) {
            let why = match &done {
                Err(e) => format!("the collective's event failed: {e}"),
                _ => format!(
                    "the collective did not complete within {:?}",
                    self.collective_timeout
                ),
            };
            self.landing.poison(stage);
            let coll = self.coll()?;
            coll.abort(&why);
            tracing::warn!(batch = %self.batch, rank = self.rank, why, "aborting the data group");
            // A device error stays one (its action resets the device's work; the engine
            // can downcast it); a collective that did not complete in time is the group's.
            let err = match done {
                Err(e) => KvLoadError::from(e),
                _ => KvLoadError::Collective {
                    batch: Some(self.batch),
                    detail: why.into(),
                },
            };
            return Err(StepError::Fatal(err));
        }
        self.auto
            .observe_fabric(layout.mode(), layout.len() as u64, started.elapsed());
        device
            .scatter(stage, &layout.blocks(), &shared)
            .map_err(|e| StepError::Local(e.into()))
            .and_then(|()| self.land(stage))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mode_has_its_own_step() {
        for mode in ShareMode::ALL {
            assert_eq!(step_for(mode).mode(), mode);
        }
    }
}
