//! docs/architecture.md's table of crate dependencies matches the Cargo.tomls, and every arrow
//! points down the stack: a doc that drifts from the code fails here.

use std::collections::BTreeSet;
use std::path::Path;

/// The workspace crates, bottom of the stack first (a crate may use only those before it).
const STACK: [&str; 9] = [
    "kv-geometry",
    "layerwise-counter",
    "kv-loader",
    "kv-device",
    "dedup-broadcast",
    "kvlink-candle",
    "mooncake-sys",
    "mooncake-linker",
    "kvlink",
];

/// Development-only crates: they may use any crate of the stack, and no crate of the stack
/// may use them (they are dev-dependencies only).
const DEV_ONLY: [&str; 1] = ["kvlink-rig"];

fn workspace_crate(name: &str) -> bool {
    STACK.contains(&name) || DEV_ONLY.contains(&name)
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The workspace crates named in the `[dependencies]` section of a Cargo.toml (normal
/// dependencies only: dev-dependencies may reach anywhere).
fn uses(manifest: &str) -> BTreeSet<String> {
    let mut in_deps = false;
    let mut out = BTreeSet::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]";
            continue;
        }
        if !in_deps {
            continue;
        }
        let name = line
            .split(['=', '.', ' '])
            .next()
            .unwrap_or_default()
            .trim();
        if workspace_crate(name) {
            out.insert(name.to_string());
        }
    }
    out
}

fn manifest_of(krate: &str) -> String {
    let path = if krate == "kvlink" {
        root().join("Cargo.toml")
    } else {
        root().join("crates").join(krate).join("Cargo.toml")
    };
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The doc's table: crate -> the crates it lists as used.
fn doc_table() -> Vec<(String, BTreeSet<String>)> {
    let doc = std::fs::read_to_string(root().join("docs/architecture.md")).unwrap();
    doc.lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            // "| crate | uses |" rows: ["", crate, uses, ""].
            if cells.len() != 4 {
                return None;
            }
            // "kvlink (facade)", "kvlink-rig (dev-only)": the name before any note.
            let krate = cells[1].split(" (").next().unwrap_or_default();
            if !workspace_crate(krate) {
                return None;
            }
            let used = cells[2]
                .split(',')
                .map(str::trim)
                .filter(|c| workspace_crate(c))
                .map(String::from)
                .collect();
            Some((krate.to_string(), used))
        })
        .collect()
}

#[test]
fn the_documented_arrows_are_the_cargo_arrows() {
    let table = doc_table();
    let listed: BTreeSet<&str> = table.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        listed,
        STACK.iter().chain(&DEV_ONLY).copied().collect(),
        "docs/architecture.md lists every workspace crate once"
    );
    assert_eq!(
        table.len(),
        STACK.len() + DEV_ONLY.len(),
        "no crate listed twice"
    );
    for (krate, doc_uses) in &table {
        assert_eq!(
            &uses(&manifest_of(krate)),
            doc_uses,
            "docs/architecture.md's row for {krate} differs from its Cargo.toml"
        );
    }
}

#[test]
fn every_arrow_points_down_the_stack() {
    // Development-only crates are no crate's normal dependency (checked first: the stack
    // order below does not know them).
    for krate in STACK {
        for dev in DEV_ONLY {
            assert!(
                !uses(&manifest_of(krate)).contains(dev),
                "{krate} uses the development-only {dev}"
            );
        }
    }
    for (i, krate) in STACK.iter().enumerate() {
        for used in uses(&manifest_of(krate)) {
            let j = STACK.iter().position(|c| *c == used).unwrap();
            assert!(j < i, "{krate} uses {used}, which is above it in the stack");
        }
    }
    // mooncake-sys is used by mooncake-linker alone.
    for krate in STACK {
        if krate != "mooncake-linker" {
            assert!(
                !uses(&manifest_of(krate)).contains("mooncake-sys"),
                "{krate} uses mooncake-sys"
            );
        }
    }
}
