#!/usr/bin/env python3
"""Summarises the linker's step events (RUST_LOG=mooncake_linker=trace) from a log file (or
stdin): per mode and rank, each layer's read wait / verify / status / share (sum and median),
the group reads (count, layers, bytes, time, GB/s), and what precedes layer 0 (pinning, then
the preflight beside the pin and the first reads: the checksum companions, the object sizes). Used by scripts/gpu-mooncake-steps.sh.

Events are attributed to a batch run by (batch, rank): a batch's `landing ready` event opens a
run, its `exchange loop` event names the run's mode."""
import re
import statistics
import sys
from collections import defaultdict

ANSI = re.compile(r"\x1b\[[0-9;]*m")
DUR = re.compile(r"^([0-9.]+)(ns|µs|us|ms|s)$")
SCALE = {"ns": 1e-6, "µs": 1e-3, "us": 1e-3, "ms": 1.0, "s": 1e3}
STEPS = ("read_wait", "verify", "status", "share")


def ms(text):
    m = DUR.match(text or "")
    return float(m.group(1)) * SCALE[m.group(2)] if m else float("nan")


def field(line, name):
    found = re.findall(r"\b" + name + r"=(\S+)", line)
    return found[-1] if found else None


def batch_of(line):
    found = re.findall(r"\bbatch=(batch \d+)", line)
    return found[-1] if found else None


def events(line):
    """The (kind, values) this line records, if any."""
    if "layer steps" in line:
        return "steps", {s: ms(field(line, s)) for s in STEPS}
    if "group read" in line:
        lay = re.search(r"layers=(\d+)\.\.(\d+)", line)
        n = int(lay.group(2)) - int(lay.group(1)) if lay else 0
        return "group", (n, int(field(line, "bytes") or 0), ms(field(line, "took")))
    if "prepared" in line:
        return "before", [("pin (session start)", ms(field(line, "pin")))]
    if "preflight companions" in line:
        found = field(line, "find")  # builds before the companions were read without `exists`
        rows = [("preflight: find companions", ms(found))] if found else []
        return "before", rows + [("preflight: companions read", ms(field(line, "took")))]
    if "preflight sizes" in line:
        return "before", [("preflight: sizes", ms(field(line, "took")))]
    return None


def collect(lines):
    steps = defaultdict(lambda: defaultdict(list))
    groups = defaultdict(list)
    before = defaultdict(list)
    mode = {}  # (batch, rank) -> mode of the run in progress, None before its exchange loop
    pending = defaultdict(list)

    def record(key, kind, values):
        if kind == "steps":
            for s, v in values.items():
                steps[key][s].append(v)
        elif kind == "group" and values[1] > 0:
            groups[key].append(values)
        elif kind == "before":
            before[key].extend(values)

    for line in lines:
        b, rank = batch_of(line), field(line, "rank")
        if b is None or rank is None:
            continue
        run = (b, rank)
        if "exchange loop" in line:
            mode[run] = field(line, "mode") or "?"
            for kind, values in pending.pop(run, []):
                record((mode[run], rank), kind, values)
            continue
        if "landing ready" in line:
            # A new run of this batch id on this rank: logged on the load thread before its
            # reader and exchange loop start (the pin's `prepared` event comes later, from the
            # reader, often after the exchange loop's first event).
            mode[run] = None
            continue
        ev = events(line)
        if ev is None:
            continue
        if mode.get(run) is None:
            pending[run].append(ev)
        else:
            record((mode[run], rank), *ev)
    return steps, groups, before


def order(kv):
    return (kv[0][0], int(kv[0][1]))


def main():
    src = open(sys.argv[1], errors="replace") if len(sys.argv) > 1 else sys.stdin
    steps, groups, before = collect(ANSI.sub("", raw.rstrip("\n")) for raw in src)
    print("## Per layer, by mode and rank (all batches of the run; ms)\n")
    print("| mode | rank | layers seen | read wait sum / median | verify sum / median | status sum / median | share sum / median |")
    print("|---|---:|---:|---|---|---|---|")
    for (mode, rank), st in sorted(steps.items(), key=order):
        cells = []
        for s in STEPS:
            xs = st.get(s, [])
            cells.append(f"{sum(xs):.1f} / {statistics.median(xs):.2f}" if xs else "—")
        print(f"| {mode} | {rank} | {len(st.get('share', []))} | " + " | ".join(cells) + " |")
    print("\n## Group reads, by mode and rank (all batches)\n")
    print("| mode | rank | calls | layers per call (median) | bytes per call (median) | ms per call (median) | GB/s (sum bytes / sum time) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (mode, rank), gs in sorted(groups.items(), key=order):
        tb, tt = sum(g[1] for g in gs), sum(g[2] for g in gs)
        print(f"| {mode} | {rank} | {len(gs)} | {statistics.median(g[0] for g in gs):.0f} | "
              f"{statistics.median(g[1] for g in gs) / 1e6:.1f} MB | "
              f"{statistics.median(g[2] for g in gs):.1f} | {tb / 1e6 / tt if tt else 0:.2f} |")
    print("\n## Before layer 0, by mode and rank (median over batches; ms)\n")
    print("| mode | rank | step | median | max |")
    print("|---|---:|---|---:|---:|")
    for (mode, rank), xs in sorted(before.items(), key=order):
        by = defaultdict(list)
        for what, v in xs:
            by[what].append(v)
        for what, vs in by.items():
            print(f"| {mode} | {rank} | {what} | {statistics.median(vs):.2f} | {max(vs):.2f} |")


if __name__ == "__main__":
    main()
