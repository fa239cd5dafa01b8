//! The ranks of one (pools, TP) configuration: each rank's Mooncake client, KV pool (host, or
//! device with its pinned staging ring) and scattered slots; linkers over them for a mode; one
//! batch on every rank at once with the engine's modelled compute; every pool verified against
//! the prefix's checksums.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use kvlink::dedup_broadcast::ModeChoice;
use kvlink::kv_device::{
    CpuDevice, Device, DeviceKvPool, HostKvPool, KvPool, StagedLandingFactory, StagingPool,
};
use kvlink::kv_geometry::{layer_checksum, KvGeometry};
use kvlink::kv_loader::{BatchId, BatchPlan, KvLoader, LayerReady, LoadStats, RequestPages};
use kvlink::mooncake_linker::store::KvStore;
use kvlink::mooncake_linker::{Linker, LinkerConfig, ReadGranularity, TpGroup};

use crate::args::Pools;
use crate::prefix::{geometry, Prefix};
use kvlink_rig::pattern::Rng;
use kvlink_rig::ranks::{all_ok, on_ranks, TimedBarrier};
use kvlink_rig::report::de;

/// Longest a rank waits at the batch's start barrier for the others.
const BARRIER_WAIT: Duration = Duration::from_secs(300);

/// One rank's pool.
pub enum RankPool {
    Host(Arc<HostKvPool>),
    Device {
        pool: Arc<DeviceKvPool>,
        staging: Arc<StagingPool>,
        dev: Arc<dyn Device>,
    },
}

/// One rank.
pub struct RankRig {
    pub g: KvGeometry,
    pub store: Arc<dyn KvStore>,
    pub pool: RankPool,
    pub slots: Vec<u32>,
}

/// Every rank of one configuration.
pub struct Rig {
    pub pools: Pools,
    pub tp: u32,
    pub ranks: Vec<RankRig>,
    /// Stages of each device rank's staging ring (0 for host pools).
    pub stages: usize,
}

/// What one rank saw of one batch.
pub struct RankRun {
    pub stats: LoadStats,
    /// Seconds from `start_load` to the first and the last layer ready (device pools: its
    /// event synchronized), and to the engine's last layer computed.
    pub first: f64,
    pub last: f64,
    pub forward_done: f64,
}

/// The device of rank `rank` for `pools`.
fn device(pools: Pools, rank: u32) -> Result<Arc<dyn Device>> {
    match pools {
        Pools::Cpu => Ok(CpuDevice::new(0).map_err(de).map_err(|e| anyhow!(e))?),
        #[cfg(feature = "cuda")]
        Pools::Gpu => Ok(kvlink::kv_device::cuda::CudaDevice::new(0)
            .map_err(de)
            .map_err(|e| anyhow!(e))?),
        #[cfg(feature = "cuda")]
        Pools::Nccl => Ok(kvlink::kv_device::cuda::CudaDevice::new(rank)
            .map_err(de)
            .map_err(|e| anyhow!(e))?),
        other => {
            let _ = rank;
            bail!("{} pools need a build with --features cuda", other.name())
        }
    }
}

impl Rig {
    /// `tp` ranks over `stores[..tp]`, pools of `prefix`'s pages at scattered slots, device
    /// pools staging through `staging_bytes` each.
    pub fn new(
        pools: Pools,
        tp: u32,
        stores: &[Arc<dyn KvStore>],
        prefix: &Prefix,
        staging_bytes: u64,
        seed: u64,
    ) -> Result<Self> {
        let n = prefix.pages.len();
        let pool_pages = n as u32;
        let g0 = geometry(tp, 0)?;
        let stage_bytes = StagingPool::half_bytes_for(&g0, n, tp);
        // The ring: as many stages as the budget holds, at least 2, at most one per layer + 1.
        let stages = ((staging_bytes / stage_bytes.max(1) as u64) as usize)
            .clamp(2, g0.num_layers() as usize + 1);
        let ranks = all_ok(on_ranks(tp as usize, |r| {
            let r = r as u32;
            let g = geometry(tp, r).map_err(|e| e.to_string())?;
            let pool = match pools {
                Pools::Host => {
                    let p = Arc::new(HostKvPool::new(g.clone(), pool_pages).map_err(de)?);
                    RankPool::Host(p)
                }
                _ => {
                    let dev = device(pools, r).map_err(|e| e.to_string())?;
                    let pool = Arc::new(
                        DeviceKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?,
                    );
                    let staging = StagingPool::with_stages(dev.clone(), stage_bytes, stages, 1)
                        .map_err(de)?;
                    RankPool::Device { pool, staging, dev }
                }
            };
            let slots = Rng(seed ^ 0x51075 ^ (u64::from(r) << 32) ^ n as u64)
                .scattered_slots(n, pool_pages)?;
            Ok(RankRig {
                g,
                store: stores[r as usize].clone(),
                pool,
                slots,
            })
        }))
        .map_err(|e| anyhow!(e))?;
        let rig = Rig {
            pools,
            tp,
            ranks,
            stages: if pools == Pools::Host { 0 } else { stages },
        };
        rig.clear()?;
        Ok(rig)
    }

    /// The groups of this configuration (data, control and a formation per rank).
    fn groups(&self) -> Result<Vec<TpGroup>> {
        match self.pools {
            Pools::Host => Ok(TpGroup::in_process(self.tp)),
            Pools::Gpu | Pools::Cpu => {
                let devs = self
                    .ranks
                    .iter()
                    .map(|r| match &r.pool {
                        RankPool::Device { dev, .. } => Ok(dev.clone()),
                        RankPool::Host(_) => Err(anyhow!("a host pool in a device rig")),
                    })
                    .collect::<Result<Vec<_>>>()?;
                TpGroup::in_process_on_devices(devs)
                    .map_err(|e| anyhow!("in-process device group: {e}"))
            }
            Pools::Nccl => nccl_groups(self.tp),
        }
    }

    /// One linker per rank for `mode`, from the default prior (a fresh linker, as an engine
    /// starts: its first batch in each mode plans from the prior), with the engine's compute
    /// configured.
    pub fn linkers(
        &self,
        prefix: &Prefix,
        mode: ModeChoice,
        compute: Duration,
    ) -> Result<Vec<Linker>> {
        let config = LinkerConfig {
            namespace: prefix.namespace.as_str().into(),
            mode,
            wait_deadline: Duration::from_secs(600),
            layer_read_timeout: Duration::from_secs(120),
            collective_timeout: Duration::from_secs(150),
            // Every batch reads its checksum companions, as a load of a prefix not loaded
            // before: the table loads one prefix again and again, which kept checksums would
            // flatter.
            checksum_cache_entries: 0,
            read_granularity: ReadGranularity::Adaptive {
                max_layers_per_call: u32::MAX,
                // The modelled compute, as an engine that knows its compute configures it (a
                // device engine's compute is not visible between its waits).
                compute_per_layer: Some(compute),
                prior: ReadGranularity::DEFAULT_PRIOR,
            },
            ..LinkerConfig::default()
        };
        let groups = self.groups()?;
        self.ranks
            .iter()
            .zip(groups)
            .map(|(r, group)| {
                let linker = match &r.pool {
                    RankPool::Host(p) => Linker::with_group(
                        r.g.clone(),
                        r.store.clone(),
                        p.clone(),
                        config.clone(),
                        group,
                    ),
                    RankPool::Device { pool, staging, .. } => Linker::with_landings(
                        r.g.clone(),
                        r.store.clone(),
                        pool.clone(),
                        Arc::new(StagedLandingFactory::new(pool.clone(), staging.clone())),
                        config.clone(),
                        Some(group),
                    ),
                };
                linker.map_err(|e| anyhow!("rank {}: linker: {e}", r.g.tp_rank()))
            })
            .collect()
    }

    /// Every rank loads the prefix as batch `batch` at once (a barrier), waits every layer as
    /// an engine does (device pools: the layer's event synchronized) and computes it
    /// (`compute`: a sleep), then takes the outcome. First and last layer ready: when the
    /// layer was ready (a watcher thread's wait), not when the engine came to it.
    pub fn run_batch(
        &self,
        linkers: &[Linker],
        prefix: &Prefix,
        batch: u64,
        compute: Duration,
    ) -> Result<Vec<RankRun>> {
        let barrier = TimedBarrier::new(linkers.len());
        let runs = on_ranks(linkers.len(), |r| {
            let linker = &linkers[r];
            let plan = BatchPlan::all_components(
                linker.geometry(),
                BatchId(batch),
                vec![RequestPages {
                    request: "mooncake-modes".into(),
                    pages: prefix.pages.clone(),
                }],
                self.ranks[r].slots.clone(),
            );
            barrier.wait(BARRIER_WAIT)?;
            let t0 = Instant::now();
            let ticket = linker.start_load(plan).map_err(|e| e.to_string())?;
            // When each layer is ready: a watcher waits for every layer as it comes, apart from
            // the engine thread, which reaches layer l only after computing the layers before
            // it (its own arrival would floor "last layer ready" at the modelled compute).
            let ready_at = |l: u32| {
                linker.wait_layer(&ticket, l).and_then(|r| match r {
                    LayerReady::Event(ev) => ev.synchronize(),
                    LayerReady::Resident => Ok(()),
                })
            };
            let (ready, failed) = std::thread::scope(|s| {
                let watcher = s.spawn(|| {
                    let mut ready = Vec::with_capacity(linker.num_layers() as usize);
                    for l in 0..linker.num_layers() {
                        if let Err(e) = ready_at(l) {
                            return Err(format!("layer {l} (the ready-time watcher): {e}"));
                        }
                        ready.push(t0.elapsed().as_secs_f64());
                    }
                    Ok(ready)
                });
                let mut failed = None;
                for l in 0..linker.num_layers() {
                    if let Err(e) = ready_at(l) {
                        failed = Some(format!("layer {l}: {e}"));
                        break;
                    }
                    if !compute.is_zero() {
                        std::thread::sleep(compute);
                    }
                }
                let watched = watcher
                    .join()
                    .unwrap_or_else(|_| Err("the ready-time watcher panicked".into()));
                (watched, failed)
            });
            // A layer the watcher did not see ready fails the batch's run: its times would be
            // missing from the table (a NaN the slowest-rank maximum drops).
            let (ready, failed) = match (ready, failed) {
                (Ok(ready), failed) => (ready, failed),
                (Err(e), None) => (Vec::new(), Some(e)),
                (Err(_), failed) => (Vec::new(), failed),
            };
            let first = ready.first().copied().unwrap_or(f64::NAN);
            let last = ready.last().copied().unwrap_or(f64::NAN);
            let forward_done = t0.elapsed().as_secs_f64();
            let outcome = linker.wait_batch(&ticket).map_err(|e| e.to_string())?;
            let stats = outcome.result.map_err(|e| e.to_string())?;
            if let Some(e) = failed {
                return Err(e);
            }
            Ok(RankRun {
                stats,
                first,
                last,
                forward_done,
            })
        });
        all_ok(runs).map_err(|e| anyhow!(e))
    }

    /// Zeroes every rank's pool (so a verification sees only what the next batch landed).
    pub fn clear(&self) -> Result<()> {
        all_ok(on_ranks(self.ranks.len(), |r| {
            let rank = &self.ranks[r];
            match &rank.pool {
                // SAFETY: between batches: no load or save of this pool is in flight.
                RankPool::Device { pool, .. } => unsafe { pool.clear() }.map_err(de),
                RankPool::Host(pool) => {
                    let widest = rank
                        .g
                        .components()
                        .iter()
                        .map(|c| c.page_layer_bytes as usize)
                        .max()
                        .unwrap_or(0);
                    let zeros = vec![0u8; widest];
                    for c in rank.g.components() {
                        for &l in &c.layers {
                            for s in 0..pool.pages() {
                                // SAFETY: between batches: no load of this pool is in flight.
                                unsafe {
                                    pool.write_slot(
                                        c.id,
                                        l,
                                        s,
                                        &zeros[..c.page_layer_bytes as usize],
                                    )
                                }
                                .map_err(de)?;
                            }
                        }
                    }
                    Ok(())
                }
            }
        }))
        .map(drop)
        .map_err(|e| anyhow!(e))
    }

    /// Every row of every rank's pool against the prefix's checksums; bytes compared.
    pub fn verify(&self, prefix: &Prefix) -> Result<u64> {
        let per = all_ok(on_ranks(self.ranks.len(), |r| {
            verify_rank(&self.ranks[r], prefix).map_err(|e| format!("{e:#}"))
        }))
        .map_err(|e| anyhow!(e))?;
        Ok(per.iter().sum())
    }
}

fn verify_rank(rank: &RankRig, prefix: &Prefix) -> Result<u64> {
    let mut bytes = 0u64;
    let mut buf = Vec::new();
    let regions = match &rank.pool {
        RankPool::Device { pool, .. } => pool.regions(),
        RankPool::Host(_) => Vec::new(),
    };
    for (ci, c) in rank.g.components().iter().enumerate() {
        let len = c.page_layer_bytes as usize;
        for (pos, &l) in c.layers.iter().enumerate() {
            // The whole (component, layer) buffer of a device pool, copied out once.
            if let RankPool::Device { pool, .. } = &rank.pool {
                let (ptr, buf_len) = pool.buffer(c.id, l).map_err(de).map_err(|e| anyhow!(e))?;
                let index = regions
                    .iter()
                    .position(|&(a, _)| a as u64 == ptr)
                    .ok_or_else(|| anyhow!("a pool buffer that is not among its regions"))?;
                buf.resize(buf_len, 0u8);
                // SAFETY: the batch's outcome was taken: nothing writes the pool meanwhile.
                unsafe { pool.read_buffer(index, &mut buf) }
                    .map_err(de)
                    .map_err(|e| anyhow!(e))?;
            } else {
                buf.resize(len, 0u8);
            }
            for (page, &slot) in rank.slots.iter().enumerate() {
                let row = match &rank.pool {
                    RankPool::Host(pool) => {
                        // SAFETY: compared after the batch's outcome was taken: no load
                        // writes the pool now.
                        unsafe { pool.read_slot(c.id, l, slot, &mut buf[..len]) }
                            .map_err(de)
                            .map_err(|e| anyhow!(e))?;
                        &buf[..len]
                    }
                    RankPool::Device { .. } => &buf[slot as usize * len..(slot as usize + 1) * len],
                };
                if layer_checksum(row) != prefix.expected(ci, pos, page) {
                    bail!(
                        "rank {}: component {} layer {l} page {page} (slot {slot}) differs from \
                         the saved bytes",
                        rank.g.tp_rank(),
                        c.name
                    );
                }
                bytes += len as u64;
            }
        }
    }
    Ok(bytes)
}

#[cfg(feature = "cuda")]
fn nccl_groups(tp: u32) -> Result<Vec<TpGroup>> {
    kvlink_rig::tp::nccl_groups(tp).map_err(|e| anyhow!(e))
}

#[cfg(not(feature = "cuda"))]
fn nccl_groups(_tp: u32) -> Result<Vec<TpGroup>> {
    bail!("NCCL groups need a build with --features cuda")
}

/// Closes every rank's linker at once.
/// A linker's `close` failed: a batch may still write the rig's pools (its slots are held),
/// so nothing else may run on them.
#[derive(Debug)]
pub struct LinkersNotClosed(pub String);

impl std::fmt::Display for LinkersNotClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "closing the linkers: {} (the rig's pools are left alone)",
            self.0
        )
    }
}

impl std::error::Error for LinkersNotClosed {}

/// Closes every linker (in parallel); a failure is a [`LinkersNotClosed`].
pub fn close_all(linkers: Vec<Linker>) -> Result<()> {
    let errors = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for l in linkers {
            let errors = &errors;
            s.spawn(move || {
                if let Err(e) = l.close() {
                    if let Ok(mut v) = errors.lock() {
                        v.push(e.to_string());
                    }
                }
                drop(l);
            });
        }
    });
    let errors = errors.into_inner().unwrap_or_default();
    match errors.into_iter().next() {
        Some(e) => Err(LinkersNotClosed(e).into()),
        None => Ok(()),
    }
}
