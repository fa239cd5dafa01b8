//! `Rank0Broadcast`: rank 0 reads every replicated row of a layer; the layer is broadcast from
//! it. Rows travel in the share layout's order: one block per component, plan pages in order.
//!
//! Host pools: rank 0's reader writes the rows straight into its own slots; the host collective
//! copies rank 0's slot rows into every receiver's slots (`broadcast_rows`: one CPU copy per
//! row per receiver); the layer is resident when that returns.
//!
//! Device pools: rank 0's reader writes the rows into the share area of its pinned stage; rank
//! 0 uploads the whole share area to device staging (one host→device copy, load stream); the
//! broadcast runs on the comm stream after that upload's event and fills every receiver's
//! device share area; every rank waits (bounded) until the broadcast is known complete, and
//! only then scatters the rows into its slots on the load stream (one launch per block) and
//! lands its own rows: nothing writes a rank's slots behind a collective not known complete.
//! Receivers move 0 bytes of replicated rows over PCIe.

use std::ops::Range;
use std::time::Instant;

use dedup_broadcast::{RowsShare, StageShare, StagingLayout};
use kv_device::{DeviceShare, HostShare, LayerStage};
use kv_loader::{LayerReady, ShareMode};

use super::{LayerCx, ShareStep, StepError};

/// Rank 0 reads, then broadcasts.
pub(crate) struct Rank0Broadcast;

impl ShareStep for Rank0Broadcast {
    fn mode(&self) -> ShareMode {
        ShareMode::Rank0Broadcast
    }

    fn host(
        &self,
        cx: &LayerCx<'_>,
        host: &dyn HostShare,
        layout: &StagingLayout,
        stage: &mut LayerStage,
    ) -> Result<LayerReady, StepError> {
        cx.share_rows(host, stage, layout, RowsShare::Broadcast { root: 0 })?;
        cx.land(stage)
    }

    fn upload_range(&self, layout: &StagingLayout, rank: u32) -> Option<Range<usize>> {
        // Rank 0's chunk is the whole share area; a receiver's is empty (nothing crosses PCIe).
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
        let shared = cx.share_stage(device, stage, StageShare::Broadcast { root: 0 })?;
        cx.wait_scatter_land(device, stage, shared, started, layout)
    }
}
