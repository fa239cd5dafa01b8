//! `AllRanks`: every rank reads every page of every component itself; nothing is shared.
//!
//! Host pools: the reader writes straight into this rank's slots; the layer is resident when
//! its reads return. Device pools: the reader writes into the stage's own area (pinned); `land`
//! copies it to the slots on the load stream (contiguous slot runs as one copy each, or one
//! copy into device staging and one scatter launch per component) and records the layer event.
//! Every rank moves the whole layer over PCIe.

use std::ops::Range;

use dedup_broadcast::StagingLayout;
use kv_device::{DeviceShare, HostShare, LayerStage};
use kv_loader::{LayerReady, ShareMode};

use super::{LayerCx, ShareStep, StepError};

/// Every rank reads its own copy.
pub(crate) struct AllRanks;

impl ShareStep for AllRanks {
    fn mode(&self) -> ShareMode {
        ShareMode::AllRanks
    }

    fn host(
        &self,
        cx: &LayerCx<'_>,
        _host: &dyn HostShare,
        _layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        cx.land(stage)
    }

    fn upload_range(&self, _layout: &StagingLayout, _rank: u32) -> Option<Range<usize>> {
        None
    }

    fn device(
        &self,
        cx: &LayerCx<'_>,
        _device: &dyn DeviceShare,
        _layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        cx.land(stage)
    }
}
