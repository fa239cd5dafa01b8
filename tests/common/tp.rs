//! TP ranks as threads over one embedded store, through either path: host pools (host rows
//! moved by the in-process group) or device pools on CPU devices (staged landings, the
//! in-process device group on comm streams).

use std::sync::Arc;
use std::time::Duration;

use kvlink::kv_device::{
    CpuDevice, CpuDeviceConfig, Device, DeviceKvPool, HostKvPool, ScatterStrategy,
    StagedLandingFactory, StagingPool,
};
use kvlink::kv_geometry::{
    ComponentLayout, ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, PageHash,
    RowUnit,
};
use kvlink::kv_loader::{BatchOutcome, KvLoadError, KvLoader, ShareMode};
use kvlink::mooncake_linker::store::{Fault, FaultRule, FaultyStore, KvStore, StoreError};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};

use super::{load_plan, page_byte, prompt, wait_all};

/// How the ranks' pools live and share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Path {
    /// Host pools, host rows.
    Host,
    /// Device pools on CPU devices: one device for every rank (as N ranks on one GPU) or one
    /// each; every stream operation delayed by up to `jitter`.
    Device {
        one_device: bool,
        jitter: Duration,
        strategy: ScatterStrategy,
    },
}

impl Path {
    /// Device pools, one CPU device per rank, no jitter, scattering with `strategy`.
    pub fn device_per_rank(strategy: ScatterStrategy) -> Self {
        Path::Device {
            one_device: false,
            jitter: Duration::ZERO,
            strategy,
        }
    }

    /// Device pools, one shared device, a little jitter, automatic scatter.
    pub fn device() -> Self {
        Path::Device {
            one_device: true,
            jitter: Duration::from_micros(200),
            strategy: ScatterStrategy::Auto,
        }
    }
}

/// One rank's pool.
pub enum RankPool {
    Host(Arc<HostKvPool>),
    Device(Arc<DeviceKvPool>),
}

impl RankPool {
    /// Fills every component's layers of `slots` with `byte` (a poison a batch must
    /// overwrite): no batch of the rank may be in flight.
    pub fn poison(&self, g: &KvGeometry, slots: &[u32], byte: u8) {
        for c in g.components() {
            let bytes = vec![byte; c.page_layer_bytes as usize];
            for &layer in &c.layers {
                for &slot in slots {
                    match self {
                        // SAFETY: no batch of the rank is in flight (the caller's promise),
                        // and nothing else touches the rank's pool meanwhile.
                        RankPool::Host(p) => unsafe { p.write_slot(c.id, layer, slot, &bytes) },
                        // SAFETY: as for the host pool.
                        RankPool::Device(p) => unsafe { p.write_slot(c.id, layer, slot, &bytes) },
                    }
                    .unwrap();
                }
            }
        }
    }

    fn read(&self, c: &ComponentLayout, layer: u32, slot: u32, out: &mut [u8]) {
        match self {
            // SAFETY: callers compare after the batch they loaded has finished (its outcome
            // was taken), and nothing else writes these slots meanwhile.
            RankPool::Host(p) => unsafe { p.read_slot(c.id, layer, slot, out) }.unwrap(),
            // SAFETY: as for the host pool.
            RankPool::Device(p) => unsafe { p.read_slot(c.id, layer, slot, out) }.unwrap(),
        }
    }
}

/// Poisons every rank's slots (see [`RankPool::poison`]): no batch of any rank may be in
/// flight.
pub fn poison_all(ranks: &[TpRank]) {
    for r in ranks {
        r.pool.poison(r.linker.geometry(), &r.slots, POISON);
    }
}

/// The byte [`poison_all`] writes.
pub const POISON: u8 = 0xa5;

/// One rank: its linker, pool, store decorator for faults, slots, and its CPU device.
pub struct TpRank {
    pub linker: Linker,
    pub pool: RankPool,
    pub faults: Arc<FaultyStore>,
    pub slots: Vec<u32>,
    pub device: Option<Arc<CpuDevice>>,
    /// The device path's staging pool.
    pub staging: Option<Arc<StagingPool>>,
}

impl TpRank {
    /// The rank's CPU device (device path only) stalls for `stall` at its first
    /// device-to-device copy, that copy included.
    pub fn stall_first_device_copy(&self, stall: Duration) {
        let device = self.device.as_ref().expect("a device-path rank");
        device.stall_at(kvlink::kv_device::cpu::CpuOp::OnDevice, 0, stall);
    }
}

/// A DSA-like model plus a sharded component, so a batch mixes shared and per-rank reads:
/// 5 layers, `k` (replicated), `indexer` (replicated, layers 1 and 4), `v` (12 heads, sharded:
/// TP 2, 3 and 4 divide it).
pub fn mixed_spec() -> ModelKvSpec {
    mixed_spec_with_v(48, 12)
}

/// [`mixed_spec`] with a `v` of `row_bytes` per token split into `heads` heads.
pub fn mixed_spec_with_v(row_bytes: u32, heads: u32) -> ModelKvSpec {
    ModelKvSpec::new(
        "mixed",
        5,
        4,
        vec![
            ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 40),
            ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, 24)
                .on_layers(LayerMap::Sparse(vec![1, 4])),
            ComponentSpec::new("v", RowUnit::Token, ElementType::Bf16, row_bytes).sharded(heads),
        ],
    )
    .unwrap()
}

/// Each rank's own bytes of a page: replicated components are the same everywhere, a sharded
/// one differs per rank (its part of the heads).
pub fn rank_byte(page: &PageHash, c: &ComponentLayout, rank: u32, l: u32, i: usize) -> u8 {
    let salt = if c.replicated { 0 } else { rank as u8 + 1 };
    page_byte(page, c.id.0, l, i) ^ salt.wrapping_mul(101)
}

/// Saves a prefix of `pages` pages the way TP ranks do (rank 0 writes replicated objects,
/// every rank its shard), then builds one linker per rank over `store` on `path`. Every rank
/// gets its own scattered slots.
pub fn tp_ranks(
    spec: &ModelKvSpec,
    tp: u32,
    store: Arc<dyn KvStore>,
    pages: usize,
    config: &LinkerConfig,
    path: Path,
) -> (Vec<TpRank>, Vec<PageHash>) {
    tp_ranks_built(spec, tp, store, pages, config, path, &RankBuild::default())
}

/// How [`tp_ranks_built`] builds each rank beyond the defaults.
pub struct RankBuild<'a> {
    /// Each rank's group passes through this (a test collective decorator on some rank's
    /// handles).
    pub wrap: &'a dyn Fn(u32, TpGroup) -> TpGroup,
    /// Device pools stage through a ring of this many stages (groups of up to `stages - 1`
    /// layers per store call).
    pub stages: usize,
    /// Each rank's store passes through this (a test store decorator on some rank), under
    /// the rank's `FaultyStore`.
    pub store: &'a dyn Fn(u32, Arc<dyn KvStore>) -> Arc<dyn KvStore>,
    /// Device landings wait this long at most for their copies (the drain limit).
    pub drain: Duration,
}

impl Default for RankBuild<'_> {
    fn default() -> Self {
        RankBuild {
            wrap: &|_, g| g,
            stages: 2,
            store: &|_, s| s,
            drain: Duration::from_secs(5),
        }
    }
}

impl<'a> RankBuild<'a> {
    /// Each rank's group passed through `wrap`.
    pub fn wrapped(wrap: &'a dyn Fn(u32, TpGroup) -> TpGroup) -> Self {
        RankBuild {
            wrap,
            ..RankBuild::default()
        }
    }

    /// Device pools staging through a ring of `stages` stages.
    pub fn stages(stages: usize) -> Self {
        RankBuild {
            stages,
            ..RankBuild::default()
        }
    }
}

/// [`tp_ranks`], built as `build` says.
pub fn tp_ranks_built(
    spec: &ModelKvSpec,
    tp: u32,
    store: Arc<dyn KvStore>,
    pages: usize,
    config: &LinkerConfig,
    path: Path,
    build: &RankBuild<'_>,
) -> (Vec<TpRank>, Vec<PageHash>) {
    let hashes = save(spec, tp, store.clone(), pages, config);
    let pool_pages = 3 * pages as u32 + 4;
    let devices: Vec<Arc<CpuDevice>> = match path {
        Path::Host => Vec::new(),
        Path::Device {
            one_device, jitter, ..
        } => {
            let cfg = CpuDeviceConfig {
                max_op_delay: jitter,
                trace: true,
                ..CpuDeviceConfig::default()
            };
            let n = if one_device { 1 } else { tp };
            (0..n)
                .map(|d| CpuDevice::with_config(d, cfg).unwrap())
                .collect()
        }
    };
    let device_of = |r: u32| devices.get((r as usize) % devices.len().max(1)).cloned();
    let groups = match path {
        Path::Host => TpGroup::in_process(tp),
        Path::Device { .. } => TpGroup::in_process_on_devices(
            (0..tp)
                .map(|r| device_of(r).unwrap() as Arc<dyn Device>)
                .collect(),
        )
        .unwrap(),
    };
    let out = groups
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let rank = rank as u32;
            let group = (build.wrap)(rank, group);
            let g = KvGeometry::new(spec.clone(), tp, rank).unwrap();
            let faults = Arc::new(FaultyStore::new((build.store)(rank, store.clone())));
            let slots = (0..pages as u32)
                .map(|i| (i * 3 + rank * 7) % pool_pages)
                .collect();
            let (linker, pool, staging) = match path {
                Path::Host => {
                    let pool = Arc::new(HostKvPool::new(g.clone(), pool_pages).unwrap());
                    let l =
                        Linker::with_group(g, faults.clone(), pool.clone(), config.clone(), group)
                            .unwrap();
                    (l, RankPool::Host(pool), None)
                }
                Path::Device { strategy, .. } => {
                    let dev = device_of(rank).unwrap();
                    let pool =
                        Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), pool_pages).unwrap());
                    let stage = StagingPool::half_bytes_for(&g, pages, tp);
                    let staging = StagingPool::with_stages(dev, stage, build.stages, 3).unwrap();
                    let landings = Arc::new(
                        StagedLandingFactory::new(pool.clone(), staging.clone())
                            .with_strategy(strategy)
                            .with_drain_limit(build.drain),
                    );
                    let l = Linker::with_landings(
                        g,
                        faults.clone(),
                        pool.clone(),
                        landings,
                        config.clone(),
                        Some(group),
                    )
                    .unwrap();
                    (l, RankPool::Device(pool), Some(staging))
                }
            };
            TpRank {
                linker,
                pool,
                faults,
                slots,
                device: device_of(rank),
                staging,
            }
        })
        .collect();
    (out, hashes)
}

/// Saves the prefix of `pages` pages as TP ranks do (objects present are skipped): what
/// [`tp_ranks`] does first, and what an engine's save after a recompute does.
pub fn save(
    spec: &ModelKvSpec,
    tp: u32,
    store: Arc<dyn KvStore>,
    pages: usize,
    config: &LinkerConfig,
) -> Vec<PageHash> {
    let tokens = prompt(11, pages, spec.page_size);
    let hashes = kvlink::kv_geometry::page_hashes(&tokens, spec.page_size, None);
    for rank in 0..tp {
        let g = KvGeometry::new(spec.clone(), tp, rank).unwrap();
        let pool = HostKvPool::new(g.clone(), pages as u32).unwrap();
        let slots: Vec<u32> = (0..pages as u32).collect();
        fill_rank_pool(&pool, &hashes, &slots, rank);
        let linker = Linker::new(g.clone(), store.clone(), Arc::new(pool), config.clone()).unwrap();
        linker.save(&load_plan(&g, 0, &hashes, slots)).unwrap();
        linker.close().unwrap();
    }
    hashes
}

/// Every layer of every page of rank `rank`'s pool holds its saved bytes.
pub fn rank_matches(r: &TpRank, pages: &[PageHash], rank: u32) -> Result<(), String> {
    rank_matches_at(r, pages, rank, &r.slots)
}

/// [`rank_matches`] for pages loaded into `slots`.
pub fn rank_matches_at(
    r: &TpRank,
    pages: &[PageHash],
    rank: u32,
    slots: &[u32],
) -> Result<(), String> {
    rank_matches_below(r, pages, rank, slots, u32::MAX)
}

/// [`rank_matches_at`] for the layers below `upto` only (those a failed batch published).
pub fn rank_matches_below(
    r: &TpRank,
    pages: &[PageHash],
    rank: u32,
    slots: &[u32],
    upto: u32,
) -> Result<(), String> {
    let g = r.linker.geometry();
    bytes_match(g, pages, rank, slots, upto, |c, l, slot, got| {
        r.pool.read(c, l, slot, got)
    })
}

/// Whether `rank`'s slots hold each page's [`rank_byte`]s on every layer below `upto`,
/// reading a slot's layer through `read`; the first wrong byte otherwise.
pub fn bytes_match(
    g: &KvGeometry,
    pages: &[PageHash],
    rank: u32,
    slots: &[u32],
    upto: u32,
    read: impl Fn(&ComponentLayout, u32, u32, &mut [u8]),
) -> Result<(), String> {
    for (pi, (page, &slot)) in pages.iter().zip(slots).enumerate() {
        for c in g.components() {
            for &l in c.layers.iter().filter(|&&l| l < upto) {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                read(c, l, slot, &mut got);
                if let Some(i) = got
                    .iter()
                    .enumerate()
                    .position(|(i, &b)| b != rank_byte(page, c, rank, l, i))
                {
                    return Err(format!(
                        "rank {rank} page {pi} comp {} layer {l} byte {i}",
                        c.name
                    ));
                }
            }
        }
    }
    Ok(())
}

/// Writes `rank`'s bytes of each page ([`rank_byte`]) into `slots` of a new `pool`, as the
/// engine's prefill would (no batch of the pool is in flight).
pub fn fill_rank_pool(pool: &HostKvPool, pages: &[PageHash], slots: &[u32], rank: u32) {
    use kvlink::kv_device::KvPool;
    for (page, &slot) in pages.iter().zip(slots) {
        for c in pool.geometry().components() {
            for &l in &c.layers {
                let data: Vec<u8> = (0..c.page_layer_bytes as usize)
                    .map(|i| rank_byte(page, c, rank, l, i))
                    .collect();
                // SAFETY: the engine's prefill: no batch of the pool is in flight (the
                // caller's pool is new).
                unsafe { pool.write_slot(c.id, l, slot, &data) }.unwrap();
            }
        }
    }
}

/// Every rank starts batch `batch`, waits every layer like an engine, and takes the outcome.
pub fn run(ranks: &[TpRank], batch: u64, pages: &[PageHash]) -> Vec<BatchOutcome> {
    run_at(ranks, batch, pages, &|r| r.slots.clone())
}

/// [`run`] into the slots `slots(rank)` gives.
pub fn run_at(
    ranks: &[TpRank],
    batch: u64,
    pages: &[PageHash],
    slots: &(dyn Fn(&TpRank) -> Vec<u32> + Sync),
) -> Vec<BatchOutcome> {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|r| {
                s.spawn(move || {
                    let plan = load_plan(r.linker.geometry(), batch, pages, slots(r));
                    let t = r.linker.start_load(plan).unwrap();
                    let _ = wait_all(&r.linker, &t);
                    r.linker.wait_batch(&t).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// [`run`], with when each rank's batch outcome was in.
pub fn run_timed(
    ranks: &[TpRank],
    batch: u64,
    pages: &[PageHash],
) -> (Vec<BatchOutcome>, Vec<std::time::Instant>) {
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|r| {
                s.spawn(move || {
                    let plan = load_plan(r.linker.geometry(), batch, pages, r.slots.clone());
                    let t = r.linker.start_load(plan).unwrap();
                    let _ = wait_all(&r.linker, &t);
                    let o = r.linker.wait_batch(&t).unwrap();
                    (o, std::time::Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).unzip()
    })
}

/// Every rank loaded `batch` whole, in one mode, every byte in place; the mode. The ranks'
/// slots are poisoned first, so that bytes an earlier batch left there cannot pass for this
/// one's (no batch of any rank may be in flight).
pub fn run_ok(ranks: &[TpRank], batch: u64, pages: &[PageHash], what: &str) -> ShareMode {
    poison_all(ranks);
    let outcomes = run(ranks, batch, pages);
    let mut modes = Vec::new();
    for (rank, (r, o)) in ranks.iter().zip(outcomes).enumerate() {
        let stats = o
            .result
            .unwrap_or_else(|e| panic!("{what}: batch {batch}, rank {rank}: {e}"));
        modes.push(stats.mode);
        rank_matches(r, pages, rank as u32)
            .unwrap_or_else(|e| panic!("{what}: batch {batch}: {e}"));
    }
    assert!(
        modes.windows(2).all(|w| w[0] == w[1]),
        "{what}: batch {batch}: modes differ across ranks: {modes:?}"
    );
    modes[0]
}

/// A linker configuration for `Auto` with short deadlines and every bandwidth known, so that
/// the model picks a sharing mode (a store slower than the fabric).
pub fn auto_config() -> LinkerConfig {
    LinkerConfig {
        mode: kvlink::mooncake_linker::dedup_broadcast::ModeChoice::Auto,
        bandwidths: kvlink::mooncake_linker::dedup_broadcast::Bandwidths {
            store_per_rank_gbps: 1.0,
            store_aggregate_gbps: 1.0,
            fabric_broadcast_gbps: 50.0,
            fabric_all_gather_gbps: 50.0,
        },
        ..config(kvlink::kv_loader::ShareMode::AllRanks)
    }
}

/// Every share mode by name (`Auto` from [`auto_config`], the others from [`config`]), each
/// configuration passed through `adjust`.
pub fn every_mode(
    adjust: impl Fn(LinkerConfig) -> LinkerConfig,
) -> Vec<(&'static str, LinkerConfig)> {
    use kvlink::kv_loader::ShareMode;
    vec![
        ("AllRanks", adjust(config(ShareMode::AllRanks))),
        ("Rank0Broadcast", adjust(config(ShareMode::Rank0Broadcast))),
        ("SplitAllGather", adjust(config(ShareMode::SplitAllGather))),
        ("Auto", adjust(auto_config())),
    ]
}

/// The fault matrices' deadlines: reads `read_timeout`, collectives and other store calls
/// 3 s, waits 8 s.
pub fn fault_deadlines(read_timeout: Duration, c: LinkerConfig) -> LinkerConfig {
    LinkerConfig {
        layer_read_timeout: read_timeout,
        collective_timeout: Duration::from_secs(3),
        store_call_timeout: Duration::from_secs(3),
        wait_deadline: Duration::from_secs(8),
        ..c
    }
}

/// A linker configuration for `mode` with short deadlines, one layer per store call (the
/// failure tests name the layer a fault hits; layer groups are tested in layer_groups.rs).
pub fn config(mode: kvlink::kv_loader::ShareMode) -> LinkerConfig {
    LinkerConfig {
        namespace: "tp".into(),
        mode: kvlink::mooncake_linker::dedup_broadcast::ModeChoice::Fixed(mode),
        wait_deadline: Duration::from_secs(10),
        collective_timeout: Duration::from_secs(5),
        read_granularity: kvlink::mooncake_linker::ReadGranularity::Fixed { layers_per_call: 1 },
        ..LinkerConfig::default()
    }
}

/// Both paths at their plainest: host pools, and device pools on one CPU device with no
/// jitter and automatic scatter.
pub fn paths() -> [Path; 2] {
    [
        Path::Host,
        Path::Device {
            one_device: true,
            jitter: Duration::ZERO,
            strategy: ScatterStrategy::Auto,
        },
    ]
}

/// Fails, once, the read of layer `layer` of the sharded component `v` in the objects whose
/// key contains `key`: a read every rank does itself, in every share mode.
pub fn fail_v_read(faults: &FaultyStore, g: &KvGeometry, key: String, layer: u32) {
    let v = g.component_by_name("v").unwrap();
    faults.inject(
        FaultRule {
            key_contains: Some(key),
            offset: Some(v.layer_range(layer).unwrap().start),
            times: Some(1),
            ..FaultRule::default()
        },
        Fault::Error(StoreError::TransferFailed {
            key: "injected".into(),
            code: -800,
        }),
    );
}

/// Every rank failed with `PeerFailed { rank, layer }`, the same code everywhere; the rank
/// that failed (`outcomes` are in rank order) adds its own error's words to it.
pub fn same_verdict(outcomes: &[BatchOutcome], rank: u32, layer: u32, what: &str) {
    let verdicts: Vec<(u32, u32, &str)> = outcomes
        .iter()
        .map(|o| match &o.result {
            Err(KvLoadError::PeerFailed {
                rank,
                layer,
                detail,
                ..
            }) => (*rank, *layer, detail.as_str()),
            Err(other) => panic!("{what}: {other:?}"),
            Ok(_) => panic!("{what}: a rank loaded despite the failure"),
        })
        .collect();
    let code = verdicts
        .iter()
        .enumerate()
        .find(|(r, _)| *r as u32 != rank)
        .map(|(_, v)| v.2);
    for (r, &(first, at, detail)) in verdicts.iter().enumerate() {
        assert_eq!((first, at), (rank, layer), "{what}: rank {r}");
        match code {
            Some(code) if r as u32 == rank => assert!(
                detail.starts_with(code) && detail.len() > code.len(),
                "{what}: the failed rank's detail {detail:?} extends {code:?}"
            ),
            Some(code) => assert_eq!(detail, code, "{what}: rank {r}"),
            None => {}
        }
    }
}
