//! A seeded soak of combined faults: where the fault matrix puts one fault on one rank's own
//! shard per batch, each round here puts up to three at once, on any rank, on a replicated
//! component as well as the shard, of mixed kinds (an error, a short read, a slow read, a call
//! that panics, one that hangs until released, the store going down for that rank; and, once
//! per set each, a rank leaving the group and a rank's collective panicking at a layer's status
//! exchange, after which the group re-forms at the next batch), while
//! every rank also runs a lookup on its control handle beside the batch. TP 3 (`KVLINK_SOAK_TP`
//! sets 2, 4 or 6), every mode, host pools and the device path (CPU devices), ranks as threads.
//!
//! Every round must end within its bound (no hang), with no panic, the same verdict on every
//! rank (all loaded or all failed; failed exactly when a fault fired), every byte right in the
//! layers a rank published (all of them when it loaded; the slots are poisoned before each
//! round, so a layer reported ready that never landed shows), every lookup answering the whole
//! prefix unless a store went down or the group broke (a rank gone, a collective panicking:
//! then those that answer agree), and the next batch, without faults, loading on every rank.
//! Each set's seed is printed; `KVLINK_SOAK_SEED=<hex>` runs every set from that seed (a
//! printed one replays its set), `KVLINK_SOAK_ROUNDS` runs more rounds.

/// Writes a line straight to this process's stdout: the test harness does not capture it, so
/// the soak's summary shows in CI logs whether the test passes or fails.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

mod common;

use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::coll::{Misbehave, Misbehaving};
use common::tp::{every_mode, fault_deadlines, mixed_spec, paths, rank_matches_below, run_ok};
use common::tp::{tp_ranks_built, Path, RankBuild, TpRank};
use kvlink::kv_geometry::PageHash;
use kvlink::kv_loader::{KvLoadError, KvLoader};
use kvlink::mooncake_linker::store::{EmbeddedStore, Fault, FaultRule, KvStore, Stall, StoreError};
use kvlink::mooncake_linker::{LinkerConfig, TpGroup};

/// The TP size: 3 unless `KVLINK_SOAK_TP` says otherwise (2, 4 or 6: the sharded component's
/// 12 heads must divide among the ranks).
fn tp() -> u32 {
    std::env::var("KVLINK_SOAK_TP")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .filter(|tp| [2, 3, 4, 6].contains(tp))
        .unwrap_or(3)
}
const PAGES: usize = 4;
const READ_TIMEOUT: Duration = Duration::from_millis(200);
/// A round not done by then counts as a hang.
const ROUND_LIMIT: Duration = Duration::from_secs(60);

/// A small deterministic generator (xorshift64*), so that a seed replays a round exactly.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Error,
    Short,
    Slow,
    Panic,
    Hung,
    Down,
    /// The set's gone rank leaves the group (its data handle is dropped) at its layer's status
    /// exchange: once per set, the first round it reaches that exchange armed.
    Gone,
    /// The set's panicking rank's data collective panics at its layer's status exchange: once
    /// per set, likewise.
    CollectivePanic,
}

const KINDS: [Kind; 8] = [
    Kind::Error,
    Kind::Short,
    Kind::Slow,
    Kind::Panic,
    Kind::Hung,
    Kind::Down,
    Kind::Gone,
    Kind::CollectivePanic,
];

/// A set's two misbehaving data collectives (each misbehaves once, in the first round that
/// arms it and reaches its layer; a re-formed group's handles are not wrapped).
struct Group {
    gone: Arc<Misbehaving>,
    panics: Arc<Misbehaving>,
}

impl Group {
    fn of(&self, kind: Kind) -> Option<&Misbehaving> {
        match kind {
            Kind::Gone => Some(&self.gone),
            Kind::CollectivePanic => Some(&self.panics),
            _ => None,
        }
    }

    /// How many of the two have misbehaved.
    fn struck(&self) -> u32 {
        u32::from(self.gone.done()) + u32::from(self.panics.done())
    }

    /// Ranks as threads whose data collectives misbehave as drawn from `rng`: one rank leaves
    /// the group, one (the same or another) panics, each at a layer's status exchange.
    fn build(rng: &mut Rng, cfg: &LinkerConfig, path: Path) -> (Vec<TpRank>, Vec<PageHash>, Self) {
        let tp = tp();
        let layers = mixed_spec().num_layers as usize;
        let gone_at = (rng.below(tp as usize) as u32, rng.below(layers) as u32);
        let panic_at = (rng.below(tp as usize) as u32, rng.below(layers) as u32);
        let made = std::sync::Mutex::new((None, None));
        let wrap = |rank: u32, g: TpGroup| {
            let mut made = made.lock().unwrap();
            let mut data = g.data.clone();
            if rank == gone_at.0 {
                let m = Misbehaving::new(data, Misbehave::GoneAtLayer { layer: gone_at.1 });
                made.0 = Some(m.clone());
                data = m;
            }
            if rank == panic_at.0 {
                let m = Misbehaving::new(data, Misbehave::PanicAtLayer { layer: panic_at.1 });
                made.1 = Some(m.clone());
                data = m;
            }
            TpGroup { data, ..g }
        };
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 28));
        let build = RankBuild::wrapped(&wrap);
        let (ranks, pages) = tp_ranks_built(&mixed_spec(), tp, store, PAGES, cfg, path, &build);
        let (gone, panics) = made.into_inner().unwrap();
        let group = Group {
            gone: gone.unwrap(),
            panics: panics.unwrap(),
        };
        (ranks, pages, group)
    }
}

/// One fault of a round: its kind, on which rank's store, on the range of which component,
/// page and layer.
#[derive(Debug, Clone)]
struct Planned {
    kind: Kind,
    rank: u32,
    component: &'static str,
    page: usize,
    layer: u32,
}

/// Up to three faults, each on a layer its component has.
fn plan_round(rng: &mut Rng, ranks: &[TpRank]) -> Vec<Planned> {
    let g = ranks[0].linker.geometry();
    (0..rng.below(4))
        .map(|_| {
            let component = ["k", "indexer", "v"][rng.below(3)];
            let layers = &g.component_by_name(component).unwrap().layers;
            Planned {
                kind: KINDS[rng.below(KINDS.len())],
                rank: rng.below(ranks.len()) as u32,
                component,
                page: rng.below(PAGES),
                layer: layers[rng.below(layers.len())],
            }
        })
        .collect()
}

/// Arms `faults` on their ranks' stores (each on one ranged read of its object's layer,
/// once) or, for a rank leaving or a collective panicking, the set's misbehaving collective
/// (unless it misbehaved already); the stalls to release after the round's waits.
fn arm(
    ranks: &[TpRank],
    group: &Group,
    pages: &[PageHash],
    batch: u64,
    faults: &[Planned],
) -> Vec<Stall> {
    let mut stalls = Vec::new();
    for f in faults {
        if let Some(m) = group.of(f.kind) {
            if !m.done() {
                m.arm();
            }
            continue;
        }
        let r = &ranks[f.rank as usize];
        let g = r.linker.geometry();
        let plan = common::load_plan(g, batch, pages, r.slots.clone());
        let c = g.component_by_name(f.component).unwrap();
        let keys = r.linker.object_keys(&plan).unwrap();
        let rule = FaultRule {
            key_contains: Some(keys[c.id.0 as usize][f.page].clone()),
            offset: Some(c.layer_range(f.layer).unwrap().start),
            times: Some(1),
            ..FaultRule::default()
        };
        let fault = match f.kind {
            Kind::Error => Fault::Error(StoreError::TransferFailed {
                key: "injected".into(),
                code: -800,
            }),
            Kind::Short => Fault::Short,
            Kind::Slow => Fault::Delay(READ_TIMEOUT + Duration::from_millis(150)),
            Kind::Panic => Fault::Panic,
            Kind::Hung => {
                let s = Stall::new();
                stalls.push(s.clone());
                Fault::Stall(s)
            }
            Kind::Down => Fault::Down,
            Kind::Gone | Kind::CollectivePanic => unreachable!("armed on the collective above"),
        };
        r.faults.inject(rule, fault);
    }
    stalls
}

/// What one round came to.
struct Round {
    /// What went wrong (empty: nothing).
    wrong: Vec<String>,
    /// Its batch failed (on every rank).
    failed: bool,
    /// How many of the set's misbehaving collectives struck in it.
    struck: u32,
}

/// Runs one round: its batch on every rank with `faults` armed, a lookup beside each.
fn round(
    ranks: &[TpRank],
    group: &Group,
    pages: &[PageHash],
    batch: u64,
    faults: &[Planned],
) -> Round {
    let mut wrong = Vec::new();
    for r in ranks {
        r.pool.poison(r.linker.geometry(), &r.slots, 0xa5);
    }
    let struck_before = group.struck();
    let stalls = arm(ranks, group, pages, batch, faults);
    // Every rank starts the batch and waits its layers, a lookup beside it on another thread.
    let waited: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|r| {
                let lookup = s.spawn(move || r.linker.lookup_pages(pages, 0));
                let load = s.spawn(move || {
                    let plan =
                        common::load_plan(r.linker.geometry(), batch, pages, r.slots.clone());
                    let t = r.linker.start_load(plan).unwrap();
                    let published = (0..r.linker.num_layers())
                        .take_while(|&l| r.linker.wait_layer(&t, l).is_ok())
                        .count() as u32;
                    (t, published)
                });
                (load, lookup)
            })
            .collect();
        hs.into_iter()
            .map(|(load, lookup)| (load.join(), lookup.join()))
            .collect()
    });
    let struck = group.struck() - struck_before;
    let fired: u32 = ranks.iter().map(|r| r.faults.faults_hit()).sum::<u32>() + struck;
    for r in ranks {
        r.faults.clear();
    }
    // A collective armed whose layer this batch never reached (it failed before) must not
    // misbehave in the next one.
    group.gone.disarm();
    group.panics.disarm();
    for s in &stalls {
        s.release();
    }
    // A store down answers every call of its rank: the lookups beside may fail there.
    let down = faults.iter().any(|f| matches!(f.kind, Kind::Down));
    // So may a rank leaving or a collective panicking: the group is aborted, control handle
    // too, and re-formed (lookups beside fail on their ranks; those that answer agree).
    let broken = struck > 0;
    let mut loaded = Vec::new();
    let mut hits = Vec::new();
    for (rank, (load, lookup)) in waited.into_iter().enumerate() {
        match lookup {
            Ok(Ok(hit)) => hits.push(hit.pages.len()),
            // The group's abort fails a lookup beside as a collective's failure (or the group
            // down): any other kind is a problem there too.
            Ok(Err(KvLoadError::Collective { .. } | KvLoadError::GroupDown { .. })) if broken => {}
            Ok(Err(e)) if !down => wrong.push(format!("rank {rank}: the lookup failed: {e}")),
            Ok(Err(_)) => {}
            Err(_) => wrong.push(format!("rank {rank}: the lookup panicked")),
        }
        let Ok((t, published)) = load else {
            wrong.push(format!("rank {rank}: the load panicked"));
            continue;
        };
        let r = &ranks[rank];
        let ok = match r.linker.wait_batch(&t) {
            Ok(o) => o.result.is_ok(),
            Err(e) => {
                wrong.push(format!("rank {rank}: no outcome: {e}"));
                false
            }
        };
        loaded.push(ok);
        let upto = if ok { u32::MAX } else { published };
        if let Err(e) = rank_matches_below(r, pages, rank as u32, &r.slots, upto) {
            wrong.push(format!("rank {rank}: wrong bytes: {e}"));
        }
        if ok && published != r.linker.num_layers() {
            wrong.push(format!(
                "rank {rank}: loaded, but only {published} layers were ready"
            ));
        }
    }
    if !(loaded.iter().all(|&l| l) || loaded.iter().all(|&l| !l)) {
        wrong.push(format!("split verdict: {loaded:?}"));
    }
    // A fault that fired fails the batch (a slow read past its deadline, an error, a short
    // read, a panic, a hung call, a store down); with none, it loads.
    let all_loaded = loaded.iter().all(|&l| l);
    if fired == 0 && !all_loaded {
        wrong.push("no fault fired, yet the batch failed".into());
    }
    if fired > 0 && loaded.iter().any(|&l| l) {
        wrong.push(format!(
            "{fired} faults fired, yet the batch loaded: {loaded:?}"
        ));
    }
    // A broken group fails lookups, never shortens one that answers: only a store down may.
    if hits.windows(2).any(|w| w[0] != w[1]) || (!down && hits.iter().any(|&h| h != PAGES)) {
        wrong.push(format!("lookups disagree or miss pages: {hits:?}"));
    }
    // The next batch, without faults, loads on every rank.
    let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_ok(ranks, batch + 1, pages, "the next batch")
    }));
    if next.is_err() {
        wrong.push("the next batch did not load on every rank".into());
    }
    let failed = !loaded.is_empty() && loaded.iter().all(|&l| !l);
    Round {
        wrong,
        failed,
        struck,
    }
}

/// What one set's rounds came to.
#[derive(Default)]
struct Soaked {
    rounds: usize,
    /// Rounds whose batch failed on every rank (the faults fired).
    failed: usize,
    /// Rounds where a rank left the group or its collective panicked (at most two a set).
    struck: usize,
    problems: Vec<String>,
}

/// Runs `rounds` rounds on fresh ranks of `(path, mode)`, configured `cfg`, from `seed`.
fn soak(path: Path, mode: &'static str, cfg: &LinkerConfig, seed: u64, rounds: usize) -> Soaked {
    let mut rng = Rng(seed | 1);
    let (ranks, pages, group) = Group::build(&mut rng, cfg, path);
    let ranks = Arc::new(ranks);
    let pages = Arc::new(pages);
    let group = Arc::new(group);
    run_ok(&ranks, 1, &pages, "fresh ranks");
    let mut soaked = Soaked::default();
    for i in 0..rounds {
        let faults = plan_round(&mut rng, &ranks);
        let batch = 2 + 2 * i as u64;
        let (tx, rx) = mpsc::channel();
        let (rs, gs, ps, fs) = (ranks.clone(), group.clone(), pages.clone(), faults.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                round(&rs, &gs, &ps, batch, &fs)
            }));
            let _ = tx.send(r);
        });
        soaked.rounds += 1;
        let wrong = match rx.recv_timeout(ROUND_LIMIT) {
            Ok(Ok(r)) => {
                soaked.failed += usize::from(r.failed);
                soaked.struck += r.struck as usize;
                r.wrong
            }
            Ok(Err(_)) => vec!["the round panicked".into()],
            Err(_) => {
                // Its ranks are stuck: no later round can use them.
                soaked.problems.push(format!(
                    "{path:?} {mode} seed {seed:#x} round {i}: hang ({faults:?})"
                ));
                return soaked;
            }
        };
        for w in wrong {
            soaked.problems.push(format!(
                "{path:?} {mode} seed {seed:#x} round {i} ({faults:?}): {w}"
            ));
        }
    }
    soaked
}

#[test]
fn combined_faults_with_lookups_beside_never_hang_split_or_land_wrong_bytes() {
    let t0 = Instant::now();
    let replay: Option<u64> = std::env::var("KVLINK_SOAK_SEED")
        .ok()
        .and_then(|s| u64::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok());
    let rounds: usize = std::env::var("KVLINK_SOAK_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let base: u64 = 0x005e_ed0f_fa17;
    let mut sets = Vec::new();
    for (p, path) in paths().into_iter().enumerate() {
        let modes = every_mode(|c| fault_deadlines(READ_TIMEOUT, c));
        for (m, (mode, cfg)) in modes.into_iter().enumerate() {
            let seed = replay.unwrap_or(base ^ ((p as u64) << 40) ^ ((m as u64) << 32));
            sets.push((path, mode, cfg, seed));
        }
    }
    // Two sets at a time: most of a slow or hung round is waiting for a deadline.
    let work = std::sync::Mutex::new(sets);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| loop {
                let Some((path, mode, cfg, seed)) = work.lock().unwrap().pop() else {
                    return;
                };
                let soaked = soak(path, mode, &cfg, seed, rounds);
                out!(
                    "soak {path:?} {mode}: seed {seed:#x}, {} rounds ({} failed on every \
                     rank, {} with a rank gone or a collective panicking), {} problems",
                    soaked.rounds,
                    soaked.failed,
                    soaked.struck,
                    soaked.problems.len()
                );
                results.lock().unwrap().push(soaked);
            });
        }
    });
    let results = results.into_inner().unwrap();
    let ran: usize = results.iter().map(|s| s.rounds).sum();
    let failed: usize = results.iter().map(|s| s.failed).sum();
    let struck: usize = results.iter().map(|s| s.struck).sum();
    let problems: Vec<String> = results.into_iter().flat_map(|s| s.problems).collect();
    for p in &problems {
        out!("  {p}");
    }
    out!(
        "SOAK: TP {}, {ran} rounds run, {failed} failed on every rank ({struck} with a rank gone \
         or a collective panicking), {} problems ({:.1} s)",
        tp(),
        problems.len(),
        t0.elapsed().as_secs_f64()
    );
    assert!(
        problems.is_empty(),
        "{} problems: {problems:#?}",
        problems.len()
    );
    assert_eq!(ran, 2 * 4 * rounds, "every round of every set ran");
    // The faults fired: most rounds carry one, and a fault on any read fails its batch.
    assert!(failed * 3 >= ran, "only {failed} of {ran} rounds failed");
    // Each set has a rank to leave and a collective to panic: with 8 rounds a set, several do.
    assert!(
        struck > 0,
        "no rank left the group and no collective panicked"
    );
}
