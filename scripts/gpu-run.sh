#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): the binaries that scripts/gpu-build.sh put in
# gpu-bin/. First the GPU checks as tests (gpu-bin/gpu_tests: the `gpu` test target,
# tests/gpu/, one test at a time, KVLINK_REQUIRE_GPU=1 so a missing GPU fails), then the
# benchmarks (gpu_check: it only measures). Each test prints its table, and gpu_check its
# result table; a last line "N passed, N failed" adds up every row of the tests and the
# benchmarks together.
#
# Usage: bash scripts/gpu-run.sh [gpu_check flags: --quick, --no-128k]   (--quick also runs the
#        tests' smaller sizes: KVLINK_GPU_QUICK=1)
# Logs, CSV and SVG timelines go to $OUT when set (else gpu-bin/out/).
# Exit status: 0 all passed; 1 a check or a test failed, or a binary exited non-zero (CUDA
# unavailable included: gpu_check's 2 is counted as a failed row).
#
# From the build machine: scripts/gpu-build.sh, then copy gpu-bin/ to the GPU machine with the
# working tree and run there `bash scripts/gpu-run.sh`.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin_dir="${KVLINK_GPU_BIN:-gpu-bin}"
out="${OUT:-$bin_dir/out}"
mkdir -p "$out"
# What this run writes, gone first: a reused $out must not show an earlier run's table or
# timelines as this one's (a run cut off, or a --quick run that writes fewer sizes).
rm -f "$out/env.txt" "$out"/gpu_check.*.log "$out"/gpu_tests.*.log "$out/gpu_result.txt" \
  "$out/gpu_check_table.txt" "$out"/timeline_*.csv "$out"/timeline_*.svg
for b in gpu_tests gpu_check; do
  if [[ ! -x "$bin_dir/$b" ]]; then
    echo "gpu-run: $bin_dir/$b missing: run scripts/gpu-build.sh on the build machine and carry gpu-bin" >&2
    exit 2
  fi
done

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

quick=0
[[ " $* " == *" --quick "* ]] && quick=1
# Each binary is bounded (KVLINK_GPU_TESTS_LIMIT, KVLINK_GPU_CHECK_LIMIT seconds): a check that
# hangs ends as a failure (exit 124) with the rows printed so far, not a device command that
# runs out with nothing back.
KVLINK_REQUIRE_GPU=1 KVLINK_GPU_QUICK=$quick timeout -k 15 "${KVLINK_GPU_TESTS_LIMIT:-360}" \
  "$bin_dir/gpu_tests" --test-threads=1 --nocapture \
  > "$out/gpu_tests.stdout.log" 2> "$out/gpu_tests.stderr.log"
trc=$?
timeout -k 15 "${KVLINK_GPU_CHECK_LIMIT:-180}" "$bin_dir/gpu_check" --out "$out" "$@" \
  > "$out/gpu_check.stdout.log" 2> "$out/gpu_check.stderr.log"
rc=$?
cat "$out/env.txt"
echo "== gpu_tests stderr (last 40 lines; full log: $out/gpu_tests.stderr.log)"
tail -n 40 "$out/gpu_tests.stderr.log"
echo "== gpu_check stderr (last 40 lines; full log: $out/gpu_check.stderr.log)"
tail -n 40 "$out/gpu_check.stderr.log"
echo "== gpu_tests (the GPU checks as tests) exit status $trc; each test's rows:"
cat "$out/gpu_tests.stdout.log"
echo "== gpu_check (benchmarks) exit status $rc; result table:"
cat "$out/gpu_check.stdout.log"
# One closing line over both: every "N passed, N failed" line of the tests' tables and the
# benchmarks' table, added up (libtest's own "test result:" line is not one of them). A binary
# that exited non-zero (cut off by its limit, crashed) with no failed row of its own counts as
# one failure: the tables it never printed must not read as "0 failed".
count() { awk '/^[0-9]+ passed, [0-9]+ failed$/ { p += $1; f += $3 } END { print p + 0, f + 0 }' "$1"; }
read -r tp tf < <(count "$out/gpu_tests.stdout.log")
read -r cp cf < <(count "$out/gpu_check.stdout.log")
for pair in "gpu_tests:$trc:$tf" "gpu_check:$rc:$cf"; do
  IFS=: read -r name code failed <<< "$pair"
  if (( code != 0 && failed == 0 )); then
    echo "gpu-run: $name exited $code with no failed row: counted as 1 failed (its remaining tables were not printed)"
    if [[ "$name" == gpu_tests ]]; then tf=1; else cf=1; fi
  fi
done
# Tests that ran no check (a filter or module renamed) must not read as a pass.
if (( tp + tf == 0 )); then
  echo "gpu-run: gpu_tests ran no check: counted as 1 failed"
  tf=1
fi
echo "$((tp + cp)) passed, $((tf + cf)) failed" | tee "$out/gpu_result.txt"
# A failed test is a failure whatever gpu_check said (its 2, "CUDA unavailable", included);
# so is a failed row, or tests that ran no check.
if (( trc != 0 || tf + cf > 0 )); then
  exit 1
fi
exit "$rc"
