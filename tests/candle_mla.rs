//! The `candle_mla` example's check, small: a candle MLA model on TP ranks as threads whose
//! prefill with a prefix loaded through kvlink (in every share mode) gives logits equal bit
//! for bit to a full recompute; and, with a store read failing on one rank, every rank falls
//! back to recomputing and its logits still match. The example's own modules are compiled
//! into this test.

#[allow(dead_code)]
#[path = "../examples/candle_mla/engine.rs"]
mod engine;
#[allow(dead_code)]
#[path = "../examples/candle_mla/model.rs"]
mod model;

use std::sync::Arc;
use std::time::Duration;

use engine::{PrefixPath, Scenario, Served};
use kvlink::kv_loader::{KvLoadError, ShareMode};
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, StoreError,
};
use kvlink::mooncake_linker::{LinkerConfig, ReadGranularity};
use kvlink_candle::candle_core::Tensor;
use model::{bit_identical, random_tokens, MlaConfig, RankModel};

const MODES: [ShareMode; 3] = [
    ShareMode::AllRanks,
    ShareMode::Rank0Broadcast,
    ShareMode::SplitAllGather,
];

/// Page size 4; request 1 is 3 pages + 2 tokens, request 2 adds 6 (20 tokens, 12 loadable).
fn scenario(tp: usize, chunk: usize) -> Scenario {
    let cfg = MlaConfig::tiny();
    Scenario {
        cfg,
        seed: 11,
        tp,
        page_size: 4,
        prompt: random_tokens(11, 14, cfg.vocab),
        new_tokens: random_tokens(12, 6, cfg.vocab),
        chunk,
        linker: LinkerConfig {
            namespace: "test-mla".into(),
            wait_deadline: Duration::from_secs(10),
            layer_read_timeout: Duration::from_secs(3),
            collective_timeout: Duration::from_secs(6),
            // One layer per store call: the failure tests name the layer a fault hits.
            read_granularity: ReadGranularity::Fixed { layers_per_call: 1 },
            ..LinkerConfig::default()
        },
    }
}

struct Fixture {
    sc: Scenario,
    models: Vec<Arc<RankModel>>,
    reference: Vec<Tensor>,
}

impl Fixture {
    fn new(sc: Scenario) -> Self {
        let models = sc.models().unwrap();
        let reference = engine::recompute_request2(&sc, &models).unwrap();
        Fixture {
            sc,
            models,
            reference,
        }
    }

    /// A store holding request 1's pages, as its prefill saved them.
    fn saved_store(&self) -> Arc<dyn KvStore> {
        let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
        let reports = engine::save_request1(&self.sc, &self.models, store.clone()).unwrap();
        assert_eq!(
            reports[0].objects_written, 3,
            "rank 0 writes the 3 whole pages"
        );
        for r in &reports[1..] {
            assert_eq!(
                (r.objects_written, r.objects_not_owned),
                (0, 3),
                "replicated latent: other ranks own nothing"
            );
        }
        store
    }

    fn serve(&self, mode: ShareMode, arm: &(dyn Fn(usize, &FaultyStore) + Sync)) -> Vec<Served> {
        engine::serve_request2(&self.sc, &self.models, self.saved_store(), mode, arm).unwrap()
    }

    /// Every rank's logits equal the reference's rows for the same tokens, bit for bit.
    fn assert_matches(&self, served: &[Served], what: &str) {
        assert_eq!(served.len(), self.sc.tp);
        for (rank, (s, r)) in served.iter().zip(&self.reference).enumerate() {
            let rows = r.dim(0).unwrap() - s.hit_tokens;
            let want = r.narrow(0, s.hit_tokens, rows).unwrap();
            assert!(
                bit_identical(&s.logits, &want).unwrap(),
                "{what}: rank {rank} differs by {}",
                model::max_abs_diff(&s.logits, &want).unwrap()
            );
        }
    }
}

fn fail_read(
    rank: usize,
    layer: u32,
    page_layer_bytes: u64,
) -> impl Fn(usize, &FaultyStore) + Sync {
    move |r, store| {
        if r == rank {
            store.inject(
                FaultRule {
                    key_contains: Some("_k".into()),
                    offset: Some(u64::from(layer) * page_layer_bytes),
                    times: None,
                    ..FaultRule::default()
                },
                Fault::Error(StoreError::TransferFailed {
                    key: "injected".into(),
                    code: -800,
                }),
            );
        }
    }
}

#[test]
fn every_mode_loads_the_prefix_and_matches_recompute_bit_for_bit() {
    let f = Fixture::new(scenario(2, 4));
    let one_copy = 3 * 4 * f.sc.format().unwrap().row_bytes() as u64 * 4; // pages·rows·B·layers
    for mode in MODES {
        let served = f.serve(mode, &|_, _| {});
        let mut read = 0;
        for (rank, s) in served.iter().enumerate() {
            assert_eq!(s.hit_tokens, 12, "{mode:?}: request 1's 3 whole pages");
            let PrefixPath::Loaded(stats) = &s.path else {
                panic!("{mode:?} rank {rank}: {:?}", s.path)
            };
            assert_eq!(stats.mode, mode);
            assert_eq!(
                stats.bytes_landed, one_copy,
                "every rank's pool got the prefix"
            );
            read += stats.bytes_read;
            assert_eq!(
                (s.save.objects_present, s.save.objects_written),
                if rank == 0 { (3, 2) } else { (0, 0) },
                "request 2 saves its 2 new whole pages, skipping the loaded ones"
            );
        }
        let expected = if mode == ShareMode::AllRanks {
            2 * one_copy
        } else {
            one_copy
        };
        assert_eq!(
            read, expected,
            "{mode:?}: bytes read from the store over all ranks"
        );
        f.assert_matches(&served, &format!("{mode:?}"));
    }
}

#[test]
fn more_ranks_and_longer_chunks_match_too() {
    // TP 4 (one head per rank), chunks of two pages: the store's 12-token hit ends mid-chunk,
    // so the engine loads the whole chunk (8 tokens) and computes from there.
    let f = Fixture::new(scenario(4, 8));
    for mode in [ShareMode::Rank0Broadcast, ShareMode::SplitAllGather] {
        let served = f.serve(mode, &|_, _| {});
        assert!(served
            .iter()
            .all(|s| matches!(s.path, PrefixPath::Loaded(_)) && s.hit_tokens == 8));
        f.assert_matches(&served, &format!("tp4 {mode:?}"));
    }
}

#[test]
fn a_failed_load_falls_back_to_recompute_and_still_matches() {
    let f = Fixture::new(scenario(2, 4));
    let plb = 4 * f.sc.format().unwrap().row_bytes() as u64;
    // Rank 0 reads in every mode (all pages, all pages, its share): fail one of its layers.
    for mode in MODES {
        for layer in [0u32, 2, 3] {
            let served = f.serve(mode, &fail_read(0, layer, plb));
            let mut verdicts = Vec::new();
            for (rank, s) in served.iter().enumerate() {
                let PrefixPath::Recomputed(why) = &s.path else {
                    panic!("{mode:?} layer {layer} rank {rank}: loaded despite the failure")
                };
                verdicts.push(why.clone());
            }
            assert!(
                verdicts[0].contains(&format!("rank 0 failed at layer {layer}")),
                "{mode:?}: {}",
                verdicts[0]
            );
            // The same verdict everywhere; rank 0, which failed, adds its own error's words.
            assert!(
                verdicts[1..].iter().all(|v| v == &verdicts[1])
                    && verdicts[0].starts_with(&verdicts[1]),
                "same verdict: {verdicts:?}"
            );
            f.assert_matches(&served, &format!("{mode:?}, failed at layer {layer}"));
            // The recomputed pages are whole again: request 2's save still writes its new ones.
            assert_eq!(served[0].save.objects_written, 2);
        }
    }
}

#[test]
fn a_failure_on_another_rank_fails_every_rank_the_same_way() {
    // Rank 1 reads its own copy (AllRanks) or its share (SplitAllGather): fail it there.
    let f = Fixture::new(scenario(2, 4));
    let plb = 4 * f.sc.format().unwrap().row_bytes() as u64;
    for mode in [ShareMode::AllRanks, ShareMode::SplitAllGather] {
        let served = f.serve(mode, &fail_read(1, 1, plb));
        for s in &served {
            assert!(
                matches!(&s.path, PrefixPath::Recomputed(why) if why.contains("rank 1 failed at layer 1")),
                "{mode:?}: {:?}",
                s.path
            );
        }
        f.assert_matches(&served, &format!("{mode:?}, rank 1 failed"));
    }
}

#[test]
fn the_load_error_is_typed_for_the_engine() {
    // What the engine matches on to choose recompute: a Load error carrying the loader's.
    let e = kvlink_candle::CandleKvError::Load {
        layer: Some(2),
        source: KvLoadError::Closed,
    };
    assert!(e.is_load_failure());
    assert!(e.to_string().starts_with("layer 2: the prefix load failed"));
}

#[test]
fn the_check_sees_the_loaded_bytes() {
    // The same prompt saved by a model with other weights: same keys, other latents. The
    // load succeeds and the logits must differ, or the equality above would prove nothing.
    let f = Fixture::new(scenario(2, 4));
    let mut other = f.sc.clone();
    other.seed += 1;
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    engine::save_request1(&other, &other.models().unwrap(), store.clone()).unwrap();
    let served = engine::serve_request2(
        &f.sc,
        &f.models,
        store,
        ShareMode::SplitAllGather,
        &|_, _| {},
    )
    .unwrap();
    for (s, r) in served.iter().zip(&f.reference) {
        assert!(matches!(s.path, PrefixPath::Loaded(_)));
        let want = r
            .narrow(0, s.hit_tokens, r.dim(0).unwrap() - s.hit_tokens)
            .unwrap();
        assert!(model::max_abs_diff(&s.logits, &want).unwrap() > 1e-3);
    }
}
