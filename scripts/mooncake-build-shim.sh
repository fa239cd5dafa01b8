#!/usr/bin/env bash
# Downloads the pinned Mooncake wheel, unpacks it and builds the kvlink shim
# (crates/mooncake-sys/csrc/shim.cpp) into $KVLINK_MOONCAKE_DIR/lib/libkvlink_mooncake.so.
#
# Usage: scripts/mooncake-build-shim.sh [--force]
#   --force   rebuild the shim even if it is newer than its sources
# Needs: python3 with pip, unzip, g++ >= 12 (-std=c++20), libpython3.11 (scripts/mooncake-env.sh
# install puts them there). Idempotent: a verified wheel and an up-to-date shim are reused.
# Prints the shim's path on stdout (last line).
set -euo pipefail
# shellcheck source=scripts/mooncake-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/mooncake-common.sh"

force=0
for arg in "$@"; do
  case "$arg" in
    --force) force=1 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) mc_die "unknown argument: $arg" ;;
  esac
done

py="${MOONCAKE_PYTHON:-python3}"
csrc="$MC_REPO/crates/mooncake-sys/csrc"
mkdir -p "$MC_DIR/dl" "$MC_DIR/lib"

# 1. The wheel, checked against the pinned sha256.
whl="$MC_DIR/dl/$MC_WHEEL_FILE"
have_sha() { [[ -f "$whl" ]] && echo "$MC_WHEEL_SHA256  $whl" | sha256sum --check --status; }
if ! have_sha; then
  rm -f "$whl"
  mc_log "downloading $MC_WHEEL_PACKAGE==$MC_WHEEL_VERSION (cp311, ~46 MB)"
  "$py" -m pip download --quiet --no-deps --disable-pip-version-check \
    "$MC_WHEEL_PACKAGE==$MC_WHEEL_VERSION" \
    --python-version 3.11 --implementation cp --abi cp311 \
    --platform manylinux_2_28_x86_64 --only-binary=:all: -d "$MC_DIR/dl"
  have_sha || mc_die "sha256 of $whl does not match the pin $MC_WHEEL_SHA256"
fi

# 2. Unpacked in place (the wheel's RPATH is $ORIGIN-relative, so it runs from there).
stamp="$MC_WHEEL_DIR/.kvlink-unpacked-$MC_WHEEL_SHA256"
if [[ ! -f "$stamp" ]]; then
  mc_log "unpacking into $MC_WHEEL_DIR"
  rm -rf "$MC_WHEEL_DIR"
  unzip -q "$whl" -d "$MC_WHEEL_DIR"
  chmod +x "$MC_BIN_DIR/mooncake_master" "$MC_BIN_DIR/mooncake_client"
  touch "$stamp"
fi
[[ -f "$MC_BIN_DIR/store.so" ]] || mc_die "$MC_BIN_DIR/store.so missing after unpacking"

# 3. The shim.
libpython="$(/sbin/ldconfig -p | awk -v so="$MC_PYTHON_SONAME" '$1 == so && /x86-64/ && !found {print $NF; found = 1}')"
[[ -n "$libpython" ]] || mc_die "$MC_PYTHON_SONAME not found by ldconfig (apt-get install libpython3.11)"

check_shim() { # $1: the library to check
  local lib="$1" missing sym
  missing="$(ldd -r "$lib" 2>&1 | grep -E 'not found|undefined symbol' || true)"
  [[ -z "$missing" ]] || mc_die "unresolved dependencies of $lib (apt-get install libibverbs1?):
$missing"
  for sym in mooncake_store_create mooncake_store_setup mooncake_store_batch_get_into kvlink_mc_abi_info \
             kvlink_mc_batch_get_ranges kvlink_mc_batch_get_session_start kvlink_mc_batch_upsert_from kvlink_mc_setup; do
    nm -D --defined-only "$lib" | grep -w "$sym" >/dev/null || mc_die "$lib does not export $sym"
  done
  readelf -d "$lib" | grep "NEEDED.*\[$MC_PYTHON_SONAME\]" >/dev/null || mc_die "$lib does not NEED $MC_PYTHON_SONAME"
}

up_to_date=1
[[ $force -eq 0 && -f "$MC_SHIM" ]] || up_to_date=0
for dep in "$csrc/shim.cpp" "$csrc/mc_min.hpp" "$csrc/kvlink_mooncake.h" "$csrc/shim.map" "$stamp" "$0"; do
  [[ $up_to_date -eq 1 && "$MC_SHIM" -nt "$dep" ]] || up_to_date=0
done
if [[ $up_to_date -eq 1 ]]; then
  mc_log "shim up to date: $MC_SHIM"
else
  mc_log "compiling $MC_SHIM"
  tmp="$MC_DIR/lib/.libkvlink_mooncake.so.tmp.$$"
  trap 'rm -f "$tmp"' EXIT
  # The version script exports only mooncake_store_* and kvlink_mc_*.
  # -l:store.so: the wheel's file is not lib*.so and has no SONAME, so NEEDED is "store.so",
  # found through the RPATH. --no-as-needed keeps libpython NEEDED: store.so has undefined Py*
  # symbols that only libpython resolves.
  g++ -std=c++20 -O2 -g -fPIC -shared -Wall -Wextra -Werror \
    -DKVLINK_MC_WHEEL_VERSION="\"$MC_WHEEL_VERSION\"" \
    -DKVLINK_MC_PYTHON_SONAME="\"$MC_PYTHON_SONAME\"" \
    -I"$csrc" "$csrc/shim.cpp" -o "$tmp" \
    -Wl,-z,defs -Wl,--version-script="$csrc/shim.map" \
    -Wl,--disable-new-dtags -Wl,-rpath,'$ORIGIN/../wheel/mooncake' \
    -L"$MC_BIN_DIR" -Wl,--no-as-needed -l:store.so "$libpython" -ldl
  check_shim "$tmp"   # in lib/, so $ORIGIN/../wheel/mooncake resolves as for the final file
  mv -f "$tmp" "$MC_SHIM"
fi
check_shim "$MC_SHIM"
mc_log "ok: $MC_SHIM"
echo "$MC_SHIM"
