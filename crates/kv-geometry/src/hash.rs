//! Page hashes: chained SHA-256 over token ids, SGLang's scheme.

use std::fmt;

use sha2::{Digest, Sha256};

/// The SHA-256 digest that names a page: `sha256(prev_digest || u32le(token)...)`.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PageHash(pub [u8; 32]);

impl PageHash {
    /// Hash of one page of `tokens`, chained from `prior` (the previous page's hash; `None`
    /// for the first page of a sequence).
    pub fn of_page(prior: Option<&PageHash>, tokens: &[u32]) -> PageHash {
        let mut h = Sha256::new();
        if let Some(p) = prior {
            h.update(p.0);
        }
        for t in tokens {
            h.update(t.to_le_bytes());
        }
        PageHash(h.finalize().into())
    }

    /// The hash to chain a request's first page from (`page_hashes(tokens, page_size,
    /// Some(PageHash::salt(extra)))`) when its KV depends on more than its tokens: a LoRA
    /// adapter, the images behind placeholder tokens, anything else the engine's attention
    /// inputs depend on. `extra` names it (an adapter's id, the images' content hashes, in a
    /// fixed order); requests of one prompt with different `extra` then never share a page's
    /// objects. SHA-256 of a kvlink domain tag, `extra`'s length and `extra`: it differs from
    /// every page hash of plain tokens unless those tokens' bytes spell the tag.
    ///
    /// ```
    /// use kv_geometry::{page_hashes, PageHash};
    /// let tokens: Vec<u32> = (0..128).collect();
    /// let plain = page_hashes(&tokens, 64, None);
    /// let lora_a = page_hashes(&tokens, 64, Some(PageHash::salt(b"lora:adapter-a")));
    /// let lora_b = page_hashes(&tokens, 64, Some(PageHash::salt(b"lora:adapter-b")));
    /// assert!(plain.iter().all(|p| !lora_a.contains(p)));
    /// assert!(lora_a.iter().all(|p| !lora_b.contains(p)));
    /// ```
    pub fn salt(extra: &[u8]) -> PageHash {
        let mut h = Sha256::new();
        h.update(b"kvlink page salt v1\0");
        h.update((extra.len() as u64).to_le_bytes());
        h.update(extra);
        PageHash(h.finalize().into())
    }

    /// Lower-case hex, 64 characters.
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push(HEX[usize::from(b >> 4)] as char);
            s.push(HEX[usize::from(b & 15)] as char);
        }
        s
    }

    /// Parses 64 hex digits (either case); anything else is `None`.
    ///
    /// ```
    /// use kv_geometry::PageHash;
    /// let h = PageHash::from_hex(&"ab".repeat(32)).unwrap();
    /// assert_eq!(h.to_hex(), "ab".repeat(32));
    /// // `u8::from_str_radix` would take "+f" as 15: not a hex digit pair.
    /// assert!(PageHash::from_hex(&"+f".repeat(32)).is_none());
    /// ```
    pub fn from_hex(hex: &str) -> Option<PageHash> {
        if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, chunk) in hex.as_bytes().chunks(2).enumerate() {
            let s = std::str::from_utf8(chunk).ok()?;
            out[i] = u8::from_str_radix(s, 16).ok()?;
        }
        Some(PageHash(out))
    }
}

impl fmt::Debug for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PageHash({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for PageHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// Hashes of the whole pages of `tokens` (a partial last page is not keyed), chained from
/// `prior`.
///
/// ```
/// use kv_geometry::page_hashes;
/// let tokens: Vec<u32> = (0..130).collect();
/// let hashes = page_hashes(&tokens, 64, None);
/// assert_eq!(hashes.len(), 2); // the last 2 tokens make no whole page
/// ```
pub fn page_hashes(tokens: &[u32], page_size: u32, prior: Option<PageHash>) -> Vec<PageHash> {
    if page_size == 0 {
        return Vec::new();
    }
    let mut prev = prior;
    tokens
        .chunks_exact(page_size as usize)
        .map(|page| {
            let h = PageHash::of_page(prev.as_ref(), page);
            prev = Some(h);
            h
        })
        .collect()
}
