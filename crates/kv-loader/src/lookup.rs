//! Lookup: how much of a request's prefix the store can give.

use kv_geometry::PageHash;

/// What the engine asks: the request's tokens, and how many leading pages it already has in
/// its own (device) prefix cache.
#[derive(Debug, Clone, Copy)]
pub struct LookupRequest<'a> {
    /// All prompt tokens of the request.
    pub tokens: &'a [u32],
    /// Leading whole pages the engine already holds; the lookup starts after them.
    pub skip_pages: usize,
}

/// The loadable prefix: pages after the engine's own hit that the store holds, in order.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LookupHit {
    /// Hashes of the loadable pages (chained from the start of the prompt).
    pub pages: Vec<PageHash>,
    /// Index of the first loadable page in the prompt: `skip_pages`, or the prompt's whole
    /// pages when it has no more than that (then `pages` is empty).
    pub first_page: usize,
    /// Tokens covered by the loadable pages: a count, not a position. With `skip_pages`
    /// above 0 the loadable tokens end at `(first_page + pages.len()) * page_size`, which is
    /// what a cache that takes "the first N tokens come from the load" needs
    /// (kvlink-candle's `PagedLatentCache::new`), not this count.
    pub tokens: usize,
}
