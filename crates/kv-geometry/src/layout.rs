//! Per-rank layout: objects (one page of one component, all its layers concatenated), the
//! byte range of a layer inside an object, and where a page's slice sits in a pool buffer.

use std::ops::Range;

use crate::{GeometryError, ModelKvSpec, RowUnit, MAX_TP_SIZE};

/// Index of a component in its model spec (and in a [`KvGeometry`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ComponentId(pub u16);

/// One component as one TP rank sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentLayout {
    /// Index in the spec.
    pub id: ComponentId,
    /// Name (last part of the object key).
    pub name: String,
    /// Same bytes on every TP rank.
    pub replicated: bool,
    /// Bytes of one row of one layer on this rank.
    pub row_bytes: u32,
    /// Rows per page: `page_size` for token rows, 1 for page rows.
    pub rows_per_page: u32,
    /// Bytes of one layer's slice of one page on this rank.
    pub page_layer_bytes: u64,
    /// Model layers carried, in object order.
    pub layers: Vec<u32>,
    /// For each model layer, its position in the object, if carried.
    position: Vec<Option<u32>>,
}

impl ComponentLayout {
    /// Bytes of one object (one page, all carried layers).
    pub fn object_bytes(&self) -> u64 {
        // Saturating, as `layer_range`, for a layout whose public fields were changed.
        self.page_layer_bytes
            .saturating_mul(self.layers.len() as u64)
    }

    /// Position of model layer `layer` in the object, or `None` if this component is not on it.
    pub fn position(&self, layer: u32) -> Option<u32> {
        self.position.get(layer as usize).copied().flatten()
    }

    /// Byte range of model layer `layer` inside one object, or `None` if not carried
    /// (saturating at `u64::MAX`, as [`slot_range`](Self::slot_range), for a layout whose
    /// public fields were changed past what [`KvGeometry::new`] builds).
    pub fn layer_range(&self, layer: u32) -> Option<Range<u64>> {
        let pos = u64::from(self.position(layer)?);
        let start = pos.saturating_mul(self.page_layer_bytes);
        Some(start..start.saturating_add(self.page_layer_bytes))
    }

    /// Byte range of page slot `slot` inside one layer's pool buffer of this component
    /// (saturating at `u64::MAX`, far past any buffer, for a slot no pool can have).
    pub fn slot_range(&self, slot: u32) -> Range<u64> {
        let start = u64::from(slot).saturating_mul(self.page_layer_bytes);
        start..start.saturating_add(self.page_layer_bytes)
    }
}

/// A model's KV as seen by one TP rank: what each object holds and where each layer is.
///
/// ```
/// use kv_geometry::{KvGeometry, ModelKvSpec};
/// let g = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 8, 3).unwrap();
/// let kv = g.component_by_name("k").unwrap();
/// assert_eq!(kv.page_layer_bytes, 64 * 656);           // 41,984 B per layer per page
/// assert_eq!(kv.object_bytes(), 78 * 64 * 656);        // 3,274,752 B per object
/// assert_eq!(kv.layer_range(2), Some(2 * 41_984..3 * 41_984));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGeometry {
    // Private: the layouts below are computed from these once, in `new`; a field changed
    // after would make keys and byte sizes disagree.
    spec: ModelKvSpec,
    tp_size: u32,
    tp_rank: u32,
    components: Vec<ComponentLayout>,
}

impl KvGeometry {
    /// The layout of `spec` on rank `tp_rank` of `tp_size`. Fails if the spec does not pass
    /// [`ModelKvSpec::validate`] (its fields are public), the rank is out of range or a
    /// sharded component's heads do not divide by `tp_size`.
    pub fn new(spec: ModelKvSpec, tp_size: u32, tp_rank: u32) -> Result<Self, GeometryError> {
        spec.validate()?;
        if tp_size == 0 || tp_rank >= tp_size {
            return Err(GeometryError::BadTpRank { tp_rank, tp_size });
        }
        crate::model::at_most("TP size", u64::from(tp_size), u64::from(MAX_TP_SIZE))?;
        let mut components = Vec::with_capacity(spec.components.len());
        for (i, c) in spec.components.iter().enumerate() {
            let row_bytes = c.rank_row_bytes(tp_size)?;
            let rows_per_page = match c.row_unit {
                RowUnit::Token => spec.page_size,
                RowUnit::Page => 1,
            };
            let layers = c.layers.layers(spec.num_layers);
            let mut position = vec![None; spec.num_layers as usize];
            for (p, &l) in layers.iter().enumerate() {
                position[l as usize] = Some(p as u32);
            }
            components.push(ComponentLayout {
                id: ComponentId(i as u16),
                name: c.name.clone(),
                replicated: c.is_replicated(),
                row_bytes,
                rows_per_page,
                page_layer_bytes: u64::from(rows_per_page) * u64::from(row_bytes),
                layers,
                position,
            });
        }
        Ok(KvGeometry {
            spec,
            tp_size,
            tp_rank,
            components,
        })
    }

    /// The model.
    pub fn spec(&self) -> &ModelKvSpec {
        &self.spec
    }

    /// Tensor-parallel size.
    pub fn tp_size(&self) -> u32 {
        self.tp_size
    }

    /// This rank.
    pub fn tp_rank(&self) -> u32 {
        self.tp_rank
    }

    /// Layers of the model.
    pub fn num_layers(&self) -> u32 {
        self.spec.num_layers
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.spec.page_size
    }

    /// All components, in spec order.
    pub fn components(&self) -> &[ComponentLayout] {
        &self.components
    }

    /// The component with this id.
    pub fn component(&self, id: ComponentId) -> Result<&ComponentLayout, GeometryError> {
        self.components
            .get(usize::from(id.0))
            .ok_or_else(|| GeometryError::UnknownComponent(format!("#{}", id.0)))
    }

    /// The component with this name.
    pub fn component_by_name(&self, name: &str) -> Result<&ComponentLayout, GeometryError> {
        self.components
            .iter()
            .find(|c| c.name == name)
            .ok_or_else(|| GeometryError::UnknownComponent(name.to_string()))
    }

    /// Bytes of one page on this rank over all layers and components.
    pub fn bytes_per_page(&self) -> u64 {
        self.components.iter().map(|c| c.object_bytes()).sum()
    }

    /// Bytes of the widest layer of one page on this rank (the most any one layer's slices of
    /// a page add up to): what a per-layer staging buffer needs per page.
    pub fn max_layer_bytes_per_page(&self) -> u64 {
        (0..self.spec.num_layers)
            .map(|l| self.layer_bytes_per_page(l).unwrap_or(0))
            .max()
            .unwrap_or(0)
    }

    /// Bytes of layer `layer` of one page on this rank, over the components that carry it.
    pub fn layer_bytes_per_page(&self, layer: u32) -> Result<u64, GeometryError> {
        if layer >= self.spec.num_layers {
            return Err(GeometryError::LayerOutOfRange {
                layer,
                num_layers: self.spec.num_layers,
            });
        }
        Ok(self
            .components
            .iter()
            .filter(|c| c.position(layer).is_some())
            .map(|c| c.page_layer_bytes)
            .sum())
    }
}
