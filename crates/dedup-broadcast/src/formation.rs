//! Re-forming a group after an abort: at a batch boundary, a rank whose handle is
//! [broken](crate::Collective::broken) asks the group's formation for a fresh handle.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use crate::{Collective, CollectiveError, InProcessGroup};

/// Makes new handles of one TP group (new communicators, a new epoch) after the old ones were
/// aborted. Every rank asks for the same epochs in the same order (`1, 2, ...`; the group first
/// built is epoch 0), each for its own rank. An implementation across processes meets the other
/// ranks (a rendezvous) and may fail by `deadline`; the caller then fails its batch and asks
/// again at the next one.
pub trait GroupFormation: Send + Sync {
    /// Rank `rank`'s handle of the group's formation number `epoch`.
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<Arc<dyn Collective>, CollectiveError>;

    /// Rank `rank`'s handle of the group's *control* channel (the lookups' handle, which runs
    /// beside the data handle on another thread) for its formation number `epoch`. Control
    /// epochs count on their own (`1, 2, ...`), independently of [`reform`](Self::reform)'s.
    /// The default says the formation cannot: a broken control handle then fails every later
    /// lookup until the engine builds a new group.
    fn reform_control(
        &self,
        rank: u32,
        epoch: u64,
        deadline: Instant,
    ) -> Result<Arc<dyn Collective>, CollectiveError> {
        let _ = (rank, epoch, deadline);
        Err(CollectiveError::Unsupported {
            op: "reform_control",
            detail: "this formation re-forms the data handle only".into(),
        })
    }
}

type Build = dyn Fn() -> Result<Vec<Arc<dyn Collective>>, CollectiveError> + Send + Sync;

/// Per epoch, the handles no rank has taken yet.
type Epochs = HashMap<u64, Vec<Option<Arc<dyn Collective>>>>;

/// The formation of a group whose ranks are threads of this process: the first rank to ask for
/// an epoch builds every rank's handle at once (with `build`), each rank takes its own. No rank
/// waits for another.
///
/// ```
/// use std::time::{Duration, Instant};
/// use dedup_broadcast::{Collective, GroupFormation, InProcessFormation};
/// let f = InProcessFormation::host(2);
/// let soon = kv_loader::deadline_after(Duration::from_secs(1));
/// let (a, b) = (f.reform(0, 1, soon).unwrap(), f.reform(1, 1, soon).unwrap());
/// assert_eq!((a.rank(), b.rank(), a.size()), (0, 1, 2));
/// ```
pub struct InProcessFormation {
    size: u32,
    build: Box<Build>,
    epochs: Mutex<Epochs>,
    /// Builds the control channel's handles (by default as `build` does).
    build_control: Option<Box<Build>>,
    control_epochs: Mutex<Epochs>,
}

impl InProcessFormation {
    /// Handles built by `build`, which returns one handle per rank, rank `r` at index `r`.
    pub fn new(
        size: u32,
        build: impl Fn() -> Result<Vec<Arc<dyn Collective>>, CollectiveError> + Send + Sync + 'static,
    ) -> Self {
        InProcessFormation {
            size,
            build: Box::new(build),
            epochs: Mutex::new(HashMap::new()),
            build_control: None,
            control_epochs: Mutex::new(HashMap::new()),
        }
    }

    /// Builds the control channel's handles with `build` (instead of the data handles'
    /// builder): e.g. host groups for the lookups of a group that shares on devices.
    pub fn with_control(
        mut self,
        build: impl Fn() -> Result<Vec<Arc<dyn Collective>>, CollectiveError> + Send + Sync + 'static,
    ) -> Self {
        self.build_control = Some(Box::new(build));
        self
    }

    /// Rank `rank`'s handle of `epoch` from `epochs`, building every rank's with `build` when
    /// `rank` is the first to ask.
    fn take(
        &self,
        epochs: &Mutex<Epochs>,
        build: &Build,
        rank: u32,
        epoch: u64,
    ) -> Result<Arc<dyn Collective>, CollectiveError> {
        if rank >= self.size {
            return Err(CollectiveError::Backend(format!(
                "rank {rank} of a group of {}",
                self.size
            )));
        }
        let mut epochs = epochs.lock();
        if !epochs.contains_key(&epoch) {
            let handles = build()?;
            if handles.len() != self.size as usize {
                return Err(CollectiveError::Backend(format!(
                    "built {} handles for {} ranks",
                    handles.len(),
                    self.size
                )));
            }
            // Older epochs are stale: a rank that asks for this one will not need them. (An
            // epoch whose handles were all taken stays until then, so that asking twice for it
            // is an error rather than a new group.)
            epochs.retain(|&e, _| e > epoch);
            epochs.insert(epoch, handles.into_iter().map(Some).collect());
        }
        let slots = epochs
            .get_mut(&epoch)
            .ok_or_else(|| CollectiveError::Backend(format!("epoch {epoch} vanished")))?;
        slots[rank as usize].take().ok_or_else(|| {
            CollectiveError::Backend(format!("rank {rank} already took epoch {epoch}"))
        })
    }

    /// Fresh [`InProcessGroup::new`] groups of `size` ranks (host memory).
    pub fn host(size: u32) -> Self {
        Self::new(size, move || {
            Ok(InProcessGroup::new(size)
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Collective>)
                .collect())
        })
    }

    /// Fresh [`InProcessGroup::on_devices`] groups over `devices` (control channels: host
    /// groups).
    pub fn on_devices(devices: Vec<Arc<dyn kv_device::Device>>) -> Self {
        let size = devices.len() as u32;
        Self::new(size, move || {
            Ok(InProcessGroup::on_devices(devices.clone())?
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Collective>)
                .collect())
        })
        .with_control(move || {
            Ok(InProcessGroup::new(size)
                .into_iter()
                .map(|c| Arc::new(c) as Arc<dyn Collective>)
                .collect())
        })
    }
}

impl GroupFormation for InProcessFormation {
    fn reform(
        &self,
        rank: u32,
        epoch: u64,
        _deadline: Instant,
    ) -> Result<Arc<dyn Collective>, CollectiveError> {
        let handle = self.take(&self.epochs, &self.build, rank, epoch)?;
        tracing::info!(rank, epoch, "group re-formed");
        Ok(handle)
    }

    fn reform_control(
        &self,
        rank: u32,
        epoch: u64,
        _deadline: Instant,
    ) -> Result<Arc<dyn Collective>, CollectiveError> {
        let build = self.build_control.as_deref().unwrap_or(&*self.build);
        let handle = self.take(&self.control_epochs, build, rank, epoch)?;
        tracing::info!(rank, epoch, "control channel re-formed");
        Ok(handle)
    }
}
