#!/usr/bin/env bash
# Packs, HERE (Debian 12), what a real Mooncake needs on the GPU machine into gpu-mooncake/ at
# the repo root (ignored by git), to be carried there with the working tree; on the GPU machine
# scripts/gpu-mooncake-run.sh unpacks it and runs a command next to a master and storage nodes.
#
# Usage: scripts/gpu-mooncake-bundle.sh [--no-py312] [--no-bins]
#   --no-py312  leave out the wheel's Python client for CPython 3.12 (the GPU machine's python3),
#               which the Python baselines of the benches need
#   --no-bins   leave out the release mooncake_read, glm_prefill and mooncake_modes examples (bin/)
#
# Why: the GPU machine (Ubuntu 24.04, glibc 2.39) has no network, no `ip` (iproute2) and no
# libpython3.11, which the cp311 wheel's store.so (and so kvlink's shim) links; it has
# libibverbs, libnuma, libcurl, glibc. What may travel there is limited to 64 MiB in all, GPU
# binaries (gpu-bin/, 20-30 MB) included, so the bundle must stay under MAX_MIB (34).
#
# Bundle (gpu-mooncake/mooncake-bundle.tar.xz, unpacked on the GPU machine):
#   mc/                      a KVLINK_MOONCAKE_DIR: wheel/mooncake/{store.so, mooncake_master,
#                            mooncake_client, libasio.so, libetcd_wrapper.so},
#                            wheel/mooncake_transfer_engine_non_cuda.libs/, lib/libkvlink_mooncake.so
#   pylib/                   libpython3.11.so.1.0 (Debian 12's; LD_LIBRARY_PATH, for the shim)
#   iproute/                 /usr/sbin/ip and the libraries it needs beyond glibc and zlib;
#                            bin/ip is a wrapper that gives only `ip` that library path
#   py312/mooncake/          the cp312 build of the same wheel version's Python client: store.so,
#                            __init__.py, buffer_pool.py; the rest links to mc/ (identical files)
#   bin/                     mooncake_read, glm_prefill, and mooncake_modes built with --features
#                            cuda (device pools; cudarc loads CUDA at run time) (release, stripped)
#   BUNDLE_INFO              versions, sha256 of the wheels, the commit
# Output: gpu-mooncake/mooncake-bundle.tar.xz and gpu-mooncake/BUNDLE_INFO (a copy).
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/mooncake-common.sh
source "$here/mooncake-common.sh"

MAX_MIB=34
# The cp312 wheel of the pinned version (same build: every library and binary but store.so is
# byte-identical to the cp311 wheel's, checked below).
PY312_WHEEL_FILE="mooncake_transfer_engine_non_cuda-0.3.13.post1-cp312-cp312-manylinux_2_28_x86_64.whl"
PY312_WHEEL_SHA256="892fd0ee77d736fc8d625981c485a43282dbdbc0926b95f05c1cadd8b0debe51"

py312=1
bins=1
for arg in "$@"; do
  case "$arg" in
    --no-py312) py312=0 ;;
    --no-bins) bins=0 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) mc_die "unknown argument: $arg" ;;
  esac
done

out="$MC_REPO/gpu-mooncake"
stage="$(mktemp -d "${TMPDIR:-/tmp}/kvlink-mc-bundle.XXXXXX")"
trap 'rm -rf "$stage"' EXIT

# 1. The cp311 wheel and the shim (idempotent).
bash "$here/mooncake-build-shim.sh" >/dev/null

# 2. mc/: the wheel's binaries and libraries, and the shim.
mkdir -p "$stage/mc/wheel/mooncake" "$stage/mc/lib"
for f in store.so mooncake_master mooncake_client libasio.so libetcd_wrapper.so; do
  cp -p "$MC_BIN_DIR/$f" "$stage/mc/wheel/mooncake/"
done
cp -rp "$MC_WHEEL_DIR/mooncake_transfer_engine_non_cuda.libs" "$stage/mc/wheel/"
cp -p "$MC_SHIM" "$stage/mc/lib/"

# 3. pylib/: Debian's libpython3.11 (it needs only glibc, zlib and expat, which Ubuntu has).
libpython="$(/sbin/ldconfig -p | awk -v so="$MC_PYTHON_SONAME" '$1 == so && /x86-64/ && !found {print $NF; found = 1}')"
[[ -n "$libpython" ]] || mc_die "$MC_PYTHON_SONAME not found by ldconfig"
mkdir -p "$stage/pylib"
cp -L "$libpython" "$stage/pylib/$MC_PYTHON_SONAME"

# 4. iproute/: ip and what it links beyond glibc and zlib, behind a wrapper that sets the
#    library path for ip alone (Debian's older libraries must not shadow the host's for others).
ip_bin="$(command -v ip || echo /usr/sbin/ip)"
[[ -x "$ip_bin" ]] || mc_die "no ip here (apt-get install iproute2)"
mkdir -p "$stage/iproute/lib" "$stage/iproute/bin"
cp -L "$ip_bin" "$stage/iproute/ip.real"
ldd "$ip_bin" | awk '/=> \// {print $1, $3}' | while read -r soname path; do
  case "$soname" in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libz.so.*) ;;
    *) cp -L "$path" "$stage/iproute/lib/$soname" ;;
  esac
done
cat >"$stage/iproute/bin/ip" <<'WRAP'
#!/usr/bin/env bash
# iproute2's ip from Debian 12, with its own libraries (and only for itself).
d="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LD_LIBRARY_PATH="$d/lib" exec "$d/ip.real" "$@"
WRAP
chmod +x "$stage/iproute/bin/ip"

# 5. py312/: the cp312 wheel's Python client (same version); everything it shares with the
#    cp311 wheel is linked, not copied.
if [[ $py312 -eq 1 ]]; then
  whl="$MC_DIR/dl/$PY312_WHEEL_FILE"
  have_sha() { [[ -f "$whl" ]] && echo "$PY312_WHEEL_SHA256  $whl" | sha256sum --check --status; }
  if ! have_sha; then
    rm -f "$whl"
    mc_log "downloading $MC_WHEEL_PACKAGE==$MC_WHEEL_VERSION (cp312, ~46 MB)"
    "${MOONCAKE_PYTHON:-python3}" -m pip download --quiet --no-deps --disable-pip-version-check \
      "$MC_WHEEL_PACKAGE==$MC_WHEEL_VERSION" --python-version 3.12 --implementation cp \
      --abi cp312 --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$MC_DIR/dl"
    have_sha || mc_die "sha256 of $whl does not match the pin $PY312_WHEEL_SHA256"
  fi
  unz="$stage/.py312-wheel"
  unzip -q "$whl" 'mooncake/*' 'mooncake_transfer_engine_non_cuda.libs/*' -d "$unz"
  for f in mooncake_master mooncake_client libasio.so libetcd_wrapper.so; do
    cmp -s "$unz/mooncake/$f" "$stage/mc/wheel/mooncake/$f" || mc_die "cp312 wheel's $f differs from cp311's"
  done
  for f in "$unz"/mooncake_transfer_engine_non_cuda.libs/*; do
    cmp -s "$f" "$stage/mc/wheel/mooncake_transfer_engine_non_cuda.libs/$(basename "$f")" \
      || mc_die "cp312 wheel's $(basename "$f") differs from cp311's"
  done
  mkdir -p "$stage/py312/mooncake"
  cp -p "$unz/mooncake/store.so" "$unz/mooncake/__init__.py" "$unz/mooncake/buffer_pool.py" \
    "$stage/py312/mooncake/"
  ln -s ../../mc/wheel/mooncake/libasio.so "$stage/py312/mooncake/libasio.so"
  ln -s ../../mc/wheel/mooncake/libetcd_wrapper.so "$stage/py312/mooncake/libetcd_wrapper.so"
  ln -s ../mc/wheel/mooncake_transfer_engine_non_cuda.libs \
    "$stage/py312/mooncake_transfer_engine_non_cuda.libs"
  rm -rf "$unz"
fi

# 6. bin/: the benches, built here (the reference table's binary with the CUDA backend, which
#    builds without a toolkit: cudarc loads libcuda and NCCL at run time).
if [[ $bins -eq 1 ]]; then
  (cd "$MC_REPO" && cargo build --release --example mooncake_read --example glm_prefill \
    && cargo build --release --features cuda --example mooncake_modes)
  mkdir -p "$stage/bin"
  for b in mooncake_read glm_prefill mooncake_modes; do
    cp "$MC_REPO/target/release/examples/$b" "$stage/bin/"
    strip "$stage/bin/$b"
  done
fi

{
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  # Staged and untracked source count as changes too (as gpu-build.sh says them).
  changes=$(git -C "$MC_REPO" status --porcelain --untracked-files=normal -- . ':!gpu-mooncake' ':!gpu-bin' 2>/dev/null || echo unknown)
  echo "commit: $(git -C "$MC_REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)${changes:+ (+ uncommitted changes)}"
  echo "wheel: $MC_WHEEL_PACKAGE==$MC_WHEEL_VERSION cp311 sha256 $MC_WHEEL_SHA256"
  [[ $py312 -eq 1 ]] && echo "py312: $PY312_WHEEL_FILE sha256 $PY312_WHEEL_SHA256"
  echo "libpython: $libpython ($(dpkg-query -W -f='${Version}' libpython3.11 2>/dev/null || echo '?'))"
  echo "ip: $ip_bin ($(dpkg-query -W -f='${Version}' iproute2 2>/dev/null || echo '?'))"
  echo "unpacked bytes: $(du -sb "$stage" | cut -f1)"
} >"$stage/BUNDLE_INFO"

# 7. One xz stream with a dictionary large enough (-9: 64 MiB) to share the near-identical
#    copies (libetcd_wrapper twice, store.so for two CPythons).
mkdir -p "$out"
tmp_out="$out/.mooncake-bundle.tar.xz.tmp"
tar -C "$stage" --owner=0 --group=0 --sort=name -cf - . | xz -9 -T1 -c >"$tmp_out"
mv -f "$tmp_out" "$out/mooncake-bundle.tar.xz"
cp "$stage/BUNDLE_INFO" "$out/BUNDLE_INFO"
size=$(stat -c %s "$out/mooncake-bundle.tar.xz")
echo "sha256: $(sha256sum "$out/mooncake-bundle.tar.xz" | cut -d' ' -f1)" >>"$out/BUNDLE_INFO"
if (( size > MAX_MIB * 1024 * 1024 )); then
  mc_die "the bundle is $size bytes (> $MAX_MIB MiB): it and the GPU binaries would not fit in 64 MiB"
fi
mc_log "ok: $out/mooncake-bundle.tar.xz ($(( size / 1024 )) KiB); on the GPU machine: bash scripts/gpu-mooncake-run.sh [--storage-nodes N] -- CMD (carry gpu-mooncake)"
