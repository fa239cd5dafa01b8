//! Read-granularity planning (`read_plan::plan_reads`): once per batch per rank, it must cost
//! far less than one store call (milliseconds).
//!
//! `cargo bench --bench read_plan`

use std::time::Duration;

use divan::{black_box, Bencher};
use kvlink::kv_geometry::{KvGeometry, ModelKvSpec};
use kvlink::mooncake_linker::read_plan::{plan_reads, ReadCost, ReadPlanRequest};

fn main() {
    divan::main();
}

/// GLM-5.2 FP8 (the model's own spec: `k` on every layer, `indexer` on 21 of 78, evenly
/// spaced), 512 pages.
fn glm_layer_bytes() -> Vec<u64> {
    let geometry = KvGeometry::new(ModelKvSpec::glm52_dsa_fp8(), 1, 0).expect("GLM-5.2 geometry");
    (0..geometry.num_layers())
        .map(|l| {
            512 * geometry
                .layer_bytes_per_page(l)
                .expect("a layer of the model")
        })
        .collect()
}

/// Plans 78 layers at 20 ms per call and 2 GB/s for a per-layer compute of `compute_us` µs.
#[divan::bench(args = [0, 5_000, 12_000, 40_000])]
fn plan_glm_78_layers(bencher: Bencher, compute_us: u64) {
    let bytes = glm_layer_bytes();
    let cost = ReadCost::from_gbps(Duration::from_millis(20), Duration::ZERO, 2.0);
    bencher.bench(|| {
        plan_reads(black_box(&ReadPlanRequest {
            layer_bytes: &bytes,
            cost,
            compute_per_layer: Duration::from_micros(compute_us),
            max_layers_per_call: 78,
        }))
    });
}
