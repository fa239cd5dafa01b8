//! What every part shares: the GLM-5.2 geometry at TP N, a prefix saved into one shared
//! embedded store, the fabric (N ranks on one GPU with the in-process device group, or one rank
//! per GPU over NCCL), each rank's device pool and pinned staging, the groups, linkers over
//! them, a batch run on every rank at once, and the comparison of a device pool with the saved
//! bytes.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::nccl::{NcclConfig, NcclGroup};
use kvlink::dedup_broadcast::{Collective, GroupFormation};
use kvlink::kv_device::cuda::cudarc::driver::result;
use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{CpuDevice, Device, HostKvPool, KvPool, StagedLandingFactory, StagingPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, ModelKvSpec, PageHash};
use kvlink::kv_loader::{
    BatchId, BatchOutcome, BatchPlan, KvLoader, LayerReady, RequestPages, ShareMode,
};
use kvlink::mooncake_linker::dedup_broadcast::ModeChoice;
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, TpGroup};

use super::util::{all_ok, de, fill_row, on_ranks, TimedBarrier};

/// Key namespace of every object this program writes.
pub const NAMESPACE: &str = "tp_gpu";

/// The three ways of sharing replicated components, in table order.
pub const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

/// GLM-5.2 with FP8 KV (DSA: 656 B/token `k` on 78 layers, 8448 B/page `indexer` on some),
/// rank `rank` of TP `tp`. Every component is replicated (MLA), so every rank's pool holds
/// the same bytes.
pub fn glm(tp: u32, rank: u32) -> Result<KvGeometry, String> {
    KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), tp, rank).map_err(|e| e.to_string())
}

/// Bytes of one staging half for batches of `pages` pages (the widest layer, with the share
/// area's padding at this TP).
pub fn half_bytes(g: &KvGeometry, pages: usize) -> usize {
    StagingPool::half_bytes_for(g, pages, g.tp_size)
}

/// Where the ranks run and how they share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fabric {
    /// `ranks` ranks on GPU 0 (threads of this process), sharing through the in-process device
    /// group: device-to-device copies on each rank's comm stream, ordered by events.
    OneGpu { ranks: u32 },
    /// Rank `r` on GPU `r`, `tp` of them, sharing over NCCL (two communicators per rank).
    Nccl { tp: u32 },
}

impl Fabric {
    /// Ranks.
    pub fn tp(self) -> u32 {
        match self {
            Fabric::OneGpu { ranks } => ranks,
            Fabric::Nccl { tp } => tp,
        }
    }

    /// The GPU of rank `r`.
    pub fn ordinal(self, r: u32) -> u32 {
        match self {
            Fabric::OneGpu { .. } => 0,
            Fabric::Nccl { .. } => r,
        }
    }

    /// GPUs used.
    pub fn gpus(self) -> u32 {
        match self {
            Fabric::OneGpu { .. } => 1,
            Fabric::Nccl { tp } => tp,
        }
    }

    /// A short label, e.g. "8 ranks on 1 GPU (in-process device group)".
    pub fn label(self) -> String {
        match self {
            Fabric::OneGpu { ranks } => {
                format!("{ranks} ranks on 1 GPU (in-process device group)")
            }
            Fabric::Nccl { tp } => format!("{tp} rank(s), one per GPU (NCCL)"),
        }
    }
}

/// The tag of a component in the byte pattern.
pub fn tag(c: &kvlink::kv_geometry::ComponentLayout) -> u64 {
    u64::from(c.id.0) + 1
}

/// What the mode really is at this TP: one rank alone always reads its own copy (the linker
/// shares only in a group of more than one).
pub fn effective(mode: ShareMode, tp: u32) -> ShareMode {
    if tp > 1 {
        mode
    } else {
        ShareMode::AllRanks
    }
}

/// A linker configuration for `mode`.
pub fn config(mode: ShareMode, collective_timeout: Duration, wait: Duration) -> LinkerConfig {
    LinkerConfig {
        namespace: NAMESPACE.into(),
        mode: ModeChoice::Fixed(mode),
        wait_deadline: wait,
        layer_read_timeout: collective_timeout.mul_f64(0.75),
        collective_timeout,
        ..LinkerConfig::default()
    }
}

/// A saved prefix: `pages` in prefix order, every object in `store`.
pub struct Prefix {
    pub store: Arc<EmbeddedStore>,
    pub pages: Vec<PageHash>,
    /// Bytes of one copy of the prefix (all components, all layers).
    pub bytes: u64,
    /// Seconds the save took.
    pub fill_s: f64,
}

/// Saves `n` pages of GLM-5.2 the way TP rank 0 of a TP `tp` deployment does after prefill
/// (a host-pool linker of rank 0 writes the replicated objects), in chunks on `threads`
/// threads so that only the store holds the whole prefix. Page `p`'s rows are
/// `fill_row(tag(c), layer, p)`.
pub fn save_prefix(tp: u32, n: usize, seed: u32, threads: usize) -> Result<Prefix, String> {
    let g = glm(tp, 0)?;
    let bytes = g.bytes_per_page() * n as u64;
    let store = Arc::new(EmbeddedStore::new(bytes + (1 << 30)));
    let tokens: Vec<u32> = (0..n as u32 * g.page_size())
        .map(|i| i.wrapping_mul(2_654_435_761) ^ seed)
        .collect();
    let pages = page_hashes(&tokens, g.page_size(), None);
    let chunk = 32usize;
    let chunks = n.div_ceil(chunk);
    let next = AtomicUsize::new(0);
    let t0 = Instant::now();
    let results = on_ranks(threads.clamp(1, chunks.max(1)), |_| {
        let pool = Arc::new(HostKvPool::new(g.clone(), chunk as u32).map_err(de)?);
        let saver = Linker::new(
            g.clone(),
            store.clone(),
            pool.clone(),
            config(
                ShareMode::AllRanks,
                Duration::from_secs(60),
                Duration::from_secs(60),
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut row = Vec::new();
        loop {
            let i = next.fetch_add(1, Ordering::Relaxed);
            if i >= chunks {
                break;
            }
            let first = i * chunk;
            let len = chunk.min(n - first);
            for c in g.components() {
                row.resize(c.page_layer_bytes as usize, 0);
                for &l in &c.layers {
                    for s in 0..len {
                        fill_row(&mut row, tag(c), l, (first + s) as u64);
                        // SAFETY: this thread's own pool, filled before any linker uses it.
                        unsafe { pool.write_slot(c.id, l, s as u32, &row) }.map_err(de)?;
                    }
                }
            }
            let p = plan(
                &g,
                0,
                "prefill",
                &pages[first..first + len],
                (0..len as u32).collect(),
            );
            let r = saver.save(&p).map_err(|e| e.to_string())?;
            let want = (len * g.components().len()) as u32;
            if r.objects_written + r.objects_present != want {
                return Err(format!(
                    "save of pages {first}..{}: {} written + {} present, want {want}",
                    first + len,
                    r.objects_written,
                    r.objects_present
                ));
            }
        }
        saver.close().map_err(|e| e.to_string())
    });
    all_ok(results)?;
    Ok(Prefix {
        store,
        pages,
        bytes,
        fill_s: t0.elapsed().as_secs_f64(),
    })
}

/// A plan of one request loading `pages` into `slots`.
pub fn plan(
    g: &KvGeometry,
    batch: u64,
    request: &str,
    pages: &[PageHash],
    slots: Vec<u32>,
) -> BatchPlan {
    BatchPlan::all_components(
        g,
        BatchId(batch),
        vec![RequestPages {
            request: request.into(),
            pages: pages.to_vec(),
        }],
        slots,
    )
}

/// One rank's GPU (its own load stream, even when ranks share a GPU): its device pool and
/// pinned staging, and the geometry of its rank.
pub struct RankDev {
    pub rank: u32,
    pub dev: Arc<dyn Device>,
    pub g: KvGeometry,
    pub pool: Arc<CudaKvPool>,
    pub staging: Arc<StagingPool>,
}

/// A device of its own for one rank on GPU `ordinal` (its own load stream; ranks on one GPU
/// share its context), or with `cpu` a CPU device (the dry run of this program's logic on a
/// machine without a GPU).
pub fn open_device(cpu: bool, ordinal: u32) -> Result<Arc<dyn Device>, String> {
    if cpu {
        Ok(CpuDevice::new(ordinal).map_err(de)?)
    } else {
        Ok(CudaDevice::new(ordinal).map_err(de)?)
    }
}

/// Every rank of `fabric` at once: a device pool of `pool_pages` and two staging buffers for
/// batches of up to `batch_pages` pages, on the rank's GPU.
pub fn rank_devs(
    cpu: bool,
    fabric: Fabric,
    pool_pages: u32,
    batch_pages: usize,
) -> Result<Vec<RankDev>, String> {
    let tp = fabric.tp();
    all_ok(on_ranks(tp as usize, |r| {
        let r = r as u32;
        let dev = open_device(cpu, fabric.ordinal(r))?;
        let g = glm(tp, r)?;
        let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pool_pages).map_err(de)?);
        let staging = StagingPool::new(dev.clone(), half_bytes(&g, batch_pages), 2).map_err(de)?;
        Ok(RankDev {
            rank: r,
            dev,
            g,
            pool,
            staging,
        })
    }))
}

/// (free, total) bytes of GPU memory of `dev`.
pub fn gpu_mem(dev: &CudaDevice) -> Result<(u64, u64), String> {
    dev.bind().map_err(de)?;
    let (free, total) = result::mem_get_info().map_err(|e| e.to_string())?;
    Ok((free as u64, total as u64))
}

/// The groups of the linkers (data and control handles per rank, and the formation that
/// re-forms the data group after an abort), made once and reused by every linker of the run,
/// since linkers run one set at a time and every rank issues the same collectives. `reset`
/// drops them (after a failure that may have left a group aborted); the next `get` makes new
/// ones.
pub struct Groups {
    fabric: Fabric,
    devices: Vec<Arc<dyn Device>>,
    current: Option<Vec<TpGroup>>,
    pub made: u32,
}

impl Groups {
    /// Groups of `fabric`; `devices[r]` is rank `r`'s device (the in-process device group's).
    pub fn new(fabric: Fabric, devices: Vec<Arc<dyn Device>>) -> Self {
        Groups {
            fabric,
            devices,
            current: None,
            made: 0,
        }
    }

    pub fn get(&mut self) -> Result<Vec<TpGroup>, String> {
        if let Some(g) = &self.current {
            return Ok(g.clone());
        }
        let groups = match self.fabric {
            Fabric::OneGpu { .. } => TpGroup::in_process_on_devices(self.devices.clone())
                .map_err(|e| format!("in-process device group: {e}"))?,
            Fabric::Nccl { tp } => nccl_groups(tp)?,
        };
        self.made += 1;
        self.current = Some(groups.clone());
        Ok(groups)
    }

    /// Drops the groups, every rank's at once (each NCCL communicator is finalized on its own
    /// comm thread). The linkers that used them must be dropped first.
    pub fn reset(&mut self) {
        if let Some(groups) = self.current.take() {
            std::thread::scope(|s| {
                for g in groups {
                    s.spawn(move || drop(g));
                }
            });
        }
    }
}

/// NCCL data and control groups over GPUs `0..tp`, with the data group's formation.
fn nccl_groups(tp: u32) -> Result<Vec<TpGroup>, String> {
    let ordinals: Vec<u32> = (0..tp).collect();
    let data = NcclGroup::new_in_process(&ordinals).map_err(|e| format!("NCCL data group: {e}"))?;
    let control =
        NcclGroup::new_in_process(&ordinals).map_err(|e| format!("NCCL control group: {e}"))?;
    let formation: Arc<dyn GroupFormation> =
        Arc::new(NcclGroup::formation(ordinals, NcclConfig::default()));
    Ok(data
        .into_iter()
        .zip(control)
        .map(|(d, c)| TpGroup {
            data: Arc::new(d) as Arc<dyn Collective>,
            control: Arc::new(c) as Arc<dyn Collective>,
            formation: Some(formation.clone()),
        })
        .collect())
}

/// One linker per rank over `stores[r]`, landing into rank `r`'s device pool through its
/// pinned staging, sharing with the group as `config.mode` says.
pub fn linkers(
    devs: &[RankDev],
    stores: &[Arc<dyn KvStore>],
    groups: Vec<TpGroup>,
    config: &LinkerConfig,
) -> Result<Vec<Linker>, String> {
    devs.iter()
        .zip(stores)
        .zip(groups)
        .map(|((d, store), group)| {
            let landings = Arc::new(StagedLandingFactory::new(d.pool.clone(), d.staging.clone()));
            Linker::with_landings(
                d.g.clone(),
                store.clone(),
                d.pool.clone(),
                landings,
                config.clone(),
                Some(group),
            )
            .map_err(|e| format!("rank {}: linker: {e}", d.rank))
        })
        .collect()
}

/// Closes and drops every rank's linker at once.
pub fn close_all(linkers: Vec<Linker>) -> Result<(), String> {
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let hs: Vec<_> = linkers
            .into_iter()
            .map(|l| {
                s.spawn(move || {
                    let r = l.close().map_err(|e| e.to_string());
                    drop(l);
                    r
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("close panicked".into())))
            .collect()
    });
    all_ok(results).map(|_| ())
}

/// What one rank saw of a batch.
pub struct RankRun {
    pub outcome: BatchOutcome,
    /// Milliseconds from the common start to each layer resident on this rank (its event
    /// synchronized), for the layers that became ready.
    pub ready_ms: Vec<f64>,
    /// The first layer wait that failed, if one did.
    pub wait_error: Option<(u32, String)>,
    /// Milliseconds from the common start to the outcome.
    pub outcome_ms: f64,
}

/// Every rank starts `plans[r]` at the same moment (a barrier), waits every layer as an
/// engine would (the event each wait hands back, synchronized), then takes the outcome.
pub fn run_batch(linkers: &[Linker], plans: Vec<BatchPlan>) -> Vec<Result<RankRun, String>> {
    let barrier = TimedBarrier::new(linkers.len());
    let plans: Vec<Mutex<Option<BatchPlan>>> =
        plans.into_iter().map(|p| Mutex::new(Some(p))).collect();
    on_ranks(linkers.len(), |r| {
        let linker = &linkers[r];
        let plan = plans[r]
            .lock()
            .map_err(|_| "plan lock poisoned")?
            .take()
            .ok_or("no plan")?;
        barrier.wait(Duration::from_secs(120))?;
        let t0 = Instant::now();
        let ticket = linker.start_load(plan).map_err(|e| e.to_string())?;
        let mut ready_ms = Vec::new();
        let mut wait_error = None;
        for l in 0..linker.num_layers() {
            let ready = linker.wait_layer(&ticket, l).and_then(|r| match r {
                LayerReady::Event(ev) => ev.synchronize(),
                LayerReady::Resident => Ok(()),
            });
            match ready {
                Ok(()) => ready_ms.push(t0.elapsed().as_secs_f64() * 1e3),
                Err(e) => {
                    wait_error = Some((l, e.to_string()));
                    break;
                }
            }
        }
        let outcome = linker.wait_batch(&ticket).map_err(|e| e.to_string())?;
        Ok(RankRun {
            outcome,
            ready_ms,
            wait_error,
            outcome_ms: t0.elapsed().as_secs_f64() * 1e3,
        })
    })
}

/// Zeroes every rank's device pool, all at once (so a later comparison sees only what the
/// next batch landed).
pub fn clear_pools(devs: &[RankDev]) -> Result<(), String> {
    all_ok(on_ranks(devs.len(), |r| devs[r].pool.clear().map_err(de))).map(|_| ())
}

/// Compares rank `d`'s device pool with the saved bytes: for every layer below `upto` that
/// `pick` selects, each component's whole layer buffer is copied out once and every plan
/// page's slot in it checked. Returns the bytes compared.
pub fn compare_pool(
    d: &RankDev,
    slots: &[u32],
    upto: u32,
    pick: &dyn Fn(u32) -> bool,
) -> Result<u64, String> {
    let mut host = Vec::new();
    let mut want = Vec::new();
    let mut bytes = 0u64;
    let regions = d.pool.regions();
    for c in d.g.components() {
        let len = c.page_layer_bytes as usize;
        want.resize(len, 0u8);
        for &l in c.layers.iter().filter(|&&l| l < upto && pick(l)) {
            let (ptr, buf_len) = d.pool.buffer(c.id, l).map_err(de)?;
            let index = regions
                .iter()
                .position(|&(a, _)| a as u64 == ptr)
                .ok_or("a pool buffer that is not among its regions")?;
            host.resize(buf_len, 0u8);
            // After the load stream's work (the landings' copies), bounded.
            d.pool.read_buffer(index, &mut host).map_err(de)?;
            for (p, &s) in slots.iter().enumerate() {
                fill_row(&mut want, tag(c), l, p as u64);
                let got = &host[s as usize * len..(s as usize + 1) * len];
                if got != &want[..] {
                    let byte = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(format!(
                        "rank {}: component {} layer {l} plan page {p} (slot {s}) differs at byte {byte}",
                        d.rank, c.name
                    ));
                }
                bytes += len as u64;
            }
        }
    }
    Ok(bytes)
}

/// Every rank's pool compared (all at once); total bytes compared.
pub fn compare_all(
    devs: &[RankDev],
    slots: &[Vec<u32>],
    upto: u32,
    pick: &(dyn Fn(u32) -> bool + Sync),
) -> Result<u64, String> {
    let per = all_ok(on_ranks(devs.len(), |r| {
        compare_pool(&devs[r], &slots[r], upto, pick)
    }))?;
    Ok(per.iter().sum())
}

/// `MemAvailable` of the host in bytes (None when /proc/meminfo cannot be read).
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
