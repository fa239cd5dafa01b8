# Sourced by the GPU-host scripts: `kvlink_machine` prints the name their result files carry,
# "h200x1" from the first GPU's model and the GPU count, or without a GPU KVLINK_MACHINE if set,
# else "cpu<cores>"; `kvlink_gpus` prints the GPU count (0 without nvidia-smi).
kvlink_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

kvlink_machine() {
  local gpus name model
  gpus=$(kvlink_gpus)
  if [[ $gpus -gt 0 ]]; then
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    model=$(echo "$name" | tr ' ' '\n' | grep -m1 '[0-9]' | tr '[:upper:]' '[:lower:]')
    echo "${model:-gpu}x$gpus"
  else
    echo "${KVLINK_MACHINE:-cpu$(nproc)}"
  fi
}
