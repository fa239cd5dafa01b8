#!/usr/bin/env bash
# Runs ON THE GPU MACHINE (or any host with the bundle or a local Mooncake): what bounds one
# Mooncake client's read of a GLM-5.2 prefix over TCP (issue 17). Four reads of the same objects,
# each in a run of its own (own master and storage node), with every thread of the storage node
# and the reader sampled from /proc (scripts/thread-busy.py):
#   python     the wheel's Python client, `batch_get_into` of whole objects (the yardstick)
#   contiguous kvlink's ranged call, all 78 layers, one range per object, contiguous buffer
#   staged     kvlink's store, all 78 layers into pool slots (staged merge, read_streams S)
#   linker     the Linker, TP 1, no compute, companions read at lookup, read_streams default and S
# Usage: bash scripts/gpu-read-bound.sh [--tokens N] [--rounds N] [--streams S]
# Output ($OUT, else gpu-mooncake/out/): read_bound_<variant>.md (the bench's table, then the
# thread table), read_bound_<variant>.stderr.log.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tokens=32768 rounds=10 streams=4
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tokens) tokens="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --streams) streams="$2"; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
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
common=(--tokens "$tokens" --rounds "$rounds" --groups 78 --parallel 1 --lanes 4
        --streams "$streams" --store-groups 78 --compute-us 0)
declare -A flags=(
  [python]="--only baseline --no-linker"
  [contiguous]="--only 1_range/object --no-python --no-linker"
  [staged]="--only merge),_78_layers --no-python --no-linker"
  [linker]="--only no-such-row --no-python --linker-compute-us 0 --linker-streams 0,$streams --linker-companions at-lookup"
)
for v in python contiguous staged linker; do
  # Words of --only may hold spaces: written with '_' above.
  read -r -a f <<< "${flags[$v]}"
  f=("${f[@]//_/ }")
  file="$out/read_bound_${v}.md"
  {
    echo "# What bounds one client's read: $v ($tokens tokens, $rounds rounds)"
    echo
    echo "Command: bash scripts/gpu-read-bound.sh --tokens $tokens --rounds $rounds --streams $streams ($(date -u +%Y-%m-%d), $(hostname), $(nproc) CPUs); this variant: $bin ${common[*]} ${f[*]}"
    echo
  } > "$file"
  timeout -k 10 300 "${runner[@]}" bash -c '
    python3 "$1" --interval 0.2 > "$2.threads" & sp=$!
    sleep 0.5
    shift 2
    rc=0; "$@" || rc=$?
    kill -TERM $sp; wait $sp || true
    exit $rc' _ "$repo/scripts/thread-busy.py" "$file" "$bin" "${common[@]}" "${f[@]}" \
    >> "$file" 2> "$out/read_bound_${v}.stderr.log" || echo "variant $v failed: $?" >> "$file"
  { echo; cat "$file.threads" 2>/dev/null; } >> "$file"
  rm -f "$file.threads"
  echo "== $v"; grep -E "^\| (Python|kvlink|[0-9.]+ ms \| [0-9])" "$file" | cut -c1-200 | head -4 || true
done
