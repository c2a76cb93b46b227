# shellcheck shell=bash
# Shared by the launch/ scripts (sourced, not run).

# Processes per node when NPROC_PER_NODE is not set: one per visible GPU, else 1 (CPU-only node).
tformer_default_nproc() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
}

# Wait for background process PID to end and return its exit code. A signal this shell traps
# interrupts `wait` (which then returns > 128) while the process runs on: keep waiting for it.
tformer_wait() {
    local rc
    while true; do
        rc=0
        wait "$1" || rc=$?
        kill -0 "$1" 2>/dev/null || return "$rc"
    done
}
