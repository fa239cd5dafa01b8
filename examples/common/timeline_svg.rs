//! The one timeline picture of the examples, as SVG: blocks (a run, a mode) of lanes (a rank)
//! of rows (reads, compute, copies) of time spans, over one shared time axis in milliseconds.
//! `glm_prefill`, `tp_gpu` and `gpu_check` each describe their timeline as a [`Chart`] and
//! draw it with [`render`].

use std::fmt::Write;

/// One bar on a row: `start..end` in ms, its colour and its hover text.
#[derive(Debug, Clone)]
pub struct Span {
    /// Start, ms.
    pub start: f64,
    /// End, ms.
    pub end: f64,
    /// Fill colour.
    pub fill: &'static str,
    /// Drawn at 40 % of the row's height (a wait rather than work).
    pub thin: bool,
    /// Hover text.
    pub title: String,
}

/// A vertical mark on a row with its text in the right margin (e.g. "last layer ready").
#[derive(Debug, Clone)]
pub struct Mark {
    /// When, ms.
    pub at: f64,
    /// Colour of the mark and its text.
    pub color: &'static str,
    /// Text in the right margin.
    pub text: String,
}

/// One row of bars.
#[derive(Debug, Clone, Default)]
pub struct Row {
    /// Name at the left of the plot.
    pub label: String,
    /// The bars.
    pub spans: Vec<Span>,
    /// A mark, if any.
    pub mark: Option<Mark>,
    /// Small labels just above the row, at a time (e.g. layer numbers).
    pub tags: Vec<(f64, String)>,
}

/// One lane: a named group of rows (a rank).
#[derive(Debug, Clone, Default)]
pub struct Lane {
    /// Name at the far left (e.g. `rank 0`).
    pub label: String,
    /// Its rows, top to bottom.
    pub rows: Vec<Row>,
}

/// One block: a heading, a note, lanes (a run, a mode).
#[derive(Debug, Clone, Default)]
pub struct Block {
    /// Heading.
    pub label: String,
    /// A note after the heading (key numbers).
    pub note: String,
    /// Lanes.
    pub lanes: Vec<Lane>,
}

/// The whole picture.
#[derive(Debug, Clone, Default)]
pub struct Chart {
    /// Title line.
    pub title: String,
    /// Line under the title.
    pub subtitle: String,
    /// Under the time axis, e.g. `time since the first start_load (ms)`.
    pub axis_label: String,
    /// Blocks, top to bottom, on one time axis.
    pub blocks: Vec<Block>,
    /// Legend: two shades and what they mean.
    pub legend: Vec<(&'static str, &'static str, String)>,
}

const W: f64 = 1400.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 190.0;
const ROW: f64 = 14.0;
const ROW_GAP: f64 = 3.0;
const LANE_GAP: f64 = 12.0;
const BLOCK_HEAD: f64 = 34.0;
const BLOCK_GAP: f64 = 16.0;
const TOP: f64 = 64.0;

/// Escapes text for SVG.
pub fn esc(s: &str) -> String {
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

fn lane_height(lane: &Lane) -> f64 {
    let rows = lane.rows.len().max(1) as f64;
    rows * ROW + (rows - 1.0) * ROW_GAP
}

/// The latest time anything is drawn at.
fn t_max(chart: &Chart) -> f64 {
    let rows = chart
        .blocks
        .iter()
        .flat_map(|b| &b.lanes)
        .flat_map(|l| &l.rows);
    rows.flat_map(|r| {
        r.spans
            .iter()
            .map(|s| s.end)
            .chain(r.mark.as_ref().map(|m| m.at))
    })
    .fold(0.0f64, f64::max)
    .max(0.001)
}

/// Draws `chart`.
pub fn render(chart: &Chart) -> String {
    let step = tick_step(t_max(chart), 12.0);
    let axis_end = (t_max(chart) / step).ceil() * step;
    let plot_w = W - LEFT - RIGHT;
    let x = |t: f64| LEFT + (t.max(0.0) / axis_end) * plot_w;
    let blocks_h: f64 = chart
        .blocks
        .iter()
        .map(|b| {
            BLOCK_HEAD
                + b.lanes
                    .iter()
                    .map(|l| lane_height(l) + LANE_GAP)
                    .sum::<f64>()
                + BLOCK_GAP
        })
        .sum();
    let axis_y = TOP + blocks_h;
    let legend_y = axis_y + 48.0;
    let h = legend_y + 20.0 * chart.legend.len().div_ceil(2) as f64 + 38.0;

    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{h:.0}" viewBox="0 0 {W} {h:.0}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="20" y="26" font-size="17" font-weight="bold">{}</text>"#,
        esc(&chart.title)
    );
    let _ = writeln!(
        s,
        r##"<text x="20" y="47" font-size="12" fill="#444">{}</text>"##,
        esc(&chart.subtitle)
    );
    grid(&mut s, axis_end, step, axis_y, &x);
    let mut y = TOP;
    for block in &chart.blocks {
        y = draw_block(&mut s, block, y, plot_w, &x);
    }
    axis(&mut s, chart, axis_end, step, axis_y, plot_w, &x);
    legend(&mut s, chart, legend_y);
    s.push_str("</svg>\n");
    s
}

fn grid(s: &mut String, axis_end: f64, step: f64, axis_y: f64, x: &dyn Fn(f64) -> f64) {
    let mut t = 0.0;
    while t <= axis_end + step * 0.01 {
        let _ = writeln!(
            s,
            r##"<line x1="{0:.1}" y1="{TOP}" x2="{0:.1}" y2="{axis_y}" stroke="#ececec" stroke-width="1"/>"##,
            x(t)
        );
        t += step;
    }
}

/// Draws one block from `y` down; returns the `y` after it.
fn draw_block(s: &mut String, block: &Block, y: f64, plot_w: f64, x: &dyn Fn(f64) -> f64) -> f64 {
    let _ = writeln!(
        s,
        r#"<text x="20" y="{:.1}" font-size="14" font-weight="bold">{}</text>"#,
        y + 18.0,
        esc(&block.label)
    );
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" font-size="12" fill="#333">{}</text>"##,
        20.0 + block.label.chars().count() as f64 * 8.8 + 16.0,
        y + 18.0,
        esc(&block.note)
    );
    let mut y = y + BLOCK_HEAD;
    for lane in &block.lanes {
        let _ = writeln!(
            s,
            r#"<text x="20" y="{:.1}" font-size="12" font-weight="bold">{}</text>"#,
            y + ROW - 2.0,
            esc(&lane.label)
        );
        for (i, row) in lane.rows.iter().enumerate() {
            draw_row(s, row, y + i as f64 * (ROW + ROW_GAP), plot_w, x);
        }
        y += lane_height(lane) + LANE_GAP;
    }
    y + BLOCK_GAP
}

fn draw_row(s: &mut String, row: &Row, ry: f64, plot_w: f64, x: &dyn Fn(f64) -> f64) {
    let _ = writeln!(
        s,
        r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#555" text-anchor="end">{}</text>"##,
        LEFT - 6.0,
        ry + ROW - 3.0,
        esc(&row.label)
    );
    for sp in &row.spans {
        let (x0, x1) = (x(sp.start), x(sp.end));
        let (top, height, min_w) = if sp.thin {
            (ry + ROW * 0.3, ROW * 0.4, 0.0)
        } else {
            (ry, ROW, 0.6)
        };
        let _ = writeln!(
            s,
            r#"<rect x="{x0:.2}" y="{top:.1}" width="{:.2}" height="{height:.1}" fill="{}"><title>{}</title></rect>"#,
            (x1 - x0).max(min_w),
            sp.fill,
            esc(&sp.title)
        );
    }
    for (at, text) in &row.tags {
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="8" fill="#1b3d5c" text-anchor="end">{}</text>"##,
            x(*at) - 1.0,
            ry - 1.0,
            esc(text)
        );
    }
    if let Some(m) = &row.mark {
        let _ = writeln!(
            s,
            r#"<line x1="{0:.1}" y1="{1:.1}" x2="{0:.1}" y2="{2:.1}" stroke="{3}" stroke-width="1.5"/>"#,
            x(m.at),
            ry - 2.0,
            ry + ROW + 2.0,
            m.color
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="10" fill="{}">{}</text>"#,
            LEFT + plot_w + 10.0,
            ry + ROW - 3.0,
            m.color,
            esc(&m.text)
        );
    }
}

fn axis(
    s: &mut String,
    chart: &Chart,
    axis_end: f64,
    step: f64,
    axis_y: f64,
    plot_w: f64,
    x: &dyn Fn(f64) -> f64,
) {
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
        r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
        LEFT + plot_w / 2.0,
        axis_y + 36.0,
        esc(&chart.axis_label)
    );
}

fn legend(s: &mut String, chart: &Chart, legend_y: f64) {
    let (mut lx, mut ly) = (LEFT, legend_y);
    for (i, (a, b, text)) in chart.legend.iter().enumerate() {
        if i > 0 && i % 2 == 0 {
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
}

/// Spans from `start` to each time in `ends`, one after the other (a thread doing the layers in
/// order), alternating two shades; `title(i, from, to)` is each one's hover text.
pub fn chained(
    start: f64,
    ends: &[f64],
    shades: [&'static str; 2],
    title: impl Fn(usize, f64, f64) -> String,
) -> Vec<Span> {
    let mut prev = start;
    ends.iter()
        .enumerate()
        .map(|(i, &e)| {
            let sp = Span {
                start: prev,
                end: e,
                fill: shades[i % 2],
                thin: false,
                title: title(i, prev, e),
            };
            prev = e;
            sp
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_span_mark_and_label() {
        let row = Row {
            label: "read".into(),
            spans: chained(0.0, &[1.0, 2.5], ["#111111", "#222222"], |i, a, b| {
                format!("layer {i}: {a} to {b}")
            }),
            mark: Some(Mark {
                at: 2.5,
                color: "#333333",
                text: "last 2.5 ms".into(),
            }),
            tags: vec![(1.0, "0".into())],
        };
        let chart = Chart {
            title: "t <&>".into(),
            axis_label: "time (ms)".into(),
            blocks: vec![Block {
                label: "mode".into(),
                lanes: vec![Lane {
                    label: "rank 0".into(),
                    rows: vec![row],
                }],
                ..Block::default()
            }],
            ..Chart::default()
        };
        let svg = render(&chart);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<rect x=").count(), 2, "{svg}");
        assert!(svg.contains("layer 1: 1 to 2.5"), "{svg}");
        assert!(svg.contains(">rank 0</text>") && svg.contains(">last 2.5 ms</text>"));
        assert!(svg.contains("t &lt;&amp;&gt;") && svg.contains(">time (ms)</text>"));
    }
}
