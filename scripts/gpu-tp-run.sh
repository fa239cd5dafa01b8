#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the TP tests of gpu-bin/gpu_tests, then
# gpu-bin/tp_gpu, both built here by scripts/gpu-build.sh.
# Issue 13 (a work item: sharing replicated KV on device memory; docs/benchmarks.md lists them)
# in one command: the device path of TP dedup through the Linker into device pools.
#   1. Correctness: the `gpu` test target's TP tests (tests/gpu/tp_dedup.rs, tp_nccl_one.rs;
#      `gpu_tests tp_`, KVLINK_REQUIRE_GPU=1). One GPU: 2, 4 and 8 ranks on the GPU (in-process
#      device group: device-to-device copies on each rank's comm stream, ordered by events):
#      every mode, bytes compared on every rank, failures on rank 0, a middle rank and the last
#      rank; NCCL with one rank through the same linker path and the device share step. Two or
#      more GPUs: the same checks over NCCL, one rank per GPU.
#   2. Benchmarks (tp_gpu): one GPU: 128K tokens per mode at 8 ranks: time to the last layer on
#      every rank, PCIe bytes per rank against the ideal. Two or more GPUs: NCCL across them,
#      one rank per GPU, 128K/256K/512K per mode beside the seed's table (the SGLang reference:
#      rank 0 loads, then broadcasts each layer over NCCL; docs/benchmarks.md, "the seed").
# The tests print their tables, then tp_gpu its benchmark tables and result table; each table
# ends with the line "N passed, N failed", and a last such line adds them all up.
#
# Usage: bash scripts/gpu-tp-run.sh [tp_gpu flags]
#   --bench-ranks N  ranks on one GPU for the benchmark (default 8)
#   --tp N           NCCL ranks, one per GPU (default: every visible GPU when 2 or more)
#   --quick          the tests' smaller sizes (KVLINK_GPU_QUICK=1: 32 pages); benchmark at 8K
#                    tokens only, one repetition
#   --max-tokens T   largest prefix benchmarked; --min-tokens T the smallest
#   --reps R         measured repetitions per mode after one warm-up (default 3)
#   --budget-s S     start no size that would end past S seconds (default: what the limit
#                    leaves after the tests, less 45 s for the kill grace and the table)
#   --host-mem-gib G host memory to plan with (default here: the machine's size, see below)
#   --threads T      store fill threads
#   --no-tests       benchmarks only (skip the TP tests)
# Output in $OUT when set (else gpu-bin/out/), nine files: env_tp.txt, gpu_tests_tp.stdout.log (the tests' tables),
# gpu_tests_tp.stderr.log (every row as it was produced), tp_gpu.stdout.log (benchmark
# tables, then the result table), tp_gpu.stderr.log (every row as it was produced, warnings),
# tp_gpu_bench_tp<N>.md (the benchmark tables), tp_gpu_<gpu>x<gpus>_ranks<N>.txt (tables +
# result table: commit it under docs/results/, e.g. tp_gpu_h200x1_ranks8.txt),
# timelines_tp<N>.tar (per size and mode: timeline_*.svg/.csv), tp_result.txt (the closing
# "N passed, N failed" line).
# The tests and tp_gpu together are stopped after KVLINK_TP_TIMEOUT seconds (default 580, inside
# the 600 s a command could run on the GPU machine) so that the logs are still packed and
# printed; tp_gpu itself starts no prefix size that would end past --budget-s.
# Exit status: 1 a TP test failed (tp_gpu's status otherwise: 0 all passed, 1 a benchmark
# failed, 2 CUDA unavailable or too few GPUs; 124 stopped by KVLINK_TP_TIMEOUT).
#
# From the build machine: scripts/gpu-build.sh, then copy gpu-bin/ to the GPU machine with the
# working tree and run there `bash scripts/gpu-tp-run.sh` (one GPU; on a machine with 2 / 4 / 8
# GPUs it also runs NCCL across them, one rank per GPU).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin_dir="${KVLINK_GPU_BIN:-gpu-bin}"
out="${OUT:-$bin_dir/out}"
mkdir -p "$out"
# What this run writes, gone first: a reused $out must not show an earlier run's tables as
# this one's (tp_gpu cut off before it wrote them, or the tests not run).
rm -rf "$out/timelines" "$out"/timelines_tp*.tar "$out"/tp_gpu_bench_tp*.md \
  "$out"/tp_gpu_*_ranks*.txt "$out"/tp_gpu.*.log "$out"/gpu_tests_tp.*.log "$out/env_tp.txt" \
  "$out/tp_result.txt"
for b in gpu_tests tp_gpu; do
  if [[ ! -x "$bin_dir/$b" ]]; then
    echo "gpu-tp-run: $bin_dir/$b missing: run scripts/gpu-build.sh on the build machine and carry gpu-bin" >&2
    exit 2
  fi
done

# --no-tests is this script's own flag; every other flag goes to tp_gpu.
run_tests=1
tp_args=()
for a in "$@"; do
  if [[ "$a" == --no-tests ]]; then run_tests=0; else tp_args+=("$a"); fi
done
set -- "${tp_args[@]}"

# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

# Host memory on the lent machines starts small and grows as it is used (KINDS.md: MemTotal
# reads 31-62 GiB at the start), so tp_gpu would skip sizes that fit. Unless --host-mem-gib is
# given, plan with the machine's size by its GPU count: 1 → 128, 2 → 256, 4 → 512, 8 → 560 GiB.
extra_args=()
# Whether flag $1 is among the rest of the arguments (as `--flag value` or `--flag=value`).
has_flag() {
  local flag=$1 a
  shift
  for a in "$@"; do
    [[ "$a" == "$flag" || "$a" == "$flag="* ]] && return 0
  done
  return 1
}
if ! has_flag --host-mem-gib "$@"; then
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

limit="${KVLINK_TP_TIMEOUT:-580}"
# The tests get what the benchmark does not need (90 s), and at least 60 s.
tests_limit=$(( limit > 150 ? limit - 90 : 60 ))
started=$SECONDS
trc=0
if (( run_tests )); then
  quick=0
  [[ " $* " == *" --quick "* ]] && quick=1
  # The tests leave the benchmark at least 60 s and the kill grace of both inside `limit`.
  KVLINK_REQUIRE_GPU=1 KVLINK_GPU_QUICK=$quick timeout -k 15 "$tests_limit" "$bin_dir/gpu_tests" tp_ \
    --test-threads=1 --nocapture > "$out/gpu_tests_tp.stdout.log" 2> "$out/gpu_tests_tp.stderr.log"
  trc=$?
fi
spent=$(( SECONDS - started ))
left=$(( limit - 15 - spent ))
# The benchmark plans with what is left of the limit, less 30 s for its table and timelines
# (unless --budget-s is given): planned past `left`, it was killed mid-size with its table
# (printed at its end) lost.
if ! has_flag --budget-s "$@"; then
  extra_args+=(--budget-s $(( left - 30 > 30 ? left - 30 : 30 )))
fi
if (( left >= 60 )); then
  timeout -k 15 "$left" "$bin_dir/tp_gpu" --out "$out" "${extra_args[@]}" "$@" \
    > "$out/tp_gpu.stdout.log" 2> "$out/tp_gpu.stderr.log"
  rc=$?
else
  echo "tp_gpu not run: the tests left $left s of the $limit s" | tee "$out/tp_gpu.stdout.log" > "$out/tp_gpu.stderr.log"
  rc=124
fi
if [[ -d "$out/timelines" ]]; then
  tp=$(find "$out/timelines" -name 'timeline_tp*' | sed -n 's/.*timeline_tp\([0-9]*\)_.*/\1/p' | head -1)
  tar -C "$out" -cf "$out/timelines_tp${tp:-N}.tar" timelines && rm -rf "$out/timelines"
fi
cat "$out/env_tp.txt"
if (( run_tests )); then
  echo "== gpu_tests tp_ stderr (last 40 lines; full log: $out/gpu_tests_tp.stderr.log)"
  tail -n 40 "$out/gpu_tests_tp.stderr.log"
  echo "== gpu_tests tp_ (the TP checks as tests, $spent s) exit status $trc; each test's rows:"
  cat "$out/gpu_tests_tp.stdout.log"
fi
echo "== tp_gpu stderr (last 80 lines; full log: $out/tp_gpu.stderr.log)"
tail -n 80 "$out/tp_gpu.stderr.log"
[[ $rc -eq 124 || $rc -eq 137 ]] && echo "== tp_gpu stopped after $left s: rows so far are in the stderr log above; tables of finished sizes in $out/tp_gpu_bench_tp*.md"
echo "== tp_gpu exit status $rc; benchmark tables and result table:"
cat "$out/tp_gpu.stdout.log"
# One closing line over both (as gpu-run.sh writes it): every "N passed, N failed" line of the
# tests' tables and of tp_gpu's, added up. A binary that exited non-zero with no failed row of
# its own counts as one failure: the tables it never printed must not read as "0 failed" (the
# last line was tp_gpu's own before, whatever the tests did).
count() { awk '/^[0-9]+ passed, [0-9]+ failed$/ { p += $1; f += $3 } END { print p + 0, f + 0 }' "$1"; }
tp=0; tf=0
if (( run_tests )); then
  read -r tp tf < <(count "$out/gpu_tests_tp.stdout.log")
  if (( trc != 0 && tf == 0 )); then
    echo "gpu-tp-run: gpu_tests tp_ exited $trc with no failed row: counted as 1 failed"
    tf=1
  fi
  # A filter that matched no test (modules renamed) must not read as a pass.
  if (( tp + tf == 0 )); then
    echo "gpu-tp-run: gpu_tests tp_ ran no check: counted as 1 failed"
    tf=1
  fi
fi
read -r bp bf < <(count "$out/tp_gpu.stdout.log")
if (( rc != 0 && bf == 0 )); then
  echo "gpu-tp-run: tp_gpu exited $rc with no failed row: counted as 1 failed"
  bf=1
fi
if (( trc == 124 || trc == 137 )); then
  echo "== gpu_tests tp_ stopped at their limit ($tests_limit s)"
fi
echo "$((tp + bp)) passed, $((tf + bf)) failed" | tee "$out/tp_result.txt"
if (( trc == 124 || trc == 137 )); then
  exit 124
fi
# A failed test is a failure whatever tp_gpu said (its 2, "CUDA unavailable", included).
if (( trc != 0 )); then
  exit 1
fi
exit "$rc"
