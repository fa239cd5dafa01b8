//! Who reads what, and where it sits in a layer's staging buffer.
//!
//! In `SplitAllGather`, rank `r` reads the contiguous share [`page_shares`]`(pages, size)[r]`
//! of the plan's pages. In both shared modes, a layer's rows travel through one contiguous
//! staging buffer per rank, laid out by [`StagingLayout`]:
//! - `Rank0Broadcast`: one block per component (in the order given), each holding that
//!   component's row of every plan page, in plan order. Rank 0 reads the whole buffer and
//!   broadcasts it.
//! - `SplitAllGather`: `size` chunks of equal length, rank-major; chunk `r` holds rank `r`'s
//!   share, as one block per component of [`padded_share`] page rows each (the last rows of a
//!   short share are padding). Equal chunks make one in-place all-gather of the buffer move
//!   every share even when the pages do not divide by the ranks.
//!
//! Every rank then copies page `i`'s rows to its own slot `i` (slots may differ per rank).

use std::ops::Range;

use kv_device::RowBlock;
use kv_geometry::{ComponentId, ComponentLayout};
use kv_loader::{ShareMode, StoreReads};

/// The replicated pages (of `pages`, in plan order) rank `rank` of a group of `size` reads from
/// the store itself when a mode's store reads are `reads`: all of them (`EveryRank`; rank 0 of
/// `RankZero`), none (the other ranks of `RankZero`), or its share ([`page_shares`]).
///
/// ```
/// use dedup_broadcast::pages_read;
/// use kv_loader::StoreReads;
/// assert_eq!(pages_read(StoreReads::EveryRank, 2, 4, 10), 0..10);
/// assert_eq!(pages_read(StoreReads::RankZero, 0, 4, 10), 0..10);
/// assert_eq!(pages_read(StoreReads::RankZero, 1, 4, 10), 0..0);
/// assert_eq!(pages_read(StoreReads::SplitByRank, 1, 4, 10), 3..6);
/// assert_eq!(pages_read(StoreReads::SplitByRank, 9, 4, 10), 0..0);
/// ```
pub fn pages_read(reads: StoreReads, rank: u32, size: u32, pages: usize) -> Range<usize> {
    match reads {
        StoreReads::EveryRank => 0..pages,
        StoreReads::RankZero if rank == 0 => 0..pages,
        StoreReads::RankZero => 0..0,
        StoreReads::SplitByRank => page_shares(pages, size)
            .get(rank as usize)
            .cloned()
            .unwrap_or(0..0),
    }
}

/// Rank `r`'s pages are `page_shares(pages, size)[r]`: contiguous, in rank order, covering
/// `0..pages` exactly, sizes differing by at most one (the first `pages % size` ranks get one
/// more). A size of 0 gives no shares.
///
/// ```
/// use dedup_broadcast::page_shares;
/// assert_eq!(page_shares(10, 4), vec![0..3, 3..6, 6..8, 8..10]);
/// assert_eq!(page_shares(2, 4), vec![0..1, 1..2, 2..2, 2..2]);
/// ```
pub fn page_shares(pages: usize, size: u32) -> Vec<Range<usize>> {
    let size = size as usize;
    if size == 0 {
        return Vec::new();
    }
    let (base, extra) = (pages / size, pages % size);
    let mut start = 0;
    (0..size)
        .map(|r| {
            let len = base + usize::from(r < extra);
            let share = start..start + len;
            start += len;
            share
        })
        .collect()
}

/// The largest share, in pages: the all-gather chunk of `SplitAllGather`. 0 for a size of 0.
///
/// ```
/// assert_eq!(dedup_broadcast::padded_share(10, 4), 3);
/// ```
pub fn padded_share(pages: usize, size: u32) -> usize {
    if size == 0 {
        0
    } else {
        pages.div_ceil(size as usize)
    }
}

/// The rank whose share holds plan page `page` (of `pages`, over `size` ranks).
fn owner(page: usize, pages: usize, size: usize) -> usize {
    let (base, extra) = (pages / size, pages % size);
    let long = extra * (base + 1);
    if page < long {
        page / (base + 1)
    } else {
        extra + (page - long) / base.max(1)
    }
}

/// First page of rank `r`'s share.
fn share_start(r: usize, pages: usize, size: usize) -> usize {
    r * (pages / size) + r.min(pages % size)
}

/// Why a staging layout cannot be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShareError {
    /// `AllRanks` reads straight into the pool; it has no staging.
    #[error("{0:?} has no staging buffer")]
    Unstaged(ShareMode),
    /// A sharded component: every rank reads its own part, nothing is shared.
    #[error("component `{0}` is sharded across TP; it is never shared")]
    Sharded(String),
    /// A component given twice.
    #[error("component #{0} is given twice")]
    DuplicateComponent(u16),
    /// A TP size of 0.
    #[error("a TP group of 0 ranks")]
    NoRanks,
    /// The buffer would not fit in the address space.
    #[error("staging for {pages} pages does not fit in memory")]
    TooLarge {
        /// Pages of the plan.
        pages: usize,
    },
}

/// One component's place in a staging chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedComponent {
    /// The component.
    pub id: ComponentId,
    /// Bytes of one page's rows of this layer (`page_layer_bytes`).
    pub page_bytes: usize,
    /// Offset of this component's block inside each chunk.
    pub base: usize,
}

/// One page's rows of one component in the staging buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StagedRow {
    /// The component.
    pub component: ComponentId,
    /// The page, as an index into the plan's pages.
    pub plan_page: usize,
    /// Byte offset in the staging buffer.
    pub offset: usize,
    /// Bytes.
    pub len: usize,
}

/// Where each (component, plan page) of one layer sits in that layer's staging buffer.
///
/// ```
/// use dedup_broadcast::StagingLayout;
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// use kv_loader::ShareMode;
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 0).unwrap();
/// let k = g.component_by_name("k").unwrap();          // 41,984 B per page and layer
/// let s = StagingLayout::new(ShareMode::SplitAllGather, 0, [k], 10, 4).unwrap();
/// assert_eq!(s.chunk_bytes(), 3 * 41_984);           // padded share: 3 pages
/// assert_eq!(s.len(), 4 * 3 * 41_984);
/// assert_eq!(s.share(2), 6..8);
/// assert_eq!(s.offset(k.id, 7), Some(2 * 3 * 41_984 + 41_984));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StagingLayout {
    mode: ShareMode,
    layer: u32,
    pages: usize,
    size: u32,
    components: Vec<StagedComponent>,
    chunk_pages: usize,
    chunk_bytes: usize,
    len: usize,
}

impl StagingLayout {
    /// The layout of layer `layer` for a plan of `pages` pages over `tp_size` ranks, moving
    /// `components` (in that order; those not carried at `layer` contribute nothing).
    /// Refuses `AllRanks`, sharded components, repeated components and a TP size of 0.
    pub fn new<'a>(
        mode: ShareMode,
        layer: u32,
        components: impl IntoIterator<Item = &'a ComponentLayout>,
        pages: usize,
        tp_size: u32,
    ) -> Result<Self, ShareError> {
        if tp_size == 0 {
            return Err(ShareError::NoRanks);
        }
        let chunk_pages = match mode.spec().reads {
            StoreReads::EveryRank => return Err(ShareError::Unstaged(mode)),
            StoreReads::RankZero => pages,
            StoreReads::SplitByRank => padded_share(pages, tp_size),
        };
        let too_large = || ShareError::TooLarge { pages };
        let mut staged: Vec<StagedComponent> = Vec::new();
        // Every component named so far, carried on this layer or not: a repeat is refused on
        // every layer alike.
        let mut named: Vec<ComponentId> = Vec::new();
        let mut chunk_bytes = 0usize;
        for c in components {
            if !c.replicated {
                return Err(ShareError::Sharded(c.name.clone()));
            }
            if named.contains(&c.id) {
                return Err(ShareError::DuplicateComponent(c.id.0));
            }
            named.push(c.id);
            if c.position(layer).is_none() {
                continue;
            }
            let page_bytes = usize::try_from(c.page_layer_bytes).map_err(|_| too_large())?;
            staged.push(StagedComponent {
                id: c.id,
                page_bytes,
                base: chunk_bytes,
            });
            let block = page_bytes.checked_mul(chunk_pages).ok_or_else(too_large)?;
            chunk_bytes = chunk_bytes.checked_add(block).ok_or_else(too_large)?;
        }
        let chunks = match mode.spec().reads {
            StoreReads::SplitByRank => tp_size as usize,
            _ => 1,
        };
        let len = chunk_bytes.checked_mul(chunks).ok_or_else(too_large)?;
        Ok(StagingLayout {
            mode,
            layer,
            pages,
            size: tp_size,
            components: staged,
            chunk_pages,
            chunk_bytes,
            len,
        })
    }

    /// The share mode laid out.
    pub fn mode(&self) -> ShareMode {
        self.mode
    }

    /// The model layer.
    pub fn layer(&self) -> u32 {
        self.layer
    }

    /// Pages of the plan.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Ranks of the group.
    pub fn tp_size(&self) -> u32 {
        self.size
    }

    /// Bytes of the staging buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when nothing is staged at this layer (no pages, or no component on it).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of one chunk: one rank's all-gather contribution (`SplitAllGather`), or the
    /// whole buffer (`Rank0Broadcast`).
    pub fn chunk_bytes(&self) -> usize {
        self.chunk_bytes
    }

    /// The components carried at this layer, in staging order.
    pub fn components(&self) -> &[StagedComponent] {
        &self.components
    }

    /// The plan pages rank `rank` reads from the store: its share (`SplitAllGather`), all of
    /// them on rank 0 and none elsewhere (`Rank0Broadcast`); [`pages_read`] of the layout's
    /// mode (a layout is never built for one whose ranks all read every page).
    pub fn share(&self, rank: u32) -> Range<usize> {
        pages_read(self.mode.spec().reads, rank, self.size, self.pages)
    }

    /// The staging bytes rank `rank` fills from the store: its chunk (`SplitAllGather`, an
    /// all-gather's send region), the whole buffer on rank 0 and nothing elsewhere
    /// (`Rank0Broadcast`).
    pub fn chunk(&self, rank: u32) -> Range<usize> {
        match self.mode.spec().reads {
            StoreReads::SplitByRank if rank < self.size => {
                let start = rank as usize * self.chunk_bytes;
                start..start + self.chunk_bytes
            }
            StoreReads::RankZero if rank == 0 => 0..self.len,
            _ => 0..0,
        }
    }

    /// Byte offset of (`component`, plan page `plan_page`)'s rows in the staging buffer, or
    /// `None` when the component is not staged at this layer or the page is past the plan.
    pub fn offset(&self, component: ComponentId, plan_page: usize) -> Option<usize> {
        let c = self.components.iter().find(|c| c.id == component)?;
        self.offset_of(c, plan_page)
    }

    fn offset_of(&self, c: &StagedComponent, plan_page: usize) -> Option<usize> {
        if plan_page >= self.pages {
            return None;
        }
        let (chunk, row) = match self.mode.spec().reads {
            StoreReads::SplitByRank => {
                let size = self.size as usize;
                let r = owner(plan_page, self.pages, size);
                (r, plan_page - share_start(r, self.pages, size))
            }
            _ => (0, plan_page),
        };
        Some(chunk * self.chunk_bytes + c.base + row * c.page_bytes)
    }

    /// Every staged row of the plan pages in `pages` (clipped to the plan), component by
    /// component, pages in order: `rows(self.share(rank))` is what `rank` reads,
    /// `rows(0..self.pages())` what every rank scatters into its slots.
    pub fn rows(&self, pages: Range<usize>) -> impl Iterator<Item = StagedRow> + '_ {
        let pages = pages.start.min(self.pages)..pages.end.min(self.pages);
        self.components.iter().flat_map(move |c| {
            pages.clone().filter_map(move |p| {
                Some(StagedRow {
                    component: c.id,
                    plan_page: p,
                    offset: self.offset_of(c, p)?,
                    len: c.page_bytes,
                })
            })
        })
    }

    /// Pages per chunk (the padded share in `SplitAllGather`, all pages in `Rank0Broadcast`).
    pub fn chunk_pages(&self) -> usize {
        self.chunk_pages
    }

    /// The staged rows as blocks, in staging order: one per component (`Rank0Broadcast`), or
    /// one per rank's share and component, rank-major (`SplitAllGather`). Each block is one
    /// scatter from device staging, and its pages are consecutive rows of the host collective.
    ///
    /// ```
    /// use dedup_broadcast::StagingLayout;
    /// use kv_geometry::{KvGeometry, ModelKvSpec};
    /// use kv_loader::ShareMode;
    /// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 0).unwrap();
    /// let k = g.component_by_name("k").unwrap();
    /// let s = StagingLayout::new(ShareMode::SplitAllGather, 0, [k], 10, 4).unwrap();
    /// let b = s.blocks();
    /// assert_eq!(b.len(), 4);
    /// assert_eq!((b[2].first_page, b[2].pages, b[2].offset), (6, 2, 2 * s.chunk_bytes()));
    /// assert_eq!(s.rows_per_rank(), vec![3, 3, 2, 2]);
    /// ```
    pub fn blocks(&self) -> Vec<RowBlock> {
        let shares = match self.mode.spec().reads {
            StoreReads::SplitByRank => page_shares(self.pages, self.size),
            _ => std::iter::once(0..self.pages).collect(),
        };
        shares
            .into_iter()
            .enumerate()
            .filter(|(_, share)| !share.is_empty())
            .flat_map(|(chunk, share)| {
                self.components.iter().map(move |c| RowBlock {
                    component: c.id,
                    first_page: share.start,
                    pages: share.len(),
                    offset: chunk * self.chunk_bytes + c.base,
                })
            })
            .collect()
    }

    /// Rows (plan pages × components) each rank owns, in rank order, as [`blocks`](Self::blocks)
    /// orders them: the counts of a host all-gather (`SplitAllGather`). `Rank0Broadcast`: every
    /// row is rank 0's.
    pub fn rows_per_rank(&self) -> Vec<usize> {
        (0..self.size)
            .map(|r| self.share(r).len() * self.components.len())
            .collect()
    }
}
