//! Object keys: `{namespace}_{page hash}_{suffix}_{component}`, and the namespaces that keep
//! one model's keys apart from another's.

use crate::{ComponentLayout, KvGeometry, PageHash};

/// The prefix of every key of a deployment: what keeps two models (or two KV formats of one
/// model) from reading each other's objects.
///
/// - [`Namespace::Model`] (the default): derived from the geometry, see
///   [`Namespace::of_model`]. Two models with the same shapes (DeepSeek-V3 and R1) differ by
///   name ([`ModelKvSpec::model`](crate::ModelKvSpec::model): a preset names its
///   architecture's reference checkpoint, so an engine serving another checkpoint of it sets
///   its own name); one model in another KV dtype or page size differs by those.
/// - [`Namespace::sglang`]: SGLang's scheme, `{tag}_{model path with / → -}`, for sharing a
///   cache with SGLang's Mooncake direct linker (its keys then match kvlink's byte for byte;
///   SGLang's HiCache `MooncakeStore` path uses other suffixes, see [`KeyScheme`]).
/// - [`Namespace::Exact`]: any prefix, given as is (`""`: none). `"text".into()` makes one.
///
/// Only [`Namespace::Model`] commits to the KV format (its fingerprint). Under an exact or
/// SGLang prefix, two deployments whose objects have the same size but other bytes (bf16
/// against f16 latents, another layer map of the same count) share keys, and nothing in the
/// objects or their checksum companions tells them apart (the companions record sizes, not
/// the format): each would load the other's KV as its own, verified. Give such prefixes one
/// KV format each (a tag per dtype, say), as SGLang's own keys require.
///
/// ```
/// use kv_geometry::{KvGeometry, ModelKvSpec, Namespace};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
/// let ns = Namespace::default().resolve(&g);
/// assert!(ns.starts_with("GLM-5.2-bytes-p64-g"));
/// assert_eq!(Namespace::sglang("prod", "zai-org/GLM-5").resolve(&g), "prod_zai-org-GLM-5");
/// assert_eq!(Namespace::from("mine").resolve(&g), "mine");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub enum Namespace {
    /// Derived from the model and its KV format ([`Namespace::of_model`]).
    #[default]
    Model,
    /// Exactly this prefix (may be empty: no prefix).
    Exact(String),
}

impl Namespace {
    /// SGLang's key prefix (`MooncakeStore._tag_keys`): `{tag}_{model_path}` with every `/` of
    /// the model path turned into `-`; an empty part is left out (with its `_`), as SGLang
    /// does for an unset tag. (A tag set to the empty string makes SGLang's keys start with
    /// `_`: give that prefix as [`Namespace::Exact`].)
    pub fn sglang(tag: &str, model_path: &str) -> Namespace {
        let path = model_path.replace('/', "-");
        let parts: Vec<&str> = [tag, path.as_str()]
            .into_iter()
            .filter(|p| !p.is_empty())
            .collect();
        Namespace::Exact(parts.join("_"))
    }

    /// The namespace of a model and its KV format:
    /// `{model}-{element types}-p{page size}-g{fingerprint}`, where the model's name keeps
    /// ASCII letters, digits, `.` and `-`, and every other byte becomes `~` and its two hex
    /// digits (`/` is `~2f`: two names never share a namespace), the element types are
    /// the components' (`+`-joined, in spec order, each once), and the fingerprint is the
    /// first 16 hex characters of [`KvGeometry::fingerprint`].
    pub fn of_model(geometry: &KvGeometry) -> String {
        let spec = geometry.spec();
        let model: String = spec
            .model
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b == b'.' || b == b'-' {
                    char::from(b).to_string()
                } else {
                    format!("~{b:02x}")
                }
            })
            .collect();
        let mut elements: Vec<&str> = Vec::new();
        for c in &spec.components {
            if !elements.contains(&c.element.name()) {
                elements.push(c.element.name());
            }
        }
        format!(
            "{model}-{}-p{}-g{}",
            elements.join("+"),
            spec.page_size,
            geometry.fingerprint().short()
        )
    }

    /// The prefix this namespace gives keys of `geometry`.
    pub fn resolve(&self, geometry: &KvGeometry) -> String {
        match self {
            Namespace::Model => Self::of_model(geometry),
            Namespace::Exact(s) => s.clone(),
        }
    }
}

impl From<&str> for Namespace {
    fn from(s: &str) -> Self {
        Namespace::Exact(s.to_string())
    }
}

impl From<String> for Namespace {
    fn from(s: String) -> Self {
        Namespace::Exact(s)
    }
}

impl From<&String> for Namespace {
    fn from(s: &String) -> Self {
        Namespace::Exact(s.clone())
    }
}

/// How object keys are named for one rank: the namespace and the parallel ranks that go in
/// the suffix. Replicated components carry `cp{c}_pp{p}`; sharded ones `tp{t}_cp{c}_pp{p}`, so
/// all TP ranks share one copy of a replicated object. These are the keys of SGLang's
/// Mooncake direct linker (`_storage_suffix`), which builds pools for DSA and DeepSeek-V4
/// models only: sharded MHA components' keys have no SGLang writer today. SGLang's HiCache
/// `MooncakeStore` names pages `{hash}__k` (MLA) or `{hash}_{tp}_k` / `_v` (MHA), which this
/// scheme does not produce.
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
