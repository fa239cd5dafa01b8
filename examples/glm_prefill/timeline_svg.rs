//! The timeline picture: per run (mode) a block, per rank a lane with a "read → ready" row
//! and a "compute" row, a shared time axis in milliseconds; drawn by the examples' one
//! timeline module (`examples/common/timeline_svg.rs`).

#[path = "../common/timeline_svg.rs"]
mod chart;

use chart::{chained, Block, Chart, Lane, Mark, Row, Span};

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
    /// Each rank's times count from its own `start_load` (rank processes share no clock),
    /// not from the first `start_load` of any rank.
    pub own_starts: bool,
}

impl RunTimeline {
    /// What the times count from, as the axis and the table say it.
    pub fn origin(&self) -> &'static str {
        if self.own_starts {
            "each rank's own start_load"
        } else {
            "the first start_load"
        }
    }
}

const READ: [&str; 2] = ["#2f6ea8", "#8fbce6"];
const COMPUTE: [&str; 2] = ["#e0701b", "#f7b77a"];
const STALL: &str = "#d9d9d9";

/// The whole picture. `title` and `subtitle` head it; every run shares one time axis.
pub fn render(title: &str, subtitle: &str, runs: &[RunTimeline]) -> String {
    let blocks = runs
        .iter()
        .map(|run| Block {
            label: run.label.clone(),
            note: run.note.clone(),
            lanes: run.ranks.iter().map(lane).collect(),
        })
        .collect();
    chart::render(&Chart {
        title: title.to_string(),
        subtitle: subtitle.to_string(),
        axis_label: format!(
            "time since {} (ms)",
            runs.first()
                .map_or("the first start_load", RunTimeline::origin)
        ),
        blocks,
        legend: vec![
            (
                READ[0],
                READ[1],
                "layer read → ready (alternating shades = consecutive layers; layer 0 includes \
                 batch setup)"
                    .into(),
            ),
            (
                COMPUTE[0],
                COMPUTE[1],
                "attention compute on the layer (SIMULATED: a sleep)".into(),
            ),
            (STALL, STALL, "engine waiting for the next layer".into()),
        ],
    })
}

/// One rank: its reads (layer l between layer l-1 ready and layer l ready: one load thread
/// reads the layers in order; layer 0 includes the batch setup), its compute and the engine's
/// waits for a layer.
fn lane(k: &RankTimeline) -> Lane {
    let rank = k.rank;
    let read = Row {
        label: "read → ready".into(),
        spans: chained(k.start, &k.ready, READ, |l, a, b| {
            format!("rank {rank} layer {l} read: {a:.2} to {b:.2} ms")
        }),
        mark: k.ready.last().map(|&r| Mark {
            at: r,
            color: "#1b3d5c",
            text: format!("last layer ready {r:.1} ms"),
        }),
        tags: k
            .ready
            .iter()
            .enumerate()
            .filter(|(l, _)| l % 10 == 0 || l + 1 == k.ready.len())
            .map(|(l, &r)| (r, l.to_string()))
            .collect(),
    };
    let mut spans = Vec::new();
    let mut prev_done = k.start;
    for (l, (&a, &b)) in k.seen.iter().zip(&k.done).enumerate() {
        if a > prev_done {
            spans.push(Span {
                start: prev_done,
                end: a,
                fill: STALL,
                thin: true,
                title: format!("rank {rank} waits for layer {l}: {prev_done:.2} to {a:.2} ms"),
            });
        }
        spans.push(Span {
            start: a,
            end: b,
            fill: COMPUTE[l % 2],
            thin: false,
            title: format!("rank {rank} layer {l} compute: {a:.2} to {b:.2} ms"),
        });
        prev_done = b;
    }
    let compute = Row {
        label: "compute (SIMULATED)".into(),
        spans,
        mark: k.done.last().map(|&d| Mark {
            at: d,
            color: "#7a3300",
            text: format!("forward done {d:.1} ms"),
        }),
        tags: Vec::new(),
    };
    Lane {
        label: format!("rank {rank}"),
        rows: vec![read, compute],
    }
}
