//! `MooncakeStore::unregister` beside a registration that hangs in the wheel with the store's
//! table of regions held, against a real Mooncake master: the unregister returns within its
//! bound (`UNREGISTER_WAIT`) and the region stays registered, where it waited for the hung
//! registration without a bound. And a read beside an unregistration that hangs in the wheel
//! with the transfer gate held: it fails at its bound (`TRANSFER_WAIT`) rather than park its
//! worker until the unregistration returns. And bounded registrations behind a hung one give
//! their store-call workers back when their callers give up.
//!
//! Needs the feature `failpoints` (the hangs are the failpoints "mooncake-register-held" and
//! "mooncake-unregister-held"), and a binary of its own: a failpoint's setting holds for the
//! whole process.
//!
//! Run: `scripts/with-mooncake.sh cargo test -p mooncake-linker --features failpoints --test
//! mooncake_register_hang`. Without `MOONCAKE_MASTER_BIN` the test skips with a message;
//! `KVLINK_REQUIRE_MOONCAKE=1` (CI) turns that into a failure.
#![cfg(feature = "failpoints")]

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{available, PrivateMaster};
use kv_device::StoreRegion;
use mooncake_linker::store::mooncake::{MooncakeStore, TRANSFER_WAIT, UNREGISTER_WAIT};
use mooncake_linker::store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, Registration, StoreCalls, StoreError,
};

/// Held by each test of this binary: a failpoint's setting is the whole process's, and the
/// tests would otherwise run side by side (one's registration passing another's failpoint).
static FAILPOINTS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The test's own master, with every failpoint of the binary to itself while the guard lives;
/// `None` (the test skips, saying so) without a master binary.
fn private_master(test: &str) -> Option<(std::sync::MutexGuard<'static, ()>, PrivateMaster)> {
    if !available(test, &["MOONCAKE_MASTER_BIN"]) {
        return None;
    }
    let failpoints = FAILPOINTS.lock().unwrap_or_else(|e| e.into_inner());
    Some((failpoints, PrivateMaster::start(&[])))
}

/// Starts registering `region` on a thread of `scope`, a registration that takes the store's
/// table of regions and sleeps `hang` with it held (the failpoint "mooncake-register-held");
/// returns once it holds the table.
///
/// # Safety
/// As [`KvStore::register`]: `region` stays allocated until it is unregistered or the store
/// is dropped.
unsafe fn hung_registration<'scope, S: KvStore + ?Sized>(
    scope: &'scope std::thread::Scope<'scope, '_>,
    store: &'scope S,
    region: MemoryRegion,
    hang: Duration,
) -> std::thread::ScopedJoinHandle<'scope, Result<(), StoreError>> {
    let table_held = hang_once("mooncake-register-held", hang);
    // SAFETY: the caller's promise, for the same region.
    let registering = scope.spawn(move || unsafe { store.register(region) });
    table_held
        .recv_timeout(Duration::from_secs(10))
        .expect("the registration reached its failpoint");
    registering
}

/// The memory of `buf`, as a store registers it.
fn region_of(buf: &mut [u8]) -> MemoryRegion {
    MemoryRegion {
        addr: buf.as_mut_ptr() as usize,
        len: buf.len(),
    }
}

/// Makes the first pass through failpoint `name` say so (on the receiver returned) and then
/// sleep `hang`, with whatever the store holds there held; later passes go straight on.
fn hang_once(name: &str, hang: Duration) -> std::sync::mpsc::Receiver<()> {
    let (reached, rx) = std::sync::mpsc::channel::<()>();
    let reached = std::sync::Mutex::new(Some(reached));
    fail::cfg_callback(name, move || {
        let first = reached.lock().unwrap().take();
        if let Some(tx) = first {
            let _ = tx.send(());
            std::thread::sleep(hang);
        }
    })
    .unwrap();
    rx
}

#[test]
fn an_unregister_beside_a_hung_registration_returns_at_its_bound() {
    let Some((_failpoints, master)) =
        private_master("an_unregister_beside_a_hung_registration_returns_at_its_bound")
    else {
        return;
    };
    let store = MooncakeStore::connect(master.config(16 << 20)).expect("connect");
    let mut held = vec![0u8; 1 << 16];
    let mut hung = vec![0u8; 1 << 16];
    let region = |buf: &mut Vec<u8>| region_of(buf);
    let (held_region, hung_region) = (region(&mut held), region(&mut hung));
    // SAFETY: `held` outlives its registration: unregistered below before it drops (a failing
    // test may free it registered, with no transfer of it in flight).
    unsafe { store.register(held_region) }.expect("register");
    let hang = UNREGISTER_WAIT + Duration::from_secs(2);
    std::thread::scope(|s| {
        // SAFETY: as above, for `hung`.
        let registering = unsafe { hung_registration(s, &store, hung_region, hang) };
        let t0 = Instant::now();
        let got = store.unregister(held_region);
        let took = t0.elapsed();
        assert!(
            matches!(&got, Err(StoreError::Unavailable { .. })),
            "{got:?}"
        );
        assert!(
            took >= UNREGISTER_WAIT - Duration::from_millis(500) && took < hang,
            "returned after {took:?}"
        );
        registering
            .join()
            .unwrap()
            .expect("the hung registration ends");
    });
    fail::remove("mooncake-register-held");
    // The region stayed registered, counted as held: unregistered now that nothing hangs.
    store
        .unregister(held_region)
        .expect("unregister once the table is free");
    store.unregister(hung_region).expect("unregister");
    drop(store);
}

/// Registrations through bounded store calls, behind one that hangs with the table held:
/// each fails at its caller's deadline and its worker comes back, so the workers alive stay
/// few. Before, each waited for the table without a bound and parked its worker until the
/// hung one returned (past `MAX_WORKERS`, every store call failed).
#[test]
fn bounded_registrations_behind_a_hung_one_give_their_workers_back() {
    let Some((_failpoints, master)) =
        private_master("bounded_registrations_behind_a_hung_one_give_their_workers_back")
    else {
        return;
    };
    let store: Arc<dyn KvStore> =
        Arc::new(MooncakeStore::connect(master.config(16 << 20)).expect("connect"));
    let calls = Arc::new(StoreCalls::new(store.clone()));
    let mut hung = vec![0u8; 1 << 16];
    let hung_region = region_of(&mut hung);
    let hang = Duration::from_secs(6);
    const BEHIND: usize = 16;
    std::thread::scope(|s| {
        // SAFETY: `hung` outlives its registration: unregistered below before it drops.
        let registering = unsafe { hung_registration(s, &*store, hung_region, hang) };
        let t0 = Instant::now();
        for _ in 0..BEHIND {
            let buf: Arc<Vec<u8>> = Arc::new(vec![0; 4096]);
            // SAFETY: `buf`'s bytes stay allocated while `buf` (the region's owner) lives.
            let region = unsafe { StoreRegion::new(buf.as_ptr() as usize, buf.len(), buf.clone()) };
            let got = Registration::bounded(
                &calls,
                region,
                Instant::now() + Duration::from_millis(50),
                Duration::from_secs(5),
            );
            assert!(
                matches!(&got, Err(StoreError::Overdue { .. })),
                "{:?}",
                got.as_ref().map(|_| ())
            );
        }
        // Each worker comes back within a look of its caller giving up (10 ms).
        std::thread::sleep(Duration::from_millis(200));
        let alive = calls.workers();
        let took = t0.elapsed();
        registering
            .join()
            .unwrap()
            .expect("the hung registration ends");
        assert!(took < hang, "the registrations behind took {took:?}");
        // Two take turns when each is back before the next registration; a loaded machine
        // may start a few more. Without the rule, one per registration.
        assert!(
            alive <= BEHIND / 4,
            "{alive} store-call workers alive after {BEHIND} registrations gave up"
        );
    });
    fail::remove("mooncake-register-held");
    store.unregister(hung_region).expect("unregister");
    drop((calls, store));
}

/// Before, the read waited on the gate without a bound, until the unregistration returned.
#[test]
fn a_read_beside_a_hung_unregistration_fails_at_its_bound() {
    let Some((_failpoints, master)) =
        private_master("a_read_beside_a_hung_unregistration_fails_at_its_bound")
    else {
        return;
    };
    let store = MooncakeStore::connect(master.config(16 << 20)).expect("connect");
    let data = vec![5u8; 1 << 12];
    let put = ObjectPut {
        key: "gate-held",
        parts: [(data.as_ptr(), data.len())].into_iter().collect(),
    };
    // SAFETY: `data` is valid for reads of its length for the whole call.
    unsafe { store.put(&[put]) }.remove(0).expect("put");
    // A registered destination (read in place, through the gate) and a region to unregister.
    let mut dst = vec![0u8; 1 << 16];
    let mut gone = vec![0u8; 1 << 16];
    let region = |buf: &mut Vec<u8>| region_of(buf);
    let (dst_region, gone_region) = (region(&mut dst), region(&mut gone));
    // SAFETY: both outlive their registrations: unregistered below before they drop (a
    // failing test may free them registered, with no transfer of them in flight).
    unsafe { store.register(dst_region) }.expect("register");
    // SAFETY: as above.
    unsafe { store.register(gone_region) }.expect("register");
    let hang = TRANSFER_WAIT + Duration::from_secs(3);
    let gate_held = hang_once("mooncake-unregister-held", hang);
    std::thread::scope(|s| {
        let unregistering = s.spawn(|| store.unregister(gone_region));
        gate_held
            .recv_timeout(Duration::from_secs(10))
            .expect("the unregistration reached its failpoint");
        let get = ObjectGet {
            key: "gate-held",
            dst: dst.as_mut_ptr(),
            len: data.len(),
        };
        let t0 = Instant::now();
        // SAFETY: `dst` is valid for writes of `len` bytes, registered, and not otherwise
        // accessed during the call.
        let got = unsafe { store.get_into(&[get]) }.remove(0);
        let took = t0.elapsed();
        assert!(
            matches!(&got, Err(StoreError::Unavailable { .. })),
            "{got:?}"
        );
        assert!(
            took >= TRANSFER_WAIT - Duration::from_millis(500) && took < hang,
            "returned after {took:?}"
        );
        unregistering
            .join()
            .unwrap()
            .expect("the hung unregistration ends");
    });
    fail::remove("mooncake-unregister-held");
    // The gate is free again: the same read lands.
    let get = ObjectGet {
        key: "gate-held",
        dst: dst.as_mut_ptr(),
        len: data.len(),
    };
    // SAFETY: as above.
    let n = unsafe { store.get_into(&[get]) }.remove(0).expect("read");
    assert_eq!(&dst[..n as usize], &data[..]);
    store.unregister(dst_region).expect("unregister");
    drop(store);
}
