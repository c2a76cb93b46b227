#!/usr/bin/env bash
# Fault-tolerant training (docs/fault-tolerance.md): torchft replica groups, each one torchrun job
# (launch/torchrun.sh) restarted on its own when it dies, plus the torchft lighthouse they meet at.
#
#   launch/ft.sh CONFIG.yaml [key=value ...]
#
# Environment (defaults in brackets):
#   REPLICAS          replica groups in the run [2]
#   REPLICA_IDS       the groups this invocation runs, e.g. "2 3" on a second machine [all: 0 .. REPLICAS-1]
#   MIN_REPLICAS      groups a step needs to commit [1]; above REPLICAS / 2 no two halves of a
#                     partitioned cluster can both commit
#   LIGHTHOUSE        the lighthouse's address, http://HOST:PORT [unset: this script starts one here,
#                     on LIGHTHOUSE_PORT, starts it again whenever it dies, and stops it when the
#                     groups are done]
#   LIGHTHOUSE_PORT   [29510]
#   JOIN_TIMEOUT_MS   lighthouse: how long a quorum waits for heartbeating groups to join [10000]
#   HEARTBEAT_TIMEOUT_MS  lighthouse: silence after which a group is dead [5000]
#   GROUP_RESTARTS    restarts of one group before this script gives up on it [100]
#   NPROC_PER_NODE    processes per group [number of visible GPUs / groups here, or 1 on a CPU]
#   TORCHFT_LIGHTHOUSE_BIN  the lighthouse executable [torchft_lighthouse]
# Each group's torchrun gets its own local rendezvous; on GPUs the groups on this node split the
# visible devices (CUDA_VISIBLE_DEVICES). Everything else as in launch/torchrun.sh.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/common.sh"

if [ $# -lt 1 ]; then
    echo "usage: launch/ft.sh CONFIG.yaml [key=value ...]" >&2
    exit 2
fi
REPLICAS=${REPLICAS:-2}
MIN_REPLICAS=${MIN_REPLICAS:-1}
LIGHTHOUSE_PORT=${LIGHTHOUSE_PORT:-29510}
GROUP_RESTARTS=${GROUP_RESTARTS:-100}
BIN=${TORCHFT_LIGHTHOUSE_BIN:-torchft_lighthouse}
read -r -a ids <<<"${REPLICA_IDS:-$(seq -s ' ' 0 $((REPLICAS - 1)))}"

lighthouse_pid=
if [ -z "${LIGHTHOUSE:-}" ]; then
    command -v "$BIN" >/dev/null 2>&1 \
        || { echo "launch/ft.sh: '$BIN' not found: pip install 'tformer[ft]' (torchft==0.2.0), or set LIGHTHOUSE to a running one" >&2; exit 2; }
    # The lighthouse, started again on its port whenever it dies: the groups wait for it (up to
    # fault_tolerance.quorum_timeout_s) and go on when it is back. TERM ends it for good.
    run_lighthouse() {
        local pid=
        trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; exit 0' TERM INT
        while true; do
            # its per-quorum INFO lines would drown the trainers' (RUST_LOG=info brings them back)
            RUST_LOG=${RUST_LOG:-warn} "$BIN" --min_replicas "$MIN_REPLICAS" --bind "[::]:$LIGHTHOUSE_PORT" \
                --join_timeout_ms "${JOIN_TIMEOUT_MS:-10000}" --heartbeat_timeout_ms "${HEARTBEAT_TIMEOUT_MS:-5000}" &
            pid=$!
            wait "$pid" || true
            echo "tformer ft: the lighthouse ended; starting it again on port $LIGHTHOUSE_PORT (the groups wait for it up to fault_tolerance.quorum_timeout_s)" >&2
            sleep 0.2
        done
    }
    run_lighthouse &
    lighthouse_pid=$!
    LIGHTHOUSE="http://$(hostname):$LIGHTHOUSE_PORT"
fi
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
fi
per_group=${NPROC_PER_NODE:-$(( gpus >= ${#ids[@]} ? gpus / ${#ids[@]} : 1 ))}

# One group: its torchrun job, started again whenever it ends in failure; the others go on meanwhile.
run_group() {
    local id=$1 slot=$2 tries=0 rc pid stopping=0
    shift 2
    if [ "$gpus" -gt 0 ]; then
        CUDA_VISIBLE_DEVICES=$(seq -s , $((slot * per_group)) $((slot * per_group + per_group - 1)))
        export CUDA_VISIBLE_DEVICES
    fi
    # TERM / INT: passed on to the group's torchrun (its workers save and exit), and no restart
    trap 'stopping=1; kill -TERM "$pid" 2>/dev/null || true' TERM INT
    while true; do
        rc=0
        NPROC_PER_NODE=$per_group "$here/torchrun.sh" "$@" fault_tolerance.enabled=true \
            "fault_tolerance.replica_id=$id" "fault_tolerance.replicas=$REPLICAS" \
            "fault_tolerance.min_replicas=$MIN_REPLICAS" "fault_tolerance.lighthouse=$LIGHTHOUSE" &
        pid=$!
        tformer_wait "$pid" || rc=$?
        [ "$rc" = 0 ] || [ "$stopping" = 1 ] && return "$rc"
        tries=$((tries + 1))
        if [ "$tries" -gt "$GROUP_RESTARTS" ]; then
            echo "tformer ft: replica group $id failed $tries times (exit $rc); GROUP_RESTARTS=$GROUP_RESTARTS reached, giving up on it" >&2
            return "$rc"
        fi
        echo "tformer ft: replica group $id ended with exit $rc; restarting it ($tries/$GROUP_RESTARTS), it heals from a live group" >&2
    done
}

echo "tformer launch: ${#ids[@]} of $REPLICAS replica group(s) here (${ids[*]}), $per_group process(es) each, lighthouse $LIGHTHOUSE, min replicas $MIN_REPLICAS" >&2
pids=()
slot=0
for id in "${ids[@]}"; do
    run_group "$id" "$slot" "$@" &
    pids+=($!)
    slot=$((slot + 1))
done
trap 'for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done' TERM INT
rc=0
for p in "${pids[@]}"; do
    tformer_wait "$p" || rc=$?
done
if [ -n "$lighthouse_pid" ]; then
    kill "$lighthouse_pid" 2>/dev/null || true
    wait "$lighthouse_pid" 2>/dev/null || true
fi
exit "$rc"
