#!/usr/bin/env bash
# Launch `tformer train` with DeepSpeed's own launcher (the `deepspeed` command).
#
#   launch/deepspeed.sh CONFIG.yaml [key=value ...]
#
# The recipe runs with parallel.strategy=deepspeed; pick the ZeRO config with
# parallel.deepspeed_config=configs/deepspeed/zero3.json (default: ZeRO stage parallel.zero_stage).
# Environment (defaults in brackets):
#   HOSTFILE        DeepSpeed hostfile, one "hostname slots=N" line per node; several nodes are reached
#                   over passwordless ssh/pdsh from this node [none: this node only]
#   NPROC_PER_NODE  processes on this node when there is no hostfile [GPUs, or 1 on a CPU-only node]
#   MASTER_ADDR     address of the first host [first host of HOSTFILE / 127.0.0.1]
#   MASTER_PORT     [29500]
#   DEEPSPEED       the deepspeed launcher [deepspeed]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

if [ $# -lt 1 ]; then
    echo "usage: launch/deepspeed.sh CONFIG.yaml [key=value ...]" >&2
    exit 2
fi
DEEPSPEED=${DEEPSPEED:-deepspeed}
command -v "$DEEPSPEED" >/dev/null 2>&1 \
    || { echo "launch/deepspeed.sh: '$DEEPSPEED' not found: pip install deepspeed (or set DEEPSPEED=/path/to/deepspeed)" >&2; exit 2; }
MASTER_PORT=${MASTER_PORT:-29500}

args=(--master_port "$MASTER_PORT" --no_local_rank --module)
if [ -n "${HOSTFILE:-}" ]; then
    [ -f "$HOSTFILE" ] || { echo "launch/deepspeed.sh: HOSTFILE=$HOSTFILE does not exist: write one 'hostname slots=N' line per node" >&2; exit 2; }
    args=(--hostfile "$HOSTFILE" "${args[@]}")
    [ -n "${MASTER_ADDR:-}" ] && args=(--master_addr "$MASTER_ADDR" "${args[@]}")
    where="hosts from $HOSTFILE"
else
    NPROC_PER_NODE=${NPROC_PER_NODE:-$(tformer_default_nproc)}
    args=(--num_nodes 1 --num_gpus "$NPROC_PER_NODE" --master_addr "${MASTER_ADDR:-127.0.0.1}" "${args[@]}")
    where="this node, $NPROC_PER_NODE process(es)"
fi

echo "tformer launch: deepspeed on $where, master port $MASTER_PORT" >&2
"$DEEPSPEED" "${args[@]}" tformer train "$1" parallel.strategy=deepspeed "${@:2}"
