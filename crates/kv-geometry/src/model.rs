//! Model KV specs: the components of a model's KV cache, and the presets kvlink knows.

use crate::{ComponentSpec, ElementType, GeometryError, LayerMap, Replication, RowUnit};

/// MLA latent width: `kv_lora_rank + qk_rope_head_dim` elements per token per layer.
pub const MLA_LATENT_ELEMENTS: u32 = 512 + 64;
/// DSA FP8 KV row: 512 fp8 nope + 4 fp32 scales (one per 128) + 64 bf16 rope.
pub const DSA_FP8_ROW_BYTES: u32 = 512 + (512 / 128) * 4 + 64 * 2;
/// DSA indexer head dim of DeepSeek-V3.2 and GLM-5.
pub const DSA_INDEX_HEAD_DIM: u32 = 128;
/// Indexer layers of GLM-5.2 (SGLang's host pool: "21 physical indexer layers out of 78").
pub const GLM52_INDEXER_LAYERS: u32 = 21;

/// Most layers a model may have. Generous (today's largest models have under 200), and small
/// enough that a per-layer table costs nothing: a config that names more is refused with
/// [`GeometryError::TooLarge`] before any per-layer list is built.
pub const MAX_LAYERS: u32 = 1 << 16;
/// Most tokens per page (engines use 1 to 256).
pub const MAX_PAGE_SIZE: u32 = 1 << 16;
/// Most bytes of one row of one layer, for the whole model (a 128-head MHA row of 256 f32
/// elements is 128 KiB; a DSA indexer page row at page size 64 is 8448 B).
///
/// With [`MAX_LAYERS`] and [`MAX_PAGE_SIZE`] this bounds one object at 2^56 bytes, so every
/// size kvlink computes in `u64` fits.
pub const MAX_ROW_BYTES: u32 = 1 << 24;
/// Most components a model may have. With one object of a page of a component at most 2^56
/// bytes ([`MAX_ROW_BYTES`]), a page of every component is at most 255 × 2^56 bytes, which
/// fits `u64` (256 such components would not).
pub const MAX_COMPONENTS: usize = 255;

/// Most TP ranks a geometry may be split over (as many as a rendezvous takes).
pub const MAX_TP_SIZE: u32 = 1 << 16;

/// `value` against `max`: a [`GeometryError::TooLarge`] past it.
pub(crate) fn at_most(what: &'static str, value: u64, max: u64) -> Result<(), GeometryError> {
    if value > max {
        return Err(GeometryError::TooLarge { what, value, max });
    }
    Ok(())
}

/// A model's KV cache: its layers, page size and components.
///
/// ```
/// use kv_geometry::ModelKvSpec;
/// let glm = ModelKvSpec::glm52_dsa_fp8();
/// assert_eq!(glm.num_layers, 78);
/// assert_eq!(glm.bytes_per_token(), 53_940.0);
/// assert_eq!(glm.bytes_for_tokens(131_072), 7_070_023_680);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ModelKvSpec {
    /// The checkpoint's name (a hub id or path): it names the default namespace
    /// ([`Namespace::Model`](crate::Namespace::Model)), so two checkpoints of one architecture,
    /// whose KV has the same shapes, must differ here; also in logs and errors. The presets
    /// name their architecture's reference checkpoint (`"DeepSeek-V3"`): set it when serving
    /// another (`ModelKvSpec { model: "deepseek-ai/DeepSeek-R1".into(), ..preset }`).
    pub model: String,
    /// Transformer layers.
    pub num_layers: u32,
    /// Tokens per page. A page-row component's bytes are not checked against it: the
    /// presets' DSA indexer rows are built for their page size of 64, so a spec of another
    /// page size builds its indexer with [`ModelKvSpec::dsa_indexer`] for that size.
    pub page_size: u32,
    /// Components, in object-key and load order.
    pub components: Vec<ComponentSpec>,
}

impl ModelKvSpec {
    /// A validated spec (see [`validate`](Self::validate)).
    pub fn new(
        model: &str,
        num_layers: u32,
        page_size: u32,
        components: Vec<ComponentSpec>,
    ) -> Result<Self, GeometryError> {
        let spec = ModelKvSpec {
            model: model.to_string(),
            num_layers,
            page_size,
            components,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Checks what everything above relies on: 1 to [`MAX_LAYERS`] layers, a page size of 1
    /// to [`MAX_PAGE_SIZE`] tokens, 1 to [`MAX_COMPONENTS`] components with unique,
    /// non-empty names free of `_`, rows of 1 to [`MAX_ROW_BYTES`] bytes, and layer maps
    /// inside the model. The fields are public, so [`KvGeometry::new`](crate::KvGeometry::new)
    /// checks again.
    pub fn validate(&self) -> Result<(), GeometryError> {
        let model = &self.model;
        if self.num_layers == 0 {
            return Err(GeometryError::BadConfig(format!("{model}: zero layers")));
        }
        at_most("layers", self.num_layers.into(), MAX_LAYERS.into())?;
        if self.page_size == 0 {
            return Err(GeometryError::BadPageSize {
                page_size: self.page_size,
                reason: "must be at least one token".into(),
            });
        }
        at_most("page size", self.page_size.into(), MAX_PAGE_SIZE.into())?;
        if self.components.is_empty() {
            return Err(GeometryError::BadConfig(format!(
                "{model}: no KV components"
            )));
        }
        at_most(
            "components",
            self.components.len() as u64,
            MAX_COMPONENTS as u64,
        )?;
        for (i, c) in self.components.iter().enumerate() {
            let bad = |reason: &str| GeometryError::BadComponent {
                component: c.name.clone(),
                reason: reason.to_string(),
            };
            if c.name.is_empty() || c.name.contains('_') {
                return Err(bad("name must be non-empty and free of '_'"));
            }
            if format!("_{}", c.name) == crate::CHECKSUM_KEY_SUFFIX {
                // Its objects' keys would end as checksum companions' keys do, and be taken
                // for companions (read, discarded and ordered as one).
                return Err(bad("the name is reserved for checksum companions"));
            }
            if c.row_bytes == 0 {
                return Err(bad("zero-byte rows"));
            }
            at_most("row bytes", c.row_bytes.into(), MAX_ROW_BYTES.into())?;
            let element = c.element.size();
            if !c.row_bytes.is_multiple_of(element) {
                // Half an element per row (a bf16 row of 1153 bytes) lays out no tensor.
                return Err(bad("rows must hold a whole number of elements"));
            }
            if let Replication::Sharded { heads } = c.replication {
                if heads > 0
                    && c.row_bytes.is_multiple_of(heads)
                    && !(c.row_bytes / heads).is_multiple_of(element)
                {
                    return Err(bad("each head's part of a row must hold whole elements"));
                }
            }
            if self.components[..i].iter().any(|o| o.name == c.name) {
                return Err(bad("two components share this name"));
            }
            c.layers.validate(&c.name, self.num_layers)?;
        }
        Ok(())
    }

    /// Bytes per token over all layers and components, for the whole model (one TP copy of
    /// replicated components, all shards of sharded ones).
    pub fn bytes_per_token(&self) -> f64 {
        self.components
            .iter()
            .map(|c| c.bytes_per_token(self.num_layers, self.page_size))
            .sum()
    }

    /// Bytes of a prefix of `tokens` tokens (whole pages only: a partial last page is not
    /// stored), saturating at `u64::MAX`; 0 for a spec whose page size is 0 (no whole page).
    pub fn bytes_for_tokens(&self, tokens: u64) -> u64 {
        let pages = tokens.checked_div(u64::from(self.page_size)).unwrap_or(0);
        self.components
            .iter()
            .map(|c| {
                let rows = match c.row_unit {
                    RowUnit::Token => u64::from(self.page_size),
                    RowUnit::Page => 1,
                };
                pages
                    .saturating_mul(rows)
                    .saturating_mul(u64::from(c.row_bytes))
                    .saturating_mul(u64::from(c.layers.count(self.num_layers)))
            })
            .fold(0u64, u64::saturating_add)
    }

    /// The component named `name`.
    pub fn component(&self, name: &str) -> Result<&ComponentSpec, GeometryError> {
        self.components
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| GeometryError::UnknownComponent(name.to_string()))
    }

    /// The same spec with component `name` on other layers (e.g. another indexer map).
    pub fn with_component_layers(
        mut self,
        name: &str,
        layers: LayerMap,
    ) -> Result<Self, GeometryError> {
        layers.validate(name, self.num_layers)?;
        let c = self
            .components
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| GeometryError::UnknownComponent(name.to_string()))?;
        c.layers = layers;
        Ok(self)
    }

    /// The MLA latent component in `dtype` (576 elements per token).
    pub fn mla_latent(dtype: ElementType) -> ComponentSpec {
        ComponentSpec::new(
            "k",
            RowUnit::Token,
            dtype,
            MLA_LATENT_ELEMENTS * dtype.size(),
        )
    }

    /// The DSA FP8 KV component (656 B per token: FlashMLA's V3.2 byte format).
    pub fn dsa_fp8_kv() -> ComponentSpec {
        ComponentSpec::new("k", RowUnit::Token, ElementType::Bytes, DSA_FP8_ROW_BYTES)
    }

    /// The DSA indexer component: one row per page of `page_size * (head_dim + head_dim/128*4)`
    /// bytes (fp8 keys with fp32 scales), 8448 B at page size 64. A row past `u32` saturates
    /// (and [`validate`](Self::validate) then refuses it as past [`MAX_ROW_BYTES`]).
    pub fn dsa_indexer(page_size: u32, index_head_dim: u32, layers: LayerMap) -> ComponentSpec {
        let per_token =
            index_head_dim.saturating_add(index_head_dim.div_ceil(128).saturating_mul(4));
        let row = page_size.saturating_mul(per_token);
        ComponentSpec::new("indexer", RowUnit::Page, ElementType::Bytes, row).on_layers(layers)
    }

    fn known(model: &str, num_layers: u32, page_size: u32, comps: Vec<ComponentSpec>) -> Self {
        // The presets are built from constants that satisfy `new`'s checks.
        ModelKvSpec {
            model: model.to_string(),
            num_layers,
            page_size,
            components: comps,
        }
    }

    /// GLM-5.2 with DSA FP8 KV: 78 layers, 656 B/token KV, indexer (8448 B/page) on 21 layers.
    ///
    /// Default indexer map: 21 layers evenly spaced over 78 (`floor(i * 78 / 21)`), since the
    /// public config does not say which layers they are; the byte totals match SGLang's
    /// (53,940 B/token). Override with [`ModelKvSpec::with_component_layers`].
    pub fn glm52_dsa_fp8() -> Self {
        Self::known(
            "GLM-5.2",
            78,
            64,
            vec![
                Self::dsa_fp8_kv(),
                Self::dsa_indexer(
                    64,
                    DSA_INDEX_HEAD_DIM,
                    LayerMap::evenly_spaced(GLM52_INDEXER_LAYERS, 78),
                ),
            ],
        )
    }

    /// GLM-5 with DSA FP8 KV and the indexer on every one of its 78 layers.
    pub fn glm5_dsa_fp8() -> Self {
        Self::known(
            "GLM-5",
            78,
            64,
            vec![
                Self::dsa_fp8_kv(),
                Self::dsa_indexer(64, DSA_INDEX_HEAD_DIM, LayerMap::Dense),
            ],
        )
    }

    /// DeepSeek-V3 (61 layers, MLA) with the latent in `dtype` (bf16: 1152 B, fp8: 576 B per
    /// token per layer), page size 64.
    pub fn deepseek_v3(dtype: ElementType) -> Self {
        Self::known("DeepSeek-V3", 61, 64, vec![Self::mla_latent(dtype)])
    }

    /// DeepSeek-V3.2 with DSA FP8 KV and the indexer on all 61 layers.
    pub fn deepseek_v32_dsa_fp8() -> Self {
        Self::known(
            "DeepSeek-V3.2",
            61,
            64,
            vec![
                Self::dsa_fp8_kv(),
                Self::dsa_indexer(64, DSA_INDEX_HEAD_DIM, LayerMap::Dense),
            ],
        )
    }

    /// Llama-3-70B (GQA): 80 layers, 8 KV heads × 128, bf16; K and V sharded across TP.
    pub fn llama3_70b() -> Self {
        let kv = |name: &str| {
            ComponentSpec::new(name, RowUnit::Token, ElementType::Bf16, 8 * 128 * 2).sharded(8)
        };
        Self::known("Llama-3-70B", 80, 64, vec![kv("k"), kv("v")])
    }
}
