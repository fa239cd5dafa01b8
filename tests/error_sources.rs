//! A device failure reaches the engine as a `KvLoadError` that keeps the backend's typed
//! error as its source (not only its words), through the trait's slot copies too.

use std::error::Error;

use kvlink::kv_device::{DeviceError, HostKvPool, KvPool};
use kvlink::kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
use kvlink::kv_loader::{EngineAction, KvLoadError};

#[test]
fn a_device_error_stays_typed_inside_kv_load_error() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    let pool = HostKvPool::new(g, 2).unwrap();
    let mut page = vec![0u8; 3];
    // SAFETY: the test's own pool, one thread, no load.
    let device = unsafe { KvPool::read_slot(&pool, ComponentId(0), 0, 0, &mut page) }.unwrap_err();
    let e = KvLoadError::from(device.clone());
    assert_eq!(e.action(), EngineAction::ResetThenRecompute);
    let KvLoadError::Device(cause) = &e else {
        panic!("{e:?}")
    };
    assert_eq!(cause.downcast_ref::<DeviceError>(), Some(&device));
    let mut chain = Vec::new();
    let mut next = e.source();
    while let Some(s) = next {
        chain.push(s.to_string());
        next = s.source();
    }
    assert!(chain.iter().any(|s| *s == device.to_string()), "{chain:?}");
    assert!(e.to_string().contains(&device.to_string()), "{e}");
}

#[test]
fn a_collective_error_stays_typed_inside_kv_load_error() {
    use kvlink::dedup_broadcast::CollectiveError;
    let coll = CollectiveError::Timeout {
        op: "all_gather",
        seq: 7,
        missing: vec![2],
    };
    let e = KvLoadError::from(coll.clone());
    let KvLoadError::Collective { detail, .. } = &e else {
        panic!("{e:?}")
    };
    assert_eq!(detail.downcast_ref::<CollectiveError>(), Some(&coll));
    assert!(e.to_string().contains(&coll.to_string()), "{e}");
    assert!(std::error::Error::source(&e).is_some());
}
