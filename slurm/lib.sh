# shellcheck shell=bash
# Shared by tformer's sbatch scripts (sourced, not run). Needs: SLURM_JOB_ID, TFORMER_HOME.

source "$(dirname "${BASH_SOURCE[0]}")/../launch/common.sh"   # tformer_wait

tformer_log() { echo "[tformer $(date -u +%H:%M:%S) job ${SLURM_JOB_ID:-?}] $*" >&2; }
tformer_die() { tformer_log "error: $*"; exit 1; }

# Head node (first host of the allocation) and the address the other nodes reach it at: SLURM's
# own NodeAddr for it, else what the name resolves to. Fails loudly: a wrong head address only
# shows up later as a rendezvous time-out on every node.
tformer_head() {
    [ -n "${SLURM_JOB_NODELIST:-}" ] || tformer_die "SLURM_JOB_NODELIST is not set: run this script with sbatch"
    HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" 2>/dev/null | head -n 1)
    [ -n "$HEAD_NODE" ] || tformer_die "could not resolve the head node from SLURM_JOB_NODELIST='$SLURM_JOB_NODELIST' with 'scontrol show hostnames'"
    if [ -z "${HEAD_ADDR:-}" ]; then
        HEAD_ADDR=$(scontrol show node "$HEAD_NODE" -o 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
        [ -n "$HEAD_ADDR" ] || HEAD_ADDR=$(getent hosts "$HEAD_NODE" | awk '{print $1; exit}')
    fi
    [ -n "$HEAD_ADDR" ] || tformer_die "could not resolve an address for head node '$HEAD_NODE' (scontrol show node / getent hosts); set HEAD_ADDR"
    export HEAD_NODE HEAD_ADDR
}

tformer_topology() {
    tformer_log "job ${SLURM_JOB_ID} '${SLURM_JOB_NAME:-}' restart ${SLURM_RESTART_COUNT:-0}; nodes ${SLURM_JOB_NUM_NODES:-1} (${SLURM_JOB_NODELIST:-}); head ${HEAD_NODE:-local} ${HEAD_ADDR:-}; processes per node ${NPROC_PER_NODE}; world $(( ${SLURM_JOB_NUM_NODES:-1} * NPROC_PER_NODE )); rendezvous port ${RDZV_PORT}; tformer ${TFORMER_HOME}"
}

# Run the srun step in the background so the batch shell can take SLURM's warning signal
# (`#SBATCH --signal=B:USR1@SECONDS`): it is forwarded to srun, which passes it to torchrun on every
# node, which passes it to every worker; the trainer finishes its step, saves and exits. The job is
# then requeued and the next run resumes from that checkpoint (resume=auto). Exits with the step's
# exit code otherwise, so a failed run reads FAILED.
tformer_run_step() {
    local pid rc
    TFORMER_PREEMPTED=0
    "$@" &
    pid=$!
    trap 'TFORMER_PREEMPTED=1; tformer_log "USR1: time is nearly up, asking the trainer to checkpoint"; kill -USR1 '"$pid"' 2>/dev/null || true' USR1
    trap 'tformer_log "TERM: forwarding to the job step"; kill -TERM '"$pid"' 2>/dev/null || true' TERM
    rc=0
    tformer_wait "$pid" || rc=$?
    trap - USR1 TERM
    if [ "$TFORMER_PREEMPTED" = 1 ]; then
        if [ "${TFORMER_REQUEUE:-1}" = 1 ]; then
            tformer_log "step ended (exit $rc) after the warning signal; requeueing job $SLURM_JOB_ID"
            scontrol requeue "$SLURM_JOB_ID" || tformer_die "scontrol requeue $SLURM_JOB_ID failed (was the job submitted with --requeue?)"
            exit 0
        fi
        tformer_log "step ended (exit $rc) after the warning signal; TFORMER_REQUEUE=0, not requeueing"
        exit 0
    fi
    tformer_log "step finished with exit code $rc"
    exit "$rc"
}
