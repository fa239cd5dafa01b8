//! The `glm_prefill` example, run small: its own code (the modules under
//! `examples/glm_prefill/`, compiled into this test), not its binary, so that `cargo test
//! --test example_glm_prefill` needs no separately built example. It saves a GLM-5.2 prefix,
//! loads it on TP ranks as threads with a simulated compute, checks every pool byte for byte,
//! and reports; these tests assert it says it verified and that its tables carry what they
//! claim.

// The example's own modules, and `report`.
include!("glm_prefill_example/harness.rs");

use std::path::PathBuf;

fn svg_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "kvlink_glm_prefill_{name}_{}.svg",
        std::process::id()
    ))
}

/// Runs the example's core with these flags; its report.
fn run(flags: &[&str]) -> Result<String, String> {
    report(flags, |args, out| app::run(args, out))
}

#[test]
fn small_prefix_loads_and_verifies_on_every_rank() {
    let svg = svg_path("small");
    let out = run(&[
        "--tokens",
        "300", // 4 whole pages; the last 44 tokens are not a page
        "--tp",
        "3",
        "--compute-us",
        "50",
        "--mode",
        "all-ranks",
        "--svg",
        svg.to_str().unwrap(),
    ])
    .unwrap();
    assert!(
        out.contains("verified: 3 ranks × 4 pages byte-identical"),
        "{out}"
    );
    assert!(out.contains("rounded down to whole pages"), "{out}");
    // One warm-up batch by default, before the measured one.
    assert_eq!(
        out.matches("warm-up batch 1 of 1 (not reported below)")
            .count(),
        1,
        "{out}"
    );
    // Only rank 0 writes the replicated objects: 4 pages × 2 components.
    assert!(
        out.contains(
            "|    0 |               8 |               0 |                                     0 |"
        ),
        "{out}"
    );
    assert!(out.contains("embedded (in-process)"), "{out}");
    // Every rank read the whole prefix itself (AllRanks): 3 copies in total.
    assert!(out.contains("= 3.00 × one copy of the prefix"), "{out}");
    assert!(out.contains("SIMULATED"), "{out}");
    // The report ends with its count of checks: the one mode asked for, verified.
    assert_eq!(
        out.trim_end().lines().last(),
        Some("1 passed, 0 failed"),
        "{out}"
    );
    let picture = std::fs::read_to_string(&svg).unwrap();
    let _ = std::fs::remove_file(&svg);
    assert!(picture.starts_with("<svg"), "{picture}");
    assert!(picture.trim_end().ends_with("</svg>"));
    for rank in 0..3 {
        assert!(picture.contains(&format!(">rank {rank}</text>")));
    }
    assert!(picture.contains("time since the first start_load (ms)"));
}

#[test]
fn compare_has_a_row_per_mode_and_never_fakes_one() {
    let svg = svg_path("compare");
    let out = run(&[
        "--tokens",
        "128",
        "--tp",
        "2",
        "--compute-us",
        "0",
        "--mode",
        "compare",
        "--svg",
        svg.to_str().unwrap(),
    ])
    .unwrap();
    let _ = std::fs::remove_file(&svg);
    let table: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("modes on the same saved prefix"))
        .filter(|l| l.starts_with('|') && l.split('|').nth(1).map(str::trim) == Some("128"))
        .collect();
    assert_eq!(table.len(), 4, "{out}");
    for (row, mode) in table
        .iter()
        .zip(["AllRanks", "Rank0Broadcast", "SplitAllGather", "Auto"])
    {
        assert!(row.contains(&format!("| {mode} ")), "{row}");
        assert!(row.contains("| embedded (in-process) |"), "{row}");
    }
    assert!(
        table[0].contains(" ms |"),
        "the baseline always runs: {}",
        table[0]
    );
    // Every mode ran as itself (the run fails otherwise at TP 2) and was verified.
    let ran = table.iter().filter(|r| r.contains(" ms |")).count();
    assert_eq!(ran, 4, "{out}");
    assert_eq!(
        out.matches("verified: 2 ranks × 2 pages byte-identical")
            .count(),
        ran,
        "{out}"
    );
    // After the table: store bytes per rank of each mode, Auto's pick with its reason, and what
    // sharing did to time on this store, with the command of the run where it pays.
    let shows: Vec<&str> = out
        .lines()
        .skip_while(|l| *l != "what this shows:")
        .collect();
    assert!(!shows.is_empty(), "{out}");
    if ran == 4 {
        assert!(
            shows.iter().any(|l| l.contains("AllRanks")
                && l.contains("store bytes read per rank: 6.9 MB / 6.9 MB")),
            "{out}"
        );
        assert!(
            shows
                .iter()
                .any(|l| l.contains("Auto keeps ") && l.contains(" ms/GB (")),
            "{out}"
        );
        assert!(
            shows
                .iter()
                .any(|l| l.starts_with("  time: ") && l.contains("--store mooncake")),
            "{out}"
        );
    }
}

#[test]
fn the_default_run_compares_every_mode() {
    let a = args::parse(std::iter::empty::<&str>()).unwrap().unwrap();
    assert_eq!(a.mode, args::ModeSel::Compare);
    assert_eq!(a.tokens, args::DEFAULT_TOKENS);
}

#[test]
fn flags_are_checked() {
    assert!(args::parse(["--help"]).unwrap().is_none());
    let a = args::parse(["--tokens=4096", "--tp", "4", "--mode", "split-all-gather"])
        .unwrap()
        .unwrap();
    assert_eq!((a.tokens, a.tp), (4096, 4));
    assert_eq!(a.mode, args::ModeSel::One(args::ModeArg::SplitAllGather));
    for bad in [
        &["--tp", "0"][..],
        &["--tokens", "63"],
        &["--mode", "fastest"],
        &["--store", "redis"],
        &["--compute-us"],
        &["--frobnicate"],
    ] {
        assert!(args::parse(bad.iter().copied()).is_err(), "{bad:?}");
    }
    let help = args::help();
    for flag in [
        "--tokens",
        "--tp",
        "--compute-us",
        "--store",
        "--mode",
        "--svg",
        "--seed",
    ] {
        assert!(help.contains(flag), "{flag}");
    }
}

#[test]
fn the_pattern_differs_per_page_component_and_layer() {
    use kvlink::kv_geometry::PageHash;
    let p = pattern::Pattern::new(7, 64);
    let get = |page: u8, comp: u16, layer: u32| {
        let mut b = vec![0u8; 64];
        p.fill(&PageHash([page; 32]), comp, layer, &mut b);
        b
    };
    let a = get(1, 0, 0);
    assert_eq!(a, get(1, 0, 0), "deterministic");
    assert!(a.iter().any(|&x| x != 0));
    for other in [get(2, 0, 0), get(1, 1, 0), get(1, 0, 1)] {
        assert_ne!(a[..8], other[..8]);
        assert_ne!(a[56..], other[56..]);
    }
    let mut seeded = vec![0u8; 64];
    pattern::Pattern::new(8, 64).fill(&PageHash([1; 32]), 0, 0, &mut seeded);
    assert_ne!(a, seeded, "the seed changes the bytes");
}

/// With a Mooncake environment (CI runs the tests under scripts/with-mooncake.sh), the
/// example works on a real Mooncake Store too; without one it says what is missing.
#[test]
fn mooncake_store_when_the_environment_has_one() {
    let have = std::env::var("MOONCAKE_MASTER").is_ok_and(|v| !v.trim().is_empty());
    let svg = svg_path("mooncake");
    let res = run(&[
        "--store",
        "mooncake",
        "--tokens",
        "128",
        "--tp",
        "2",
        "--compute-us",
        "0",
        "--svg",
        svg.to_str().unwrap(),
    ]);
    let _ = std::fs::remove_file(&svg);
    if have {
        let out = res.unwrap();
        assert!(
            out.contains("verified: 2 ranks × 2 pages byte-identical"),
            "{out}"
        );
        assert!(out.contains("store: mooncake ("), "{out}");
    } else {
        assert!(
            std::env::var("KVLINK_REQUIRE_MOONCAKE").as_deref() != Ok("1"),
            "KVLINK_REQUIRE_MOONCAKE=1 but MOONCAKE_MASTER is not set"
        );
        let err = res.unwrap_err();
        assert!(err.contains("MOONCAKE_MASTER"), "{err}");
    }
}
