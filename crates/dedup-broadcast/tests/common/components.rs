//! Components of generated geometries (property tests).

use kv_geometry::{ComponentSpec, ElementType, LayerMap, RowUnit};

/// Component `c{i}` of plain bytes, `row_bytes` per page (`page_rows`) or per token, on the
/// `sparse` layers only or (`None`) on every layer.
pub fn byte_component(
    i: usize,
    page_rows: bool,
    row_bytes: u32,
    sparse: Option<Vec<u32>>,
) -> ComponentSpec {
    let unit = if page_rows {
        RowUnit::Page
    } else {
        RowUnit::Token
    };
    let c = ComponentSpec::new(&format!("c{i}"), unit, ElementType::Bytes, row_bytes);
    match sparse {
        Some(layers) => c.on_layers(LayerMap::Sparse(layers)),
        None => c,
    }
}
