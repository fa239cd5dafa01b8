#!/usr/bin/env python3
"""Samples how busy every thread of some processes is, from /proc, until stopped (SIGTERM or
SIGINT) or --seconds have passed; then prints, per thread that was ever busy, how often it was
saturated. Used to find what bounds one Mooncake client's read over TCP (the storage node's
transfer thread, the reader's, or neither): see docs/benchmarks.md, "What bounds one client".

Usage: thread-busy.py [--match REGEX] [--interval S] [--seconds S] [--min-busy F] > table.md
  --match     regex on a process's command line (default: mooncake|python|mooncake_read)
  --interval  seconds between samples (default 0.2)
  --seconds   stop after this long (default: run until signalled)
  --min-busy  a sample interval counts as "active" for a thread when it used at least this
              share of one core (default 0.10)

Per thread it prints: the process (pid, first words of its command line), the thread's name,
the intervals it was active in, and among those the median and 90th percentile of its busy
share of one core and the share of active intervals at >= 90 % of a core (saturated).
"""
import argparse
import os
import re
import signal
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def thread_ticks(pid):
    """{tid: (name, utime + stime ticks)} of one process; empty if it is gone."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                s = f.read()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces: split after the last ')'.
        name = s[s.index("(") + 1 : s.rindex(")")]
        rest = s[s.rindex(")") + 2 :].split()
        out[int(tid)] = (name, int(rest[11]) + int(rest[12]))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--match", default="mooncake|python|mooncake_read")
    p.add_argument("--interval", type=float, default=0.2)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--min-busy", type=float, default=0.10)
    a = p.parse_args()
    pat = re.compile(a.match)
    me = os.getpid()
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    prev, prev_t = {}, time.monotonic()
    shares = {}  # (pid, tid) -> list of busy shares per interval
    names = {}
    start = prev_t
    while not stop and (a.seconds <= 0 or time.monotonic() - start < a.seconds):
        time.sleep(a.interval)
        now = time.monotonic()
        cur = {}
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == me:
                continue
            pid = int(d)
            cl = cmdline(pid)
            if not cl or not pat.search(cl):
                continue
            for tid, (name, ticks) in thread_ticks(pid).items():
                cur[(pid, tid)] = ticks
                names[(pid, tid)] = (" ".join(cl.split()[:2])[:60], name)
        dt = now - prev_t
        for k, ticks in cur.items():
            if k in prev and dt > 0:
                shares.setdefault(k, []).append((ticks - prev[k]) / TICK / dt)
        prev, prev_t = cur, now
    print(f"Thread busy shares, sampled every {a.interval} s for {time.monotonic() - start:.0f} s "
          f"(processes matching `{a.match}`; active: >= {a.min_busy:.2f} of a core).")
    print()
    print("| pid | process | thread | active intervals | median busy | p90 busy | saturated (>= 0.9) |")
    print("|---:|---|---|---:|---:|---:|---:|")
    rows = []
    for k, xs in shares.items():
        act = sorted(x for x in xs if x >= a.min_busy)
        if not act:
            continue
        med = act[len(act) // 2]
        p90 = act[min(len(act) - 1, int(len(act) * 0.9))]
        sat = sum(1 for x in act if x >= 0.9) / len(act)
        rows.append((k, len(act), med, p90, sat))
    rows.sort(key=lambda r: (-r[1] * r[2]))
    for (pid, tid), n, med, p90, sat in rows[:40]:
        proc, name = names[(pid, tid)]
        print(f"| {pid} | `{proc}` | {name} ({tid}) | {n} | {med:.2f} | {p90:.2f} | {sat:.0%} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
