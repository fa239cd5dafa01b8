//! The GLM-5.2 FP8 objects of the bench: keys as kvlink (and SGLang's layout) name them, one
//! object per (page, component) with its layers concatenated, a checkable byte pattern, and the
//! two destination layouts the readers use.

use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use kvlink::kv_geometry::{
    checksum_key, page_hashes, KeyScheme, KvGeometry, ModelKvSpec, ObjectChecksums,
};
use kvlink::mooncake_linker::store::{KvStore, MemoryRegion, ObjectPut, PutOutcome};

/// Where a reader puts layer `pos` (position inside the object) of page `page`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dest {
    /// Layer-major slots, `(pos * pages + page) * layer_bytes`, like a layer-first KV pool: the
    /// layers of one page are not adjacent, so a read of several layers needs a range each.
    Pool,
    /// The object's own layout per page, `page * object_bytes + pos * layer_bytes`: the layers
    /// of one page are adjacent, so a read of several layers is one range.
    PageMajor,
}

/// One component (`k` or `indexer`): its objects' keys and the reader's memory for them.
pub struct Component {
    /// `k` or `indexer`.
    pub name: String,
    /// Bytes of one layer of one page.
    pub layer_bytes: u64,
    /// Per model layer: the position of that layer inside the object, if it has it.
    pub position: Vec<Option<u32>>,
    /// Layers in one object.
    pub layers_in_object: u32,
    /// One key per page.
    pub keys: Vec<String>,
    /// The reader's destination: `pages * object_bytes`, in the layout of the variant.
    pub buf: Vec<u8>,
    /// The checksum companions (`{key}_kvsum`, as kvlink's save writes them), one
    /// `companion_bytes` long per page, back to back; empty when none are written.
    pub companions: Vec<u8>,
    /// Bytes of one companion.
    pub companion_bytes: usize,
}

impl Component {
    /// Bytes of one object.
    pub fn object_bytes(&self) -> u64 {
        self.layer_bytes * u64::from(self.layers_in_object)
    }

    /// Byte offset in `buf` of layer position `pos` of `page` under `dest`.
    pub fn dest_offset(&self, dest: Dest, page: usize, pos: u32) -> usize {
        let pages = self.keys.len() as u64;
        let off = match dest {
            Dest::Pool => (u64::from(pos) * pages + page as u64) * self.layer_bytes,
            Dest::PageMajor => {
                page as u64 * self.object_bytes() + u64::from(pos) * self.layer_bytes
            }
        };
        off as usize
    }
}

/// Every object of the bench.
pub struct Objects {
    /// The key prefix (a fresh one per run).
    pub namespace: String,
    /// Model layers (78).
    pub layers: u32,
    /// Pages (tokens / 64).
    pub pages: usize,
    /// `k` and `indexer`.
    pub components: Vec<Component>,
}

/// Writes `keys[i]` from `bytes[i * len..][..len]`, `chunk` keys per call; every one must be
/// written (a key already there means a namespace reused).
fn put_each(
    store: &dyn KvStore,
    keys: &[String],
    bytes: &[u8],
    len: usize,
    chunk: usize,
) -> Result<()> {
    if bytes.len() < keys.len() * len {
        bail!("{} keys of {len} B from {} B", keys.len(), bytes.len());
    }
    for (c, names) in keys.chunks(chunk).enumerate() {
        let puts: Vec<ObjectPut<'_>> = names
            .iter()
            .enumerate()
            .map(|(i, key)| ObjectPut {
                key,
                parts: [(bytes[(c * chunk + i) * len..].as_ptr(), len)]
                    .into_iter()
                    .collect(),
            })
            .collect();
        // SAFETY: every part is a distinct `len`-long slice of `bytes` (checked above to hold
        // them all), which the shared borrow keeps unwritten during the call.
        for (r, k) in unsafe { store.put(&puts) }.into_iter().zip(names) {
            match r {
                Ok(PutOutcome::Written) => {}
                other => bail!("put {k}: {other:?}"),
            }
        }
    }
    Ok(())
}

/// The pattern's 8-byte word `w` of object (component `c`, page `p`).
fn word(c: usize, p: usize, w: usize) -> u64 {
    ((p as u64) << 40 ^ (c as u64) << 36 ^ w as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn fill_object(dst: &mut [u8], c: usize, p: usize) {
    for (w, chunk) in dst.chunks_exact_mut(8).enumerate() {
        chunk.copy_from_slice(&word(c, p, w).to_le_bytes());
    }
}

impl Objects {
    /// GLM-5.2 FP8 KV objects for `tokens` cached tokens, keyed under a fresh namespace (so a
    /// master reused across runs never serves an old object); with `companions`, each object's
    /// checksum companion too, as kvlink's save writes it (else the objects are as SGLang
    /// writes them: a load checks them by length only).
    pub fn glm52(tokens: u32, companions: bool) -> Result<Self> {
        let geometry = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0)?;
        if !tokens.is_multiple_of(geometry.page_size()) {
            bail!("--tokens must be a multiple of {}", geometry.page_size());
        }
        let nonce = SystemTime::now().duration_since(UNIX_EPOCH)?.as_nanos();
        let token_ids: Vec<u32> = (0..tokens).collect();
        let hashes = page_hashes(&token_ids, geometry.page_size(), None);
        let namespace = format!("bench{nonce}");
        let scheme = KeyScheme::new(&namespace, 0, 0, 0);
        let layers = geometry.num_layers();
        let components = geometry
            .components()
            .iter()
            .enumerate()
            .map(|(c, layout)| {
                let keys: Vec<String> = hashes
                    .iter()
                    .map(|h| scheme.object_key(h, layout))
                    .collect();
                let bytes = keys.len() as u64 * layout.object_bytes();
                let companion_bytes = ObjectChecksums::encoded_len(layout.layers.len());
                let mut sums = Vec::new();
                if companions {
                    let mut object = vec![0u8; layout.object_bytes() as usize];
                    for p in 0..keys.len() {
                        fill_object(&mut object, c, p);
                        let s = ObjectChecksums::of_object(&object, layout.page_layer_bytes)?;
                        sums.extend_from_slice(&s.encode());
                    }
                }
                Ok(Component {
                    name: layout.name.clone(),
                    layer_bytes: layout.page_layer_bytes,
                    position: (0..layers).map(|l| layout.position(l)).collect(),
                    layers_in_object: layout.layers.len() as u32,
                    keys,
                    buf: vec![0u8; bytes as usize],
                    companions: sums,
                    companion_bytes,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            namespace,
            layers,
            pages: hashes.len(),
            components,
        })
    }

    /// Bytes of every object together.
    pub fn total_bytes(&self) -> u64 {
        self.components.iter().map(|c| c.buf.len() as u64).sum()
    }

    /// Every key, component by component.
    pub fn all_keys(&self) -> Vec<&str> {
        self.components
            .iter()
            .flat_map(|c| c.keys.iter().map(String::as_str))
            .collect()
    }

    /// Registers the reader's buffers with `store`.
    ///
    /// # Safety
    /// As [`KvStore::register`]: `self` (its buffers) outlives the registration, i.e. it is
    /// dropped only after `store` has unregistered them or is gone.
    pub unsafe fn register(&mut self, store: &dyn KvStore) -> Result<()> {
        for c in &mut self.components {
            let region = MemoryRegion {
                addr: c.buf.as_mut_ptr() as usize,
                len: c.buf.len(),
            };
            // SAFETY: the caller promised that the buffers outlive the registration; the
            // buffers are never reallocated while `self` lives.
            unsafe { store.register(region) }
                .with_context(|| format!("registering the {} buffer", c.name))?;
            if !c.companions.is_empty() {
                let region = MemoryRegion {
                    addr: c.companions.as_mut_ptr() as usize,
                    len: c.companions.len(),
                };
                // SAFETY: as above: never reallocated while `self` lives.
                unsafe { store.register(region) }
                    .with_context(|| format!("registering the {} companions", c.name))?;
            }
        }
        Ok(())
    }

    /// Writes every object through `store` (the buffers hold the pattern in page-major order
    /// meanwhile, and are zeroed afterwards).
    pub fn put_all(&mut self, store: &dyn KvStore) -> Result<()> {
        for (ci, c) in self.components.iter_mut().enumerate() {
            let obj = c.object_bytes() as usize;
            for (p, dst) in c.buf.chunks_exact_mut(obj).enumerate() {
                fill_object(dst, ci, p);
            }
            put_each(store, &c.keys, &c.buf, obj, 32)?;
            if !c.companions.is_empty() {
                let keys: Vec<String> = c.keys.iter().map(|k| checksum_key(k)).collect();
                put_each(store, &keys, &c.companions, c.companion_bytes, 256)?;
            }
            c.buf.fill(0);
        }
        Ok(())
    }

    /// The bytes of object (component `c`, page `p`), into `out` (one object long).
    pub fn expected_object(&self, c: usize, p: usize, out: &mut [u8]) {
        fill_object(out, c, p);
    }

    /// Zeroes the reader's buffers (before a checked read).
    pub fn clear(&mut self) {
        for c in &mut self.components {
            c.buf.fill(0);
        }
    }

    /// Checks that the buffers hold every object under `dest`.
    pub fn verify(&self, dest: Dest) -> Result<()> {
        for (ci, c) in self.components.iter().enumerate() {
            let lb = c.layer_bytes as usize;
            let mut expected = vec![0u8; c.object_bytes() as usize];
            for p in 0..self.pages {
                fill_object(&mut expected, ci, p);
                for pos in 0..c.layers_in_object {
                    let at = c.dest_offset(dest, p, pos);
                    let want = &expected[pos as usize * lb..(pos as usize + 1) * lb];
                    if &c.buf[at..at + lb] != want {
                        bail!("{} page {p} layer position {pos}: bytes differ", c.name);
                    }
                }
            }
        }
        Ok(())
    }
}
