//! The wheel's own Python client as the baseline: a child process with its own Mooncake client
//! (no segment), reading the same objects on command, so that its reads interleave with
//! kvlink's in every round.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::objects::Objects;

/// The reader: setup, buffers (registered), per-call argument lists built before timing.
/// Commands on stdin: `whole` (one `batch_get_into` of every object) or `ranges K` (read
/// session over every key, then one `batch_get_into_multi_buffer_ranges` per K layers with one
/// range per object, then the session's end). It answers each with the seconds it took,
/// measured inside Python. Every read's result is checked (bytes per key), and after each
/// command the first word of every layer of every object is compared with the pattern.
const SCRIPT: &str = r#"
import ctypes, json, sys, time
from mooncake.store import MooncakeDistributedStore
cfg = json.load(open(sys.argv[1]))
s = MooncakeDistributedStore()
assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", cfg["master"]) == 0, "setup"
comps = []
for c in cfg["components"]:
    obj = c["layer_bytes"] * c["layers_in_object"]
    buf = ctypes.create_string_buffer(obj * len(c["keys"]))
    base = ctypes.addressof(buf)
    assert s.register_buffer(base, obj * len(c["keys"])) == 0, "register"
    comps.append(dict(c, obj=obj, buf=buf, base=base))
all_keys = [k for c in comps for k in c["keys"]]
whole_ptrs = [c["base"] + p * c["obj"] for c in comps for p in range(len(c["keys"]))]
whole_sizes = [c["obj"] for c in comps for _ in c["keys"]]
M = (1 << 64) - 1
def word(ci, p, w):
    return ((((p << 40) ^ (ci << 36) ^ w) & M) * 0x9E3779B97F4A7C15) & M
def check():
    for ci, c in enumerate(comps):
        lb, obj = c["layer_bytes"], c["obj"]
        for p in range(len(c["keys"])):
            for pos in range(c["layers_in_object"]):
                at = p * obj + pos * lb
                got = int.from_bytes(c["buf"][at:at + 8], "little")
                assert got == word(ci, p, pos * lb // 8), f"{c['name']} page {p} pos {pos}"
def plan(k):
    calls = []
    for first in range(0, cfg["layers"], k):
        layers = range(first, min(first + k, cfg["layers"]))
        keys, ptrs, sizes, offs = [], [], [], []
        for c in comps:
            pos = [c["positions"][l] for l in layers if c["positions"][l] is not None]
            if not pos:
                continue
            n, lb = len(pos), c["layer_bytes"]
            for p, key in enumerate(c["keys"]):
                keys.append(key)
                ptrs.append([c["base"] + p * c["obj"] + pos[0] * lb])
                sizes.append([n * lb])
                offs.append([pos[0] * lb])
        calls.append((keys, ptrs, sizes, offs))
    return calls
def clear():
    # Zeroed before each timed command (outside its time), so that check() sees what that
    # command landed, not what an earlier one left.
    for c in comps:
        ctypes.memset(c["base"], 0, c["obj"] * len(c["keys"]))
plans = {}
print("ready", flush=True)
for line in sys.stdin:
    cmd = line.split()
    if not cmd or cmd[0] == "quit":
        break
    clear()
    if cmd[0] == "whole":
        t0 = time.perf_counter()
        r = s.batch_get_into(all_keys, whole_ptrs, whole_sizes)
        dt = time.perf_counter() - t0
        assert r == whole_sizes, [x for x in r if x < 0][:3]
    else:
        k = int(cmd[1])
        calls = plans.setdefault(k, plan(k))
        t0 = time.perf_counter()
        assert all(x == 0 for x in s.batch_get_session_start(all_keys)), "session"
        for keys, ptrs, sizes, offs in calls:
            r = s.batch_get_into_multi_buffer_ranges(keys, ptrs, sizes, offs)
            assert r == [x[0] for x in sizes], [x for x in r if x < 0][:3]
        s.batch_get_session_end(all_keys)
        dt = time.perf_counter() - t0
    check()
    print(dt, flush=True)
s.close()
"#;

/// How long the reader may take to set up its client and buffers.
const READY_WAIT: Duration = Duration::from_secs(120);
/// How long one command (one timed read of every object, and its check) may take.
const COMMAND_WAIT: Duration = Duration::from_secs(300);

/// A running Python reader.
pub struct PythonReader {
    child: Child,
    stdin: ChildStdin,
    /// Its stdout's lines (a thread reads them, so that every wait for one is bounded).
    lines: mpsc::Receiver<String>,
    config: PathBuf,
}

fn json_str(s: &str) -> String {
    // Keys are ASCII (hex hashes, namespace, suffixes): no escaping beyond quotes needed.
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

impl PythonReader {
    /// Starts the reader against `master` (from `MOONCAKE_PYTHON` / `MOONCAKE_PYTHONPATH`).
    pub fn start(master: &str, objects: &Objects) -> Result<Self> {
        let python = std::env::var("MOONCAKE_PYTHON").unwrap_or_else(|_| "python3".into());
        let path = std::env::var("MOONCAKE_PYTHONPATH")
            .context("MOONCAKE_PYTHONPATH unset (run under scripts/with-mooncake.sh)")?;
        let comps: Vec<String> = objects
            .components
            .iter()
            .map(|c| {
                let keys: Vec<String> = c.keys.iter().map(|k| json_str(k)).collect();
                let pos: Vec<String> = c
                    .position
                    .iter()
                    .map(|p| p.map_or("null".into(), |p| p.to_string()))
                    .collect();
                format!(
                    "{{\"name\":{},\"layer_bytes\":{},\"layers_in_object\":{},\"positions\":[{}],\"keys\":[{}]}}",
                    json_str(&c.name),
                    c.layer_bytes,
                    c.layers_in_object,
                    pos.join(","),
                    keys.join(",")
                )
            })
            .collect();
        let json = format!(
            "{{\"master\":{},\"layers\":{},\"components\":[{}]}}",
            json_str(master),
            objects.layers,
            comps.join(",")
        );
        let config =
            std::env::temp_dir().join(format!("mooncake_read-{}.json", std::process::id()));
        std::fs::write(&config, json)?;
        // Ends with this program: one killed by a time limit leaves no reader behind.
        let spawned = kvlink_rig::child::end_with_parent(&mut Command::new(python))
            .env("PYTHONPATH", path)
            .arg("-c")
            .arg(SCRIPT)
            .arg(&config)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                // The reader that would remove the config on drop does not exist yet.
                let _ = std::fs::remove_file(&config);
                return Err(e).context("starting the Python reader");
            }
        };
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_file(&config);
            bail!("the Python reader started without its pipes");
        };
        let lines = kvlink_rig::child::lines(stdout);
        let mut reader = Self {
            child,
            stdin,
            lines,
            config,
        };
        let first = reader.line(READY_WAIT)?;
        if first != "ready" {
            bail!("python reader: expected `ready`, got {first:?}");
        }
        Ok(reader)
    }

    /// Its next line, waited for at most `limit`.
    fn line(&mut self, limit: Duration) -> Result<String> {
        match self.lines.recv_timeout(limit) {
            Ok(l) => Ok(l.trim().to_owned()),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                bail!("the Python reader exited (its error is above)")
            }
            Err(mpsc::RecvTimeoutError::Timeout) => bail!(
                "the Python reader said nothing for {} s (its Mooncake client stuck?)",
                limit.as_secs()
            ),
        }
    }

    /// Runs one command; the seconds Python measured.
    pub fn run(&mut self, command: &str) -> Result<f64> {
        writeln!(self.stdin, "{command}")?;
        self.stdin.flush()?;
        let l = self.line(COMMAND_WAIT)?;
        l.parse().with_context(|| format!("python answered {l:?}"))
    }
}

impl Drop for PythonReader {
    fn drop(&mut self) {
        let _ = writeln!(self.stdin, "quit");
        let _ = self.stdin.flush();
        // Bounded: the script exits on `quit`; kill it if it has not after 10 s.
        for _ in 0..100 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.config);
    }
}
