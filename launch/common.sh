# Shared by the launch/ scripts (sourced, not run).

# Processes per node when NPROC_PER_NODE is not set: one per visible GPU, else 1 (CPU-only node).
tformer_default_nproc() {
    local n=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
    fi
    if [ "${n:-0}" -gt 0 ]; then echo "$n"; else echo 1; fi
}
