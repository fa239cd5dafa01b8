//! TP ranks as processes, through the linker as it is: each rank process forms its
//! `TpGroup` at a rendezvous (`TpGroup::from_rendezvous`, two socket handles), rank 0
//! serves the embedded store it saved a prefix into, the other ranks reach it through the
//! served store; every sharing mode loads the same bytes into every rank's pool, and the
//! lookup agrees on the hit; `Auto` runs the same mode on every rank. Every child process is
//! killed when its handle drops.
#![cfg(target_os = "linux")]

mod common;
// The process harness of dedup-broadcast's tests (spawns this binary as rank processes).
#[path = "../crates/dedup-broadcast/tests/common/procs.rs"]
mod procs;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use kvlink::dedup_broadcast::{MeetingPoint, ModeChoice, Rendezvous, RendezvousConfig};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{page_hashes, KvGeometry};
use kvlink::kv_loader::{KvLoader, LookupRequest, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore, ServeAt};
use kvlink::mooncake_linker::{serve_group_store, Linker, LinkerConfig, TpGroup};
use procs::{arg, field, report, role, RankProc};

const PAGES: usize = 9;
const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

fn cfg(mode: ModeChoice) -> LinkerConfig {
    LinkerConfig {
        namespace: "procs".into(),
        mode,
        wait_deadline: Duration::from_secs(20),
        collective_timeout: Duration::from_secs(20),
        ..LinkerConfig::default()
    }
}

#[test]
#[ignore = "a rank process's entry: its parent test runs it with --ignored"]
fn rank_process() {
    let Some(role) = role() else { return };
    rank_main(&role);
}

fn rank_main(role: &HashMap<String, String>) {
    let (rank, world): (u32, u32) = (arg(role, "rank"), arg(role, "world"));
    let spec = small_spec();
    let geometry = KvGeometry::new(spec.clone(), world, rank).unwrap();
    let config = RendezvousConfig::new(rank, world, MeetingPoint::Tcp(role["meet"].clone()))
        .geometry(&geometry)
        .timeout(Duration::from_secs(20));
    let mut rv = Rendezvous::new(config).unwrap();
    if let Some(a) = rv.listen_addr() {
        report(&format!("addr {a}"));
    }
    let tokens = prompt(5, PAGES, spec.page_size);
    // Rank 0 keeps the store and serves it; it saved a previous request's prefix into it.
    let (local, _server) = if rank == 0 {
        let store = Arc::new(EmbeddedStore::new(64 << 20));
        let server = serve_group_store(&mut rv, store.clone(), ServeAt::Unix).unwrap();
        save_prefix(
            &spec,
            store.clone(),
            &tokens,
            &cfg(ModeChoice::Fixed(ShareMode::AllRanks)),
        );
        (Some(store as Arc<dyn KvStore>), Some(server))
    } else {
        (None, None)
    };
    let formed = TpGroup::from_rendezvous(rv).expect("forming the group");
    report(&format!("formed epoch={}", formed.epoch));
    let store = formed
        .store(local)
        .unwrap()
        .expect("rank 0 announced its store");
    let pages = page_hashes(&tokens, spec.page_size, None);
    let choices = MODES
        .into_iter()
        .map(ModeChoice::Fixed)
        .chain([ModeChoice::Auto]);
    for (i, mode) in choices.enumerate() {
        let pool_pages = 3 * PAGES as u32 + 2;
        let pool = Arc::new(HostKvPool::new(geometry.clone(), pool_pages).unwrap());
        let linker = Linker::with_group(
            geometry.clone(),
            store.clone(),
            pool.clone(),
            cfg(mode),
            formed.group.clone(),
        )
        .unwrap();
        let hit = linker
            .lookup(&LookupRequest {
                tokens: &tokens,
                skip_pages: 0,
            })
            .unwrap();
        // Every rank its own scattered slots.
        let slots: Vec<u32> = (0..PAGES as u32)
            .map(|p| (p * 3 + rank * 5 + 1) % pool_pages)
            .collect();
        let ticket = linker
            .start_load(load_plan(&geometry, i as u64 + 1, &pages, slots.clone()))
            .unwrap();
        wait_all(&linker, &ticket).unwrap();
        let stats = linker.wait_batch(&ticket).unwrap().result.unwrap();
        pool_matches(&pool, &pages, &slots, spec.num_layers).unwrap();
        let asked = match mode {
            ModeChoice::Fixed(m) => format!("{m:?}"),
            _ => "Auto".to_string(),
        };
        report(&format!(
            "loaded mode={asked} ran={:?} hit={} read={}",
            stats.mode,
            hit.pages.len(),
            stats.bytes_read
        ));
        linker.close().unwrap();
    }
}

#[test]
fn ranks_as_processes_load_every_mode_through_the_linker() {
    let world = 3u32;
    let mut r0 = RankProc::spawn("rank 0", &format!("rank=0,world={world},meet=127.0.0.1:0"));
    let addr = r0.expect("addr ", Duration::from_secs(30));
    let mut procs = vec![r0];
    for r in 1..world {
        procs.push(RankProc::spawn(
            &format!("rank {r}"),
            &format!("rank={r},world={world},meet={addr}"),
        ));
    }
    let wait = Duration::from_secs(90);
    let mut read = vec![HashMap::new(); world as usize];
    let mut auto_ran = Vec::new();
    for (r, p) in procs.iter_mut().enumerate() {
        assert_eq!(field(&p.expect("formed ", wait), "epoch"), "1");
        for mode in MODES {
            let got = p.expect("loaded ", wait);
            assert_eq!(field(&got, "mode"), format!("{mode:?}"), "rank {r}");
            assert_eq!(field(&got, "ran"), format!("{mode:?}"), "rank {r}: {got}");
            assert_eq!(field(&got, "hit"), PAGES.to_string(), "rank {r}");
            let bytes: u64 = field(&got, "read").parse().unwrap();
            read[r].insert(format!("{mode:?}"), bytes);
        }
        // Auto: whichever mode rank 0 proposed, every rank ran it and verified its pool.
        let got = p.expect("loaded ", wait);
        assert_eq!(field(&got, "mode"), "Auto", "rank {r}");
        assert!(
            MODES.iter().any(|m| field(&got, "ran") == format!("{m:?}")),
            "rank {r}: {got}"
        );
        auto_ran.push(field(&got, "ran").to_string());
        p.succeeds(wait);
    }
    assert!(auto_ran.iter().all(|m| m == &auto_ran[0]), "{auto_ran:?}");
    // Each byte leaves the store once when ranks share: rank 0 reads everything in
    // Rank0Broadcast, the others nothing; in SplitAllGather the reads add up to one copy.
    let all = read[0]["AllRanks"];
    assert!(all > 0);
    assert_eq!(read[0]["Rank0Broadcast"], all);
    assert!(
        (1..world as usize).all(|r| read[r]["Rank0Broadcast"] == 0),
        "{read:?}"
    );
    let split: u64 = read.iter().map(|m| m["SplitAllGather"]).sum();
    assert_eq!(split, all, "{read:?}");
}
