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
//!
//! Ranges adjacent in the object but not in memory (several layers of one page, landing in a
//! layer-major pool) can still be one range: read into a scratch area of the store, then
//! copied out ([`shape`]). A copy of 41,984 B costs a few µs against a round trip of tens.

use std::ops::Range;

use mooncake_sys::Range as ShimRange;
use smallvec::SmallVec;

use crate::store::ReadRange;

/// One range after [`coalesce`]: the range, and which of the input ranges it joins.
#[derive(Debug, Clone)]
pub(crate) struct Merged {
    pub(crate) range: ShimRange,
    /// Indices of the input ranges it covers, in order.
    pub(crate) inputs: Range<usize>,
}

/// `ranges` with each run of consecutive ranges that continue each other both in the object
/// (offset) and in memory (destination) merged into one. Order is kept; nothing is reordered.
pub(crate) fn coalesce(ranges: &[ReadRange]) -> SmallVec<[Merged; 2]> {
    let mut out: SmallVec<[Merged; 2]> = SmallVec::new();
    for (i, r) in ranges.iter().enumerate() {
        if let Some(Merged {
            range: last,
            inputs,
        }) = out.last_mut()
        {
            let continues_object = last.offset.checked_add(last.size) == Some(r.offset);
            let continues_memory =
                (last.dst as usize).checked_add(last.size as usize) == Some(r.dst as usize);
            if continues_object && continues_memory && r.len > 0 {
                last.size = last.size.saturating_add(r.len as u64);
                inputs.end = i + 1;
                continue;
            }
        }
        out.push(Merged {
            range: ShimRange {
                dst: r.dst.cast(),
                size: r.len as u64,
                offset: r.offset,
            },
            inputs: i..i + 1,
        });
    }
    out
}

/// Where one range the wheel reads lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Target {
    /// Straight into caller memory.
    Caller(*mut u8),
    /// Into the key's scratch area, at this byte offset.
    Scratch(u64),
}

/// One range the wheel reads: `size` bytes at `offset` in the object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    pub(crate) target: Target,
    pub(crate) size: u64,
    pub(crate) offset: u64,
}

/// A copy out of the key's scratch area after the read: `len` bytes at `from` to `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct CopyOut {
    pub(crate) from: u64,
    pub(crate) to: *mut u8,
    pub(crate) len: usize,
}

/// An input range read through scratch: range `index` of the key's ranges lies at `from`
/// (`len` bytes) in the key's scratch share, inside copy `copy` of [`Shaped::copies`], which
/// moves it to the range's destination: where its checksum is taken, in that copy's pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StagedRange {
    pub(crate) index: usize,
    pub(crate) copy: usize,
    pub(crate) from: u64,
    pub(crate) len: usize,
}

impl StagedRange {
    /// Where its bytes land: `copy`'s destination plus this offset inside `copy` (`None` when
    /// it does not start inside `copy`).
    pub(crate) fn offset_in(&self, copy: &CopyOut) -> Option<usize> {
        usize::try_from(self.from.checked_sub(copy.from)?).ok()
    }
}

/// How one key's ranges are read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Shaped {
    pub(crate) spans: SmallVec<[Span; 2]>,
    pub(crate) copies: SmallVec<[CopyOut; 4]>,
    /// The input ranges that go through scratch, in scratch order.
    pub(crate) staged: SmallVec<[StagedRange; 4]>,
    /// Scratch bytes the spans use (0 when everything lands in caller memory).
    pub(crate) scratch: u64,
}

/// The spans for `ranges` of one key: ranges adjacent in object and memory merged (as
/// [`coalesce`]); then, with `stage`, each run of merged ranges that continue each other in
/// the object (but not in memory) read as one span into scratch, with a copy out per range
/// (and the input ranges it carries listed in [`Shaped::staged`]).
pub(crate) fn shape(ranges: &[ReadRange], stage: bool) -> Shaped {
    let merged = coalesce(ranges);
    let mut out = Shaped::default();
    let mut i = 0;
    while i < merged.len() {
        // The run of merged ranges starting at i that continue each other in the object.
        let mut j = i + 1;
        while stage && j < merged.len() && {
            let prev = &merged[j - 1].range;
            prev.offset.checked_add(prev.size) == Some(merged[j].range.offset)
        } {
            j += 1;
        }
        if j - i == 1 {
            let m = &merged[i].range;
            // An empty range reads nothing: no zero-byte slice goes to the wheel.
            if m.size > 0 {
                out.spans.push(Span {
                    target: Target::Caller(m.dst.cast()),
                    size: m.size,
                    offset: m.offset,
                });
            }
        } else {
            let start = out.scratch;
            let first = merged[i].range.offset;
            for Merged { range: m, inputs } in &merged[i..j] {
                let copy = out.copies.len();
                out.copies.push(CopyOut {
                    from: start.saturating_add(m.offset - first),
                    to: m.dst.cast(),
                    len: m.size as usize,
                });
                for k in inputs.clone() {
                    out.staged.push(StagedRange {
                        index: k,
                        copy,
                        from: start.saturating_add(ranges[k].offset - first),
                        len: ranges[k].len,
                    });
                }
            }
            let last = &merged[j - 1].range;
            // Saturating: a range ending past u64 is refused before any read (`get_ranges`'
            // vetting); here it only must not overflow. Its span then comes out short, and
            // `copy_key`'s bounds checks would fail the key.
            let size = last.offset.saturating_add(last.size) - first;
            // A run of empty ranges only reads nothing (its copies move nothing).
            if size > 0 {
                out.spans.push(Span {
                    target: Target::Scratch(start),
                    size,
                    offset: first,
                });
            }
            out.scratch = out.scratch.saturating_add(size);
        }
        i = j;
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
    let total: u64 = bytes.iter().fold(0, |a, &b| a.saturating_add(b));
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
        acc = acc.saturating_add(bytes[start]);
        while end < max_end && acc < target {
            acc = acc.saturating_add(bytes[end]);
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out.push(start..bytes.len());
    out
}

/// Groups keys needing `scratch[i]` bytes of staging each into sequential calls of at most
/// `limit` bytes: contiguous runs in order, each as long as it fits, a key alone where it does
/// not fit by itself. Per call, its keys and the scratch it needs. The calls tile
/// `0..scratch.len()` in order; none is empty.
pub(crate) fn scratch_calls(scratch: &[u64], limit: u64) -> Vec<(Range<usize>, u64)> {
    let mut calls = Vec::new();
    let mut start = 0;
    while start < scratch.len() {
        let mut end = start + 1;
        let mut need = scratch[start];
        while end < scratch.len() && need.saturating_add(scratch[end]) <= limit {
            need += scratch[end];
            end += 1;
        }
        calls.push((start..end, need));
        start = end;
    }
    calls
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

    /// Empty ranges put no zero-byte slice on the wire, alone or in a staged run, and the
    /// ranges around them still read what they did.
    #[test]
    fn empty_ranges_read_nothing() {
        for stage in [false, true] {
            let empties = [range(1000, 0, 0), range(1000, 0, 0), range(5000, 0, 64)];
            assert!(shape(&empties, stage).spans.is_empty(), "stage {stage}");
            let mixed = [range(1000, 8, 0), range(3000, 0, 8), range(4000, 8, 8)];
            let shaped = shape(&mixed, stage);
            assert!(
                shaped.spans.iter().all(|s| s.size > 0),
                "{:?}",
                shaped.spans
            );
            let bytes: u64 = shaped.spans.iter().map(|s| s.size).sum();
            assert_eq!(bytes, 16, "stage {stage}");
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
            .map(|m| (m.range.dst as usize, m.range.size, m.range.offset))
            .collect();
        assert_eq!(got, vec![(1000, 20, 0), (1020, 10, 30), (2000, 15, 40)]);
        let inputs: Vec<_> = merged.iter().map(|m| m.inputs.clone()).collect();
        assert_eq!(inputs, vec![0..2, 2..3, 3..5]);
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

    /// (object byte -> memory address) of `ranges`, sorted.
    fn mapping(ranges: &[ReadRange]) -> Vec<(u64, usize)> {
        let mut v: Vec<(u64, usize)> = ranges
            .iter()
            .flat_map(|r| (0..r.len).map(move |i| (r.offset + i as u64, r.dst as usize + i)))
            .collect();
        v.sort_unstable();
        v
    }

    /// The same mapping, as `shaped` realises it (scratch at address `scratch_base`).
    fn shaped_mapping(shaped: &Shaped, scratch_base: usize) -> Vec<(u64, usize)> {
        let mut v = Vec::new();
        for s in &shaped.spans {
            for i in 0..s.size {
                match s.target {
                    Target::Caller(p) => v.push((s.offset + i, p as usize + i as usize)),
                    Target::Scratch(at) => {
                        let scratch = at + i;
                        // Every scratch byte is copied out exactly once.
                        let outs: Vec<usize> = shaped
                            .copies
                            .iter()
                            .filter(|c| c.from <= scratch && scratch < c.from + c.len as u64)
                            .map(|c| c.to as usize + (scratch - c.from) as usize)
                            .collect();
                        assert_eq!(
                            outs.len(),
                            1,
                            "scratch byte {scratch} copied {} times",
                            outs.len()
                        );
                        assert!(scratch_base + (scratch as usize) < usize::MAX);
                        v.push((s.offset + i, outs[0]));
                    }
                }
            }
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn ranges_ending_past_the_largest_offset_shape_and_split_without_overflow() {
        // The store refuses such a read before any I/O; shaping and splitting it must still
        // not overflow (a panic with overflow checks on).
        let top = [
            range(0x1000, 16, u64::MAX - 31),
            range(0x3000, 16, u64::MAX - 15),
            range(0x5000, usize::MAX, u64::MAX),
        ];
        let staged = shape(&top, true);
        assert_eq!(staged.spans.len(), 2);
        assert!(staged.scratch > 0);
        let plain = shape(&top, false);
        assert_eq!(plain.spans.len(), 3);
        assert_eq!(plain.scratch, 0);
        let parts = partition(&[u64::MAX, u64::MAX, 1], 4, 1);
        assert_eq!(parts.iter().map(|p| p.len()).sum::<usize>(), 3);
    }

    #[test]
    fn shaping_stages_runs_adjacent_in_the_object_only() {
        // Three layers of one page into a layer-major pool (stride 1000), then a gap.
        let ranges = [
            range(10_000, 100, 0),
            range(11_000, 100, 100),
            range(12_000, 100, 200),
            range(13_000, 100, 400),
        ];
        let direct = shape(&ranges, false);
        assert_eq!(direct.spans.len(), 4);
        assert_eq!(direct.scratch, 0);
        let staged = shape(&ranges, true);
        assert_eq!(
            staged.spans.as_slice(),
            &[
                Span {
                    target: Target::Scratch(0),
                    size: 300,
                    offset: 0
                },
                Span {
                    target: Target::Caller(13_000 as *mut u8),
                    size: 100,
                    offset: 400
                },
            ]
        );
        assert_eq!(staged.scratch, 300);
        assert_eq!(staged.copies.len(), 3);
        let listed: Vec<(usize, usize, u64, usize)> = staged
            .staged
            .iter()
            .map(|s| (s.index, s.copy, s.from, s.len))
            .collect();
        assert_eq!(
            listed,
            vec![(0, 0, 0, 100), (1, 1, 100, 100), (2, 2, 200, 100)]
        );
        assert!(direct.staged.is_empty());
    }

    proptest! {
        #[test]
        fn scratch_calls_tile_the_keys_within_the_limit(
            scratch in prop::collection::vec(0u64..100, 0..40),
            limit in 1u64..200,
        ) {
            let calls = scratch_calls(&scratch, limit);
            let mut next = 0;
            for (i, (keys, need)) in calls.iter().enumerate() {
                prop_assert_eq!(keys.start, next);
                prop_assert!(!keys.is_empty());
                prop_assert_eq!(*need, scratch[keys.clone()].iter().sum::<u64>());
                // Within the limit, or one key that does not fit by itself.
                prop_assert!(*need <= limit || keys.len() == 1);
                // As long as it fits: the next key would not.
                if let Some((later, _)) = calls.get(i + 1) {
                    prop_assert!(need + scratch[later.start] > limit);
                }
                next = keys.end;
            }
            prop_assert_eq!(next, scratch.len());
        }
    }

    proptest! {
        #[test]
        fn shaped_reads_move_the_same_bytes_to_the_same_places(
            spans in prop::collection::vec((0usize..3, 0usize..64, 0u64..3), 0..30),
            stage in any::<bool>(),
        ) {
            let mut ranges = Vec::new();
            let (mut dst, mut off) = (1 << 20, 0u64);
            for (mem_gap, len, obj_gap) in &spans {
                dst += mem_gap * 1000;
                off += obj_gap * 5;
                ranges.push(range(dst, *len, off));
                dst += len;
                off += *len as u64;
            }
            let shaped = shape(&ranges, stage);
            prop_assert_eq!(mapping(&ranges), shaped_mapping(&shaped, 0));
            prop_assert!(shaped.spans.len() <= ranges.len());
            // An empty range reads nothing: no zero-byte slice goes to the wheel.
            prop_assert!(shaped.spans.iter().all(|s| s.size > 0), "{:?}", shaped.spans);
            let scratch_used: u64 = shaped
                .spans
                .iter()
                .filter(|s| matches!(s.target, Target::Scratch(_)))
                .map(|s| s.size)
                .sum();
            prop_assert_eq!(scratch_used, shaped.scratch);
            if !stage {
                prop_assert_eq!(shaped.scratch, 0);
            }
            // Each input range read through scratch is listed once, where a copy moves its
            // bytes to its destination; the others land in caller memory directly.
            let mut listed = vec![0; ranges.len()];
            for st in &shaped.staged {
                listed[st.index] += 1;
                let r = &ranges[st.index];
                prop_assert_eq!(st.len, r.len);
                // Its copy holds it whole and moves it to its destination.
                let c = &shaped.copies[st.copy];
                prop_assert!(c.from <= st.from && st.from + st.len as u64 <= c.from + c.len as u64);
                prop_assert_eq!(c.to as usize + st.offset_in(c).unwrap(), r.dst as usize);
            }
            prop_assert!(shaped.staged.windows(2).all(|w| w[0].from + w[0].len as u64 <= w[1].from));
            let staged_bytes: u64 = shaped.staged.iter().map(|s| s.len as u64).sum();
            prop_assert_eq!(staged_bytes, shaped.scratch);
            prop_assert!(listed.iter().all(|&n| n <= 1));
        }

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
            let got = pairs(&mut merged.iter().map(|m| (m.range.dst as usize, m.range.size as usize, m.range.offset)));
            prop_assert_eq!(want, got);
            // Neighbours that remain separate really do not continue each other.
            for w in merged.windows(2) {
                let (a, b) = (&w[0].range, &w[1].range);
                let joins = a.offset + a.size == b.offset
                    && a.dst as usize + a.size as usize == b.dst as usize;
                prop_assert!(!joins);
            }
            // The inputs tile the ranges in order, and each merged range is exactly its inputs.
            let mut next = 0;
            for m in &merged {
                prop_assert_eq!(m.inputs.start, next);
                next = m.inputs.end;
                let first = &ranges[m.inputs.start];
                let len: usize = ranges[m.inputs.clone()].iter().map(|r| r.len).sum();
                prop_assert_eq!((m.range.dst as usize, m.range.offset, m.range.size as usize), (first.dst as usize, first.offset, len));
            }
            prop_assert_eq!(next, ranges.len());
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
