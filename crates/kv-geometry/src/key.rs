//! Object keys: `{namespace}_{page hash}_{suffix}_{component}`.

use crate::{ComponentLayout, PageHash};

/// How object keys are named for one rank: the namespace and the parallel ranks that go in
/// the suffix. Replicated components carry `cp{c}_pp{p}`; sharded ones `tp{t}_cp{c}_pp{p}`, so
/// all TP ranks share one copy of a replicated object.
///
/// ```
/// use kv_geometry::{KeyScheme, KvGeometry, ModelKvSpec, PageHash};
/// let g = KvGeometry::new(ModelKvSpec::llama3_70b(), 2, 1).unwrap();
/// let keys = KeyScheme::new("ns", 1, 0, 0);
/// let page = PageHash([0xab; 32]);
/// let k = keys.object_key(&page, g.component_by_name("v").unwrap());
/// assert_eq!(k, format!("ns_{}_tp1_cp0_pp0_v", "ab".repeat(32)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyScheme {
    /// Prefix shared by all keys of a deployment (model and tag); may be empty.
    pub namespace: String,
    /// This rank's TP rank (used for sharded components only).
    pub tp_rank: u32,
    /// Context-parallel rank.
    pub cp_rank: u32,
    /// Pipeline-parallel rank.
    pub pp_rank: u32,
}

impl KeyScheme {
    /// A key scheme for one rank.
    pub fn new(namespace: &str, tp_rank: u32, cp_rank: u32, pp_rank: u32) -> Self {
        KeyScheme {
            namespace: namespace.to_string(),
            tp_rank,
            cp_rank,
            pp_rank,
        }
    }

    /// The key of one page of one component.
    pub fn object_key(&self, page: &PageHash, component: &ComponentLayout) -> String {
        let mut key = String::with_capacity(self.namespace.len() + 96);
        self.write_key(&mut key, page, component);
        key
    }

    /// Appends the key of one page of one component to `out` (no allocation when `out` has
    /// room).
    pub fn write_key(&self, out: &mut String, page: &PageHash, component: &ComponentLayout) {
        use std::fmt::Write;
        if !self.namespace.is_empty() {
            out.push_str(&self.namespace);
            out.push('_');
        }
        // Writing into a String cannot fail.
        let _ = write!(out, "{page}_");
        if !component.replicated {
            let _ = write!(out, "tp{}_", self.tp_rank);
        }
        let _ = write!(
            out,
            "cp{}_pp{}_{}",
            self.cp_rank, self.pp_rank, component.name
        );
    }
}
