#!/usr/bin/env bash
# What a session with a lent GPU runs there, one part per call of the device tool (each call is
# limited to 10 minutes; a machine to 30 minutes per session), from the repository root:
#
#   bash scripts/gpu_session.sh tests                # the `gpu` tests (pytest -m gpu)
#   bash scripts/gpu_session.sh bench gpt2,bert      # bench/bench_gpu.py rows, JSON under $OUT
#   bash scripts/gpu_session.sh bench llama
#   bash scripts/gpu_session.sh bench t5
#   bash scripts/gpu_session.sh all                  # everything below in one call, at most 9 minutes:
#                                                    # the gpu tests, every family eager and compiled
#                                                    # (tformer's trainer settings: loss.chunk_size=auto,
#                                                    # compiled head) next to HF; writes ONE session.json
#                                                    # (commit it as bench/results/DATE-DEVICE.json, then
#                                                    # python bench/speed_table.py --write) and ONE session.log
#
# The GPU machine has torch, transformers, tokenizers and safetensors but not every package the
# trainer imports; carry the missing ones as wheels in .whl/ (scripts/gpu_wheels.sh fetches them
# on the CPU machine) and name .whl in the call's `carry`. Logs and JSON go to $OUT (or /tmp/gpu-out).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_session.sh tests | bench FAMILIES [extra bench_gpu.py flags] | all}
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' \
    | tee -a "$out/device.txt"
case $part in
tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/tests.log"
    ;;
bench)
    families=${2:?usage: gpu_session.sh bench FAMILIES (comma list of gpt2, llama, bert, t5)}
    shift 2
    python3 bench/bench_gpu.py --family "$families" --json "$out/bench-${families//,/-}.json" "$@" 2>&1 \
        | tee "$out/bench-${families//,/-}.log"
    ;;
all)
    # each part under its own deadline (seconds), so the whole fits one 10-minute call of the device tool
    log="$out/session.log"
    : >"$log"
    { timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py || echo "tests rc=$?"; } 2>&1 | tee -a "$log"
    { timeout 170 python3 bench/bench_gpu.py --compile off --no-generate --json /tmp/gpu-eager.json \
        || echo "eager rc=$?"; } 2>&1 | tee -a "$log"
    { timeout 200 python3 bench/bench_gpu.py --compile on --no-generate --steps 5 --warmup 2 \
        --json /tmp/gpu-compiled.json || echo "compiled rc=$?"; } 2>&1 | tee -a "$log"
    python3 scripts/gpu_merge.py "$out/session.json" /tmp/gpu-eager.json /tmp/gpu-compiled.json "$log" \
        | tee -a "$log"
    ;;
*)
    echo "unknown part '$part': use tests, bench or all" >&2
    exit 2
    ;;
esac
