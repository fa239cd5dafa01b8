//! `SplitAllGather`: each rank reads its share of the plan's pages (contiguous, sizes differing
//! by at most one); an all-gather gives every rank all of them. The share layout puts rank `r`'s
//! rows in chunk `r` (one block per component, padded to the largest share), so one in-place
//! all-gather moves every share.
//!
//! Host pools: each rank's reader writes its share straight into its own slots; the host
//! collective copies every owner's slot rows into every other rank's slots
//! (`all_gather_rows`, counts = rows per share).
//!
//! Device pools: each rank's reader writes its share into its chunk of the pinned share area;
//! it uploads that chunk alone (about 1/N of the layer over PCIe), the all-gather runs in place
//! on device staging on the comm stream after every rank's upload event, and every rank waits
//! (bounded) until the all-gather is known complete, and only then scatters all blocks into
//! its slots and lands its own rows: nothing writes a rank's slots behind a collective not
//! known complete.

use std::ops::Range;
use std::time::Instant;

use dedup_broadcast::{RowsShare, StageShare, StagingLayout};
use kv_device::{DeviceShare, HostShare, LayerStage};
use kv_loader::{LayerReady, ShareMode};

use super::{LayerCx, ShareStep, StepError};

/// Each rank reads a share, then all-gather.
pub(crate) struct SplitAllGather;

impl ShareStep for SplitAllGather {
    fn mode(&self) -> ShareMode {
        ShareMode::SplitAllGather
    }

    fn host(
        &self,
        cx: &LayerCx<'_>,
        host: &dyn HostShare,
        layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        let counts = layout.rows_per_rank();
        cx.share_rows(
            host,
            stage,
            layout,
            RowsShare::AllGather { counts: &counts },
        )?;
        cx.land(stage)
    }

    fn upload_range(&self, layout: &StagingLayout, rank: u32) -> Option<Range<usize>> {
        Some(layout.chunk(rank))
    }

    fn device(
        &self,
        cx: &LayerCx<'_>,
        device: &dyn DeviceShare,
        layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        let started = Instant::now();
        let shared = cx.share_stage(device, stage, StageShare::AllGather)?;
        cx.wait_scatter_land(device, stage, shared, started, layout)
    }
}
