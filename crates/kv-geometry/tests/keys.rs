//! Page hashes and keys pinned against independently computed values.
//!
//! Literals computed with Python's hashlib, SGLang's `get_hash_str` scheme:
//! ```python
//! def h(tokens, prior=None):
//!     s = hashlib.sha256()
//!     if prior: s.update(bytes.fromhex(prior))
//!     for t in tokens: s.update(t.to_bytes(4, 'little'))
//!     return s.hexdigest()
//! a = h(list(range(64))); b = h(list(range(64, 128)), a); c = h([1, 2, 3, 4]); d = h([0xffffffff] * 4)
//! ```

use kv_geometry::{page_hashes, KeyScheme, KvGeometry, ModelKvSpec, PageHash};

const A: &str = "fea7b32778ecbdd7adee1941e98c89cf96bbc762f5f1beb0be24e36a456fbbc5";
const B: &str = "1617a7384eff5e9135098c24794739af884859cdb17c1a61a834e8d6ac997351";
const C: &str = "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72";
const D: &str = "5ac6a5945f16500911219129984ba8b387a06f24fe383ce4e81a73294065461b";

#[test]
fn chained_hashes_match_hashlib() {
    let tokens: Vec<u32> = (0..150).collect();
    let pages = page_hashes(&tokens, 64, None);
    assert_eq!(pages.len(), 2, "the partial last page is not keyed");
    assert_eq!(pages[0].to_hex(), A);
    assert_eq!(pages[1].to_hex(), B);
    // Chaining from a prior digest continues the same sequence.
    let tail = page_hashes(&tokens[64..128], 64, Some(pages[0]));
    assert_eq!(tail, vec![pages[1]]);
    assert_eq!(page_hashes(&[1, 2, 3, 4], 4, None)[0].to_hex(), C);
    assert_eq!(page_hashes(&[u32::MAX; 4], 4, None)[0].to_hex(), D);
    assert_eq!(PageHash::from_hex(A), Some(pages[0]));
    assert_eq!(PageHash::from_hex("zz"), None);
}

#[test]
fn keys_have_the_exact_shape() {
    let page = PageHash::from_hex(A).unwrap();
    let glm = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 3).unwrap();
    let ks = KeyScheme::new("glm52-fp8", 3, 0, 0);
    assert_eq!(
        ks.object_key(&page, glm.component_by_name("k").unwrap()),
        format!("glm52-fp8_{A}_cp0_pp0_k")
    );
    assert_eq!(
        ks.object_key(&page, glm.component_by_name("indexer").unwrap()),
        format!("glm52-fp8_{A}_cp0_pp0_indexer")
    );
    // Replicated keys do not depend on the TP rank; sharded ones do.
    let other = KeyScheme::new("glm52-fp8", 5, 0, 0);
    assert_eq!(
        ks.object_key(&page, glm.component_by_name("k").unwrap()),
        other.object_key(&page, glm.component_by_name("k").unwrap())
    );
    let llama = KvGeometry::new(ModelKvSpec::llama3_70b(), 8, 3).unwrap();
    let ks = KeyScheme::new("", 3, 1, 2);
    assert_eq!(
        ks.object_key(&page, llama.component_by_name("k").unwrap()),
        format!("{A}_tp3_cp1_pp2_k")
    );
}
