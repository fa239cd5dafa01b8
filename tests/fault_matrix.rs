//! The fault matrix: every mode (AllRanks, Rank0Broadcast, SplitAllGather, Auto) at TP 3 and
//! TP 4, on host pools and on the device path (CPU devices), ranks as threads of this process
//! (in-process groups); the failing rank is rank 0, a middle rank or the last, at the first, a
//! middle or the last layer, and the fault is one of: an error, a short read, a slow read past
//! the deadline, a store call that hangs, a store call that panics (a defect in the client
//! library under it), the store going down, the rank leaving the group,
//! a plan that differs on that rank (no layer: the gate catches it before any).
//!
//! Every cell runs one batch with the fault and the next batch without it, and counts: hangs
//! (a cell not done within its bound), panics, wrong bytes (in any layer a rank published, or
//! in a batch that loaded; the slots are poisoned before each batch), split verdicts (ranks
//! that disagree on the batch), whether every rank's verdict is the fault's (`PeerFailed`
//! naming the failing rank; for a plan mismatch `AllRanks` naming the ranks whose plan
//! differs), and whether the next batch loaded on every rank, byte for byte, in the group's
//! mode. It prints the matrix
//! and requires every cell run, 0 hangs, 0 panics, 0 wrong bytes, 0 split verdicts and the
//! next batch loaded every time. Small sizes (5 layers, 4 pages), short deadlines; sets of
//! ranks run two at a time (most of a slow or hung cell is waiting).

/// Writes a line straight to this process's stdout: the test harness does not capture it, so
/// the matrix shows in CI logs whether the test passes or fails.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::coll::{Misbehave, Misbehaving};
use common::load_plan;
use common::tp::{
    every_mode, fault_deadlines, mixed_spec, paths, poison_all, rank_matches_below, run_ok,
    tp_ranks_built, Path, RankBuild, TpRank,
};
use kvlink::kv_geometry::PageHash;
use kvlink::kv_loader::{BatchPlan, KvLoader, LoadTicket, RequestPages, ShareMode};
use kvlink::mooncake_linker::store::{EmbeddedStore, Fault, FaultRule, KvStore, Stall, StoreError};
use kvlink::mooncake_linker::{LinkerConfig, TpGroup};

const PAGES: usize = 4;
const LAYERS: [u32; 3] = [0, 2, 4];
const READ_TIMEOUT: Duration = Duration::from_millis(200);
/// A cell not done by then counts as a hang (its threads are left behind).
const CELL_LIMIT: Duration = Duration::from_secs(30);
/// The whole matrix must finish by then (a bound on the test, not a speed goal).
const MATRIX_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Error,
    Short,
    Slow,
    Hung,
    Panic,
    StoreDown,
    RankGone,
    PlanMismatch,
}

const KINDS: [Kind; 8] = [
    Kind::Error,
    Kind::Short,
    Kind::Slow,
    Kind::Hung,
    Kind::Panic,
    Kind::StoreDown,
    Kind::RankGone,
    Kind::PlanMismatch,
];

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Error => "error",
            Kind::Short => "short read",
            Kind::Slow => "slow read",
            Kind::Hung => "hung call",
            Kind::Panic => "call panics",
            Kind::StoreDown => "store down",
            Kind::RankGone => "rank gone",
            Kind::PlanMismatch => "plan mismatch",
        }
    }

    /// Whether the batch with the fault loads (a plan mismatch falls back to AllRanks).
    fn loads(self) -> bool {
        self == Kind::PlanMismatch
    }
}

fn modes() -> Vec<(&'static str, LinkerConfig)> {
    every_mode(|c| fault_deadlines(READ_TIMEOUT, c))
}

/// What one cell saw.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    cells: u32,
    hangs: u32,
    panics: u32,
    wrong_bytes: u32,
    split: u32,
    /// The faulty batch ended as the kind says on every rank: failed with `PeerFailed` naming
    /// the failing rank (a rank leaving: failed), or, for a plan mismatch, loaded `AllRanks`
    /// naming the ranks whose plan differs.
    as_expected: u32,
    next_loaded: u32,
}

impl std::ops::AddAssign for Seen {
    fn add_assign(&mut self, o: Seen) {
        self.cells += o.cells;
        self.hangs += o.hangs;
        self.panics += o.panics;
        self.wrong_bytes += o.wrong_bytes;
        self.split += o.split;
        self.as_expected += o.as_expected;
        self.next_loaded += o.next_loaded;
    }
}

/// One set of ranks (fresh for each `RankGone` cell: its rank leaves for good).
struct Ranks {
    rs: Vec<TpRank>,
    hashes: Vec<PageHash>,
    gone: Vec<Arc<Misbehaving>>,
    base: ShareMode,
    batch: AtomicUsize,
}

fn ranks(tp: u32, cfg: &LinkerConfig, path: Path, gone_at: Option<(u32, u32)>) -> Ranks {
    let gone = Mutex::new(Vec::new());
    let wrap = |rank: u32, g: TpGroup| match gone_at {
        Some((r, layer)) if r == rank => {
            let m = Misbehaving::new(g.data.clone(), Misbehave::GoneAtLayer { layer });
            gone.lock().unwrap().push(m.clone());
            let data: Arc<dyn kvlink::dedup_broadcast::Collective> = m;
            TpGroup { data, ..g }
        }
        _ => g,
    };
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 28));
    let (rs, hashes) = tp_ranks_built(
        &mixed_spec(),
        tp,
        store,
        PAGES,
        cfg,
        path,
        &RankBuild::wrapped(&wrap),
    );
    let base = run_ok(&rs, 1, &hashes, "fresh ranks");
    Ranks {
        rs,
        hashes,
        gone: gone.into_inner().unwrap(),
        base,
        batch: AtomicUsize::new(2),
    }
}

/// The fault of `kind` on rank `rank`'s own shard read of `layer`; what releases it after.
fn arm(set: &Ranks, kind: Kind, rank: u32, layer: u32) -> Option<Stall> {
    let r = &set.rs[rank as usize];
    let v = r.linker.geometry().component_by_name("v").unwrap().clone();
    let rule = FaultRule {
        key_contains: Some(format!("tp{rank}_cp0_pp0_v")),
        offset: Some(v.layer_range(layer).unwrap().start),
        times: Some(1),
        ..FaultRule::default()
    };
    let fault = match kind {
        Kind::Error => Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
        Kind::Short => Fault::Short,
        Kind::Slow => Fault::Delay(READ_TIMEOUT + Duration::from_millis(150)),
        Kind::Hung => {
            let s = Stall::new();
            r.faults.inject(rule, Fault::Stall(s.clone()));
            return Some(s);
        }
        Kind::Panic => Fault::Panic,
        Kind::StoreDown => Fault::Down,
        Kind::RankGone => {
            set.gone.iter().for_each(|m| m.arm());
            return None;
        }
        Kind::PlanMismatch => return None,
    };
    r.faults.inject(rule, fault);
    None
}

/// The plan rank `rank` loads for `batch` (for a plan mismatch, the failing rank names its
/// request differently: same pages, another logical plan).
fn plan_of(set: &Ranks, r: &TpRank, batch: u64, mismatch: bool) -> BatchPlan {
    let mut plan = load_plan(r.linker.geometry(), batch, &set.hashes, r.slots.clone());
    if mismatch {
        plan.logical.requests = vec![RequestPages {
            request: "another-request".into(),
            pages: set.hashes.clone(),
        }];
    }
    plan
}

/// Runs one cell on `set`: the faulty batch, then the next one.
fn cell(set: &Ranks, kind: Kind, fail: u32, layer: u32) -> Seen {
    let mut seen = Seen {
        cells: 1,
        ..Seen::default()
    };
    let batch = set.batch.fetch_add(2, Ordering::SeqCst) as u64;
    // Bytes an earlier batch left in the slots must not pass for this one's.
    poison_all(&set.rs);
    let stall = arm(set, kind, fail, layer);
    // Phase A: every rank starts the batch and waits its layers like an engine.
    let waited: Vec<std::thread::Result<(LoadTicket, u32)>> = std::thread::scope(|s| {
        let hs: Vec<_> = set
            .rs
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let mismatch = kind == Kind::PlanMismatch && rank as u32 == fail;
                s.spawn(move || {
                    let t = r
                        .linker
                        .start_load(plan_of(set, r, batch, mismatch))
                        .unwrap();
                    let published = (0..r.linker.num_layers())
                        .take_while(|&l| r.linker.wait_layer(&t, l).is_ok())
                        .count() as u32;
                    (t, published)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    // The store comes back; a hung call returns.
    for r in &set.rs {
        r.faults.clear();
    }
    if let Some(s) = stall {
        s.release();
    }
    let mut loaded = Vec::new();
    let mut verdicts_as_expected = true;
    for (rank, w) in waited.into_iter().enumerate() {
        let Ok((t, published)) = w else {
            seen.panics += 1;
            continue;
        };
        let r = &set.rs[rank];
        let outcome = r.linker.wait_batch(&t);
        let ok = matches!(&outcome, Ok(o) if o.result.is_ok());
        loaded.push(ok);
        verdicts_as_expected &= outcome
            .as_ref()
            .is_ok_and(|o| verdict_as_expected(kind, fail, set.rs.len() as u32, &o.result));
        let upto = if ok { u32::MAX } else { published };
        if rank_matches_below(r, &set.hashes, rank as u32, &r.slots, upto).is_err() {
            seen.wrong_bytes += 1;
        }
    }
    let all = loaded.iter().all(|&l| l);
    let none = loaded.iter().all(|&l| !l);
    if !(all || none) {
        seen.split += 1;
    }
    if loaded.len() == set.rs.len()
        && (if kind.loads() { all } else { none })
        && verdicts_as_expected
    {
        seen.as_expected += 1;
    }
    // The next batch loads on every rank, in the group's mode.
    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_ok(&set.rs, batch + 1, &set.hashes, "next batch")
    }));
    match next {
        Ok(mode) if mode == set.base => seen.next_loaded += 1,
        Ok(_) => {}
        Err(_) => {}
    }
    seen
}

/// Whether one rank's result is what a fault of `kind` on rank `fail` (of `tp`) must give: a
/// plan mismatch loads `AllRanks` on every rank, each naming the ranks whose plan differs
/// from rank 0's; a rank leaving fails the batch (how its peers see it depends on when it
/// left); every other fault fails every rank with `PeerFailed` naming `fail` (its own error
/// gated to the others, not a timeout of theirs).
fn verdict_as_expected(
    kind: Kind,
    fail: u32,
    tp: u32,
    result: &Result<kvlink::kv_loader::LoadStats, kvlink::kv_loader::KvLoadError>,
) -> bool {
    match (kind, result) {
        (Kind::PlanMismatch, Ok(stats)) => {
            let differ: Vec<u32> = if fail == 0 {
                (1..tp).collect()
            } else {
                vec![fail]
            };
            stats.mode == ShareMode::AllRanks && stats.plans_differ == differ
        }
        (Kind::RankGone, Err(_)) => true,
        (_, Err(kvlink::kv_loader::KvLoadError::PeerFailed { rank, .. })) => *rank == fail,
        _ => false,
    }
}

type Key = (Kind, &'static str, u32);

/// Runs every cell of one (path, TP, mode), returning what each kind saw.
fn one_set(path: Path, tp: u32, mode: &'static str, cfg: LinkerConfig) -> BTreeMap<Key, Seen> {
    let pname = if path == Path::Host { "host" } else { "device" };
    let mut out: BTreeMap<Key, Seen> = BTreeMap::new();
    let mut shared: Option<Arc<Ranks>> = None;
    for kind in KINDS {
        for fail in [0, tp / 2, tp - 1] {
            let layers: &[u32] = if kind == Kind::PlanMismatch {
                &[0]
            } else {
                &LAYERS
            };
            for &layer in layers {
                let set = match kind {
                    Kind::RankGone => Arc::new(ranks(tp, &cfg, path, Some((fail, layer)))),
                    _ => shared
                        .get_or_insert_with(|| Arc::new(ranks(tp, &cfg, path, None)))
                        .clone(),
                };
                // Bounded: the cell runs on its own thread; one that does not finish in time
                // is a hang (and its ranks are not used again).
                let (tx, rx) = mpsc::channel();
                let s = set.clone();
                std::thread::spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        cell(&s, kind, fail, layer)
                    }));
                    let _ = tx.send(r);
                });
                let seen = match rx.recv_timeout(CELL_LIMIT) {
                    Ok(Ok(seen)) => seen,
                    Ok(Err(_)) => Seen {
                        cells: 1,
                        panics: 1,
                        ..Seen::default()
                    },
                    Err(_) => {
                        shared = None;
                        Seen {
                            cells: 1,
                            hangs: 1,
                            ..Seen::default()
                        }
                    }
                };
                if seen.panics + seen.hangs + seen.wrong_bytes + seen.split > 0
                    || seen.next_loaded == 0
                    || seen.as_expected == 0
                {
                    out!(
                        "  cell {pname} tp{tp} {mode} {} rank {fail} layer {layer}: {seen:?}",
                        kind.name()
                    );
                }
                *out.entry((kind, pname, tp)).or_default() += seen;
            }
        }
    }
    let _ = mode;
    out
}

#[test]
fn every_cell_runs_no_hang_no_panic_no_wrong_byte_and_the_next_batch_loads() {
    let t0 = Instant::now();
    let mut sets = Vec::new();
    for path in paths() {
        for tp in [3u32, 4] {
            for (mode, cfg) in modes() {
                sets.push((path, tp, mode, cfg));
            }
        }
    }
    // Two sets at a time: most of a slow or hung cell is waiting for a deadline.
    let work = Mutex::new(sets);
    let results: Mutex<BTreeMap<(Kind, &'static str, u32), Seen>> = Mutex::new(BTreeMap::new());
    let by_mode: Mutex<BTreeMap<&'static str, Seen>> = Mutex::new(BTreeMap::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some((path, tp, mode, cfg)) = work.lock().unwrap().pop() else {
                    break;
                };
                let got = one_set(path, tp, mode, cfg);
                let mut r = results.lock().unwrap();
                let mut m = by_mode.lock().unwrap();
                for (k, v) in got {
                    *r.entry(k).or_default() += v;
                    *m.entry(mode).or_default() += v;
                }
            });
        }
    });
    let results = results.into_inner().unwrap();
    let by_mode = by_mode.into_inner().unwrap();
    out!("");
    out!("fault matrix: in-process groups, TP 3 and 4, ranks 0 / middle / last, layers first / middle / last");
    out!(
        "{:<14} {:<7} {:>3} {:>6} {:>6} {:>7} {:>12} {:>6} {:>14} {:>12}",
        "fault",
        "path",
        "tp",
        "cells",
        "hangs",
        "panics",
        "wrong bytes",
        "split",
        "as expected",
        "next loaded"
    );
    let mut total = Seen::default();
    for ((kind, path, tp), v) in &results {
        out!(
            "{:<14} {:<7} {:>3} {:>6} {:>6} {:>7} {:>12} {:>6} {:>14} {:>12}",
            kind.name(),
            path,
            tp,
            v.cells,
            v.hangs,
            v.panics,
            v.wrong_bytes,
            v.split,
            format!("{}/{}", v.as_expected, v.cells),
            format!("{}/{}", v.next_loaded, v.cells)
        );
        total += *v;
    }
    for (mode, v) in &by_mode {
        out!(
            "  by mode {mode:<15} cells {:>4}, next loaded {:>4}",
            v.cells,
            v.next_loaded
        );
    }
    out!(
        "TOTAL: {} cells run, {} hangs, {} panics, {} wrong bytes, {} split verdicts, {} as expected, next batch loaded {}/{} ({:.1} s)",
        total.cells,
        total.hangs,
        total.panics,
        total.wrong_bytes,
        total.split,
        total.as_expected,
        total.next_loaded,
        total.cells,
        t0.elapsed().as_secs_f64()
    );
    // 2 paths × 2 TPs × 4 modes × 3 ranks × (7 kinds × 3 layers + 1 plan mismatch).
    assert_eq!(total.cells, 2 * 2 * 4 * 3 * (7 * 3 + 1));
    assert_eq!(
        (total.hangs, total.panics, total.wrong_bytes, total.split),
        (0, 0, 0, 0)
    );
    assert_eq!(
        total.as_expected, total.cells,
        "every faulty batch ended as its fault says"
    );
    assert_eq!(
        total.next_loaded, total.cells,
        "the next batch loaded every time"
    );
    assert!(t0.elapsed() < MATRIX_LIMIT, "{:?}", t0.elapsed());
}
