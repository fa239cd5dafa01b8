//! A batch run on every rank at once, as an engine waits for it, and the comparison of every
//! rank's device pool with the saved bytes.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_device::KvPool;
use kv_loader::{BatchOutcome, BatchPlan, KvLoader, LayerReady};

use super::rank_dev::RankDev;
use crate::glm::tag;
use crate::pattern::fill_row;
use crate::ranks::{all_ok, on_ranks, TimedBarrier};
use crate::report::de;

/// What one rank saw of a batch.
pub struct RankRun {
    /// The batch's outcome on this rank.
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
/// Where no outcome can be taken (`wait_batch` failed: the load may still write the slots)
/// the rank's loader is reset, which cancels the batch and waits for it, so that the caller
/// may clear and compare the pools again; the error says whether that reset failed too (then
/// the pool may still be written: stop using it).
pub fn run_batch<L: KvLoader + Sync>(
    linkers: &[L],
    plans: Vec<BatchPlan>,
) -> Vec<Result<RankRun, String>> {
    if plans.len() != linkers.len() {
        // A rank without a plan would never reach the barrier the others wait at.
        let e = format!("{} plans for {} ranks", plans.len(), linkers.len());
        return linkers.iter().map(|_| Err(e.clone())).collect();
    }
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
        let outcome = linker
            .wait_batch(&ticket)
            .map_err(|e| match linker.reset() {
                Ok(()) => format!("no outcome ({e}); the loader was reset"),
                Err(r) => format!(
                    "no outcome ({e}), and the reset failed too ({r}): the pool may still be written"
                ),
            })?;
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
///
/// # Safety
/// Between batches: no load or save of any of these pools is in flight, and nothing else
/// reads or writes them during the call.
pub unsafe fn clear_pools(devs: &[RankDev]) -> Result<(), String> {
    all_ok(on_ranks(devs.len(), |r| {
        // SAFETY: the caller's promise; each rank's thread clears only its own pool.
        unsafe { devs[r].pool.clear() }.map_err(de)
    }))
    .map(|_| ())
}

/// Compares rank `d`'s device pool with the saved bytes: for every layer below `upto` that
/// `pick` selects, each component's whole layer buffer is copied out once and every plan
/// page's slot in it checked, and every other slot checked to be still zero (a landing that
/// also wrote a slot outside its plan, e.g. a share area's padding row, would overwrite
/// another sequence's KV). Returns the bytes compared (the plan's).
///
/// # Safety
/// The loads into the pool have ended (a batch's outcome taken, or every layer of a rig's
/// landing landed), and nothing else writes the pool during the call. The pool was zeroed
/// ([`clear_pools`], or a fresh pool) before the loads compared.
pub unsafe fn compare_pool(
    d: &RankDev,
    slots: &[u32],
    upto: u32,
    pick: &dyn Fn(u32) -> bool,
) -> Result<u64, String> {
    let mut host = Vec::new();
    let mut want = Vec::new();
    let mut bytes = 0u64;
    let regions = d.pool.regions();
    let mut planned = vec![false; d.pool.pages() as usize];
    for &s in slots {
        *planned
            .get_mut(s as usize)
            .ok_or_else(|| format!("rank {}: slot {s} past the pool", d.rank))? = true;
    }
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
            // SAFETY: the caller's promise (loads ended, nothing else writing the pool).
            unsafe { d.pool.read_buffer(index, &mut host) }.map_err(de)?;
            for (p, &s) in slots.iter().enumerate() {
                fill_row(&mut want, tag(c), l, p as u64);
                let got = host
                    .get(s as usize * len..(s as usize + 1) * len)
                    .ok_or_else(|| format!("rank {}: slot {s} past the pool", d.rank))?;
                if got != &want[..] {
                    let byte = got.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
                    return Err(format!(
                        "rank {}: component {} layer {l} plan page {p} (slot {s}) differs at byte {byte}",
                        d.rank, c.name
                    ));
                }
                bytes += len as u64;
            }
            untouched_slots_zero(d.rank, &c.name, l, &host, len, &planned)?;
        }
    }
    Ok(bytes)
}

/// Every slot of one layer buffer `host` (slots of `len` bytes) that no plan page names is
/// still all zero.
fn untouched_slots_zero(
    rank: u32,
    component: &str,
    layer: u32,
    host: &[u8],
    len: usize,
    planned: &[bool],
) -> Result<(), String> {
    let stray = host
        .chunks(len.max(1))
        .zip(planned)
        .position(|(row, &p)| !p && row.iter().any(|&b| b != 0));
    match stray {
        Some(s) => Err(format!(
            "rank {rank}: component {component} layer {layer}: slot {s}, in no plan page, was written"
        )),
        None => Ok(()),
    }
}

/// Every rank's pool compared (all at once); total bytes compared.
///
/// # Safety
/// As [`compare_pool`], for every rank's pool.
pub unsafe fn compare_all(
    devs: &[RankDev],
    slots: &[Vec<u32>],
    upto: u32,
    pick: &(dyn Fn(u32) -> bool + Sync),
) -> Result<u64, String> {
    let per = all_ok(on_ranks(devs.len(), |r| {
        // SAFETY: the caller's promise, for this rank's pool.
        unsafe { compare_pool(&devs[r], &slots[r], upto, pick) }
    }))?;
    Ok(per.iter().sum())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kv_device::{CpuDevice, DeviceKvPool, StagingPool};

    use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, RowUnit};
    use kv_loader::mock::{MockCall, MockKvLoader, MockScript};
    use kv_loader::{BatchId, BatchPlan};

    use super::{compare_pool, run_batch, RankDev};
    use crate::glm::{glm, half_bytes, tag};
    use crate::pattern::fill_row;

    /// A CPU rank of GLM-5.2 at TP 1 with a pool of 4 pages, plan pages 0 and 1 written into
    /// slots 0 and 2 on the first two layers.
    fn rank_with_plan_rows() -> RankDev {
        let dev = CpuDevice::new(0).unwrap();
        let g = glm(1, 0).unwrap();
        let pool = Arc::new(DeviceKvPool::new(dev.clone(), g.clone(), 4).unwrap());
        for c in g.components() {
            let mut row = vec![0u8; c.page_layer_bytes as usize];
            for &l in c.layers.iter().filter(|&&l| l < 2) {
                for (p, s) in [(0u64, 0u32), (1, 2)] {
                    fill_row(&mut row, tag(c), l, p);
                    // SAFETY: the test's own pool: nothing else uses it.
                    unsafe { pool.write_slot(c.id, l, s, &row) }.unwrap();
                }
            }
        }
        RankDev {
            rank: 0,
            staging: StagingPool::new(dev.clone(), half_bytes(&g, 2), 1).unwrap(),
            dev,
            g,
            pool,
        }
    }

    /// Before, a rank whose `wait_batch` gave no outcome just returned: the next check
    /// cleared and compared a pool that batch might still write. The loader is reset now.
    #[test]
    fn a_batch_without_an_outcome_resets_its_loader() {
        let script = MockScript {
            time_out: vec![BatchId(1)],
            ..MockScript::default()
        };
        let mock = MockKvLoader::new(2, script);
        let spec = ModelKvSpec::new(
            "tiny",
            2,
            4,
            vec![ComponentSpec::new(
                "k",
                RowUnit::Token,
                ElementType::Bytes,
                8,
            )],
        )
        .unwrap();
        let g = KvGeometry::new(spec, 1, 0).unwrap();
        let page = kv_geometry::page_hashes(&[1, 2, 3, 4], 4, None);
        let plan = BatchPlan::all_components(
            &g,
            BatchId(1),
            vec![kv_loader::RequestPages {
                request: "r".into(),
                pages: page,
            }],
            vec![0],
        );
        let runs = run_batch(std::slice::from_ref(&mock), vec![plan]);
        let e = runs.into_iter().next().unwrap().err().unwrap();
        assert!(e.contains("the loader was reset"), "{e}");
        assert!(mock.calls().contains(&MockCall::Reset));
    }

    /// Before, only the plan's slots were compared: a landing that also wrote a slot outside
    /// its plan (another sequence's KV, in an engine) passed every check.
    #[test]
    fn a_slot_outside_the_plan_written_fails_the_comparison() {
        let d = rank_with_plan_rows();
        // SAFETY: nothing writes the pool during the comparisons (the test's own).
        let bytes = unsafe { compare_pool(&d, &[0, 2], 2, &|_| true) }.unwrap();
        assert!(bytes > 0);
        let c = &d.g.components()[0];
        let stray = vec![1u8; c.page_layer_bytes as usize];
        // SAFETY: as above.
        unsafe { d.pool.write_slot(c.id, 1, 3, &stray) }.unwrap();
        // SAFETY: as above.
        let e = unsafe { compare_pool(&d, &[0, 2], 2, &|_| true) }.unwrap_err();
        assert!(e.contains("slot 3, in no plan page, was written"), "{e}");
        // A layer not picked is not compared, strays included.
        // SAFETY: as above.
        assert!(unsafe { compare_pool(&d, &[0, 2], 2, &|l| l == 0) }.is_ok());
        // A plan slot past the pool is refused, not a panic.
        // SAFETY: as above.
        assert!(unsafe { compare_pool(&d, &[0, 9], 2, &|_| true) }.is_err());
    }
}
