//! The staged landing into a device pool: the pool equals a host pool that loaded the same
//! rows (scattered, contiguous and mixed slots; every scatter strategy), a batch that fails at
//! a layer, and the save-direction gather.

use std::sync::Arc;

use std::time::{Duration, Instant};

use kvlink::kv_device::cuda::{CudaDevice, CudaKvPool};
use kvlink::kv_device::{
    Device, DirectLanding, HostKvPool, KvPool, LandingFactory, LayerLanding, LayerStage,
    ScatterStrategy, StagedLanding, StagedLandingFactory, StagingPool,
};
use kvlink::kv_geometry::KvGeometry;
use kvlink::kv_loader::{LayerReady, RawStream};

use kvlink_rig::glm::{glm, half_bytes, own_all, tag};
use kvlink_rig::pattern::{fill_row, Rng};
use kvlink_rig::report::{de, Report, Status};

use super::landing_misuse::misuse;
use super::Args;

const SEC: &str = "correctness";

fn soon() -> Instant {
    kvlink::kv_loader::deadline_after(Duration::from_secs(30))
}

pub fn run(args: &Args, report: &mut Report) {
    let dev = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            report.push(SEC, "open GPU 0", Status::Fail, de(e));
            return;
        }
    };
    report.info("env", "GPU 0", dev.name());
    let pages: u32 = if args.quick { 48 } else { 160 };
    let n = if args.quick { 20 } else { 64 };
    let mut rng = Rng(0x5eed);
    let scattered = rng
        .scattered_slots(n, pages)
        .expect("fewer slots than pages");
    let contiguous: Vec<u32> = (7..7 + n as u32).collect();
    let mut mixed: Vec<u32> = (100 % pages..100 % pages + 4).collect();
    mixed.extend(0..(n as u32 - 4) / 2);
    mixed.extend((pages - (n as u32 - 4 - (n as u32 - 4) / 2))..pages);
    for (label, slots, strategy) in [
        (
            "scattered slots, auto (kernel)",
            &scattered,
            ScatterStrategy::Auto,
        ),
        ("scattered slots, runs", &scattered, ScatterStrategy::Runs),
        (
            "contiguous slots, auto (one copy)",
            &contiguous,
            ScatterStrategy::Auto,
        ),
        (
            "contiguous slots, kernel",
            &contiguous,
            ScatterStrategy::Kernel,
        ),
        ("3 runs, auto", &mixed, ScatterStrategy::Auto),
    ] {
        report.check(
            SEC,
            &format!("staged load = host reference: {label}"),
            || load_and_compare(&dev, pages, slots, strategy, None),
        );
    }
    report.check(
        SEC,
        "failure at layer 5: earlier layers in, later untouched, lease back",
        || failure_at_layer(&dev, pages, &scattered, 5),
    );
    report.check(SEC, "misuse refused with typed errors (no panic)", || {
        misuse(&dev, pages)
    });
    report.check(SEC, "gather (save direction) = loaded rows", || {
        gather(&dev, pages, &scattered)
    });
}

/// Opens `layer` in `stage` of both landings and writes row data for (component, layer, page)
/// of pages `0..n` into their targets.
fn stage_layer(
    g: &KvGeometry,
    layer: u32,
    n: usize,
    staged: (&StagedLanding, &mut LayerStage),
    direct: Option<(&DirectLanding, &mut LayerStage)>,
) -> Result<(), String> {
    let (sl, ss) = staged;
    sl.open(ss, layer, soon()).map_err(de)?;
    // This check stands in for the store: it fills the stages through their loans.
    let mut staged_loan = sl.lend(ss).map_err(de)?;
    let mut direct_loan = match direct {
        Some((dl, ds)) => {
            dl.open(ds, layer, soon()).map_err(de)?;
            Some((dl, dl.lend(ds).map_err(de)?))
        }
        None => None,
    };
    for c in g.components() {
        if c.position(layer).is_none() {
            continue;
        }
        let len = c.page_layer_bytes as usize;
        let mut row = vec![0u8; len];
        for page in 0..n {
            fill_row(&mut row, tag(c), layer, page as u64);
            let t = sl.target(&staged_loan, c.id, page).map_err(de)?;
            staged_loan.write(t, &row).map_err(de)?;
            if let Some((dl, loan)) = direct_loan.as_mut() {
                let h = dl.target(loan, c.id, page).map_err(de)?;
                loan.write(h, &row).map_err(de)?;
            }
        }
    }
    Ok(())
}

/// Every device buffer equals the host pool's buffer (region by region, same order).
pub fn compare_pools(pool: &CudaKvPool, host: &HostKvPool) -> Result<u64, String> {
    let dregs = pool.regions();
    let hregs = host.regions();
    if dregs.len() != hregs.len() {
        return Err("region counts differ".into());
    }
    let mut bytes = 0u64;
    let mut buf = Vec::new();
    for (i, (d, h)) in dregs.iter().zip(&hregs).enumerate() {
        buf.resize(d.1, 0u8);
        // SAFETY: the loads compared have finished: nothing writes the pool meanwhile.
        unsafe { pool.read_buffer(i, &mut buf) }.map_err(de)?;
        // SAFETY: `h` is a live buffer of the host pool, `h.1` bytes, not written now.
        let hs = unsafe { std::slice::from_raw_parts(h.0 as *const u8, h.1) };
        if buf[..] != hs[..] {
            let at = buf.iter().zip(hs).position(|(a, b)| a != b).unwrap_or(0);
            return Err(format!(
                "buffer #{i} differs from the host reference at byte {at}"
            ));
        }
        bytes += d.1 as u64;
    }
    Ok(bytes)
}

/// A staged landing and a direct landing of the same batch, with their stages.
struct Pair {
    staged: StagedLanding,
    direct: DirectLanding,
    s: Vec<LayerStage>,
    d: Vec<LayerStage>,
}

fn pair(
    pool: &Arc<CudaKvPool>,
    host: &Arc<HostKvPool>,
    staging: &Arc<StagingPool>,
    slots: &Arc<[u32]>,
    strategy: ScatterStrategy,
) -> Result<Pair, String> {
    let g = pool.geometry().clone();
    let mut staged = StagedLanding::new(
        pool.clone(),
        staging.lease().map_err(de)?,
        slots.clone(),
        own_all(&g),
    )
    .map_err(de)?
    .with_strategy(strategy);
    let host_dyn: Arc<dyn KvPool> = host.clone();
    let mut direct = DirectLanding::new(host_dyn, slots.clone(), own_all(&g)).map_err(de)?;
    let s = staged.take_stages();
    let d = direct.take_stages();
    Ok(Pair {
        staged,
        direct,
        s,
        d,
    })
}

impl Pair {
    /// Stages layer `layer` (pages `0..n`) in both landings, then lands both; the staged
    /// landing's ready signal.
    fn layer(&mut self, g: &KvGeometry, layer: u32, n: usize) -> Result<LayerReady, String> {
        let h = layer as usize % 2;
        stage_layer(
            g,
            layer,
            n,
            (&self.staged, &mut self.s[h]),
            Some((&self.direct, &mut self.d[h])),
        )?;
        let _ = self.direct.land(&mut self.d[h]);
        self.staged.land(&mut self.s[h]).map_err(de)
    }
}

fn load_and_compare(
    dev: &Arc<CudaDevice>,
    pages: u32,
    slots: &[u32],
    strategy: ScatterStrategy,
    fail_at: Option<u32>,
) -> Result<String, String> {
    let g = glm(1, 0)?;
    let n = slots.len();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let host = Arc::new(HostKvPool::new(g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
    let slots: Arc<[u32]> = slots.into();
    let mut p = pair(&pool, &host, &staging, &slots, strategy)?;
    // A stream of kvlink's handle: the tracked one's first stream would synchronize the
    // whole context, with no bound. SAFETY: a stream for raw kernels and events: no
    // `CudaSlice` is made through it.
    let compute = unsafe { dev.untracked_context() }
        .new_stream()
        .map_err(|e| e.to_string())?;
    let mut events = 0;
    for layer in 0..g.num_layers() {
        match p.layer(&g, layer, n)? {
            LayerReady::Event(ev) => {
                // SAFETY: `compute` is a live stream of this context, alive past this call.
                let raw = unsafe { RawStream::from_raw(compute.cu_stream() as usize) };
                ev.wait_on_stream(raw).map_err(|e| e.to_string())?;
                events += 1;
            }
            LayerReady::Resident => return Err("a device landing returned Resident".into()),
        }
        if fail_at == Some(layer) {
            break;
        }
    }
    compute.synchronize().map_err(|e| e.to_string())?;
    let stats = p.staged.stats();
    let h2d: u64 = p.staged.transfers().iter().map(|t| t.host_to_device).sum();
    drop(p);
    let bytes = compare_pools(&pool, &host)?;
    if staging.available() != 1 {
        return Err("the staging lease did not return to its pool".into());
    }
    Ok(format!(
        "{events} layer events, {} runs, {} copies + {} kernel launches, {:.0} MB over PCIe, {:.0} MB compared",
        runs(&slots),
        stats.copies,
        stats.kernel_launches,
        h2d as f64 / 1e6,
        bytes as f64 / 1e6
    ))
}

fn runs(slots: &[u32]) -> usize {
    slots
        .windows(2)
        .filter(|w| w[0].checked_add(1) != Some(w[1]))
        .count()
        + usize::from(!slots.is_empty())
}

fn failure_at_layer(
    dev: &Arc<CudaDevice>,
    pages: u32,
    slots: &[u32],
    fail: u32,
) -> Result<String, String> {
    let g = glm(1, 0)?;
    let n = slots.len();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let host = Arc::new(HostKvPool::new(g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 1).map_err(de)?;
    let slots: Arc<[u32]> = slots.into();
    {
        let mut p = pair(&pool, &host, &staging, &slots, ScatterStrategy::Auto)?;
        for layer in 0..fail {
            p.layer(&g, layer, n)?;
        }
        // Layer `fail`: its reads "fail" half-way: staging was written, the layer never lands.
        let h = fail as usize % 2;
        stage_layer(&g, fail, n / 2, (&p.staged, &mut p.s[h]), None)?;
        if staging.available() != 0 {
            return Err("lease not held during the batch".into());
        }
        // The batch is abandoned here: the landing is dropped with layer `fail` unlanded.
    }
    if staging.available() != 1 {
        return Err("the staging lease did not return after the failed batch".into());
    }
    let bytes = compare_pools(&pool, &host)?;
    // The next batch on the same staging loads completely.
    let mut p = pair(&pool, &host, &staging, &slots, ScatterStrategy::Auto)?;
    for layer in 0..g.num_layers() {
        p.layer(&g, layer, n)?;
    }
    drop(p);
    compare_pools(&pool, &host)?;
    Ok(format!(
        "layers 0..{fail} equal, {fail}.. untouched ({:.0} MB compared); next batch on the same staging loads fully",
        bytes as f64 / 1e6
    ))
}

fn gather(dev: &Arc<CudaDevice>, pages: u32, slots: &[u32]) -> Result<String, String> {
    let g = glm(1, 0)?;
    let n = slots.len();
    let pool = Arc::new(CudaKvPool::new(dev.clone(), g.clone(), pages).map_err(de)?);
    let host = Arc::new(HostKvPool::new(g.clone(), pages).map_err(de)?);
    let staging = StagingPool::new(dev.clone(), half_bytes(&g, n), 2).map_err(de)?;
    let slots: Arc<[u32]> = slots.into();
    let mut p = pair(&pool, &host, &staging, &slots, ScatterStrategy::Auto)?;
    for layer in 0..g.num_layers() {
        p.layer(&g, layer, n)?;
    }
    drop(p);
    let mut checked = 0u64;
    for strategy in [ScatterStrategy::Kernel, ScatterStrategy::Runs] {
        let factory =
            StagedLandingFactory::new(pool.clone(), staging.clone()).with_strategy(strategy);
        let mut save = factory.begin_save(slots.clone()).map_err(de)?;
        for layer in [0u32, 1, 2, 3, 40, 77] {
            for c in g.components() {
                if c.position(layer).is_none() {
                    continue;
                }
                let rows = save.gather(c.id, layer).map_err(de)?;
                let len = c.page_layer_bytes as usize;
                let mut want = vec![0u8; len];
                for page in 0..n {
                    fill_row(&mut want, tag(c), layer, page as u64);
                    let got = rows.get(page * len..(page + 1) * len).unwrap_or_default();
                    if got != &want[..] {
                        return Err(format!(
                            "{strategy:?}: layer {layer} component {} page {page} differs",
                            c.id.0
                        ));
                    }
                    checked += len as u64;
                }
            }
        }
    }
    Ok(format!(
        "{:.1} MB of gathered rows equal",
        checked as f64 / 1e6
    ))
}
