//! The launcher of `--ranks-as processes`: serves the embedded store (one copy for every
//! rank process, no setup), starts `--tp` rank processes of this program (rank 0 first, on a
//! port the system picks; the others at the address it reports), relays rank 0's report as
//! it comes, and ends with every process's exit status. Every process it started is killed
//! if it returns early (an error, a panic).

use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use kvlink::kv_geometry::{KvGeometry, ModelKvSpec};
use kvlink::mooncake_linker::store::{EmbeddedStore, ServeAt, StoreServer};

use kvlink_rig::child::lines;

use super::rank::RENDEZVOUS_MARK;
use crate::args::{Args, StoreKind};

/// Starts one rank process with these flags, its stdout piped (the binary: this program;
/// a test: its own harness).
pub(crate) type ChildSpawner = dyn Fn(&[String]) -> std::io::Result<Child>;

/// Starts this program with `args`.
pub(crate) fn this_program(args: &[String]) -> std::io::Result<Child> {
    // Ends with the launcher: a launcher killed by a time limit leaves no rank behind.
    kvlink_rig::child::end_with_parent(&mut Command::new(std::env::current_exe()?))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
}

/// How long rank 0 may take to say where it listens.
const RENDEZVOUS_WAIT: Duration = Duration::from_secs(60);
/// How long the others may take to exit once rank 0 has.
const EXIT_WAIT: Duration = Duration::from_secs(120);
/// How long rank 0 may go without a line of its report before the launcher takes it for stuck
/// (and kills every rank process): its longest step, one size's runs of every mode, takes
/// well under a minute.
const REPORT_IDLE: Duration = Duration::from_secs(600);

/// The rank processes: killed and reaped when dropped unless they exited.
struct Ranks(Vec<Child>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.0 {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}

/// The launcher (see the module docs).
pub(crate) fn launch(args: &Args, out: &mut dyn Write, spawn: &ChildSpawner) -> Result<()> {
    let tp = args.tp;
    let spec = ModelKvSpec::glm52_dsa_fp8();
    let n_pages = args.tokens / u64::from(spec.page_size);
    let prefix_bytes = KvGeometry::new(spec, tp, 0)?.bytes_per_page() * n_pages;
    let server = match args.store {
        StoreKind::Embedded => Some(
            StoreServer::start(
                Arc::new(EmbeddedStore::new(
                    prefix_bytes + prefix_bytes / 8 + (64 << 20),
                )),
                ServeAt::Unix,
            )
            .context("serving the embedded store to the rank processes")?,
        ),
        StoreKind::Mooncake => None,
    };
    writeln!(
        out,
        "glm_prefill launcher: TP ranks as PROCESSES — starting {tp} rank processes of this \
         program (rank 0 prints the report below); {}",
        match &server {
            Some(s) => format!(
                "the launcher keeps the embedded store and serves it to them at {}",
                s.location()
            ),
            None => "each rank process opens its own Mooncake client".into(),
        }
    )?;
    out.flush()?;
    let flags = |rank: u32, meet: &str| {
        let mut a = args.procs.argv.clone();
        a.extend([
            "--rank".into(),
            rank.to_string(),
            "--world".into(),
            tp.to_string(),
            "--rendezvous".into(),
            meet.to_string(),
        ]);
        if let Some(s) = &server {
            a.extend(["--store-at".into(), s.address().to_string()]);
        }
        a
    };
    let started = Instant::now();
    let mut ranks = Ranks(Vec::new());
    let mut first = spawn(&flags(0, "127.0.0.1:0")).context("starting rank 0")?;
    let rank0 = lines(
        first
            .stdout
            .take()
            .ok_or_else(|| anyhow!("rank 0's stdout"))?,
    );
    ranks.0.push(first);
    let deadline = kvlink::kv_loader::deadline_after(RENDEZVOUS_WAIT);
    let meet = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rank0.recv_timeout(left) {
            Ok(line) => match line.find(RENDEZVOUS_MARK) {
                Some(i) => break line[i + RENDEZVOUS_MARK.len()..].trim().to_string(),
                // A test harness may print before the rank does.
                None => writeln!(out, "{line}")?,
            },
            Err(_) => bail!("rank 0 did not say where it listens within {RENDEZVOUS_WAIT:?}"),
        }
    };
    writeln!(
        out,
        "glm_prefill launcher: rank 0 listens at {meet}; starting ranks 1..{tp}"
    )?;
    let mut others = Vec::new();
    for rank in 1..tp {
        let mut c = spawn(&flags(rank, &meet)).with_context(|| format!("starting rank {rank}"))?;
        others.push(lines(
            c.stdout
                .take()
                .ok_or_else(|| anyhow!("rank {rank}'s stdout"))?,
        ));
        ranks.0.push(c);
    }
    writeln!(out)?;
    // Rank 0's report, as it comes.
    loop {
        match rank0.recv_timeout(REPORT_IDLE) {
            Ok(line) => {
                writeln!(out, "{line}")?;
                out.flush()?;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                "rank 0 said nothing for {} s: taken for stuck, every rank process is killed",
                REPORT_IDLE.as_secs()
            ),
        }
    }
    let statuses = wait_all(&mut ranks)?;
    writeln!(out)?;
    writeln!(
        out,
        "glm_prefill launcher: {tp} rank processes ended after {:.1} s:",
        started.elapsed().as_secs_f64()
    )?;
    // The processes have ended, but their readers may still hold the last lines (an error
    // report, say): each is read until its pipe closes, within one short bound.
    let drained_by = kvlink::kv_loader::deadline_after(Duration::from_secs(2));
    for (i, rx) in others.iter().enumerate() {
        loop {
            let left = drained_by.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => writeln!(out, "  [rank {}] {line}", i + 1)?,
                Err(_) => break,
            }
        }
    }
    for (rank, s) in statuses.iter().enumerate() {
        writeln!(out, "  rank {rank}: {s}")?;
    }
    let ok = statuses.iter().filter(|s| s.success()).count();
    writeln!(out)?;
    writeln!(
        out,
        "Checks, one per rank process (it loaded in every mode and its own pool is \
         byte-identical to the saved bytes):"
    )?;
    writeln!(out, "{ok} passed, {} failed", statuses.len() - ok)?;
    drop(server);
    if statuses.iter().any(|s| !s.success()) {
        bail!("a rank process failed (see above)");
    }
    Ok(())
}

/// Waits for every rank process (bounded: the others once rank 0 ended).
fn wait_all(ranks: &mut Ranks) -> Result<Vec<std::process::ExitStatus>> {
    let deadline = kvlink::kv_loader::deadline_after(EXIT_WAIT);
    let mut statuses = vec![None; ranks.0.len()];
    loop {
        for (c, s) in ranks.0.iter_mut().zip(statuses.iter_mut()) {
            if s.is_none() {
                *s = c.try_wait()?;
            }
        }
        if statuses.iter().all(Option::is_some) {
            return Ok(statuses.into_iter().flatten().collect());
        }
        if Instant::now() >= deadline {
            bail!("rank processes still running {EXIT_WAIT:?} after rank 0 ended (killed)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
