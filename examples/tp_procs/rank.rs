//! A rank process: forms its group at the rendezvous (NCCL on its GPU, or sockets in the dry
//! run), loads from the launcher's served store through its own Linker into its own pool,
//! compares the pool with the saved bytes, and reports each step on stdout.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::{
    GroupHandles, MeetingPoint, Rendezvous, RendezvousConfig, RendezvousFormation,
};
use kvlink::kv_device::{DeviceKvPool, HostKvPool, KvPool, StagedLandingFactory, StagingPool};
use kvlink::kv_geometry::{page_hashes, KvGeometry, PageHash};
use kvlink::kv_loader::{KvLoader, LayerReady, LoadStats, ShareMode};
use kvlink::mooncake_linker::store::{Fault, FaultRule, FaultyStore, KvStore, SocketStore};
use kvlink::mooncake_linker::{FormedTpGroup, Linker, TpGroup};

use crate::launch::MARK;
use crate::Args;
use kvlink_rig::glm::{glm, half_bytes, tag};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::de;
use kvlink_rig::tp::{compare_pool, config, open_device, plan, share_every_layer, RankDev, MODES};

/// A rank process's settings.
#[derive(Debug, Clone, Default)]
pub struct RankArgs {
    pub rank: u32,
    pub world: u32,
    pub rendezvous: String,
    pub store_at: String,
    pub gpu: u32,
    /// `one` (one rank: the linker, the share step, a re-formation) or `group`.
    pub case: String,
    /// In `group`: the rank whose read of a middle layer outlasts the collective deadline.
    pub slow_rank: Option<u32>,
}

/// A report line for the launcher.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{MARK}{line}");
    let _ = out.flush();
}

/// The collective deadline of the timeout case (the stalled rank outlasts it).
const SHORT_COLLECTIVE: Duration = Duration::from_secs(6);
/// The slow rank's read of one layer: well inside the linker's read bound, so that the
/// launcher's stop (see `cases::STALL`) finds the rank in the middle of the batch.
const SLOW_READ: Duration = Duration::from_secs(2);

/// This rank's pool: device memory (CUDA) or, in the dry run, host memory.
enum Pool {
    Device(RankDev),
    Host(Arc<HostKvPool>, KvGeometry, u32),
}

impl Pool {
    fn open(args: &Args, r: &RankArgs, pages: u32, batch_pages: usize) -> Result<Pool, String> {
        let g = glm(r.world, r.rank)?;
        if args.cpu {
            let pool = HostKvPool::new(g.clone(), pages).map_err(de)?;
            return Ok(Pool::Host(Arc::new(pool), g, r.rank));
        }
        let dev = open_device(false, r.gpu)?;
        let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
        // A spare pair: a batch whose collective was aborted may keep its pair quarantined.
        let staging = StagingPool::new(dev.clone(), half_bytes(&g, batch_pages), 3).map_err(de)?;
        Ok(Pool::Device(RankDev {
            rank: r.rank,
            dev,
            g,
            pool,
            staging,
        }))
    }

    fn geometry(&self) -> &KvGeometry {
        match self {
            Pool::Device(d) => &d.g,
            Pool::Host(_, g, _) => g,
        }
    }

    fn linker(
        &self,
        store: Arc<dyn KvStore>,
        mode: ShareMode,
        collective: Duration,
        group: TpGroup,
    ) -> Result<Linker, String> {
        let cfg = config(mode, collective, Duration::from_secs(60));
        match self {
            Pool::Device(d) => Linker::with_landings(
                d.g.clone(),
                store,
                d.pool.clone(),
                Arc::new(StagedLandingFactory::new(d.pool.clone(), d.staging.clone())),
                cfg,
                Some(group),
            ),
            Pool::Host(p, g, _) => Linker::with_group(g.clone(), store, p.clone(), cfg, group),
        }
        .map_err(|e| format!("linker: {e}"))
    }

    fn clear(&self) -> Result<(), String> {
        match self {
            // SAFETY: between batches: no load or save of this pool is in flight.
            Pool::Device(d) => unsafe { d.pool.clear() }.map_err(de),
            Pool::Host(p, _, _) => {
                // SAFETY: cleared between batches, when none of this pool is in flight.
                unsafe { p.clear() };
                Ok(())
            }
        }
    }

    /// The pool against the saved bytes (plan page `p` at `slots[p]`, every other slot still
    /// zero: compared after a `clear` and one batch); the plan's bytes compared.
    fn compare(&self, slots: &[u32]) -> Result<u64, String> {
        match self {
            // SAFETY: callers compare after `load` took the batch's outcome (or returned Err
            // and the rank stopped): nothing writes the pool.
            Pool::Device(d) => unsafe { compare_pool(d, slots, d.g.num_layers(), &|_| true) },
            Pool::Host(p, g, rank) => {
                let (mut want, mut got, mut bytes) = (Vec::new(), Vec::new(), 0u64);
                let mut planned = vec![false; p.pages() as usize];
                for &s in slots {
                    *planned
                        .get_mut(s as usize)
                        .ok_or("a plan slot past the pool")? = true;
                }
                for c in g.components() {
                    let len = c.page_layer_bytes as usize;
                    want.resize(len, 0);
                    got.resize(len, 0);
                    for &l in &c.layers {
                        for (pi, &s) in slots.iter().enumerate() {
                            fill_row(&mut want, tag(c), l, pi as u64);
                            // SAFETY: compared after the batch's outcome was taken.
                            unsafe { p.read_slot(c.id, l, s, &mut got) }.map_err(de)?;
                            if got != want {
                                return Err(format!(
                                    "rank {rank}: component {} layer {l} page {pi} (slot {s}) differs",
                                    c.name
                                ));
                            }
                            bytes += len as u64;
                        }
                        // Every other slot is still zero (the pool was cleared before the
                        // batch): a landing that wrote outside its plan fails here.
                        for s in (0..p.pages()).filter(|&s| !planned[s as usize]) {
                            // SAFETY: as above.
                            unsafe { p.read_slot(c.id, l, s, &mut got) }.map_err(de)?;
                            if got.iter().any(|&b| b != 0) {
                                return Err(format!(
                                    "rank {rank}: component {} layer {l}: slot {s}, in no plan page, was written",
                                    c.name
                                ));
                            }
                        }
                    }
                }
                Ok(bytes)
            }
        }
    }
}

fn pages_of(args: &Args) -> Vec<PageHash> {
    let page = 64u32;
    let tokens: Vec<u32> = (0..args.pages as u32 * page)
        .map(|i| i.wrapping_mul(2_654_435_761) ^ args.seed)
        .collect();
    page_hashes(&tokens, page, None)
}

/// Forms this rank's group at the rendezvous: NCCL communicators on its GPU, or sockets in
/// the dry run.
fn form(args: &Args, r: &RankArgs, g: &KvGeometry) -> Result<FormedTpGroup, String> {
    let config = RendezvousConfig::new(r.rank, r.world, MeetingPoint::Tcp(r.rendezvous.clone()))
        .geometry(g)
        .nccl(!args.cpu)
        .timeout(Duration::from_secs(120));
    let rv = Rendezvous::new(config).map_err(|e| format!("rendezvous: {e}"))?;
    if let Some(a) = rv.listen_addr() {
        say(&format!("addr {a}"));
    }
    let formation = if args.cpu {
        RendezvousFormation::sockets(rv)
    } else {
        RendezvousFormation::nccl(rv, r.gpu, Default::default())
            .map_err(|e| format!("NCCL formation: {e}"))?
    }
    .reform_timeout(Duration::from_secs(10));
    TpGroup::from_formation(Arc::new(formation)).map_err(|e| format!("forming: {e}"))
}

/// One batch of the whole prefix into `slots`: every layer waited as an engine would (its
/// event synchronized); the outcome, and the layers that became ready. `Err` when no outcome
/// could be taken and a reset could not settle the batch: its slots may still be written, so
/// the caller must not touch the pool again (it stops).
fn load(
    linker: &Linker,
    batch: u64,
    pages: &[PageHash],
    slots: &[u32],
) -> Result<(Result<LoadStats, String>, u32, Duration), String> {
    let t = Instant::now();
    let p = plan(linker.geometry(), batch, "tp-procs", pages, slots.to_vec());
    let ticket = match linker.start_load(p) {
        Ok(t) => t,
        Err(e) => return Ok((Err(e.to_string()), 0, t.elapsed())),
    };
    let mut ready = 0;
    for l in 0..linker.num_layers() {
        let ok = linker.wait_layer(&ticket, l).and_then(|r| match r {
            LayerReady::Event(ev) => ev.synchronize(),
            LayerReady::Resident => Ok(()),
        });
        if ok.is_err() {
            break;
        }
        ready = l + 1;
    }
    let result = match linker.wait_batch(&ticket) {
        Ok(o) => o.result.map_err(|e| format!("{}: {e}", e.kind_name())),
        Err(e) => {
            // No outcome: the batch may still be landing. A reset cancels it and waits
            // (bounded); only then may the pool be cleared for the next batch.
            linker
                .reset()
                .map_err(|r| format!("batch {batch} unsettled ({e}), and reset: {r}"))?;
            Err(e.to_string())
        }
    };
    Ok((result, ready, t.elapsed()))
}

/// A rank process (see the module docs).
pub fn run(args: &Args, r: &RankArgs) -> Result<(), String> {
    let g = glm(r.world, r.rank)?;
    let formed = form(args, r, &g)?;
    say(&format!("formed epoch={}", formed.epoch));
    let n = args.pages;
    let pool_pages = 2 * n as u32 + 8;
    let pool = Pool::open(args, r, pool_pages, n)?;
    let served: Arc<dyn KvStore> =
        Arc::new(SocketStore::connect(&r.store_at).map_err(|e| format!("store: {e}"))?);
    let pages = pages_of(args);
    for (i, mode) in MODES.into_iter().enumerate() {
        let slots =
            Rng(0x5eed ^ (u64::from(r.rank) << 20) ^ i as u64).scattered_slots(n, pool_pages)?;
        pool.clear()?;
        let linker = pool.linker(
            served.clone(),
            mode,
            Duration::from_secs(20),
            formed.group.clone(),
        )?;
        let (result, _, took) = load(&linker, 1 + i as u64, &pages, &slots)?;
        let line = match result {
            Ok(stats) => format!(
                "mode name={mode:?} ran={:?} read={} landed={} h2d={} ms={:.1} verified={}",
                stats.mode,
                stats.bytes_read,
                stats.bytes_landed,
                stats.transfers.host_to_device,
                took.as_secs_f64() * 1e3,
                pool.compare(&slots)?
            ),
            Err(e) => format!("mode name={mode:?} failed={}", e.replace(' ', "_")),
        };
        say(&line);
        // A close that fails leaves a batch that may still write the pool: the next mode
        // must not clear and compare it.
        linker.close().map_err(|e| {
            format!("closing the {mode:?} linker: {e} (a batch may still write the pool)")
        })?;
    }
    match r.case.as_str() {
        "one" if !args.cpu => one_rank_share_steps(&pool, &formed)?,
        "group" => {
            if let Some(slow) = r.slow_rank {
                timeout_then_reform(args, r, &pool, &formed, &served, &pages, slow)?;
            }
        }
        _ => {}
    }
    say("done");
    Ok(())
}

/// The timeout case: rank `slow` is stopped (SIGSTOP, by the launcher once it says
/// `stall-me`) in the middle of a batch, during a slow read of a middle layer, for longer
/// than the collective deadline: a process that stalls, which no store-call bound can
/// shorten (a slow read alone fails in time through the status words and leaves the group
/// whole). Every rank fails that batch (the peers' NCCL operations reach their deadline and
/// abort; the stalled rank, continued, finds its peers gone), then each keeps loading until
/// the group re-formed at the rendezvous and a batch loads.
fn timeout_then_reform(
    args: &Args,
    r: &RankArgs,
    pool: &Pool,
    formed: &FormedTpGroup,
    served: &Arc<dyn KvStore>,
    pages: &[PageHash],
    slow: u32,
) -> Result<(), String> {
    let n = args.pages;
    let slots = Rng(0x51_0e ^ u64::from(r.rank)).scattered_slots(n, 2 * n as u32 + 8)?;
    let faulty = Arc::new(FaultyStore::new(served.clone()));
    let layer = pool.geometry().num_layers() / 2;
    if r.rank == slow {
        let k = pool.geometry().components()[0].clone();
        faulty.inject(
            FaultRule {
                key_contains: Some(format!("_{}", k.name)),
                offset: k.layer_range(layer).map(|x| x.start),
                times: Some(1),
                ..FaultRule::default()
            },
            Fault::Delay(SLOW_READ),
        );
    }
    pool.clear()?;
    let linker = pool.linker(
        faulty as Arc<dyn KvStore>,
        ShareMode::SplitAllGather,
        SHORT_COLLECTIVE,
        formed.group.clone(),
    )?;
    if r.rank == slow {
        say("stall-me");
    }
    let (result, ready, took) = load(&linker, 10, pages, &slots)?;
    match result {
        Ok(_) => return Err("the batch with a stalled rank loaded".into()),
        Err(e) => say(&format!(
            "slow failed_ms={:.0} ready={ready} layer={layer} err={}",
            took.as_secs_f64() * 1e3,
            e.replace(' ', "_")
        )),
    }
    let until = kvlink::kv_loader::deadline_after(Duration::from_secs(90));
    let mut tries = 0;
    loop {
        tries += 1;
        pool.clear()?;
        let (result, _, took) = load(&linker, 11, pages, &slots)?;
        match result {
            Ok(stats) => {
                say(&format!(
                    "reformed epoch={} tries={tries} ran={:?} ms={:.1} verified={}",
                    formed.formation.last().map_or(0, |m| m.epoch),
                    stats.mode,
                    took.as_secs_f64() * 1e3,
                    pool.compare(&slots)?
                ));
                break;
            }
            Err(e) if Instant::now() < until => {
                eprintln!(
                    "tp_procs rank {}: a batch after the timeout failed ({e}); trying again",
                    r.rank
                );
                std::thread::sleep(Duration::from_millis(200));
            }
            Err(e) => return Err(format!("never re-formed: {e}")),
        }
    }
    linker
        .close()
        .map_err(|e| format!("closing the linker: {e} (a batch may still write the pool)"))
}

/// One rank: the device share step of the linker's shared modes on this process's NCCL
/// data communicator (formed at the rendezvous), then an abort, a re-formation at the
/// rendezvous (new ids, new communicators), and the share step again.
fn one_rank_share_steps(pool: &Pool, formed: &FormedTpGroup) -> Result<(), String> {
    let Pool::Device(d) = pool else {
        return Ok(());
    };
    let mut handles = GroupHandles {
        data: formed.group.data.clone(),
        control: formed.group.control.clone(),
        epoch: formed.epoch,
    };
    for round in 0..2 {
        for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
            let (layers, bytes) = share_step(d, &handles, mode)?;
            say(&format!(
                "share mode={mode:?} epoch={} layers={layers} compared={bytes}",
                handles.epoch
            ));
        }
        if round == 0 {
            handles.abort("tp_procs: an abort, as after a collective timeout");
            let broken = handles.broken().is_some();
            let formation = formed.group.formation.as_ref().ok_or("no formation")?;
            let soon = kvlink::kv_loader::deadline_after(Duration::from_secs(60));
            handles = formation
                .reform(0, handles.epoch + 1, soon)
                .map_err(|e| format!("re-forming: {e}"))?;
            say(&format!(
                "reform broken_before={broken} epoch={} device={}",
                handles.epoch,
                handles.data.memory().device
            ));
        }
    }
    Ok(())
}

/// Every layer of a GLM-5.2 batch through a staged landing: this rank's share written into
/// pinned staging, uploaded, shared with `share_stage` on `handles.data`, scattered into
/// the pool, landed; then the pool compared. (layers, bytes compared)
fn share_step(d: &RankDev, handles: &GroupHandles, mode: ShareMode) -> Result<(u32, u64), String> {
    let coll = handles.data.as_ref();
    let g = &d.g;
    let n = 32usize;
    let slots = Rng(0xabc ^ mode as u64).scattered_slots(n, d.pool.pages())?;
    // SAFETY: before the batch: no load or save of this pool is in flight.
    unsafe { d.pool.clear() }.map_err(de)?;
    // This example stands in for the store: the rig fills each stage through its loan.
    share_every_layer(d, coll, mode, &slots)?;
    // SAFETY: `share_every_layer` landed every layer (waited for): nothing writes the pool.
    let bytes = unsafe { compare_pool(d, &slots, g.num_layers(), &|_| true) }?;
    Ok((g.num_layers(), bytes))
}
