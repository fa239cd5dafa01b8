//! `MooncakeStore` against a real Mooncake master.
//!
//! Run: `scripts/mooncake-build-shim.sh && scripts/with-mooncake.sh cargo test -p mooncake-linker
//! --test mooncake_store`. Without `MOONCAKE_MASTER` the tests skip with a message;
//! `KVLINK_REQUIRE_MOONCAKE=1` (CI) turns that into a failure.
//!
//! One test uses the master `with-mooncake.sh` started, through `MooncakeConfig::from_env`.
//! The others each start a private `mooncake_master` (`MOONCAKE_MASTER_BIN`) on a free
//! loopback port, so that no test's objects live in another test's segment (a segment goes
//! away with its client) and the store-full and master-killed tests control the whole cluster.

mod common;

use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{available, env, free_port, unique, PrivateMaster};

use kv_geometry::layer_checksum;
use mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use mooncake_linker::store::{
    KvStore, MemoryRegion, ObjectGet, ObjectPut, PutOutcome, RangeChecksums, RangedGet, ReadRange,
    StoreError,
};

// ---------------------------------------------------------------------------------- helpers

/// The same bytes the Python side generates: `(i * 131 + seed) % 251`.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| ((i * 131 + seed) % 251) as u8)
        .collect()
}

fn put_one(store: &dyn KvStore, key: &str, data: &[u8]) -> Result<PutOutcome, StoreError> {
    let put = ObjectPut {
        key,
        parts: [(data.as_ptr(), data.len())].into_iter().collect(),
    };
    // SAFETY: `data` is valid for reads of its length for the whole call.
    unsafe { store.put(&[put]) }.remove(0)
}

fn get_one(store: &dyn KvStore, key: &str, cap: usize) -> Result<Vec<u8>, StoreError> {
    let mut buf = vec![0u8; cap];
    let get = ObjectGet {
        key,
        dst: buf.as_mut_ptr(),
        len: cap,
    };
    // SAFETY: `buf` is valid for writes of `cap` bytes and not otherwise accessed.
    let n = unsafe { store.get_into(&[get]) }.remove(0)?;
    buf.truncate(n as usize);
    Ok(buf)
}

/// One ranged read of `key`'s first `len` bytes (through its read session).
fn ranged_one(store: &dyn KvStore, key: &str, len: usize) -> Result<Vec<u8>, StoreError> {
    let mut buf = vec![0u8; len];
    let get = RangedGet {
        key,
        ranges: [ReadRange {
            dst: buf.as_mut_ptr(),
            len,
            offset: 0,
        }]
        .into_iter()
        .collect(),
    };
    // SAFETY: `buf` is valid for writes of `len` bytes and not otherwise accessed during the
    // call; kept for good below when the read ends `Abandoned` (its transfer may still write).
    match unsafe { store.get_ranges(&[get]) }.remove(0) {
        Ok(n) => {
            buf.truncate(n as usize);
            Ok(buf)
        }
        Err(e) => {
            if matches!(e, StoreError::Abandoned { .. }) {
                std::mem::forget(buf);
            }
            Err(e)
        }
    }
}

/// Runs the wheel's Python client on `script`, bounded: `timeout` ends it after two minutes
/// (a hung client would hold the test for good).
fn python(script: &str, args: &[&str]) -> std::process::Output {
    let py = env("MOONCAKE_PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new("timeout")
        .args(["--kill-after=5", "120"])
        .arg(py)
        .env(
            "PYTHONPATH",
            env("MOONCAKE_PYTHONPATH").expect("MOONCAKE_PYTHONPATH"),
        )
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run the wheel's Python client");
    assert!(
        out.status.success(),
        "python failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Python prelude: a pure client (no segment) of the master in argv[1].
const PY_CLIENT: &str = r#"
import sys
from mooncake.store import MooncakeDistributedStore
def pattern(seed, n):
    return bytes((i * 131 + seed) % 251 for i in range(n))
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", sys.argv[1])
assert rc == 0, f"setup {rc}"
"#;

// ---------------------------------------------------------------------------------- tests

/// The master of with-mooncake.sh, configured exactly as SGLang would be (environment).
#[test]
fn from_env_round_trip_exists_missing_remove() {
    if !available("from_env_round_trip_exists_missing_remove", &[]) {
        return;
    }
    let cfg = MooncakeConfig::from_env().expect("MOONCAKE_* environment");
    let store = MooncakeStore::connect(cfg).expect("connect");
    store.health().unwrap();
    assert_eq!(store.name(), "mooncake");

    let a = unique("rt-a");
    let data = pattern(3, 100_000);
    assert_eq!(put_one(&store, &a, &data), Ok(PutOutcome::Written));
    assert_eq!(
        put_one(&store, &a, &pattern(4, 100_000)),
        Ok(PutOutcome::AlreadyPresent)
    );
    assert_eq!(
        get_one(&store, &a, 200_000).unwrap(),
        data,
        "first write wins"
    );
    assert_eq!(store.object_size(&[&a]), vec![Ok(100_000)]);

    // Multi-part put: the object is the concatenation.
    let b = unique("rt-b");
    let (p1, p2) = (pattern(5, 1000), pattern(6, 3000));
    let put = ObjectPut {
        key: &b,
        parts: [(p1.as_ptr(), p1.len()), (p2.as_ptr(), p2.len())]
            .into_iter()
            .collect(),
    };
    // SAFETY: both parts are valid for reads for the call.
    assert_eq!(unsafe { store.put(&[put]) }, vec![Ok(PutOutcome::Written)]);
    assert_eq!(get_one(&store, &b, 4000).unwrap(), [p1, p2].concat());

    // exists / missing.
    let missing = unique("rt-missing");
    assert_eq!(
        store.exists(&[&a, &missing, &b]),
        vec![Ok(true), Ok(false), Ok(true)]
    );
    assert_eq!(
        get_one(&store, &missing, 16),
        Err(StoreError::NotFound {
            key: missing.clone()
        })
    );
    assert_eq!(
        store.object_size(&[&missing]),
        vec![Err(StoreError::NotFound {
            key: missing.clone()
        })]
    );
    // A too-small destination is the caller's error, for that key.
    assert!(matches!(
        get_one(&store, &a, 10),
        Err(StoreError::InvalidArgument { key, .. }) if key == a
    ));

    // remove: a never-read object goes at once; a just-read one holds a lease.
    let c = unique("rt-c");
    put_one(&store, &c, &pattern(7, 64)).unwrap();
    assert_eq!(store.remove(&[&c]), vec![Ok(())]);
    assert_eq!(store.exists(&[&c]), vec![Ok(false)]);
    assert!(matches!(&store.remove(&[&a])[0], Err(StoreError::Lease { key, .. }) if *key == a));
    assert_eq!(
        store.remove(&[&missing]),
        vec![Err(StoreError::NotFound {
            key: missing.clone()
        })]
    );
}

/// The replace path's remove: an object found bad goes even while a read lease holds it
/// (the load or lookup that found it took one), where a plain remove is refused.
#[test]
fn discard_removes_an_object_a_lease_holds() {
    if !available(
        "discard_removes_an_object_a_lease_holds",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store = MooncakeStore::connect(master.config(64 << 20)).expect("connect");
    let key = unique("bad");
    put_one(&store, &key, &pattern(1, 4096)).unwrap();
    assert_eq!(get_one(&store, &key, 4096).unwrap().len(), 4096); // a read: a lease
    assert!(matches!(
        &store.remove(&[&key])[0],
        Err(StoreError::Lease { .. })
    ));
    assert_eq!(store.discard(&[&key]), vec![Ok(())]);
    assert_eq!(store.exists(&[&key]), vec![Ok(false)]);
    assert!(matches!(
        &store.discard(&[&key])[0],
        Err(StoreError::NotFound { .. })
    ));
    // And the next put writes it again (first-write-wins no longer keeps the bad one).
    assert_eq!(
        put_one(&store, &key, &pattern(2, 4096)),
        Ok(PutOutcome::Written)
    );
}

/// On a master in strict multi-tenant mode (`--enable_multi_tenants`, tenants `tenant-a` and
/// `tenant-b` registered), clients of one tenant share objects and clients of the other do
/// not see them (`MooncakeConfig::tenant`, `MOONCAKE_TENANT_ID`). Before, every kvlink client
/// joined the `default` tenant whatever the deployment said: there, unregistered, every put
/// failed, and kvlink found none of its tenant's objects. (Without strict mode this wheel's
/// master keeps one key space for every tenant: measured, with its Python client too.)
#[test]
fn clients_of_a_tenant_share_objects_and_other_tenants_do_not_see_them() {
    if !available(
        "clients_of_a_tenant_share_objects_and_other_tenants_do_not_see_them",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let policy = std::env::temp_dir().join(format!("{}.yaml", unique("kvlink-tenants")));
    let quota = 1u64 << 30;
    std::fs::write(
        &policy,
        format!(
            "version: 1\ntenants:\n  - name: tenant-a\n    quota: {quota}\n  - name: \
             tenant-b\n    quota: {quota}\n"
        ),
    )
    .unwrap();
    let _policy_removed = RemovedOnDrop(policy.clone());
    let uri = format!("--tenant_quota_connector_uri={}", policy.display());
    let master = PrivateMaster::start(&["--enable_multi_tenants=true", &uri]);
    let of = |tenant: &str| {
        MooncakeStore::connect(master.config(32 << 20).tenant(tenant)).expect("connect")
    };
    let (a, a_again, b) = (of("tenant-a"), of("tenant-a"), of("tenant-b"));
    let unregistered = of("default");
    assert!(
        put_one(&unregistered, &unique("tenant"), &pattern(8, 4096)).is_err(),
        "a put of an unregistered tenant"
    );
    let key = unique("tenant");
    let data = pattern(9, 8192);
    assert_eq!(put_one(&a, &key, &data), Ok(PutOutcome::Written));
    assert_eq!(a_again.exists(&[&key]), vec![Ok(true)]);
    assert_eq!(get_one(&a_again, &key, 8192).unwrap(), data);
    assert_eq!(
        b.exists(&[&key]),
        vec![Ok(false)],
        "another tenant's object"
    );
    // The other tenant writes its own object under the same key.
    let theirs = pattern(10, 8192);
    assert_eq!(put_one(&b, &key, &theirs), Ok(PutOutcome::Written));
    assert_eq!(get_one(&b, &key, 8192).unwrap(), theirs);
    assert_eq!(get_one(&a, &key, 8192).unwrap(), data);
}

/// Removes its file when dropped (a test's temporary file, also when the test fails).
struct RemovedOnDrop(std::path::PathBuf);

impl Drop for RemovedOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// A copying put (registered-only memory, as over RDMA) goes through the client's local
/// buffer: an object larger than it is refused saying so, and the puts after it in the same
/// call still go. Before, the wheel's INVALID_PARAMS came back, and the first failure made
/// every later copying put of the call `Unavailable` unwritten.
#[test]
fn an_object_larger_than_the_local_buffer_is_refused_alone() {
    if !available(
        "an_object_larger_than_the_local_buffer_is_refused_alone",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let config = master
        .config(64 << 20)
        .registered_only(true)
        .local_buffer_size(1 << 20);
    let store = MooncakeStore::connect(config).expect("connect");
    let (big, small) = (unique("too-big"), unique("fits"));
    let (big_bytes, small_bytes) = (pattern(1, 2 << 20), pattern(2, 64 << 10));
    let puts = [
        ObjectPut {
            key: &big,
            parts: [(big_bytes.as_ptr(), big_bytes.len())]
                .into_iter()
                .collect(),
        },
        ObjectPut {
            key: &small,
            parts: [(small_bytes.as_ptr(), small_bytes.len())]
                .into_iter()
                .collect(),
        },
    ];
    // SAFETY: both sources are valid for reads of their lengths for the whole call.
    let out = unsafe { store.put(&puts) };
    match &out[0] {
        Err(StoreError::InvalidArgument { detail, .. }) => {
            assert!(detail.contains("local buffer"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        out[1],
        Ok(PutOutcome::Written),
        "the put after it still went"
    );
    assert_eq!(get_one(&store, &small, 64 << 10).unwrap(), small_bytes);
}

/// With only registered memory moving in place (as over RDMA; `registered_only` over TCP
/// here), whole-object reads into unregistered buffers go through the store's registered
/// bounce and land byte for byte, alone or beside a read into a registered region in the
/// same call, short objects included; before, they were refused.
#[test]
fn whole_reads_into_unregistered_memory_go_through_the_bounce() {
    if !available(
        "whole_reads_into_unregistered_memory_go_through_the_bounce",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store =
        MooncakeStore::connect(master.config(64 << 20).registered_only(true)).expect("connect");
    let keys: Vec<String> = (0..3).map(|i| unique(&format!("bounce{i}"))).collect();
    let sizes = [4096usize, 10_000, 3 << 20];
    for (i, (k, &n)) in keys.iter().zip(&sizes).enumerate() {
        put_one(&store, k, &pattern(i as u64, n)).unwrap();
    }
    // One at a time, into unregistered buffers (the last needs a larger bounce).
    for (i, (k, &n)) in keys.iter().zip(&sizes).enumerate() {
        assert_eq!(get_one(&store, k, n).unwrap(), pattern(i as u64, n), "{k}");
    }
    // A short object into a larger buffer: its bytes, and its length.
    assert_eq!(get_one(&store, &keys[0], 8192).unwrap(), pattern(0, 4096));
    // One call: an unregistered destination beside a registered one.
    let mut registered = vec![0u8; sizes[1]];
    let region = MemoryRegion {
        addr: registered.as_mut_ptr() as usize,
        len: registered.len(),
    };
    // SAFETY: `registered` outlives the registration (unregistered below, before it drops).
    unsafe { store.register(region) }.unwrap();
    let mut own = vec![0u8; sizes[0]];
    let gets = [
        ObjectGet {
            key: &keys[0],
            dst: own.as_mut_ptr(),
            len: own.len(),
        },
        ObjectGet {
            key: &keys[1],
            dst: registered.as_mut_ptr(),
            len: registered.len(),
        },
    ];
    // SAFETY: both buffers are valid for writes of their lengths, distinct, and untouched
    // during the call.
    let got = unsafe { store.get_into(&gets) };
    assert_eq!(got, vec![Ok(sizes[0] as u64), Ok(sizes[1] as u64)]);
    assert_eq!(own, pattern(0, sizes[0]));
    assert_eq!(registered, pattern(1, sizes[1]));
    store.unregister(region).unwrap();
    // Ranged reads have no bounce: into unregistered memory they are refused, as before.
    let mut into = vec![0u8; 64];
    let ranged = RangedGet {
        key: &keys[0],
        ranges: [ReadRange {
            dst: into.as_mut_ptr(),
            len: 64,
            offset: 0,
        }]
        .into_iter()
        .collect(),
    };
    // SAFETY: `into` is valid for writes of 64 bytes and untouched during the call.
    let refused = unsafe { store.get_ranges(&[ranged]) }.remove(0);
    assert!(
        matches!(refused, Err(StoreError::InvalidArgument { .. })),
        "{refused:?}"
    );
}

/// Pages are objects laid out layer after layer; a load reads a few layers of every page
/// straight into a layer-major pool, as the linker does.
#[test]
fn ranged_reads_of_several_layers_of_several_pages() {
    if !available(
        "ranged_reads_of_several_layers_of_several_pages",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store = MooncakeStore::connect(master.config(64 << 20)).expect("connect");
    const PAGES: usize = 5;
    const LAYERS: usize = 6;
    const LAYER_BYTES: usize = 4096;
    let keys: Vec<String> = (0..PAGES).map(|p| unique(&format!("page{p}"))).collect();
    let objects: Vec<Vec<u8>> = (0..PAGES)
        .map(|p| pattern(p as u64 * 17 + 1, LAYERS * LAYER_BYTES))
        .collect();
    for (k, o) in keys.iter().zip(&objects) {
        assert_eq!(put_one(&store, k, o), Ok(PutOutcome::Written));
    }

    // pool[layer][page] = LAYER_BYTES; read layers 1, 3 and 4.
    let read_layers = [1usize, 3, 4];
    let mut pool = vec![0u8; LAYERS * PAGES * LAYER_BYTES];
    let region = MemoryRegion {
        addr: pool.as_mut_ptr() as usize,
        len: pool.len(),
    };
    // SAFETY: `pool` stays allocated until the `unregister` at the end of this test (a failed
    // assertion ends the test with no transfer after it).
    unsafe { store.register(region) }.unwrap();
    let base = pool.as_mut_ptr();
    let slot = |layer: usize, page: usize| (layer * PAGES + page) * LAYER_BYTES;

    let gets = |pages: &[usize]| -> Vec<RangedGet<'_>> {
        pages
            .iter()
            .map(|&p| RangedGet {
                key: &keys[p],
                ranges: read_layers
                    .iter()
                    .map(|&l| ReadRange {
                        // SAFETY: slot() < pool.len() - LAYER_BYTES, inside `pool`.
                        dst: unsafe { base.add(slot(l, p)) },
                        len: LAYER_BYTES,
                        offset: (l * LAYER_BYTES) as u64,
                    })
                    .collect(),
            })
            .collect()
    };
    // Without an explicit session (the store opens one for the call), pages 0..3 ...
    let first = gets(&[0, 1, 2]);
    // SAFETY: the destinations are distinct slots of `pool`, registered, untouched meanwhile.
    let got = unsafe { store.get_ranges(&first) };
    assert_eq!(got, vec![Ok((3 * LAYER_BYTES) as u64); 3]);
    // ... and inside an explicit session, the rest.
    let rest: Vec<&str> = keys[3..].iter().map(String::as_str).collect();
    let session = store.start_session(&rest).unwrap();
    assert_eq!(session.lease, Some(Duration::from_secs(10)));
    let second = gets(&[3, 4]);
    // SAFETY: as above.
    let got = unsafe { store.get_ranges(&second) };
    assert_eq!(got, vec![Ok((3 * LAYER_BYTES) as u64); 2]);
    store.end_session(&session).unwrap();

    for p in 0..PAGES {
        for l in 0..LAYERS {
            let s = &pool[slot(l, p)..slot(l, p) + LAYER_BYTES];
            if read_layers.contains(&l) {
                assert_eq!(
                    s,
                    &objects[p][l * LAYER_BYTES..(l + 1) * LAYER_BYTES],
                    "page {p} layer {l}"
                );
            } else {
                assert!(
                    s.iter().all(|&b| b == 0),
                    "page {p} layer {l} must be untouched"
                );
            }
        }
    }

    // A batch can partly fail: a missing page and a range past the end, next to a good one.
    let missing = unique("page-missing");
    let mut small = vec![0u8; 2 * LAYER_BYTES];
    let sp = small.as_mut_ptr();
    let mixed = vec![
        RangedGet {
            key: &keys[0],
            ranges: [ReadRange {
                dst: sp,
                len: LAYER_BYTES,
                offset: 0,
            }]
            .into_iter()
            .collect(),
        },
        RangedGet {
            key: &missing,
            ranges: [ReadRange {
                // SAFETY: LAYER_BYTES + 16 <= small.len(): inside `small`.
                dst: unsafe { sp.add(LAYER_BYTES) },
                len: 16,
                offset: 0,
            }]
            .into_iter()
            .collect(),
        },
        RangedGet {
            key: &keys[1],
            ranges: [ReadRange {
                // SAFETY: LAYER_BYTES + 128 <= small.len(): inside `small`.
                dst: unsafe { sp.add(LAYER_BYTES + 64) },
                len: 64,
                offset: (LAYERS * LAYER_BYTES - 32) as u64,
            }]
            .into_iter()
            .collect(),
        },
    ];
    // SAFETY: distinct ranges of `small`, untouched meanwhile.
    let got = unsafe { store.get_ranges(&mixed) };
    assert_eq!(got[0], Ok(LAYER_BYTES as u64));
    assert_eq!(
        got[1],
        Err(StoreError::NotFound {
            key: missing.clone()
        })
    );
    assert!(
        matches!(&got[2], Err(StoreError::InvalidArgument { key, .. }) if *key == keys[1]),
        "{:?}",
        got[2]
    );
    assert_eq!(&small[..LAYER_BYTES], &objects[0][..LAYER_BYTES]);
    // Empty ranges read nothing and go nowhere: no session, no call, even for a key the store
    // does not have; beside a real range they change nothing.
    let empty = |key| RangedGet {
        key,
        ranges: [ReadRange {
            dst: sp,
            len: 0,
            offset: 0,
        }]
        .into_iter()
        .collect(),
    };
    // SAFETY: nothing is written (every range is empty).
    let got = unsafe { store.get_ranges(&[empty(&missing), empty(&keys[0])]) };
    assert_eq!(got, vec![Ok(0), Ok(0)]);
    store.unregister(region).unwrap();
}

/// A store with several read streams splits a large ranged read into concurrent calls and
/// merges ranges adjacent in object and memory: the bytes and the per-key results (a missing
/// key, a range past the end) come out the same as one call's.
#[test]
fn ranged_reads_in_streams_land_every_byte_and_keep_per_key_results() {
    if !available(
        "ranged_reads_in_streams_land_every_byte_and_keep_per_key_results",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store = MooncakeStore::connect(master.config(192 << 20).read_streams(4)).expect("connect");
    assert_eq!(store.config().read_streams_count(), 4);
    // One stream, staged: 72 MiB in calls of at most 32 MiB of scratch, each call's copies
    // out of scratch overlapping the next call.
    let single = MooncakeStore::connect(master.config(0).read_streams(1).staged_merge(true))
        .expect("connect");
    const PAGES: usize = 12;
    const LAYERS: usize = 6;
    const LAYER_BYTES: usize = 1 << 20;
    const OBJ: usize = LAYERS * LAYER_BYTES;
    let keys: Vec<String> = (0..PAGES).map(|p| unique(&format!("stream{p}"))).collect();
    let objects: Vec<Vec<u8>> = (0..PAGES).map(|p| pattern(p as u64 + 40, OBJ)).collect();
    for (k, o) in keys.iter().zip(&objects) {
        assert_eq!(put_one(&store, k, o), Ok(PutOutcome::Written));
    }
    let missing = unique("stream-missing");
    let mut names: Vec<&str> = keys.iter().map(String::as_str).collect();
    names.insert(5, &missing);
    let mut buf = vec![0u8; (PAGES + 1) * OBJ];
    let region = MemoryRegion {
        addr: buf.as_mut_ptr() as usize,
        len: buf.len(),
    };
    // SAFETY: `buf` stays allocated until the `unregister`s at the end of this test (a failed
    // assertion ends the test with no transfer after it).
    unsafe { store.register(region) }.unwrap();
    // SAFETY: as above.
    unsafe { single.register(region) }.unwrap();
    let base = buf.as_mut_ptr();
    // Page-major: a page's layers are adjacent in memory as in the object (merged into one
    // range per key). Layer-major: they are not (a range each).
    for (reader, page_major) in [(&store, true), (&store, false), (&single, false)] {
        let slot = |i: usize, l: usize| {
            if page_major {
                i * OBJ + l * LAYER_BYTES
            } else {
                (l * (PAGES + 1) + i) * LAYER_BYTES
            }
        };
        let gets: Vec<RangedGet<'_>> = names
            .iter()
            .enumerate()
            .map(|(i, key)| RangedGet {
                key,
                ranges: (0..LAYERS)
                    .map(|l| {
                        // The last key's last range runs past the end of its object.
                        let past_end = i == PAGES && l == LAYERS - 1;
                        ReadRange {
                            // SAFETY: slot(i, l) + LAYER_BYTES <= buf.len(): inside `buf`.
                            dst: unsafe { base.add(slot(i, l)) },
                            len: if past_end { 1024 } else { LAYER_BYTES },
                            offset: if past_end {
                                (OBJ - 512) as u64
                            } else {
                                (l * LAYER_BYTES) as u64
                            },
                        }
                    })
                    .collect(),
            })
            .collect();
        // Checksums asked for: taken of the ranges the store copies out of its scratch.
        let mut sums: Vec<RangeChecksums> = gets
            .iter()
            .map(|g| smallvec::smallvec![None; g.ranges.len()])
            .collect();
        // SAFETY: distinct slots of `buf`, registered, untouched meanwhile.
        let got = unsafe { reader.get_ranges_checksummed(&gets, &mut sums) };
        assert_eq!(got.len(), PAGES + 1);
        for (i, r) in got.iter().enumerate() {
            if i == 5 {
                assert_eq!(
                    *r,
                    Err(StoreError::NotFound {
                        key: missing.clone()
                    })
                );
            } else if i == PAGES {
                assert!(
                    matches!(r, Err(StoreError::InvalidArgument { key, .. }) if key == names[i]),
                    "{r:?}"
                );
            } else {
                assert_eq!(*r, Ok(OBJ as u64), "key {i} (page-major {page_major})");
            }
        }
        for (i, key) in names.iter().enumerate().take(PAGES) {
            let Some(p) = keys.iter().position(|k| k == key) else {
                continue;
            };
            for l in 0..LAYERS {
                let landed = &buf[slot(i, l)..slot(i, l) + LAYER_BYTES];
                assert!(
                    landed == &objects[p][l * LAYER_BYTES..(l + 1) * LAYER_BYTES],
                    "page {p} layer {l} (page-major {page_major})"
                );
                // Page-major: one range straight into `buf`, nothing copied, no checksum.
                // Layer-major, staged: every range copied out of scratch, each checksum that
                // of the bytes that landed.
                let want = (!page_major && reader.config().staged_merge_enabled())
                    .then(|| layer_checksum(landed));
                assert_eq!(
                    sums[i][l], want,
                    "page {p} layer {l} (page-major {page_major})"
                );
            }
        }
        buf.fill(0);
    }
    store.unregister(region).unwrap();
    single.unregister(region).unwrap();
}

#[test]
fn store_full_is_no_space_with_the_key() {
    if !available(
        "store_full_is_no_space_with_the_key",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    // The only segment of this cluster: 16 MiB (Mooncake's minimum).
    let store = MooncakeStore::connect(master.config(16 << 20)).expect("connect");
    let big_key = unique("full-big");
    let big = pattern(1, 32 << 20);
    assert!(
        matches!(put_one(&store, &big_key, &big), Err(StoreError::NoSpace { key, .. }) if key == big_key),
        "an object larger than the whole pool"
    );
    // A batch that overflows: some keys fail with NoSpace, each error names its key.
    let keys: Vec<String> = (0..40).map(|i| unique(&format!("full-{i}"))).collect();
    let data = pattern(2, 1 << 20);
    let puts: Vec<ObjectPut<'_>> = keys
        .iter()
        .map(|k| ObjectPut {
            key: k,
            parts: [(data.as_ptr(), data.len())].into_iter().collect(),
        })
        .collect();
    // SAFETY: `data` is valid for reads for the call.
    let got = unsafe { store.put(&puts) };
    let full: Vec<&String> = got
        .iter()
        .zip(&keys)
        .filter_map(|(r, k)| match r {
            Err(StoreError::NoSpace { key, .. }) => {
                assert_eq!(key, k);
                Some(k)
            }
            Ok(PutOutcome::Written) => None,
            other => panic!("{k}: unexpected {other:?}"),
        })
        .collect();
    assert!(
        !full.is_empty(),
        "24 MiB into an 8 MiB pool must not all fit"
    );
    assert!(full.len() < keys.len(), "some objects fit");
}

#[test]
fn python_client_writes_rust_reads_byte_for_byte() {
    if !available(
        "python_client_writes_rust_reads_byte_for_byte",
        &["MOONCAKE_MASTER_BIN", "MOONCAKE_PYTHONPATH"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    // The Rust store holds the only segment, so the Python client's put lands in it and
    // outlives the Python process.
    let store = MooncakeStore::connect(master.config(64 << 20)).expect("connect");
    let key = unique("py2rs");
    let n = (1 << 20) + 123;
    python(
        &format!(
            "{PY_CLIENT}\nrc = s.put(sys.argv[2], pattern(11, {n}))\nassert rc == 0, rc\ns.close()"
        ),
        &[&master.addr, &key],
    );
    let got = get_one(&store, &key, n + 100).unwrap();
    assert_eq!(got.len(), n);
    assert!(got == pattern(11, n), "bytes differ");
}

#[test]
fn rust_writes_python_client_reads_byte_for_byte() {
    if !available(
        "rust_writes_python_client_reads_byte_for_byte",
        &["MOONCAKE_MASTER_BIN", "MOONCAKE_PYTHONPATH"],
    ) {
        return;
    }
    let master = PrivateMaster::start(&[]);
    let store = MooncakeStore::connect(master.config(64 << 20)).expect("connect");
    let key = unique("rs2py");
    let n = (1 << 20) + 77;
    let data = pattern(23, n);
    assert_eq!(put_one(&store, &key, &data), Ok(PutOutcome::Written));
    let out = std::env::temp_dir().join(format!("{key}.bin"));
    python(
        &format!(
            "{PY_CLIENT}\nv = s.get(sys.argv[2])\nassert len(v) == {n}, len(v)\n\
             open(sys.argv[3], 'wb').write(v)\ns.close()"
        ),
        &[&master.addr, &key, out.to_str().unwrap()],
    );
    let got = std::fs::read(&out).unwrap();
    let _ = std::fs::remove_file(&out);
    assert!(got == data, "bytes differ");
}

#[test]
fn master_killed_mid_batch_is_a_typed_error_in_bounded_time() {
    if !available(
        "master_killed_mid_batch_is_a_typed_error_in_bounded_time",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    let mut master = PrivateMaster::start(&[]);
    let store = Arc::new(MooncakeStore::connect(master.config(64 << 20)).expect("connect"));
    const N: usize = 32;
    const SIZE: usize = 256 << 10;
    let keys: Vec<String> = (0..N).map(|i| unique(&format!("kill{i}"))).collect();
    let data = pattern(5, SIZE);
    for k in &keys {
        put_one(&*store, k, &data).unwrap();
    }

    // A reader loops over batched ranged reads until one fails.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let reader = {
        let (store, keys, stop) = (Arc::clone(&store), keys.clone(), Arc::clone(&stop));
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let mut dst = vec![0u8; N * SIZE];
            let base = dst.as_mut_ptr();
            let mut ok_batches = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let gets: Vec<RangedGet<'_>> = keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| RangedGet {
                        key: k,
                        ranges: [ReadRange {
                            // SAFETY: slot i of `dst`.
                            dst: unsafe { base.add(i * SIZE) },
                            len: SIZE,
                            offset: 0,
                        }]
                        .into_iter()
                        .collect(),
                    })
                    .collect();
                // SAFETY: distinct slots of `dst`, owned by this thread.
                let got = unsafe { store.get_ranges(&gets) };
                if let Some(e) = got.into_iter().find_map(Result::err) {
                    return (ok_batches, Some((Instant::now(), e)));
                }
                ok_batches += 1;
                done.store(ok_batches, Ordering::Relaxed);
            }
            (ok_batches, None)
        })
    };
    // The master is killed once the reader has read a batch (bounded).
    let by = Instant::now() + Duration::from_secs(30);
    while done.load(Ordering::Relaxed) == 0 && !reader.is_finished() {
        assert!(Instant::now() < by, "no batch read in 30 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    let killed_at = Instant::now();
    master.kill();
    // Bounded: the reader must report within 30 s (measured: well under 5 s).
    let deadline = killed_at + Duration::from_secs(30);
    while !reader.is_finished() {
        if Instant::now() > deadline {
            stop.store(true, Ordering::Relaxed);
            panic!("no error 30 s after the master was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let (ok_batches, failure) = reader.join().unwrap();
    let (failed_at, err) = failure.expect("reads must fail once the master is gone");
    assert!(ok_batches > 0, "some batches ran before the kill");
    let elapsed = failed_at.saturating_duration_since(killed_at);
    assert!(elapsed < Duration::from_secs(30), "{elapsed:?}");
    assert!(
        matches!(
            err,
            StoreError::Unavailable { .. }
                | StoreError::RpcTimeout { .. }
                | StoreError::TransferFailed { .. }
        ),
        "{err:?}"
    );
    // Other calls fail typed too.
    let exists = store.exists(&[&keys[0]]);
    assert!(
        matches!(
            exists[0],
            Err(StoreError::Unavailable { .. } | StoreError::RpcTimeout { .. })
        ),
        "{exists:?}"
    );
    // Health follows the client's heartbeat to the master: it turns within a few periods.
    let deadline = killed_at + Duration::from_secs(30);
    while store.health().is_ok() {
        assert!(
            Instant::now() < deadline,
            "health still ok 30 s after the kill"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    report(&format!(
        "master killed: first failed batch after {elapsed:?} ({err}); health unavailable after {:?}",
        killed_at.elapsed()
    ));
}

/// A master that crashes and is restarted on its port by its supervisor (empty: it lost its
/// objects and segments). The client must come back to it without a new store: its calls are
/// typed errors meanwhile, then answer again (the lost objects missing), a put is written and
/// reads back byte for byte, and a read of a lost object fails rather than returning bytes.
#[test]
fn a_master_restarted_on_its_port_serves_the_client_again() {
    if !available(
        "a_master_restarted_on_its_port_serves_the_client_again",
        &["MOONCAKE_MASTER_BIN"],
    ) {
        return;
    }
    // A long lease (the master's and the store's alike): the session opened below is still
    // joined without the master after the restart.
    let mut master = PrivateMaster::start(&["--default_kv_lease_ttl=60000"]);
    let store = MooncakeStore::connect(master.config(64 << 20).lease(Duration::from_secs(60)))
        .expect("connect");
    const SIZE: usize = 256 << 10;
    let lost = unique("restart-lost");
    let lost_data = pattern(8, SIZE);
    let data = pattern(9, SIZE);
    put_one(&store, &lost, &lost_data).unwrap();
    assert_eq!(get_one(&store, &lost, SIZE).unwrap(), lost_data);
    // A read session held across the restart (as a load's pin): a ranged read joins it
    // without the master for half the lease.
    let session = store.start_session(&[&lost]).unwrap();
    assert_eq!(ranged_one(&store, &lost, SIZE).unwrap(), lost_data);
    let restarted_at = Instant::now();
    master.restart();
    // Bounded: the client answers again within a minute (its heartbeat reconnects, then
    // remounts its segment).
    let by = restarted_at + Duration::from_secs(60);
    let mut last = None;
    // A key of its own per attempt: a put that got part way cannot answer the next one
    // `AlreadyPresent`.
    let (fresh, written) = loop {
        assert!(
            Instant::now() < by,
            "no put written a minute after the restart: {last:?}"
        );
        let fresh = unique("restart-fresh");
        match put_one(&store, &fresh, &data) {
            Ok(outcome) => break (fresh, outcome),
            Err(e) => {
                assert!(
                    matches!(
                        e,
                        StoreError::Unavailable { .. }
                            | StoreError::RpcTimeout { .. }
                            | StoreError::NoSpace { .. }
                            | StoreError::Lease { .. }
                            | StoreError::TransferFailed { .. }
                            | StoreError::Other { .. }
                    ),
                    "{e:?}"
                );
                last = Some(e);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    };
    let served_after = restarted_at.elapsed();
    assert_eq!(written, PutOutcome::Written);
    assert_eq!(get_one(&store, &fresh, SIZE).unwrap(), data);
    // The session of the lost key, opened before the restart and still held: a ranged read
    // of it must not return bytes (the remounted segment's space may hold the fresh object
    // by now).
    let ranged = ranged_one(&store, &lost, SIZE);
    let _ = store.end_session(&session);
    assert!(
        ranged.is_err(),
        "a lost object's ranged read returned bytes {:.1} s after its session began (the \
         fresh object's: {})",
        restarted_at.elapsed().as_secs_f64(),
        ranged.as_ref().is_ok_and(|b| *b == data)
    );
    assert_eq!(
        store.exists(&[&lost])[0],
        Ok(false),
        "the restarted master lost it"
    );
    assert!(
        get_one(&store, &lost, SIZE).is_err(),
        "a lost object's read returned bytes"
    );
    report(&format!(
        "master restarted: first put written after {served_after:?} (last error before: {last:?})"
    ));
}

/// Measurements go to stderr (shown with --nocapture).
#[allow(clippy::print_stderr)]
fn report(line: &str) {
    eprintln!("[mooncake_store] {line}");
}

/// A child process of this test, killed (and reaped) on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A `mooncake_client` storage node of this test only; killed on drop.
struct StorageNode(Child);

impl StorageNode {
    fn start(master: &PrivateMaster, segment: &str) -> Self {
        let bin = env("MOONCAKE_CLIENT_BIN").expect("MOONCAKE_CLIENT_BIN");
        let port = free_port();
        let child = Command::new(bin)
            .arg("--host=127.0.0.1")
            .arg(format!("--port={port}"))
            .arg(format!("--global_segment_size={segment}"))
            .arg("--metadata_server=P2PHANDSHAKE")
            .arg(format!("--master_server_address={}", master.addr))
            .arg("--protocol=tcp")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start mooncake_client");
        // Built before the wait: a node that never listens is killed (on drop) too.
        let node = Self(child);
        let deadline = kv_loader::deadline_after(Duration::from_secs(20));
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "storage node not listening");
            std::thread::sleep(Duration::from_millis(50));
        }
        node
    }
}

impl Drop for StorageNode {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The median: the middle value, or the mean of the two middle ones for an even count (NaN
/// when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Rust `MooncakeStore` ranged batched reads vs the wheel's Python client `batch_get_into`, on
/// the same objects held by a separate storage node (`mooncake_client`), same run. Both readers
/// are pure clients in their own process, reading over TCP loopback.
#[test]
#[ignore = "benchmark: scripts/with-mooncake.sh cargo test -p mooncake-linker --test mooncake_store -- --ignored --nocapture"]
fn bench_rust_ranged_reads_vs_python_batch_get_into() {
    if !available(
        "bench_rust_ranged_reads_vs_python_batch_get_into",
        &[
            "MOONCAKE_MASTER_BIN",
            "MOONCAKE_CLIENT_BIN",
            "MOONCAKE_PYTHONPATH",
        ],
    ) {
        return;
    }
    const OBJECTS: usize = 64;
    const LAYERS: usize = 8;
    const LAYER_BYTES: usize = 128 << 10; // 1 MiB objects
    const OBJ: usize = LAYERS * LAYER_BYTES;
    const ITERS: usize = 20;
    let master = PrivateMaster::start(&[]);
    let _node = StorageNode::start(&master, "1 GB");
    // A pure client: every object lands on the storage node.
    let store =
        MooncakeStore::connect(master.config(0).local_buffer_size(64 << 20)).expect("connect");
    let total_bytes = OBJECTS * OBJ;
    let keys: Vec<String> = (0..OBJECTS).map(|i| unique(&format!("bench{i}"))).collect();
    let data: Vec<Vec<u8>> = (0..OBJECTS).map(|i| pattern(i as u64, OBJ)).collect();
    let puts: Vec<ObjectPut<'_>> = keys
        .iter()
        .zip(&data)
        .map(|(k, d)| ObjectPut {
            key: k,
            parts: [(d.as_ptr(), d.len())].into_iter().collect(),
        })
        .collect();
    // SAFETY: `data` outlives the call.
    assert!(unsafe { store.put(&puts) }
        .iter()
        .all(|r| r == &Ok(PutOutcome::Written)));

    let mut dst = vec![0u8; OBJECTS * OBJ];
    let region = MemoryRegion {
        addr: dst.as_mut_ptr() as usize,
        len: dst.len(),
    };
    // SAFETY: `dst` stays allocated until the `unregister` at the end of this benchmark.
    unsafe { store.register(region) }.unwrap();
    let base = dst.as_mut_ptr();
    let ranged = |layers: &[usize]| -> Vec<RangedGet<'_>> {
        keys.iter()
            .enumerate()
            .map(|(i, k)| RangedGet {
                key: k,
                ranges: layers
                    .iter()
                    .map(|&l| ReadRange {
                        // SAFETY: object slot i, layer l: inside `dst`.
                        dst: unsafe { base.add(i * OBJ + l * LAYER_BYTES) },
                        len: LAYER_BYTES,
                        offset: (l * LAYER_BYTES) as u64,
                    })
                    .collect(),
            })
            .collect()
    };
    let all_layers: Vec<usize> = (0..LAYERS).collect();
    let read_ranges = |gets: &[RangedGet<'_>]| {
        // SAFETY: distinct slots of `dst` (registered), untouched meanwhile.
        let got = unsafe { store.get_ranges(gets) };
        assert!(
            got.iter().all(Result::is_ok),
            "{:?}",
            got.iter().find(|r| r.is_err())
        );
    };
    let eight = ranged(&all_layers);
    let one_layer = ranged(&[3]);
    let whole_as_range: Vec<RangedGet<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| RangedGet {
            key: k,
            ranges: [ReadRange {
                // SAFETY: object slot i: inside `dst`.
                dst: unsafe { base.add(i * OBJ) },
                len: OBJ,
                offset: 0,
            }]
            .into_iter()
            .collect(),
        })
        .collect();
    let whole: Vec<ObjectGet<'_>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| ObjectGet {
            key: k,
            // SAFETY: object slot i: inside `dst`.
            dst: unsafe { base.add(i * OBJ) },
            len: OBJ,
        })
        .collect();
    let names: Vec<&str> = keys.iter().map(String::as_str).collect();

    // The wheel's Python client in its own process, reading the same objects on command, so
    // that its iterations interleave with the Rust ones (the machine's load drifts).
    let script = format!(
        r#"
import sys, ctypes, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", sys.argv[1]) == 0
keys = sys.argv[2].split(",")
buf = ctypes.create_string_buffer({OBJECTS} * {OBJ})
p = ctypes.addressof(buf)
assert s.register_buffer(p, {OBJECTS} * {OBJ}) == 0
ptrs = [p + i * {OBJ} for i in range(len(keys))]
L, LB = {LAYERS}, {LAYER_BYTES}
rptrs = [[q + l * LB for l in range(L)] for q in ptrs]
rsizes = [[LB] * L] * len(keys)
roffs = [[l * LB for l in range(L)]] * len(keys)
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.strip()
    t0 = time.perf_counter()
    if cmd == "get":
        r = s.batch_get_into(keys, ptrs, [{OBJ}] * len(keys))
    elif cmd == "ranges":
        assert all(x == 0 for x in s.batch_get_session_start(keys))
        r = s.batch_get_into_multi_buffer_ranges(keys, rptrs, rsizes, roffs)
        s.batch_get_session_end(keys)
    else:
        break
    dt = time.perf_counter() - t0
    assert all(x == {OBJ} for x in r), r
    print(dt, flush=True)
s.close()
"#
    );
    let py = Command::new(env("MOONCAKE_PYTHON").unwrap_or_else(|| "python3".into()))
        .env(
            "PYTHONPATH",
            env("MOONCAKE_PYTHONPATH").expect("MOONCAKE_PYTHONPATH"),
        )
        .arg("-c")
        .arg(&script)
        .arg(&master.addr)
        .arg(keys.join(","))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("start the Python reader");
    // Killed when the benchmark ends, also by a panic.
    let mut py = Reaped(py);
    let mut py_in = py.0.stdin.take().unwrap();
    let mut py_out = std::io::BufReader::new(py.0.stdout.take().unwrap());
    let mut py_line = |cmd: &str| -> f64 {
        use std::io::{BufRead, Write};
        if !cmd.is_empty() {
            writeln!(py_in, "{cmd}").unwrap();
            py_in.flush().unwrap();
        }
        let mut l = String::new();
        py_out.read_line(&mut l).unwrap();
        l.trim().parse().unwrap_or(f64::NAN)
    };
    py_line(""); // "ready"

    let timed = |f: &dyn Fn()| {
        let start = Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    // (name, bytes per iteration, times)
    let mut results: Vec<(String, usize, Vec<f64>)> = [
        "rust get_into (batch_get_into, whole objects)".to_owned(),
        "python batch_get_into (whole objects)".to_owned(),
        format!("rust get_ranges, {LAYERS} ranges/object"),
        format!("python session + {LAYERS} ranges/object + end"),
        "rust get_ranges, 1 range = whole object".to_owned(),
        format!("rust get_ranges, {LAYERS} ranges/object, explicit session"),
        "rust get_ranges, 1 layer/object".to_owned(),
    ]
    .into_iter()
    .enumerate()
    .map(|(i, n)| {
        (
            n,
            if i == 6 {
                total_bytes / LAYERS
            } else {
                total_bytes
            },
            Vec::new(),
        )
    })
    .collect();
    for _ in 0..ITERS {
        let round = [
            timed(&|| {
                // SAFETY: distinct slots of `dst` (registered), untouched meanwhile.
                let got = unsafe { store.get_into(&whole) };
                assert!(got.iter().all(Result::is_ok));
            }),
            py_line("get"),
            timed(&|| read_ranges(&eight)),
            py_line("ranges"),
            timed(&|| read_ranges(&whole_as_range)),
            timed(&|| {
                let session = store.start_session(&names).unwrap();
                read_ranges(&eight);
                store.end_session(&session).unwrap();
            }),
            timed(&|| read_ranges(&one_layer)),
        ];
        for (r, t) in results.iter_mut().zip(round) {
            r.2.push(t);
        }
    }
    py_line("quit");
    let _ = py.0.wait();
    for (i, d) in data.iter().enumerate() {
        assert!(dst[i * OBJ..(i + 1) * OBJ] == d[..], "object {i}");
    }
    store.unregister(region).unwrap();

    let gib = |bytes: usize, secs: f64| bytes as f64 / secs / f64::from(1u32 << 30);
    report(&format!(
        "{OBJECTS} objects x {LAYERS} layers x {} KiB on a storage node, TCP loopback, \
         interleaved, median of {ITERS} (min):",
        LAYER_BYTES >> 10
    ));
    let medians: Vec<f64> = results
        .iter()
        .map(|(name, bytes, t)| {
            let min = t.iter().copied().fold(f64::INFINITY, f64::min);
            let m = median(t.clone());
            report(&format!(
                "  {name:<56} {:>7.1} ms = {:.2} GiB/s  (best {:.2} GiB/s)",
                m * 1e3,
                gib(*bytes, m),
                gib(*bytes, min)
            ));
            m
        })
        .collect();
    report(&format!(
        "  python/rust time ratio: batch_get_into {:.2}; {LAYERS} ranges/object {:.2}; \
         rust ranged vs python batch_get_into {:.2}",
        medians[1] / medians[0],
        medians[3] / medians[2],
        medians[1] / medians[2]
    ));
}

/// Thousands of small objects read whole in one call (a 128K-token prefix's checksum
/// companions: 4,096 per rank) all arrive, in bounded time, each key's result in its place (a
/// key missing from the store, in the second of the calls the read is split into, fails alone).
/// The wheel's `batch_get_into` with that many keys over TCP stalled until its 60 s transfer
/// timeout on the GPU host; the store splits such reads into calls of at most
/// `mooncake::MAX_WHOLE_READS_PER_CALL` keys.
#[test]
fn thousands_of_small_objects_read_whole_in_one_call() {
    if !available(
        "thousands_of_small_objects_read_whole_in_one_call",
        &["MOONCAKE_MASTER_BIN", "MOONCAKE_CLIENT_BIN"],
    ) {
        return;
    }
    const OBJECTS: usize = 4096;
    const LEN: usize = 640;
    let master = PrivateMaster::start(&[]);
    let _node = StorageNode::start(&master, "256 MB");
    let store = Arc::new(MooncakeStore::connect(master.config(0)).expect("connect"));
    let keys: Vec<String> = (0..OBJECTS).map(|i| unique(&format!("small{i}"))).collect();
    let data: Vec<Vec<u8>> = (0..OBJECTS).map(|i| pattern(i as u64, LEN)).collect();
    for (k, d) in keys.chunks(256).zip(data.chunks(256)) {
        let puts: Vec<ObjectPut<'_>> = k
            .iter()
            .zip(d)
            .map(|(k, d)| ObjectPut {
                key: k,
                parts: [(d.as_ptr(), d.len())].into_iter().collect(),
            })
            .collect();
        // SAFETY: `data` outlives the call.
        let put = unsafe { store.put(&puts) };
        assert!(put.iter().all(|r| r == &Ok(PutOutcome::Written)), "{put:?}");
    }
    // Read list: every object, with a key the store does not hold at index MISSING.
    const MISSING: usize = 1500;
    let mut wanted = keys.clone();
    wanted.insert(MISSING, unique("never-written"));
    let (tx, rx) = std::sync::mpsc::channel();
    let reader = {
        let (store, keys) = (store.clone(), wanted);
        std::thread::spawn(move || {
            let mut bufs = vec![vec![0u8; LEN]; OBJECTS + 1];
            let gets: Vec<ObjectGet<'_>> = keys
                .iter()
                .zip(bufs.iter_mut())
                .map(|(key, b)| ObjectGet {
                    key,
                    dst: b.as_mut_ptr(),
                    len: b.len(),
                })
                .collect();
            let t = Instant::now();
            // SAFETY: each destination is a buffer of this thread, of its length, distinct,
            // untouched until the call returns.
            let got = unsafe { store.get_into(&gets) };
            let took = t.elapsed();
            let _ = tx.send((got, bufs, took));
        })
    };
    let (mut got, mut bufs, took) = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("4,096 whole reads in one call did not return within 30 s");
    let _ = reader.join();
    report(&format!(
        "{OBJECTS} objects of {LEN} B read whole in one call: {took:?}"
    ));
    let missing = got.remove(MISSING);
    assert!(missing.is_err(), "{missing:?}");
    bufs.remove(MISSING);
    assert!(
        got.iter().all(|r| r == &Ok(LEN as u64)),
        "{:?}",
        got.iter().find(|r| r != &&Ok(LEN as u64))
    );
    for (i, b) in bufs.iter().enumerate() {
        assert_eq!(b, &data[i], "object {i}");
    }
}
