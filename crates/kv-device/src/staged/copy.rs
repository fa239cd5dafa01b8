//! How rows move between staging and scattered pool slots: contiguous slot runs as one copy
//! each, or one row-copy launch per block (never one call per page).

use std::sync::Arc;

use crate::{DeviceError, RowCopy, Stream, Transfer};

/// How a landing moves staged rows into scattered slots (and back, for saves).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScatterStrategy {
    /// Runs when the slots form at most [`DIRECT_RUNS_MAX`] contiguous runs, else Kernel.
    #[default]
    Auto,
    /// One copy per contiguous run of slots, straight into the pool.
    Runs,
    /// Rows in device staging, then one row-copy launch (row `i` → slot `slots[i]`).
    Kernel,
}

/// With [`ScatterStrategy::Auto`], slot runs up to this count are copied directly.
pub const DIRECT_RUNS_MAX: usize = 8;

/// A contiguous run: plan pages `page..page+len` go to slots `slot..slot+len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Run {
    pub(crate) page: u32,
    pub(crate) slot: u32,
    pub(crate) len: u32,
}

/// The runs of `slots`, whose first entry is plan page `first`.
pub(crate) fn slot_runs(slots: &[u32], first: usize) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for (i, &s) in slots.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if r.slot.checked_add(r.len) == Some(s) => r.len += 1,
            _ => runs.push(Run {
                page: (first + i) as u32,
                slot: s,
                len: 1,
            }),
        }
    }
    runs
}

impl ScatterStrategy {
    /// True when `runs` runs are copied run by run.
    pub(crate) fn uses_runs(self, runs: usize) -> bool {
        match self {
            ScatterStrategy::Runs => true,
            ScatterStrategy::Kernel => false,
            ScatterStrategy::Auto => runs <= DIRECT_RUNS_MAX,
        }
    }
}

/// Rows of one component to move between staging and the pool: staged row `i` (at
/// `i * row` from the staging base) is plan page `first_page + i`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowSpan {
    pub(crate) first_page: usize,
    pub(crate) pages: usize,
    pub(crate) row: u64,
    /// Pool buffer of (component, layer).
    pub(crate) pool: u64,
    /// Device slot table (`u32` per plan page), 0 when there is none.
    pub(crate) slot_table: u64,
}

impl RowSpan {
    /// The slot runs of the span's pages (`slots`: the batch's, one per plan page).
    fn runs(&self, slots: &[u32]) -> Vec<Run> {
        slot_runs(
            &slots[self.first_page..self.first_page + self.pages],
            self.first_page,
        )
    }

    /// Bytes of all its rows.
    fn bytes(&self) -> u64 {
        self.pages as u64 * self.row
    }

    /// Where run `r` lies: the address of its first slot in the pool, its offset from the
    /// staging base, and its bytes.
    fn place(&self, r: &Run) -> (u64, u64, usize) {
        let slot = self.pool + u64::from(r.slot) * self.row;
        let at = (r.page as usize - self.first_page) as u64 * self.row;
        (slot, at, (u64::from(r.len) * self.row) as usize)
    }

    /// The span's entries of the device slot table.
    fn slot_rows(&self) -> u64 {
        self.slot_table + 4 * self.first_page as u64
    }
}

/// What one move enqueued.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Moved {
    pub(crate) copies: u64,
    pub(crate) launches: u64,
    pub(crate) host_to_device: u64,
    pub(crate) device_to_device: u64,
    pub(crate) device_to_host: u64,
}

/// The staging side of a move.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Staged {
    /// Rows in pinned host memory at this address; the device staging at `dev` (the same
    /// offset in the device stage) is free for the kernel path.
    Host { host: usize, dev: u64 },
    /// Rows already in device staging.
    Device(u64),
}

/// Enqueues the move of `span`'s rows from staging into their slots.
///
/// # Safety
/// The staged rows and the slots of `span` are valid (inside their buffers) and untouched by
/// others until an event recorded after this completes; `slots` are the batch's slots.
pub(crate) unsafe fn scatter(
    stream: &Arc<dyn Stream>,
    strategy: ScatterStrategy,
    slots: &[u32],
    span: RowSpan,
    from: Staged,
) -> Result<Moved, DeviceError> {
    let mut m = Moved::default();
    let runs = span.runs(slots);
    let bytes = span.bytes();
    if strategy.uses_runs(runs.len()) {
        for r in &runs {
            let (dst, at, len) = span.place(r);
            let t = match from {
                Staged::Host { host, .. } => Transfer::ToDevice {
                    dst,
                    src: host + at as usize,
                    len,
                },
                Staged::Device(dev) => Transfer::OnDevice {
                    dst,
                    src: dev + at,
                    len,
                },
            };
            // SAFETY: the run's rows lie in staging and its slots in the pool (caller).
            unsafe { stream.transfer(t)? };
            m.copies += 1;
        }
        match from {
            Staged::Host { .. } => m.host_to_device += bytes,
            Staged::Device(_) => m.device_to_device += bytes,
        }
        return Ok(m);
    }
    let dev = match from {
        Staged::Host { host, dev } => {
            let t = Transfer::ToDevice {
                dst: dev,
                src: host,
                len: bytes as usize,
            };
            // SAFETY: the rows lie in the pinned stage and the same range of the device stage
            // is this span's (caller).
            unsafe { stream.transfer(t)? };
            m.copies += 1;
            m.host_to_device += bytes;
            dev
        }
        Staged::Device(dev) => dev,
    };
    let c = RowCopy {
        src: dev,
        dst: span.pool,
        src_rows: 0,
        dst_rows: span.slot_rows(),
        n_rows: rows_of(&span)?,
        row_bytes: span.row,
    };
    // SAFETY: source rows in device staging, destination rows `slots[i]` inside the pool
    // buffer, the slot table holds every plan page's slot; distinct slots (validated plan).
    unsafe { stream.copy_rows(c)? };
    m.launches += 1;
    m.device_to_device += bytes;
    Ok(m)
}

/// Enqueues the gather of `span`'s slots into pinned staging at `host` (plan order), through
/// device staging at `dev` for the kernel path.
///
/// # Safety
/// As for [`scatter`], reversed.
pub(crate) unsafe fn gather(
    stream: &Arc<dyn Stream>,
    strategy: ScatterStrategy,
    slots: &[u32],
    span: RowSpan,
    host: usize,
    dev: u64,
) -> Result<Moved, DeviceError> {
    let mut m = Moved::default();
    let runs = span.runs(slots);
    let bytes = span.bytes();
    if strategy.uses_runs(runs.len()) {
        for r in &runs {
            let (src, at, len) = span.place(r);
            let t = Transfer::ToHost {
                dst: host + at as usize,
                src,
                len,
            };
            // SAFETY: slots in the pool, destination in the pinned stage (caller).
            unsafe { stream.transfer(t)? };
            m.copies += 1;
        }
        m.device_to_host += bytes;
        return Ok(m);
    }
    let c = RowCopy {
        src: span.pool,
        dst: dev,
        src_rows: span.slot_rows(),
        dst_rows: 0,
        n_rows: rows_of(&span)?,
        row_bytes: span.row,
    };
    // SAFETY: source rows `slots[i]` in the pool, destination rows in device staging.
    unsafe { stream.copy_rows(c)? };
    let t = Transfer::ToHost {
        dst: host,
        src: dev,
        len: bytes as usize,
    };
    // SAFETY: device staging → pinned stage, `bytes` inside both.
    unsafe { stream.transfer(t)? };
    m.launches += 1;
    m.copies += 1;
    m.device_to_device += bytes;
    m.device_to_host += bytes;
    Ok(m)
}

/// `span`'s row count as a row copy takes it (a `u32`).
fn rows_of(span: &RowSpan) -> Result<u32, DeviceError> {
    u32::try_from(span.pages)
        .map_err(|_| DeviceError::InvalidStage("a row copy of 2^32 rows or more"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_coalesce_consecutive_slots() {
        let r = slot_runs(&[4, 5, 6, 9, 2, 3], 10);
        let got: Vec<(u32, u32, u32)> = r.iter().map(|r| (r.page, r.slot, r.len)).collect();
        assert_eq!(got, vec![(10, 4, 3), (13, 9, 1), (14, 2, 2)]);
        assert!(slot_runs(&[], 0).is_empty());
        assert_eq!(slot_runs(&[u32::MAX, 0], 0).len(), 2);
        assert!(ScatterStrategy::Auto.uses_runs(DIRECT_RUNS_MAX));
        assert!(!ScatterStrategy::Auto.uses_runs(DIRECT_RUNS_MAX + 1));
    }
}
