# Sourced by scripts/gpu-run.sh and scripts/gpu-tp-run.sh on the GPU machine: the loader path
# and environment the GPU binaries need.
#
# libcuda comes with the driver; libnccl.so is in /usr/lib/x86_64-linux-gnu. libnvrtc (for the
# run-time kernel compile; without it the PTX shipped in the binary is used) sits with the
# toolkit or in PyTorch's wheels: put what exists on the loader path.
nvrtc_dirs=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib /usr/local/cuda-13*/targets/x86_64-linux/lib; do
  [[ -e "$d/libnvrtc.so.13" || -e "$d/libnvrtc.so" ]] && nvrtc_dirs="$nvrtc_dirs:$d"
done
if [[ -z "$nvrtc_dirs" ]]; then
  nvrtc=$(find /opt /usr/local /usr/lib -maxdepth 9 -name 'libnvrtc.so.13*' -not -name '*builtins*' 2>/dev/null | head -1)
  [[ -n "$nvrtc" ]] && nvrtc_dirs=":$(dirname "$nvrtc")"
fi
export LD_LIBRARY_PATH="${nvrtc_dirs#:}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export RUST_BACKTRACE=1
# NVLink multicast stays off (KINDS.md: a program using it can put the host's shared GPUs out
# of service). kvlink never asks for it; keep it off regardless.
export NCCL_NVLS_ENABLE=0
