//! Property test of `BatchPlan::validate`: for any plan (hostile slots, component ids and pool
//! sizes included) it never panics and agrees with a reference model written out plainly.

use std::collections::HashMap;

use kv_geometry::{ComponentId, ElementType, KvGeometry, ModelKvSpec, PageHash};
use kv_loader::{BatchId, BatchPlan, KvLoadError, LogicalPlan, PlanError, RequestPages};
use proptest::prelude::*;

/// What `validate` must answer, checked in its documented order: slot count, components (none
/// for pages; each unknown or out of order), then each page's slot in plan order (outside the
/// pool, or used before).
fn expected(plan: &BatchPlan, components: usize, pool: u32) -> Result<(), PlanError> {
    let pages = plan.logical.num_pages();
    if pages != plan.slots.len() {
        return Err(PlanError::SlotCount {
            pages,
            slots: plan.slots.len(),
        });
    }
    if pages > 0 && plan.logical.components.is_empty() {
        return Err(PlanError::NoComponents { pages });
    }
    let mut prev = None;
    for c in &plan.logical.components {
        if usize::from(c.0) >= components || prev.is_some_and(|p| p >= c.0) {
            return Err(PlanError::BadComponent(c.0));
        }
        prev = Some(c.0);
    }
    let mut first_use: HashMap<u32, usize> = HashMap::new();
    for (page, &slot) in plan.slots.iter().enumerate() {
        if slot >= pool {
            return Err(PlanError::SlotOutOfPool {
                slot,
                page,
                pool_pages: pool,
            });
        }
        if let Some(&first) = first_use.get(&slot) {
            return Err(PlanError::DuplicateSlot {
                slot,
                first,
                second: page,
            });
        }
        first_use.insert(slot, page);
    }
    Ok(())
}

fn arb_plan() -> impl Strategy<Value = BatchPlan> {
    (
        any::<u64>(),
        proptest::collection::vec(0usize..6, 0..4),
        proptest::collection::vec(prop_oneof![0u16..4, any::<u16>()], 0..4),
        proptest::collection::vec(prop_oneof![0u32..16, any::<u32>(), Just(u32::MAX)], 0..24),
    )
        .prop_map(|(batch, request_pages, components, slots)| {
            let requests = request_pages
                .iter()
                .enumerate()
                .map(|(r, &n)| RequestPages {
                    request: format!("r{r}").as_str().into(),
                    pages: (0..n).map(|p| PageHash([(r * 8 + p) as u8; 32])).collect(),
                })
                .collect();
            BatchPlan {
                logical: LogicalPlan {
                    batch: BatchId(batch),
                    requests,
                    components: components.into_iter().map(ComponentId).collect(),
                },
                slots,
            }
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(4000))]

    #[test]
    fn validate_never_panics_and_matches_the_model(
        plan in arb_plan(),
        pool in prop_oneof![0u32..20, any::<u32>(), Just(u32::MAX)],
    ) {
        let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).unwrap();
        let n = g.components().len();
        let got = plan.validate(&g, pool);
        match (got, expected(&plan, n, pool)) {
            (Ok(()), Ok(())) => {}
            (Err(KvLoadError::InvalidPlan { batch, reason }), Err(want)) => {
                prop_assert_eq!(batch, plan.logical.batch);
                prop_assert_eq!(reason, want);
            }
            (got, want) => prop_assert!(false, "validate gave {:?}, the model {:?}", got, want),
        }
    }

    /// The canonical encoding is injective on the plans above: equal bytes, equal plans.
    #[test]
    fn canonical_bytes_identify_the_plan(a in arb_plan(), b in arb_plan()) {
        prop_assert_eq!(a.logical.canonical_bytes() == b.logical.canonical_bytes(), a.logical == b.logical);
    }
}

#[test]
fn the_model_covers_each_error() {
    let g = KvGeometry::new(ModelKvSpec::deepseek_v3(ElementType::Bf16), 1, 0).unwrap();
    let plan = |slots: Vec<u32>, comps: Vec<u16>| BatchPlan {
        logical: LogicalPlan {
            batch: BatchId(1),
            requests: vec![RequestPages {
                request: "r".into(),
                pages: vec![PageHash([1; 32]), PageHash([2; 32])],
            }],
            components: comps.into_iter().map(ComponentId).collect(),
        },
        slots,
    };
    for (p, pool) in [
        (plan(vec![0], vec![0]), 4),
        (plan(vec![0, 1], vec![1]), 4),
        (plan(vec![0, 4], vec![0]), 4),
        (plan(vec![3, 3], vec![0]), 4),
        (plan(vec![3, 2], vec![0]), 4),
    ] {
        assert_eq!(
            p.validate(&g, pool).map_err(|e| match e {
                KvLoadError::InvalidPlan { reason, .. } => reason,
                other => panic!("{other}"),
            }),
            expected(&p, 1, pool)
        );
    }
}
