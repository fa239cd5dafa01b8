//! `cargo run --example glm_prefill`: the main job of kvlink, runnable with no setup.
//!
//! GLM-5.2 with FP8 KV, TP ranks as threads, the embedded (in-process) store: save a cached
//! prefix as the request that computed it would have, then load it layer by layer on every
//! rank into different scattered slots while a simulated attention pass consumes each layer;
//! check every rank's pool byte for byte; print the numbers, and draw the per-layer timeline
//! as an SVG. By default every share mode and `Auto` run on the same saved prefix, side by
//! side: store bytes read per rank, time to the last layer, `Auto`'s pick with its reason.
//! `--help` lists the flags; `--mode all-ranks` (or another mode) runs one mode.
//!
//! Exit status: 0 verified, 1 a load or the check failed, 2 bad flags or the store is not
//! available.

mod app;
mod args;
mod auto_reason;
mod pattern;
mod progress;
mod report;
mod shows;
mod timeline_svg;

use std::io::Write;
use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let mut stdout = std::io::stdout().lock();
    let mut stderr = std::io::stderr();
    let args = match args::parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            let _ = stdout.write_all(args::help().as_bytes());
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            let _ = writeln!(stderr, "{e}");
            return ExitCode::from(2);
        }
    };
    match app::run(&args, &mut stdout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let _ = stdout.flush();
            let _ = writeln!(stderr, "error: {e:#}");
            if e.downcast_ref::<app::Unavailable>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
