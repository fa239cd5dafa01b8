# shellcheck shell=bash
# Shared settings of the Mooncake scripts (sourced, not run).
#
#   KVLINK_MOONCAKE_DIR   where the wheel is unpacked and the shim built (default: <repo>/.mooncake)
#   MOONCAKE_PYTHON       Python 3.11 used for `pip download` and the interop tests (default: python3)
#
# Layout under $KVLINK_MOONCAKE_DIR:
#   dl/<wheel>.whl                 the pinned wheel, sha256-checked
#   wheel/                         the unzipped wheel (a PYTHONPATH root: `import mooncake.store`)
#   wheel/mooncake/store.so        the C++ client, mooncake_master, mooncake_client, ...
#   lib/libkvlink_mooncake.so      the shim (RPATH $ORIGIN/../wheel/mooncake)
#   run/                           logs of scripts/with-mooncake.sh

MC_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MC_DIR="${KVLINK_MOONCAKE_DIR:-$MC_REPO/.mooncake}"

# The pin. Bumping it means re-checking crates/mooncake-sys/csrc/mc_min.hpp line by line.
MC_WHEEL_PACKAGE="mooncake-transfer-engine-non-cuda"
MC_WHEEL_VERSION="0.3.13.post1"
MC_WHEEL_FILE="mooncake_transfer_engine_non_cuda-0.3.13.post1-cp311-cp311-manylinux_2_28_x86_64.whl"
MC_WHEEL_SHA256="ca9f668a04ffe648b250fda28b97d0a7da149cb110dec5cf3d166a9e68afc940"
MC_PYTHON_SONAME="libpython3.11.so.1.0"

MC_WHEEL_DIR="$MC_DIR/wheel"
MC_BIN_DIR="$MC_WHEEL_DIR/mooncake"
MC_SHIM="$MC_DIR/lib/libkvlink_mooncake.so"

# Debian packages: runtime of the wheel (libibverbs1 is needed even for TCP), the shim's build,
# pip (for `pip download`) and the network-namespace tools.
MC_APT_PACKAGES=(libibverbs1 libnuma1 libcurl4 libpython3.11 python3 python3-pip g++ unzip iproute2 util-linux procps)

mc_log() { printf '[mooncake] %s\n' "$*" >&2; }
mc_die() { printf '[mooncake] error: %s\n' "$*" >&2; exit 1; }
