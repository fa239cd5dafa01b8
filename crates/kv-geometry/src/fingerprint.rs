//! Geometry fingerprints: one digest that every TP rank of a group computes from its own
//! geometry and compares with the others' before sharing any bytes (a rank built with another
//! model, page size, component list or TP size would otherwise scatter rows into the wrong
//! places).
//!
//! The digest is SHA-256 over a canonical byte encoding (fixed-width little-endian integers,
//! length-prefixed strings, a tag per enum variant), so it is the same in every process, on
//! every host, in every build: it never depends on Rust's `Hash` or on memory layout.

use sha2::{Digest, Sha256};

use crate::{ComponentSpec, ElementType, KvGeometry, LayerMap, ModelKvSpec, Replication, RowUnit};

/// Version of the canonical encoding below; part of the digest, bumped if the encoding changes.
const ENCODING: u32 = 1;

/// A geometry fingerprint: 32 bytes of SHA-256.
///
/// ```
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let r0 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
/// let r5 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 5).unwrap();
/// let tp4 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 0).unwrap();
/// // Every rank of one group agrees; another TP size does not.
/// assert_eq!(r0.group_fingerprint(), r5.group_fingerprint());
/// assert_ne!(r0.group_fingerprint(), tp4.group_fingerprint());
/// assert_eq!(r0.group_fingerprint().to_hex().len(), 64);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    /// Lower-case hex, for logs and errors.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl std::fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The first 8 bytes are plenty to tell two geometries apart in a message.
        let hex = self.to_hex();
        f.write_str(&hex[..16])
    }
}

/// Canonical encoder: fixed-width little-endian integers, length-prefixed strings.
struct Canon(Sha256);

impl Canon {
    fn u8(&mut self, v: u8) {
        self.0.update([v]);
    }
    fn u32(&mut self, v: u32) {
        self.0.update(v.to_le_bytes());
    }
    fn str(&mut self, s: &str) {
        self.u32(s.len() as u32);
        self.0.update(s.as_bytes());
    }
    fn component(&mut self, c: &ComponentSpec) {
        self.str(&c.name);
        self.u8(match c.row_unit {
            RowUnit::Token => 0,
            RowUnit::Page => 1,
        });
        self.u8(match c.element {
            ElementType::Bf16 => 0,
            ElementType::F16 => 1,
            ElementType::Fp8E4m3 => 2,
            ElementType::Bytes => 3,
        });
        self.u32(c.row_bytes);
        match &c.layers {
            LayerMap::Dense => self.u8(0),
            LayerMap::Sparse(v) => {
                self.u8(1);
                self.u32(v.len() as u32);
                v.iter().for_each(|&l| self.u32(l));
            }
        }
        match c.replication {
            Replication::Replicated => self.u8(0),
            Replication::Sharded { heads } => {
                self.u8(1);
                self.u32(heads);
            }
        }
    }
    fn spec(&mut self, s: &ModelKvSpec) {
        self.str(&s.model);
        self.u32(s.num_layers);
        self.u32(s.page_size);
        self.u32(s.components.len() as u32);
        s.components.iter().for_each(|c| self.component(c));
    }
}

impl ModelKvSpec {
    /// The spec's fingerprint: model name, layers, page size and every component (name, row
    /// unit, element type, row bytes, layer map, replication), canonically encoded.
    pub fn fingerprint(&self) -> Fingerprint {
        let mut c = Canon(Sha256::new());
        c.str("kvlink-spec");
        c.u32(ENCODING);
        c.spec(self);
        Fingerprint(c.0.finalize().into())
    }
}

impl KvGeometry {
    /// What every rank of one TP group must share: the spec and the TP size (not the rank).
    /// Ranks compare it when they form a group.
    pub fn group_fingerprint(&self) -> Fingerprint {
        let mut c = Canon(Sha256::new());
        c.str("kvlink-group-geometry");
        c.u32(ENCODING);
        c.spec(&self.spec);
        c.u32(self.tp_size);
        Fingerprint(c.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_changes_the_fingerprint() {
        let base = ModelKvSpec::glm52_dsa_fp8();
        let f = base.fingerprint();
        let mut other = base.clone();
        other.page_size = 32;
        assert_ne!(other.fingerprint(), f);
        let mut other = base.clone();
        other.components[0].row_bytes += 1;
        assert_ne!(other.fingerprint(), f);
        let other = base
            .clone()
            .with_component_layers("indexer", LayerMap::Sparse(vec![0, 1]))
            .unwrap();
        assert_ne!(other.fingerprint(), f);
        let mut other = base.clone();
        other.model.push('x');
        assert_ne!(other.fingerprint(), f);
        assert_eq!(base.clone().fingerprint(), f);
    }

    #[test]
    fn known_value_is_stable_across_builds() {
        // A change here means ranks of two kvlink builds would refuse each other: bump
        // ENCODING deliberately, never by accident.
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 3).unwrap();
        let hex = g.group_fingerprint().to_hex();
        assert_eq!(hex.len(), 64);
        assert_eq!(hex, KNOWN_GLM52_TP8);
    }

    /// Computed outside Rust (Python's hashlib over the same canonical encoding, written out
    /// field by field), so the test checks the encoding, not a copy of this code's output.
    const KNOWN_GLM52_TP8: &str =
        "1ed1d9ce6792b7c8e865c399d66b2df7d15b36c4d2d4d3bd3423ac355b558bba";
}
