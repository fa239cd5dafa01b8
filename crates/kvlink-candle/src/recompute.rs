//! What a failed load leaves the engine to recompute: per layer, the loaded tokens not yet
//! written again.

use std::ops::Range;

/// After a load into a sequence's slots failed, the rows of its tokens hold whatever the
/// slots held before (another sequence's KV, or zeros), not this prompt's. Per layer, the
/// first token the engine has not yet written again, from the load's first token up to its
/// extent: a read reaching past the mark would return those stale rows as if computed. The
/// tokens before the load's first (the engine's own prefix) were never the load's.
#[derive(Debug, Clone)]
pub(crate) struct Recompute {
    /// Tokens the failed load covered.
    extent: usize,
    /// Per layer, the first token not yet written again.
    next: Vec<usize>,
}

impl Recompute {
    /// Nothing recomputed yet of tokens `start..extent` on `layers` layers.
    pub(crate) fn new(layers: usize, start: usize, extent: usize) -> Self {
        Recompute {
            extent,
            next: vec![start.min(extent); layers],
        }
    }

    /// Layer `layer`'s tokens `start..end` were written: the mark moves past them when they
    /// reach it (a write beyond the mark leaves the gap before it stale).
    pub(crate) fn wrote(&mut self, layer: u32, start: usize, end: usize) {
        if let Some(next) = self.next.get_mut(layer as usize) {
            if start <= *next && end > *next {
                *next = end;
            }
        }
    }

    /// The stale tokens a read of layer `layer`'s first `tokens` tokens would return (`None`:
    /// none; a layer past the geometry has no mark, the pool refuses it).
    pub(crate) fn stale(&self, layer: u32, tokens: usize) -> Option<Range<usize>> {
        let next = *self.next.get(layer as usize)?;
        let end = tokens.min(self.extent);
        (next < end).then_some(next..end)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::Recompute;

    #[test]
    fn a_layer_is_stale_until_its_tokens_are_written_again_from_the_start() {
        let mut r = Recompute::new(2, 0, 8);
        assert_eq!(r.stale(0, 8), Some(0..8));
        assert_eq!(r.stale(0, 20), Some(0..8), "past the load: computed anyway");
        r.wrote(0, 4, 8);
        assert_eq!(
            r.stale(0, 8),
            Some(0..8),
            "a gap before the write stays stale"
        );
        r.wrote(0, 0, 5);
        assert_eq!(r.stale(0, 8), Some(5..8));
        assert_eq!(r.stale(0, 5), None);
        r.wrote(0, 5, 12);
        assert_eq!(r.stale(0, 12), None);
        assert_eq!(r.stale(1, 1), Some(0..1), "layers are marked apart");
        assert_eq!(r.stale(2, 8), None, "no such layer: the pool refuses it");
    }

    #[test]
    fn tokens_before_the_load_were_never_stale() {
        let mut r = Recompute::new(1, 4, 12);
        assert_eq!(r.stale(0, 4), None, "the engine's own prefix");
        assert_eq!(r.stale(0, 6), Some(4..6));
        r.wrote(0, 4, 12);
        assert_eq!(r.stale(0, 12), None);
        assert_eq!(
            Recompute::new(1, 20, 12).stale(0, 30),
            None,
            "a start past the extent"
        );
    }

    proptest! {
        /// Whatever the writes, a read is never called fresh while a token it reads of the
        /// failed load's was not written again: the stale range runs from the first unwritten
        /// token (or earlier) to the read's end. Writes in token order that cover the read
        /// leave nothing stale.
        #[test]
        fn a_read_is_fresh_only_where_every_token_was_written_again(
            extent in 0usize..40,
            mut writes in proptest::collection::vec((0usize..48, 0usize..16), 0..12),
            tokens in 0usize..48,
            in_order in any::<bool>(),
        ) {
            if in_order {
                writes.sort();
            }
            let mut r = Recompute::new(1, 0, extent);
            let mut written = [false; 64];
            for &(start, n) in &writes {
                r.wrote(0, start, start + n);
                written[start..start + n].iter_mut().for_each(|w| *w = true);
            }
            let end = tokens.min(extent);
            let first_unwritten = written[..end].iter().position(|&w| !w);
            match r.stale(0, tokens) {
                None => prop_assert_eq!(first_unwritten, None),
                Some(stale) => {
                    prop_assert_eq!(stale.end, end);
                    prop_assert!(stale.start < end);
                    prop_assert!(written[..stale.start].iter().all(|&w| w));
                    if in_order {
                        prop_assert_eq!(Some(stale.start), first_unwritten);
                    }
                }
            }
        }
    }
}
