//! The TP group a linker shares replicated KV with, and the load thread's handle on it, which
//! is re-formed at a batch boundary after an abort.

use std::sync::Arc;
use std::time::Instant;

use dedup_broadcast::{Collective, GroupFormation, InProcessFormation, InProcessGroup};
use kv_device::Device;
use parking_lot::Mutex;

/// One rank's handles on its TP group: `data` carries the per-layer exchanges of the load
/// thread, `control` the lookups of the engine's thread. Two handles, because the two
/// threads issue collectives independently and one handle's operations must stay in one
/// order on every rank (NCCL's rule: over NCCL these are two communicators). `formation`,
/// when given, makes a fresh `data` handle after it was aborted.
#[derive(Clone)]
pub struct TpGroup {
    /// Used by the load thread only: gate, status words, the share of each layer.
    pub data: Arc<dyn Collective>,
    /// Used by `lookup` only: the minimum loadable prefix over the group.
    pub control: Arc<dyn Collective>,
    /// Re-forms `data` after an abort (a collective whose event never completed); without
    /// one, a broken group fails every later batch.
    pub formation: Option<Arc<dyn GroupFormation>>,
}

impl TpGroup {
    /// Handles for `size` ranks that are threads of this process, moving host memory (rank
    /// `r` gets element `r`).
    ///
    /// ```
    /// let groups = mooncake_linker::TpGroup::in_process(4);
    /// assert_eq!(groups.len(), 4);
    /// assert_eq!(groups[2].data.rank(), 2);
    /// ```
    pub fn in_process(size: u32) -> Vec<TpGroup> {
        let formation: Arc<dyn GroupFormation> = Arc::new(InProcessFormation::host(size));
        InProcessGroup::new(size)
            .into_iter()
            .zip(InProcessGroup::new(size))
            .map(|(data, control)| TpGroup {
                data: Arc::new(data),
                control: Arc::new(control),
                formation: Some(formation.clone()),
            })
            .collect()
    }

    /// Handles for ranks that are threads of this process, rank `r` on `devices[r]` (ranks
    /// may share one device): the data handle shares layers in device memory, each rank with
    /// its own comm stream; lookups go through a host group.
    ///
    /// ```
    /// use kv_device::{CpuDevice, Device};
    /// use std::sync::Arc;
    /// let dev: Arc<dyn Device> = CpuDevice::new(0).unwrap();
    /// let groups = mooncake_linker::TpGroup::in_process_on_devices(vec![dev.clone(), dev]).unwrap();
    /// assert!(groups[1].data.memory().device);
    /// ```
    pub fn in_process_on_devices(
        devices: Vec<Arc<dyn Device>>,
    ) -> Result<Vec<TpGroup>, dedup_broadcast::CollectiveError> {
        let size = devices.len() as u32;
        let formation: Arc<dyn GroupFormation> =
            Arc::new(InProcessFormation::on_devices(devices.clone()));
        Ok(InProcessGroup::on_devices(devices)?
            .into_iter()
            .zip(InProcessGroup::new(size))
            .map(|(data, control)| TpGroup {
                data: Arc::new(data),
                control: Arc::new(control),
                formation: Some(formation.clone()),
            })
            .collect())
    }

    /// Ranks in the group.
    pub fn size(&self) -> u32 {
        self.data.size()
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.data.rank()
    }
}

/// The load thread's data handle: re-formed through the group's formation at a batch boundary
/// when it is broken; counts the gates held on it (the gate's sequence number: equal on every
/// rank while the ranks are in step, 0 again after a re-form).
pub(crate) struct DataGroup {
    handle: Arc<dyn Collective>,
    formation: Option<Arc<dyn GroupFormation>>,
    epoch: u64,
    gates: u64,
}

impl DataGroup {
    /// The data handle of `group`, when this linker shares with other ranks.
    pub(crate) fn of(group: Option<&TpGroup>) -> Option<DataGroup> {
        group.filter(|g| g.size() > 1).map(|g| DataGroup {
            handle: g.data.clone(),
            formation: g.formation.clone(),
            epoch: 0,
            gates: 0,
        })
    }

    /// The handle for the next batch: a fresh one first when this one is broken. A re-form
    /// that does not complete by `deadline` fails (this batch fails; the next one tries again).
    pub(crate) fn ready(&mut self, deadline: Instant) -> Result<Arc<dyn Collective>, String> {
        if let Some(why) = self.handle.broken() {
            let formation = self
                .formation
                .as_ref()
                .ok_or_else(|| format!("the group is broken ({why}) and has no formation"))?;
            let rank = self.handle.rank();
            let fresh = formation
                .reform(rank, self.epoch + 1, deadline)
                .map_err(|e| format!("re-forming the group after `{why}`: {e}"))?;
            tracing::info!(rank, epoch = self.epoch + 1, why, "data group re-formed");
            self.handle = fresh;
            self.epoch += 1;
            self.gates = 0;
        }
        Ok(self.handle.clone())
    }

    /// The number of the next gate on this handle (then counted).
    pub(crate) fn next_gate(&mut self) -> u64 {
        let n = self.gates;
        self.gates += 1;
        n
    }
}

/// The lookups' control handle: re-formed through the group's formation
/// ([`GroupFormation::reform_control`]) at the next lookup after it broke.
pub(crate) struct ControlGroup {
    state: Mutex<(Arc<dyn Collective>, u64)>,
    formation: Option<Arc<dyn GroupFormation>>,
}

impl ControlGroup {
    /// The control handle of `group`, when this linker shares with other ranks.
    pub(crate) fn of(group: Option<&TpGroup>) -> Option<ControlGroup> {
        group.filter(|g| g.size() > 1).map(|g| ControlGroup {
            state: Mutex::new((g.control.clone(), 0)),
            formation: g.formation.clone(),
        })
    }

    /// The handle for the next lookup: a fresh one first when this one is broken.
    pub(crate) fn ready(&self, deadline: Instant) -> Result<Arc<dyn Collective>, String> {
        let mut state = self.state.lock();
        let (handle, epoch) = &mut *state;
        if let Some(why) = handle.broken() {
            let formation = self.formation.as_ref().ok_or_else(|| {
                format!("the control channel is broken ({why}) and has no formation")
            })?;
            let rank = handle.rank();
            let fresh = formation
                .reform_control(rank, *epoch + 1, deadline)
                .map_err(|e| format!("re-forming the control channel after `{why}`: {e}"))?;
            tracing::info!(rank, epoch = *epoch + 1, why, "control channel re-formed");
            *handle = fresh;
            *epoch += 1;
        }
        Ok(handle.clone())
    }
}
