//! The timeline picture, as hand-written SVG: per run (mode) a block, per rank a lane with a
//! "read → ready" row and a "compute" row, a shared time axis in milliseconds.

use std::fmt::Write;

/// One rank's timeline of one load, in ms since the run's first `start_load`.
#[derive(Debug, Clone, Default)]
pub struct RankTimeline {
    /// TP rank.
    pub rank: u32,
    /// When this rank called `start_load`.
    pub start: f64,
    /// Per layer: when it was seen ready by a thread blocked in `wait_layer`.
    pub ready: Vec<f64>,
    /// Per layer: when the engine's own `wait_layer` returned (compute starts).
    pub seen: Vec<f64>,
    /// Per layer: when the engine's simulated compute ended.
    pub done: Vec<f64>,
}

/// One load (one mode) over all ranks.
#[derive(Debug, Clone, Default)]
pub struct RunTimeline {
    /// Heading of the block (the mode).
    pub label: String,
    /// A note after the heading (key numbers).
    pub note: String,
    /// Ranks in order.
    pub ranks: Vec<RankTimeline>,
}

const W: f64 = 1400.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 190.0;
const ROW: f64 = 14.0;
const ROW_GAP: f64 = 3.0;
const LANE_GAP: f64 = 12.0;
const BLOCK_HEAD: f64 = 34.0;
const BLOCK_GAP: f64 = 16.0;

const READ: [&str; 2] = ["#2f6ea8", "#8fbce6"];
const COMPUTE: [&str; 2] = ["#e0701b", "#f7b77a"];
const STALL: &str = "#d9d9d9";

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// A "nice" tick step (1, 2 or 5 × 10^k) giving about `target` ticks over `span`.
fn tick_step(span: f64, target: f64) -> f64 {
    let raw = (span / target).max(1e-6);
    let mag = 10f64.powf(raw.log10().floor());
    for m in [1.0, 2.0, 5.0, 10.0] {
        if m * mag >= raw {
            return m * mag;
        }
    }
    10.0 * mag
}

fn fmt_tick(v: f64, step: f64) -> String {
    if step >= 1.0 {
        format!("{v:.0}")
    } else if step >= 0.1 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// The whole picture. `title` and `subtitle` head it; every run shares one time axis.
pub fn render(title: &str, subtitle: &str, runs: &[RunTimeline]) -> String {
    let t_max = runs
        .iter()
        .flat_map(|r| r.ranks.iter())
        .flat_map(|k| k.done.iter().chain(k.ready.iter()))
        .fold(0.0f64, |a, &b| a.max(b))
        .max(0.001);
    let step = tick_step(t_max, 12.0);
    let axis_end = (t_max / step).ceil() * step;
    let plot_w = W - LEFT - RIGHT;
    let x = |t: f64| LEFT + (t / axis_end) * plot_w;

    let lane_h = 2.0 * ROW + ROW_GAP;
    let top = 64.0;
    let blocks_h: f64 = runs
        .iter()
        .map(|r| BLOCK_HEAD + r.ranks.len() as f64 * (lane_h + LANE_GAP) + BLOCK_GAP)
        .sum();
    let axis_y = top + blocks_h;
    let legend_y = axis_y + 48.0;
    let h = legend_y + 58.0;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h:.0}" viewBox="0 0 {W} {h:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="20" y="26" font-size="17" font-weight="bold">{}</text>"#,
        esc(title)
    );
    let _ = writeln!(
        s,
        r##"<text x="20" y="47" font-size="12" fill="#444">{}</text>"##,
        esc(subtitle)
    );

    // Grid lines under everything.
    let mut t = 0.0;
    while t <= axis_end + step * 0.01 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{top}" x2="{0:.1}" y2="{axis_y}" stroke="#ececec" stroke-width="1"/>"##,
            x(t)
        );
        t += step;
    }

    let mut y = top;
    for run in runs {
        let _ = writeln!(
            s,
            r#"<text x="20" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
            y + 18.0,
            esc(&run.label)
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="12" fill="#333">{}</text>"##,
            20.0 + run.label.chars().count() as f64 * 8.8 + 16.0,
            y + 18.0,
            esc(&run.note)
        );
        y += BLOCK_HEAD;
        for k in &run.ranks {
            let read_y = y;
            let comp_y = y + ROW + ROW_GAP;
            let _ = writeln!(
                s,
                r#"<text x="20" y="{:.1}" font-size="12" font-weight="bold">rank {}</text>"#,
                read_y + ROW - 2.0,
                k.rank
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#555" text-anchor="end">read → ready</text>"##,
                LEFT - 6.0,
                read_y + ROW - 3.0
            );
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#555" text-anchor="end">compute (SIMULATED)</text>"##,
                LEFT - 6.0,
                comp_y + ROW - 3.0
            );
            // Read bars: layer l is read between layer l-1 ready and layer l ready (one load
            // thread reads the layers in order); layer 0 includes the batch setup.
            let mut prev = k.start;
            for (l, &r) in k.ready.iter().enumerate() {
                let (x0, x1) = (x(prev), x(r));
                let _ = writeln!(
                    s,
                    r#"<rect x="{x0:.2}" y="{read_y:.1}" width="{:.2}" height="{ROW}" fill="{}"><title>rank {} layer {l} read: {prev:.2} to {r:.2} ms</title></rect>"#,
                    (x1 - x0).max(0.6),
                    READ[l % 2],
                    k.rank
                );
                prev = r;
            }
            // Compute bars, and the engine's stalls (waiting for a layer) in grey.
            let mut prev_done = k.start;
            for (l, (&a, &b)) in k.seen.iter().zip(&k.done).enumerate() {
                if a - prev_done > 0.0 {
                    let _ = writeln!(
                        s,
                        r#"<rect x="{:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{STALL}"><title>rank {} waits for layer {l}: {prev_done:.2} to {a:.2} ms</title></rect>"#,
                        x(prev_done),
                        comp_y + ROW * 0.3,
                        (x(a) - x(prev_done)).max(0.0),
                        ROW * 0.4,
                        k.rank
                    );
                }
                let (x0, x1) = (x(a), x(b));
                let _ = writeln!(
                    s,
                    r#"<rect x="{x0:.2}" y="{comp_y:.1}" width="{:.2}" height="{ROW}" fill="{}"><title>rank {} layer {l} compute: {a:.2} to {b:.2} ms</title></rect>"#,
                    (x1 - x0).max(0.6),
                    COMPUTE[l % 2],
                    k.rank
                );
                prev_done = b;
            }
            // Layer numbers every 10 layers, above the read row.
            for (l, &r) in k.ready.iter().enumerate() {
                if l % 10 == 0 || l + 1 == k.ready.len() {
                    let _ = writeln!(
                        s,
                        r##"<text x="{:.1}" y="{:.1}" font-size="8" fill="#1b3d5c" text-anchor="end">{l}</text>"##,
                        x(r) - 1.0,
                        read_y - 1.0
                    );
                }
            }
            // Marks: last layer ready, forward done.
            if let (Some(&r), Some(&d)) = (k.ready.last(), k.done.last()) {
                let _ = writeln!(
                    s,
                    r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#1b3d5c" stroke-width="1.5"/>"##,
                    x(r),
                    read_y - 2.0,
                    read_y + ROW + 2.0
                );
                let _ = writeln!(
                    s,
                    r##"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="#7a3300" stroke-width="1.5"/>"##,
                    x(d),
                    comp_y - 2.0,
                    comp_y + ROW + 2.0
                );
                let _ = writeln!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#1b3d5c">last layer ready {r:.1} ms</text>"##,
                    LEFT + plot_w + 10.0,
                    read_y + ROW - 3.0
                );
                let _ = writeln!(
                    s,
                    r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#7a3300">forward done {d:.1} ms</text>"##,
                    LEFT + plot_w + 10.0,
                    comp_y + ROW - 3.0
                );
            }
            y += lane_h + LANE_GAP;
        }
        y += BLOCK_GAP;
    }

    // Time axis.
    let _ = writeln!(
        s,
        r#"<line x1="{LEFT}" y1="{axis_y}" x2="{:.1}" y2="{axis_y}" stroke="black" stroke-width="1"/>"#,
        LEFT + plot_w
    );
    let mut t = 0.0;
    while t <= axis_end + step * 0.01 {
        let xt = x(t);
        let _ = writeln!(
            s,
            r#"<line x1="{xt:.1}" y1="{axis_y}" x2="{xt:.1}" y2="{:.1}" stroke="black"/>"#,
            axis_y + 5.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{xt:.1}" y="{:.1}" font-size="11" text-anchor="middle">{}</text>"#,
            axis_y + 18.0,
            fmt_tick(t, step)
        );
        t += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">time since the first start_load (ms)</text>"#,
        LEFT + plot_w / 2.0,
        axis_y + 36.0
    );

    // Legend.
    let items = [
        (READ[0], READ[1], "layer read → ready (alternating shades = consecutive layers; layer 0 includes batch setup)"),
        (COMPUTE[0], COMPUTE[1], "attention compute on the layer (SIMULATED: a sleep)"),
        (STALL, STALL, "engine waiting for the next layer"),
    ];
    let mut lx = LEFT;
    let mut ly = legend_y;
    for (i, (a, b, text)) in items.iter().enumerate() {
        if i == 2 {
            lx = LEFT;
            ly += 20.0;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{:.1}" width="12" height="12" fill="{a}"/><rect x="{:.1}" y="{:.1}" width="12" height="12" fill="{b}"/>"#,
            ly - 10.0,
            lx + 12.0,
            ly - 10.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{ly:.1}" font-size="11">{}</text>"#,
            lx + 30.0,
            esc(text)
        );
        lx += 30.0 + text.len() as f64 * 6.1 + 24.0;
    }
    s.push_str("</svg>\n");
    s
}
