//! Checksums of objects, per layer: what kvlink writes beside each object it saves, and the
//! check a load makes of each layer's bytes before it reports them loaded.
//!
//! An object (one page of one component, its layers concatenated) keeps SGLang's layout and
//! key. Its checksums live in a small **companion object** under
//! [`checksum_key`]`(object key)` (`{object key}_kvsum`), written in the same store call.
//! Component names cannot contain `_`, so no object key of kvlink or SGLang ends that way.
//!
//! The companion object (version 1, integers little-endian):
//!
//! ```text
//! "KVCS" (4 bytes), version u8 = 1, algorithm u8 = 1 (XXH3-64, seed 0), reserved u16 = 0,
//! layer_bytes u64 (bytes of one layer's range), layers u32 (ranges in the object),
//! layers × checksum u64 (XXH3-64 of each layer's range, in object order),
//! trailer u64 (XXH3-64 of everything before it)
//! ```
//!
//! Objects without a companion (written by SGLang, or whose companion was lost) are still
//! loadable: their check is only the byte count ([`Verified::LengthOnly`]), which is weaker.
//!
//! What every later version keeps, so that a reader of this version can tell a newer writer's
//! companion from a bad one: the magic first, the version and algorithm bytes after it, and
//! the XXH3-64 trailer of everything before it last. A companion that keeps these but carries
//! another version or algorithm is [`ChecksumError::Unsupported`] (its object is not bad: a
//! reader checks it as it checks an object with no companion), whatever its length.

use thiserror::Error;
use xxhash_rust::xxh3::xxh3_64;

use crate::ComponentLayout;

/// What a companion object's key ends with: `{object key}_kvsum`.
pub const CHECKSUM_KEY_SUFFIX: &str = "_kvsum";
const MAGIC: &[u8; 4] = b"KVCS";
const VERSION: u8 = 1;
const XXH3_64: u8 = 1;
const HEADER: usize = 4 + 1 + 1 + 2 + 8 + 4;

/// The key of the companion object that holds `object_key`'s checksums.
///
/// ```
/// assert_eq!(kv_geometry::checksum_key("ns_ab12_cp0_pp0_k"), "ns_ab12_cp0_pp0_k_kvsum");
/// ```
pub fn checksum_key(object_key: &str) -> String {
    let mut k = String::with_capacity(object_key.len() + CHECKSUM_KEY_SUFFIX.len());
    k.push_str(object_key);
    k.push_str(CHECKSUM_KEY_SUFFIX);
    k
}

/// The checksum of one layer's range of an object (XXH3-64, seed 0).
pub fn layer_checksum(bytes: &[u8]) -> u64 {
    xxh3_64(bytes)
}

/// Why a companion object or a layer's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ChecksumError {
    /// The companion object is not one (truncated, another magic, version 0, a bad trailer,
    /// a header of this version that does not add up). A whole one of another version or
    /// algorithm is [`Unsupported`](Self::Unsupported) instead.
    #[error("checksum object: {0}")]
    Malformed(&'static str),
    /// The companion describes an object of another layout than the geometry's.
    #[error("checksum object for {layers} ranges of {layer_bytes} B; the geometry has {want_layers} of {want_bytes} B")]
    Layout {
        /// Ranges it describes.
        layers: u32,
        /// Bytes per range it describes.
        layer_bytes: u64,
        /// Ranges the geometry expects.
        want_layers: u32,
        /// Bytes per range the geometry expects.
        want_bytes: u64,
    },
    /// A layer's bytes are not as long as the layout says.
    #[error("layer {layer}: {got} bytes, {expected} expected")]
    Length {
        /// The layer: a model layer from [`ObjectChecksums::verify_layer`]; the range's
        /// position in the object (0 for a whole object of the wrong length) from
        /// [`ObjectChecksums::of_layers`] and [`ObjectChecksums::of_object`].
        layer: u32,
        /// Bytes expected.
        expected: u64,
        /// Bytes given.
        got: u64,
    },
    /// The component does not carry this layer.
    #[error("the component has no layer {0}")]
    NoLayer(u32),
    /// The companion is a whole kvlink checksum object (magic and trailer good) of a version
    /// or algorithm this build does not read: a newer writer's. Not a sign that its object
    /// is bad.
    #[error(
        "checksum object of version {version}, algorithm {algorithm}: this build reads \
         version 1, algorithm 1 (XXH3-64)"
    )]
    Unsupported {
        /// The version byte it carries.
        version: u8,
        /// The algorithm byte it carries.
        algorithm: u8,
    },
    /// A layer's bytes do not match the checksum written with the object.
    #[error("layer {layer}: checksum {actual:#018x}, {expected:#018x} written")]
    Mismatch {
        /// Model layer.
        layer: u32,
        /// Written with the object.
        expected: u64,
        /// Of the bytes read.
        actual: u64,
    },
}

/// How a layer's bytes were checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verified {
    /// Length and checksum (the object was written by kvlink with its companion).
    Checksum,
    /// Length only (no companion: an object SGLang wrote, or one whose companion is lost).
    LengthOnly,
}

/// The per-layer checksums of one object, as its companion object holds them.
///
/// ```
/// use kv_geometry::{ObjectChecksums, Verified, KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
/// let ix = g.component_by_name("indexer").unwrap();
/// let object: Vec<u8> = (0..ix.object_bytes()).map(|i| i as u8).collect();
/// let sums = ObjectChecksums::of_object(&object, ix.page_layer_bytes).unwrap();
/// let stored = sums.encode();                       // the companion object's bytes
/// let back = ObjectChecksums::decode(&stored).unwrap();
/// assert_eq!(ObjectChecksums::decode_for(&stored, ix), Ok(back.clone()));
/// let k = g.component_by_name("k").unwrap();
/// assert!(ObjectChecksums::decode_for(&stored, k).is_err(), "another component's layout");
/// let layer3 = &object[ix.layer_range(3).unwrap().start as usize..][..8448];
/// assert_eq!(ObjectChecksums::verify_layer(Some(&back), ix, 3, layer3), Ok(Verified::Checksum));
/// let mut bad = layer3.to_vec();
/// bad[100] ^= 1;
/// assert!(ObjectChecksums::verify_layer(Some(&back), ix, 3, &bad).is_err());
/// assert_eq!(ObjectChecksums::verify_layer(None, ix, 3, &bad), Ok(Verified::LengthOnly));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectChecksums {
    /// Bytes of each layer's range.
    pub layer_bytes: u64,
    /// One checksum per layer range, in object order.
    pub sums: Vec<u64>,
}

impl ObjectChecksums {
    /// The checksums of an object given as its layer ranges, in object order (each
    /// `layer_bytes` long, else an error).
    pub fn of_layers<'a>(
        layer_bytes: u64,
        layers: impl IntoIterator<Item = &'a [u8]>,
    ) -> Result<Self, ChecksumError> {
        let mut sums = Vec::new();
        for (pos, l) in layers.into_iter().enumerate() {
            if l.len() as u64 != layer_bytes {
                return Err(ChecksumError::Length {
                    layer: pos as u32,
                    expected: layer_bytes,
                    got: l.len() as u64,
                });
            }
            sums.push(layer_checksum(l));
        }
        Ok(ObjectChecksums { layer_bytes, sums })
    }

    /// The checksums of a whole object whose layer ranges are `layer_bytes` long each.
    pub fn of_object(object: &[u8], layer_bytes: u64) -> Result<Self, ChecksumError> {
        let n = usize::try_from(layer_bytes)
            .ok()
            .filter(|&n| n > 0 && object.len().is_multiple_of(n))
            .ok_or(ChecksumError::Length {
                layer: 0,
                expected: layer_bytes,
                got: object.len() as u64,
            })?;
        Self::of_layers(layer_bytes, object.chunks(n))
    }

    /// Bytes of the companion object of an object of `layers` layer ranges: what a load reads
    /// without asking the store for the size.
    ///
    /// ```
    /// use kv_geometry::ObjectChecksums;
    /// let sums = ObjectChecksums { layer_bytes: 8, sums: vec![1, 2, 3] };
    /// assert_eq!(sums.encode().len(), ObjectChecksums::encoded_len(3));
    /// ```
    pub fn encoded_len(layers: usize) -> usize {
        HEADER + 8 * layers + 8
    }

    /// The companion object's bytes (see the module's format).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER + 8 * self.sums.len() + 8);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&[VERSION, XXH3_64, 0, 0]);
        out.extend_from_slice(&self.layer_bytes.to_le_bytes());
        out.extend_from_slice(&(self.sums.len() as u32).to_le_bytes());
        for s in &self.sums {
            out.extend_from_slice(&s.to_le_bytes());
        }
        let trailer = xxh3_64(&out);
        out.extend_from_slice(&trailer.to_le_bytes());
        out
    }

    /// Parses a companion object: a newer writer's whole one is
    /// [`ChecksumError::Unsupported`], anything else that is not one of this version
    /// [`ChecksumError::Malformed`]; never a panic.
    ///
    /// ```
    /// use kv_geometry::{ChecksumError, ObjectChecksums};
    /// let mut bytes = ObjectChecksums { layer_bytes: 8, sums: vec![1, 2] }.encode();
    /// bytes[4] = 2; // version 2, the trailer made again: a newer writer's companion
    /// let n = bytes.len() - 8;
    /// let trailer = xxhash_rust::xxh3::xxh3_64(&bytes[..n]);
    /// bytes[n..].copy_from_slice(&trailer.to_le_bytes());
    /// assert_eq!(
    ///     ObjectChecksums::decode(&bytes),
    ///     Err(ChecksumError::Unsupported { version: 2, algorithm: 1 })
    /// );
    /// bytes[9] ^= 1; // any changed byte: the trailer no longer matches
    /// assert!(matches!(ObjectChecksums::decode(&bytes), Err(ChecksumError::Malformed(_))));
    /// ```
    pub fn decode(bytes: &[u8]) -> Result<Self, ChecksumError> {
        let bad = ChecksumError::Malformed;
        let (body, trailer) = bytes
            .len()
            .checked_sub(8)
            .map(|n| bytes.split_at(n))
            .ok_or(bad("shorter than a header"))?;
        // The magic, version and algorithm first (what every version keeps), the rest of
        // this version's header after the trailer and those are known good.
        if body.len() < 6 {
            return Err(bad("shorter than a header"));
        }
        let u64_at = |b: &[u8], at: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[at..at + 8]);
            u64::from_le_bytes(w)
        };
        if xxh3_64(body) != u64_at(trailer, 0) {
            return Err(bad("trailer does not match"));
        }
        if &body[..4] != MAGIC {
            return Err(bad("not a kvlink checksum object"));
        }
        if body[4] == 0 {
            return Err(bad("version 0"));
        }
        if body[4] != VERSION || body[5] != XXH3_64 {
            return Err(ChecksumError::Unsupported {
                version: body[4],
                algorithm: body[5],
            });
        }
        if body.len() < HEADER {
            return Err(bad("shorter than a header"));
        }
        if body[6..8] != [0, 0] {
            return Err(bad("reserved bytes are not zero"));
        }
        let layer_bytes = u64_at(body, 8);
        let mut count = [0u8; 4];
        count.copy_from_slice(&body[16..20]);
        let count = u32::from_le_bytes(count) as usize;
        let sums = &body[HEADER..];
        if sums.len() != count.saturating_mul(8) {
            return Err(bad("length does not match the layer count"));
        }
        Ok(ObjectChecksums {
            layer_bytes,
            sums: (0..count).map(|i| u64_at(sums, i * 8)).collect(),
        })
    }

    /// [`decode`](Self::decode), then [`check_layout`](Self::check_layout) against `layout`:
    /// the companion of an object of `layout`, or why it is not one.
    pub fn decode_for(bytes: &[u8], layout: &ComponentLayout) -> Result<Self, ChecksumError> {
        let sums = Self::decode(bytes)?;
        sums.check_layout(layout)?;
        Ok(sums)
    }

    /// Whether these checksums describe objects of `layout` (same number of layer ranges of
    /// the same length).
    pub fn check_layout(&self, layout: &ComponentLayout) -> Result<(), ChecksumError> {
        if self.layer_bytes != layout.page_layer_bytes || self.sums.len() != layout.layers.len() {
            return Err(ChecksumError::Layout {
                layers: self.sums.len() as u32,
                layer_bytes: self.layer_bytes,
                want_layers: layout.layers.len() as u32,
                want_bytes: layout.page_layer_bytes,
            });
        }
        Ok(())
    }

    /// The check a load makes of model layer `layer`'s bytes of one object of `layout`
    /// before it reports them loaded: the length always, the checksum when the object has
    /// a companion (`sums`). Pure: no I/O, no allocation.
    pub fn verify_layer(
        sums: Option<&ObjectChecksums>,
        layout: &ComponentLayout,
        layer: u32,
        bytes: &[u8],
    ) -> Result<Verified, ChecksumError> {
        Self::verify_layer_landed(sums, layout, layer, bytes, None)
    }

    /// [`verify_layer`](Self::verify_layer), given `landed`: the [`layer_checksum`] of `bytes`
    /// taken while they were written there (a store that copies a range out of its own
    /// staging hashes it in the same pass), so that they need not be read again. `None`:
    /// `bytes` are hashed here.
    ///
    /// ```
    /// use kv_geometry::{layer_checksum, ObjectChecksums, Verified, KvGeometry, ModelKvSpec};
    /// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
    /// let ix = g.component_by_name("indexer").unwrap();
    /// let object: Vec<u8> = (0..ix.object_bytes()).map(|i| (i * 3) as u8).collect();
    /// let sums = ObjectChecksums::of_object(&object, ix.page_layer_bytes).unwrap();
    /// let layer3 = &object[ix.layer_range(3).unwrap().start as usize..][..8448];
    /// let landed = Some(layer_checksum(layer3));
    /// assert_eq!(
    ///     ObjectChecksums::verify_layer_landed(Some(&sums), ix, 3, layer3, landed),
    ///     Ok(Verified::Checksum)
    /// );
    /// // A checksum taken of other bytes than the layer's is a mismatch.
    /// assert!(ObjectChecksums::verify_layer_landed(Some(&sums), ix, 3, layer3, Some(0)).is_err());
    /// ```
    pub fn verify_layer_landed(
        sums: Option<&ObjectChecksums>,
        layout: &ComponentLayout,
        layer: u32,
        bytes: &[u8],
        landed: Option<u64>,
    ) -> Result<Verified, ChecksumError> {
        let pos = layout
            .position(layer)
            .ok_or(ChecksumError::NoLayer(layer))?;
        if bytes.len() as u64 != layout.page_layer_bytes {
            return Err(ChecksumError::Length {
                layer,
                expected: layout.page_layer_bytes,
                got: bytes.len() as u64,
            });
        }
        let Some(sums) = sums else {
            return Ok(Verified::LengthOnly);
        };
        sums.check_layout(layout)?;
        // `layers` is public: a changed copy of a layout may no longer have this position.
        let expected = *sums
            .sums
            .get(pos as usize)
            .ok_or(ChecksumError::NoLayer(layer))?;
        let actual = landed.unwrap_or_else(|| layer_checksum(bytes));
        if actual != expected {
            return Err(ChecksumError::Mismatch {
                layer,
                expected,
                actual,
            });
        }
        Ok(Verified::Checksum)
    }
}
