#!/usr/bin/env bash
# What a session with a lent GPU runs there, one part per call of the device tool (each call is
# limited to 10 minutes; a machine to 30 minutes per session), from the repository root:
#
#   bash scripts/gpu_session.sh tests                # the `gpu` tests (pytest -m gpu)
#   bash scripts/gpu_session.sh bench gpt2,bert      # bench/bench_gpu.py rows, JSON under $OUT
#   bash scripts/gpu_session.sh bench llama
#   bash scripts/gpu_session.sh bench t5
#   bash scripts/gpu_session.sh calibrate            # tformer plan --calibrate on this GPU (<= 2 min), then
#                                                    # bench/bench_plan_gpu.py with that profile against the
#                                                    # newest bench/results file (run it on that file's card)
#   bash scripts/gpu_session.sh profile [CONFIG]     # the trainer's profiler on one bench row (default
#                                                    # llama-1b), eager and compiled, and profile-report
#   bash scripts/gpu_session.sh all                  # everything below in one call, under 9 minutes:
#                                                    # the gpu tests (llama's compiled recipe only),
#                                                    # every family eager and compiled
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
part=${1:?usage: gpu_session.sh tests | bench FAMILIES [extra bench_gpu.py flags] | calibrate | profile [CONFIG] | all}
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
calibrate)
    timeout 150 python3 -m tformer plan --calibrate "$out/gpu-profile.json" 2>&1 | tee "$out/calibrate.log"
    newest=$(find bench/results -maxdepth 1 -name '*.json' | sort | tail -n 1)
    { python3 bench/bench_plan_gpu.py --gpu "$out/gpu-profile.json" "$newest" || echo "bench_plan_gpu rc=$?"; } 2>&1 \
        | tee -a "$out/calibrate.log"
    ;;
all)
    # Budget from the H100 run of 2026-11-27 (torch 2.11): the gpu tests took 131 s, 78 s of it in
    # the four compiled-recipe tests (only llama's is kept here) and 27 s in DDP/FSDP2 in a world of
    # one (`tests` runs them all); a family's process builds its
    # model on the CPU (up to ~15 s for llama-1b), runs eager then compiled, and HF's whole-model
    # compile alone is 41-54 s, tformer's 15-25 s. Each family runs in its own process under its
    # own deadline, and a family that finishes early hands its spare seconds to the next; the
    # bench writes its JSON after every row, so a deadline loses only the row in flight. The
    # micro-batch each contender settled on last time on this device (--start-from) saves the
    # out-of-memory tries that cost a compiled contender a whole compile. Three contenders a mode:
    # tformer's raw loop, the Trainer's own step (on synthetic data; its compile finds inductor's
    # cache warm from the raw loop's) and HF. Total: 15 + 45 + 465 s.
    log="$out/session.log"
    : >"$log"
    { timeout 45 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
        -k "(not compiled_blocks or llama) and not world_of_one" || echo "tests rc=$?"; } 2>&1 | tee -a "$log"
    prior=$(find bench/results -maxdepth 1 -name '*.json' | sort | tail -n 1)
    parts=()
    spare=0
    for planned in gpt2:115 llama:130 bert:110 t5:110; do
        family=${planned%%:*}
        deadline=$((${planned##*:} + spare))
        began=$SECONDS
        rm -f "/tmp/gpu-$family.json"  # an earlier session's file must not pass for this one's
        { timeout "$deadline" python3 bench/bench_gpu.py --family "$family" --compile off,on --no-generate \
            --warmup 2 --steps 6 --compiled-warmup 1 --compiled-steps 4 ${prior:+--start-from "$prior"} \
            --json "/tmp/gpu-$family.json" || echo "$family rc=$? (deadline ${deadline} s)"; } 2>&1 | tee -a "$log"
        spare=$((deadline - (SECONDS - began)))
        spare=$((spare > 0 ? spare : 0))
        parts+=("/tmp/gpu-$family.json")
    done
    python3 scripts/gpu_merge.py "$out/session.json" "${parts[@]}" "$log" | tee -a "$log"
    ;;
profile)
    # Where a row's step goes, by the trainer's own profiler (profile.steps) and `tformer
    # profile-report` (device time split into GEMMs / attention / other / optimizer / idle, the top
    # ops, the plan beside it): the bench row's shape (seq 2048, micro-batch 8, bf16, synthetic
    # data), eager then compiled. Budget: ~15 s to build llama-1b, the steps, a final checkpoint of
    # ~15 GB (deleted after), ~20 s of compile: under 3 minutes for both.
    config=${2:-llama-1b}
    for compiled in false true; do
        run=/tmp/gpu-profile-$config-$compiled
        rm -rf "$run"
        { timeout 150 python3 -m tformer train "configs/$config.yaml" data.source=synthetic micro_batch_size=8 \
            grad_accum=1 max_steps=6 profile.steps=5-6 eval_every=0 eval_batches=1 save_every=0 log_every=1 \
            precision=bf16 compile=$compiled progress=false output_dir="$run" \
            && python3 -m tformer profile-report "$run" --no-png || echo "profile compile=$compiled rc=$?"; } 2>&1 \
            | grep -v "^USDT" | tee -a "$out/profile-$config.log"
        rm -rf "$run/checkpoints"
    done
    ;;
*)
    echo "unknown part '$part': use tests, bench, calibrate, profile or all" >&2
    exit 2
    ;;
esac
