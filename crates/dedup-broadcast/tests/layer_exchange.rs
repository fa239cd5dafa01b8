//! The blocks together: for random geometries, plans and per-rank slots, moving each layer
//! through a staging buffer (rank 0 reads + broadcast, or split reads + in-place all-gather)
//! leaves every rank's pool identical to every rank reading everything itself.

mod common;

use std::collections::HashMap;
use std::thread;
use std::time::Duration;

use common::components::byte_component;
use dedup_broadcast::{
    all_gather_in_place, broadcast_slice, Collective, InProcessGroup, StagingLayout,
};
use kv_geometry::{ComponentId, KvGeometry, ModelKvSpec};
use kv_loader::ShareMode;
use proptest::prelude::*;

/// A simulated pool: (component, layer, slot) -> the page's bytes of that layer.
type Pool = HashMap<(ComponentId, u32, u32), Vec<u8>>;

/// What the store holds for (component, layer, plan page).
fn stored(c: ComponentId, layer: u32, page: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i * 7 + page * 131 + layer as usize * 17 + usize::from(c.0) * 59) as u8)
        .collect()
}

fn load(g: &KvGeometry, mode: ShareMode, pages: usize, slots: &[Vec<u32>]) -> Vec<Pool> {
    let tp = g.tp_size();
    let ranks = InProcessGroup::new(tp);
    let deadline = kv_loader::deadline_after(Duration::from_secs(60));
    thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                let my_slots = &slots[c.rank() as usize];
                s.spawn(move || {
                    let mut pool = Pool::new();
                    for layer in 0..g.num_layers() {
                        if mode == ShareMode::AllRanks {
                            for comp in g
                                .components()
                                .iter()
                                .filter(|x| x.position(layer).is_some())
                            {
                                for (p, &slot) in my_slots.iter().enumerate() {
                                    let bytes =
                                        stored(comp.id, layer, p, comp.page_layer_bytes as usize);
                                    pool.insert((comp.id, layer, slot), bytes);
                                }
                            }
                            continue;
                        }
                        let st =
                            StagingLayout::new(mode, layer, g.components(), pages, tp).unwrap();
                        let mut staging = vec![0u8; st.len()];
                        for row in st.rows(st.share(c.rank())) {
                            staging[row.offset..row.offset + row.len].copy_from_slice(&stored(
                                row.component,
                                layer,
                                row.plan_page,
                                row.len,
                            ));
                        }
                        match mode {
                            ShareMode::Rank0Broadcast => {
                                broadcast_slice(c, &mut staging, 0, deadline).unwrap()
                            }
                            _ => all_gather_in_place(c, &mut staging, deadline).unwrap(),
                        }
                        for row in st.rows(0..pages) {
                            pool.insert(
                                (row.component, layer, my_slots[row.plan_page]),
                                staging[row.offset..row.offset + row.len].to_vec(),
                            );
                        }
                    }
                    pool
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn arb_case() -> impl Strategy<Value = (KvGeometry, usize, Vec<Vec<u32>>)> {
    (
        1u32..5,
        1u32..=5,
        prop::collection::vec((any::<bool>(), 1u32..40, 0u32..5, any::<bool>()), 1..3),
        0usize..12,
        any::<u64>(),
    )
        .prop_map(|(layers, tp, comps, pages, seed)| {
            let components = comps
                .into_iter()
                .enumerate()
                .map(|(i, (page_rows, row_bytes, only, dense))| {
                    let sparse = (!dense).then(|| vec![only % layers]);
                    byte_component(i, page_rows, row_bytes, sparse)
                })
                .collect();
            let spec = ModelKvSpec::new("t", layers, 2, components).unwrap();
            let g = KvGeometry::new(spec, tp, 0).unwrap();
            // Per rank, a different permutation of slots out of a 2x larger pool.
            let slots = (0..tp)
                .map(|r| {
                    let mut all: Vec<u32> = (0..(pages * 2) as u32).collect();
                    let mut x = seed ^ (u64::from(r) + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                    for i in (1..all.len()).rev() {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        all.swap(i, (x % (i as u64 + 1)) as usize);
                    }
                    all.truncate(pages);
                    all
                })
                .collect();
            (g, pages, slots)
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn shared_modes_match_every_rank_reading((g, pages, slots) in arb_case()) {
        let baseline = load(&g, ShareMode::AllRanks, pages, &slots);
        for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
            let pools = load(&g, mode, pages, &slots);
            prop_assert_eq!(&pools, &baseline, "{:?}", mode);
        }
    }
}
