#!/usr/bin/env bash
# Runs ON THE GPU MACHINE: the reference table of the dedup modes against a real Mooncake Store
# (issue 17: a work item, read throughput from Mooncake; docs/benchmarks.md lists them), one part
# per command (each part stays inside the 10 minutes a command could run on the GPU machine).
# Built and packed where the repo is by scripts/gpu-mooncake-bundle.sh (gpu-mooncake/: the
# wheel's binaries and libraries, mooncake_modes built with CUDA, mooncake_read, glm_prefill);
# every part runs under scripts/gpu-mooncake-run.sh (a master and storage nodes on loopback,
# in a private network namespace, stopped at the end).
#
# Usage: bash scripts/gpu-mooncake-table.sh --part PART [--quick] [-- extra flags for the binary]
# Parts (run them back to back on one warm machine; times measured/estimated for one H200 host):
#   host     host pools, TP 2, 4, 8 as threads, 32K and 128K tokens, every mode and Auto (two
#            Auto runs per TP), one storage node                            (about 6-8 min)
#   nodes    the same with 4 storage nodes (SplitAllGather against their aggregate)
#                                                                           (about 6-8 min)
#   device   device pools with the ranks on the GPU(s): every rank on GPU 0 (in-process device
#            group), and with 2+ GPUs one rank per GPU over NCCL; 32K and 128K, one storage
#            node                                                           (about 6-8 min)
#   reads    one client: the wheel's Python whole-object read against kvlink's reads and the
#            Linker itself (adaptive layer groups, store defaults; checksums taken by the store
#            as the rows land, on the default verify threads (4 on the GPU host; 16 at
#            03c5f1c: no clear gain); checksum companions read by every load, and read at
#            lookup with the objects pinned at lookup (the default) or by the load) with the engine
#            computing 0 / 5.76 ms per layer (SIMULATED: the modelled compute at 32K), 32K
#            tokens, one storage node (about 3-4 min; KVLINK_TABLE_TIMEOUT=330)
#   procs    ranks as processes (glm_prefill --ranks-as processes), TP 2, 4, 8
#            (KVLINK_TABLE_TP), 32K, every mode and Auto, then Auto alone a second time (two
#            runs must agree), one storage node, if this build's glm_prefill has the mode;
#            else the part says so and exits 0                              (about 3-5 min)
# KVLINK_TABLE_TOKENS / KVLINK_TABLE_TP (host, nodes, device; procs too, one size: the first)
#           the prefix sizes and TP sizes
#           (default 32768,131072 and 2,4,8; procs 32768), to split a part that would not fit one command
#           (e.g. KVLINK_TABLE_TOKENS=131072 KVLINK_TABLE_TP=8 ... --part host).
# KVLINK_TABLE_REPS / KVLINK_TABLE_AUTO_RUNS (host, nodes, device) batches per fixed mode (default 2)
#           and fresh Auto runs per TP (default 2)
# KVLINK_TABLE_MODES_BIN (host, nodes, device) another mooncake_modes build to run instead of the
#           bundle's (an absolute path: an A/B of two builds in one command)
# --quick   small sizes (2K tokens, TP 2 and 4, one rep, one Auto run; device pools on CPU
#           devices when no GPU is visible): a dry run of the whole part in well under a minute
#
# Output ($OUT when set, else gpu-mooncake/out/): the part's tables, named after the machine and
# shape for docs/results/ (e.g. mooncake_modes_h200x1_host_128k_n1.md, mooncake_read_h200x1_32k.md),
# each ending with `N passed, N failed` where it checks; <part>.stdout.log, <part>.stderr.log and
# env_<part>.txt. The part's runs together are stopped after KVLINK_TABLE_TIMEOUT seconds
# (default 570; each run gets what is left), and mooncake_modes starts no prefix size it expects
# to end past --budget-s (default 520 s) and writes each size's table when it is done, so the
# tables of the sizes it finished are kept.
#
# From the build machine:
#   bash scripts/gpu-mooncake-bundle.sh        # gpu-mooncake/ (< 34 MiB)
# then copy gpu-mooncake/ to the GPU machine with the working tree and run there
#   bash scripts/gpu-mooncake-table.sh --part host  # then --part reads, device, nodes
set -uo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"

part=""
quick=0
extra=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --part) part="${2:-}"; shift 2 ;;
    --quick) quick=1; shift ;;
    -h|--help) sed -n '2,50p' "$0"; exit 0 ;;
    --) shift; extra=("$@"); break ;;
    *) echo "gpu-mooncake-table: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$part" in
  host|nodes|device|reads|procs) ;;
  *) echo "gpu-mooncake-table: --part host|nodes|device|reads|procs (see --help)" >&2; exit 2 ;;
esac

out="${OUT:-$repo/gpu-mooncake/out}"
mkdir -p "$out"
export OUT="$out"
# This part's earlier tables go first: a reused $OUT (a warm machine, the default folder) must
# not show an earlier run's table, with its "N passed, 0 failed", as this run's (a size not
# reached this time, a run stopped at its limit). Other parts' tables stay: the parts run one
# after another into one folder.
rm -f "$out/$part.stdout.log" "$out/$part.stderr.log" "$out/env_$part.txt"
case "$part" in
  host)   rm -f "$out"/mooncake_modes_*_host_*_n1.md ;;
  nodes)  rm -f "$out"/mooncake_modes_*_host_*_n"${KVLINK_TABLE_NODES:-4}".md ;;
  device) rm -f "$out"/mooncake_modes_*_gpu_*_n1.md "$out"/mooncake_modes_*_nccl_*_n1.md \
                "$out"/mooncake_modes_*_cpu-device_*_n1.md ;;
  reads)  rm -f "$out"/mooncake_read_*.md ;;
  procs)  rm -f "$out"/glm_prefill_procs_*.md "$out/procs.help.stderr.log" ;;
esac

# The machine: "h200x1" from the first GPU's name and the GPU count; "cpu<cores>" without one.
# shellcheck source=scripts/machine-name.sh
source "$repo/scripts/machine-name.sh"
gpus=$(kvlink_gpus)
machine=$(kvlink_machine)
if [[ $gpus -gt 0 ]]; then
  # shellcheck source=scripts/gpu-common.sh
  source "$repo/scripts/gpu-common.sh"
fi
# Host memory on the lent machines grows as it is used (MemTotal reads low at the start): plan
# with the machine's size by its GPU count.
case "$gpus" in
  1) export KVLINK_HOST_MEM_GIB="${KVLINK_HOST_MEM_GIB:-120}" ;;
  2) export KVLINK_HOST_MEM_GIB="${KVLINK_HOST_MEM_GIB:-240}" ;;
  4) export KVLINK_HOST_MEM_GIB="${KVLINK_HOST_MEM_GIB:-490}" ;;
  8) export KVLINK_HOST_MEM_GIB="${KVLINK_HOST_MEM_GIB:-540}" ;;
esac

{
  echo "== $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), part $part$([[ $quick -eq 1 ]] && echo ' (quick)')"
  echo "command: bash scripts/gpu-mooncake-table.sh --part $part $([[ $quick -eq 1 ]] && echo --quick) ${extra[*]}"
  echo "machine: $machine; CPUs: $(nproc)"
  grep -E 'MemTotal|MemAvailable' /proc/meminfo
  [[ $gpus -gt 0 ]] && nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv 2>&1
  cat "$repo/gpu-mooncake/BUNDLE_INFO" 2>/dev/null
} > "$out/env_$part.txt"

limit="${KVLINK_TABLE_TIMEOUT:-570}"
# One limit for the whole part, however many runs it makes (the procs part makes up to seven):
# each run gets what is left of it, so the part ends, and prints its summary, inside the
# device command's time.
part_deadline=$(( $(date +%s) + limit ))
run_bundle() { # $1: storage nodes; the rest: the command
  local nodes="$1"; shift
  local left=$(( part_deadline - $(date +%s) ))
  if (( left < 5 )); then
    echo "gpu-mooncake-table: the part's ${limit} s are spent; not run: $*" >&2
    return 124
  fi
  timeout -k 15 "$left" bash "$repo/scripts/gpu-mooncake-run.sh" --storage-nodes "$nodes" -- "$@"
}

modes_bin="${KVLINK_TABLE_MODES_BIN:-mooncake_modes}"
modes_flags=(--machine "$machine" --out "$out" --budget-s "${KVLINK_TABLE_BUDGET:-520}")
if [[ $quick -eq 1 ]]; then
  modes_flags+=(--tokens 2048 --tp 2,4 --reps 1 --auto-runs 1)
else
  modes_flags+=(--tokens "${KVLINK_TABLE_TOKENS:-32768,131072}" --tp "${KVLINK_TABLE_TP:-2,4,8}"
                --reps "${KVLINK_TABLE_REPS:-2}" --auto-runs "${KVLINK_TABLE_AUTO_RUNS:-2}")
fi

rc=0
case "$part" in
  host)
    export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-8 GB}"
    run_bundle 1 "$modes_bin" --pools host "${modes_flags[@]}" "${extra[@]}" \
      > "$out/host.stdout.log" 2> "$out/host.stderr.log" || rc=$?
    ;;
  nodes)
    export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-3 GB}"
    run_bundle "${KVLINK_TABLE_NODES:-4}" "$modes_bin" --pools host "${modes_flags[@]}" "${extra[@]}" \
      > "$out/nodes.stdout.log" 2> "$out/nodes.stderr.log" || rc=$?
    ;;
  device)
    export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-8 GB}"
    if [[ $gpus -ge 2 ]]; then pools="gpu,nccl"; elif [[ $gpus -eq 1 ]]; then pools="gpu"; else pools="cpu"; fi
    run_bundle 1 "$modes_bin" --pools "$pools" "${modes_flags[@]}" "${extra[@]}" \
      > "$out/device.stdout.log" 2> "$out/device.stderr.log" || rc=$?
    ;;
  reads)
    export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-4 GB}"
    if [[ $quick -eq 1 ]]; then
      flags=(--tokens 2048 --rounds 1 --groups 78 --parallel 2 --lanes 8 --streams 1,8 --store-groups 78
             --compute-us 0 --linker-compute-us 0,5480 --linker-verify-threads 0 --linker-as-landed on --linker-companions every-load,at-lookup,at-lookup-pin-at-load)
    else
      flags=(--tokens 32768 --rounds 5 --groups 8,26,78 --parallel 8 --lanes 8 --streams 4,8
             --store-groups 26,78 --compute-us 0 --linker-compute-us 0,5760 --linker-verify-threads 0 --linker-as-landed on --linker-companions every-load,at-lookup,at-lookup-pin-at-load)
    fi
    tag=$([[ $quick -eq 1 ]] && echo 2k || echo 32k)
    read_rc=0
    run_bundle 1 mooncake_read "${flags[@]}" "${extra[@]}" \
      > "$out/reads.stdout.log" 2> "$out/reads.stderr.log" || read_rc=$?
    [[ $read_rc -eq 0 ]] || rc=$read_rc
    {
      echo "# One Mooncake client reads GLM-5.2 FP8 objects ($tag tokens): the wheel's Python client against kvlink, same run"
      echo
      echo "Command: bash scripts/gpu-mooncake-table.sh --part reads$([[ $quick -eq 1 ]] && echo ' --quick') ($(date -u +%Y-%m-%d), $machine, $(nproc) CPUs, one storage node over TCP loopback)."
      echo
      cat "$out/reads.stdout.log"
      # mooncake_read compares every variant's bytes and every Linker pool with the objects in
      # round 1, ends with its count of those checks, and exits non-zero on a mismatch (or any
      # failure). A run that ended without its count (killed, an older build), or that exited
      # non-zero after a count of no failure (a crash past it), is one failure more.
      last=$(tail -n 1 "$out/reads.stdout.log")
      if ! grep -Eq '^[0-9]+ passed, [0-9]+ failed$' <<< "$last" \
         || { [[ $read_rc -ne 0 ]] && grep -Eq ' 0 failed$' <<< "$last"; }; then
        echo
        echo "mooncake_read ended (exit $read_rc) without a count of checks that says so:"
        echo "0 passed, 1 failed"
      fi
    } > "$out/mooncake_read_${machine}_${tag}.md"
    ;;
  procs)
    # glm_prefill's processes mode (issue 14: one process per rank, a rendezvous, socket
    # collectives, each rank its own Mooncake client): run when this build has it.
    # A help that did not run (no bundle, a master that did not start, no binary) fails the
    # part: it must not read as a build without processes mode, which passes with nothing run.
    help_rc=0
    help=$(run_bundle 1 glm_prefill --help 2> "$out/procs.help.stderr.log") || help_rc=$?
    if [[ $help_rc -ne 0 ]]; then
      echo "procs: glm_prefill --help failed (exit $help_rc, $out/procs.help.stderr.log): nothing run" \
        | tee "$out/procs.stdout.log"
      tail -n 20 "$out/procs.help.stderr.log" >&2
      rc=$help_rc
    elif grep -- '--ranks-as' <<< "$help" > /dev/null; then
      export MOONCAKE_STORAGE_NODE_SEGMENT="${MOONCAKE_STORAGE_NODE_SEGMENT:-4 GB}"
      if [[ $quick -eq 1 ]]; then tokens=2048; tps="2 4"; else tokens=32768; tps="2 4 8"; fi
      # One prefix size from KVLINK_TABLE_TOKENS (its first), with the modelled compute of that
      # size.
      if [[ -n "${KVLINK_TABLE_TOKENS:-}" ]]; then
        tokens="${KVLINK_TABLE_TOKENS%%,*}"
        [[ $tokens -ge 131072 ]] && export MOONCAKE_STORAGE_NODE_SEGMENT="${KVLINK_PROCS_SEGMENT:-9 GB}"
      fi
      # shellcheck source=scripts/modelled-compute.sh
      source "$repo/scripts/modelled-compute.sh"
      compute=$(modelled_compute_us "$tokens") || exit 2
      tps="${KVLINK_TABLE_TP:-$tps}"; tps="${tps//,/ }"
      tag=$((tokens / 1024))k
      : > "$out/procs.stdout.log"
      for tp in $tps; do
        file="$out/glm_prefill_procs_${machine}_tp${tp}_${tag}_n1.md"
        {
          echo "# glm_prefill, TP $tp ranks as processes, Mooncake (one storage node), $tag tokens"
          echo
          echo "Command: ${KVLINK_TABLE_TOKENS:+KVLINK_TABLE_TOKENS=$KVLINK_TABLE_TOKENS }${KVLINK_TABLE_TP:+KVLINK_TABLE_TP=$KVLINK_TABLE_TP }bash scripts/gpu-mooncake-table.sh --part procs$([[ $quick -eq 1 ]] && echo ' --quick') ($(date -u +%Y-%m-%d), $machine); compute per layer SIMULATED ${compute} µs (the modelled compute at $tag)."
          echo
          echo '```'
        } > "$file"
        one=0
        run_bundle 1 glm_prefill --store mooncake --ranks-as processes --mode compare --tp "$tp" \
          --tokens "$tokens" --compute-us "$compute" --svg "/tmp/glm_prefill_procs_tp$tp.svg" "${extra[@]}" \
          >> "$file" 2>> "$out/procs.stderr.log" || one=$?
        [[ $one -eq 0 ]] || rc=$one
        # Auto again, alone: a second glm_prefill run (it saves the prefix again, the objects
        # already present are skipped, and Auto calibrates afresh); the two picks are compared
        # below (a disagreement counts as a failed check).
        {
          echo '```'
          echo
          echo "## Auto, second run (\`glm_prefill --mode auto\`, same flags)"
          echo
          echo '```'
        } >> "$file"
        two=0
        run_bundle 1 glm_prefill --store mooncake --ranks-as processes --mode auto --tp "$tp" \
          --tokens "$tokens" --compute-us "$compute" "${extra[@]}" \
          >> "$file" 2>> "$out/procs.stderr.log" || two=$?
        [[ $two -eq 0 ]] || rc=$two
        {
          echo '```'
          echo
          echo "glm_prefill exit status: compare $one, Auto again $two (0: every mode loaded and every rank's pool verified)"
          echo
          passed=0; failed=0
          for x in $one $two; do if [[ $x -eq 0 ]]; then passed=$((passed + 1)); else failed=$((failed + 1)); fi; done
          # The two runs' picks (rank 0's "Auto keeps X" in each run's Auto line).
          picks=$(grep '^  Auto chose ' "$file" | grep -o 'Auto keeps [A-Za-z0-9]*' | awk '{print $3}' | paste -sd' ' -)
          if [[ $(wc -w <<< "$picks") -eq 2 && $(tr ' ' '\n' <<< "$picks" | sort -u | wc -l) -eq 1 ]]; then
            echo "Auto's picks agree: $picks"; passed=$((passed + 1))
          else
            echo "Auto's picks do not agree (or a run kept none): ${picks:-none}"; failed=$((failed + 1))
          fi
          echo
          echo "$passed passed, $failed failed"
        } >> "$file"
        cat "$file" >> "$out/procs.stdout.log"
      done
    else
      echo "procs: this build's glm_prefill has no processes mode (--ranks-as); nothing to run" | tee "$out/procs.stdout.log"
    fi
    ;;
esac

cat "$out/env_$part.txt"
echo "== stderr (last 40 lines; full log: $out/$part.stderr.log)"
tail -n 40 "$out/$part.stderr.log" 2>/dev/null
[[ $rc -eq 124 || $rc -eq 137 ]] && echo "== stopped after $limit s: the tables of the sizes that finished are in $out"
echo "== exit status $rc; output:"
cat "$out/$part.stdout.log" 2>/dev/null
echo "== files in $out:"
ls -l "$out"
exit "$rc"
