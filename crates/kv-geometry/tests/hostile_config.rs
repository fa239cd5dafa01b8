//! config.json values that do not fit: every one is a typed error, never a panic or an abort,
//! plus a property test of the parser over arbitrary (JSON-shaped) input.

use kv_geometry::{
    ComponentSpec, ElementType, GeometryError, KvGeometry, LayerMap, ModelKvSpec, RowUnit,
    MAX_COMPONENTS, MAX_LAYERS, MAX_PAGE_SIZE, MAX_ROW_BYTES,
};
use proptest::prelude::*;

fn parse(json: &str) -> Result<ModelKvSpec, GeometryError> {
    ModelKvSpec::from_hf_config("org/model", json, ElementType::Bf16, 64)
}

#[test]
fn latent_width_overflowing_u32_is_an_error() {
    // kv_lora_rank + qk_rope_head_dim overflows u32 (hf_config.rs: the latent sum).
    let cfg = r#"{"model_type":"deepseek_v3","num_hidden_layers":61,
                  "kv_lora_rank":4294967295,"qk_rope_head_dim":64}"#;
    assert!(matches!(parse(cfg), Err(GeometryError::BadConfig(_))));
    // The sum fits but times the element size does not.
    let cfg = r#"{"model_type":"deepseek_v3","num_hidden_layers":61,
                  "kv_lora_rank":3000000000,"qk_rope_head_dim":64}"#;
    assert!(overflows(parse(cfg)));
}

#[test]
fn llama_row_overflowing_u32_is_an_error() {
    let cfg = r#"{"model_type":"llama","num_hidden_layers":80,"num_attention_heads":64,
                  "num_key_value_heads":65536,"head_dim":65536}"#;
    assert!(overflows(parse(cfg)));
}

#[test]
fn a_head_dim_that_does_not_divide_is_an_error_not_truncated() {
    // No head_dim: hidden_size / num_attention_heads must be whole (100 / 3 was taken as 33).
    let cfg = r#"{"model_type":"llama","num_hidden_layers":2,"num_attention_heads":3,
                  "num_key_value_heads":1,"hidden_size":100}"#;
    assert!(matches!(parse(cfg), Err(GeometryError::BadConfig(m)) if m.contains("multiple")));
    let cfg = r#"{"model_type":"llama","num_hidden_layers":2,"num_attention_heads":4,
                  "num_key_value_heads":1,"hidden_size":128}"#;
    assert!(parse(cfg).is_ok());
}

#[test]
fn a_spec_with_page_size_zero_has_no_whole_page() {
    let spec = ModelKvSpec {
        page_size: 0,
        ..ModelKvSpec::glm52_dsa_fp8()
    };
    assert_eq!(spec.bytes_for_tokens(64), 0);
}

#[test]
fn dsa_indexer_row_overflowing_u32_is_an_error() {
    let cfg = r#"{"model_type":"glm_moe_dsa","num_hidden_layers":78,"kv_lora_rank":512,
                  "qk_rope_head_dim":64,"index_head_dim":4294967295}"#;
    // Refused at its bound before any product is taken.
    let p = parse(cfg);
    assert!(
        matches!(
            p,
            Err(GeometryError::TooLarge {
                what: "row bytes",
                ..
            })
        ),
        "{p:?}"
    );
    let cfg = r#"{"model_type":"glm_moe_dsa","num_hidden_layers":78,"kv_lora_rank":512,
                  "qk_rope_head_dim":64,"index_head_dim":128}"#;
    let huge_pages = ModelKvSpec::from_hf_config("org/model", cfg, ElementType::Fp8E4m3, u32::MAX);
    assert!(
        matches!(
            huge_pages,
            Err(GeometryError::TooLarge {
                what: "page size",
                ..
            })
        ),
        "{huge_pages:?}"
    );
}

#[test]
fn layer_count_past_the_bound_is_refused_before_any_layer_list_is_built() {
    let cfg = r#"{"model_type":"deepseek_v3","num_hidden_layers":4294967295,
                  "kv_lora_rank":512,"qk_rope_head_dim":64}"#;
    assert!(matches!(
        parse(cfg),
        Err(GeometryError::TooLarge { what: "layers", .. })
    ));
    // A spec built by hand (public fields) past the bound: KvGeometry refuses it too, rather
    // than allocate a position per layer.
    let spec = ModelKvSpec {
        num_layers: u32::MAX,
        ..ModelKvSpec::deepseek_v3(ElementType::Bf16)
    };
    assert!(matches!(
        KvGeometry::new(spec, 1, 0),
        Err(GeometryError::TooLarge { .. })
    ));
}

#[test]
fn bounds_are_inclusive_and_documented_values() {
    let row = |bytes| {
        vec![ComponentSpec::new(
            "k",
            RowUnit::Token,
            ElementType::Bytes,
            bytes,
        )]
    };
    assert!(ModelKvSpec::new("m", MAX_LAYERS, 1, row(1)).is_ok());
    assert!(ModelKvSpec::new("m", MAX_LAYERS + 1, 1, row(1)).is_err());
    assert!(ModelKvSpec::new("m", 1, MAX_PAGE_SIZE, row(1)).is_ok());
    assert!(ModelKvSpec::new("m", 1, MAX_PAGE_SIZE + 1, row(1)).is_err());
    assert!(ModelKvSpec::new("m", 1, 1, row(MAX_ROW_BYTES)).is_ok());
    assert!(ModelKvSpec::new("m", 1, 1, row(MAX_ROW_BYTES + 1)).is_err());
    // The largest spec still has objects whose sizes fit a u64 with room to spare.
    let big = ModelKvSpec::new("m", MAX_LAYERS, MAX_PAGE_SIZE, row(MAX_ROW_BYTES)).unwrap();
    let g = KvGeometry::new(big, 1, 0).unwrap();
    assert_eq!(
        g.bytes_per_page(),
        u64::from(MAX_LAYERS) * u64::from(MAX_PAGE_SIZE) * u64::from(MAX_ROW_BYTES)
    );
    assert_eq!(
        ModelKvSpec::glm52_dsa_fp8().bytes_for_tokens(u64::MAX),
        u64::MAX,
        "saturates"
    );
    let sparse = LayerMap::Sparse(vec![0, MAX_LAYERS]);
    assert!(ModelKvSpec::new("m", MAX_LAYERS, 1, row(1))
        .unwrap()
        .with_component_layers("k", sparse)
        .is_err());
}

/// At most [`MAX_COMPONENTS`] components (255: a page of that many objects of the largest
/// size, 2^56 bytes each, fits `u64`; 256 of them summed to 2^64 and wrapped).
#[test]
fn the_component_bound_keeps_a_page_in_u64() {
    let comps = |n: usize| -> Vec<ComponentSpec> {
        (0..n)
            .map(|i| ComponentSpec::new(&format!("c{i}"), RowUnit::Token, ElementType::Bytes, 1))
            .collect()
    };
    assert!(ModelKvSpec::new("m", 1, 1, comps(MAX_COMPONENTS)).is_ok());
    assert!(matches!(
        ModelKvSpec::new("m", 1, 1, comps(MAX_COMPONENTS + 1)),
        Err(GeometryError::TooLarge { .. })
    ));
    assert!((MAX_COMPONENTS as u128) << 56 <= u128::from(u64::MAX));
}

/// A component named `kvsum` is refused: its objects' keys would end in `_kvsum`, as
/// checksum companions' keys do, and be taken for companions.
#[test]
fn a_component_named_as_checksum_companions_end_is_refused() {
    let c = ComponentSpec::new("kvsum", RowUnit::Token, ElementType::Bytes, 8);
    assert!(matches!(
        ModelKvSpec::new("m", 2, 4, vec![c]),
        Err(GeometryError::BadComponent { .. })
    ));
}

/// Rows that cannot hold whole elements lay out no tensor: a bf16 row of an odd byte count, a
/// sharded bf16 row whose heads get an odd byte count each, are refused; the same bytes
/// declared as raw bytes, or with whole elements per head, are taken.
#[test]
fn rows_of_part_elements_are_refused() {
    let spec = |c: ComponentSpec| ModelKvSpec::new("m", 2, 4, vec![c]);
    let half = ComponentSpec::new("k", RowUnit::Token, ElementType::Bf16, 1153);
    assert!(
        matches!(&spec(half), Err(GeometryError::BadComponent { reason, .. }) if reason.contains("whole number of elements")),
    );
    assert!(spec(ComponentSpec::new(
        "k",
        RowUnit::Token,
        ElementType::Bytes,
        1153
    ))
    .is_ok());
    assert!(spec(ComponentSpec::new(
        "k",
        RowUnit::Token,
        ElementType::Bf16,
        1152
    ))
    .is_ok());
    // 4 heads of 3 bytes: whole bytes per head, but not whole bf16 elements.
    let split = ComponentSpec::new("v", RowUnit::Token, ElementType::Bf16, 12).sharded(4);
    assert!(
        matches!(&spec(split), Err(GeometryError::BadComponent { reason, .. }) if reason.contains("each head")),
    );
    let whole = ComponentSpec::new("v", RowUnit::Token, ElementType::Bf16, 16).sharded(4);
    assert!(spec(whole).is_ok());
}

fn json_number() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<u64>().prop_map(|v| v.to_string()),
        (0u64..5000).prop_map(|v| v.to_string()),
        Just("4294967295".to_string()),
        Just("4294967296".to_string()),
        Just("18446744073709551615".to_string()),
        Just("-1".to_string()),
        Just("1e300".to_string()),
        Just("0".to_string()),
        Just("\"64\"".to_string()),
        Just("null".to_string()),
    ]
}

fn config() -> impl Strategy<Value = String> {
    let fields = [
        "num_hidden_layers",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "index_head_dim",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
    ];
    (
        prop_oneof![
            Just("deepseek_v3"),
            Just("deepseek_v32"),
            Just("glm_moe_dsa"),
            Just("llama"),
            Just("qwen3"),
        ],
        proptest::collection::vec(proptest::option::of(json_number()), fields.len()),
    )
        .prop_map(move |(ty, values)| {
            let mut parts = vec![format!("\"model_type\":\"{ty}\"")];
            for (f, v) in fields.iter().zip(values) {
                if let Some(v) = v {
                    parts.push(format!("\"{f}\":{v}"));
                }
            }
            format!("{{{}}}", parts.join(","))
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Any config, dtype and page size: an error or a spec within the bounds whose geometry
    /// builds at TP 1 — never a panic.
    #[test]
    fn the_parser_never_panics(cfg in config(), dtype in 0usize..4, page in prop_oneof![
        Just(0u32), Just(1), Just(64), Just(MAX_PAGE_SIZE), Just(MAX_PAGE_SIZE + 1), Just(u32::MAX),
        any::<u32>()]) {
        let dtype = [ElementType::Bf16, ElementType::F16, ElementType::Fp8E4m3, ElementType::Bytes][dtype];
        if let Ok(spec) = ModelKvSpec::from_hf_config("org/model", &cfg, dtype, page) {
            prop_assert!(spec.num_layers >= 1 && spec.num_layers <= MAX_LAYERS);
            prop_assert!(spec.page_size >= 1 && spec.page_size <= MAX_PAGE_SIZE);
            prop_assert!(spec.components.iter().all(|c| c.row_bytes >= 1 && c.row_bytes <= MAX_ROW_BYTES));
            let g = KvGeometry::new(spec.clone(), 1, 0);
            prop_assert!(g.is_ok(), "{:?}", g);
            let _ = spec.bytes_for_tokens(u64::MAX);
            let _ = spec.bytes_per_token();
        }
    }

    /// Arbitrary text never panics the parser, and is refused as a bad config (no text of 200
    /// characters or fewer drawn here is a whole config of a known model).
    #[test]
    fn arbitrary_text_never_panics(text in ".{0,200}") {
        let parsed = parse(&text);
        prop_assert!(matches!(parsed, Err(GeometryError::BadConfig(_))), "{:?}", parsed);
    }
}

/// The FP8 DSA row is laid out for a 512 + 64 latent: a config with another latent, or none,
/// is refused rather than given 656-byte rows that do not fit it.
#[test]
fn an_fp8_dsa_config_with_another_latent_is_refused() {
    let fp8 = |cfg: &str| ModelKvSpec::from_hf_config("org/model", cfg, ElementType::Fp8E4m3, 64);
    let other = r#"{"model_type":"deepseek_v32","num_hidden_layers":61,"kv_lora_rank":256,
                    "qk_rope_head_dim":32}"#;
    assert!(
        matches!(fp8(other), Err(GeometryError::BadConfig(m)) if m.contains("256")),
        "{:?}",
        fp8(other)
    );
    let none = r#"{"model_type":"glm_moe_dsa","num_hidden_layers":78}"#;
    assert!(fp8(none).is_err());
    let right = r#"{"model_type":"glm_moe_dsa","num_hidden_layers":78,"kv_lora_rank":512,
                    "qk_rope_head_dim":64}"#;
    assert!(fp8(right).is_ok());
}

/// The parse failed because a size overflows (not for some other reason a wrapped value gave).
fn overflows(parsed: Result<ModelKvSpec, GeometryError>) -> bool {
    matches!(&parsed, Err(GeometryError::BadConfig(m)) if m.contains("overflows"))
}
