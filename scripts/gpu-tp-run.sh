#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): gpu-bin/tp_gpu, built here by scripts/gpu-build.sh.
# Issue 13 in one command: the device path of TP dedup through the Linker into device pools.
#   One GPU: 2, 4 and 8 ranks on the GPU (in-process device group: device-to-device copies on
#   each rank's comm stream, ordered by events): every mode, bytes compared on every rank,
#   failures on rank 0, a middle rank and the last rank; NCCL with one rank through the same
#   linker path and the device share step; then 128K tokens per mode at 8 ranks: time to the
#   last layer on every rank, PCIe bytes per rank against the ideal.
#   Two or more GPUs: the same command runs NCCL across them, one rank per GPU (correctness,
#   then 128K/256K/512K per mode beside the seed's table).
# The result table is printed last; it ends with the line "N passed, N failed".
#
# Usage: bash scripts/gpu-tp-run.sh [tp_gpu flags]
#   --ranks A,B,..   ranks on one GPU for the correctness checks (default 2,4,8)
#   --bench-ranks N  ranks on one GPU for the benchmark (default 8)
#   --tp N           NCCL ranks, one per GPU (default: every visible GPU when 2 or more)
#   --quick          correctness on 32 pages, benchmark at 8K tokens only, one repetition
#   --max-tokens T   largest prefix benchmarked; --min-tokens T the smallest
#   --reps R         measured repetitions per mode after one warm-up (default 3)
#   --budget-s S     start no size that would end past S seconds (default 540)
#   --host-mem-gib G host memory to plan with (default here: the machine's size, see below)
#   --no-bench / --no-checks / --threads T
# Output in $OUT when set (else gpu-bin/out/), six files (the device tool brings back at most 8):
#   env_tp.txt, tp_gpu.stdout.log (benchmark tables, then the result table), tp_gpu.stderr.log
#   (every row as it was produced, warnings), tp_gpu_bench_tp<N>.md (the benchmark tables),
#   tp_gpu_<gpu>x<gpus>_ranks<N>.txt (tables + result table: commit it under docs/results/,
#   e.g. tp_gpu_h200x1_ranks8.txt), timelines_tp<N>.tar (per size and mode: timeline_*.svg/.csv).
# tp_gpu is stopped after KVLINK_TP_TIMEOUT seconds (default 580, inside the device tool's 600 s
# limit) so that the logs are still packed and printed; tp_gpu itself starts no prefix size that
# would end past --budget-s (540 s).
# Exit status: tp_gpu's (0 all passed, 1 a check failed, 2 CUDA unavailable or too few GPUs;
# 124 stopped by KVLINK_TP_TIMEOUT).
#
# From the build machine: scripts/gpu-build.sh, then with the device tool
#   run(command="bash scripts/gpu-tp-run.sh", carry=["gpu-bin"], kind="nvidia-h200", timeout_s=600)
# (kind -x2 / -x4 / -x8 for NCCL across 2 / 4 / 8 GPUs, one rank per GPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin_dir="${KVLINK_GPU_BIN:-gpu-bin}"
out="${OUT:-$bin_dir/out}"
mkdir -p "$out"
if [[ ! -x "$bin_dir/tp_gpu" ]]; then
  echo "gpu-tp-run: $bin_dir/tp_gpu missing: run scripts/gpu-build.sh on the build machine and carry gpu-bin" >&2
  exit 2
fi

# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

# Host memory on the lent machines starts small and grows as it is used (KINDS.md: MemTotal
# reads 31-62 GiB at the start), so tp_gpu would skip sizes that fit. Unless --host-mem-gib is
# given, plan with the machine's size by its GPU count: 1 → 128, 2 → 256, 4 → 512, 8 → 560 GiB.
extra_args=()
if [[ " $* " != *" --host-mem-gib "* ]]; then
  ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  case "$ngpu" in
    1) extra_args=(--host-mem-gib 120) ;;
    2) extra_args=(--host-mem-gib 240) ;;
    4) extra_args=(--host-mem-gib 490) ;;
    8) extra_args=(--host-mem-gib 540) ;;
  esac
fi

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo "command: bash scripts/gpu-tp-run.sh $*"
  echo "tp_gpu flags added: ${extra_args[*]:-none}"
  cat "$bin_dir/BUILD_INFO" 2>/dev/null
  ldd --version 2>&1 | head -1
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -20
  echo "CPUs: $(nproc)"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>&1
} > "$out/env_tp.txt"

rm -rf "$out/timelines"
timeout -k 15 "${KVLINK_TP_TIMEOUT:-580}" "$bin_dir/tp_gpu" --out "$out" "${extra_args[@]}" "$@" \
  > "$out/tp_gpu.stdout.log" 2> "$out/tp_gpu.stderr.log"
rc=$?
if [[ -d "$out/timelines" ]]; then
  tp=$(find "$out/timelines" -name 'timeline_tp*' | sed -n 's/.*timeline_tp\([0-9]*\)_.*/\1/p' | head -1)
  tar -C "$out" -cf "$out/timelines_tp${tp:-N}.tar" timelines && rm -rf "$out/timelines"
fi
cat "$out/env_tp.txt"
echo "== tp_gpu stderr (last 80 lines; full log: $out/tp_gpu.stderr.log)"
tail -n 80 "$out/tp_gpu.stderr.log"
[[ $rc -eq 124 || $rc -eq 137 ]] && echo "== tp_gpu stopped after ${KVLINK_TP_TIMEOUT:-580} s: rows so far are in the stderr log above; tables of finished sizes in $out/tp_gpu_bench_tp*.md"
echo "== tp_gpu exit status $rc; benchmark tables and result table:"
cat "$out/tp_gpu.stdout.log"
exit "$rc"
