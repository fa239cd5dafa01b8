//! Property tests of layout and key math.

use std::collections::HashSet;

use kv_geometry::{
    page_hashes, ComponentSpec, ElementType, KeyScheme, KvGeometry, LayerMap, ModelKvSpec, RowUnit,
};
use proptest::prelude::*;

fn arb_spec() -> impl Strategy<Value = ModelKvSpec> {
    (
        1u32..40,
        1u32..5,
        1u32..200,
        proptest::collection::vec(any::<bool>(), 1..40),
        1u32..4,
    )
        .prop_map(|(layers, page_pow, row, mask, heads_mul)| {
            let page = 1 << page_pow;
            let sparse: Vec<u32> = (0..layers)
                .filter(|l| mask[*l as usize % mask.len()])
                .collect();
            let mut comps = vec![ComponentSpec::new(
                "k",
                RowUnit::Token,
                ElementType::Bytes,
                row,
            )];
            if !sparse.is_empty() {
                comps.push(
                    ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, row * 3 + 1)
                        .on_layers(LayerMap::Sparse(sparse)),
                );
            }
            comps.push(
                ComponentSpec::new("v", RowUnit::Token, ElementType::Bf16, 8 * heads_mul * 4)
                    .sharded(4 * heads_mul),
            );
            ModelKvSpec::new("prop", layers, page, comps).unwrap()
        })
}

proptest! {
    #[test]
    fn layer_ranges_tile_each_object(spec in arb_spec(), tp_pow in 0u32..3) {
        let tp = 1 << tp_pow;
        let g = KvGeometry::new(spec, tp, tp - 1).unwrap();
        for c in g.components() {
            let mut ranges: Vec<_> = (0..g.num_layers()).filter_map(|l| c.layer_range(l)).collect();
            prop_assert_eq!(ranges.len(), c.layers.len());
            ranges.sort_by_key(|r| r.start);
            let mut at = 0;
            for r in ranges {
                prop_assert_eq!(r.start, at);
                prop_assert_eq!(r.end - r.start, c.page_layer_bytes);
                at = r.end;
            }
            prop_assert_eq!(at, c.object_bytes());
        }
    }

    #[test]
    fn pool_slices_never_overlap(spec in arb_spec(), slots in proptest::collection::hash_set(0u32..10_000, 1..50)) {
        let g = KvGeometry::new(spec, 2, 1).unwrap();
        for c in g.components() {
            // One buffer per (component, layer): slices of distinct slots in one buffer
            // must be disjoint, and adjacent slots must touch.
            let mut rs: Vec<_> = slots.iter().map(|&s| (s, c.slot_range(s))).collect();
            rs.sort_by_key(|(s, _)| *s);
            for w in rs.windows(2) {
                prop_assert!(w[0].1.end <= w[1].1.start);
                if w[1].0 == w[0].0 + 1 { prop_assert_eq!(w[0].1.end, w[1].1.start); }
            }
        }
    }

    #[test]
    fn keys_distinct_for_distinct_prefixes(a in proptest::collection::vec(any::<u32>(), 4..40),
                                            b in proptest::collection::vec(any::<u32>(), 4..40)) {
        let pa = page_hashes(&a, 4, None);
        let pb = page_hashes(&b, 4, None);
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let ks = KeyScheme::new("ns", 0, 0, 0);
        let c = g.component_by_name("k").unwrap();
        for (i, (ha, hb)) in pa.iter().zip(&pb).enumerate() {
            let same_prefix = a[..(i + 1) * 4] == b[..(i + 1) * 4];
            prop_assert_eq!(ks.object_key(ha, c) == ks.object_key(hb, c), same_prefix);
        }
        let all: HashSet<_> = pa.iter().map(|h| ks.object_key(h, c)).collect();
        prop_assert_eq!(all.len(), pa.len());
    }
}
