//! The fault matrix on a process group: TP 3, each rank a process of this test binary, the
//! group formed at a rendezvous (socket collectives), rank 0 serving the store the others read
//! through. Every mode (AllRanks, Rank0Broadcast, SplitAllGather, Auto), failing rank 0 / 1 / 2,
//! layer first / middle / last, kinds that make sense without re-forming a process group: an
//! error, a short read, a slow read past the deadline, a store call that hangs, a store call
//! that panics, the store going down (for that rank), a plan that differs. (A rank that dies is `kill -9` plus the group's
//! re-forming at the rendezvous: the process-group formation's own tests.) Each rank runs the
//! same cells in the same order and reports each; the parent prints the matrix and requires
//! every cell run, 0 hangs, 0 panics, 0 wrong bytes (the slots are poisoned before each
//! batch), 0 split verdicts, every rank's verdict the fault's (`PeerFailed` naming the failing
//! rank; for a plan mismatch `AllRanks` naming the ranks whose plan differs), the next batch
//! loaded.
#![cfg(target_os = "linux")]

/// Writes a line straight to this process's stdout: the test harness does not capture it, so
/// the matrix shows in CI logs whether the test passes or fails.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod common;
#[path = "../crates/dedup-broadcast/tests/common/procs.rs"]
mod procs;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::tp::{every_mode, fault_deadlines, mixed_spec, rank_byte, RankPool, POISON};
use common::{load_plan, prompt};
use kvlink::dedup_broadcast::{MeetingPoint, Rendezvous, RendezvousConfig};
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{page_hashes, KvGeometry, PageHash};
use kvlink::kv_loader::{BatchOutcome, KvLoadError, KvLoader, RequestPages};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, ServeAt, Stall, StoreError,
};
use kvlink::mooncake_linker::{serve_group_store, Linker, LinkerConfig, TpGroup};
use procs::{arg, field, report, role, RankProc};

const WORLD: u32 = 3;
const PAGES: usize = 4;
const LAYERS: [u32; 3] = [0, 2, 4];
const READ_TIMEOUT: Duration = Duration::from_millis(200);
const KINDS: [&str; 7] = ["error", "short", "slow", "hung", "panic", "down", "plan"];

fn modes() -> Vec<(&'static str, LinkerConfig)> {
    every_mode(|c| fault_deadlines(READ_TIMEOUT, c))
}

/// Every cell, in the order every rank runs them.
fn cells() -> Vec<(&'static str, &'static str, u32, u32)> {
    let mut v = Vec::new();
    for (mode, _) in modes() {
        for kind in KINDS {
            for fail in 0..WORLD {
                let layers: &[u32] = if kind == "plan" { &[0] } else { &LAYERS };
                for &layer in layers {
                    v.push((mode, kind, fail, layer));
                }
            }
        }
    }
    v
}

#[test]
#[ignore = "a rank process's entry: its parent test runs it with --ignored"]
fn rank_process() {
    let Some(role) = role() else { return };
    rank_main(&role);
}

/// Layers below `upto` of every page in `slots` hold this rank's saved bytes.
fn bytes_ok(
    pool: &HostKvPool,
    g: &KvGeometry,
    pages: &[PageHash],
    slots: &[u32],
    upto: u32,
) -> bool {
    let rank = g.tp_rank();
    pages.iter().zip(slots).all(|(page, &slot)| {
        g.components().iter().all(|c| {
            c.layers.iter().filter(|&&l| l < upto).all(|&l| {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                // SAFETY: read after the batch's outcome was taken; nothing else writes them.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }.unwrap();
                got.iter()
                    .enumerate()
                    .all(|(i, &b)| b == rank_byte(page, c, rank, l, i))
            })
        })
    })
}

/// What a rank's batch ended as, in one word: `<mode>/<ranks whose plan differs>` when it
/// loaded, `peer_failed/<rank>` when a rank's failure failed it, else the error's kind.
fn verdict(outcome: &Result<BatchOutcome, KvLoadError>) -> String {
    match outcome.as_ref().map(|o| &o.result) {
        Ok(Ok(stats)) => {
            let differ: Vec<String> = stats.plans_differ.iter().map(u32::to_string).collect();
            format!("{:?}/{}", stats.mode, differ.join("+"))
        }
        Ok(Err(KvLoadError::PeerFailed { rank, .. })) => format!("peer_failed/{rank}"),
        Ok(Err(e)) => e.kind_name().to_string(),
        Err(e) => format!("wait/{}", e.kind_name()),
    }
}

/// The verdict every rank must give for a fault of `kind` on rank `fail`: a plan mismatch
/// loads `AllRanks`, naming the ranks whose plan differs from rank 0's; any other fault fails
/// every rank with `PeerFailed` naming the failing rank.
fn expected_verdict(kind: &str, fail: u32) -> String {
    if kind != "plan" {
        return format!("peer_failed/{fail}");
    }
    let differ: Vec<String> = if fail == 0 {
        (1..WORLD).map(|r| r.to_string()).collect()
    } else {
        vec![fail.to_string()]
    };
    format!("AllRanks/{}", differ.join("+"))
}

fn rank_main(role: &HashMap<String, String>) {
    let rank: u32 = arg(role, "rank");
    let spec = mixed_spec();
    let g = KvGeometry::new(spec.clone(), WORLD, rank).unwrap();
    let rv_config = RendezvousConfig::new(rank, WORLD, MeetingPoint::Tcp(role["meet"].clone()))
        .geometry(&g)
        .timeout(Duration::from_secs(30));
    let mut rv = Rendezvous::new(rv_config).unwrap();
    if let Some(a) = rv.listen_addr() {
        report(&format!("addr {a}"));
    }
    let (local, _server) = if rank == 0 {
        let store = Arc::new(EmbeddedStore::new(64 << 20));
        let server = serve_group_store(&mut rv, store.clone(), ServeAt::Unix).unwrap();
        common::tp::save(&spec, WORLD, store.clone(), PAGES, &modes()[0].1);
        (Some(store as Arc<dyn KvStore>), Some(server))
    } else {
        (None, None)
    };
    let formed = TpGroup::from_rendezvous(rv).expect("forming the group");
    report(&format!("formed epoch={}", formed.epoch));
    let served = formed.store(local).unwrap().expect("rank 0 serves");
    let faults = Arc::new(FaultyStore::new(served));
    let pages = page_hashes(&prompt(11, PAGES, spec.page_size), spec.page_size, None);
    let pool_pages = 3 * PAGES as u32 + 4;
    let slots: Vec<u32> = (0..PAGES as u32)
        .map(|i| (i * 3 + rank * 7) % pool_pages)
        .collect();
    let v = g.component_by_name("v").unwrap().clone();
    let mut batch = 1u64;
    let mut current: Option<(&str, Linker, Arc<HostKvPool>)> = None;
    for (mode, kind, fail, layer) in cells() {
        if current.as_ref().is_none_or(|c| c.0 != mode) {
            if let Some((_, l, _)) = current.take() {
                l.close().unwrap();
            }
            let cfg = modes().into_iter().find(|m| m.0 == mode).unwrap().1;
            let pool = Arc::new(HostKvPool::new(g.clone(), pool_pages).unwrap());
            let l = Linker::with_group(
                g.clone(),
                faults.clone(),
                pool.clone(),
                cfg,
                formed.group.clone(),
            )
            .unwrap();
            current = Some((mode, l, pool));
        }
        let (_, linker, pool) = current.as_ref().unwrap();
        let mine = rank == fail;
        let mut stall = None;
        if mine && kind != "plan" {
            let rule = FaultRule {
                key_contains: Some(format!("tp{rank}_cp0_pp0_v")),
                offset: Some(v.layer_range(layer).unwrap().start),
                times: Some(1),
                ..FaultRule::default()
            };
            let fault = match kind {
                "error" => Fault::Error(StoreError::TransferFailed {
                    key: "injected".into(),
                    code: -800,
                }),
                "short" => Fault::Short,
                "panic" => Fault::Panic,
                "slow" => Fault::Delay(READ_TIMEOUT + Duration::from_millis(150)),
                "hung" => {
                    let s = Stall::new();
                    stall = Some(s.clone());
                    Fault::Stall(s)
                }
                _ => Fault::Down,
            };
            faults.inject(rule, fault);
        }
        let mut plan = load_plan(&g, batch, &pages, slots.clone());
        if mine && kind == "plan" {
            plan.logical.requests = vec![RequestPages {
                request: "another-request".into(),
                pages: pages.clone(),
            }];
        }
        RankPool::Host(pool.clone()).poison(&g, &slots, POISON);
        let t = linker.start_load(plan).unwrap();
        let published = (0..linker.num_layers())
            .take_while(|&l| linker.wait_layer(&t, l).is_ok())
            .count() as u32;
        faults.clear();
        if let Some(s) = stall {
            s.release();
        }
        let outcome = linker.wait_batch(&t);
        let loaded = matches!(&outcome, Ok(o) if o.result.is_ok());
        let upto = if loaded { u32::MAX } else { published };
        let ok = bytes_ok(pool, &g, &pages, &slots, upto);
        RankPool::Host(pool.clone()).poison(&g, &slots, POISON);
        let t = linker
            .start_load(load_plan(&g, batch + 1, &pages, slots.clone()))
            .unwrap();
        let next_mode = common::wait_all(linker, &t)
            .ok()
            .and_then(|()| linker.wait_batch(&t).ok())
            .and_then(|o| o.result.ok())
            .map(|s| format!("{:?}", s.mode));
        let next_ok = next_mode.is_some() && bytes_ok(pool, &g, &pages, &slots, u32::MAX);
        report(&format!(
            "cell mode={mode} kind={kind} fail={fail} layer={layer} loaded={} verdict={} bytes={} next={} nextmode={}",
            u8::from(loaded),
            verdict(&outcome),
            u8::from(ok),
            u8::from(next_ok),
            next_mode.unwrap_or_else(|| "-".into())
        ));
        batch += 2;
    }
    if let Some((_, l, _)) = current {
        l.close().unwrap();
    }
    report("done");
}

#[test]
fn every_cell_on_a_process_group_runs_without_hang_panic_or_wrong_byte() {
    let t0 = Instant::now();
    let mut r0 = RankProc::spawn("rank 0", "rank=0,meet=127.0.0.1:0");
    let addr = r0.expect("addr ", Duration::from_secs(30));
    let mut procs = vec![r0];
    for r in 1..WORLD {
        procs.push(RankProc::spawn(
            &format!("rank {r}"),
            &format!("rank={r},meet={addr}"),
        ));
    }
    let wait = Duration::from_secs(30);
    for p in procs.iter_mut() {
        p.expect("formed ", Duration::from_secs(60));
    }
    #[derive(Default)]
    struct Row {
        cells: u32,
        wrong: u32,
        split: u32,
        as_expected: u32,
        next: u32,
    }
    let mut rows: BTreeMap<&str, Row> = BTreeMap::new();
    let mut by_mode: BTreeMap<&str, (u32, u32)> = BTreeMap::new();
    let mut base: HashMap<&str, String> = HashMap::new();
    for (mode, kind, fail, layer) in cells() {
        // A rank that does not report a cell in time panics here: a hang fails the test.
        let got: Vec<String> = procs.iter_mut().map(|p| p.expect("cell ", wait)).collect();
        for g in &got {
            assert_eq!(
                (
                    field(g, "mode"),
                    field(g, "kind"),
                    field(g, "fail"),
                    field(g, "layer")
                ),
                (
                    mode,
                    kind,
                    fail.to_string().as_str(),
                    layer.to_string().as_str()
                ),
                "ranks out of order"
            );
        }
        let loaded: Vec<bool> = got.iter().map(|g| field(g, "loaded") == "1").collect();
        let row = rows.entry(kind).or_default();
        row.cells += 1;
        row.wrong += got.iter().filter(|g| field(g, "bytes") != "1").count() as u32;
        let all = loaded.iter().all(|&l| l);
        let none = loaded.iter().all(|&l| !l);
        row.split += u32::from(!(all || none));
        let verdict = expected_verdict(kind, fail);
        let verdicts_ok = got.iter().all(|g| field(g, "verdict") == verdict);
        if !verdicts_ok {
            let seen: Vec<&str> = got.iter().map(|g| field(g, "verdict")).collect();
            out!("  cell {mode} {kind} rank {fail} layer {layer}: verdicts {seen:?}, expected {verdict}");
        }
        row.as_expected += u32::from((if kind == "plan" { all } else { none }) && verdicts_ok);
        let modes: Vec<&str> = got.iter().map(|g| field(g, "nextmode")).collect();
        let first = base
            .entry(mode)
            .or_insert_with(|| modes[0].to_string())
            .clone();
        let next_ok =
            got.iter().all(|g| field(g, "next") == "1") && modes.iter().all(|m| *m == first);
        row.next += u32::from(next_ok);
        let m = by_mode.entry(mode).or_default();
        m.0 += 1;
        m.1 += u32::from(next_ok);
    }
    for p in procs.iter_mut() {
        p.expect("done", wait);
        p.succeeds(wait);
    }
    out!("");
    out!("fault matrix on a process group: TP 3 processes, socket collectives, served store");
    out!(
        "(a rank that hangs or panics fails this test before the table: those columns are 0 here)"
    );
    out!(
        "{:<14} {:>6} {:>6} {:>7} {:>12} {:>6} {:>14} {:>12}",
        "fault",
        "cells",
        "hangs",
        "panics",
        "wrong bytes",
        "split",
        "as expected",
        "next loaded"
    );
    let (mut cells_run, mut wrong, mut split, mut expected, mut next) = (0, 0, 0, 0, 0);
    for (kind, r) in &rows {
        out!(
            "{:<14} {:>6} {:>6} {:>7} {:>12} {:>6} {:>14} {:>12}",
            kind,
            r.cells,
            0,
            0,
            r.wrong,
            r.split,
            format!("{}/{}", r.as_expected, r.cells),
            format!("{}/{}", r.next, r.cells)
        );
        cells_run += r.cells;
        wrong += r.wrong;
        split += r.split;
        expected += r.as_expected;
        next += r.next;
    }
    for (mode, (c, n)) in &by_mode {
        out!(
            "  by mode {mode:<15} cells {c:>4}, next loaded {n:>4} (next batch in {})",
            base[mode]
        );
    }
    out!(
        "TOTAL: {cells_run} cells run, 0 hangs, 0 panics, {wrong} wrong bytes, {split} split verdicts, {expected} as expected, next batch loaded {next}/{cells_run} ({:.1} s)",
        t0.elapsed().as_secs_f64()
    );
    assert_eq!(cells_run as usize, cells().len());
    assert_eq!((wrong, split), (0, 0));
    assert_eq!(expected, cells_run);
    assert_eq!(next, cells_run);
}
