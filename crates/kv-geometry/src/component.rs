//! KV components: one kind of row (MLA latent, DSA FP8 KV, DSA indexer, MHA K or V).

use crate::{ElementType, GeometryError};

/// What one row of a component covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowUnit {
    /// One row per token; a page is `page_size` consecutive rows.
    Token,
    /// One row per page (the DSA indexer keeps a page's keys and scales in one row).
    Page,
}

/// Which model layers carry a component.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LayerMap {
    /// Every layer of the model.
    Dense,
    /// Only these model layers, strictly increasing.
    Sparse(Vec<u32>),
}

impl LayerMap {
    /// The model layers carried, in order, for a model of `num_layers` layers.
    pub fn layers(&self, num_layers: u32) -> Vec<u32> {
        match self {
            LayerMap::Dense => (0..num_layers).collect(),
            LayerMap::Sparse(v) => v.clone(),
        }
    }

    /// How many layers are carried.
    pub fn count(&self, num_layers: u32) -> u32 {
        match self {
            LayerMap::Dense => num_layers,
            LayerMap::Sparse(v) => v.len() as u32,
        }
    }

    /// `count` layers spread evenly over `num_layers`: layer `floor(i * num_layers / count)`
    /// for `i` in `0..count`. GLM-5.2's default indexer map (21 of 78) is built this way.
    pub fn evenly_spaced(count: u32, num_layers: u32) -> LayerMap {
        if count >= num_layers {
            return LayerMap::Dense;
        }
        let n = u64::from(num_layers);
        let c = u64::from(count);
        LayerMap::Sparse((0..c).map(|i| (i * n / c) as u32).collect())
    }

    pub(crate) fn validate(&self, component: &str, num_layers: u32) -> Result<(), GeometryError> {
        let LayerMap::Sparse(v) = self else {
            return Ok(());
        };
        let bad = |reason: String| GeometryError::BadLayerMap {
            component: component.to_string(),
            reason,
        };
        if v.is_empty() {
            return Err(bad("no layers".into()));
        }
        if v.windows(2).any(|w| w[0] >= w[1]) {
            return Err(bad("layers must be strictly increasing".into()));
        }
        if let Some(&last) = v.last() {
            if last >= num_layers {
                return Err(bad(format!(
                    "layer {last} is past the model's {num_layers} layers"
                )));
            }
        }
        Ok(())
    }
}

/// How a component's bytes relate across tensor-parallel ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Replication {
    /// The same bytes on every TP rank (MLA latent, DSA KV and indexer). Stored once.
    Replicated,
    /// Heads split evenly across TP ranks (MHA/GQA K and V); one object per rank.
    Sharded {
        /// KV heads of the whole model (before the split).
        heads: u32,
    },
}

/// One kind of KV row, as the model keeps it.
///
/// ```
/// use kv_geometry::{ComponentSpec, ElementType, LayerMap, Replication, RowUnit};
/// let latent = ComponentSpec::new("k", RowUnit::Token, ElementType::Bf16, 1152);
/// assert_eq!(latent.row_bytes, 1152);
/// assert_eq!(latent.replication, Replication::Replicated);
/// assert_eq!(latent.layers, LayerMap::Dense);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ComponentSpec {
    /// Name, used as the last part of object keys (`k`, `v`, `indexer`).
    pub name: String,
    /// What a row covers.
    pub row_unit: RowUnit,
    /// Element type of the row.
    pub element: ElementType,
    /// Bytes of one row of one layer for the whole model (all heads, before any TP split).
    pub row_bytes: u32,
    /// Layers that carry this component.
    pub layers: LayerMap,
    /// Replicated or sharded across TP.
    pub replication: Replication,
}

impl ComponentSpec {
    /// A dense, replicated component.
    pub fn new(name: &str, row_unit: RowUnit, element: ElementType, row_bytes: u32) -> Self {
        ComponentSpec {
            name: name.to_string(),
            row_unit,
            element,
            row_bytes,
            layers: LayerMap::Dense,
            replication: Replication::Replicated,
        }
    }

    /// The same component on only some layers.
    pub fn on_layers(mut self, layers: LayerMap) -> Self {
        self.layers = layers;
        self
    }

    /// The same component with its heads split across TP.
    pub fn sharded(mut self, heads: u32) -> Self {
        self.replication = Replication::Sharded { heads };
        self
    }

    /// True when every TP rank holds the same bytes.
    pub fn is_replicated(&self) -> bool {
        matches!(self.replication, Replication::Replicated)
    }

    /// Bytes of one row of one layer on one TP rank.
    pub fn rank_row_bytes(&self, tp_size: u32) -> Result<u32, GeometryError> {
        match self.replication {
            Replication::Replicated => Ok(self.row_bytes),
            Replication::Sharded { heads } => {
                if tp_size == 0
                    || !heads.is_multiple_of(tp_size)
                    || !self.row_bytes.is_multiple_of(heads)
                {
                    return Err(GeometryError::HeadsNotDivisible {
                        component: self.name.clone(),
                        heads,
                        tp_size,
                    });
                }
                Ok(self.row_bytes / tp_size)
            }
        }
    }

    /// Bytes this component adds per token over all its layers, for the whole model.
    /// Page-row components count `row_bytes / page_size` per token.
    pub fn bytes_per_token(&self, num_layers: u32, page_size: u32) -> f64 {
        let per_layer = match self.row_unit {
            RowUnit::Token => f64::from(self.row_bytes),
            RowUnit::Page => f64::from(self.row_bytes) / f64::from(page_size.max(1)),
        };
        per_layer * f64::from(self.layers.count(num_layers))
    }
}
