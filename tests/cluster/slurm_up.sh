#!/usr/bin/env bash
# Bring up a real two-node SLURM cluster on this one machine, for tformer's launch tests.
#
# Debian's slurmctld + two slurmd daemons (nodes node1 and node2, one port each on 127.0.0.1) +
# munge, as plain background daemons (no systemd, no cgroups). Idempotent: a running cluster whose
# config is unchanged is left alone. Needs root (apt-get, munged, slurmd).
#
#   bash tests/cluster/slurm_up.sh            # install if missing, write config, start daemons
#   export SLURM_CONF=/tmp/tformer-slurm/slurm.conf   # then sbatch / squeue / scontrol work
#   bash tests/cluster/slurm_up.sh --down     # cancel its jobs, stop the daemons (munged too if this script started it)
#
# Settings (environment): TFORMER_SLURM_DIR (state, logs, spool; default /tmp/tformer-slurm),
# TFORMER_SLURM_PORT (slurmctld port; slurmd ports follow it; default 16817).
set -euo pipefail

DIR=${TFORMER_SLURM_DIR:-/tmp/tformer-slurm}
PORT=${TFORMER_SLURM_PORT:-16817}
CONF=$DIR/slurm.conf

die() { echo "slurm_up: $*" >&2; exit 1; }

# Wait up to $1 tenths of a second for the processes $2... to exit; SIGKILL those still there.
reap() {
    local tenths=$1 pid alive
    shift
    for _ in $(seq "$tenths"); do
        alive=0
        for pid in "$@"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        [ "$alive" = 0 ] && return 0
        sleep 0.1
    done
    for pid in "$@"; do kill -KILL "$pid" 2>/dev/null || true; done
}

stop_all() {
    # Jobs first: a job's slurmstepd and tasks outlive slurmd (slurmctld signals them, KillWait=30).
    if [ -f "$CONF" ] && SLURM_CONF=$CONF scontrol ping 2>/dev/null | grep -q UP; then
        local jobs
        jobs=$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null || true)
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086 # one job id per word
            SLURM_CONF=$CONF scancel $jobs 2>/dev/null || true
            for _ in $(seq 400); do
                [ -z "$(SLURM_CONF=$CONF squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.1
            done
        fi
    fi
    local pids=() f
    for f in "$DIR"/slurmd-*.pid "$DIR"/slurmctld.pid; do
        [ -f "$f" ] && pids+=("$(cat "$f")")
    done
    mapfile -t -O "${#pids[@]}" pids < <(pgrep -f "slurm(ctl)?d .*-f $CONF" || true)
    if [ "${#pids[@]}" -gt 0 ]; then
        kill "${pids[@]}" 2>/dev/null || true
        reap 100 "${pids[@]}"
    fi
    rm -f "$DIR"/slurmd-*.pid "$DIR/slurmctld.pid"
}

# munged only if this script started it (its pid saved in $DIR): a machine's own munged stays.
stop_munge() {
    [ -f "$DIR/munged.pid" ] || return 0
    local pid
    pid=$(cat "$DIR/munged.pid")
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = munged ]; then
        kill "$pid" 2>/dev/null || true
        reap 100 "$pid"
    fi
    rm -f "$DIR/munged.pid"
}

if [ "${1:-}" = "--down" ]; then
    stop_all
    stop_munge
    exit 0
fi

[ "$(id -u)" = 0 ] || die "needs root (apt-get install, munged, slurmd); run as root or use an existing cluster"

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v sbatch >/dev/null \
        || ! command -v munged >/dev/null; then
    echo "slurm_up: installing slurmctld slurmd slurm-client munge (Debian packages)" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null \
        || die "apt-get install of slurmctld slurmd slurm-client munge failed"
fi

# munge: one key, daemon running as the munge user.
if [ ! -s /etc/munge/munge.key ]; then
    mungekey --create --force >/dev/null 2>&1 || die "could not create /etc/munge/munge.key"
    chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge "$DIR"
chown munge:munge /run/munge /var/log/munge /var/lib/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    runuser -u munge -- /usr/sbin/munged --force || die "munged did not start (see /var/log/munge/munged.log)"
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munge does not answer after starting munged"
    cp /run/munge/munged.pid "$DIR/munged.pid"  # ours: --down stops it
fi

mkdir -p "$DIR/ctld" "$DIR/node1" "$DIR/node2"
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 4 ))
HOST=$(hostname -s)
NEW=$(mktemp)
cat >"$NEW" <<EOF
# Written by tests/cluster/slurm_up.sh: a two-node test cluster on one machine.
ClusterName=tformer-test
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
MpiDefault=none
NodeName=node1 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 1)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
NodeName=node2 NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((PORT + 2)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=test Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF

export SLURM_CONF=$CONF
if [ -f "$CONF" ] && cmp -s "$NEW" "$CONF" && scontrol ping 2>/dev/null | grep -q UP \
        && [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c -E ' (idle|mix|alloc)')" = 2 ]; then
    rm -f "$NEW"
    echo "slurm_up: cluster already running (SLURM_CONF=$CONF)"
    exit 0
fi
stop_all
mv "$NEW" "$CONF"
chmod 644 "$CONF"

/usr/sbin/slurmctld -f "$CONF" -c || die "slurmctld did not start (see $DIR/slurmctld.log)"
for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
scontrol ping | grep -q UP || die "slurmctld does not answer (see $DIR/slurmctld.log)"
/usr/sbin/slurmd -f "$CONF" -N node1 || die "slurmd node1 did not start (see $DIR/slurmd-node1.log)"
/usr/sbin/slurmd -f "$CONF" -N node2 || die "slurmd node2 did not start (see $DIR/slurmd-node2.log)"
for _ in $(seq 200); do
    [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" = 2 ] && break
    sleep 0.1
done
if [ "$(sinfo -h -N -o '%N %t' | grep -c ' idle')" != 2 ]; then
    scontrol update nodename=node1,node2 state=resume >/dev/null 2>&1 || true
    sleep 1
fi
[ "$(sinfo -h -N -o '%N %t' | grep -c ' idle')" = 2 ] \
    || die "nodes not idle: $(sinfo -h -N -o '%N %t %E' | tr '\n' ';') (see $DIR/slurmd-*.log)"
echo "slurm_up: cluster up: 2 nodes x $CPUS CPUs (SLURM_CONF=$CONF)"
