//! What the saved KV bytes are: deterministic pseudo-random bytes per (page hash, component,
//! layer), cheap to regenerate for the check (also in a debug build).
//!
//! Each (page, component, layer) slice is a window of a seeded random table at an offset drawn
//! from a hash of (seed, page hash, component, layer), with that hash stamped into its first
//! and last 8 bytes: so the bytes look random, and a slice that lands in another page's slot,
//! another layer or another component, or shifted, is caught.

use kvlink::kv_geometry::PageHash;

const TABLE_BYTES: usize = 1 << 22;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The generator of one run.
pub struct Pattern {
    seed: u64,
    table: Vec<u8>,
    max_slice: usize,
}

impl Pattern {
    /// A generator for slices of at most `max_slice` bytes.
    pub fn new(seed: u64, max_slice: usize) -> Self {
        let len = TABLE_BYTES + max_slice;
        let mut table = Vec::with_capacity(len + 8);
        let mut s = splitmix(seed ^ 0x6b76_6c69_6e6b);
        while table.len() < len {
            s = splitmix(s);
            table.extend_from_slice(&s.to_le_bytes());
        }
        table.truncate(len);
        Pattern {
            seed,
            table,
            max_slice,
        }
    }

    fn key(&self, page: &PageHash, component: u16, layer: u32) -> u64 {
        let mut h = splitmix(self.seed);
        for chunk in page.0.chunks_exact(8) {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            h = splitmix(h ^ u64::from_le_bytes(w));
        }
        splitmix(h ^ (u64::from(component) << 32) ^ u64::from(layer))
    }

    /// Writes the bytes of (`page`, `component`, `layer`) into `out` (its whole length).
    pub fn fill(&self, page: &PageHash, component: u16, layer: u32, out: &mut [u8]) {
        assert!(
            out.len() <= self.max_slice,
            "slice longer than the table allows"
        );
        let k = self.key(page, component, layer);
        let off = (k % TABLE_BYTES as u64) as usize;
        out.copy_from_slice(&self.table[off..off + out.len()]);
        let stamp = k.to_le_bytes();
        let n = out.len().min(8);
        for (o, s) in out[..n].iter_mut().zip(stamp) {
            *o ^= s;
        }
        let tail = splitmix(k).to_le_bytes();
        let len = out.len();
        for (o, s) in out[len - n..].iter_mut().zip(tail) {
            *o ^= s;
        }
    }
}
