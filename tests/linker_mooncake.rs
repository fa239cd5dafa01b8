//! The linker over a real Mooncake store (one client per TP rank, master on loopback):
//! save, layer-wise load in every mode, a missing object.
//!
//! Run: `scripts/mooncake-build-shim.sh && scripts/with-mooncake.sh cargo test --test
//! linker_mooncake`. Without `MOONCAKE_MASTER` the tests skip with a message;
//! `KVLINK_REQUIRE_MOONCAKE=1` (CI) turns that into a failure.

mod common;
// The private master of the mooncake-linker crate's own Mooncake tests.
#[path = "../crates/mooncake-linker/tests/common/mod.rs"]
mod private_master;

use std::sync::Arc;
use std::time::Duration;

use common::sessions::Sessions;
use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{KvGeometry, PageHash};
use kvlink::kv_loader::{BatchOutcome, KvLoader, ShareMode};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::KvStore;
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};
use private_master::PrivateMaster;

/// A `mooncake_master` of this test only (killed on drop) and `n` clients of it, each lending
/// its segment to the pool as `MOONCAKE_GLOBAL_SEGMENT_SIZE` says. Private, because a master
/// places an object in any mounted segment and drops it when that segment's client goes: on
/// the master this binary's tests shared, a test that ended took other tests' objects with it
/// (a CI run lost a page of `a_load_takes_its_lookups_pins_over_mooncake` that way, `NotFound`).
#[allow(clippy::print_stderr)] // the skip message is the point
fn mooncake_clients(n: usize) -> Option<(PrivateMaster, Vec<Arc<dyn KvStore>>)> {
    let unset = |v: &str| std::env::var(v).map_or(true, |v| v.is_empty());
    if unset("MOONCAKE_MASTER") || unset("MOONCAKE_MASTER_BIN") {
        assert!(
            std::env::var("KVLINK_REQUIRE_MOONCAKE").map_or(true, |v| v != "1"),
            "KVLINK_REQUIRE_MOONCAKE=1 but MOONCAKE_MASTER or MOONCAKE_MASTER_BIN is unset: run \
             under scripts/with-mooncake.sh"
        );
        eprintln!(
            "skipping: MOONCAKE_MASTER not set. To run: scripts/mooncake-build-shim.sh && \
             scripts/with-mooncake.sh cargo test --test linker_mooncake"
        );
        return None;
    }
    let master = PrivateMaster::start(&[]);
    let segment = MooncakeConfig::from_env()
        .expect("Mooncake environment")
        .global_segment_bytes();
    let clients = (0..n)
        .map(|_| {
            Arc::new(MooncakeStore::connect(master.config(segment)).expect("connect"))
                as Arc<dyn KvStore>
        })
        .collect();
    Some((master, clients))
}

fn cfg(ns: &str, mode: ShareMode) -> LinkerConfig {
    LinkerConfig {
        namespace: ns.into(),
        mode: ModeChoice::Fixed(mode),
        wait_deadline: Duration::from_secs(30),
        ..LinkerConfig::default()
    }
}

fn unique_ns(name: &str) -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{name}-{t}")
}

#[test]
fn tp2_loads_every_mode_over_mooncake() {
    let Some((_master, clients)) = mooncake_clients(2) else {
        return;
    };
    let spec = small_spec();
    let ns = unique_ns("lm");
    let tokens = prompt(5, 6, spec.page_size);
    let pages: Vec<PageHash> = save_prefix(
        &spec,
        clients[0].clone(),
        &tokens,
        &cfg(&ns, ShareMode::AllRanks),
    );
    for mode in [
        ShareMode::AllRanks,
        ShareMode::Rank0Broadcast,
        ShareMode::SplitAllGather,
    ] {
        let groups = TpGroup::in_process(2);
        let outcomes: Vec<(BatchOutcome, Arc<HostKvPool>, Vec<u32>)> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .enumerate()
                .map(|(rank, group)| {
                    let (store, spec, pages, ns) =
                        (clients[rank].clone(), spec.clone(), &pages, &ns);
                    s.spawn(move || {
                        let g = KvGeometry::new(spec, 2, rank as u32).unwrap();
                        let pool = Arc::new(HostKvPool::new(g.clone(), 32).unwrap());
                        let linker = Linker::with_group(
                            g.clone(),
                            store,
                            pool.clone(),
                            cfg(ns, mode),
                            group,
                        )
                        .unwrap();
                        let slots: Vec<u32> = (0..6).map(|i| 31 - i * 4 - rank as u32).collect();
                        let t = linker
                            .start_load(load_plan(&g, 1, pages, slots.clone()))
                            .unwrap();
                        wait_all(&linker, &t).unwrap();
                        (linker.wait_batch(&t).unwrap(), pool, slots)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut total = 0;
        for (o, pool, slots) in &outcomes {
            let stats = o
                .result
                .as_ref()
                .unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            assert_eq!(stats.mode, mode);
            total += stats.bytes_read;
            pool_matches(pool, &pages, slots, 6).unwrap();
        }
        let g = KvGeometry::new(spec.clone(), 2, 0).unwrap();
        let copies = if mode == ShareMode::AllRanks { 2 } else { 1 };
        assert_eq!(total, copies * 6 * g.bytes_per_page(), "{mode:?}");
    }
}

/// A client that moves only registered memory in place (as over RDMA; set here over TCP
/// with `registered_only`) loads with checksums: the ranged reads land in the registered pool,
/// the checksum companions (read into the load's own buffers) through the store's registered
/// bounce. Before, those companion reads were refused, and a load over RDMA needed
/// `verify_checksums` off.
#[test]
fn a_load_with_checksums_when_only_registered_memory_moves_in_place() {
    let Some((master, saver)) = mooncake_clients(1) else {
        return;
    };
    let registered_only: Arc<dyn KvStore> =
        Arc::new(MooncakeStore::connect(master.config(0).registered_only(true)).expect("connect"));
    let spec = small_spec();
    let ns = unique_ns("bounce");
    let tokens = prompt(7, 4, spec.page_size);
    let pages = save_prefix(
        &spec,
        saver[0].clone(),
        &tokens,
        &cfg(&ns, ShareMode::AllRanks),
    );
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let config = LinkerConfig {
        verify_checksums: true,
        ..cfg(&ns, ShareMode::AllRanks)
    };
    let linker = Linker::new(g.clone(), registered_only, pool.clone(), config).unwrap();
    let slots = vec![6, 1, 4, 3];
    let t = linker
        .start_load(load_plan(&g, 1, &pages, slots.clone()))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    let outcome = linker.wait_batch(&t).unwrap();
    let stats = outcome.result.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(stats.bytes_read, 4 * g.bytes_per_page());
    pool_matches(&pool, &pages, &slots, 4).unwrap();
}

#[test]
fn a_missing_object_fails_the_batch_with_not_found() {
    let Some((_master, clients)) = mooncake_clients(1) else {
        return;
    };
    let spec = small_spec();
    let ns = unique_ns("miss");
    let config = cfg(&ns, ShareMode::AllRanks);
    let tokens = prompt(9, 3, spec.page_size);
    let pages = save_prefix(&spec, clients[0].clone(), &tokens, &config);
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g.clone(), clients[0].clone(), pool.clone(), config).unwrap();
    // The first three pages load; a fourth that was never saved fails the batch.
    let mut with_missing = pages.clone();
    with_missing.push(PageHash([0x42; 32]));
    let t = linker
        .start_load(load_plan(&g, 1, &with_missing, vec![0, 1, 2, 3]))
        .unwrap();
    wait_fails_not_found(&linker, &t);
    assert!(linker.wait_batch(&t).unwrap().result.is_err());
    let t = linker
        .start_load(load_plan(&g, 2, &pages, vec![5, 6, 7]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    linker.wait_batch(&t).unwrap().result.unwrap();
    pool_matches(&pool, &pages, &[5, 6, 7], 6).unwrap();
}

/// Objects without checksum companions (as SGLang writes them) load from a real Mooncake with
/// verification on: the companions' whole-object read comes back `NotFound` per key (no
/// `exists` is asked first), and each layer is checked by length only; with one companion
/// left, that object's layers are checked against it and the others by length.
#[test]
fn objects_without_companions_load_checked_by_length() {
    let Some((_master, clients)) = mooncake_clients(1) else {
        return;
    };
    let spec = small_spec();
    let ns = unique_ns("nosums");
    let config = cfg(&ns, ShareMode::AllRanks);
    let tokens = prompt(13, 3, spec.page_size);
    let pages = save_prefix(&spec, clients[0].clone(), &tokens, &config);
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let linker = Linker::new(g.clone(), clients[0].clone(), pool.clone(), config).unwrap();
    let keys: Vec<String> = linker
        .object_keys(&load_plan(&g, 0, &pages, vec![0, 1, 2]))
        .unwrap()
        .into_iter()
        .flatten()
        .collect();
    // Every companion but the first object's goes (the objects stay as they are). Forced:
    // the save read its companions back, and a read holds Mooncake's lease (10 s), which
    // refuses a plain remove.
    let companions: Vec<String> = keys[1..]
        .iter()
        .map(|k| kvlink::kv_geometry::checksum_key(k))
        .collect();
    let refs: Vec<&str> = companions.iter().map(String::as_str).collect();
    assert!(clients[0].discard(&refs).iter().all(Result::is_ok));
    let t = linker
        .start_load(load_plan(&g, 1, &pages, vec![4, 2, 6]))
        .unwrap();
    wait_all(&linker, &t).unwrap();
    linker.wait_batch(&t).unwrap().result.unwrap();
    pool_matches(&pool, &pages, &[4, 2, 6], g.num_layers()).unwrap();
    // Each (object, layer) range is checked once: the first object's (component 0, page 0)
    // against its companion, every other by length.
    let carried = |c: usize| {
        (0..g.num_layers())
            .filter(|&l| g.components()[c].position(l).is_some())
            .count() as u64
    };
    let all: u64 = (0..g.components().len())
        .map(|c| carried(c) * pages.len() as u64)
        .sum();
    let m = linker.metrics();
    assert_eq!(m.ranges_checksummed, carried(0), "{m:?}");
    assert_eq!(m.ranges_length_only, all - carried(0), "{m:?}");
}

/// On a real Mooncake store, a lookup's read session is taken over by its load (which starts
/// none), both when the load comes at once and when it comes after the renewal period (it
/// renews the session before its first read); every byte is right either way.
#[test]
fn a_load_takes_its_lookups_pins_over_mooncake() {
    let Some((_master, clients)) = mooncake_clients(1) else {
        return;
    };
    let spec = small_spec();
    let ns = unique_ns("pins");
    let config = LinkerConfig {
        // Long enough that batch 1, loaded at once, is not due for a renewal on a loaded
        // machine; batch 2 comes after it.
        lease_renewal: Duration::from_secs(1),
        ..cfg(&ns, ShareMode::AllRanks)
    };
    let tokens = prompt(17, 4, spec.page_size);
    let pages = save_prefix(&spec, clients[0].clone(), &tokens, &config);
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 8).unwrap());
    let sessions = Sessions::over(clients[0].clone());
    let linker = Linker::new(g.clone(), sessions.clone(), pool.clone(), config).unwrap();
    for (batch, pause) in [(1u64, Duration::ZERO), (2, Duration::from_millis(1200))] {
        let before = linker.metrics().pins_ahead;
        assert_eq!(linker.lookup_pages(&pages, 0).unwrap().pages.len(), 4);
        let limit = std::time::Instant::now() + Duration::from_secs(10);
        while linker.metrics().pins_ahead == before && std::time::Instant::now() < limit {
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(pause);
        let slots = vec![7, 1, 4, 2];
        let t = linker
            .start_load(load_plan(&g, batch, &pages, slots.clone()))
            .unwrap();
        wait_all(&linker, &t).unwrap();
        linker.wait_batch(&t).unwrap().result.unwrap();
        pool_matches(&pool, &pages, &slots, g.num_layers()).unwrap();
        assert_eq!(linker.metrics().pins_ahead_taken, batch, "batch {batch}");
        let (started, ended) = sessions.counts();
        assert_eq!(started, ended, "batch {batch}: every session ended");
        assert!(sessions.pinned().is_empty());
        if batch == 1 {
            assert_eq!(started, 1, "the load started no session of its own");
        } else {
            // Taken past `lease_renewal`: renewed before the first read, then the old one
            // ended.
            assert!(started >= 3, "batch 2: {started} sessions");
            assert!(
                sessions.order().starts_with("sesse"),
                "{}",
                sessions.order()
            );
        }
    }
    linker.close().unwrap();
}
