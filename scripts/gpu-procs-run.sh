#!/usr/bin/env bash
# Runs on the GPU machine (no Rust there): gpu-bin/tp_procs and gpu-bin/glm_prefill, built here
# by scripts/gpu-build.sh. Issue 14 (a work item; docs/benchmarks.md lists them) in one command:
# TP ranks as PROCESSES.
#   1. One rank process with NCCL through the whole path: the rendezvous ships the NCCL ids,
#      the process joins its data and control communicators, loads every mode through the
#      Linker into a device pool (pool compared), runs the device share step on its NCCL
#      communicator for every layer, aborts it, re-forms at the rendezvous, shares again.
#   2. Two or more GPUs: one rank process per GPU, NCCL device path through the Linker, every
#      mode, every pool compared, store reads per mode; a rank process stopped mid-batch
#      (SIGSTOP) past the collective deadline → every rank fails that batch (NCCL aborts), the linkers
#      re-form the group at the rendezvous and the next batch verifies.
#   3. glm_prefill --mode compare on this host with TP ranks as threads, then as processes
#      (host pools, embedded store): every pool verified, the tables kept.
# The result table is printed last; it ends with the line "N passed, N failed".
#
# Usage: bash scripts/gpu-procs-run.sh [tp_procs flags]
#   --tp N            rank processes of part 2 (default: every visible GPU when 2 or more)
#   --pages N         pages of the prefix of parts 1 and 2 (default 64 = 221 MB)
#   --glm-tp N        TP ranks of the glm_prefill runs (default 8)
#   --glm-tokens T    their cached tokens (default 32768 = 1.77 GB per rank)
#   --quick           32 pages, glm_prefill at TP 4 and 8,192 tokens
# Output in $OUT when set (else gpu-bin/out/), at most seven files: env_procs.txt,
#   tp_procs.stdout.log (the result table), tp_procs.stderr.log (every row as it came, the rank
#   processes' warnings), tp_procs.txt (the table), glm_prefill_threads.txt and
#   glm_prefill_processes.txt (both whole reports, with the comparison tables),
#   glm_prefill_timelines.tar (the two timeline pictures).
# tp_procs is stopped after KVLINK_PROCS_TIMEOUT seconds (default 290: the whole run fits in
# five minutes), so the logs are still printed.
# Exit status: tp_procs's (0 all passed, 1 a check failed, 2 no GPU or bad flags; 124 stopped).
#
# From the build machine: scripts/gpu-build.sh, then copy gpu-bin/ to the GPU machine with the
# working tree and run there `bash scripts/gpu-procs-run.sh` (on one GPU parts 1 and 3 only;
# with 2 / 4 / 8 GPUs part 2 runs 2 / 4 / 8 rank processes).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin_dir="${KVLINK_GPU_BIN:-gpu-bin}"
out="${OUT:-$bin_dir/out}"
mkdir -p "$out"
# What this run writes, gone first: a reused $out must not show an earlier run's outputs as
# this one's (part 3 cut off, or not run).
rm -f "$out"/glm_prefill_*.txt "$out"/glm_prefill_*.svg "$out/glm_prefill_timelines.tar" \
  "$out"/tp_procs.*.log "$out/tp_procs.txt" "$out/env_procs.txt"
for b in tp_procs glm_prefill; do
  if [[ ! -x "$bin_dir/$b" ]]; then
    echo "gpu-procs-run: $bin_dir/$b missing: run scripts/gpu-build.sh on the build machine and carry gpu-bin" >&2
    exit 2
  fi
done

# shellcheck source=scripts/gpu-common.sh
source scripts/gpu-common.sh

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
  echo "command: bash scripts/gpu-procs-run.sh $*"
  cat "$bin_dir/BUILD_INFO" 2>/dev/null
  ldd --version 2>&1 | head -1
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv 2>&1
  echo "CPUs: $(nproc)"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ls -l /usr/lib/x86_64-linux-gnu/libnccl.so* 2>&1
} > "$out/env_procs.txt"

# tp_procs ends every wait 20 s before the limit, so that a silent rank fails its row and the
# tables are still written.
# A limit in whole seconds only (`timeout` also takes "5m"; then no --limit-s is passed), and a
# --limit-s among the arguments comes first, so it wins.
limit=${KVLINK_PROCS_TIMEOUT:-290}
run_limit=()
if [[ "$limit" =~ ^[0-9]+$ ]] && (( 10#$limit > 0 )); then
  secs=$(( 10#$limit ))
  run_limit=(--limit-s $(( secs > 40 ? secs - 20 : (secs + 1) / 2 )))
fi
timeout -k 10 "$limit" "$bin_dir/tp_procs" --out "$out" \
  --glm-bin "$bin_dir/glm_prefill" "$@" ${run_limit[@]+"${run_limit[@]}"} \
  > "$out/tp_procs.stdout.log" 2> "$out/tp_procs.stderr.log"
rc=$?
svgs=$(cd "$out" && ls glm_prefill_*.svg 2>/dev/null)
if [[ -n "$svgs" ]]; then
  # shellcheck disable=SC2086
  tar -C "$out" -cf "$out/glm_prefill_timelines.tar" $svgs && (cd "$out" && rm -f $svgs)
fi
cat "$out/env_procs.txt"
echo "== tp_procs stderr (last 60 lines; full log: $out/tp_procs.stderr.log)"
tail -n 60 "$out/tp_procs.stderr.log"
for shape in threads processes; do
  f="$out/glm_prefill_$shape.txt"
  if [[ -f "$f" ]]; then
    echo "== glm_prefill, TP ranks as $shape: the comparison (whole report: $f)"
    sed -n '/^modes on the same saved prefix/,$p' "$f"
  fi
done
[[ $rc -eq 124 || $rc -eq 137 ]] && echo "== tp_procs stopped after ${KVLINK_PROCS_TIMEOUT:-290} s: rows so far are in the stderr log above"
echo "== tp_procs exit status $rc; result table:"
cat "$out/tp_procs.stdout.log"
# A tp_procs that exited non-zero (stopped at its limit, crashed, bad flags) with no failed row
# of its own counts as one failure: the rows it never printed must not read as "0 failed", and
# the output still ends with its closing count.
read -r pp pf < <(awk '/^[0-9]+ passed, [0-9]+ failed$/ { p = $1; f = $3 } END { print p + 0, f + 0 }' \
  "$out/tp_procs.stdout.log")
if (( rc != 0 && pf == 0 )); then
  echo "gpu-procs-run: tp_procs exited $rc with no failed row: counted as 1 failed"
  echo "$pp passed, 1 failed"
fi
exit "$rc"
