//! `mooncake_read`: where one Mooncake client's layer-wise read time goes, measured.
//!
//! Run it next to a real master and a separate storage node, for example
//! `MOONCAKE_STORAGE_NODE_SEGMENT="4 GB" scripts/with-mooncake.sh --storage-node
//! target/release/examples/mooncake_read --tokens 16384`. It writes GLM-5.2 FP8 objects (per
//! page: `k`, 78 layers × 41,984 B, and `indexer`, 21 layers × 8,448 B) to the storage node,
//! then clients with no segment of their own (so every byte crosses TCP) read every layer of
//! every object in each variant: the wheel's Python client (whole objects, and SGLang's
//! layer-wise path) and kvlink's `MooncakeStore` (whole objects; layer groups as separate ranges
//! or one range per object; concurrent calls; the wheel's TCP knobs; the store's read streams).
//! Variants interleave round by round on the same objects; the table gives medians. Every
//! kvlink variant's bytes are checked once; the Python reader checks its results and the
//! first word of every layer.
//!
//! A second table plans layer groups with `read_plan` from the costs just measured, for each
//! `--compute-us` (a per-layer compute time that is MODELLED, not run), and reads with them.

mod args;
mod linker_rows;
mod objects;
mod python;
mod readers;
mod report;

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result};
use kvlink::mooncake_linker::read_plan::{
    plan_reads, ReadCost, ReadCostEstimator, ReadPlanRequest,
};
use kvlink::mooncake_linker::store::mooncake::{MooncakeConfig, MooncakeStore};
use kvlink::mooncake_linker::store::KvStore;

use linker_rows::{LinkerReader, LinkerTiming, RowSpec};
use objects::{Dest, Objects};
use python::PythonReader;
use readers::{every, Read, Timing};
use report::Row;

/// Who runs a variant.
enum Runner {
    /// A command of the Python reader.
    Python(String),
    /// kvlink, on client `store` (index into the connected clients).
    Kvlink { store: usize, read: Read },
}

struct Variant {
    runner: Runner,
    row: Row,
}

const BASELINE: &str = "Python `batch_get_into`, whole objects (baseline)";

/// The connected clients and what distinguishes each.
struct Clients {
    stores: Vec<MooncakeStore>,
    /// `(client, MC_TCP_LANES_PER_PEER)`.
    lanes: Vec<(usize, usize)>,
    /// `(client, read_streams)`.
    streams: Vec<(usize, usize)>,
    /// The client with `MC_TCP_ENABLE_CONNECTION_POOL=1`.
    pooled: usize,
}

fn connect(config: &MooncakeConfig, env: Option<(&str, String)>) -> Result<MooncakeStore> {
    // The wheel reads its MC_TCP_* variables when a client's transport is created. The bench
    // sets one around that connect only, while no client has a transfer in flight.
    if let Some((k, v)) = &env {
        std::env::set_var(k, v);
    }
    let store = MooncakeStore::connect(config.clone());
    if let Some((k, _)) = &env {
        std::env::remove_var(k);
    }
    store.with_context(|| format!("connecting to {}", config.master_addr()))
}

fn connect_all(a: &args::Args, config: &MooncakeConfig) -> Result<Clients> {
    let mut stores = vec![connect(config, None)?];
    let mut lanes = Vec::new();
    for &n in &a.lanes {
        lanes.push((stores.len(), n));
        stores.push(connect(
            config,
            Some(("MC_TCP_LANES_PER_PEER", n.to_string())),
        )?);
    }
    let mut streams = Vec::new();
    for &n in &a.streams {
        streams.push((stores.len(), n));
        let store_level = config.clone().read_streams(n).staged_merge(true);
        stores.push(connect(&store_level, None)?);
    }
    let pooled = stores.len();
    stores.push(connect(
        config,
        Some(("MC_TCP_ENABLE_CONNECTION_POOL", "1".into())),
    )?);
    Ok(Clients {
        stores,
        lanes,
        streams,
        pooled,
    })
}

fn variants(a: &args::Args, objects: &Objects, clients: &Clients) -> Vec<Variant> {
    let bytes = objects.total_bytes();
    let l = objects.layers;
    let mut v = Vec::new();
    let mut add = |label: String, calls: usize, runner: Runner| {
        v.push(Variant {
            runner,
            row: Row {
                label,
                bytes,
                calls: calls as u64,
                times: Vec::new(),
                firsts: Vec::new(),
                first_calls: Vec::new(),
            },
        })
    };
    let calls = |k: u32| every(k, l).len();
    if !a.no_python {
        add(BASELINE.into(), 1, Runner::Python("whole".into()));
        add(
            "Python session + `batch_get_into_multi_buffer_ranges`, 1 layer/call".into(),
            calls(1),
            Runner::Python("ranges 1".into()),
        );
        for &k in &a.groups {
            add(
                format!("Python, {k} layers/call, 1 range/object"),
                calls(k),
                Runner::Python(format!("ranges {k}")),
            );
        }
    }
    let ranged = |k: u32, dest, parallel| Read::Ranged {
        groups: every(k, l),
        dest,
        parallel,
    };
    let on = |store: usize, read| Runner::Kvlink { store, read };
    add(
        "kvlink `get_into`, whole objects".into(),
        1,
        on(0, Read::Whole { parallel: 1 }),
    );
    for &p in &a.whole_parallel {
        add(
            format!("kvlink `get_into`, whole objects, {p} concurrent calls"),
            p,
            on(0, Read::Whole { parallel: p }),
        );
    }
    add(
        "kvlink `get_into`, whole objects, `MC_TCP_ENABLE_CONNECTION_POOL=1`".into(),
        1,
        on(clients.pooled, Read::Whole { parallel: 1 }),
    );
    add(
        "kvlink `get_ranges`, 1 layer/call".into(),
        calls(1),
        on(0, ranged(1, Dest::Pool, 1)),
    );
    for &k in &a.groups {
        add(
            format!("kvlink, {k} layers/call, {k} ranges/object (pool slots)"),
            calls(k),
            on(0, ranged(k, Dest::Pool, 1)),
        );
        add(
            format!("kvlink, {k} layers/call, 1 range/object (contiguous dst)"),
            calls(k),
            on(0, ranged(k, Dest::PageMajor, 1)),
        );
    }
    for &p in &a.parallel {
        add(
            format!("kvlink, 1 layer/call, {p} concurrent calls (`read_parallelism` {p})"),
            calls(1) * p,
            on(0, ranged(1, Dest::Pool, p)),
        );
    }
    for &(store, lanes) in &clients.lanes {
        add(
            format!(
                "kvlink, `MC_TCP_LANES_PER_PEER={lanes}`, 1 layer/call, {lanes} concurrent calls"
            ),
            calls(1) * lanes,
            on(store, ranged(1, Dest::Pool, lanes)),
        );
    }
    for &(store, streams) in &clients.streams {
        add(
            format!("{}, 1 layer/call", store_label(streams)),
            calls(1),
            on(store, ranged(1, Dest::Pool, 1)),
        );
        for &k in &a.store_groups {
            add(
                format!("{}, {k} layers/call, pool slots", store_label(streams)),
                calls(k),
                on(store, ranged(k, Dest::Pool, 1)),
            );
        }
    }
    if !a.only.is_empty() {
        v.retain(|x| a.only.iter().any(|w| x.row.label.contains(w.as_str())));
    }
    v
}

/// Runs `read` on `store` once; on the first round, with the buffers zeroed before and checked
/// after.
fn kvlink_once(
    store: &MooncakeStore,
    objects: &mut Objects,
    read: &Read,
    checked: bool,
) -> Result<Timing> {
    if checked {
        objects.clear();
    }
    let timing = readers::run(store, objects, read)?;
    if checked {
        let dest = match read {
            Read::Whole { .. } => Dest::PageMajor,
            Read::Ranged { dest, .. } => *dest,
        };
        objects.verify(dest)?;
        check_passed();
    }
    Ok(timing)
}

fn rounds(
    a: &args::Args,
    vs: &mut [Variant],
    clients: &Clients,
    objects: &mut Objects,
    python: &mut Option<PythonReader>,
    out: &mut impl Write,
) -> Result<()> {
    for round in 0..a.rounds {
        for v in vs.iter_mut() {
            let secs = match &v.runner {
                Runner::Python(cmd) => python
                    .as_mut()
                    .context("no Python reader")?
                    .run(cmd)
                    .with_context(|| v.row.label.clone())?,
                Runner::Kvlink { store, read } => {
                    let t = kvlink_once(&clients.stores[*store], objects, read, round == 0)
                        .with_context(|| v.row.label.clone())?;
                    if let Some(&first) = t.ready.first() {
                        v.row.firsts.push(first);
                        v.row.first_calls.push(first - t.session);
                    }
                    t.total
                }
            };
            v.row.times.push(secs);
        }
        writeln!(out, "round {}/{} done", round + 1, a.rounds)?;
        out.flush()?;
    }
    Ok(())
}

/// The label prefix of the store-level rows of the client with `streams` read streams.
fn store_label(streams: usize) -> String {
    format!("kvlink store (`read_streams` {streams}, staged merge)")
}

/// The cost model of one call, from the rows whose label starts with `prefix` (the average
/// call of each row: its bytes and time, median over rounds).
fn measured_cost(rows: &[Row], layers: u32, prefix: &str) -> ReadCost {
    let prior = ReadCost::from_gbps(Duration::from_millis(1), Duration::ZERO, 1.0);
    let mut est = ReadCostEstimator::new(prior);
    for r in rows.iter().filter(|r| r.label.starts_with(prefix)) {
        let calls = r.calls.max(1);
        let per_call_layers = (u64::from(layers) / calls) as u32;
        est.observe(
            per_call_layers,
            r.bytes / calls,
            Duration::from_secs_f64(r.median() / calls as f64),
        );
    }
    est.estimate()
}

/// Forward done under a MODELLED compute of `compute` per layer: layer 0 starts when ready,
/// each next one when ready and the previous one is done.
fn modelled_forward(ready: &[f64], compute: f64) -> f64 {
    let mut start: f64 = 0.0;
    for (l, r) in ready.iter().enumerate() {
        start = if l == 0 { *r } else { r.max(start + compute) };
    }
    start + compute
}

fn policy(
    a: &args::Args,
    cost: ReadCost,
    (client, streams): (&MooncakeStore, usize),
    objects: &mut Objects,
    python: &mut Option<PythonReader>,
    baseline: Option<f64>,
    out: &mut impl Write,
) -> Result<()> {
    let layer_bytes: Vec<u64> = (0..objects.layers)
        .map(|l| {
            objects
                .components
                .iter()
                .filter(|c| c.position[l as usize].is_some())
                .map(|c| c.layer_bytes * c.keys.len() as u64)
                .sum()
        })
        .collect();
    writeln!(
        out,
        "\nread_plan from the measured cost ({:.2} ms per call + {:.2} GB/s), compute per layer MODELLED (not run); {} rounds, medians; \
         client: {}, into pool slots",
        cost.per_call.as_secs_f64() * 1e3,
        1e-9 / cost.seconds_per_byte,
        a.rounds,
        store_label(streams),
    )?;
    writeln!(out, "\n| compute/layer (modelled) | layers per call | first layer ready ms | last layer ready ms | forward done ms (modelled) | Python whole-object read ms (+ 78 × compute) |")?;
    writeln!(out, "|---:|---|---:|---:|---:|---:|")?;
    for &us in &a.compute_us {
        let compute = Duration::from_micros(us);
        let plan = plan_reads(&ReadPlanRequest {
            layer_bytes: &layer_bytes,
            cost,
            compute_per_layer: compute,
            max_layers_per_call: a.max_layers_per_call.min(objects.layers),
        })?;
        let read = Read::Ranged {
            groups: plan.groups().to_vec(),
            dest: Dest::Pool,
            parallel: 1,
        };
        let (mut first, mut last, mut done, mut py) = (vec![], vec![], vec![], vec![]);
        for round in 0..a.rounds {
            let t = kvlink_once(client, objects, &read, round == 0)?;
            first.push(t.ready[0]);
            last.push(*t.ready.last().unwrap_or(&t.total));
            done.push(modelled_forward(&t.ready, compute.as_secs_f64()));
            if let Some(p) = python.as_mut() {
                py.push(p.run("whole")?);
            }
        }
        // The median as every other table takes it (the mean of the middle two for an even
        // count).
        let med = |v: &mut Vec<f64>| kvlink_rig::measure::median(v);
        let sizes: Vec<String> = plan
            .groups()
            .iter()
            .map(|g| (g.end - g.start).to_string())
            .collect();
        let py_ms = if py.is_empty() {
            baseline.unwrap_or(f64::NAN)
        } else {
            med(&mut py)
        };
        writeln!(
            out,
            "| {} ms | {} | {:.0} | {:.0} | {:.0} | {:.0} ({:.0}) |",
            compute.as_secs_f64() * 1e3,
            sizes.join(" "),
            med(&mut first) * 1e3,
            med(&mut last) * 1e3,
            med(&mut done) * 1e3,
            py_ms * 1e3,
            (py_ms + f64::from(objects.layers) * compute.as_secs_f64()) * 1e3,
        )?;
    }
    Ok(())
}

/// Byte checks that passed so far: each kvlink variant's destination and each Linker row's
/// pool, compared with the objects in the first round. A check that fails ends the run.
static CHECKS_PASSED: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Counts one byte check that passed.
fn check_passed() {
    CHECKS_PASSED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// The closing count: the checks that passed, and the one that ended the run if it failed.
fn write_checks(out: &mut impl Write, failed: u32) -> std::io::Result<()> {
    writeln!(
        out,
        "\nChecks (round 1: each kvlink variant's bytes and each Linker row's pool equal to the \
         objects; a failed check or any other failure ends the run and counts as one):"
    )?;
    writeln!(
        out,
        "{} passed, {failed} failed",
        CHECKS_PASSED.load(std::sync::atomic::Ordering::Relaxed)
    )
}

fn median(v: &mut [f64]) -> f64 {
    kvlink_rig::measure::median(v)
}

/// The `Linker` rows: one linker per `--linker-compute-us` value (each its own client, with
/// the library's defaults), interleaved round by round with the Python whole-object read.
fn linker_table(
    a: &args::Args,
    objects: &Objects,
    python: &mut Option<PythonReader>,
    rows: &[Row],
    out: &mut impl Write,
) -> Result<()> {
    if a.linker_compute_us.is_empty() {
        return Ok(());
    }
    let defaults = MooncakeConfig::from_env()?.global_segment_size(0);
    let pool = linker_rows::pool(objects)?;
    let mut readers = RowSpec::every(a)
        .into_iter()
        .map(|spec| LinkerReader::new(&defaults, &objects.namespace, a.tokens, pool.clone(), spec))
        .collect::<Result<Vec<_>>>()?;
    let mut times: Vec<Vec<LinkerTiming>> = readers.iter().map(|_| Vec::new()).collect();
    let mut py = Vec::new();
    let mut whole = || python.as_mut().map(|p| p.run("whole")).transpose();
    for round in 0..a.rounds {
        // The Python read goes before the Linker rows in the first round and every second one
        // after it, and after them in the others, so that neither side always reads right
        // after the other: the paired ratio's order is balanced.
        let python_first = round % 2 == 0;
        if python_first {
            py.extend(whole()?);
        }
        for (r, t) in readers.iter_mut().zip(&mut times) {
            t.push(r.run(objects, round == 0)?);
        }
        if !python_first {
            py.extend(whole()?);
        }
    }
    let py_ms = median(&mut py.clone()) * 1e3;
    let one_layer = rows
        .iter()
        .find(|r| r.label == "kvlink `get_ranges`, 1 layer/call")
        .map(|r| r.median() / r.calls.max(1) as f64 * 1e3);
    // Layer 0 read alone from a cold start, as a load's first layer is: the read session's
    // start and that layer's one call (layer 0 has every component: more bytes than most).
    let layer0: Vec<String> = rows
        .iter()
        .filter(|r| r.label.ends_with("1 layer/call") && !r.firsts.is_empty())
        .map(|r| {
            format!(
                "{} {:.1} ms (its call alone {:.1} ms)",
                r.label,
                r.first_median() * 1e3,
                r.first_call_median() * 1e3
            )
        })
        .collect();
    writeln!(
        out,
        "\nThe Linker (TP 1, host pool, scattered slots): adaptive layer groups, store defaults \
         (read_streams {}, staged merge {}) unless a row's columns say otherwise; an engine thread waits for each layer, then \
         computes it (SIMULATED: sleeps); {} rounds interleaved with the Python whole-object \
         read (before the Linker rows in rounds 1, 3, 5 and so on, after them in the others), \
         medians; the two ratios are medians of each round's ratio to that round's Python read \
         (paired), and the rounds whose last layer came no later than that round's Python read \
         are counted; one layer read alone (kvlink `get_ranges`, 1 layer/call, above, its \
         average call): {}; layer 0 read alone from a cold start (the read session's start and \
         its call, median): {}",
        defaults.read_streams_count(),
        if defaults.staged_merge_enabled() {
            "on"
        } else {
            "off"
        },
        a.rounds,
        one_layer.map_or("—".into(), |ms| format!("{ms:.1} ms")),
        if layer0.is_empty() {
            "—".to_string()
        } else {
            layer0.join("; ")
        },
    )?;
    writeln!(out, "\n| engine compute/layer (SIMULATED) | `MC_TCP_LANES_PER_PEER` | read streams | verify threads | checksums | checksum companions | layers per call (last round) | first layer ready ms | last layer ready ms | forward done ms | Python whole-object read ms (median of the rounds) | Python + {} × compute ms | last layer / Python | rounds: last layer ≤ Python | forward done / (Python + compute) | measured by the linker |", objects.layers)?;
    writeln!(
        out,
        "|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )?;
    for (r, t) in readers.iter().zip(&times) {
        let c = r.spec.compute.as_secs_f64() * 1e3;
        let first = median(&mut t.iter().map(|x| x.first).collect::<Vec<_>>()) * 1e3;
        let last = median(&mut t.iter().map(|x| x.last).collect::<Vec<_>>()) * 1e3;
        let done = median(&mut t.iter().map(|x| x.forward_done).collect::<Vec<_>>()) * 1e3;
        let groups = t.last().map_or(String::new(), |x| {
            x.groups
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        });
        let serial = py_ms + f64::from(objects.layers) * c;
        let compute_s = f64::from(objects.layers) * r.spec.compute.as_secs_f64();
        // Each round against the Python read of the same round (NaN without Python).
        let paired = |f: &dyn Fn(&LinkerTiming, f64) -> f64| {
            let mut v: Vec<f64> = t
                .iter()
                .enumerate()
                .map(|(i, x)| py.get(i).map_or(f64::NAN, |&p| f(x, p)))
                .collect();
            median(&mut v)
        };
        let last_vs = paired(&|x, p| x.last / p);
        let done_vs = paired(&|x, p| x.forward_done / (p + compute_s));
        let won = t.iter().zip(&py).filter(|(x, &p)| x.last <= p).count();
        let won = if py.is_empty() {
            "—".to_string()
        } else {
            format!("{won} of {}", t.len().min(py.len()))
        };
        writeln!(
            out,
            "| {c:.1} ms | {} | {groups} | {first:.0} | {last:.0} | {done:.0} | {py_ms:.0} | {serial:.0} | {last_vs:.2} | {won} | {done_vs:.2} | {} |",
            r.spec
                .columns(defaults.read_streams_count(), a.no_companions)
                .join(" | "),
            r.measured(),
        )?;
    }
    Ok(())
}

fn run(a: &args::Args, out: &mut impl Write) -> Result<()> {
    // Pure clients (every byte crosses TCP from the storage node). Unless a variant says
    // otherwise, the store reads as it did before its store-level changes: one call at a
    // time, no staged merge.
    let config = MooncakeConfig::from_env()
        .context("run under scripts/with-mooncake.sh --storage-node")?
        .global_segment_size(0)
        .read_streams(1)
        .staged_merge(false);
    // Declared before the clients, so dropped after them: the buffers outlive their
    // registrations.
    let mut objects = Objects::glm52(a.tokens, !a.no_companions)?;
    let clients = connect_all(a, &config)?;
    for s in &clients.stores {
        // SAFETY: `objects` is declared before `clients`, so its buffers are dropped only
        // after every store (and its registrations) is gone.
        unsafe { objects.register(s)? };
    }
    let t = std::time::Instant::now();
    objects.put_all(&clients.stores[0])?;
    writeln!(
        out,
        "{} pages × {{{}}}: {:.2} GB written to the storage node in {:.1} s ({}); this machine: {} CPUs; MC_TCP_SLICE_SIZE={}",
        objects.pages,
        objects
            .components
            .iter()
            .map(|c| format!("`{}` {} B", c.name, c.object_bytes()))
            .collect::<Vec<_>>()
            .join(", "),
        objects.total_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64(),
        if a.no_companions {
            "no checksum companions: objects as SGLang writes them"
        } else {
            "each with its checksum companion, as kvlink's save writes it"
        },
        std::thread::available_parallelism().map_or(0, usize::from),
        std::env::var("MC_TCP_SLICE_SIZE").unwrap_or_else(|_| "unset (64 KiB)".into()),
    )?;
    {
        // What a batch pays before its first read: the read session (one master call for
        // every key) and the size check (one master call per key in the pinned wheel).
        let keys = objects.all_keys();
        let t = std::time::Instant::now();
        let session = clients.stores[0].start_session(&keys)?;
        let session_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = std::time::Instant::now();
        let sizes = clients.stores[0].object_size(&keys);
        let sizes_ms = t.elapsed().as_secs_f64() * 1e3;
        clients.stores[0].end_session(&session)?;
        if let Some(e) = sizes.into_iter().find_map(Result::err) {
            anyhow::bail!("object_size: {e}");
        }
        writeln!(
            out,
            "before the first read, for {} keys: read session start {session_ms:.1} ms; object sizes {sizes_ms:.1} ms",
            keys.len()
        )?;
    }
    let mut python = if a.no_python {
        None
    } else {
        Some(PythonReader::start(config.master_addr(), &objects)?)
    };
    let mut vs = variants(a, &objects, &clients);
    rounds(a, &mut vs, &clients, &mut objects, &mut python, out)?;
    let rows: Vec<Row> = vs.into_iter().map(|v| v.row).collect();
    writeln!(out)?;
    report::table(out, &rows, (!a.no_python).then_some(BASELINE))?;
    if let (false, Some(&(idx, streams))) = (a.compute_us.is_empty(), clients.streams.first()) {
        let cost = measured_cost(&rows, objects.layers, &store_label(streams));
        let baseline = rows.iter().find(|r| r.label == BASELINE).map(Row::median);
        let client = (&clients.stores[idx], streams);
        policy(a, cost, client, &mut objects, &mut python, baseline, out)?;
    }
    linker_table(a, &objects, &mut python, &rows, out)?;
    drop(python);
    for s in &clients.stores {
        s.health()?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    let a = args::parse();
    let mut out = std::io::stdout().lock();
    match run(&a, &mut out) {
        Ok(()) => {
            let _ = write_checks(&mut out, 0);
            ExitCode::SUCCESS
        }
        Err(e) => {
            let _ = write_checks(&mut out, 1);
            let _ = out.flush();
            let _ = writeln!(std::io::stderr(), "error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
