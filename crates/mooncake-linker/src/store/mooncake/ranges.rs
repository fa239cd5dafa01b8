//! How [`MooncakeStore::get_ranges`](super::MooncakeStore) hands ranges to the wheel: adjacent
//! ranges merged, and the keys split into concurrent read streams.
//!
//! Why (measured, and read in the pinned wheel's source): over TCP, one ranged call
//! (`batch_get_into_multi_buffer_ranges`) submits all its ranges as one scatter transfer, which
//! the TCP transport runs as a *sequence*: one range at a time on one connection, each a request
//! and response round trip. A call's time is therefore the sum over its ranges of (round trip +
//! bytes / one stream's rate). Fewer ranges (merging) and several calls at once (streams, each
//! on its own connection: the wheel keeps `MC_TCP_LANES_PER_PEER`, default 4, connections per
//! storage node) are the two ways to shorten it from the client's side.

use std::ops::Range;

use mooncake_sys::Range as ShimRange;
use smallvec::SmallVec;

use crate::store::ReadRange;

/// `ranges` with each run of consecutive ranges that continue each other both in the object
/// (offset) and in memory (destination) merged into one. Order is kept; nothing is reordered.
pub(crate) fn coalesce(ranges: &[ReadRange]) -> SmallVec<[ShimRange; 2]> {
    let mut out: SmallVec<[ShimRange; 2]> = SmallVec::new();
    for r in ranges {
        if let Some(last) = out.last_mut() {
            let continues_object = last.offset.checked_add(last.size) == Some(r.offset);
            let continues_memory =
                (last.dst as usize).checked_add(last.size as usize) == Some(r.dst as usize);
            if continues_object && continues_memory && r.len > 0 {
                last.size += r.len as u64;
                continue;
            }
        }
        out.push(ShimRange {
            dst: r.dst.cast(),
            size: r.len as u64,
            offset: r.offset,
        });
    }
    out
}

/// Splits keys with `bytes[i]` bytes each into contiguous parts balanced by bytes: at most
/// `streams` of them, and few enough that they average at least `min_bytes` (small reads stay
/// one call). The parts tile `0..bytes.len()` in order; none is empty; an empty input gives
/// none.
pub(crate) fn partition(bytes: &[u64], streams: usize, min_bytes: u64) -> Vec<Range<usize>> {
    if bytes.is_empty() {
        return Vec::new();
    }
    let total: u64 = bytes.iter().sum();
    let by_size = (total / min_bytes.max(1)).max(1);
    let parts = (streams.max(1) as u64).min(by_size).min(bytes.len() as u64) as usize;
    let mut out = Vec::with_capacity(parts);
    let mut start = 0;
    let mut acc: u64 = 0;
    for part in 1..parts {
        // End this part where the running total first reaches part/parts of the bytes, leaving
        // at least one key for each remaining part.
        let target = (u128::from(total) * part as u128 / parts as u128) as u64;
        let max_end = bytes.len() - (parts - part);
        let mut end = start + 1;
        acc += bytes[start];
        while end < max_end && acc < target {
            acc += bytes[end];
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out.push(start..bytes.len());
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn range(dst: usize, len: usize, offset: u64) -> ReadRange {
        ReadRange {
            dst: dst as *mut u8,
            len,
            offset,
        }
    }

    #[test]
    fn merges_only_what_continues_in_object_and_memory() {
        let merged = coalesce(&[
            range(1000, 10, 0),
            range(1010, 10, 10), // continues both
            range(1020, 10, 30), // gap in the object
            range(2000, 10, 40), // gap in memory
            range(2010, 5, 50),  // continues both
        ]);
        let got: Vec<(usize, u64, u64)> = merged
            .iter()
            .map(|r| (r.dst as usize, r.size, r.offset))
            .collect();
        assert_eq!(got, vec![(1000, 20, 0), (1020, 10, 30), (2000, 15, 40)]);
    }

    #[test]
    fn partition_respects_streams_and_minimum() {
        assert!(partition(&[], 4, 1).is_empty());
        assert_eq!(partition(&[10, 10, 10, 10], 1, 1), vec![0..4]);
        assert_eq!(partition(&[10, 10, 10, 10], 2, 1), vec![0..2, 2..4]);
        // 40 bytes with a 25-byte minimum: one part.
        assert_eq!(partition(&[10, 10, 10, 10], 4, 25), vec![0..4]);
        // More streams than keys: one key each.
        assert_eq!(partition(&[5, 5], 8, 1), vec![0..1, 1..2]);
    }

    proptest! {
        #[test]
        fn coalesced_ranges_move_the_same_bytes_to_the_same_places(
            spans in prop::collection::vec((0usize..3, 1usize..64, 0u64..3, any::<bool>()), 0..40)
        ) {
            // Build ranges that sometimes continue the previous one.
            let mut ranges = Vec::new();
            let (mut dst, mut off) = (4096usize, 0u64);
            for (mem_gap, len, obj_gap, _) in &spans {
                dst += mem_gap * 7;
                off += obj_gap * 5;
                ranges.push(range(dst, *len, off));
                dst += len;
                off += *len as u64;
            }
            let merged = coalesce(&ranges);
            prop_assert!(merged.len() <= ranges.len());
            // Every (object byte -> memory byte) of the input is in the output, and no more.
            let pairs = |it: &mut dyn Iterator<Item = (usize, usize, u64)>| {
                let mut v: Vec<(u64, usize)> = it
                    .flat_map(|(d, l, o)| (0..l).map(move |i| (o + i as u64, d + i)))
                    .collect();
                v.sort_unstable();
                v
            };
            let want = pairs(&mut ranges.iter().map(|r| (r.dst as usize, r.len, r.offset)));
            let got = pairs(&mut merged.iter().map(|r| (r.dst as usize, r.size as usize, r.offset)));
            prop_assert_eq!(want, got);
            // Neighbours that remain separate really do not continue each other.
            for w in merged.windows(2) {
                let joins = w[0].offset + w[0].size == w[1].offset
                    && w[0].dst as usize + w[0].size as usize == w[1].dst as usize;
                prop_assert!(!joins);
            }
        }

        #[test]
        fn partition_tiles_in_order_within_bounds(
            bytes in prop::collection::vec(0u64..10_000, 0..200),
            streams in 0usize..12,
            min_bytes in 0u64..50_000,
        ) {
            let parts = partition(&bytes, streams, min_bytes);
            let mut next = 0;
            for p in &parts {
                prop_assert_eq!(p.start, next);
                prop_assert!(p.end > p.start);
                next = p.end;
            }
            prop_assert_eq!(next, bytes.len());
            prop_assert!(parts.len() <= streams.max(1));
            let total: u64 = bytes.iter().sum();
            if parts.len() > 1 {
                prop_assert!(total / parts.len() as u64 >= min_bytes.max(1));
            }
        }
    }
}
