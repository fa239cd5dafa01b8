//! The time model's decisions.

use dedup_broadcast::{choose_mode, layer_times, Bandwidths, ModeChoice};
use kv_loader::ShareMode;

const MB100: u64 = 100_000_000;

fn bw(per_rank: f64, aggregate: f64, bcast: f64, ag: f64) -> Bandwidths {
    Bandwidths {
        store_per_rank_gbps: per_rank,
        store_aggregate_gbps: aggregate,
        fabric_broadcast_gbps: bcast,
        fabric_all_gather_gbps: ag,
    }
}

fn auto(b: &Bandwidths, tp: u32) -> ShareMode {
    choose_mode(ModeChoice::Auto, b, tp, MB100).0
}

#[test]
fn model_times() {
    // 100 MB, TP 4: per-rank 5 GB/s, aggregate 10 GB/s, broadcast 100, all-gather 50.
    let t = layer_times(&bw(5.0, 10.0, 100.0, 50.0), 4, MB100);
    let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
    assert!(close(t.of(ShareMode::AllRanks), 0.04)); // 400 MB through 10 GB/s
    assert!(close(t.of(ShareMode::Rank0Broadcast), 0.02)); // 100 MB at 5 GB/s; broadcast 1 ms
    assert!(close(t.of(ShareMode::SplitAllGather), 0.01)); // 25 MB at 5 = 5 ms, 100 MB at 10 = 10 ms
}

#[test]
fn shared_store_bottleneck_and_fast_fabric_dedups() {
    // The reference's situation: readers contend for one path (aggregate ≈ 3.6 GB/s x 8 would be
    // the no-contention case; here the path caps at 29 GB/s for 8 readers).
    let b = bw(6.0, 29.0, 300.0, 300.0);
    assert_eq!(auto(&b, 8), ShareMode::SplitAllGather);
    // Aggregate no better than one reader: splitting reads cannot help, broadcast is simpler.
    assert_eq!(
        auto(&bw(5.0, 5.0, 300.0, 300.0), 8),
        ShareMode::Rank0Broadcast
    );
}

#[test]
fn independent_store_paths_and_slow_fabric_read_everywhere() {
    // Every rank has its own path (aggregate = 8 x per rank), and the fabric is slower
    // than the store: nothing to gain.
    assert_eq!(auto(&bw(5.0, 40.0, 2.0, 2.0), 8), ShareMode::AllRanks);
    // Own paths but a fast fabric: split reads use all paths and move B/N each.
    assert_eq!(
        auto(&bw(5.0, 40.0, 300.0, 300.0), 8),
        ShareMode::SplitAllGather
    );
}

#[test]
fn unknown_bandwidths_are_never_chosen() {
    // All-gather unknown: broadcast still beats a contended store.
    assert_eq!(
        auto(&bw(5.0, 10.0, 100.0, f64::NAN), 4),
        ShareMode::Rank0Broadcast
    );
    // No fabric numbers at all.
    assert_eq!(auto(&bw(5.0, 10.0, 0.0, -1.0), 4), ShareMode::AllRanks);
    // No store numbers: every time is unknown, the tie goes to AllRanks.
    assert_eq!(
        auto(&bw(f64::INFINITY, 0.0, 100.0, 100.0), 4),
        ShareMode::AllRanks
    );
}

#[test]
fn fixed_and_degenerate_cases() {
    let b = bw(5.0, 10.0, 100.0, 100.0);
    for m in [
        ShareMode::AllRanks,
        ShareMode::Rank0Broadcast,
        ShareMode::SplitAllGather,
    ] {
        let (mode, why) = choose_mode(ModeChoice::Fixed(m), &b, 4, MB100);
        assert_eq!(mode, m);
        assert!(why.contains("configuration"));
        // One rank: nothing to share, whatever the configuration.
        assert_eq!(
            choose_mode(ModeChoice::Fixed(m), &b, 1, MB100).0,
            ShareMode::AllRanks
        );
    }
    assert_eq!(
        choose_mode(ModeChoice::Auto, &b, 4, 0).0,
        ShareMode::AllRanks
    );
    let (_, why) = choose_mode(ModeChoice::Auto, &b, 4, MB100);
    assert!(why.contains("AllRanks") && why.contains("Rank0Broadcast") && why.contains("ms"));
}
