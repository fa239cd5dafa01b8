#!/usr/bin/env bash
# Runs ON THE GPU MACHINE: unpacks the Mooncake bundle that scripts/gpu-mooncake-bundle.sh made
# here (gpu-mooncake/mooncake-bundle.tar.xz, carried with the working tree) into /tmp, sets the
# environment that makes it work with its own libraries, and runs CMD next to a real master and
# storage node(s) through scripts/with-mooncake.sh (loopback only, private network namespace,
# everything it started stopped at the end).
#
# Usage: bash scripts/gpu-mooncake-run.sh [--storage-nodes N] [--] CMD [ARG...]
#   --storage-nodes N   storage nodes to start (default 1); their segment size is
#                       MOONCAKE_STORAGE_NODE_SEGMENT (default here "8 GB" each), and the
#                       command's clients lend none (MOONCAKE_GLOBAL_SEGMENT_SIZE default here 0:
#                       every byte they read crosses TCP from a storage node)
# CMD sees (besides what scripts/with-mooncake.sh exports):
#   PATH                 the bundle's bin/ (mooncake_read, glm_prefill, mooncake_modes) and iproute/bin/ first
#   LD_LIBRARY_PATH      the bundle's pylib/ (libpython3.11 for kvlink's shim) first
#   KVLINK_MOONCAKE_DIR  the bundle's mc/ (wheel binaries, libraries, shim)
#   MOONCAKE_PYTHONPATH  the bundle's py312/ (the wheel's Python client for python3.12), if packed
#   KVLINK_MC_BUNDLE     the unpacked bundle
# Examples:
#   bash scripts/gpu-mooncake-run.sh -- mooncake_read --tokens 32768
#   bash scripts/gpu-mooncake-run.sh --storage-nodes 4 -- glm_prefill --store mooncake --mode compare --tp 8
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bundle="$repo/gpu-mooncake/mooncake-bundle.tar.xz"

nodes=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --storage-nodes)
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || { echo "gpu-mooncake-run: --storage-nodes needs a count >= 1" >&2; exit 2; }
      nodes="$2"; shift 2 ;;
    -h|--help) sed -n '2,23p' "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ $# -gt 0 ]] || { echo "gpu-mooncake-run: no command (usage: $0 [--storage-nodes N] -- CMD...)" >&2; exit 2; }
[[ -f "$bundle" ]] || { echo "gpu-mooncake-run: no $bundle: run scripts/gpu-mooncake-bundle.sh where the repo is built and carry gpu-mooncake/" >&2; exit 2; }

# Unpack once per bundle content (the directory is named after its hash).
sum="$(sha256sum "$bundle" | cut -c1-16)"
dir="${TMPDIR:-/tmp}/kvlink-mooncake-$sum"
if [[ ! -f "$dir/.unpacked" ]]; then
  rm -rf "$dir.tmp"
  mkdir -p "$dir.tmp"
  xz -dc "$bundle" | tar -C "$dir.tmp" -xf -
  touch "$dir.tmp/.unpacked"
  rm -rf "$dir"
  mv "$dir.tmp" "$dir"
fi

export KVLINK_MC_BUNDLE="$dir"
export KVLINK_MOONCAKE_DIR="$dir/mc"
export PATH="$dir/bin:$dir/iproute/bin:$PATH"
export LD_LIBRARY_PATH="$dir/pylib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if [[ -d "$dir/py312/mooncake" ]]; then
  export MOONCAKE_PYTHONPATH="${MOONCAKE_PYTHONPATH:-$dir/py312}"
fi
export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-8 GB}"
export MOONCAKE_GLOBAL_SEGMENT_SIZE="${MOONCAKE_GLOBAL_SEGMENT_SIZE:-0}"
sed 's/^/[gpu-mooncake] /' "$dir/BUNDLE_INFO" >&2
exec bash "$repo/scripts/with-mooncake.sh" --storage-nodes "$nodes" -- "$@"
