//! The header that starts every stream of a socket-collective operation: which operation
//! this is (sequence number, kind, root) and its shape (bytes, a digest of the row layout).
//! A rank checks every header it receives against its own operation, so ranks whose
//! sequences or arguments diverged get a typed error instead of each other's bytes.

use xxhash_rust::xxh3::Xxh3;

use super::engine::HEADER;
use crate::CollectiveError;

const MAGIC: u32 = u32::from_le_bytes(*b"KVOP");

/// Kinds of operation, as they travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    BroadcastRows = 1,
    AllGatherRows = 2,
    GatherBytes = 3,
    /// The completion round after a rows operation (see the socket collective's docs).
    Confirm = 4,
}

impl OpKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::BroadcastRows => "broadcast_rows",
            OpKind::AllGatherRows => "all_gather_rows",
            OpKind::GatherBytes => "all_gather_bytes",
            OpKind::Confirm => "confirm",
        }
    }
    fn from_u8(v: u8) -> Option<Self> {
        match v {
            1 => Some(OpKind::BroadcastRows),
            2 => Some(OpKind::AllGatherRows),
            3 => Some(OpKind::GatherBytes),
            4 => Some(OpKind::Confirm),
            _ => None,
        }
    }
}

/// One operation's description.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpHeader {
    pub(crate) seq: u64,
    pub(crate) kind: OpKind,
    pub(crate) root: u32,
    /// Bytes of the whole operation (every row, or one value).
    pub(crate) len: u64,
    /// Digest of the row lengths and per-rank counts (0 for values).
    pub(crate) layout: u64,
}

/// Digest of a row layout: every row's length, then the per-rank counts.
pub(crate) fn layout_digest(row_lens: impl Iterator<Item = usize>, counts: &[usize]) -> u64 {
    let mut h = Xxh3::new();
    for l in row_lens {
        h.update(&(l as u64).to_le_bytes());
    }
    h.update(&[0xff]);
    for &c in counts {
        h.update(&(c as u64).to_le_bytes());
    }
    h.digest()
}

impl OpHeader {
    pub(crate) fn encode(&self) -> [u8; HEADER] {
        let mut b = [0u8; HEADER];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..12].copy_from_slice(&self.seq.to_le_bytes());
        b[12] = self.kind as u8;
        b[13..17].copy_from_slice(&self.root.to_le_bytes());
        b[17..25].copy_from_slice(&self.len.to_le_bytes());
        b[25..33].copy_from_slice(&self.layout.to_le_bytes());
        b
    }

    fn decode(b: &[u8; HEADER]) -> (u32, u64, u8, u32, u64, u64) {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        (
            u32_at(0),
            u64_at(4),
            b[12],
            u32_at(13),
            u64_at(17),
            u64_at(25),
        )
    }

    /// Checks `peer`'s header against this (this rank's) operation, reported as `op`.
    pub(crate) fn check(
        &self,
        op: &'static str,
        me: u32,
        peer: u32,
        got: &[u8; HEADER],
    ) -> Result<(), CollectiveError> {
        let seq = self.seq;
        let mismatch = |detail: String| CollectiveError::Mismatch {
            op,
            seq,
            rank: peer,
            detail,
        };
        let (magic, pseq, kind, root, len, layout) = Self::decode(got);
        if magic != MAGIC {
            return Err(mismatch(format!(
                "a stream that is not an operation (magic {magic:#x})"
            )));
        }
        let pkind = OpKind::from_u8(kind);
        if pseq != seq || pkind != Some(self.kind) || root != self.root {
            let name = pkind.map_or("an unknown operation", OpKind::name);
            return Err(mismatch(format!(
                "{name} #{pseq} (root {root}) where rank {me} issued {} #{seq} (root {})",
                self.kind.name(),
                self.root
            )));
        }
        if len != self.len {
            return Err(CollectiveError::SizeMismatch {
                op,
                seq,
                rank: peer,
                expected: self.len as usize,
                got: len as usize,
                first: me,
            });
        }
        if layout != self.layout {
            return Err(mismatch(format!(
                "the same bytes in other rows or per-rank counts than rank {me}"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_check_every_field() {
        let h = OpHeader {
            seq: 5,
            kind: OpKind::AllGatherRows,
            root: 0,
            len: 100,
            layout: layout_digest([50usize, 50].into_iter(), &[1, 1]),
        };
        assert_eq!(h.check("op", 0, 1, &h.encode()), Ok(()));
        let other = |f: &dyn Fn(&mut OpHeader)| {
            let mut o = h;
            f(&mut o);
            h.check("op", 0, 1, &o.encode()).unwrap_err()
        };
        assert!(matches!(
            other(&|o| o.seq = 6),
            CollectiveError::Mismatch { rank: 1, .. }
        ));
        assert!(matches!(
            other(&|o| o.kind = OpKind::BroadcastRows),
            CollectiveError::Mismatch { .. }
        ));
        assert!(matches!(
            other(&|o| o.root = 2),
            CollectiveError::Mismatch { .. }
        ));
        assert!(matches!(
            other(&|o| o.len = 99),
            CollectiveError::SizeMismatch {
                expected: 100,
                got: 99,
                rank: 1,
                first: 0,
                ..
            }
        ));
        assert!(matches!(
            other(&|o| o.layout = layout_digest([40usize, 60].into_iter(), &[1, 1])),
            CollectiveError::Mismatch { .. }
        ));
        assert!(matches!(
            h.check("op", 0, 1, &[0u8; HEADER]),
            Err(CollectiveError::Mismatch { .. })
        ));
        // Same bytes, other split: the layout digest differs.
        assert_ne!(
            layout_digest([50usize, 50].into_iter(), &[2, 0]),
            layout_digest([50usize, 50].into_iter(), &[1, 1])
        );
    }
}
