//! The latent row format: `kv_lora_rank` compressed-KV elements then `rope_dim` rope-key
//! elements, in one dtype, one row per token per layer (DeepSeek-V3's MLA cache).

use candle_core::{DType, Tensor};
use kv_geometry::{ComponentLayout, ElementType, KvGeometry, RowUnit};

use crate::CandleKvError;

/// How one latent row is laid out in the pool: `[c_kv (kv_lora_rank) | k_pe (rope_dim)]`,
/// every element `dtype`. DeepSeek-V3: 512 + 64 in bf16 = 1152 B.
///
/// ```
/// use kvlink_candle::{candle_core::DType, LatentFormat};
/// let f = LatentFormat::new(512, 64, DType::BF16).unwrap();
/// assert_eq!((f.width(), f.row_bytes()), (576, 1152));
/// assert!(LatentFormat::new(512, 64, DType::U32).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LatentFormat {
    /// Elements of the compressed KV (`c_kv`), first in the row.
    pub kv_lora_rank: usize,
    /// Elements of the shared rope key (`k_pe`), after `c_kv`.
    pub rope_dim: usize,
    /// Element type in the pool (f32, bf16 or f16).
    pub dtype: DType,
}

impl LatentFormat {
    /// A format; refuses empty rows, rows larger than a pool row can be (`u32` bytes), and
    /// dtypes the adapter does not move (anything but f32, bf16, f16).
    pub fn new(kv_lora_rank: usize, rope_dim: usize, dtype: DType) -> Result<Self, CandleKvError> {
        if kv_lora_rank == 0 {
            return Err(CandleKvError::Format(
                "kv_lora_rank must be non-zero".into(),
            ));
        }
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(CandleKvError::Format(format!(
                "dtype {dtype:?} is not supported (f32, bf16, f16)"
            )));
        }
        // `width` and `row_bytes` are plain arithmetic: refuse sizes they cannot hold.
        let fits = kv_lora_rank
            .checked_add(rope_dim)
            .and_then(|w| w.checked_mul(dtype.size_in_bytes()))
            .is_some_and(|b| u32::try_from(b).is_ok());
        if !fits {
            return Err(CandleKvError::Format(format!(
                "a row of {kv_lora_rank} + {rope_dim} elements of {dtype:?} is larger than a \
                 pool row can be"
            )));
        }
        Ok(LatentFormat {
            kv_lora_rank,
            rope_dim,
            dtype,
        })
    }

    /// Elements per row: `kv_lora_rank + rope_dim` (saturating: the fields are public, so a
    /// format built without [`new`](Self::new) may hold any sizes; [`check`](Self::check)
    /// refuses those).
    pub fn width(&self) -> usize {
        self.kv_lora_rank.saturating_add(self.rope_dim)
    }

    /// Bytes per row (saturating, as [`width`](Self::width)).
    pub fn row_bytes(&self) -> usize {
        self.width().saturating_mul(self.dtype.size_in_bytes())
    }

    /// Checks this format against a pool component: token rows, this row size, and an
    /// element type that agrees (`Bytes` components take any dtype of the right size: the
    /// engine vouches for what opaque bytes hold).
    pub fn check(
        &self,
        geometry: &KvGeometry,
        component: &ComponentLayout,
    ) -> Result<(), CandleKvError> {
        // A format built as a struct literal has not been through `new`'s checks.
        Self::new(self.kv_lora_rank, self.rope_dim, self.dtype)?;
        let spec = geometry.spec().component(&component.name)?;
        if spec.row_unit != RowUnit::Token || component.rows_per_page != geometry.page_size() {
            return Err(CandleKvError::Format(format!(
                "component `{}` does not keep one row per token",
                component.name
            )));
        }
        // An MLA latent is the same bytes on every rank: a component split among the ranks
        // holds a slice of heads here, which `split` would cut as `[c_kv | k_pe]`.
        if !component.replicated && geometry.tp_size() > 1 {
            return Err(CandleKvError::Format(format!(
                "component `{}` is split among the {} TP ranks (a slice of heads on each), not \
                 a latent every rank holds whole",
                component.name,
                geometry.tp_size()
            )));
        }
        if component.row_bytes as usize != self.row_bytes() {
            return Err(CandleKvError::Format(format!(
                "component `{}` rows are {} B on this rank; {} x {:?} is {} B",
                component.name,
                component.row_bytes,
                self.width(),
                self.dtype,
                self.row_bytes()
            )));
        }
        let agrees = match spec.element {
            ElementType::Bf16 => self.dtype == DType::BF16,
            ElementType::F16 => self.dtype == DType::F16,
            ElementType::F32 => self.dtype == DType::F32,
            ElementType::Bytes => true,
            // FP8 and any later format: not a dtype this adapter moves.
            _ => false,
        };
        if !agrees {
            return Err(CandleKvError::Format(format!(
                "component `{}` holds {:?}, not {:?}",
                component.name, spec.element, self.dtype
            )));
        }
        Ok(())
    }

    /// The two-tensor form mistral.rs keeps: `(c_kv, k_pe)` of a latent tensor whose last
    /// dimension is [`width`](Self::width) (views, no copy).
    pub fn split(&self, latent: &Tensor) -> Result<(Tensor, Tensor), CandleKvError> {
        let dims = latent.dims();
        if dims.last() != Some(&self.width()) {
            return Err(CandleKvError::Shape {
                expected: format!("[.., {}]", self.width()),
                got: dims.to_vec(),
            });
        }
        let last = dims.len() - 1;
        Ok((
            latent.narrow(last, 0, self.kv_lora_rank)?,
            latent.narrow(last, self.kv_lora_rank, self.rope_dim)?,
        ))
    }
}

/// The little-endian bytes of `t` (any shape, any layout), which must already be `dtype`.
pub(crate) fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>, CandleKvError> {
    let flat = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::F32 => flat
            .to_vec1::<f32>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => flat
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => flat
            .to_vec1::<half::f16>()?
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        other => {
            return Err(CandleKvError::Format(format!(
                "dtype {other:?} is not supported (f32, bf16, f16)"
            )))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_whose_row_cannot_be_counted_are_refused() {
        assert!(LatentFormat::new(usize::MAX, 1, DType::F32).is_err());
        assert!(LatentFormat::new(usize::MAX / 2, 0, DType::F32).is_err());
        assert!(LatentFormat::new(1 << 31, 0, DType::BF16).is_err());
        let glm = LatentFormat::new(512, 64, DType::BF16).unwrap();
        assert_eq!((glm.width(), glm.row_bytes()), (576, 1152));
    }

    fn geometry_of(element: ElementType, row_bytes: u32) -> KvGeometry {
        use kv_geometry::{ComponentSpec, ModelKvSpec};
        let spec = ModelKvSpec::new(
            "m",
            2,
            4,
            vec![ComponentSpec::new("k", RowUnit::Token, element, row_bytes)],
        )
        .unwrap();
        KvGeometry::new(spec, 1, 0).unwrap()
    }

    /// A component split among TP ranks is refused at TP > 1 even when a rank's slice has the
    /// latent's row size: it is a slice of heads, not `[c_kv | k_pe]`. Before, it passed.
    #[test]
    fn a_component_split_among_ranks_is_no_latent() {
        use kv_geometry::{ComponentSpec, ModelKvSpec};
        let format = LatentFormat::new(8, 4, DType::F32).unwrap();
        // 2 heads of one latent row each: at TP 2 a rank's slice is one latent row's size.
        let rows = 2 * format.row_bytes() as u32;
        let spec = ModelKvSpec::new(
            "m",
            2,
            4,
            vec![ComponentSpec::new("k", RowUnit::Token, ElementType::F32, rows).sharded(2)],
        )
        .unwrap();
        let tp2 = KvGeometry::new(spec.clone(), 2, 1).unwrap();
        assert_eq!(tp2.components()[0].row_bytes as usize, format.row_bytes());
        assert!(matches!(
            format.check(&tp2, &tp2.components()[0]),
            Err(CandleKvError::Format(m)) if m.contains("split among the 2 TP ranks")
        ));
    }

    /// A component's element type must be the format's dtype (f32 latents included: they had
    /// no element type of their own and were declared opaque bytes); opaque bytes take any
    /// dtype of the row's size; FP8 none.
    #[test]
    fn element_type_must_agree_with_the_dtype() {
        let cases = [
            (ElementType::F32, DType::F32, true),
            (ElementType::F32, DType::BF16, false),
            (ElementType::Bf16, DType::BF16, true),
            (ElementType::Bf16, DType::F16, false),
            (ElementType::F16, DType::F16, true),
            (ElementType::Bytes, DType::F32, true),
            (ElementType::Bytes, DType::BF16, true),
            (ElementType::Fp8E4m3, DType::BF16, false),
        ];
        for (element, dtype, ok) in cases {
            let format = LatentFormat::new(8, 4, dtype).unwrap();
            let g = geometry_of(element, format.row_bytes() as u32);
            let got = format.check(&g, &g.components()[0]);
            assert_eq!(got.is_ok(), ok, "{element:?} with {dtype:?}: {got:?}");
        }
    }
}
