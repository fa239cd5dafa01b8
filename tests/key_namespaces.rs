//! Keys cannot collide by default: two models with the same shapes (DeepSeek-V3 and R1) or
//! one model in two KV dtypes never read each other's objects through one store, while an
//! SGLang namespace writes exactly SGLang's keys.

mod common;

use std::sync::Arc;

use common::*;
use kvlink::kv_device::HostKvPool;
use kvlink::kv_geometry::{ElementType, KvGeometry, ModelKvSpec};
use kvlink::kv_loader::{KvLoader, LookupRequest};
use kvlink::mooncake_linker::store::{EmbeddedStore, KvStore};
use kvlink::mooncake_linker::{Linker, LinkerConfig, Namespace};

fn named(model: &str, dtype: ElementType) -> ModelKvSpec {
    ModelKvSpec {
        model: model.into(),
        ..ModelKvSpec::deepseek_v3(dtype)
    }
}

fn hits(spec: &ModelKvSpec, store: Arc<dyn KvStore>, tokens: &[u32], cfg: LinkerConfig) -> usize {
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
    let linker = Linker::new(g, store, pool, cfg).unwrap();
    let hit = linker
        .lookup(&LookupRequest {
            tokens,
            skip_pages: 0,
        })
        .unwrap();
    linker.close().unwrap();
    hit.pages.len()
}

#[test]
fn models_with_the_same_shapes_do_not_share_objects_by_default() {
    let v3 = named("deepseek-ai/DeepSeek-V3", ElementType::Fp8E4m3);
    let r1 = named("deepseek-ai/DeepSeek-R1", ElementType::Fp8E4m3);
    let v3_bf16 = named("deepseek-ai/DeepSeek-V3", ElementType::Bf16);
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let tokens = prompt(4, 2, 64);
    save_prefix(&v3, store.clone(), &tokens, &LinkerConfig::default());
    assert_eq!(
        hits(&v3, store.clone(), &tokens, LinkerConfig::default()),
        2
    );
    assert_eq!(
        hits(&r1, store.clone(), &tokens, LinkerConfig::default()),
        0,
        "R1 must not read V3's KV"
    );
    assert_eq!(
        hits(&v3_bf16, store, &tokens, LinkerConfig::default()),
        0,
        "a bf16 cache must not read fp8 objects"
    );
}

#[test]
fn an_sglang_namespace_writes_sglangs_keys() {
    let spec = named("deepseek-ai/DeepSeek-V3", ElementType::Bf16);
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let tokens = prompt(6, 1, 64);
    let cfg = LinkerConfig {
        namespace: Namespace::sglang("hicache", "deepseek-ai/DeepSeek-V3"),
        ..LinkerConfig::default()
    };
    let pages = save_prefix(&spec, store.clone(), &tokens, &cfg);
    let key = format!("hicache_deepseek-ai-DeepSeek-V3_{}_cp0_pp0_k", pages[0]);
    assert_eq!(store.exists(&[&key]), vec![Ok(true)]);
    assert_eq!(hits(&spec, store, &tokens, cfg), 1);
}

/// Three ranks of one TP group, the middle one configured with another namespace (a
/// deployment tag set apart on one process), whose objects for the same page hashes hold
/// other bytes. Before, the batch gate did not see the namespace: rank 0 read its own
/// namespace's objects and broadcast them, and rank 1 landed them under an `Ok` outcome. The
/// gate's digest covers the key space now: the plans differ, the batch runs `AllRanks`, and
/// every rank lands its own namespace's bytes.
#[test]
fn ranks_of_different_namespaces_never_land_each_others_objects() {
    use common::tp::{config, mixed_spec, save};
    use kvlink::kv_loader::ShareMode;
    use kvlink::mooncake_linker::TpGroup;

    const OTHER: u8 = 0x5a;
    let spec = mixed_spec();
    let pages = 4;
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let cfg_a = config(ShareMode::Rank0Broadcast);
    let cfg_b = LinkerConfig {
        namespace: "tp-other".into(),
        ..cfg_a.clone()
    };
    let hashes = save(&spec, 3, store.clone(), pages, &cfg_a);
    // Namespace b: the same page hashes, every byte OTHER.
    for rank in 0..3 {
        let g = KvGeometry::new(spec.clone(), 3, rank).unwrap();
        let pool = HostKvPool::new(g.clone(), pages as u32).unwrap();
        let slots: Vec<u32> = (0..pages as u32).collect();
        for c in g.components() {
            for &l in &c.layers {
                for &slot in &slots {
                    let row = vec![OTHER; c.page_layer_bytes as usize];
                    // SAFETY: a new pool, no batch of it in flight.
                    unsafe { pool.write_slot(c.id, l, slot, &row) }.unwrap();
                }
            }
        }
        let linker = Linker::new(g.clone(), store.clone(), Arc::new(pool), cfg_b.clone()).unwrap();
        linker.save(&load_plan(&g, 0, &hashes, slots)).unwrap();
        linker.close().unwrap();
    }
    let ranks: Vec<(Linker, Arc<HostKvPool>)> = TpGroup::in_process(3)
        .into_iter()
        .enumerate()
        .map(|(rank, group)| {
            let g = KvGeometry::new(spec.clone(), 3, rank as u32).unwrap();
            let pool = Arc::new(HostKvPool::new(g.clone(), pages as u32).unwrap());
            let cfg = if rank == 1 { &cfg_b } else { &cfg_a };
            let linker =
                Linker::with_group(g, store.clone(), pool.clone(), cfg.clone(), group).unwrap();
            (linker, pool)
        })
        .collect();
    let slots: Vec<u32> = (0..pages as u32).collect();
    let outcomes: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .map(|(linker, _)| {
                let slots = slots.clone();
                let hashes = &hashes;
                s.spawn(move || {
                    let plan = load_plan(linker.geometry(), 1, hashes, slots);
                    let t = linker.start_load(plan).unwrap();
                    linker.wait_batch(&t).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, o) in outcomes.iter().enumerate() {
        let stats = o
            .result
            .as_ref()
            .unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert_eq!(
            stats.mode,
            ShareMode::AllRanks,
            "rank {rank}: the plans differ"
        );
        assert_eq!(
            ranks[rank].0.metrics().batches_plans_differ,
            1,
            "rank {rank}"
        );
    }
    let (linker, pool) = &ranks[1];
    for c in linker.geometry().components() {
        for &l in &c.layers {
            for &slot in &slots {
                let mut got = vec![0u8; c.page_layer_bytes as usize];
                // SAFETY: the batch is over (its outcome taken); nothing writes the pool.
                unsafe { pool.read_slot(c.id, l, slot, &mut got) }.unwrap();
                assert!(
                    got.iter().all(|&b| b == OTHER),
                    "rank 1, {} layer {l} slot {slot}: another namespace's bytes",
                    c.name
                );
            }
        }
    }
    for (linker, _) in ranks {
        linker.close().unwrap();
    }
}

/// Requests of one prompt under different LoRA adapters (or images behind the same
/// placeholder tokens) must not share objects: their page hashes, chained from a salt naming
/// the adapter, find only their own saves, and a plain lookup of the tokens finds neither.
#[test]
fn pages_chained_from_different_salts_never_hit_each_other() {
    use kvlink::kv_geometry::{page_hashes, PageHash};
    let spec = named("deepseek-ai/DeepSeek-V3", ElementType::Fp8E4m3);
    let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 26));
    let tokens = prompt(4, 2, 64);
    let g = KvGeometry::new(spec.clone(), 1, 0).unwrap();
    let pool = Arc::new(HostKvPool::new(g.clone(), 4).unwrap());
    let linker = Linker::new(g.clone(), store, pool, LinkerConfig::default()).unwrap();
    let salted = |adapter: &[u8]| page_hashes(&tokens, 64, Some(PageHash::salt(adapter)));
    let a = salted(b"lora:a");
    linker.save(&load_plan(&g, 0, &a, vec![0, 1])).unwrap();
    assert_eq!(linker.lookup_pages(&a, 0).unwrap().pages, a);
    assert!(linker
        .lookup_pages(&salted(b"lora:b"), 0)
        .unwrap()
        .pages
        .is_empty());
    let plain = LookupRequest {
        tokens: &tokens,
        skip_pages: 0,
    };
    assert!(linker.lookup(&plain).unwrap().pages.is_empty());
    linker.close().unwrap();
}
