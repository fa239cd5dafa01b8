# Sourced by the GPU-host scripts: GLM-5.2's prefill compute per layer for a 4096-token
# uncached suffix after a cached prefix of N tokens, at the H200's dense BF16 rate, in µs (the
# model `mooncake_modes` prints in full; these are its values for the prefix sizes the scripts
# run). `modelled_compute_us N` prints it, or fails for a size it has no value for.
modelled_compute_us() {
  case "$1" in
    2048) echo 5480 ;;
    32768) echo 5760 ;;
    131072) echo 6660 ;;
    *) echo "no modelled compute for $1 tokens (2048, 32768, 131072)" >&2; return 1 ;;
  esac
}
