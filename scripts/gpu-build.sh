#!/usr/bin/env bash
# Builds the GPU binaries HERE (no GPU, no CUDA toolkit needed: cudarc loads libcuda, libnccl
# and libnvrtc at run time) into gpu-bin/ at the repo root, ready to be carried to the GPU
# machine, where scripts/gpu-run.sh runs them.
#
# Usage: scripts/gpu-build.sh               release build of the `gpu` test binary and of
#                                           examples/gpu_check, tp_gpu, tp_procs and glm_prefill
#                                           (--features cuda)
#        scripts/gpu-build.sh --regen-ptx   regenerate crates/kv-device/src/cuda/copy_rows.ptx
#                                           from copy_rows.cu with NVRTC 13.0 from PyPI
# Output: gpu-bin/gpu_tests (the `gpu` test target, tests/gpu/: the GPU checks as tests, built
# with feature `failpoints` so that its fault-injection checks run) and
# gpu-bin/gpu_check (benchmarks), run by scripts/gpu-run.sh; gpu-bin/tp_gpu (run with the TP tests by
# scripts/gpu-tp-run.sh), gpu-bin/tp_procs and gpu-bin/glm_prefill (run by
# scripts/gpu-procs-run.sh), stripped,
# gpu-bin/BUILD_INFO. Fails if gpu-bin/ exceeds 60 MiB or a binary needs glibc newer than 2.34
# (what the GPU machine was checked to run).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [[ "${1:-}" == "--regen-ptx" ]]; then
  tools="${KVLINK_NVRTC_DIR:-$PWD/target/nvrtc-cu13}"
  if [[ ! -e "$tools/nvidia/cu13/lib/libnvrtc.so.13" ]]; then
    python3 -m pip install --quiet --no-deps --target "$tools" "nvidia-cuda-nvrtc==13.0.*"
  fi
  lib="$tools/nvidia/cu13/lib"
  LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" python3 scripts/gen-ptx.py \
    "$lib/libnvrtc.so.13" crates/kv-device/src/cuda/copy_rows.cu crates/kv-device/src/cuda/copy_rows.ptx
  exit 0
fi

bins=(gpu_check tp_gpu tp_procs glm_prefill)
cargo build --release --features cuda "${bins[@]/#/--example=}"
# The GPU checks as tests: the test binary itself (its path has a hash; cargo names it).
tests_bin=$(cargo test --release --features cuda,failpoints --test gpu --no-run --message-format=json \
  | grep -o '"executable":"[^"]*"' | tail -1 | sed 's/"executable":"//; s/"$//')
if [[ ! -x "$tests_bin" ]]; then
  echo "gpu-build: the gpu test binary was not found (got '$tests_bin')" >&2
  exit 1
fi
rm -rf gpu-bin
mkdir -p gpu-bin
cp "$tests_bin" gpu-bin/gpu_tests
max_glibc=0
for b in gpu_tests "${bins[@]}"; do
  [[ "$b" == gpu_tests ]] || cp "target/release/examples/$b" gpu-bin/
  strip "gpu-bin/$b"
  # objdump must succeed (a failure is not "no glibc needed"); grep finding no versioned
  # glibc symbol (exit 1) means the binary needs none.
  syms=$(objdump -T "gpu-bin/$b")
  need=$( (grep -o 'GLIBC_[0-9.]*' <<< "$syms" || [[ $? -eq 1 ]]) | sed 's/GLIBC_//' | sort -Vu | tail -1)
  need=${need:-0}
  if [[ "$(printf '%s\n2.34\n' "$need" | sort -V | tail -1)" != "2.34" ]]; then
    echo "gpu-build: $b needs glibc $need (> 2.34): it may not run on the GPU machine" >&2
    exit 1
  fi
  max_glibc=$(printf '%s\n%s\n' "$max_glibc" "$need" | sort -V | tail -1)
done
size=$(du -sb gpu-bin | cut -f1)
if (( size > 60 * 1024 * 1024 )); then
  echo "gpu-build: gpu-bin/ is $size bytes (> 60 MiB)" >&2
  exit 1
fi
{
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  changes=$(git status --porcelain --untracked-files=normal -- . ':!gpu-bin' 2>/dev/null || echo unknown)
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)${changes:+ (+ uncommitted changes)}"
  echo "rustc: $(rustc --version)"
  echo "max glibc symbol: $max_glibc"
} > gpu-bin/BUILD_INFO
ls -l gpu-bin
echo "gpu-build: gpu-bin/ ready ($(( size / 1024 )) KiB); on the GPU machine: bash scripts/gpu-run.sh, scripts/gpu-tp-run.sh or scripts/gpu-procs-run.sh (carry gpu-bin)"
