//! Plan gate digest (design §6: a 512K-token plan "well under a millisecond").
//!
//! `cargo bench --bench plan_digest`

use divan::{black_box, Bencher};
use kvlink::dedup_broadcast::plan_digest;
use kvlink::kv_geometry::{ComponentId, PageHash};
use kvlink::kv_loader::{BatchId, LogicalPlan, RequestId, RequestPages};

fn main() {
    divan::main();
}

/// `tokens` tokens in pages of 64, split over `requests` requests, two components (DSA).
fn plan(tokens: usize, requests: usize) -> LogicalPlan {
    let pages = tokens / 64;
    let per = pages / requests;
    LogicalPlan {
        batch: BatchId(42),
        requests: (0..requests)
            .map(|r| RequestPages {
                request: RequestId(format!("request-{r:04}")),
                pages: (0..per)
                    .map(|i| {
                        let mut h = [0u8; 32];
                        h[..8].copy_from_slice(&((r * per + i) as u64).to_le_bytes());
                        h[31] = 0x5a;
                        PageHash(h)
                    })
                    .collect(),
            })
            .collect(),
        components: vec![ComponentId(0), ComponentId(1)],
    }
}

/// Digest of a plan of `tokens` tokens in 4 requests.
#[divan::bench(args = [131_072, 524_288])]
fn digest(bencher: Bencher, tokens: usize) {
    let p = plan(tokens, 4);
    bencher.bench_local(|| plan_digest(black_box(&p)));
}

/// The same 512K tokens as 64 requests of 8K (more, shorter pieces).
#[divan::bench]
fn digest_512k_in_64_requests(bencher: Bencher) {
    let p = plan(524_288, 64);
    bencher.bench_local(|| plan_digest(black_box(&p)));
}
