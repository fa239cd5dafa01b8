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
