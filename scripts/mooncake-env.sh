#!/usr/bin/env bash
# Sets up what a real Mooncake needs on a Debian 12 machine, and prints the test environment.
#
# Usage:
#   scripts/mooncake-env.sh install     apt packages (libibverbs1, libpython3.11, g++, pip, ...;
#                                       needs root), then the pinned wheel and the shim
#                                       (scripts/mooncake-build-shim.sh)
#   scripts/mooncake-env.sh check       says what is missing, changes nothing (exit 1 if anything)
#   scripts/mooncake-env.sh env         prints the environment the tests read (as `export` lines)
#
# Servers are started by scripts/with-mooncake.sh, which runs a command next to a master on
# 127.0.0.1 inside a private network namespace and stops exactly what it started:
#   scripts/with-mooncake.sh cargo test -p mooncake-sys
#   scripts/with-mooncake.sh bash          # an interactive shell with a master running
#
# The wheel's Python client needs no install: PYTHONPATH=$MOONCAKE_PYTHONPATH python3 -c
# 'from mooncake.store import MooncakeDistributedStore' works from the unpacked wheel.
set -euo pipefail
here="$(dirname "${BASH_SOURCE[0]}")"
# shellcheck source=scripts/mooncake-common.sh
source "$here/mooncake-common.sh"

missing_packages() {
  local p
  for p in "${MC_APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || echo "$p"
  done
}

case "${1:-}" in
  install)
    mapfile -t need < <(missing_packages)
    if [[ ${#need[@]} -gt 0 ]]; then
      [[ $(id -u) -eq 0 ]] || mc_die "need root to apt-get install: ${need[*]}"
      mc_log "apt-get install ${need[*]}"
      export DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    fi
    bash "$here/mooncake-build-shim.sh"
    ;;
  check)
    status=0
    mapfile -t need < <(missing_packages)
    if [[ ${#need[@]} -gt 0 ]]; then mc_log "missing Debian packages: ${need[*]}"; status=1; fi
    if [[ ! -f "$MC_SHIM" ]]; then mc_log "missing shim $MC_SHIM (scripts/mooncake-build-shim.sh)"; status=1; fi
    if [[ ! -x "$MC_BIN_DIR/mooncake_master" ]]; then mc_log "missing $MC_BIN_DIR/mooncake_master"; status=1; fi
    [[ $status -eq 0 ]] && mc_log "ok: $MC_SHIM, $MC_BIN_DIR/mooncake_master"
    exit "$status"
    ;;
  env)
    exec bash "$here/with-mooncake.sh" --print-env
    ;;
  *)
    sed -n '2,18p' "$0"
    [[ "${1:-}" == -h || "${1:-}" == --help ]] && exit 0
    exit 2
    ;;
esac
