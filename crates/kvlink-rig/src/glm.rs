//! The model every check and benchmark loads: GLM-5.2 with FP8 KV, and the byte pattern of
//! its rows.

use kv_device::{BatchShape, StagingPool};
use kv_geometry::{ComponentLayout, KvGeometry, ModelKvSpec};

/// GLM-5.2 with FP8 KV (DSA: 656 B/token `k` on 78 layers, 8448 B/page `indexer` on some),
/// rank `rank` of TP `tp`. Every component is replicated (MLA), so every rank's pool holds
/// the same bytes.
pub fn glm(tp: u32, rank: u32) -> Result<KvGeometry, String> {
    KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), tp, rank).map_err(|e| e.to_string())
}

/// Bytes of one staging half for batches of `pages` pages (the widest layer, with the share
/// area's padding at this TP).
pub fn half_bytes(g: &KvGeometry, pages: usize) -> usize {
    StagingPool::half_bytes_for(g, pages, g.tp_size())
}

/// Every component of the geometry, read by this rank itself (nothing shared).
pub fn own_all(g: &KvGeometry) -> BatchShape {
    BatchShape::own_only(g.components().iter().map(|c| c.id).collect())
}

/// The tag of a component in the byte pattern.
pub fn tag(c: &ComponentLayout) -> u64 {
    u64::from(c.id.0) + 1
}
