#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (or any host with the bundle or a local Mooncake): what bounds one
# Mooncake client's read of a GLM-5.2 prefix over TCP (issue 17: read throughput from Mooncake;
# docs/benchmarks.md lists the work items). Four reads of the same objects,
# each in a run of its own (own master and storage node) and nothing else read in that run,
# with every thread of the storage node and the reader sampled from /proc (scripts/thread-busy.py):
#   python     the wheel's Python client, `batch_get_into` of whole objects (the yardstick)
#   contiguous kvlink's ranged call, all 78 layers, one range per object, contiguous buffer
#   staged     kvlink's store, all 78 layers into pool slots (staged merge, read_streams S)
#   linker     the Linker, TP 1, no compute, companions read at lookup, 8 and S read streams
# Usage: bash scripts/gpu-read-bound.sh [--tokens N] [--rounds N] [--streams S]
# Output ($OUT, else gpu-mooncake/out/): read_bound_<variant>.md (the bench's table, then the
# thread table), read_bound_<variant>.stderr.log. Exits 1 if any variant failed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tokens=32768 rounds=10 streams=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tokens) tokens="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --streams) streams="$2"; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "gpu-read-bound: unknown argument $1" >&2; exit 2 ;;
  esac
done
out="${OUT:-$repo/gpu-mooncake/out}"
mkdir -p "$out"
# A built Mooncake named by KVLINK_MOONCAKE_DIR (this machine's) wins over the bundle.
if [[ -z "${KVLINK_MOONCAKE_DIR:-}" && -f "$repo/gpu-mooncake/mooncake-bundle.tar.xz" ]]; then
  runner=(bash "$repo/scripts/gpu-mooncake-run.sh" --)
  bin=mooncake_read
else
  runner=(bash "$repo/scripts/with-mooncake.sh" --storage-node)
  bin="$repo/target/release/examples/mooncake_read"
fi
export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-4 GB}"
# --no-plan: no read_plan table, whose rounds would read the objects again in every variant.
common=(--tokens "$tokens" --rounds "$rounds" --groups 78 --parallel 1 --lanes 4
        --streams "$streams" --store-groups 78 --no-plan)

# The variant's own flags, into the array `f`.
variant_flags() {
  case "$1" in
    python) f=(--only "Python \`batch_get_into\`, whole objects" --no-linker) ;;
    contiguous) f=(--only "1 range/object (contiguous dst)" --no-python --no-linker) ;;
    staged) f=(--only "staged merge), 78 layers/call, pool slots" --no-python --no-linker) ;;
    linker) f=(--only "no such row" --no-python --linker-compute-us 0
               --linker-streams "8,$streams" --linker-companions at-lookup) ;;
  esac
}

failed=0
for v in python contiguous staged linker; do
  variant_flags "$v"
  file="$out/read_bound_${v}.md"
  {
    echo "# What bounds one client's read: $v ($tokens tokens, $rounds rounds)"
    echo
    echo "Command: bash scripts/gpu-read-bound.sh --tokens $tokens --rounds $rounds --streams $streams ($(date -u +%Y-%m-%d), $(nproc) CPUs); this variant ran: $(printf '%q ' "$bin" "${common[@]}" "${f[@]}")"
    echo
  } > "$file"
  # The sampler writes its table to a file of its own (atomically) when stopped; the command
  # waits for it, also when the bench fails.
  # -k past with-mooncake's own 10 s grace for the command's group (a group of its own, which
  # timeout's KILL does not reach): with-mooncake stops it before it is killed itself.
  timeout -k 20 300 "${runner[@]}" bash -c '
    python3 "$1" --interval 0.2 --out "$2" & sp=$!
    sleep 0.5
    shift 2
    rc=0; "$@" || rc=$?
    kill -TERM $sp 2>/dev/null; wait $sp || true
    exit $rc' _ "$repo/scripts/thread-busy.py" "$file.threads" "$bin" "${common[@]}" "${f[@]}" \
    >> "$file" 2> "$out/read_bound_${v}.stderr.log" || { echo "variant $v failed: $?" >> "$file"; failed=1; }
  # A sampler cut off by the timeout may still be writing: give it a moment.
  for _ in 1 2 3 4 5; do [[ -f "$file.threads" ]] && break; sleep 1; done
  {
    echo
    echo "The thread table below samples the whole run, not the timed reads alone: it starts 0.5 s"
    echo "before the bench, so it also covers the object writes (the storage node's thread busy),"
    echo "the client's start and the size queries. Busy shares are of that whole window."
    echo
    cat "$file.threads" 2>/dev/null || echo "(no thread table: the sampler did not finish)"
  } >> "$file"
  rm -f "$file.threads"
  echo "== $v"; grep -E "^\| (Python|kvlink|[0-9.]+ ms \| [0-9])" "$file" | cut -c1-200 | head -4 || true
done
exit $failed
