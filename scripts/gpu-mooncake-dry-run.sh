#!/usr/bin/env bash
# Runs, HERE (the build machine), scripts/gpu-mooncake-table.sh --quick for the given parts the
# way the GPU machine would: in a private mount namespace where libpython3.11, libbpf, libmnl
# and /usr/sbin/ip are hidden (the GPU machine has none of them), from a clean environment
# (env -i, PATH=/usr/bin:/bin), so that everything the parts need must come from the bundle
# (gpu-mooncake/, made by scripts/gpu-mooncake-bundle.sh first).
#
# Usage: bash scripts/gpu-mooncake-dry-run.sh [PART...]     (default: host device reads procs)
#   MOONCAKE_PYTHON   a python3.12 for the bundle's cp312 client (the GPU machine's python3 is
#                     3.12; default: the first python3.12 found here)
#   OUT               where the tables go (default: gpu-mooncake/dry-run/)
# Needs root (mount namespace, bind mounts).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
parts=("$@")
[[ ${#parts[@]} -gt 0 ]] || parts=(host device reads procs)
# The interpreter itself (a pyenv shim would need pyenv's environment).
py="${MOONCAKE_PYTHON:-}"
if [[ -z "$py" ]]; then
  for cand in python3.12 /root/.pyenv/versions/3.12*/bin/python3; do
    py="$("$cand" -c 'import sys; print(sys.executable)' 2>/dev/null)" && break
  done
fi
out="${OUT:-$repo/gpu-mooncake/dry-run}"
mkdir -p "$out"
hide=()
for f in "$(/sbin/ldconfig -p | awk '$1 == "libpython3.11.so.1.0" && /x86-64/ && !found {print $NF; found = 1}')" \
         "$(/sbin/ldconfig -p | awk '$1 == "libbpf.so.1" && /x86-64/ && !found {print $NF; found = 1}')" \
         "$(/sbin/ldconfig -p | awk '$1 == "libmnl.so.0" && /x86-64/ && !found {print $NF; found = 1}')" \
         /usr/sbin/ip; do
  [[ -n "$f" && -e "$f" ]] && hide+=("$(readlink -f "$f")")
done
echo "[dry-run] hidden: ${hide[*]}; python for the cp312 client: ${py:-none}" >&2
status=0
for part in "${parts[@]}"; do
  echo "[dry-run] part $part" >&2
  unshare -m -- bash -c '
    set -e
    mount --make-rprivate /
    for f in "${@:4}"; do mount --bind /dev/null "$f"; done
    exec env -i PATH=/usr/bin:/bin HOME=/tmp OUT="$2" ${3:+MOONCAKE_PYTHON=$3} \
      bash "$1/scripts/gpu-mooncake-table.sh" --part "$0" --quick
  ' "$part" "$repo" "$out" "$py" "${hide[@]}" || status=$?
done
exit "$status"
