//! The outcome of a batch, the same on every rank.

use std::time::Duration;

use crate::{BatchId, KvLoadError, ShareMode, TransferBytes};

/// What a loaded batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadStats {
    /// Pages loaded.
    pub pages: u32,
    /// Layers loaded.
    pub layers: u32,
    /// Bytes this rank read from the store.
    pub bytes_read: u64,
    /// Bytes that landed in this rank's pool.
    pub bytes_landed: u64,
    /// How replicated components were shared.
    pub mode: ShareMode,
    /// From `start_load` to the first layer ready.
    pub first_layer: Duration,
    /// From `start_load` to the last layer ready.
    pub last_layer: Duration,
    /// Bytes this rank moved to land the batch, by direction (see [`TransferBytes`]).
    pub transfers: TransferBytes,
    /// The same, layer by layer (index = model layer; empty when the loader does not count
    /// per layer).
    pub layer_transfers: Vec<TransferBytes>,
    /// `Some(why)` when this rank loaded the batch alone, reading its own copy with no
    /// collective, because its TP group was down and the engine allowed that fallback (the
    /// linker's `group_fallback`); `None` for a batch loaded with the group (or by a loader
    /// without one).
    pub alone: Option<String>,
    /// Layers per store call of this rank's reads, in layer order (empty when the rank read
    /// nothing, or the loader does not group its reads).
    pub read_groups: Vec<u32>,
}

/// A finished batch: loaded, or failed with the same error on every rank.
#[derive(Debug, Clone)]
pub struct BatchOutcome {
    /// The batch.
    pub batch: BatchId,
    /// Stats, or why it failed (the engine then recomputes the batch's pages).
    pub result: Result<LoadStats, KvLoadError>,
}

/// What a save did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SaveReport {
    /// Objects written.
    pub objects_written: u32,
    /// Objects skipped because the store already had them.
    pub objects_present: u32,
    /// Objects this rank does not own (replicated components on ranks other than 0).
    pub objects_not_owned: u32,
    /// Bytes written.
    pub bytes_written: u64,
}
