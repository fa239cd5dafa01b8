#!/usr/bin/env bash
# Runs ON THE GPU MACHINE: where a load's time goes, step by step, against a real Mooncake Store.
# One mooncake_modes run (host pools, ranks as threads, one storage node) with the linker's
# debug/trace events on, then a summary of them per mode and rank: each layer's wait for its
# read, its verification, its status exchange and its share step (sums and medians), every
# group read (layers, bytes, time, GB/s), and what precedes layer 0 (companions, pins,
# preflight). With --procs the ranks are processes instead (glm_prefill --ranks-as processes, one
# run per mode, socket collectives, each rank its own Mooncake client; compute SIMULATED at the
# table's modelled compute for the prefix size unless --no-compute). Built and packed here by
# scripts/gpu-mooncake-bundle.sh (carry gpu-mooncake/).
#
# Usage: bash scripts/gpu-mooncake-steps.sh [--tokens N] [--tp N] [--modes m1,m2] [--no-compute] [--procs]
# Output ($OUT, else gpu-mooncake/out/): steps_<machine>_tp<N>_<tokens>.md (the summary and the
# run's tables), steps_tp<N>_<tokens>.stderr.log.xz (the raw events).
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
tokens=32768; tp=2; modes="rank0-broadcast,split-all-gather"; extra=(); procs=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tokens) tokens="$2"; shift 2 ;;
    --tp) tp="$2"; shift 2 ;;
    --modes) modes="$2"; shift 2 ;;
    --no-compute) extra+=(--no-compute); shift ;;
    --procs) procs=1; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "gpu-mooncake-steps: unknown argument $1" >&2; exit 2 ;;
  esac
done
out="${OUT:-$repo/gpu-mooncake/out}"; mkdir -p "$out"
# shellcheck source=scripts/machine-name.sh
source "$repo/scripts/machine-name.sh"
# The card's own model in the name (an H100 run is not labelled H200).
machine=$(kvlink_machine)
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  source "$repo/scripts/gpu-common.sh"
fi
export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-8 GB}"
export RUST_LOG="warn,mooncake_linker=trace" NO_COLOR=1
tag="$((tokens / 1024))k"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
shape="threads"
if [[ $procs -eq 1 ]]; then
  shape="processes"
  # The modelled compute per layer of the prefix size (as the table's procs part).
  if [[ ${#extra[@]} -gt 0 ]]; then
    compute=0
  else
    # shellcheck source=scripts/modelled-compute.sh
    source "$repo/scripts/modelled-compute.sh"
    compute=$(modelled_compute_us "$tokens") || { echo "gpu-mooncake-steps: or --no-compute" >&2; exit 2; }
  fi
  # One glm_prefill run per mode, each inside one shared time limit. A mode passes when its
  # run exits 0: glm_prefill verifies every rank's pool and exits 1 on a failed load or a
  # differing pool. The count is the file's last line (a mode the time limit cut is neither).
  timeout -k 15 "${KVLINK_TABLE_TIMEOUT:-400}" bash -c '
    rc=0; passed=0; failed=0
    for mode in ${1//,/ }; do
      echo "## glm_prefill --mode $mode"; echo; echo "\`\`\`"
      if bash scripts/gpu-mooncake-run.sh --storage-nodes 1 -- glm_prefill --store mooncake \
        --ranks-as processes --mode "$mode" --tp "$2" --tokens "$3" --compute-us "$4"; then
        passed=$((passed + 1))
      else
        rc=$?; failed=$((failed + 1))
      fi
      echo "\`\`\`"; echo
    done
    echo "$passed passed, $failed failed"
    exit $rc' _ "$modes" "$tp" "$tokens" "$compute" > "$work/stdout.log" 2> "$work/stderr.log"
  rc=$?
  cp "$work/stdout.log" "$work/runs.md"
else
  timeout -k 15 "${KVLINK_TABLE_TIMEOUT:-400}" bash scripts/gpu-mooncake-run.sh --storage-nodes 1 -- \
    mooncake_modes --pools host --tokens "$tokens" --tp "$tp" --modes "$modes" --reps 2 --auto-runs 1 \
    --machine "$machine" --out "$work" --budget-s 360 "${extra[@]}" \
    > "$work/stdout.log" 2> "$work/stderr.log"
  rc=$?
fi
file="$out/steps_${machine}_tp${tp}_${tag}$([[ $procs -eq 1 ]] && echo _procs).md"
{
  echo "# Where a load's time goes: TP $tp ranks as $shape, $tag tokens, host pools, one storage node"
  echo
  echo "Command: bash scripts/gpu-mooncake-steps.sh --tokens $tokens --tp $tp --modes $modes ${extra[*]}$([[ $procs -eq 1 ]] && echo ' --procs') ($(date -u +%Y-%m-%d), $machine, $(nproc) CPUs); exit status $rc"
  echo
  python3 "$repo/scripts/steps_summary.py" "$work/stderr.log" 2>&1 || echo "(no python3 summary: see the raw log)"
  echo
  echo "## The run's tables"
  echo
  cat "$work"/*.md 2>/dev/null || cat "$work/stdout.log"
} > "$file"
raw="$out/steps_tp${tp}_${tag}$([[ $procs -eq 1 ]] && echo _procs).stderr.log"
xz -T0 -c "$work/stderr.log" > "$raw.xz" 2>/dev/null || cp "$work/stderr.log" "$raw"
echo "wrote $file"
exit $rc
