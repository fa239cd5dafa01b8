// The `glm_prefill` example's modules, compiled into a test crate, and how its tests run them
// (`include!`d at the test crate's root; the paths are relative to this file).

#[allow(dead_code)]
#[path = "../../examples/glm_prefill/app.rs"]
mod app;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/args.rs"]
mod args;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/auto_reason.rs"]
mod auto_reason;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/pattern.rs"]
mod pattern;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/progress.rs"]
mod progress;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/report.rs"]
mod report;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/shows.rs"]
mod shows;
#[allow(dead_code)]
#[path = "../../examples/glm_prefill/timeline_svg.rs"]
mod timeline_svg;

/// Parses `flags` as the example does and runs `body` on them: the report, or the error
/// followed by the report so far.
fn report(
    flags: &[&str],
    body: impl FnOnce(&args::Args, &mut Vec<u8>) -> anyhow::Result<()>,
) -> Result<String, String> {
    let args = args::parse(flags.iter().copied())
        .map_err(|e| e.to_string())?
        .expect("not --help");
    let mut out = Vec::new();
    let res = body(&args, &mut out);
    let text = String::from_utf8(out).expect("utf-8 report");
    res.map(|()| text.clone())
        .map_err(|e| format!("{e:#}\n--- report so far ---\n{text}"))
}
