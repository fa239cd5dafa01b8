//! What the runs measured, the checks on it, and the markdown tables of one (pools, size).

use std::fmt::Write as _;
use std::time::Duration;

use kvlink::kv_loader::ShareMode;

use crate::args::{Args, Pools};
use crate::compute;
use crate::prefix::Prefix;
use crate::rig::RankRun;
use kvlink_rig::measure::{fmt_bytes, fmt_tokens, median, Markdown};
use kvlink_rig::report::{Report, Status};

/// The seed's table (SGLang, GLM-5.2 W4AFP8, 8×H20, TP8, Mooncake over RDMA, TTFT).
const SEED: [(u64, f64, f64); 3] = [
    (131_072, 1.959, 1.185),
    (262_144, 3.851, 2.229),
    (524_288, 7.950, 4.891),
];

/// Auto's pick counts as the best when its mode's median is within this of the best mode's:
/// Auto's own tie margin (10 %) and 5 % for the medians being of other batches.
const PICK_TOLERANCE: f64 = 1.15;

/// One mode's batches on one rig.
pub struct ModeResult {
    pub name: String,
    pub mode: ShareMode,
    /// Per measured batch, the slowest rank's seconds to its first layer, last layer and
    /// forward done.
    first: Vec<f64>,
    last: Vec<f64>,
    done: Vec<f64>,
    /// Per rank, of the last batch: store bytes read, PCIe bytes.
    reads: Vec<u64>,
    pcie: Vec<u64>,
    /// Every rank of every batch that ran another mode than `mode` ("batch 2: rank 1 ran
    /// AllRanks"): its time is in the medians, so the row would credit `mode` with it.
    off_mode: Vec<String>,
    /// Rank 0's layers per store call in the last batch.
    groups: Vec<u32>,
}

impl ModeResult {
    pub fn new(name: String, mode: ShareMode) -> Self {
        ModeResult {
            name,
            mode,
            first: Vec::new(),
            last: Vec::new(),
            done: Vec::new(),
            reads: Vec::new(),
            pcie: Vec::new(),
            off_mode: Vec::new(),
            groups: Vec::new(),
        }
    }

    /// One batch on every rank.
    pub fn add(&mut self, runs: &[RankRun]) {
        let batch = self.last.len() + 1;
        for (r, run) in runs.iter().enumerate() {
            if run.stats.mode != self.mode {
                self.off_mode
                    .push(format!("batch {batch}: rank {r} ran {:?}", run.stats.mode));
            }
        }
        let max = |f: fn(&RankRun) -> f64| runs.iter().map(f).fold(0.0, f64::max);
        self.first.push(max(|r| r.first));
        self.last.push(max(|r| r.last));
        self.done.push(max(|r| r.forward_done));
        self.reads = runs.iter().map(|r| r.stats.bytes_read).collect();
        self.pcie = runs.iter().map(|r| r.stats.transfers.pcie()).collect();
        self.groups = runs
            .first()
            .map(|r| r.stats.read_groups.clone())
            .unwrap_or_default();
    }

    /// Every rank of every measured batch that ran another mode than this result's (empty:
    /// each ran as configured).
    pub fn off_mode(&self) -> &[String] {
        &self.off_mode
    }

    /// Median seconds to the last layer (slowest rank).
    pub fn last(&self) -> f64 {
        median(&mut self.last.clone())
    }

    fn first(&self) -> f64 {
        median(&mut self.first.clone())
    }

    fn done(&self) -> f64 {
        median(&mut self.done.clone())
    }

    /// Store bytes per rank are what the mode reads: every rank a copy (`AllRanks`), rank 0
    /// alone (`Rank0Broadcast`), 1/N each within one page's bytes (of `pages`) and one copy
    /// together (`SplitAllGather`).
    pub fn store_check(
        &self,
        tp: u32,
        (one_copy, pages): (u64, u64),
        report: &mut Report,
        label: &str,
    ) {
        let total: u64 = self.reads.iter().sum();
        let ok = match self.mode {
            _ if tp == 1 => self.reads.iter().all(|&b| b == one_copy),
            ShareMode::AllRanks => self.reads.iter().all(|&b| b == one_copy),
            ShareMode::Rank0Broadcast => {
                self.reads.first() == Some(&one_copy) && self.reads[1..].iter().all(|&b| b == 0)
            }
            // Pages split by count: a rank's bytes are within one page's of an even share (a
            // tolerance of half a share let 0.76 / 0.24 of one copy pass at TP 2).
            ShareMode::SplitAllGather => {
                let share = one_copy / u64::from(tp);
                let page = one_copy / pages.max(1);
                total == one_copy && self.reads.iter().all(|&b| b.abs_diff(share) <= page)
            }
        };
        report.push(
            "bytes",
            format!("{label} {}: store bytes per rank", self.name),
            if ok { Status::Pass } else { Status::Fail },
            format!(
                "[{}] ({} in total; one copy {})",
                list(&self.reads),
                fmt_bytes(total),
                fmt_bytes(one_copy)
            ),
        );
    }
}

fn list(v: &[u64]) -> String {
    v.iter()
        .map(|&b| fmt_bytes(b))
        .collect::<Vec<_>>()
        .join(" / ")
}

fn ms(s: f64) -> String {
    if s.is_finite() {
        format!("{:.0} ms", s * 1e3)
    } else {
        "—".into()
    }
}

/// One fresh Auto run.
pub struct AutoRun {
    /// The mode of each batch while it measured.
    pub measuring: Vec<ShareMode>,
    /// Each of those batches' time to the last layer (slowest rank, seconds).
    pub measured_last: Vec<f64>,
    /// The mode it kept (`None`: not decided within the batches allowed).
    pub kept: Option<ShareMode>,
    /// Its measured batches after the decision.
    pub result: ModeResult,
}

/// Everything one TP size measured.
struct TpRows {
    tp: u32,
    fixed: Vec<ModeResult>,
    autos: Vec<AutoRun>,
}

/// The tables of one (pools, size).
pub struct SizeTables {
    pools: Pools,
    tokens: u64,
    bytes: u64,
    nodes: u32,
    compute: Duration,
    compute_text: String,
    reps: usize,
    warmup: usize,
    rows: Vec<TpRows>,
}

impl SizeTables {
    pub fn new(pools: Pools, prefix: &Prefix, nodes: u32, compute: Duration, a: &Args) -> Self {
        SizeTables {
            pools,
            tokens: prefix.tokens,
            bytes: prefix.bytes,
            nodes,
            compute,
            compute_text: if compute.is_zero() {
                "no compute (--no-compute): pure load time".into()
            } else {
                compute::describe(prefix.tokens, a.suffix_tokens)
            },
            reps: a.reps,
            warmup: a.warmup,
            rows: Vec::new(),
        }
    }

    /// One TP size's results, and the checks on them: Auto's pick is the best mode (or within
    /// the tolerance of it) by each mode's median over batches that run did not decide from
    /// (the fixed row's, and the other Auto runs' while they measured: a fixed row alone is
    /// one or two batches, as noisy as the margin between close modes), Auto's runs agree, and
    /// at TP 8 on one storage node `Rank0Broadcast` takes at most 0.25× `AllRanks`.
    pub fn add(
        &mut self,
        tp: u32,
        fixed: Vec<ModeResult>,
        autos: Vec<AutoRun>,
        report: &mut Report,
        label: &str,
    ) {
        let time = |m: ShareMode| fixed.iter().find(|r| r.mode == m).map(ModeResult::last);
        let best_fixed = fixed
            .iter()
            .min_by(|a, b| a.last().total_cmp(&b.last()))
            .map(|r| (r.mode, r.last()));
        report.info(
            "auto",
            format!("{label}: the fixed rows' batches (ms)"),
            batch_times(
                fixed
                    .iter()
                    .flat_map(|r| r.last.iter().map(move |&t| (r.mode, t))),
            ),
        );
        for (i, run) in autos.iter().enumerate() {
            let every = batches_beside(&fixed, &autos, i);
            let (status, what) = judge_pick(run, &every, &time, best_fixed);
            report.push(
                "auto",
                format!("{label} Auto run {}: picks the best mode", i + 1),
                status,
                what,
            );
        }
        if autos.len() >= 2 {
            let picks: Vec<Option<ShareMode>> = autos.iter().map(|r| r.kept).collect();
            let agree = picks.windows(2).all(|w| w[0] == w[1]) && picks[0].is_some();
            report.push(
                "auto",
                format!("{label} Auto: {} runs agree", autos.len()),
                if agree { Status::Pass } else { Status::Fail },
                format!("{picks:?}"),
            );
        }
        if tp == 8 {
            if let (Some(all), Some(r0)) =
                (time(ShareMode::AllRanks), time(ShareMode::Rank0Broadcast))
            {
                let ratio = r0 / all;
                let target = self.nodes == 1;
                report.push(
                    "target",
                    format!("{label}: Rank0Broadcast ≤ 0.25 × AllRanks"),
                    match (target, ratio <= 0.25) {
                        (false, _) => Status::Info,
                        (true, true) => Status::Pass,
                        (true, false) => Status::Fail,
                    },
                    format!(
                        "{} / {} = {ratio:.2}{}",
                        ms(r0),
                        ms(all),
                        if target {
                            ""
                        } else {
                            " (the target is for one storage node)"
                        }
                    ),
                );
            }
        }
        self.rows.push(TpRows { tp, fixed, autos });
    }

    /// The markdown of this (pools, size).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let pools = match self.pools {
            Pools::Host => {
                "host pools; ranks are threads of one process sharing through the \
                            in-process host group (one CPU copy per row per receiver)"
            }
            Pools::Gpu => {
                "device pools, every rank on GPU 0 (in-process device group: \
                           device-to-device copies ordered by events, no NVLink); PCIe and HBM \
                           shared by every rank"
            }
            Pools::Nccl => "device pools, one rank per GPU, NCCL",
            Pools::Cpu => {
                "device pools on CPU devices (a DRY RUN of the device orchestration: \
                           no GPU number)"
            }
        };
        let _ = writeln!(
            out,
            "# Dedup modes against a real Mooncake Store: GLM-5.2 FP8, {} cached tokens ({} per \
             copy), {} storage node(s)\n",
            fmt_tokens(self.tokens),
            fmt_bytes(self.bytes),
            self.nodes
        );
        let _ = writeln!(
            out,
            "Pools: {pools}. Store: Mooncake over TCP loopback, one client per rank with no \
             segment of its own (every byte crosses TCP from a storage node), adaptive layer \
             groups (LoadStats.read_groups). Times: the slowest rank, from its `start_load`, \
             median of {} batches per fixed mode after {} unreported warm-up batches ({} for \
             Auto after it decided); the pools are zeroed before each mode's last batch and \
             every row of every rank is checked against the saved bytes after it.\n\n{}.\n",
            self.reps, self.warmup, self.reps, self.compute_text
        );
        let mut t = Markdown::new(&[
            "TP",
            "mode",
            "last layer ready",
            "forward done (compute MODELLED)",
            "first layer ready",
            "vs AllRanks (last layer)",
            "store bytes read per rank",
            "PCIe bytes per rank",
            "layers per call (rank 0)",
        ]);
        for r in &self.rows {
            let base = r
                .fixed
                .iter()
                .find(|m| m.mode == ShareMode::AllRanks)
                .map(ModeResult::last);
            let row = |m: &ModeResult, name: String| {
                vec![
                    r.tp.to_string(),
                    name,
                    ms(m.last()),
                    ms(m.done()),
                    ms(m.first()),
                    base.map_or("—".into(), |b| format!("{:.2}×", m.last() / b)),
                    list(&m.reads),
                    if self.pools == Pools::Host {
                        "— (host pools)".into()
                    } else {
                        list(&m.pcie)
                    },
                    m.groups
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(" "),
                ]
            };
            for m in &r.fixed {
                t.row(row(m, format!("{:?}", m.mode)));
            }
            for (i, a) in r.autos.iter().enumerate() {
                let name = match a.kept {
                    Some(k) => format!("Auto (run {}) → {k:?}", i + 1),
                    None => format!("Auto (run {}): undecided", i + 1),
                };
                t.row(row(&a.result, name));
            }
        }
        out.push_str(&t.render());
        let _ = writeln!(
            out,
            "\nAuto measures every mode in rounds (3 batches per mode by default; a mode 1.5× \
             slower than the best after the first round is dropped; up to 6 per mode while a \
             mode is within 5 % of the tie margin), keeps the lowest median, and breaks ties \
             within 10 % towards fewer store bytes per rank. Batches each Auto \
             run spent measuring: {}.",
            self.rows
                .iter()
                .flat_map(|r| r.autos.iter().map(move |a| format!(
                    "TP{} {}",
                    r.tp,
                    a.measuring.len()
                )))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some((_, all, r0)) = SEED.iter().find(|s| s.0 == self.tokens) {
            let _ = writeln!(
                out,
                "\nBeside the seed (SGLang, GLM-5.2 W4AFP8, 8×H20, TP8, Mooncake over RDMA, \
                 TTFT): every rank loads {all:.3} s, rank 0 + broadcast {r0:.3} s. Here \
                 (forward done, TP8): {}. What differs: TCP over loopback instead of RDMA, one \
                 host whose cores run the storage node(s), the clients and the ranks, the \
                 compute modelled (not run), {}.",
                self.rows
                    .iter()
                    .find(|r| r.tp == 8)
                    .map(|r| r
                        .fixed
                        .iter()
                        .map(|m| format!("{:?} {:.3} s", m.mode, m.done()))
                        .chain(
                            r.autos
                                .iter()
                                .map(|a| format!("Auto {:.3} s", a.result.done()))
                        )
                        .collect::<Vec<_>>()
                        .join(", "))
                    .unwrap_or_else(|| "TP8 not run".into()),
                match self.pools {
                    Pools::Host => "host pools (no GPU)",
                    Pools::Gpu => "every rank on one GPU",
                    Pools::Nccl => "one GPU per rank",
                    Pools::Cpu => "CPU devices (dry run)",
                }
            );
        }
        let _ = writeln!(
            out,
            "\nOne layer's compute here: {:.2} ms.",
            self.compute.as_secs_f64() * 1e3
        );
        out
    }
}

/// Whether Auto run `run` kept the best mode: by each mode's median over `every` (the batches
/// it did not decide from), within [`PICK_TOLERANCE`]; with the fixed rows (`time`,
/// `best_fixed`) beside, for the reader.
fn judge_pick(
    run: &AutoRun,
    every: &[(ShareMode, Vec<f64>)],
    time: &dyn Fn(ShareMode) -> Option<f64>,
    best_fixed: Option<(ShareMode, f64)>,
) -> (Status, String) {
    let pooled = |m: ShareMode| {
        every
            .iter()
            .find(|(mode, _)| *mode == m)
            .map_or((f64::INFINITY, 0), |(_, v)| {
                (median(&mut v.clone()), v.len())
            })
    };
    let best = every
        .iter()
        .map(|(m, _)| (*m, pooled(*m).0))
        .min_by(|a, b| a.1.total_cmp(&b.1));
    match (run.kept, best, best_fixed) {
        (None, ..) => (Status::Fail, "Auto kept no mode".to_string()),
        (Some(k), Some((b, bt)), Some((bf, bft))) => {
            let (kt, kn) = pooled(k);
            let ok = kt <= bt * PICK_TOLERANCE;
            (
                if ok { Status::Pass } else { Status::Fail },
                format!(
                    "kept {k:?} (median {} over {kn} batches it did not decide from, \
                     {:.2}× the best); best by those {b:?} ({} over {}); by the fixed rows \
                     alone {k:?} {} against {bf:?} {} ({:.2}×); after {} batches [{}]; \
                     Auto's own batches after it kept a mode {}; while it measured, median by \
                     mode: {}; each batch while it measured (ms): {}",
                    ms(kt),
                    kt / bt,
                    ms(bt),
                    pooled(b).1,
                    ms(time(k).unwrap_or(f64::INFINITY)),
                    ms(bft),
                    time(k).unwrap_or(f64::INFINITY) / bft,
                    run.measuring.len(),
                    run.measuring
                        .iter()
                        .map(|m| format!("{m:?}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                    ms(run.result.last()),
                    calibration_medians(run),
                    batch_times(measured(run))
                ),
            )
        }
        (Some(k), ..) => (Status::Info, format!("kept {k:?} (no fixed mode ran)")),
    }
}

/// Each mode's batch times (slowest rank, to the last layer) at one TP size that Auto run
/// `judged` did not decide from: the fixed rows', and the other Auto runs' while they measured
/// (not the batches after a decision: only the kept mode has those, run later and warmer).
fn batches_beside(
    fixed: &[ModeResult],
    autos: &[AutoRun],
    judged: usize,
) -> Vec<(ShareMode, Vec<f64>)> {
    let fixed = fixed
        .iter()
        .flat_map(|r| r.last.iter().map(move |&t| (r.mode, t)));
    let measuring = autos
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != judged)
        .flat_map(|(_, run)| measured(run));
    by_mode(fixed.chain(measuring))
}

/// The batches Auto run `run` measured, as (mode, time to the last layer).
fn measured(run: &AutoRun) -> impl Iterator<Item = (ShareMode, f64)> + '_ {
    run.measuring
        .iter()
        .copied()
        .zip(run.measured_last.iter().copied())
}

/// Times grouped by mode, modes in first-seen order.
fn by_mode(times: impl Iterator<Item = (ShareMode, f64)>) -> Vec<(ShareMode, Vec<f64>)> {
    let mut by: Vec<(ShareMode, Vec<f64>)> = Vec::new();
    for (m, t) in times {
        match by.iter_mut().find(|(mode, _)| *mode == m) {
            Some((_, v)) => v.push(t),
            None => by.push((m, vec![t])),
        }
    }
    by
}

/// Batches as `mode ms` in the order they ran (the raw times a pick's stability is read from).
fn batch_times(times: impl Iterator<Item = (ShareMode, f64)>) -> String {
    times
        .map(|(m, t)| format!("{m:?} {:.0}", t * 1e3))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The median time to the last layer of each mode's batches while Auto measured.
fn calibration_medians(run: &AutoRun) -> String {
    by_mode(measured(run))
        .into_iter()
        .map(|(m, mut v)| {
            let n = v.len();
            format!(
                "{m:?} {} ({n} batches)",
                ms(kvlink_rig::measure::median(&mut v))
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use kvlink::kv_loader::{LoadStats, ShareMode};

    use super::ModeResult;
    use crate::rig::RankRun;

    fn run(mode: ShareMode) -> RankRun {
        RankRun {
            stats: LoadStats {
                pages: 1,
                layers: 1,
                mode,
                ..LoadStats::default()
            },
            first: 0.1,
            last: 0.2,
            forward_done: 0.3,
        }
    }

    /// Before, only the last batch's modes were kept: a batch that fell back to another mode
    /// earlier had its time in the medians while the row said "ran as configured".
    #[test]
    fn a_batch_of_another_mode_is_flagged_whichever_batch_it_was() {
        let mut r = ModeResult::new("Rank0Broadcast".into(), ShareMode::Rank0Broadcast);
        r.add(&[
            run(ShareMode::Rank0Broadcast),
            run(ShareMode::Rank0Broadcast),
        ]);
        r.add(&[run(ShareMode::AllRanks), run(ShareMode::AllRanks)]);
        r.add(&[
            run(ShareMode::Rank0Broadcast),
            run(ShareMode::Rank0Broadcast),
        ]);
        assert_eq!(
            r.off_mode(),
            [
                "batch 2: rank 0 ran AllRanks",
                "batch 2: rank 1 ran AllRanks"
            ]
        );
    }
}
