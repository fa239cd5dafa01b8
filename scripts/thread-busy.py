#!/usr/bin/env python3
"""Samples how busy every thread of some processes is, from /proc, until stopped (SIGTERM or
SIGINT) or --seconds have passed; then prints, per thread that was ever busy, how often it was
saturated. Used to find what bounds one Mooncake client's read over TCP (the storage node's
transfer thread, the reader's, or neither): docs/benchmarks.md, "What bounds one client".

Usage: thread-busy.py [--match REGEX] [--interval S] [--seconds S] [--min-busy F] [--out FILE]
  --match     regex on a process's command line (default: mooncake|python)
  --interval  seconds between samples (default 0.2)
  --seconds   stop after this long (default: run until signalled)
  --min-busy  a sample interval counts as "active" for a thread when it ran at least this
              share of one core (default 0.10)
  --out       write the table here (atomically, through a temporary file); default stdout

Run time comes from /proc/<pid>/task/<tid>/schedstat (nanoseconds on a CPU), each thread's
share over the time between its own two reads. Per thread it prints: the process (pid, its
program's name), the thread's name, the intervals it was active in, and among those the
median and 90th percentile of its share of one core, the share of active intervals at
>= 90 % of a core (saturated), and its voluntary context switches per second while active (a
thread that waits in short sleeps, polling, switches tens of thousands of times a second; one
that moves bytes, far fewer).
"""
import argparse
import math
import os
import re
import signal
import statistics
import sys
import time


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def program(cl):
    """The program's name: argv[0]'s base name, and for an interpreter its script or `-c`."""
    words = cl.split()
    if not words:
        return "?"
    name = os.path.basename(words[0])
    if name.startswith("python") and len(words) > 1:
        name += " " + (os.path.basename(words[1]) if not words[1].startswith("-") else words[1])
    return name


def thread_sample(pid, tid):
    """(name, ns on a CPU, voluntary switches, monotonic time read) of one thread, or None."""
    base = f"/proc/{pid}/task/{tid}"
    try:
        with open(f"{base}/schedstat") as f:
            ns = int(f.read().split()[0])
        with open(f"{base}/comm") as f:
            name = f.read().strip()
        vol = 0
        with open(f"{base}/status") as f:
            for line in f:
                if line.startswith("voluntary_ctxt_switches:"):
                    vol = int(line.split()[1])
                    break
        return name, ns, vol, time.monotonic()
    except (OSError, ValueError, IndexError):
        return None


def write(text, out):
    if not out:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    tmp = f"{out}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, out)


def table(samples, names, a, elapsed):
    lines = [
        f"Thread busy shares, sampled every {a.interval} s for {elapsed:.0f} s (processes "
        f"matching `{a.match}`; active: >= {a.min_busy:.2f} of a core; run time from schedstat).",
        "",
        "| pid | program | thread | active intervals | median busy | p90 busy | saturated (>= 0.9) | voluntary switches/s while active |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    rows = []
    for k, xs in samples.items():
        act = [(b, sw) for b, sw in xs if b >= a.min_busy]
        if not act:
            continue
        busy = sorted(b for b, _ in act)
        med = statistics.median(busy)
        # Nearest-rank 90th percentile: the smallest value with at least 90 % of the
        # samples at or below it (int(n * 0.9) gave the maximum for n <= 10).
        p90 = busy[max(0, math.ceil(0.9 * len(busy)) - 1)]
        sat = sum(1 for b in busy if b >= 0.9) / len(busy)
        sw = statistics.median(s for _, s in act)
        rows.append((k, len(act), med, p90, sat, sw))
    rows.sort(key=lambda r: -r[1] * r[2])
    for (pid, tid), n, med, p90, sat, sw in rows[:40]:
        prog, name = names[(pid, tid)]
        lines.append(
            f"| {pid} | `{prog}` | {name} ({tid}) | {n} | {med:.2f} | {p90:.2f} | {sat:.0%} | {sw:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--match", default="mooncake|python")
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--min-busy", type=float, default=0.10)
    p.add_argument("--out", default="")
    a = p.parse_args()
    pat = re.compile(a.match)
    me = os.getpid()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    prev = {}  # (pid, tid) -> (ns, vol, t)
    samples = {}  # (pid, tid) -> [(busy share, voluntary switches per s)]
    names = {}
    start = time.monotonic()
    while not stop and (a.seconds <= 0 or time.monotonic() - start < a.seconds):
        time.sleep(a.interval)
        cur = {}
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == me:
                continue
            pid = int(d)
            cl = cmdline(pid)
            if not cl or not pat.search(cl):
                continue
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:
                continue
            for t in tids:
                s = thread_sample(pid, int(t))
                if s is None:
                    continue
                name, ns, vol, at = s
                k = (pid, int(t))
                cur[k] = (ns, vol, at)
                names[k] = (program(cl), name)
                if k in prev:
                    pns, pvol, pat_ = prev[k]
                    dt = at - pat_
                    # A thread id reused by a new thread reads as time going back: skipped.
                    if dt > 0 and ns >= pns and vol >= pvol:
                        samples.setdefault(k, []).append(((ns - pns) / 1e9 / dt, (vol - pvol) / dt))
        prev = cur
    write(table(samples, names, a, time.monotonic() - start), a.out)


if __name__ == "__main__":
    main()
