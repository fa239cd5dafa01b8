//! Slot claims on a host pool: kvlink's own safe paths never write a slot row while another
//! of them reads or writes it. Two landings over one slot, a save of a slot a landing writes
//! (also through a loan that outlives its landing, as a store call past its deadline holds
//! it), and two stages of one landing at one layer are refused with typed errors.

use std::sync::Arc;
use std::time::Duration;

use kv_device::{
    BatchShape, DeviceError, DirectLanding, HostKvPool, KvPool, LayerLanding, SaveSource,
};
use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};

fn pool() -> Arc<dyn KvPool> {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    Arc::new(HostKvPool::new(g, 8).unwrap())
}

fn landing(pool: &Arc<dyn KvPool>, slots: &[u32]) -> Result<DirectLanding, DeviceError> {
    DirectLanding::new(
        pool.clone(),
        slots.into(),
        BatchShape::own_only(vec![ComponentId(0)]),
    )
}

fn busy(r: Result<impl Sized, DeviceError>, slot: u32) -> bool {
    matches!(r, Err(DeviceError::SlotBusy { slot: s, .. }) if s == slot)
}

fn soon() -> std::time::Instant {
    kv_loader::deadline_after(Duration::from_secs(1))
}

#[test]
fn two_landings_never_write_one_slot() {
    let p = pool();
    let first = landing(&p, &[1, 2, 3]).unwrap();
    assert!(busy(landing(&p, &[5, 3]), 3), "slot 3 is the first batch's");
    // The refused landing kept nothing: slot 5 is free.
    let other = landing(&p, &[5, 6]).unwrap();
    drop(first);
    assert!(
        landing(&p, &[3]).is_ok(),
        "free again once the first landing is gone"
    );
    drop(other);
    assert!(busy(landing(&p, &[4, 4]), 4), "a slot named twice");
}

#[test]
fn a_save_never_reads_a_slot_a_landing_writes() {
    let p = pool();
    let mut l = landing(&p, &[2]).unwrap();
    assert!(busy(SaveSource::slot(&p, ComponentId(0), 0, 2), 2));
    assert!(SaveSource::slot(&p, ComponentId(0), 0, 4).is_ok());
    // A loan out (a store call past its deadline holds it) keeps the slot claimed after the
    // landing itself is dropped.
    let mut stages = l.take_stages();
    l.open(&mut stages[0], 0, soon()).unwrap();
    let loan = l.lend(&mut stages[0]).unwrap();
    drop(l);
    assert!(busy(SaveSource::slot(&p, ComponentId(0), 0, 2), 2));
    assert!(busy(landing(&p, &[2]), 2));
    drop(loan);
    let source = SaveSource::slot(&p, ComponentId(0), 0, 2).unwrap();
    // ...and a save source alive keeps landings out of its slot, clones included.
    let clone = source.clone();
    drop(source);
    assert!(busy(landing(&p, &[2]), 2));
    drop(clone);
    assert!(landing(&p, &[2]).is_ok());
}

#[test]
fn a_layer_is_open_in_one_stage_of_a_landing_at_a_time() {
    let p = pool();
    let mut l = landing(&p, &[0, 1]).unwrap();
    let mut stages = l.take_stages();
    l.open(&mut stages[0], 3, soon()).unwrap();
    assert!(matches!(
        l.open(&mut stages[1], 3, soon()),
        Err(DeviceError::InvalidStage(_))
    ));
    l.open(&mut stages[1], 4, soon()).unwrap();
    l.land(&mut stages[0]).unwrap();
    // Landed: layer 3 may be opened again (in another stage).
    l.open(&mut stages[2], 3, soon()).unwrap();
}
