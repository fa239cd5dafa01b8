//! A stable fingerprint of a geometry: what decides the bytes of every object a rank reads or
//! writes.

use std::fmt;

use sha2::{Digest, Sha256};

use crate::{ElementType, KvGeometry, LayerMap, Replication, RowUnit};

/// Version byte of [`KvGeometry::fingerprint`]'s encoding (after the magic).
pub const FINGERPRINT_VERSION: u8 = 1;

/// The SHA-256 of a geometry's canonical encoding ([`KvGeometry::fingerprint`]).
///
/// Stable: the same geometry gives the same fingerprint in every process, on every machine,
/// in every kvlink version. The encoding is versioned; version 1 is frozen (tests pin its
/// values), and a change of it would be a new version with new values, never new values
/// under the old one.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GeometryFingerprint(pub [u8; 32]);

impl GeometryFingerprint {
    /// The first 8 bytes as 16 lower-case hex characters (what namespaces carry).
    pub fn short(&self) -> String {
        hex(&self.0[..8])
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl fmt::Display for GeometryFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Debug for GeometryFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "GeometryFingerprint({})", self.short())
    }
}

fn element_code(e: ElementType) -> u8 {
    match e {
        ElementType::Bf16 => 0,
        ElementType::F16 => 1,
        ElementType::Fp8E4m3 => 2,
        ElementType::Bytes => 3,
        ElementType::F32 => 4,
    }
}

impl KvGeometry {
    /// The geometry's fingerprint: the SHA-256 of this encoding (integers little-endian,
    /// version [`FINGERPRINT_VERSION`] = 1):
    ///
    /// ```text
    /// "kvlink.geometry" (15 bytes), version u8 = 1,
    /// num_layers u32, page_size u32,
    /// tp_size u32 if any component is sharded, else 0,
    /// component count u32, then per component in spec order:
    ///   name length u32, name (UTF-8),
    ///   row unit u8 (0 token, 1 page), element u8 (0 bf16, 1 f16, 2 fp8 e4m3, 3 bytes, 4 f32),
    ///   row_bytes u32 (whole model, before any TP split),
    ///   replication u8 0 | u8 1 + heads u32,
    ///   layers u8 0 (every layer) | u8 1 + count u32 + each layer u32
    /// ```
    ///
    /// It covers what decides the bytes of every object this rank reads or writes, and
    /// nothing else: not the model's name (namespaces carry that beside it), not the rank
    /// (every rank of a group has the same fingerprint), and the TP size only when a sharded
    /// component makes objects depend on it (replicated objects saved at TP 8 load at TP 4).
    /// A sparse layer map that names every layer counts as "every layer".
    ///
    /// ```
    /// use kv_geometry::{KvGeometry, ModelKvSpec};
    /// let a = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
    /// let b = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 3).unwrap();
    /// assert_eq!(a.fingerprint(), b.fingerprint()); // all replicated: TP does not matter
    /// let l8 = KvGeometry::new(ModelKvSpec::llama3_70b(), 8, 0).unwrap();
    /// let l4 = KvGeometry::new(ModelKvSpec::llama3_70b(), 4, 0).unwrap();
    /// assert_ne!(l8.fingerprint(), l4.fingerprint()); // K and V are split by TP
    /// ```
    pub fn fingerprint(&self) -> GeometryFingerprint {
        let mut h = Sha256::new();
        self.write_fingerprint_encoding(&mut |b| h.update(b));
        GeometryFingerprint(h.finalize().into())
    }

    /// What every rank of one TP group must share before it shares any bytes: this
    /// geometry's [`fingerprint`](Self::fingerprint), the model's name and the TP size (not
    /// the rank). The SHA-256 of `"kvlink.group"` (12 bytes), version u8 = 1, the 32
    /// fingerprint bytes, tp_size u32, model name length u32, model name (UTF-8). Ranks
    /// compare it when they form a group.
    ///
    /// ```
    /// use kv_geometry::{KvGeometry, ModelKvSpec};
    /// let r0 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
    /// let r5 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 5).unwrap();
    /// let tp4 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 0).unwrap();
    /// assert_eq!(r0.group_fingerprint(), r5.group_fingerprint());
    /// assert_ne!(r0.group_fingerprint(), tp4.group_fingerprint());
    /// ```
    pub fn group_fingerprint(&self) -> GeometryFingerprint {
        let mut h = Sha256::new();
        h.update(b"kvlink.group");
        h.update([FINGERPRINT_VERSION]);
        h.update(self.fingerprint().0);
        h.update(self.tp_size().to_le_bytes());
        h.update((self.spec().model.len() as u32).to_le_bytes());
        h.update(self.spec().model.as_bytes());
        GeometryFingerprint(h.finalize().into())
    }

    fn write_fingerprint_encoding(&self, out: &mut dyn FnMut(&[u8])) {
        let spec = self.spec();
        let u32le = |v: u32| v.to_le_bytes();
        out(b"kvlink.geometry");
        out(&[FINGERPRINT_VERSION]);
        out(&u32le(spec.num_layers));
        out(&u32le(spec.page_size));
        let sharded = spec.components.iter().any(|c| !c.is_replicated());
        out(&u32le(if sharded { self.tp_size() } else { 0 }));
        out(&u32le(spec.components.len() as u32));
        for c in &spec.components {
            out(&u32le(c.name.len() as u32));
            out(c.name.as_bytes());
            out(&[match c.row_unit {
                RowUnit::Token => 0,
                RowUnit::Page => 1,
            }]);
            out(&[element_code(c.element)]);
            out(&u32le(c.row_bytes));
            match c.replication {
                Replication::Replicated => out(&[0]),
                Replication::Sharded { heads } => {
                    out(&[1]);
                    out(&u32le(heads));
                }
            }
            match &c.layers {
                LayerMap::Sparse(v) if v.len() as u32 != spec.num_layers => {
                    out(&[1]);
                    out(&u32le(v.len() as u32));
                    for &l in v {
                        out(&u32le(l));
                    }
                }
                // Dense, or a sparse map of every layer (validated: strictly increasing,
                // inside the model, so all of them).
                _ => out(&[0]),
            }
        }
    }
}
