//! Geometry fingerprints pinned against an independent implementation of their documented
//! encoding, and the namespaces built from them: keys of different models or KV formats never
//! collide by default, and SGLang's scheme is one call away.
//!
//! The literals were computed with Python's hashlib from the encoding documented on
//! `KvGeometry::fingerprint` (version 1):
//! ```python
//! def enc(num_layers, page, tp, comps):
//!     b = b"kvlink.geometry" + bytes([1]) + struct.pack("<II", num_layers, page)
//!     b += struct.pack("<I", tp if any(c['heads'] is not None for c in comps) else 0)
//!     b += struct.pack("<I", len(comps))
//!     for c in comps:
//!         b += struct.pack("<I", len(c['name'])) + c['name'].encode()
//!         b += bytes([c['unit'], c['elem']]) + struct.pack("<I", c['row'])
//!         b += bytes([0]) if c['heads'] is None else bytes([1]) + struct.pack("<I", c['heads'])
//!         if c['layers'] is None or len(c['layers']) == num_layers: b += bytes([0])
//!         else: b += bytes([1]) + struct.pack("<I", len(c['layers'])) + b"".join(struct.pack("<I", l) for l in c['layers'])
//!     return hashlib.sha256(b).hexdigest()
//! ```

use kv_geometry::{
    page_hashes, ComponentSpec, ElementType, KeyScheme, KvGeometry, LayerMap, ModelKvSpec,
    Namespace, PageHash, RowUnit,
};

const GLM52_FP: &str = "395b645d8fbcb7ad8e1192901f41c2772143f51a50e9a5eee0de717b333dc4b2";
const V3_BF16_FP: &str = "cc99701523f3552982006024659f15c7ff0070689396d06bc2d1faec0a60116d";
const LLAMA70_TP8_FP: &str = "63e70bb4423f72c824cd7b5e3aab02cb4602762b81929258b47466fbe57a0d08";

fn geometry(spec: ModelKvSpec, tp: u32) -> KvGeometry {
    KvGeometry::new(spec, tp, tp - 1).unwrap()
}

#[test]
fn fingerprints_match_the_documented_encoding() {
    let glm = geometry(ModelKvSpec::glm52_dsa_fp8(), 8);
    assert_eq!(glm.fingerprint().to_string(), GLM52_FP);
    assert_eq!(glm.fingerprint().short(), &GLM52_FP[..16]);
    let v3 = geometry(ModelKvSpec::deepseek_v3(ElementType::Bf16), 1);
    assert_eq!(v3.fingerprint().to_string(), V3_BF16_FP);
    let llama = geometry(ModelKvSpec::llama3_70b(), 8);
    assert_eq!(llama.fingerprint().to_string(), LLAMA70_TP8_FP);
}

#[test]
fn fingerprints_follow_the_bytes_and_nothing_else() {
    let fp = |spec: ModelKvSpec, tp: u32, rank: u32| {
        KvGeometry::new(spec, tp, rank).unwrap().fingerprint()
    };
    let glm = ModelKvSpec::glm52_dsa_fp8();
    // Not the rank, not the name, not the TP size of replicated-only models.
    assert_eq!(fp(glm.clone(), 8, 0), fp(glm.clone(), 8, 7));
    assert_eq!(fp(glm.clone(), 8, 0), fp(glm.clone(), 1, 0));
    let renamed = ModelKvSpec {
        model: "other".into(),
        ..glm.clone()
    };
    assert_eq!(fp(glm.clone(), 1, 0), fp(renamed, 1, 0));
    // A sparse map of every layer is "every layer".
    let all: Vec<u32> = (0..78).collect();
    let dense_ix = glm
        .clone()
        .with_component_layers("indexer", LayerMap::Dense)
        .unwrap();
    let listed_ix = glm
        .clone()
        .with_component_layers("indexer", LayerMap::Sparse(all))
        .unwrap();
    assert_eq!(fp(dense_ix.clone(), 1, 0), fp(listed_ix, 1, 0));
    assert_ne!(fp(dense_ix, 1, 0), fp(glm.clone(), 1, 0));
    // Dtype, page size, rows, layers, heads and (for sharded models) TP size all count.
    let v3 = |dtype| ModelKvSpec::deepseek_v3(dtype);
    assert_ne!(
        fp(v3(ElementType::Bf16), 1, 0),
        fp(v3(ElementType::Fp8E4m3), 1, 0)
    );
    let paged = |page: u32| {
        ModelKvSpec::new(
            "m",
            4,
            page,
            vec![ComponentSpec::new(
                "k",
                RowUnit::Token,
                ElementType::Bf16,
                64,
            )],
        )
        .unwrap()
    };
    assert_ne!(fp(paged(32), 1, 0), fp(paged(64), 1, 0));
    assert_ne!(
        fp(ModelKvSpec::llama3_70b(), 8, 0),
        fp(ModelKvSpec::llama3_70b(), 4, 0)
    );
    // Same process, a clone: the same value (no address, no randomness in it).
    assert_eq!(fp(glm.clone(), 2, 1), fp(glm, 2, 1));
}

#[test]
fn default_namespaces_tell_models_and_formats_apart() {
    let ns = |spec: ModelKvSpec| Namespace::default().resolve(&geometry(spec, 1));
    let v3 = ModelKvSpec {
        model: "deepseek-ai/DeepSeek-V3".into(),
        ..ModelKvSpec::deepseek_v3(ElementType::Bf16)
    };
    let r1 = ModelKvSpec {
        model: "deepseek-ai/DeepSeek-R1".into(),
        ..v3.clone()
    };
    assert_eq!(
        ns(v3.clone()),
        format!("deepseek-ai~2fDeepSeek-V3-bf16-p64-g{}", &V3_BF16_FP[..16])
    );
    // Same shapes, other model; same model, other KV dtype: other keys.
    assert_ne!(ns(v3.clone()), ns(r1));
    assert_ne!(
        ns(v3.clone()),
        ns(ModelKvSpec {
            model: v3.model.clone(),
            ..ModelKvSpec::deepseek_v3(ElementType::Fp8E4m3)
        })
    );
    assert_eq!(
        ns(ModelKvSpec::glm52_dsa_fp8()),
        format!("GLM-5.2-bytes-p64-g{}", &GLM52_FP[..16])
    );
    // Odd characters never reach a key.
    let odd = ModelKvSpec {
        model: "a b_c/d\0e".into(),
        ..ModelKvSpec::deepseek_v3(ElementType::Bf16)
    };
    assert!(ns(odd).starts_with("a~20b~5fc~2fd~00e-bf16-p64-g"));
    // Names that differ only in bytes outside the kept set differ in their namespaces.
    // Before, each of these bytes became `-` and these three shared one.
    let named = |model: &str| {
        ns(ModelKvSpec {
            model: model.into(),
            ..ModelKvSpec::deepseek_v3(ElementType::Bf16)
        })
    };
    let (a, b, c) = (named("org/m_1"), named("org-m-1"), named("org/m-1"));
    assert!(a != b && b != c && a != c, "{a} {b} {c}");
    assert_ne!(named("é"), named("è"));
}

#[test]
fn the_sglang_namespace_gives_sglangs_keys() {
    // SGLang's direct linker: "{tag}_{model path, / -> -}_{sha256 hex}_cp{c}_pp{p}_{pool}".
    let g = geometry(ModelKvSpec::glm52_dsa_fp8(), 8);
    let tokens: Vec<u32> = (0..64).collect();
    let page = page_hashes(&tokens, 64, None)[0];
    let hex = "fea7b32778ecbdd7adee1941e98c89cf96bbc762f5f1beb0be24e36a456fbbc5";
    assert_eq!(page, PageHash::from_hex(hex).unwrap());
    let ns = Namespace::sglang("prod", "zai-org/GLM-5.2-FP8").resolve(&g);
    let keys = KeyScheme::new(&ns, 3, 0, 0);
    assert_eq!(
        keys.object_key(&page, g.component_by_name("k").unwrap()),
        format!("prod_zai-org-GLM-5.2-FP8_{hex}_cp0_pp0_k")
    );
    assert_eq!(
        keys.object_key(&page, g.component_by_name("indexer").unwrap()),
        format!("prod_zai-org-GLM-5.2-FP8_{hex}_cp0_pp0_indexer")
    );
    // Either part may be absent, as in SGLang.
    assert_eq!(Namespace::sglang("", "org/m").resolve(&g), "org-m");
    assert_eq!(Namespace::sglang("tag", "").resolve(&g), "tag");
    assert_eq!(Namespace::sglang("", "").resolve(&g), "");
}

/// `KvGeometry::group_fingerprint` (version 1), from Python's hashlib over its documented
/// encoding: `sha256(b"kvlink.group" + bytes([1]) + fingerprint + pack("<I", tp) +
/// pack("<I", len(model)) + model)`.
const GLM52_TP8_GROUP: &str = "27fab14a05a19f62845e3d2a7850438cec3b2bee9c584142468db8997b436d5a";

#[test]
fn group_fingerprints_match_the_documented_encoding() {
    let r7 = geometry(ModelKvSpec::glm52_dsa_fp8(), 8);
    let r0 = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
    assert_eq!(r7.group_fingerprint().to_string(), GLM52_TP8_GROUP);
    assert_eq!(r0.group_fingerprint(), r7.group_fingerprint());
    // Replicated objects ignore the TP size; a group does not.
    let tp4 = geometry(ModelKvSpec::glm52_dsa_fp8(), 4);
    assert_eq!(tp4.fingerprint(), r7.fingerprint());
    assert_ne!(tp4.group_fingerprint(), r7.group_fingerprint());
}
