#!/usr/bin/env bash
# Runs CMD next to a real Mooncake master (and optionally a storage node), all on 127.0.0.1 inside
# a private network namespace, then stops exactly the processes it started and returns CMD's exit
# status.
#
# Usage: scripts/with-mooncake.sh [--storage-node | --storage-nodes N] [--print-env] [--] CMD [ARG...]
#   --storage-node     also start one `mooncake_client` storage node (MOONCAKE_STORAGE_NODE_SEGMENT,
#                      default "1 GB", each)
#   --storage-nodes N  start N of them (ports MOONCAKE_STORAGE_NODE_PORT, default 50052, and up);
#                      the master spreads objects over their segments
#   --print-env     print the environment CMD would get and exit (starts nothing)
#
# Why a network namespace: some Mooncake listeners bind the wildcard address whatever
# their flags say (the Transfer Engine data port [::]:15000-17000, its handshake port 0.0.0.0).
# `unshare -n` gives this script and everything it starts a namespace whose only interface is
# `lo`, so nothing is reachable from outside the machine. The caller's own network is untouched.
# Needs root (or unprivileged user namespaces: then `unshare -rn` is used).
#
# Environment CMD gets (what the tests and MooncakeConfig::from_env read):
#   MOONCAKE_MASTER=127.0.0.1:<port>   MOONCAKE_PROTOCOL=tcp   MOONCAKE_DEVICE=
#   MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE   MOONCAKE_LOCAL_HOSTNAME=127.0.0.1
#   MOONCAKE_GLOBAL_SEGMENT_SIZE (default 512 MiB)   MOONCAKE_LOCAL_BUFFER_SIZE (default 64 MiB)
#   MOONCAKE_STORE_LIBRARY=<shim>   MC_TCP_BIND_ADDRESS=127.0.0.1   MC_LOG_LEVEL (default ERROR)
#   MOONCAKE_MASTER_BIN / MOONCAKE_CLIENT_BIN (for tests that run their own master)
#   MOONCAKE_PYTHON / MOONCAKE_PYTHONPATH (the wheel's Python client, for interop tests; both
#   kept when set, e.g. to a cp312 build of the same wheel version)
#   MOONCAKE_STORAGE_NODES (how many storage nodes were started)
#   MOONCAKE_MASTER_METRICS=127.0.0.1:<port>   MOONCAKE_MASTER_PID
#
# Tunables: MOONCAKE_MASTER_PORT (50051), MOONCAKE_MASTER_METRICS_PORT (9003),
#   MOONCAKE_MASTER_ARGS (extra master flags), MOONCAKE_READY_TIMEOUT (seconds, 30),
#   MOONCAKE_KEEP_LOGS=1 (keep $KVLINK_MOONCAKE_DIR/run/<id>/ logs even when CMD succeeds).
set -euo pipefail
# shellcheck source=scripts/mooncake-common.sh
source "$(dirname "${BASH_SOURCE[0]}")/mooncake-common.sh"

storage_nodes=0
print_env=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --storage-node) storage_nodes=1; shift ;;
    --storage-nodes)
      [[ "${2:-}" =~ ^[1-9][0-9]*$ ]] || mc_die "--storage-nodes needs a count >= 1"
      storage_nodes="$2"; shift 2 ;;
    --print-env) print_env=1; shift ;;
    -h|--help) sed -n '2,34p' "$0"; exit 0 ;;
    --) shift; break ;;
    -*) mc_die "unknown option: $1" ;;
    *) break ;;
  esac
done

master_port="${MOONCAKE_MASTER_PORT:-50051}"
metrics_port="${MOONCAKE_MASTER_METRICS_PORT:-9003}"

mc_env() {
  cat <<ENV
MOONCAKE_MASTER=127.0.0.1:$master_port
MOONCAKE_MASTER_METRICS=127.0.0.1:$metrics_port
MOONCAKE_PROTOCOL=tcp
MOONCAKE_DEVICE=
MOONCAKE_TE_META_DATA_SERVER=P2PHANDSHAKE
MOONCAKE_LOCAL_HOSTNAME=127.0.0.1
MOONCAKE_GLOBAL_SEGMENT_SIZE=${MOONCAKE_GLOBAL_SEGMENT_SIZE:-536870912}
MOONCAKE_LOCAL_BUFFER_SIZE=${MOONCAKE_LOCAL_BUFFER_SIZE:-67108864}
MOONCAKE_STORE_LIBRARY=${MOONCAKE_STORE_LIBRARY:-$MC_SHIM}
MOONCAKE_MASTER_BIN=$MC_BIN_DIR/mooncake_master
MOONCAKE_CLIENT_BIN=$MC_BIN_DIR/mooncake_client
MOONCAKE_PYTHON=${MOONCAKE_PYTHON:-python3}
MOONCAKE_PYTHONPATH=${MOONCAKE_PYTHONPATH:-$MC_WHEEL_DIR}
MOONCAKE_STORAGE_NODES=$storage_nodes
MC_TCP_BIND_ADDRESS=127.0.0.1
MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
ENV
}

if [[ $print_env -eq 1 ]]; then
  mc_env | sed 's/^/export /'
  exit 0
fi
[[ $# -gt 0 ]] || mc_die "no command given (usage: scripts/with-mooncake.sh [--storage-node] [--] CMD...)"
[[ -x "$MC_BIN_DIR/mooncake_master" ]] || mc_die "no $MC_BIN_DIR/mooncake_master: run scripts/mooncake-build-shim.sh first"

# 1. Enter a private network namespace (once): re-run this script under unshare.
if [[ "${KVLINK_MC_IN_NETNS:-}" != 1 ]]; then
  command -v unshare >/dev/null || mc_die "unshare not found (apt-get install util-linux)"
  flags=(--net)
  [[ $(id -u) -eq 0 ]] || flags=(--map-root-user --net)
  args=()
  [[ $storage_nodes -gt 0 ]] && args+=(--storage-nodes "$storage_nodes")
  # exec: unshare replaces this shell, so the caller's signals reach the script directly.
  exec env KVLINK_MC_IN_NETNS=1 unshare "${flags[@]}" -- bash "$0" "${args[@]}" -- "$@"
fi

# 2. Inside the namespace: only lo, and up.
unset KVLINK_MC_IN_NETNS
ip link set lo up
others="$(ip -o link show | awk -F': ' '$2 != "lo" {print $2}')"
[[ -z "$others" ]] || mc_die "network namespace has interfaces besides lo: $others"

run_dir="$MC_DIR/run/$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$run_dir"
pids=()

stop_started() {
  local pid i
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do
    for ((i = 0; i < 50; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      mc_log "pid $pid did not stop on SIGTERM within 5 s: SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
  pids=()
}
trap stop_started EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

wait_port() { # $1 port, $2 pid, $3 name, $4 log
  local deadline=$((SECONDS + ${MOONCAKE_READY_TIMEOUT:-30}))
  while ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; do
    if ! kill -0 "$2" 2>/dev/null; then
      tail -n 30 "$4" >&2 || true
      mc_die "$3 (pid $2) exited before listening on 127.0.0.1:$1; log: $4"
    fi
    if ((SECONDS >= deadline)); then
      tail -n 30 "$4" >&2 || true
      mc_die "$3 not listening on 127.0.0.1:$1 after ${MOONCAKE_READY_TIMEOUT:-30} s; log: $4"
    fi
    sleep 0.1
  done
}

# 3. The master (metadata only; no data goes through it).
export MC_TCP_BIND_ADDRESS=127.0.0.1 MC_LOG_LEVEL="${MC_LOG_LEVEL:-ERROR}"
# shellcheck disable=SC2086 # MOONCAKE_MASTER_ARGS is a list of flags
"$MC_BIN_DIR/mooncake_master" \
  --rpc_address=127.0.0.1 --rpc_port="$master_port" \
  --metrics_host=127.0.0.1 --metrics_port="$metrics_port" \
  --enable_http_metadata_server=false \
  ${MOONCAKE_MASTER_ARGS:-} >"$run_dir/master.log" 2>&1 &
master_pid=$!
pids+=("$master_pid")
wait_port "$master_port" "$master_pid" mooncake_master "$run_dir/master.log"
wait_port "$metrics_port" "$master_pid" "mooncake_master metrics" "$run_dir/master.log"
mc_log "mooncake_master pid $master_pid on 127.0.0.1:$master_port (log $run_dir/master.log)"

# 4. Optional storage nodes.
node_pids=()
for ((n = 0; n < storage_nodes; n++)); do
  node_port=$(( ${MOONCAKE_STORAGE_NODE_PORT:-50052} + n ))
  node_log="$run_dir/storage-node-$n.log"
  "$MC_BIN_DIR/mooncake_client" --host=127.0.0.1 --port="$node_port" \
    --global_segment_size="${MOONCAKE_STORAGE_NODE_SEGMENT:-1 GB}" \
    --metadata_server=P2PHANDSHAKE --master_server_address="127.0.0.1:$master_port" \
    --protocol=tcp >"$node_log" 2>&1 &
  node_pids+=($!)
  pids+=($!)
  wait_port "$node_port" "${node_pids[-1]}" mooncake_client "$node_log"
  mc_log "mooncake_client storage node pid ${node_pids[-1]} on 127.0.0.1:$node_port"
done

# 5. The command, with the environment.
while IFS= read -r line; do export "${line?}"; done < <(mc_env)
export MOONCAKE_MASTER_PID="$master_pid"
mc_env | sed 's/^/[mooncake] env: /' >&2
# In the background, in a process group of its own (job control on for its start), waited
# for: a signal to this script reaches its trap at once (a foreground command held the trap
# until it ended), and the trap stops the command's whole group (cargo and the test binaries
# it runs), then the master and nodes. With job control the command does not ignore SIGINT;
# its stdin is /dev/null (a background job reading the terminal would stop; the tests read
# none).
set +e
cmd_pid=
stop_group() { # $1 the command's pid (its process group's id), $2 "reaped" once waited for
  local pid=$1 i
  # A reaped command's pid may belong to another process by now: its group alone is signalled.
  if [[ "${2:-}" == reaped ]]; then
    kill -TERM -- "-$pid" 2>/dev/null || true
  else
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  fi
  # The whole group gets the grace (cargo may end at once, its test binaries later).
  for ((i = 0; i < 100; i++)); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
  kill -KILL -- "-$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
}
stop_command() { # $1 exit status
  # A signal between the start and `cmd_pid=$!` finds the command as the last job ($!).
  local pid=${cmd_pid:-$!}
  if [[ -n "$pid" ]]; then stop_group "$pid"; fi
  exit "$1"
}
trap 'stop_command 130' INT
trap 'stop_command 143' TERM
set -m
"$@" </dev/null &
cmd_pid=$!
set +m
wait "$cmd_pid"
status=$?
trap 'exit 130' INT
trap 'exit 143' TERM
# Anything the command left running in its group is stopped with it (the same grace, then
# KILL: a leftover that ignores TERM must not outlive the master and nodes stopped below).
stop_group "$cmd_pid" reaped
set -e
stop_started
trap - EXIT
mc_log "command exited with $status; stopped $master_pid${node_pids[*]:+ ${node_pids[*]}}"
# Logs are kept when something failed (or MOONCAKE_KEEP_LOGS=1).
if [[ $status -eq 0 && "${MOONCAKE_KEEP_LOGS:-0}" != 1 ]]; then rm -rf "$run_dir"; fi
exit "$status"
