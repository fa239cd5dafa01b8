//! The groups every rank's linker shares through (in-process device group or NCCL), and the
//! linkers over them.

use std::sync::Arc;

use dedup_broadcast::nccl::{NcclConfig, NcclGroup};
use dedup_broadcast::{Collective, GroupFormation};
use kv_device::{Device, StagedLandingFactory};
use kv_loader::KvLoader;
use mooncake_linker::store::KvStore;
use mooncake_linker::{Linker, LinkerConfig, TpGroup};

use super::rank_dev::RankDev;
use super::Fabric;
use crate::ranks::all_ok;

/// The groups of the linkers (data and control handles per rank, and the formation that
/// re-forms the data group after an abort), made once and reused by every linker of the run,
/// since linkers run one set at a time and every rank issues the same collectives. The rig
/// counts as one more user of every rank's handles while it holds them
/// ([`GroupFormation::enter`]), so that a set of linkers closing does not make the ranks
/// leave the group (which aborts it) before the next set. `reset` drops them (after a failure
/// that may have left a group aborted); the next `get` makes new ones.
pub struct Groups {
    fabric: Fabric,
    devices: Vec<Arc<dyn Device>>,
    current: Option<Vec<TpGroup>>,
    /// Groups made so far (a reset and the next `get` make one more).
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

    /// Every rank's group: the current ones, or new ones after a reset.
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
        for g in &groups {
            if let Some(f) = &g.formation {
                f.enter(g.rank());
            }
        }
        self.current = Some(groups.clone());
        Ok(groups)
    }

    /// Drops the groups, every rank's at once (each NCCL communicator is finalized on its own
    /// comm thread). The linkers that used them must be dropped first.
    pub fn reset(&mut self) {
        if let Some(groups) = self.current.take() {
            for g in &groups {
                if let Some(f) = &g.formation {
                    // The rig's own use ends; the groups are dropped next, so nothing to abort.
                    let _ = f.leave(g.rank());
                }
            }
            std::thread::scope(|s| {
                for g in groups {
                    s.spawn(move || drop(g));
                }
            });
        }
    }
}

/// NCCL data and control groups over GPUs `0..tp`, with the data group's formation.
pub fn nccl_groups(tp: u32) -> Result<Vec<TpGroup>, String> {
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
