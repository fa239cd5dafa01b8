//! The per-layer compute of the engine, MODELLED (not run): GLM-5.2's prefill FLOPs per layer
//! for the uncached suffix at the H200's dense BF16 rate. The engine thread of each rank sleeps
//! this long after each layer is ready, which gives a TTFT-shaped "forward done" beside the
//! time to the last layer.

use std::time::Duration;

/// H200 (SXM) dense BF16 tensor rate, FLOP/s.
pub const H200_BF16_FLOPS: f64 = 989.5e12;
/// Active parameters per layer: GLM-5.x activates 40 B of its 744 B parameters per token, over
/// 78 layers (embeddings and the output head counted in: a slight overestimate).
pub const ACTIVE_PARAMS_PER_LAYER: f64 = 40e9 / 78.0;
/// Query heads.
pub const HEADS: f64 = 64.0;
/// Absorbed MLA: q·k over the 512-wide latent plus the 64 rope dims; p·v over the latent.
pub const QK_DIM: f64 = 576.0;
pub const PV_DIM: f64 = 512.0;
/// DSA: each query attends to its top 2048 keys.
pub const TOP_K: f64 = 2048.0;
/// The lightning indexer scores every key for every query on 21 of the 78 layers.
pub const INDEXER_HEADS: f64 = 32.0;
pub const INDEXER_DIM: f64 = 128.0;
pub const INDEXER_LAYER_SHARE: f64 = 21.0 / 78.0;

/// FLOPs of one layer for `suffix` new tokens after `prefix` cached ones.
pub fn flops_per_layer(prefix: u64, suffix: u64) -> f64 {
    let (p, s) = (prefix as f64, suffix as f64);
    let weights = 2.0 * ACTIVE_PARAMS_PER_LAYER * s;
    let keys = TOP_K.min(p + s);
    let attention = 2.0 * s * keys * HEADS * (QK_DIM + PV_DIM);
    let indexer = INDEXER_LAYER_SHARE * 2.0 * s * (p + s) * INDEXER_HEADS * INDEXER_DIM;
    weights + attention + indexer
}

/// The modelled compute of one layer.
pub fn per_layer(prefix: u64, suffix: u64) -> Duration {
    Duration::from_secs_f64(flops_per_layer(prefix, suffix) / H200_BF16_FLOPS)
}

/// The formula and its numbers, as every table states it.
pub fn describe(prefix: u64, suffix: u64) -> String {
    format!(
        "compute per layer MODELLED (the engine thread sleeps it; not run): GLM-5.2 prefill FLOPs \
         per layer for a {suffix}-token uncached suffix after the {prefix}-token cached prefix, \
         at the H200's dense BF16 rate ({:.1} TFLOP/s, full utilisation: a lower bound): \
         2·A·S + 2·S·min(K, P+S)·H·(576+512) + (21/78)·2·S·(P+S)·32·128 with A = 40e9/78 active \
         parameters per layer, H = 64 heads, K = 2048 (DSA top-k), P = {prefix}, S = {suffix}: \
         {:.2e} FLOP = {:.2} ms per layer",
        H200_BF16_FLOPS / 1e12,
        flops_per_layer(prefix, suffix),
        per_layer(prefix, suffix).as_secs_f64() * 1e3
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_of_the_tables() {
        let ms = |p| per_layer(p, 4096).as_secs_f64() * 1e3;
        assert!((ms(131_072) - 6.66).abs() < 0.05, "{}", ms(131_072));
        assert!((ms(32_768) - 5.76).abs() < 0.05, "{}", ms(32_768));
    }
}
