//! The model numbers of docs/architecture.md ("Model numbers"), pinned.

use kv_geometry::{ElementType, GeometryError, KvGeometry, LayerMap, ModelKvSpec};

const T128K: u64 = 131_072;

#[test]
fn bytes_per_token_match_the_reference_table() {
    let cases: [(ModelKvSpec, f64, u64); 6] = [
        (
            ModelKvSpec::deepseek_v3(ElementType::Bf16),
            70_272.0,
            9_210_691_584,
        ),
        (
            ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3),
            35_136.0,
            4_605_345_792,
        ),
        (ModelKvSpec::deepseek_v32_dsa_fp8(), 48_068.0, 6_300_368_896),
        (ModelKvSpec::glm52_dsa_fp8(), 53_940.0, 7_070_023_680),
        (ModelKvSpec::glm5_dsa_fp8(), 61_464.0, 8_056_209_408),
        (ModelKvSpec::llama3_70b(), 327_680.0, 42_949_672_960),
    ];
    for (spec, per_token, at_128k) in cases {
        assert_eq!(spec.bytes_per_token(), per_token, "{}", spec.model);
        assert_eq!(spec.bytes_for_tokens(T128K), at_128k, "{}", spec.model);
    }
}

#[test]
fn dsa_kv_only_rows_match() {
    // GLM-5.x KV only: 51,168 B/token; DeepSeek-V3.2 KV only: 40,016 B/token.
    let glm = ModelKvSpec::glm52_dsa_fp8();
    assert_eq!(
        glm.component("k").unwrap().bytes_per_token(78, 64),
        51_168.0
    );
    let v32 = ModelKvSpec::deepseek_v32_dsa_fp8();
    assert_eq!(
        v32.component("k").unwrap().bytes_per_token(61, 64),
        40_016.0
    );
}

#[test]
fn glm52_objects_and_layers() {
    let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 5).unwrap();
    let kv = g.component_by_name("k").unwrap();
    let ix = g.component_by_name("indexer").unwrap();
    assert_eq!(kv.page_layer_bytes, 41_984);
    assert_eq!(kv.object_bytes(), 3_274_752);
    assert_eq!(ix.page_layer_bytes, 8_448);
    assert_eq!(ix.layers.len(), 21);
    assert_eq!(ix.object_bytes(), 21 * 8_448);
    // Default map: floor(i * 78 / 21).
    assert_eq!(&ix.layers[..5], &[0, 3, 7, 11, 14]);
    assert_eq!(*ix.layers.last().unwrap(), 74);
    assert_eq!(ix.layer_range(0), Some(0..8_448));
    assert_eq!(ix.layer_range(3), Some(8_448..16_896));
    assert_eq!(ix.layer_range(1), None);
    assert!(kv.replicated && ix.replicated);
    // Replicated: every rank holds the whole row.
    assert_eq!(g.bytes_per_page(), 3_274_752 + 21 * 8_448);
    assert_eq!(g.layer_bytes_per_page(0).unwrap(), 41_984 + 8_448);
    assert_eq!(g.layer_bytes_per_page(1).unwrap(), 41_984);
    assert_eq!(g.max_layer_bytes_per_page(), 41_984 + 8_448);
    assert!(matches!(
        g.layer_bytes_per_page(78),
        Err(GeometryError::LayerOutOfRange { layer: 78, .. })
    ));
}

#[test]
fn indexer_map_is_configurable() {
    let spec = ModelKvSpec::glm52_dsa_fp8()
        .with_component_layers("indexer", LayerMap::Sparse(vec![1, 5, 77]))
        .unwrap();
    let g = KvGeometry::new(spec, 1, 0).unwrap();
    assert_eq!(
        g.component_by_name("indexer").unwrap().layers,
        vec![1, 5, 77]
    );
    let bad =
        ModelKvSpec::glm52_dsa_fp8().with_component_layers("indexer", LayerMap::Sparse(vec![5, 5]));
    assert!(matches!(bad, Err(GeometryError::BadLayerMap { .. })));
    let past =
        ModelKvSpec::glm52_dsa_fp8().with_component_layers("indexer", LayerMap::Sparse(vec![78]));
    assert!(matches!(past, Err(GeometryError::BadLayerMap { .. })));
}

#[test]
fn gqa_shards_by_head() {
    let g = KvGeometry::new(ModelKvSpec::llama3_70b(), 4, 2).unwrap();
    let k = g.component_by_name("k").unwrap();
    assert!(!k.replicated);
    assert_eq!(k.row_bytes, 2 * 128 * 2); // 2 of 8 heads
    assert_eq!(k.page_layer_bytes, 64 * 512);
    let err = KvGeometry::new(ModelKvSpec::llama3_70b(), 3, 0).unwrap_err();
    assert_eq!(
        err,
        GeometryError::HeadsNotDivisible {
            component: "k".into(),
            heads: 8,
            tp_size: 3
        }
    );
    assert!(err
        .to_string()
        .contains("8 heads do not divide by TP size 3"));
    assert!(matches!(
        KvGeometry::new(ModelKvSpec::llama3_70b(), 2, 2),
        Err(GeometryError::BadTpRank { .. })
    ));
    // A TP size past the bound is refused, even for a model with nothing to shard (which
    // no heads check would stop): a probe sized by it built a key scheme per rank.
    assert!(KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), kv_geometry::MAX_TP_SIZE, 0).is_ok());
    assert!(matches!(
        KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), u32::MAX, 0),
        Err(GeometryError::TooLarge {
            what: "TP size",
            ..
        })
    ));
}

#[test]
fn hf_configs() {
    let v3 = r#"{"model_type":"deepseek_v3","num_hidden_layers":61,"kv_lora_rank":512,"qk_rope_head_dim":64}"#;
    let s = ModelKvSpec::from_hf_config("org/model", v3, ElementType::Fp8E4m3, 64).unwrap();
    assert_eq!(s.bytes_per_token(), 35_136.0);

    let v32 = r#"{"model_type":"deepseek_v32","num_hidden_layers":61,"kv_lora_rank":512,"qk_rope_head_dim":64,"index_head_dim":128}"#;
    let s = ModelKvSpec::from_hf_config("org/model", v32, ElementType::Fp8E4m3, 64).unwrap();
    assert_eq!(
        s,
        ModelKvSpec {
            model: "org/model".into(),
            ..ModelKvSpec::deepseek_v32_dsa_fp8()
        }
    );

    let glm = r#"{"model_type":"glm_moe_dsa","num_hidden_layers":78,"kv_lora_rank":512,"qk_rope_head_dim":64,"index_head_dim":128}"#;
    let s = ModelKvSpec::from_hf_config("org/model", glm, ElementType::Fp8E4m3, 64).unwrap();
    assert_eq!(s.bytes_per_token(), 61_464.0);
    let s = s
        .with_component_layers("indexer", LayerMap::evenly_spaced(21, 78))
        .unwrap();
    assert_eq!(s.bytes_per_token(), 53_940.0);

    let llama = r#"{"model_type":"llama","num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,"hidden_size":8192}"#;
    let s = ModelKvSpec::from_hf_config("org/model", llama, ElementType::Bf16, 64).unwrap();
    assert_eq!(s.components, ModelKvSpec::llama3_70b().components);

    let qwen = r#"{"model_type":"qwen3_moe","num_hidden_layers":48}"#;
    let err = ModelKvSpec::from_hf_config("org/model", qwen, ElementType::Bf16, 64).unwrap_err();
    assert_eq!(err, GeometryError::UnsupportedModelType("qwen3_moe".into()));
    assert!(err.to_string().contains("qwen3_moe"));

    let missing = r#"{"model_type":"deepseek_v3","num_hidden_layers":61}"#;
    assert!(matches!(
        ModelKvSpec::from_hf_config("org/model", missing, ElementType::Bf16, 64),
        Err(GeometryError::BadConfig(m)) if m.contains("kv_lora_rank")
    ));
    assert!(ModelKvSpec::from_hf_config("org/model", "{", ElementType::Bf16, 64).is_err());
    // The name is the engine's, not the config's: published configs often have none, and a
    // fine-tune keeps its base's. Before, both took `model_type` here and shared a namespace.
    let v3_named = r#"{"_name_or_path":"base","model_type":"deepseek_v3","num_hidden_layers":61,"kv_lora_rank":512,"qk_rope_head_dim":64}"#;
    let r1 =
        ModelKvSpec::from_hf_config("deepseek-ai/DeepSeek-R1", v3_named, ElementType::Bf16, 64);
    assert_eq!(r1.unwrap().model, "deepseek-ai/DeepSeek-R1");
    assert!(matches!(
        ModelKvSpec::from_hf_config("", v3, ElementType::Bf16, 64),
        Err(GeometryError::BadConfig(m)) if m.contains("model name")
    ));
}
