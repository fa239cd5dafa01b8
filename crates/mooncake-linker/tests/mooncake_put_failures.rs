//! `MooncakeStore::put` after a copying put failed as a transfer, against a real Mooncake
//! master: the rest of the call is not tried, the zero-copy batch included (each would wait
//! out the client's transfer timeout once more while the caller has given up).
//!
//! Needs the feature `failpoints` (the failure is the failpoint "mooncake-copying-put"), and a
//! binary of its own: a failpoint's setting holds for the whole process.
//!
//! Run: `scripts/with-mooncake.sh cargo test -p mooncake-linker --features failpoints --test
//! mooncake_put_failures`. Without `MOONCAKE_MASTER_BIN` the test skips with a message;
//! `KVLINK_REQUIRE_MOONCAKE=1` (CI) turns that into a failure.
#![cfg(feature = "failpoints")]

mod common;

use common::{available, unique, PrivateMaster};
use mooncake_linker::store::mooncake::MooncakeStore;
use mooncake_linker::store::{KvStore, MemoryRegion, ObjectPut, StoreError};

#[test]
fn after_a_copying_put_fails_the_zero_copy_batch_is_not_sent() {
    if !available(
        "after_a_copying_put_fails_the_zero_copy_batch_is_not_sent",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    // Registered memory alone moves in place (as over RDMA): an unregistered part goes
    // through the copying put, a registered one in the zero-copy batch after it.
    let store =
        MooncakeStore::connect(master.config(64 << 20).registered_only(true)).expect("connect");
    let copied = vec![1u8; 64 << 10];
    let mut in_place = vec![2u8; 64 << 10];
    let region = MemoryRegion {
        addr: in_place.as_mut_ptr() as usize,
        len: in_place.len(),
    };
    // SAFETY: `in_place` outlives its registration (unregistered below, before it drops).
    unsafe { store.register(region) }.expect("register");
    let (a, b) = (unique("copied"), unique("in-place"));
    let puts = [
        ObjectPut {
            key: &a,
            parts: [(copied.as_ptr(), copied.len())].into_iter().collect(),
        },
        ObjectPut {
            key: &b,
            parts: [(in_place.as_ptr(), in_place.len())].into_iter().collect(),
        },
    ];
    fail::cfg("mooncake-copying-put", "return").unwrap();
    // SAFETY: both sources are valid for reads of their lengths for the whole call.
    let out = unsafe { store.put(&puts) };
    fail::remove("mooncake-copying-put");
    assert!(
        matches!(&out[0], Err(StoreError::TransferFailed { .. })),
        "{:?}",
        out[0]
    );
    match &out[1] {
        Err(e @ StoreError::Unavailable { .. }) => {
            assert!(e.to_string().contains("earlier copying put failed"), "{e}")
        }
        other => panic!("the zero-copy put was sent: {other:?}"),
    }
    assert_eq!(store.exists(&[&a, &b]), vec![Ok(false), Ok(false)]);
    store.unregister(region).expect("unregister");
}
