//! Building a [`ModelKvSpec`] from a Hugging Face `config.json`.

use serde_json::Value;

use crate::model::{DSA_FP8_ROW_BYTES, DSA_INDEX_HEAD_DIM};
use crate::{ComponentSpec, ElementType, GeometryError, LayerMap, ModelKvSpec, RowUnit};

fn field_u32(cfg: &Value, name: &str) -> Result<u32, GeometryError> {
    cfg.get(name)
        .and_then(Value::as_u64)
        .and_then(|v| u32::try_from(v).ok())
        .ok_or_else(|| GeometryError::BadConfig(format!("missing or bad integer field `{name}`")))
}

/// The product of `factors` (a `None` factor already overflowed), or a typed error naming
/// `what` when it does not fit a row's `u32`. Bounds past that are
/// [`ModelKvSpec::validate`]'s.
fn product(what: &str, factors: &[Option<u32>]) -> Result<u32, GeometryError> {
    factors
        .iter()
        .try_fold(1u32, |acc, f| f.and_then(|f| acc.checked_mul(f)))
        .ok_or_else(|| GeometryError::BadConfig(format!("{what}: the row size overflows")))
}

/// An optional field: absent (or `null`) is `None`; present but not a `u32` is an error,
/// not a silent fallback to the default.
fn opt_u32(cfg: &Value, name: &str) -> Result<Option<u32>, GeometryError> {
    match cfg.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(_) => field_u32(cfg, name).map(Some),
    }
}

impl ModelKvSpec {
    /// A spec from the model's name, its Hugging Face `config.json` text, the KV cache dtype
    /// and the page size.
    ///
    /// `model` names the checkpoint the engine serves (its hub id or path, as SGLang's key
    /// prefix does): it becomes [`ModelKvSpec::model`], which names the default namespace, so
    /// two checkpoints of one architecture (DeepSeek-V3 and R1, a fine-tune and its base) have
    /// KV of the same shapes and must differ here. The config's `_name_or_path` is not used:
    /// published configs often lack it, and fine-tunes keep their base's. An empty name is
    /// refused.
    ///
    /// Known `model_type`s: `deepseek_v3` (MLA latent in `kv_dtype`), `deepseek_v32` and
    /// `glm_moe_dsa` (DSA: FP8 KV as 656 B rows when `kv_dtype` is fp8, the bf16/f16 latent
    /// otherwise, plus the indexer on every layer — override with
    /// [`ModelKvSpec::with_component_layers`]), `llama` (K and V sharded by KV head). Any other
    /// type is refused with an error naming it.
    ///
    /// Hostile or broken configs are typed errors, never a panic: a field that is not a `u32`,
    /// a row size that overflows, or a number past the bounds of [`ModelKvSpec::validate`]
    /// ([`MAX_LAYERS`](crate::MAX_LAYERS), [`MAX_PAGE_SIZE`](crate::MAX_PAGE_SIZE),
    /// [`MAX_ROW_BYTES`](crate::MAX_ROW_BYTES)).
    ///
    /// ```
    /// use kv_geometry::{ElementType, ModelKvSpec};
    /// let cfg = r#"{"model_type":"deepseek_v3","num_hidden_layers":61,
    ///               "kv_lora_rank":512,"qk_rope_head_dim":64}"#;
    /// let spec = ModelKvSpec::from_hf_config("deepseek-ai/DeepSeek-R1", cfg, ElementType::Bf16, 64)
    ///     .unwrap();
    /// assert_eq!(spec.bytes_per_token(), 70_272.0);
    /// assert_eq!(spec.model, "deepseek-ai/DeepSeek-R1");
    /// ```
    pub fn from_hf_config(
        model: &str,
        config_json: &str,
        kv_dtype: ElementType,
        page_size: u32,
    ) -> Result<ModelKvSpec, GeometryError> {
        if model.is_empty() {
            return Err(GeometryError::BadConfig(
                "an empty model name (it names the default namespace)".into(),
            ));
        }
        let cfg: Value = serde_json::from_str(config_json)
            .map_err(|e| GeometryError::BadConfig(format!("not JSON: {e}")))?;
        let model_type = cfg
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| GeometryError::BadConfig("missing `model_type`".into()))?;
        let layers = field_u32(&cfg, "num_hidden_layers")?;
        if kv_dtype == ElementType::Bytes {
            return Err(GeometryError::UnsupportedKvDtype {
                dtype: kv_dtype,
                model: model_type.to_string(),
            });
        }
        let latent = |cfg: &Value| -> Result<ComponentSpec, GeometryError> {
            let rank = field_u32(cfg, "kv_lora_rank")?;
            let rope = field_u32(cfg, "qk_rope_head_dim")?;
            let row = product(
                "kv_lora_rank + qk_rope_head_dim",
                &[rank.checked_add(rope), Some(kv_dtype.size())],
            )?;
            Ok(ComponentSpec::new("k", RowUnit::Token, kv_dtype, row))
        };
        let components = match model_type {
            "deepseek_v3" => vec![latent(&cfg)?],
            "deepseek_v32" | "glm_moe_dsa" => {
                let kv = if kv_dtype == ElementType::Fp8E4m3 {
                    // The FP8 row (656 B: 512 FP8 latent values, 4 scales, 64 BF16 rope values)
                    // is laid out for this latent alone.
                    let rank = field_u32(&cfg, "kv_lora_rank")?;
                    let rope = field_u32(&cfg, "qk_rope_head_dim")?;
                    if (rank, rope) != (512, 64) {
                        return Err(GeometryError::BadConfig(format!(
                            "the FP8 DSA cache row ({DSA_FP8_ROW_BYTES} B) is laid out for \
                             kv_lora_rank 512 and qk_rope_head_dim 64; this config has {rank} \
                             and {rope}"
                        )));
                    }
                    ModelKvSpec::dsa_fp8_kv()
                } else {
                    latent(&cfg)?
                };
                let head_dim = opt_u32(&cfg, "index_head_dim")?.unwrap_or(DSA_INDEX_HEAD_DIM);
                vec![
                    kv,
                    ModelKvSpec::dsa_indexer(page_size, head_dim, LayerMap::Dense),
                ]
            }
            "llama" => {
                let kv_heads = opt_u32(&cfg, "num_key_value_heads")?
                    .map_or_else(|| field_u32(&cfg, "num_attention_heads"), Ok)?;
                let head_dim = match opt_u32(&cfg, "head_dim")? {
                    Some(d) => d,
                    None => {
                        let hidden = field_u32(&cfg, "hidden_size")?;
                        let heads = field_u32(&cfg, "num_attention_heads")?;
                        if heads == 0 || hidden % heads != 0 {
                            return Err(GeometryError::BadConfig(format!(
                                "no head_dim, and hidden_size {hidden} is not a multiple of \
                                 num_attention_heads {heads}"
                            )));
                        }
                        hidden / heads
                    }
                };
                let row = product(
                    "num_key_value_heads * head_dim",
                    &[Some(kv_heads), Some(head_dim), Some(kv_dtype.size())],
                )?;
                let part = |n: &str| {
                    ComponentSpec::new(n, RowUnit::Token, kv_dtype, row).sharded(kv_heads)
                };
                vec![part("k"), part("v")]
            }
            other => return Err(GeometryError::UnsupportedModelType(other.to_string())),
        };
        ModelKvSpec::new(model, layers, page_size, components)
    }
}
