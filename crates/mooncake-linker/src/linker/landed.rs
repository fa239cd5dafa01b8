//! The checksums a store took of one layer's rows as they landed
//! ([`KvStore::get_ranges_checksummed`](crate::store::KvStore::get_ranges_checksummed)):
//! handed from the reader to the layer's check with the layer, so that a row the store copied
//! itself (a read staged through its own memory) is checked without reading its bytes again.
//! A row without one is hashed by the check, as before.

/// One layer's landed checksums, per component list (own, shared: [`BatchLayers`] order), per
/// component, per plan page.
///
/// [`BatchLayers`]: super::batch::BatchLayers
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct LandedSums {
    pages: usize,
    own: Vec<Option<u64>>,
    shared: Vec<Option<u64>>,
}

impl LandedSums {
    /// None yet, for `own` and `shared` components of `pages` plan pages each.
    pub(crate) fn new(pages: usize, own: usize, shared: usize) -> Self {
        LandedSums {
            pages,
            own: vec![None; own.saturating_mul(pages)],
            shared: vec![None; shared.saturating_mul(pages)],
        }
    }

    fn index(&self, comp: usize, page: usize) -> Option<usize> {
        (page < self.pages).then(|| comp.checked_mul(self.pages)?.checked_add(page))?
    }

    /// Records the checksum of component `comp`'s row at plan page `page` (ignored outside
    /// the layer's components and pages).
    pub(crate) fn set(&mut self, shared: bool, comp: usize, page: usize, sum: u64) {
        let Some(i) = self.index(comp, page) else {
            return;
        };
        let list = if shared {
            &mut self.shared
        } else {
            &mut self.own
        };
        if let Some(slot) = list.get_mut(i) {
            *slot = Some(sum);
        }
    }

    /// The checksum of component `comp`'s row at plan page `page`, if the store took one.
    pub(crate) fn get(&self, shared: bool, comp: usize, page: usize) -> Option<u64> {
        let list = if shared { &self.shared } else { &self.own };
        *list.get(self.index(comp, page)?)?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_keeps_its_own_checksum_and_nothing_outside_is_kept() {
        let mut l = LandedSums::new(3, 2, 1);
        l.set(false, 1, 2, 7);
        l.set(true, 0, 0, 9);
        // Outside the layer's components or pages: ignored, not another row's slot.
        l.set(false, 2, 0, 1);
        l.set(false, 0, 3, 1);
        l.set(true, 1, 0, 1);
        l.set(false, usize::MAX, usize::MAX, 1);
        assert_eq!(l.get(false, 1, 2), Some(7));
        assert_eq!(l.get(true, 0, 0), Some(9));
        let set = [(false, 1, 2), (true, 0, 0)];
        for shared in [false, true] {
            for comp in 0..3 {
                for page in 0..4 {
                    if !set.contains(&(shared, comp, page)) {
                        assert_eq!(l.get(shared, comp, page), None, "{shared} {comp} {page}");
                    }
                }
            }
        }
    }
}
