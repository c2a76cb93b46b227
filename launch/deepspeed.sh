#!/usr/bin/env bash
# Launch `tformer train` with DeepSpeed's own launcher (the `deepspeed` command).
#
#   launch/deepspeed.sh CONFIG.yaml [key=value ...]
#
# The recipe runs with parallel.strategy=deepspeed; pick the ZeRO config with
# parallel.deepspeed_config=configs/deepspeed/zero3.json (default: ZeRO stage parallel.zero_stage).
#
# Three ways to run:
#   this node only        no HOSTFILE: NPROC_PER_NODE processes here
#   several nodes by ssh  HOSTFILE: run once, on the first host; DeepSpeed reaches every host of the
#                         hostfile with pdsh over passwordless ssh and starts its processes there
#   several nodes, no ssh HOSTFILE and NODE_RANK: run once on every host (e.g. one srun task per node),
#                         each with its own NODE_RANK and the first host's MASTER_ADDR
# Environment (defaults in brackets):
#   HOSTFILE        DeepSpeed hostfile, one "hostname slots=N" line per node [none: this node only]
#   NODE_RANK       this host's line in HOSTFILE, counted from 0: start this host only, no ssh [unset]
#   NPROC_PER_NODE  processes on this node when there is no hostfile [GPUs, or 1 on a CPU-only node]
#   MASTER_ADDR     address of the first host [DeepSpeed asks the first host over ssh / 127.0.0.1]
#   MASTER_PORT     [29500]
#   SSH_PORT        sshd port on the hosts [ssh's default]
#   DEEPSPEED_ARGS  more arguments for the deepspeed launcher, e.g. "--no_ssh_check" [none]
#   DEEPSPEED       the deepspeed launcher [deepspeed]
# Over ssh, a host starts with ssh's bare environment: this script hands the variables tformer and
# its libraries read (TFORMER_*, WANDB_*, HF_*, NCCL_*, GLOO_*, TORCH_*, OMP_NUM_THREADS, ...) to every
# host through DeepSpeed's environment file (DS_ENV_FILE), after the lines of your own
# ~/.deepspeed_env and ./.deepspeed_env. Set DS_ENV_FILE yourself to use only yours.
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
    [ -n "${SSH_PORT:-}" ] && args=(--ssh_port "$SSH_PORT" "${args[@]}")
    if [ -n "${NODE_RANK:-}" ]; then
        [ -n "${MASTER_ADDR:-}" ] || { echo "launch/deepspeed.sh: NODE_RANK=$NODE_RANK (no ssh) needs MASTER_ADDR, the first host's address" >&2; exit 2; }
        args=(--no_ssh --node_rank "$NODE_RANK" "${args[@]}")
        where="node $NODE_RANK of the hosts in $HOSTFILE (no ssh)"
    else
        if [ -z "${DS_ENV_FILE:-}" ]; then
            # what every host must see: the user's DeepSpeed env files, then ours
            DS_ENV_FILE=$(mktemp "${TMPDIR:-/tmp}/tformer-ds-env.XXXXXX")
            trap 'rm -f "$DS_ENV_FILE"' EXIT
            for f in "$HOME/.deepspeed_env" ./.deepspeed_env; do
                [ -f "$f" ] && grep '=' "$f" >>"$DS_ENV_FILE"
            done
            env | grep -E '^(TFORMER_|WANDB_|HF_|TRANSFORMERS_|NCCL_|GLOO_|TORCH_|CUDA_|OMP_NUM_THREADS=|MKL_NUM_THREADS=|PYTHONPATH=|PATH=|VIRTUAL_ENV=)' \
                | grep -v '^[A-Za-z_0-9]*=.*[\"`$]' >>"$DS_ENV_FILE" || true
            export DS_ENV_FILE
        fi
        where="hosts from $HOSTFILE (pdsh over ssh)"
    fi
    [ -n "${MASTER_ADDR:-}" ] && args=(--master_addr "$MASTER_ADDR" "${args[@]}")
else
    NPROC_PER_NODE=${NPROC_PER_NODE:-$(tformer_default_nproc)}
    args=(--num_nodes 1 --num_gpus "$NPROC_PER_NODE" --master_addr "${MASTER_ADDR:-127.0.0.1}" "${args[@]}")
    where="this node, $NPROC_PER_NODE process(es)"
fi
# shellcheck disable=SC2206  # DEEPSPEED_ARGS is a list of words on purpose
extra=(${DEEPSPEED_ARGS:-})

echo "tformer launch: deepspeed on $where, master port $MASTER_PORT" >&2
# not exec: the EXIT trap removes the environment file once the run has ended (set -e: the exit
# code is the launcher's)
"$DEEPSPEED" "${extra[@]}" "${args[@]}" tformer train "$1" parallel.strategy=deepspeed "${@:2}"
