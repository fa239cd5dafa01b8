//! `cargo run --example kv_connector`: kvlink behind a mistral.rs-style prefix-cache
//! connector (`lookup_blocks`, `observe_store`, `observe_evict`), on the embedded store.
//!
//! A request computes and caches 6 blocks (saved to the store through the connector), the
//! engine evicts them, a second request with the same prefix gets them back hydrated from
//! the store (checked byte for byte), and a third, with a store fault injected, falls back
//! to compute. `connector.rs` is the adapter; `demo.rs` the engine around it. Exits 1 unless
//! the hydrated bytes match.

mod connector;
mod demo;

use std::io::Write;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut out = std::io::stdout();
    let verdict = match demo::run(&mut out) {
        Ok(s) => {
            let ok = s.bytes_match && s.after_fault.is_none() && s.fault_hits > 0;
            let line = format!(
                "{}: {} blocks hydrated, {} free of the pool's blocks at the end; connector {:?}",
                if ok { "ok" } else { "FAILED" },
                s.hydrated,
                s.free_blocks,
                s.stats
            );
            (ok, line)
        }
        Err(e) => (false, format!("FAILED: {e:#}")),
    };
    let _ = writeln!(out, "{}", verdict.1);
    if verdict.0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
