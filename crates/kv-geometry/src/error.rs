//! Errors of geometry construction and lookups.

/// What went wrong building or querying a KV geometry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// A sharded component's heads do not divide evenly by the tensor-parallel size.
    #[error("component `{component}`: {heads} heads do not divide by TP size {tp_size}")]
    HeadsNotDivisible {
        /// Component name.
        component: String,
        /// Heads of the component.
        heads: u32,
        /// Tensor-parallel size.
        tp_size: u32,
    },
    /// The TP rank is not below the TP size, or the size is zero.
    #[error("TP rank {tp_rank} is out of range for TP size {tp_size}")]
    BadTpRank {
        /// Rank asked for.
        tp_rank: u32,
        /// TP size.
        tp_size: u32,
    },
    /// The page size is zero.
    #[error("bad page size {page_size}: {reason}")]
    BadPageSize {
        /// Page size in tokens.
        page_size: u32,
        /// Why it is refused.
        reason: String,
    },
    /// A layer index is not below the model's layer count.
    #[error("layer {layer} is out of range for a model of {num_layers} layers")]
    LayerOutOfRange {
        /// Layer asked for.
        layer: u32,
        /// Layers of the model.
        num_layers: u32,
    },
    /// A sparse layer map is empty, unsorted, has duplicates, or names a layer past the model.
    #[error("component `{component}`: bad layer map: {reason}")]
    BadLayerMap {
        /// Component name.
        component: String,
        /// Why it is refused.
        reason: String,
    },
    /// A component has a zero-byte row, or two components share a name.
    #[error("component `{component}`: {reason}")]
    BadComponent {
        /// Component name.
        component: String,
        /// Why it is refused.
        reason: String,
    },
    /// A number past kvlink's documented bound ([`MAX_LAYERS`](crate::MAX_LAYERS),
    /// [`MAX_PAGE_SIZE`](crate::MAX_PAGE_SIZE), [`MAX_ROW_BYTES`](crate::MAX_ROW_BYTES),
    /// [`MAX_COMPONENTS`](crate::MAX_COMPONENTS), [`MAX_TP_SIZE`](crate::MAX_TP_SIZE)):
    /// refused before anything is sized by it.
    #[error("{what}: {value} is more than the most kvlink takes ({max})")]
    TooLarge {
        /// What was counted.
        what: &'static str,
        /// The value given (saturated at `u64::MAX`).
        value: u64,
        /// The bound.
        max: u64,
    },
    /// No component of that name in the model.
    #[error("no component `{0}` in this model")]
    UnknownComponent(String),
    /// A Hugging Face `config.json` names a model type kvlink does not know.
    #[error("unsupported model type `{0}` (known: deepseek_v3, deepseek_v32, glm_moe_dsa, llama)")]
    UnsupportedModelType(String),
    /// A Hugging Face `config.json` could not be parsed or lacks a field.
    #[error("config.json: {0}")]
    BadConfig(String),
    /// A KV dtype this model family cannot store.
    #[error("KV dtype {dtype:?} is not supported for {model}")]
    UnsupportedKvDtype {
        /// The dtype asked for.
        dtype: crate::ElementType,
        /// The model family.
        model: String,
    },
}
