//! `cargo run --example candle_mla`: kvlink in a candle engine, end to end.
//!
//! A tiny MLA transformer (DeepSeek-V3's attention: the cache holds only the latent
//! `c_kv` and the shared rope key; K and V are rebuilt from it) with seeded random weights,
//! TP ranks as threads, heads sharded, the latent replicated. Request 1 prefills a prompt and
//! saves its latent KV through kvlink; request 2 (that prompt plus new tokens) loads the
//! prefix layer by layer in each share mode while its new tokens are computed, each attention
//! layer waiting for its layer through `kvlink_candle::PagedLatentCache`. One more run
//! injects a store failure: the engine falls back to recomputing. Every run's logits are
//! compared with a full recompute of request 2; the example exits 1 unless they are equal
//! bit for bit.
//!
//! Flags: `--tp N` (2), `--page-size N` (16), `--prompt N` tokens of request 1 (88),
//! `--new N` tokens request 2 adds (24), `--chunk N` prefill chunk, a multiple of the page
//! size (16), `--seed N` (7).

mod engine;
mod model;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use engine::{PrefixPath, Scenario, Served};
use kvlink::kv_loader::ShareMode;
use kvlink::mooncake_linker::store::{
    EmbeddedStore, Fault, FaultRule, FaultyStore, KvStore, StoreError,
};
use kvlink::mooncake_linker::LinkerConfig;
use model::{bit_identical, max_abs_diff, random_tokens, MlaConfig};

struct Args {
    tp: usize,
    page_size: u32,
    prompt: usize,
    new: usize,
    chunk: usize,
    seed: u64,
}

fn parse() -> Result<Option<Args>, String> {
    let mut a = Args {
        tp: 2,
        page_size: 16,
        prompt: 88,
        new: 24,
        chunk: 16,
        seed: 7,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Ok(None);
        }
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let n: u64 = v
            .parse()
            .map_err(|_| format!("{flag}: `{v}` is not a number"))?;
        let small = |n: u64| usize::try_from(n).map_err(|_| format!("{flag}: too large"));
        match flag.as_str() {
            "--tp" => a.tp = small(n)?,
            "--page-size" => a.page_size = u32::try_from(n).map_err(|_| "page size too large")?,
            "--prompt" => a.prompt = small(n)?,
            "--new" => a.new = small(n)?,
            "--chunk" => a.chunk = small(n)?,
            "--seed" => a.seed = n,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.new == 0 || a.page_size == 0 || a.tp == 0 {
        return Err("--new, --page-size and --tp must be at least 1".into());
    }
    Ok(Some(a))
}

#[allow(clippy::print_stdout)]
fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let args = match parse() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("usage: candle_mla [--tp N] [--page-size N] [--prompt N] [--new N] [--chunk N] [--seed N]");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            println!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            println!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

#[allow(clippy::print_stdout)]
fn run(a: &Args) -> anyhow::Result<bool> {
    let cfg = MlaConfig::tiny();
    let prompt = random_tokens(a.seed, a.prompt, cfg.vocab);
    let new_tokens = random_tokens(a.seed + 1, a.new, cfg.vocab);
    let sc = Scenario {
        cfg,
        seed: a.seed,
        tp: a.tp,
        page_size: a.page_size,
        prompt,
        new_tokens,
        chunk: a.chunk,
        linker: LinkerConfig {
            namespace: "tiny-mla".into(),
            wait_deadline: Duration::from_secs(20),
            layer_read_timeout: Duration::from_secs(5),
            collective_timeout: Duration::from_secs(10),
            ..LinkerConfig::default()
        },
    };
    let models = sc.models()?;
    let fmt = sc.format()?;
    println!(
        "candle_mla: tiny MLA model ({} layers, hidden {}, {} heads, latent {} + rope {} = {} B/token/layer f32), TP {} (ranks as threads, {} heads each)",
        cfg.layers, cfg.hidden, cfg.heads, cfg.kv_lora_rank, cfg.rope_dim, fmt.row_bytes(),
        a.tp, cfg.heads / a.tp,
    );

    // Request 1 once, into a store that every run below starts from (a fresh copy per run,
    // so request 2's own save in one run does not lengthen the next run's hit).
    let t = Instant::now();
    let saved_store =
        || -> anyhow::Result<(Arc<dyn KvStore>, Vec<kvlink::kv_loader::SaveReport>)> {
            let store: Arc<dyn KvStore> = Arc::new(EmbeddedStore::new(1 << 28));
            let saved = engine::save_request1(&sc, &models, store.clone())?;
            Ok((store, saved))
        };
    let (_, saved) = saved_store()?;
    println!(
        "request 1: {}-token prompt prefilled in chunks of {} on every rank; its {} whole pages saved through kvlink: rank 0 wrote {} objects ({} B), rank 1.. own none ({})",
        sc.prompt.len(), sc.chunk, sc.prompt.len() / a.page_size as usize,
        saved[0].objects_written, saved[0].bytes_written, ms(t.elapsed()),
    );

    let t = Instant::now();
    let reference = engine::recompute_request2(&sc, &models)?;
    let total = sc.request2().len();
    println!(
        "reference: request 2 ({total} tokens = request 1's prompt + {} new) recomputed from token 0 with no store ({})",
        a.new, ms(t.elapsed()),
    );

    let runs: Vec<(&str, ShareMode, Option<u32>)> = vec![
        ("AllRanks", ShareMode::AllRanks, None),
        ("Rank0Broadcast", ShareMode::Rank0Broadcast, None),
        ("SplitAllGather", ShareMode::SplitAllGather, None),
        (
            "Rank0Broadcast + rank 0 read fails at layer 2",
            ShareMode::Rank0Broadcast,
            Some(2),
        ),
        (
            "SplitAllGather + rank 0 read fails at layer 1",
            ShareMode::SplitAllGather,
            Some(1),
        ),
    ];
    println!();
    println!(
        "{:<46} {:<10} {:>4} {:>15} {:>19} {:>9} {:>9} {:>13}  bit-identical",
        "request 2: prefix through kvlink",
        "prefix",
        "hit",
        "store B r0/r1..",
        "layer ready 1st/last",
        "blocked",
        "prefill",
        "max|Δ logits|"
    );
    let mut all_ok = true;
    let mut first: Option<Vec<Served>> = None;
    for (name, mode, fail_layer) in runs {
        let rule = fail_layer.map(|l| {
            let off = u64::from(l) * u64::from(a.page_size) * fmt.row_bytes() as u64;
            (
                FaultRule {
                    key_contains: Some("_k".into()),
                    offset: Some(off),
                    times: None,
                    ..FaultRule::default()
                },
                Fault::Error(StoreError::TransferFailed {
                    key: "injected".into(),
                    code: -800,
                }),
            )
        });
        let arm = |rank: usize, s: &FaultyStore| {
            if let (0, Some((r, f))) = (rank, &rule) {
                s.inject(r.clone(), f.clone());
            }
        };
        let (store, _) = saved_store()?;
        let served = engine::serve_request2(&sc, &models, store, mode, &arm)?;
        let (diff, same) = compare(&served, &reference)?;
        // A failure must end in recompute on every rank, no failure in a load on every rank;
        // no hit only where the prompt holds no whole chunk of whole pages besides its last
        // token (the engine loads whole chunks only; else a broken save, key or lookup would
        // pass: every run recomputed, its logits trivially equal).
        let ps = a.page_size as usize;
        let whole_page = a.prompt.saturating_sub(1) / ps * ps >= a.chunk;
        let expected_path = served.iter().all(|s| {
            matches!(
                (&s.path, fail_layer),
                (PrefixPath::Loaded(_), None) | (PrefixPath::Recomputed(_), Some(_))
            ) || (matches!(s.path, PrefixPath::NoHit) && !whole_page)
        });
        let ok = same && expected_path;
        all_ok &= ok;
        let s0 = &served[0];
        let (prefix, read, ready) = match &s0.path {
            PrefixPath::Loaded(st) => {
                let reads: Vec<String> = served
                    .iter()
                    .map(|s| match &s.path {
                        PrefixPath::Loaded(st) => st.bytes_read.to_string(),
                        PrefixPath::Recomputed(_) | PrefixPath::NoHit => "-".into(),
                    })
                    .collect();
                (
                    "loaded",
                    reads.join("/"),
                    format!("{} / {}", ms(st.first_layer), ms(st.last_layer)),
                )
            }
            PrefixPath::Recomputed(_) => ("recomputed", "-".into(), "-".into()),
            PrefixPath::NoHit => ("no hit", "-".into(), "-".into()),
        };
        println!(
            "{:<46} {:<10} {:>4} {:>15} {:>19} {:>9} {:>9} {:>13}  {}",
            name,
            prefix,
            s0.hit_tokens,
            read,
            ready,
            ms(s0.blocked),
            ms(s0.prefill),
            format!("{diff:e}"),
            if same { "yes" } else { "NO" },
        );
        if let PrefixPath::Recomputed(why) = &s0.path {
            println!("    every rank fell back to recompute; rank 0's error: {why}");
        }
        if !ok {
            println!("    MISMATCH (or the wrong path) in this run");
        }
        first.get_or_insert(served);
    }
    println!();
    if let Some(s) = &first {
        println!(
            "page tables of request 2 (each rank's own slots; the same latent bytes land in them): {}",
            s.iter()
                .enumerate()
                .map(|(r, x)| format!("rank {r} {:?}", x.page_table))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "save after request 2's prefill: rank 0 wrote {} new objects, {} were already present",
            s[0].save.objects_written, s[0].save.objects_present
        );
    }
    let dense = engine::dense_request2(&sc, &models)?;
    let hit = first.as_ref().map_or(0, |s| s[0].hit_tokens);
    let d = max_abs_diff(
        &dense[0].narrow(0, hit, total - hit)?,
        &reference[0].narrow(0, hit, total - hit)?,
    )?;
    println!(
        "info: request 2 in one unchunked pass with latents in plain tensors differs from the chunked recompute by max|Δ| = {d:e} (other GEMM shapes, other summation order: why chunk boundaries are counted from token 0, docs/integration.md)"
    );
    println!(
        "{}",
        if all_ok {
            "OK: every run's logits equal the full recompute's, bit for bit, on every rank"
        } else {
            "FAILED: some run's logits differ from the full recompute's"
        }
    );
    Ok(all_ok)
}

/// Largest difference over ranks between served logits and the reference's same rows, and
/// whether every rank's are bit-identical.
fn compare(
    served: &[Served],
    reference: &[kvlink_candle::candle_core::Tensor],
) -> anyhow::Result<(f32, bool)> {
    // Every rank compared: a rank missing from either list is a failure, not a skipped row.
    anyhow::ensure!(
        served.len() == reference.len(),
        "{} ranks served, {} reference ranks",
        served.len(),
        reference.len()
    );
    let mut worst = 0f32;
    let mut same = true;
    for (s, r) in served.iter().zip(reference) {
        let rows = r.dim(0)?.checked_sub(s.hit_tokens).ok_or_else(|| {
            anyhow::anyhow!("{} tokens hit, past the reference's rows", s.hit_tokens)
        })?;
        let want = r.narrow(0, s.hit_tokens, rows)?;
        worst = worst.max(max_abs_diff(&s.logits, &want)?);
        same &= bit_identical(&s.logits, &want)?;
    }
    Ok((worst, same))
}
