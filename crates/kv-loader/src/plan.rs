//! Plans: the logical part every TP rank must agree on, and the per-rank slots.

use std::collections::HashMap;

use kv_geometry::{ComponentId, KvGeometry, PageHash};

use crate::{BatchId, KvLoadError, PlanError, RequestId};

/// Version tag of [`LogicalPlan::write_canonical`]'s encoding.
pub const CANONICAL_PLAN_VERSION: u8 = 1;

/// The pages of one request, in order.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestPages {
    /// The engine's request.
    pub request: RequestId,
    /// Page hashes of the pages to move, in prefix order.
    pub pages: Vec<PageHash>,
}

/// What a batch moves, independent of where it lands: requests, their pages, components.
/// Every TP rank must build the same logical plan for the same batch (dedup checks it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LogicalPlan {
    /// The batch.
    pub batch: BatchId,
    /// Requests in batch order; their pages are the plan's pages, flattened in this order.
    pub requests: Vec<RequestPages>,
    /// Components to move (a subset of the geometry's, strictly increasing).
    pub components: Vec<ComponentId>,
}

impl LogicalPlan {
    /// Pages over all requests.
    pub fn num_pages(&self) -> usize {
        self.requests.iter().map(|r| r.pages.len()).sum()
    }

    /// All page hashes, flattened in plan order.
    pub fn pages(&self) -> impl Iterator<Item = &PageHash> {
        self.requests.iter().flat_map(|r| r.pages.iter())
    }

    /// Feeds the canonical byte encoding to `sink`, in pieces: version, batch id, components,
    /// then per request its id and page hashes; every integer little-endian, every variable
    /// part length-prefixed. Two plans are equal exactly when their encodings are.
    pub fn write_canonical(&self, sink: &mut dyn FnMut(&[u8])) {
        sink(&[CANONICAL_PLAN_VERSION]);
        sink(&self.batch.0.to_le_bytes());
        sink(&(self.components.len() as u32).to_le_bytes());
        for c in &self.components {
            sink(&c.0.to_le_bytes());
        }
        sink(&(self.requests.len() as u32).to_le_bytes());
        for r in &self.requests {
            sink(&(r.request.0.len() as u32).to_le_bytes());
            sink(r.request.0.as_bytes());
            sink(&(r.pages.len() as u32).to_le_bytes());
            for p in &r.pages {
                sink(&p.0);
            }
        }
    }

    /// The canonical encoding as one buffer.
    pub fn canonical_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(32 + self.num_pages() * 32);
        self.write_canonical(&mut |b| out.extend_from_slice(b));
        out
    }
}

/// A batch to load or save on one rank: the logical plan and, for each of its pages in plan
/// order, the page slot of this rank's pool it lands in (or is saved from).
///
/// ```
/// use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec, PageHash};
/// use kv_loader::{BatchId, BatchPlan, LogicalPlan, RequestPages};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let plan = BatchPlan {
///     logical: LogicalPlan {
///         batch: BatchId(1),
///         requests: vec![RequestPages { request: "r1".into(), pages: vec![PageHash([1; 32]), PageHash([2; 32])] }],
///         components: vec![ComponentId(0), ComponentId(1)],
///     },
///     slots: vec![10, 3],
/// };
/// plan.validate(&g, 16).unwrap();
/// assert!(plan.validate(&g, 4).is_err()); // slot 10 is outside a 4-page pool
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchPlan {
    /// What moves.
    pub logical: LogicalPlan,
    /// Where each page lands on this rank (page slot index of the pool).
    pub slots: Vec<u32>,
}

impl BatchPlan {
    /// A plan whose components are all of the geometry's.
    pub fn all_components(
        geometry: &KvGeometry,
        batch: BatchId,
        requests: Vec<RequestPages>,
        slots: Vec<u32>,
    ) -> Self {
        BatchPlan {
            logical: LogicalPlan {
                batch,
                requests,
                components: geometry.components().iter().map(|c| c.id).collect(),
            },
            slots,
        }
    }

    /// The checks a plan needs no geometry or pool for: one slot per page, and components
    /// (at least one, when there are pages) strictly increasing. [`validate`](Self::validate)
    /// makes them first; a loader without a geometry (a mock) can make them alone.
    ///
    /// ```
    /// use kv_loader::{BatchId, BatchPlan, LogicalPlan, PlanError, RequestId, RequestPages};
    /// use kv_geometry::{ComponentId, PageHash};
    /// let plan = |components: Vec<u16>| BatchPlan {
    ///     logical: LogicalPlan {
    ///         batch: BatchId(1),
    ///         requests: vec![RequestPages { request: RequestId("r".into()), pages: vec![PageHash([1; 32])] }],
    ///         components: components.into_iter().map(ComponentId).collect(),
    ///     },
    ///     slots: vec![4],
    /// };
    /// assert_eq!(plan(vec![0, 1]).check_shape(), Ok(()));
    /// assert_eq!(plan(vec![]).check_shape(), Err(PlanError::NoComponents { pages: 1 }));
    /// assert_eq!(plan(vec![1, 0]).check_shape(), Err(PlanError::BadComponent(0)));
    /// ```
    pub fn check_shape(&self) -> Result<(), PlanError> {
        self.check_shape_with(|_| true)
    }

    /// [`check_shape`](Self::check_shape), with each component also refused unless `known`
    /// (the first component unknown or out of order is the error).
    fn check_shape_with(&self, known: impl Fn(ComponentId) -> bool) -> Result<(), PlanError> {
        let pages = self.logical.num_pages();
        if pages != self.slots.len() {
            return Err(PlanError::SlotCount {
                pages,
                slots: self.slots.len(),
            });
        }
        if pages > 0 && self.logical.components.is_empty() {
            return Err(PlanError::NoComponents { pages });
        }
        let mut prev: Option<u16> = None;
        for c in &self.logical.components {
            if !known(*c) || prev.is_some_and(|p| p >= c.0) {
                return Err(PlanError::BadComponent(c.0));
            }
            prev = Some(c.0);
        }
        Ok(())
    }

    /// Checks the plan against the geometry and a pool of `pool_pages` page slots: one slot
    /// per page, every slot inside the pool, no slot twice, components (at least one, when
    /// there are pages) known and not repeated.
    pub fn validate(&self, geometry: &KvGeometry, pool_pages: u32) -> Result<(), KvLoadError> {
        self.validate_slots(geometry, pool_pages, false)
    }

    /// [`validate`](Self::validate) for a save, which only reads the slots: a slot may be
    /// named again for the same page (two requests sharing a prefix block, saved in one
    /// plan); a slot named for two different pages is still refused.
    ///
    /// ```
    /// use kv_geometry::{ComponentSpec, ElementType, KvGeometry, ModelKvSpec, PageHash, RowUnit};
    /// use kv_loader::{BatchId, BatchPlan, LogicalPlan, RequestId, RequestPages};
    /// let spec = ModelKvSpec::new("m", 1, 4,
    ///     vec![ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, 8)]).unwrap();
    /// let g = KvGeometry::new(spec, 1, 0).unwrap();
    /// let plan = |pages: [u8; 2]| BatchPlan {
    ///     logical: LogicalPlan {
    ///         batch: BatchId(1),
    ///         requests: pages.iter().map(|&p| RequestPages {
    ///             request: RequestId(format!("r{p}")), pages: vec![PageHash([p; 32])],
    ///         }).collect(),
    ///         components: vec![g.components()[0].id],
    ///     },
    ///     slots: vec![0, 0],
    /// };
    /// assert!(plan([1, 1]).validate_save(&g, 4).is_ok());
    /// assert!(plan([1, 1]).validate(&g, 4).is_err());
    /// assert!(plan([1, 2]).validate_save(&g, 4).is_err());
    /// ```
    pub fn validate_save(&self, geometry: &KvGeometry, pool_pages: u32) -> Result<(), KvLoadError> {
        self.validate_slots(geometry, pool_pages, true)
    }

    fn validate_slots(
        &self,
        geometry: &KvGeometry,
        pool_pages: u32,
        same_page_again: bool,
    ) -> Result<(), KvLoadError> {
        let batch = self.logical.batch;
        let bad = |reason| KvLoadError::InvalidPlan { batch, reason };
        self.check_shape_with(|c| geometry.component(c).is_ok())
            .map_err(bad)?;
        // Bitset of used slots, plus who used them first for the error.
        let mut used = vec![0u64; (pool_pages as usize).div_ceil(64)];
        // For a save, once a slot comes again: each slot's first position and every page,
        // so that each repeat is checked at once.
        let mut seen: Option<(HashMap<u32, usize>, Vec<&PageHash>)> = None;
        for (page, &slot) in self.slots.iter().enumerate() {
            if slot >= pool_pages {
                return Err(bad(PlanError::SlotOutOfPool {
                    slot,
                    page,
                    pool_pages,
                }));
            }
            let (w, b) = (slot as usize / 64, slot % 64);
            if used[w] & (1 << b) != 0 {
                let first = if same_page_again {
                    let (firsts, pages) = seen.get_or_insert_with(|| {
                        let mut firsts = HashMap::new();
                        for (i, &s) in self.slots.iter().enumerate().rev() {
                            firsts.insert(s, i);
                        }
                        (firsts, self.logical.pages().collect())
                    });
                    let first = firsts.get(&slot).copied().unwrap_or(0);
                    if pages.get(first).is_some() && pages.get(first) == pages.get(page) {
                        continue;
                    }
                    first
                } else {
                    self.slots.iter().position(|&s| s == slot).unwrap_or(0)
                };
                return Err(bad(PlanError::DuplicateSlot {
                    slot,
                    first,
                    second: page,
                }));
            }
            used[w] |= 1 << b;
        }
        Ok(())
    }
}

/// Page slots from the token rows of each page's first token (as engines that index pools
/// by token allocate them). Every row must start a page.
///
/// ```
/// use kv_loader::slots_from_token_rows;
/// assert_eq!(slots_from_token_rows(&[128, 0, 64], 64).unwrap(), vec![2, 0, 1]);
/// assert!(slots_from_token_rows(&[65], 64).is_err());
/// ```
///
/// A page size of zero is [`PlanError::ZeroPageSize`], a row whose page number does not fit
/// a `u32` slot [`PlanError::RowOutOfRange`].
pub fn slots_from_token_rows(rows: &[u64], page_size: u32) -> Result<Vec<u32>, PlanError> {
    if page_size == 0 {
        return Err(PlanError::ZeroPageSize);
    }
    let ps = u64::from(page_size);
    rows.iter()
        .map(|&row| {
            if !row.is_multiple_of(ps) {
                return Err(PlanError::Misaligned { row, page_size });
            }
            u32::try_from(row / ps).map_err(|_| PlanError::RowOutOfRange { row, page_size })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Before, a page size of 0 was taken as 1 (rows became slots), and a row past the last
    /// `u32` page was called misaligned.
    #[test]
    fn token_rows_need_a_page_size_and_pages_that_fit_a_slot() {
        assert_eq!(
            slots_from_token_rows(&[0, 8], 0),
            Err(PlanError::ZeroPageSize)
        );
        let row = (u64::from(u32::MAX) + 1) * 64;
        assert_eq!(
            slots_from_token_rows(&[row], 64),
            Err(PlanError::RowOutOfRange { row, page_size: 64 })
        );
        assert_eq!(
            slots_from_token_rows(&[u64::from(u32::MAX) * 64], 64),
            Ok(vec![u32::MAX])
        );
        assert_eq!(
            slots_from_token_rows(&[65], 64),
            Err(PlanError::Misaligned {
                row: 65,
                page_size: 64
            })
        );
    }
}
