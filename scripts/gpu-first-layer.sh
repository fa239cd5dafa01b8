#!/usr/bin/env bash
# The first layer of one client's load, with the objects pinned at lookup against pinned by the
# load: the Linker (TP 1, host pool, 32K tokens of GLM-5.2, checksum companions read at
# lookup, an engine computing 5.76 ms per layer, SIMULATED) beside layer 0 read alone from a
# cold start (the store's read session and its one call), and the Python whole-object read.
# Two runs, the two settings in opposite order (A B, then B A), each its own master and
# storage node, --rounds rounds each.
#
# Usage (on the GPU host, after bash scripts/gpu-mooncake-bundle.sh here; carry gpu-mooncake):
#   OUT=/tmp/fl bash scripts/gpu-first-layer.sh [--rounds N] [--tokens T] [--hot] [-- MOONCAKE_READ_FLAGS]
# --hot: a hot prefix, its checksum companions kept from round 1, so a lookup reads nothing
# ahead and only pins (kept-at-lookup against kept-at-lookup-pin-at-load).
# KVLINK_READ_BIN: another mooncake_read build to run instead of the bundle's (an absolute path:
# an A/B of two builds in one command).
# Output: $OUT/first_layer_<machine>_<tokens/1024>k.md (both runs), and the runs' stderr.
# Exits 1 if a run failed.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
rounds=10
tokens=32768
hot=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --tokens) tokens="$2"; shift 2 ;;
    --hot) hot=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu-first-layer: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
out="${OUT:-$repo/gpu-mooncake/out}"
mkdir -p "$out"
# shellcheck source=scripts/machine-name.sh
source "$repo/scripts/machine-name.sh"
machine=$(kvlink_machine)
file="$out/first_layer_${machine}_$((tokens / 1024))k.md"
export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-4 GB}"
# `|| true`: without BUNDLE_INFO (or its commit line) grep fails, which `set -e -o pipefail`
# would make the script's silent end; the commit then reads "unknown".
commit="$(grep '^commit:' "$repo/gpu-mooncake/BUNDLE_INFO" 2>/dev/null | awk '{print $2}' || true)"
{
  echo "# First layer: objects pinned at lookup against pinned by the load ($((tokens / 1024))K tokens$([[ $hot -eq 1 ]] && echo ", a hot prefix: companions kept"))"
  echo
  echo "Bundle built at commit ${commit:-unknown}${KVLINK_READ_BIN:+; mooncake_read: $KVLINK_READ_BIN}. Command: \`${KVLINK_READ_BIN:+KVLINK_READ_BIN=$KVLINK_READ_BIN }bash scripts/gpu-first-layer.sh --rounds $rounds --tokens $tokens$([[ $hot -eq 1 ]] && echo ' --hot')${*:+ -- $*}\` ($(date -u +%Y-%m-%d), $machine, $(nproc) CPUs, one storage node over TCP loopback)."
} > "$file"
rc=0
n=0
passed=0
if [[ $hot -eq 1 ]]; then
  orders=(kept-at-lookup,kept-at-lookup-pin-at-load kept-at-lookup-pin-at-load,kept-at-lookup)
else
  orders=(at-lookup,at-lookup-pin-at-load at-lookup-pin-at-load,at-lookup)
fi
for order in "${orders[@]}"; do
  n=$((n + 1))
  {
    echo
    echo "## Run $n: --linker-companions $order"
    echo
  } >> "$file"
  timeout -k 15 300 bash "$repo/scripts/gpu-mooncake-run.sh" -- "${KVLINK_READ_BIN:-mooncake_read}" \
    --tokens "$tokens" --rounds "$rounds" --no-plan --groups 78 --streams 4 --store-groups 78 \
    --only "staged merge), 1 layer/call" --linker-compute-us 5760 --linker-companions "$order" "$@" \
    >> "$file" 2> "$out/first_layer_run$n.stderr.log" && passed=$((passed + 1)) \
    || { r=$?; rc=1; echo "run $n failed (exit $r)" >> "$file"; }
done
# Each run compares every variant's bytes and the Linker's pool with the objects in round 1
# and exits non-zero on a mismatch (or any failure).
{
  echo
  echo "$passed passed, $((n - passed)) failed"
} >> "$file"
exit "$rc"
