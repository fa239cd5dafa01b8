#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the binaries that scripts/gpu-build.sh put in
# gpu-bin/. Correctness checks, NCCL checks and benchmarks in one run; the result table is
# printed last.
#
# Usage: bash scripts/gpu-run.sh [gpu_check flags: --quick, --no-128k]
# Logs, CSV and SVG timelines go to $OUT when set (else gpu-bin/out/).
# Exit status: gpu_check's (0 all passed, 1 a check failed, 2 CUDA unavailable).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin_dir="${KVLINK_GPU_BIN:-gpu-bin}"
out="${OUT:-$bin_dir/out}"
mkdir -p "$out"
if [[ ! -x "$bin_dir/gpu_check" ]]; then
  echo "gpu-run: $bin_dir/gpu_check missing: run scripts/gpu-build.sh on the build machine and carry gpu-bin" >&2
  exit 2
fi

# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  cat "$bin_dir/BUILD_INFO" 2>/dev/null
  ldd --version 2>&1 | head -1
  nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>&1
} > "$out/env.txt"

"$bin_dir/gpu_check" --out "$out" "$@" > "$out/gpu_check.stdout.log" 2> "$out/gpu_check.stderr.log"
rc=$?
cat "$out/env.txt"
echo "== gpu_check stderr (last 60 lines; full log: $out/gpu_check.stderr.log)"
tail -n 60 "$out/gpu_check.stderr.log"
echo "== gpu_check exit status $rc; result table:"
cat "$out/gpu_check.stdout.log"
exit "$rc"
