#!/usr/bin/env bash
# Split a long run into a chain of jobs: each starts when the previous one ends (whatever its
# outcome), resumes from the newest checkpoint (resume=auto) and trains until its own time is up.
# Jobs after the run has reached max_steps find nothing left to do and end at once.
#
#   slurm/chain.sh N SCRIPT.sbatch [sbatch options --] CONFIG.yaml [key=value ...]
#   slurm/chain.sh 10 slurm/multi_node.sbatch --nodes=8 --gpus-per-node=8 --time=24:00:00 -- \
#       configs/llama-1b.yaml max_time=85800
#
# Give the trainer a max_time (seconds) a little under the job's --time so it saves a checkpoint
# itself; the USR1 warning of the sbatch scripts is the safety net. The jobs of one chain share the
# name of the first job. Prints the job ids.
set -euo pipefail

usage="usage: slurm/chain.sh N SCRIPT.sbatch [sbatch options --] CONFIG.yaml [key=value ...]"
[ $# -ge 3 ] || { echo "$usage" >&2; exit 2; }
n=$1; script=$2; shift 2
[[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "slurm/chain.sh: N must be a positive number of jobs, got '$n'; $usage" >&2; exit 2; }
[ -f "$script" ] || { echo "slurm/chain.sh: no sbatch script '$script'; $usage" >&2; exit 2; }
opts=()
if printf '%s\n' "$@" | grep -qx -- "--"; then
    while [ "$1" != "--" ]; do opts+=("$1"); shift; done
    shift
fi
[ $# -ge 1 ] || { echo "$usage" >&2; exit 2; }

prev=""
for _ in $(seq "$n"); do
    dep=()
    [ -n "$prev" ] && dep=(--dependency="afterany:$prev")
    # No self-requeue inside a chain: the next link continues the run.
    prev=$(sbatch --parsable "${dep[@]}" --export=ALL,TFORMER_REQUEUE=0 "${opts[@]}" "$script" "$@")
    prev=${prev%%;*}
    echo "$prev"
done
