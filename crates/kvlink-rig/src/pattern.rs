//! Deterministic bytes: the row pattern every check and benchmark writes and compares, and a
//! small PRNG for scattered slots.

/// A deterministic row of `len` bytes for (tag, layer, page): 64-bit words mixing the three
/// with the word index; any misplaced row or byte shows.
pub fn fill_row(out: &mut [u8], tag: u64, layer: u32, page: u64) {
    let seed = (tag << 56) ^ (u64::from(layer) << 40) ^ page.wrapping_mul(0x9E37_79B9);
    let mut chunks = out.chunks_exact_mut(8);
    let mut k = 0u64;
    for c in &mut chunks {
        let w = seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(17);
        c.copy_from_slice(&w.to_le_bytes());
        k += 1;
    }
    let rest = chunks.into_remainder();
    let w = (seed ^ k.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes();
    let n = rest.len();
    rest.copy_from_slice(&w[..n]);
}

/// A small deterministic PRNG (xorshift) for slot permutations.
pub struct Rng(pub u64);

impl Rng {
    /// The next pseudo-random word.
    pub fn next_word(&mut self) -> u64 {
        let mut x = self.0.max(1);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// `n` distinct slots out of `0..pages`, scattered; an error when `pages` has fewer
    /// than `n` (a check over fewer pages than asked for would pass for the wrong reason).
    pub fn scattered_slots(&mut self, n: usize, pages: u32) -> Result<Vec<u32>, String> {
        if n > pages as usize {
            return Err(format!(
                "{n} distinct slots asked of a pool of {pages} pages"
            ));
        }
        let mut all: Vec<u32> = (0..pages).collect();
        for i in (1..all.len()).rev() {
            let j = (self.next_word() % (i as u64 + 1)) as usize;
            all.swap(i, j);
        }
        all.truncate(n);
        Ok(all)
    }
}
