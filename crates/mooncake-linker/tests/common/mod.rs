//! Helpers of the tests against a real Mooncake: whether Mooncake is there, and a private
//! `mooncake_master` per test (its own cluster, its own metrics port).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use mooncake_linker::store::mooncake::MooncakeConfig;

pub fn require() -> bool {
    std::env::var("KVLINK_REQUIRE_MOONCAKE").is_ok_and(|v| v == "1")
}

pub fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Whether Mooncake is there; says how to enable the test when it is not (or fails, in CI).
#[allow(clippy::print_stderr)] // the skip message is the point
pub fn available(test: &str, needs: &[&str]) -> bool {
    let missing: Vec<&str> = std::iter::once("MOONCAKE_MASTER")
        .chain(needs.iter().copied())
        .filter(|v| env(v).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    assert!(
        !require(),
        "{test}: KVLINK_REQUIRE_MOONCAKE=1 but {missing:?} unset; run under scripts/with-mooncake.sh"
    );
    eprintln!(
        "skipping {test}: {missing:?} not set. To run it: scripts/mooncake-build-shim.sh && \
         scripts/with-mooncake.sh cargo test -p mooncake-linker"
    );
    false
}

pub fn free_port() -> u16 {
    free_ports::<1>()[0]
}

/// `N` distinct free ports: each held while the next is taken (ports taken one after another,
/// each let go first, may be the same: a master given one port for RPC and metrics serves HTTP
/// where its clients expect RPC, and every client fails "Client not available").
pub fn free_ports<const N: usize>() -> [u16; N] {
    let held: Vec<TcpListener> = (0..N)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    std::array::from_fn(|i| held[i].local_addr().unwrap().port())
}

/// A `mooncake_master` of this test only, on 127.0.0.1; killed on drop.
pub struct PrivateMaster {
    child: Option<Child>,
    pub addr: String,
    metrics: String,
    log: PathBuf,
    /// The ports and extra arguments it was started with (a restart reuses them).
    ports: [u16; 2],
    extra: Vec<String>,
}

impl PrivateMaster {
    pub fn start(extra: &[&str]) -> Self {
        let [port, metrics] = free_ports::<2>();
        let log = std::env::temp_dir().join(format!("kvlink-master-{port}.log"));
        // Built before the wait, so that a master that never listens is killed (on drop) by
        // the wait's own failure too.
        let mut master = Self {
            child: None,
            addr: format!("127.0.0.1:{port}"),
            metrics: format!("127.0.0.1:{metrics}"),
            log,
            ports: [port, metrics],
            extra: extra.iter().map(|a| (*a).to_owned()).collect(),
        };
        // A log left by an earlier failed run on the same port is not mixed in.
        let _ = std::fs::remove_file(&master.log);
        master.spawn();
        master
    }

    /// Starts the master process on its ports and waits (bounded) until it listens.
    fn spawn(&mut self) {
        let bin = env("MOONCAKE_MASTER_BIN").expect("MOONCAKE_MASTER_BIN");
        let [port, metrics] = self.ports;
        // One file for both streams (two `create`s would each write from offset 0 over the
        // other's lines); a restart appends.
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let err = out.try_clone().unwrap();
        let child = Command::new(bin)
            .arg("--rpc_address=127.0.0.1")
            .arg(format!("--rpc_port={port}"))
            .arg("--metrics_host=127.0.0.1")
            .arg(format!("--metrics_port={metrics}"))
            .arg("--enable_http_metadata_server=false")
            .args(&self.extra)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(Stdio::from(err))
            .spawn()
            .expect("start mooncake_master");
        self.child = Some(child);
        let deadline = kv_loader::deadline_after(Duration::from_secs(20));
        while TcpStream::connect(&self.addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "private master not listening on {}; log {}",
                self.addr,
                self.log.display()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGKILL, then a fresh master (empty: no objects, no segments) on the same ports, as a
    /// master process that crashed and was restarted by its supervisor.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// The master's counter `name` from its Prometheus endpoint (`GET /metrics` on the
    /// metrics port), e.g. `master_batch_get_replica_list_requests_total`.
    pub fn metric(&self, name: &str) -> u64 {
        let text = http_get(&self.metrics, "/metrics");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == name).then(|| v.trim().parse::<f64>().ok())?
            })
            .map(|v| v as u64)
            .unwrap_or_else(|| panic!("no metric `{name}` at {}", self.metrics))
    }

    /// Replica-list queries the master has answered (single and batched): what a client
    /// pays for every read that is not inside a read session.
    pub fn replica_queries(&self) -> u64 {
        self.metric("master_get_replica_list_requests_total")
            + self.metric("master_batch_get_replica_list_requests_total")
    }

    pub fn config(&self, segment: u64) -> MooncakeConfig {
        let mut cfg = MooncakeConfig::new(&self.addr)
            .local_hostname("127.0.0.1")
            .global_segment_size(segment)
            .local_buffer_size(16 << 20);
        if let Some(lib) = env("MOONCAKE_STORE_LIBRARY") {
            cfg = cfg.library(lib);
        }
        if let Some(p) = env("MOONCAKE_PROTOCOL") {
            cfg = cfg.protocol(p);
        }
        cfg
    }

    /// SIGKILL, now.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for PrivateMaster {
    fn drop(&mut self) {
        self.kill();
        // Keep the log of a failed test.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

pub fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

/// The body of `GET path` from `addr`, bounded (the master's server keeps connections open,
/// so the body is read to its `Content-Length`).
fn http_get(addr: &str, path: &str) -> String {
    let mut conn = TcpStream::connect(addr).unwrap_or_else(|e| panic!("metrics at {addr}: {e}"));
    conn.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    conn.set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        conn,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    let mut buf = [0u8; 64 << 10];
    loop {
        let n = match conn.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => panic!("metrics at {addr}: {e}"),
        };
        raw.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&raw);
        if let Some((head, body)) = text.split_once("\r\n\r\n") {
            let len = head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            });
            if len.is_some_and(|len| body.len() >= len) {
                break;
            }
        }
    }
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200"),
        "metrics: {head}"
    );
    body.to_string()
}
