#!/usr/bin/env bash
# Launch `tformer train` with torchrun on this node: one node, or one node of several.
#
#   launch/torchrun.sh CONFIG.yaml [key=value ...]
#
# Everything else comes from the environment (defaults in brackets):
#   NNODES            nodes in the job [1]. With 1 the rendezvous is local (--standalone).
#   NPROC_PER_NODE    processes on this node [number of visible GPUs, or 1 on a CPU-only node]
#   NODE_RANK         this node's index, 0 = head [SLURM_NODEID, else 0]
#   HEAD_ADDR         address of the head node (required when NNODES > 1)
#   RDZV_PORT         rendezvous port on the head node [29500]
#   LOCAL_ADDR        this node's address as the other nodes reach it [looked up by torchrun]
#   RDZV_ID           rendezvous id, the same on every node of one job [SLURM_JOB_ID, else "tformer"]
#   MAX_RESTARTS      elastic restarts of the whole worker group after a failure [0]; the trainer
#                     resumes from the newest complete checkpoint (resume=auto) after each restart
#   SHUTDOWN_TIMEOUT  seconds workers get to save a checkpoint after SIGTERM/SIGUSR1 [600]
#   TORCHRUN          the torchrun executable [torchrun]
# Network knobs passed through untouched: NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME (the interface
# the collectives use, e.g. ib0 or eth0), NCCL_IB_DISABLE, NCCL_DEBUG=INFO (diagnose), NCCL_NET_GDR_LEVEL,
# TORCH_NCCL_ASYNC_ERROR_HANDLING, OMP_NUM_THREADS (threads per process; torchrun sets 1 by default).
# SIGTERM and SIGUSR1 sent to torchrun are forwarded to every worker: the trainer finishes its step,
# saves a checkpoint and exits 0.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [ $# -lt 1 ]; then
    echo "usage: launch/torchrun.sh CONFIG.yaml [key=value ...]" >&2
    exit 2
fi

NNODES=${NNODES:-1}
NPROC_PER_NODE=${NPROC_PER_NODE:-$(tformer_default_nproc)}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
RDZV_PORT=${RDZV_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-tformer}}
MAX_RESTARTS=${MAX_RESTARTS:-0}
SHUTDOWN_TIMEOUT=${SHUTDOWN_TIMEOUT:-600}
TORCHRUN=${TORCHRUN:-torchrun}
# Elastic restarts over gloo are unreliable when the agent's rendezvous store is shared with the
# workers (measured: 4 failed restarts in 10); a separate store costs nothing.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

command -v "$TORCHRUN" >/dev/null 2>&1 \
    || { echo "launch/torchrun.sh: '$TORCHRUN' not found: activate the environment with tformer installed or set TORCHRUN=/path/to/torchrun" >&2; exit 2; }

args=(--nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" --max-restarts "$MAX_RESTARTS")
# Older torchrun releases have no --signals-to-handle and forward SIGTERM only (SIGUSR1 would kill
# the agent and orphan the workers): there this script stays in between and turns USR1 into TERM,
# which the trainer treats the same way (finish the step, save, exit 0).
help=$("$TORCHRUN" --help 2>/dev/null || true)
forward_usr1=torchrun
if grep -q -- "--signals-to-handle" <<<"$help" && [ "${TFORMER_USR1_AS_TERM:-0}" != 1 ]; then
    args+=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
else
    forward_usr1=term
fi
if grep -q -- "--shutdown-timeout" <<<"$help"; then
    args+=(--shutdown-timeout "$SHUTDOWN_TIMEOUT")
fi

if [ "$NNODES" = 1 ] && [ -z "${HEAD_ADDR:-}" ]; then
    args+=(--standalone)
    where="standalone (local rendezvous)"
else
    if [ -z "${HEAD_ADDR:-}" ]; then
        echo "launch/torchrun.sh: NNODES=$NNODES needs HEAD_ADDR (address of node 0); set HEAD_ADDR=host-or-ip" >&2
        exit 2
    fi
    # The head node hosts the rendezvous store. Said explicitly rather than guessed from host names,
    # which fails when nodes share a name (containers, network namespaces) or the head is an IP.
    is_host=0
    [ "$NODE_RANK" = 0 ] && is_host=1
    args+=(--node-rank "$NODE_RANK" --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT"
           --rdzv-id "$RDZV_ID" --rdzv-conf "is_host=$is_host")
    [ -n "${LOCAL_ADDR:-}" ] && args+=(--local-addr "$LOCAL_ADDR")
    where="rendezvous $HEAD_ADDR:$RDZV_PORT id $RDZV_ID"
fi

echo "tformer launch: node $NODE_RANK/$NNODES on $(hostname), $NPROC_PER_NODE process(es), world $((NNODES * NPROC_PER_NODE)), $where, max restarts $MAX_RESTARTS" >&2
if [ "$forward_usr1" = torchrun ]; then
    exec "$TORCHRUN" "${args[@]}" -m tformer train "$@"
fi
"$TORCHRUN" "${args[@]}" -m tformer train "$@" &
pid=$!
trap 'kill -TERM "$pid" 2>/dev/null || true' USR1 TERM
tformer_wait "$pid"  # set -e: exits with torchrun's code
