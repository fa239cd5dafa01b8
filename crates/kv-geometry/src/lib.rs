//! What the KV bytes are: model KV specs (MLA, DSA FP8 rows and indexer page rows, MHA/GQA),
//! pages, per-layer byte ranges inside objects, TP replication, page hashes and object keys.
//!
//! Pure: no I/O, no threads. Everything above it in kvlink asks this crate where bytes go.
//!
//! - A **component** ([`ComponentSpec`]) is one kind of row: replicated across TP (MLA, DSA)
//!   or sharded by head (MHA/GQA K and V).
//! - An **object** is one (page, component): all the component's layers of that page,
//!   concatenated in layer order; [`ComponentLayout::layer_range`] is layer *l*'s bytes in it.
//! - A **page hash** ([`PageHash`]) chains SHA-256 over the page's token ids;
//!   [`KeyScheme`] turns it into the object key.
//!
//! ```
//! use kv_geometry::{page_hashes, KeyScheme, KvGeometry, ModelKvSpec};
//! let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 0).unwrap();
//! let tokens: Vec<u32> = (0..256).collect();
//! let pages = page_hashes(&tokens, g.page_size(), None);
//! let keys = KeyScheme::new("glm", 0, 0, 0);
//! let key = keys.object_key(&pages[0], g.component_by_name("indexer").unwrap());
//! assert!(key.starts_with("glm_") && key.ends_with("_cp0_pp0_indexer"));
//! ```

mod checksum;
mod component;
mod dtype;
mod error;
mod fingerprint;
mod hash;
mod hf_config;
mod key;
mod layout;
mod model;

pub use checksum::{
    checksum_key, layer_checksum, ChecksumError, ObjectChecksums, Verified, CHECKSUM_KEY_SUFFIX,
};
pub use component::{ComponentSpec, LayerMap, Replication, RowUnit};
pub use dtype::ElementType;
pub use error::GeometryError;
pub use fingerprint::{GeometryFingerprint, FINGERPRINT_VERSION};
pub use hash::{page_hashes, PageHash};
pub use key::{KeyScheme, Namespace};
pub use layout::{ComponentId, ComponentLayout, KvGeometry};
pub use model::{
    ModelKvSpec, DSA_FP8_ROW_BYTES, DSA_INDEX_HEAD_DIM, GLM52_INDEXER_LAYERS, MAX_COMPONENTS,
    MAX_LAYERS, MAX_PAGE_SIZE, MAX_ROW_BYTES, MAX_TP_SIZE, MLA_LATENT_ELEMENTS,
};
