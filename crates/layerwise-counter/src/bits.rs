//! [`LayerBits`]: which layers of a batch were reported complete.

/// A bit set over layer indices, reused from batch to batch of one slot.
#[derive(Debug, Default)]
pub(crate) struct LayerBits {
    words: Vec<u64>,
}

impl LayerBits {
    /// Clears the set and makes room for `num_layers` layers (allocates only to grow).
    pub(crate) fn reset(&mut self, num_layers: u32) {
        let words = (num_layers as usize).div_ceil(64);
        self.words.clear();
        self.words.resize(words, 0);
    }

    /// Sets `layer`; false if it was already set. `layer` must be within the last reset.
    pub(crate) fn insert(&mut self, layer: u32) -> bool {
        let (word, mask) = Self::locate(layer);
        match self.words.get_mut(word) {
            Some(w) if *w & mask == 0 => {
                *w |= mask;
                true
            }
            _ => false,
        }
    }

    /// Whether `layer` is set.
    pub(crate) fn contains(&self, layer: u32) -> bool {
        let (word, mask) = Self::locate(layer);
        self.words.get(word).is_some_and(|w| w & mask != 0)
    }

    fn locate(layer: u32) -> (usize, u64) {
        ((layer / 64) as usize, 1u64 << (layer % 64))
    }
}

#[cfg(all(test, not(kvlink_loom)))]
mod tests {
    use super::LayerBits;

    #[test]
    fn insert_contains_reset() {
        let mut b = LayerBits::default();
        b.reset(130);
        assert!(!b.contains(129));
        assert!(b.insert(129));
        assert!(!b.insert(129));
        assert!(b.contains(129));
        assert!(b.insert(0));
        assert!(!b.contains(64));
        assert!(!b.insert(200), "out of range is refused, not a panic");
        b.reset(3);
        assert!(!b.contains(0));
        assert!(!b.contains(129));
    }
}
