//! Misuse of a staged landing is refused with typed errors, never a panic: slots past the
//! pool, a staging half too small, a second lease, loans out of order, targets off the plan or
//! the layer, landing twice, a stage of another landing. Each refusal is checked for its
//! `DeviceError` variant (as an H200 run at 77e5b52 printed them: docs/results).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{
    DeviceError, DirectLanding, HostKvPool, LayerLanding, StagedLanding, StagingPool,
};
use kvlink::kv_geometry::ComponentId;
use kvlink_rig::glm::{glm, half_bytes, own_all};
use kvlink_rig::report::de;

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

/// The refusals, one per misuse; `Err` names a misuse that was accepted.
pub fn misuse(dev: &Arc<CudaDevice>, pages: u32) -> Result<String, String> {
    let g = glm(1, 0)?;
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, 4), 1).map_err(de)?;
    let mut seen = Vec::new();
    let mut expect = |what: &str, kind: Kind, r: Result<(), DeviceError>| -> Result<(), String> {
        match r {
            Err(e) if kind.holds(&e) => {
                seen.push(format!("{what}: {e}"));
                Ok(())
            }
            Err(e) => Err(format!("{what}: refused as {e:?}, not {kind:?}")),
            Ok(()) => Err(format!("{what}: accepted")),
        }
    };
    let new = |slots: Vec<u32>| {
        StagedLanding::new(pool.clone(), staging.lease()?, slots.into(), own_all(&g))
    };
    expect(
        "slot past the pool",
        Kind::OutOfPool,
        new(vec![0, pages]).map(|_| ()),
    )?;
    expect(
        "staging half too small",
        Kind::StageTooSmall,
        new((0..64).collect()).map(|_| ()),
    )?;
    let mut l = new(vec![3, 1, 2, 0]).map_err(de)?;
    expect(
        "second lease of a 1-buffer pool",
        Kind::Alloc,
        staging.lease().map(|_| ()),
    )?;
    let mut stages = l.take_stages();
    expect(
        "a loan before the layer is open",
        Kind::InvalidStage,
        l.lend(&mut stages[0]).map(|_| ()),
    )?;
    l.open(&mut stages[0], 0, soon()).map_err(de)?;
    let loan = l.lend(&mut stages[0]).map_err(de)?;
    expect(
        "plan page without a slot",
        Kind::OutOfPool,
        l.target(&loan, ComponentId(0), 4).map(|_| ()),
    )?;
    expect(
        "a stage lent twice",
        Kind::Lent,
        l.lend(&mut stages[0]).map(|_| ()),
    )?;
    expect(
        "landing a lent stage",
        Kind::Lent,
        l.land(&mut stages[0]).map(|_| ()),
    )?;
    drop(loan);
    let off_layer = (0..g.num_layers())
        .find(|&x| g.components().iter().any(|c| c.position(x).is_none()))
        .unwrap_or(0);
    let missing = g
        .components()
        .iter()
        .find(|c| c.position(off_layer).is_none())
        .map(|c| c.id)
        .unwrap_or(ComponentId(99));
    l.open(&mut stages[1], off_layer, soon()).map_err(de)?;
    let loan = l.lend(&mut stages[1]).map_err(de)?;
    expect(
        "component not on the layer",
        Kind::OutOfPool,
        l.target(&loan, missing, 0).map(|_| ()),
    )?;
    drop(loan);
    l.land(&mut stages[0]).map_err(de)?;
    expect(
        "land a stage twice",
        Kind::InvalidStage,
        l.land(&mut stages[0]).map(|_| ()),
    )?;
    let other = DirectLanding::new(
        Arc::new(HostKvPool::new(g.clone(), 4).map_err(de)?),
        vec![0].into(),
        own_all(&g),
    )
    .map_err(de)?;
    expect(
        "a stage of another landing",
        Kind::InvalidStage,
        other.open(&mut stages[1], 0, soon()),
    )?;
    Ok(format!("{} refusals: {}", seen.len(), seen.join(" | ")))
}

/// The `DeviceError` variant a misuse is refused with.
#[derive(Debug, Clone, Copy)]
enum Kind {
    OutOfPool,
    StageTooSmall,
    Alloc,
    InvalidStage,
    Lent,
}

impl Kind {
    fn holds(self, e: &DeviceError) -> bool {
        matches!(
            (self, e),
            (Kind::OutOfPool, DeviceError::OutOfPool { .. })
                | (Kind::StageTooSmall, DeviceError::StageTooSmall { .. })
                | (Kind::Alloc, DeviceError::Alloc { .. })
                | (Kind::InvalidStage, DeviceError::InvalidStage(_))
                | (Kind::Lent, DeviceError::Lent(_))
        )
    }
}
