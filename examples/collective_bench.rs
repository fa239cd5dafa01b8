//! `cargo run --release --example collective_bench -- --ranks 8 --mb 100 --reps 5`
//!
//! One layer of `--mb` MiB (rows of 41,984 B: one GLM-5.2 page layer each) shared among
//! `--ranks` ranks, timed per operation on rank 0 (whose call returns once every rank has
//! its bytes), median of `--reps`:
//! - ceilings in this process: `memcpy` of the layer on one thread, and one Unix socket pair
//!   streaming the layer between two threads (send and receive copies included);
//! - the in-process group (ranks as threads): broadcast, in-place all-gather;
//! - the socket group with ranks as processes of this example (spawned, killed at the end):
//!   `broadcast_rows` and `all_gather_rows`, ring and direct over Unix sockets, ring over TCP.
//!
//! "delivered" is the bytes every receiver got together per second: `(ranks - 1) × layer /
//! time`, for broadcasts and all-gathers alike. Linux only.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvlink::dedup_broadcast::{
    all_gather_in_place, broadcast_slice, Algorithm, Collective, InProcessGroup, MeetingPoint,
    Rendezvous, RendezvousConfig, TransportChoice,
};
use kvlink::kv_device::HostRow;

const ROW: usize = 41_984;
const ROLE: &str = "KVLINK_BENCH_ROLE";
const MARK: &str = "KVLINK|";

/// The flags (clap).
#[derive(clap::Parser)]
#[command(
    name = "collective_bench",
    about = "TP ranks as processes: the socket collective against the in-process group."
)]
struct Args {
    /// TP ranks (processes).
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u32).range(2..))]
    ranks: u32,
    /// Size of the shared layer, MiB (2^20 bytes; the report prints decimal MB).
    #[arg(long, value_name = "MIB", default_value_t = 100)]
    mb: usize,
    /// Repetitions (the median is reported).
    #[arg(long, value_name = "R", default_value_t = 5)]
    reps: usize,
    /// Accepted and ignored (`cargo bench` passes it).
    #[arg(long, hide = true)]
    bench: bool,
}

fn parse() -> Result<Args, String> {
    use clap::Parser;
    let mut a = Args::try_parse().map_err(|e| e.render().to_string())?;
    a.reps = a.reps.max(1);
    Ok(a)
}

/// The median (the mean of the two middle values of an even count).
fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    let mid = v.len() / 2;
    if v.len().is_multiple_of(2) {
        (v[mid - 1] + v[mid]) / 2
    } else {
        v[mid]
    }
}

fn out(line: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{line}");
    let _ = o.flush();
}

fn main() {
    if let Ok(role) = std::env::var(ROLE) {
        rank_process(&role);
        return;
    }
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            let _ = writeln!(std::io::stderr(), "{e}");
            std::process::exit(2);
        }
    };
    let rows = (args.mb << 20) / ROW;
    let layer = rows * ROW;
    let n = args.ranks;
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    out(&format!(
        "# {n} ranks, layer {:.1} MB ({rows} rows of {ROW} B), median of {} reps, {cores} cores",
        layer as f64 / 1e6,
        args.reps
    ));
    out("| what | time per op | delivered | vs in-process |\n|---|---|---|---|");
    let gbps = |bytes: usize, t: Duration| bytes as f64 / t.as_secs_f64() / 1e9;
    let memcpy = time_memcpy(layer, args.reps);
    out(&format!(
        "| ceiling: memcpy of the layer, one thread | {:.2} ms | {:.2} GB/s | |",
        ms(memcpy),
        gbps(layer, memcpy)
    ));
    let pair = time_socket_pair(layer, args.reps);
    out(&format!(
        "| ceiling: one Unix socket pair, two threads | {:.2} ms | {:.2} GB/s | |",
        ms(pair),
        gbps(layer, pair)
    ));
    let delivered = (n as usize - 1) * layer;
    let (ip_b, ip_g) = time_in_process(n, layer, args.reps);
    out(&format!(
        "| in-process group: broadcast | {:.2} ms | {:.2} GB/s | 1.00 |",
        ms(ip_b),
        gbps(delivered, ip_b)
    ));
    out(&format!(
        "| in-process group: all-gather | {:.2} ms | {:.2} GB/s | 1.00 |",
        ms(ip_g),
        gbps(delivered, ip_g)
    ));
    for (algo, transport) in [("ring", "unix"), ("direct", "unix"), ("ring", "tcp")] {
        match time_processes(&args, algo, transport) {
            Ok(r) => {
                for (op, base, label) in [
                    ("bcast", ip_b, "broadcast_rows"),
                    ("gather", ip_g, "all_gather_rows"),
                ] {
                    let t = r[op];
                    out(&format!(
                        "| processes, {algo} over {transport}: {label} | {:.2} ms | {:.2} GB/s | {:.2} |",
                        ms(t),
                        gbps(delivered, t),
                        base.as_secs_f64() / t.as_secs_f64()
                    ));
                }
            }
            Err(e) => out(&format!(
                "| processes, {algo} over {transport} | failed: {e} | | |"
            )),
        }
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn time_memcpy(layer: usize, reps: usize) -> Duration {
    let src = vec![7u8; layer];
    let mut dst = vec![0u8; layer];
    dst.copy_from_slice(&src);
    median(
        (0..reps)
            .map(|_| {
                let t = Instant::now();
                dst.copy_from_slice(std::hint::black_box(&src));
                std::hint::black_box(&dst);
                t.elapsed()
            })
            .collect(),
    )
}

fn time_socket_pair(layer: usize, reps: usize) -> Duration {
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().expect("socket pair");
    let src = vec![7u8; layer];
    let mut dst = vec![0u8; layer];
    // One warm-up (dropped), as every other row: the socket buffers' first growth.
    let times: Vec<Duration> = (0..=reps)
        .map(|_| {
            let t = Instant::now();
            std::thread::scope(|s| {
                s.spawn(|| a.write_all(&src).expect("send"));
                b.read_exact(&mut dst).expect("receive");
            });
            t.elapsed()
        })
        .collect();
    median(times[1..].to_vec())
}

fn time_in_process(n: u32, layer: usize, reps: usize) -> (Duration, Duration) {
    let ranks = InProcessGroup::new(n);
    let far = || kvlink::kv_loader::deadline_after(Duration::from_secs(120));
    let times: Vec<(Duration, Duration)> = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .iter()
            .map(|c| {
                s.spawn(move || {
                    let mut buf = vec![c.rank() as u8; layer];
                    let (mut b, mut g) = (Vec::new(), Vec::new());
                    for _ in 0..=reps {
                        c.all_gather_u64(0, far()).expect("barrier");
                        let t = Instant::now();
                        broadcast_slice(c, &mut buf, 0, far()).expect("broadcast");
                        b.push(t.elapsed());
                        c.all_gather_u64(0, far()).expect("barrier");
                        let t = Instant::now();
                        let chunk = layer / n as usize * n as usize;
                        all_gather_in_place(c, &mut buf[..chunk], far()).expect("all-gather");
                        g.push(t.elapsed());
                    }
                    (median(b[1..].to_vec()), median(g[1..].to_vec()))
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank")).collect()
    });
    times[0]
}

/// A rank process, killed when dropped.
struct RankProc {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl RankProc {
    fn spawn(role: &str) -> std::io::Result<RankProc> {
        let mut cmd = Command::new(std::env::current_exe()?);
        // A bench killed by its time limit takes its rank processes with it (they waited out
        // their 120 s collective deadlines before).
        let mut child = kvlink_rig::child::end_with_parent(&mut cmd)
            .env(ROLE, role)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()?;
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if let Some(rest) = line.strip_prefix(MARK) {
                    let _ = tx.send(rest.to_string());
                }
            }
        });
        Ok(RankProc { child, lines: rx })
    }

    fn expect(&self, prefix: &str, timeout: Duration) -> Result<String, String> {
        let deadline = kvlink::kv_loader::deadline_after(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .map_err(|_| format!("no {prefix:?} from a rank"))?;
            if let Some(rest) = line.strip_prefix(prefix) {
                return Ok(rest.to_string());
            }
        }
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn time_processes(
    args: &Args,
    algo: &str,
    transport: &str,
) -> Result<HashMap<&'static str, Duration>, String> {
    let role = |r: u32, meet: &str| {
        format!(
            "rank={r},world={},meet={meet},algo={algo},transport={transport},mb={},reps={}",
            args.ranks, args.mb, args.reps
        )
    };
    let wait = Duration::from_secs(600);
    let r0 = RankProc::spawn(&role(0, "127.0.0.1:0")).map_err(|e| e.to_string())?;
    let addr = r0.expect("addr ", wait)?;
    let mut procs = vec![r0];
    for r in 1..args.ranks {
        procs.push(RankProc::spawn(&role(r, &addr)).map_err(|e| e.to_string())?);
    }
    let mut res = HashMap::new();
    for op in ["bcast", "gather"] {
        let v = procs[0].expect(&format!("{op} ms="), wait)?;
        let ms: f64 = v.trim().parse().map_err(|_| format!("bad time {v}"))?;
        res.insert(op, Duration::from_secs_f64(ms / 1e3));
    }
    for p in &procs {
        p.expect("done", wait)?;
    }
    Ok(res)
}

fn rank_process(role: &str) {
    let kv: HashMap<&str, &str> = role.split(',').filter_map(|s| s.split_once('=')).collect();
    let num = |k: &str| kv[k].parse::<usize>().expect("a number");
    let (rank, world) = (num("rank") as u32, num("world") as u32);
    let config = RendezvousConfig::new(rank, world, MeetingPoint::Tcp(kv["meet"].into()))
        .algorithm(Algorithm::parse(kv["algo"]).expect("algorithm"))
        .transport(TransportChoice::parse(kv["transport"]).expect("transport"))
        .timeout(Duration::from_secs(120));
    let mut rv = Rendezvous::new(config).expect("rendezvous");
    if let Some(a) = rv.listen_addr() {
        out(&format!("{MARK}addr {a}"));
    }
    let coll = rv
        .form()
        .expect("forming")
        .connect(1)
        .expect("connecting")
        .remove(0);
    let rows_n = (num("mb") << 20) / ROW;
    let mut buf = vec![rank as u8; rows_n * ROW];
    let base = buf.as_mut_ptr() as usize;
    let rows: Vec<HostRow> = (0..rows_n)
        .map(|i| HostRow {
            addr: base + i * ROW,
            len: ROW,
        })
        .collect();
    let counts: Vec<usize> = (0..world as usize)
        .map(|r| rows_n / world as usize + usize::from(r < rows_n % world as usize))
        .collect();
    let far = || kvlink::kv_loader::deadline_after(Duration::from_secs(120));
    let reps = num("reps");
    let (mut b, mut g) = (Vec::new(), Vec::new());
    for _ in 0..=reps {
        coll.all_gather_u64(0, far()).expect("barrier");
        let t = Instant::now();
        // SAFETY: every row is a distinct piece of `buf`, owned by this process and untouched
        // during the call.
        unsafe { coll.broadcast_rows(&rows, 0, far()) }.expect("broadcast_rows");
        b.push(t.elapsed());
        coll.all_gather_u64(0, far()).expect("barrier");
        let t = Instant::now();
        // SAFETY: as above.
        unsafe { coll.all_gather_rows(&rows, &counts, far()) }.expect("all_gather_rows");
        g.push(t.elapsed());
    }
    if rank == 0 {
        out(&format!(
            "{MARK}bcast ms={:.3}",
            ms(median(b[1..].to_vec()))
        ));
        out(&format!(
            "{MARK}gather ms={:.3}",
            ms(median(g[1..].to_vec()))
        ));
    }
    out(&format!("{MARK}done"));
}
