//! Shares tile the pages; staging rows never overlap and fit the buffer, in both modes.

mod common;

use common::components::byte_component;
use dedup_broadcast::{padded_share, page_shares, ShareError, StagingLayout};
use kv_geometry::{KvGeometry, ModelKvSpec};
use kv_loader::ShareMode;
use proptest::prelude::*;

proptest! {
    #[test]
    fn shares_tile_the_pages(pages in 0usize..5000, size in 1u32..=16) {
        let shares = page_shares(pages, size);
        prop_assert_eq!(shares.len(), size as usize);
        let mut next = 0;
        for s in &shares {
            prop_assert_eq!(s.start, next);
            prop_assert!(s.end >= s.start);
            next = s.end;
        }
        prop_assert_eq!(next, pages);
        let lens: Vec<usize> = shares.iter().map(|s| s.len()).collect();
        let (min, max) = (lens.iter().min().copied().unwrap_or(0), lens.iter().max().copied().unwrap_or(0));
        prop_assert!(max - min <= 1);
        prop_assert_eq!(max, padded_share(pages, size));
        // Longer shares come first.
        prop_assert!(lens.windows(2).all(|w| w[0] >= w[1]));
    }
}

#[test]
fn no_ranks_no_shares() {
    assert!(page_shares(10, 0).is_empty());
    assert_eq!(padded_share(10, 0), 0);
}

/// A model of `layers` layers with random replicated components (token or page rows, dense
/// or sparse).
fn arb_geometry() -> impl Strategy<Value = (KvGeometry, u32)> {
    (
        1u32..6,
        1u32..=8,
        prop::collection::vec(
            (
                any::<bool>(),
                1u32..300,
                prop::collection::btree_set(0u32..6, 1..4),
                any::<bool>(),
            ),
            1..4,
        ),
    )
        .prop_map(|(layers, tp, comps)| {
            let components = comps
                .into_iter()
                .enumerate()
                .map(|(i, (page_rows, row_bytes, sparse, dense))| {
                    let sparse: Vec<u32> = sparse.into_iter().filter(|&l| l < layers).collect();
                    let sparse = (!dense && !sparse.is_empty()).then_some(sparse);
                    byte_component(i, page_rows, row_bytes, sparse)
                })
                .collect();
            let spec = ModelKvSpec::new("test", layers, 4, components).unwrap();
            (KvGeometry::new(spec, tp, 0).unwrap(), tp)
        })
}

proptest! {
    #[test]
    fn staging_rows_are_disjoint_and_fit(
        (g, tp) in arb_geometry(),
        pages in 0usize..200,
        split in any::<bool>(),
    ) {
        let mode = if split { ShareMode::SplitAllGather } else { ShareMode::Rank0Broadcast };
        for layer in 0..g.num_layers() {
            let s = StagingLayout::new(mode, layer, g.components(), pages, tp).unwrap();
            let carried: Vec<_> = g.components().iter().filter(|c| c.position(layer).is_some()).collect();
            prop_assert_eq!(s.components().len(), carried.len());
            let mut rows: Vec<(usize, usize)> = s.rows(0..pages).map(|r| (r.offset, r.len)).collect();
            prop_assert_eq!(rows.len(), pages * carried.len());
            // Every row through offset() too, and absent components have none.
            for c in g.components() {
                for p in 0..pages {
                    let o = s.offset(c.id, p);
                    prop_assert_eq!(o.is_some(), c.position(layer).is_some());
                }
                prop_assert_eq!(s.offset(c.id, pages), None);
            }
            rows.sort();
            for w in rows.windows(2) {
                prop_assert!(w[0].0 + w[0].1 <= w[1].0, "overlap {:?}", w);
            }
            if let Some(last) = rows.last() {
                prop_assert!(last.0 + last.1 <= s.len());
            }
            let expected_rows: usize = carried.iter().map(|c| c.page_layer_bytes as usize).sum::<usize>();
            match mode {
                ShareMode::SplitAllGather => {
                    prop_assert_eq!(s.chunk_bytes(), expected_rows * padded_share(pages, tp));
                    prop_assert_eq!(s.len(), s.chunk_bytes() * tp as usize);
                    // Each rank's rows lie in its own chunk.
                    for r in 0..tp {
                        let chunk = s.chunk(r);
                        prop_assert_eq!(chunk.len(), s.chunk_bytes());
                        for row in s.rows(s.share(r)) {
                            prop_assert!(chunk.start <= row.offset && row.offset + row.len <= chunk.end);
                        }
                    }
                }
                _ => {
                    prop_assert_eq!(s.len(), expected_rows * pages);
                    prop_assert_eq!(s.share(0), 0..pages);
                    prop_assert_eq!(s.chunk(0), 0..s.len());
                    for r in 1..tp {
                        prop_assert!(s.share(r).is_empty() && s.chunk(r).is_empty());
                    }
                }
            }
        }
    }
}

#[test]
fn rank0_rows_are_in_plan_order_per_component() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
    let (k, idx) = (
        g.component_by_name("k").unwrap(),
        g.component_by_name("indexer").unwrap(),
    );
    let indexer_layer = idx.layers[0];
    let s = StagingLayout::new(
        ShareMode::Rank0Broadcast,
        indexer_layer,
        g.components(),
        5,
        8,
    )
    .unwrap();
    for p in 0..5 {
        assert_eq!(s.offset(k.id, p), Some(p * 41_984));
        assert_eq!(s.offset(idx.id, p), Some(5 * 41_984 + p * 8448));
    }
    // A layer without the indexer stages only the KV rows.
    let plain = (0..78).find(|l| idx.position(*l).is_none()).unwrap();
    let s = StagingLayout::new(ShareMode::Rank0Broadcast, plain, g.components(), 5, 8).unwrap();
    assert_eq!(s.len(), 5 * 41_984);
    assert_eq!(s.offset(idx.id, 0), None);
}

#[test]
fn split_pads_short_shares() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 4, 0).unwrap();
    let k = g.component_by_name("k").unwrap();
    let s = StagingLayout::new(ShareMode::SplitAllGather, 1, [k], 10, 4).unwrap();
    // Shares 3,3,2,2 pages; chunks of 3.
    let offsets: Vec<usize> = (0..10)
        .map(|p| s.offset(k.id, p).unwrap() / 41_984)
        .collect();
    assert_eq!(offsets, vec![0, 1, 2, 3, 4, 5, 6, 7, 9, 10]);
    assert_eq!(s.len(), 12 * 41_984);
}

#[test]
fn refusals() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 2, 0).unwrap();
    assert_eq!(
        StagingLayout::new(ShareMode::AllRanks, 0, g.components(), 3, 2),
        Err(ShareError::Unstaged(ShareMode::AllRanks))
    );
    assert_eq!(
        StagingLayout::new(ShareMode::SplitAllGather, 0, g.components(), 3, 0),
        Err(ShareError::NoRanks)
    );
    let k = g.component_by_name("k").unwrap();
    assert_eq!(
        StagingLayout::new(ShareMode::Rank0Broadcast, 0, [k, k], 3, 2),
        Err(ShareError::DuplicateComponent(k.id.0))
    );
    // Also on a layer the repeated component does not carry (the indexer is on some layers
    // only): refused on every layer alike, not only where it is carried.
    let ix = g.component_by_name("indexer").unwrap();
    let bare = (0..g.num_layers())
        .find(|&l| ix.position(l).is_none())
        .unwrap();
    assert_eq!(
        StagingLayout::new(ShareMode::Rank0Broadcast, bare, [ix, ix], 3, 2),
        Err(ShareError::DuplicateComponent(ix.id.0))
    );
    let mha = KvGeometry::new(ModelKvSpec::llama3_70b(), 2, 0).unwrap();
    assert!(matches!(
        StagingLayout::new(ShareMode::Rank0Broadcast, 0, mha.components(), 3, 2),
        Err(ShareError::Sharded(_))
    ));
    let empty = StagingLayout::new(ShareMode::SplitAllGather, 0, g.components(), 0, 2).unwrap();
    assert!(empty.is_empty());
}
