#!/usr/bin/env bash
# What a session with a lent GPU runs there, one part per call of the device tool, from the
# repository root. Each part writes ONE log and at most ONE JSON into $OUT (the tool brings back
# at most 8 files):
#
#   bash scripts/gpu_session.sh all    # first call, under 9 minutes: every family, tformer and HF,
#                                      # eager and compiled (tformer's trainer settings:
#                                      # loss.chunk_size=auto, compiled head) -> session.json,
#                                      # session.log (commit the JSON as bench/results/DATE-DEVICE.json,
#                                      # then python bench/speed_table.py --write)
#   bash scripts/gpu_session.sh more   # second call on the same warm machine, under 4.5 minutes:
#                                      # the 8B-shaped float8 row (bf16 vs tensorwise vs rowwise,
#                                      # compiled), the Trainer's own rows of every family (eager and
#                                      # compiled, its compile finding inductor's cache on disk warm
#                                      # from `all`), the gpu tests' fast subset, and the planner's
#                                      # predicted vs measured step time and memory for every tformer
#                                      # and trainer row of both parts -> more.json, more.log
#                                      # (commit it as bench/results/DATE-DEVICE/more.json: the top
#                                      # level holds one file a session, whose newest the README's
#                                      # table and --start-from read)
#   bash scripts/gpu_session.sh zoo    # a call of its own (a later session, or after `all` when
#                                      # `more` ran before), under 9 minutes: the new decoders
#                                      # (qwen3-0.6b; qwen3-30b-a3b, Moonlight's DeepSeek-V3 shape and
#                                      # gpt-oss-20b cut to the layers that fit), tformer and HF, eager
#                                      # and compiled -> zoo.json, zoo.log (commit it as
#                                      # bench/results/DATE-DEVICE/zoo.json)
#   bash scripts/gpu_session.sh zoo-enc  # under 4.5 minutes: modernbert-base (seq 1,024) and
#                                      # t5gemma-s-s (512 -> 114) likewise -> zoo-enc.json, zoo-enc.log
#   bash scripts/gpu_session.sh tests               # every `gpu` test (pytest -m gpu)
#   bash scripts/gpu_session.sh bench gpt2,bert     # bench/bench_gpu.py rows (extra flags pass on)
#   bash scripts/gpu_session.sh profile [CONFIG]    # the trainer's profiler on one bench row (default
#                                                   # llama-1b), eager and compiled, and profile-report
#   bash scripts/gpu_session.sh calibrate           # tformer plan --calibrate on this GPU (<= 2 min), then
#                                                   # bench/bench_plan_gpu.py with that profile against the
#                                                   # newest bench/results file (run it on that file's card)
#
# Budget (a session: 15 device-minutes, at most 10 a call, 30-60 s to start a machine). The H100
# session of 2026-11-28 (torch 2.11, one `all` of three contenders, the tests first) ran every
# family past its deadline before HF's compiled row, and the tests' 45 s ran out after 13 passed.
# Measured there, first (compiling) steps: tformer 16-28 s, the Trainer 0.9-12 s (inductor's cache
# warm from tformer's), HF 30-39 s (41-54 s on an H200); eager steps 0.2-0.66 s; a family's process
# builds its model on the CPU (up to ~15 s for llama-1b); `--family llama --compile on` with three
# contenders took ~110 s, bert ~80 s. So two calls on one warm machine:
#   all   505 s of deadlines + 10 s merge: tformer and HF, eager and compiled, ~85-115 s a family
#         (imports ~8, build 3-15, eager rows ~10, tformer's compile ~25, HF's ~40, steps a few)
#   more  260 s + ~5 s of wheel install: the float8 row 100 s (three compiles of an 11-layer
#         8B-wide model, ~25-30 s each, built on the GPU in seconds), the Trainer 120 s (each
#         family's process builds two Trainers on the CPU -- llama's ~15 s each -- and compiles
#         warm), the tests 30 s, the merge and the planner's prices 10 s
# Each step runs under its own deadline (`timeout`) and hands the seconds it leaves to the next,
# so one slow step cannot take the part past its call; the bench writes its JSON after every row,
# so a deadline loses only the row in flight. The micro-batch each contender settled on before on
# this device (--start-from: the newest bench/results file; for the Trainer, `all`'s session.json,
# where tformer's raw loop settled) spares the out-of-memory tries that cost a compiled contender
# a whole compile.
#
# GPU_SESSION_DRY=1 prints each step's command and deadline, runs nothing, and totals the budget
# (tests/test_gpu.py holds the parts to their limits that way, on a CPU). GPU_SESSION_TINY=1 runs
# `all` and `more` for real on this CPU with tiny presets (bench_gpu.py --tiny; the float8 row
# eager): the plumbing end to end (the long lane's test).
#
# The GPU machine has torch, transformers, tokenizers and safetensors but not every package the
# trainer imports; carry the missing ones (torchao for the float8 row among them) as wheels in
# .whl/ (scripts/gpu_wheels.sh fetches them on the CPU machine) and name .whl in the call's
# `carry`. Logs and JSON go to $OUT (or /tmp/gpu-out).
set -euo pipefail
cd "$(dirname "$0")/.."
part=${1:?usage: gpu_session.sh all | more | zoo | zoo-enc | tests | bench FAMILIES [extra bench_gpu.py flags] | calibrate | profile [CONFIG]}
out=${OUT:-/tmp/gpu-out}
dry=${GPU_SESSION_DRY:-}
work=${GPU_SESSION_WORK:-/tmp} # each step's own JSON, merged into $OUT's
tiny=()
fp8_tiny=()
stretch=1
if [ -n "${GPU_SESSION_TINY:-}" ]; then
    tiny=(--tiny --device cpu)
    fp8_tiny=(--compile off)
    stretch=4 # inductor compiles for a 2-core CPU several times slower than for a GPU host's 16
fi
mkdir -p "$out"
case $part in
all) log=session.log ;;
more) log=more.log ;;
zoo) log=zoo.log ;;
zoo-enc) log=zoo-enc.log ;;
tests) log=tests.log ;;
bench) log="bench-${2//,/-}.log" ;;
calibrate) log=calibrate.log ;;
profile) log="profile-${2:-llama-1b}.log" ;;
*)
    echo "unknown part '$part': use all, more, zoo, zoo-enc, tests, bench, calibrate or profile" >&2
    exit 2
    ;;
esac
log="$out/$log"
: >"$log"
exec > >(tee -a "$log") 2>&1
tee_pid=$!
# the call ends when this script does: let tee write the log's last lines first
trap 'exec >&- 2>&-; wait "$tee_pid"' EXIT
if [ -z "$dry" ] && [ ${#tiny[@]} -eq 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if [ -z "$dry" ] && [ ${#tiny[@]} -eq 0 ]; then # torch's and transformers' versions are in every bench JSON
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi

spare=0
planned=0
# step SECONDS WHAT COMMAND...: COMMAND under a deadline of SECONDS plus what earlier steps left
step() {
    local seconds=$1 what=$2 rc=0
    shift 2
    local deadline=$((seconds * stretch + spare)) began=$SECONDS
    planned=$((planned + seconds))
    if [ -n "$dry" ]; then
        echo "dry-run: $what: deadline $deadline s: $*"
    else
        # --foreground: the command stays in this script's process group, so whatever ends the
        # script (the device tool's limit, a test's deadline) ends the step with it
        timeout --foreground -k 5 "$deadline" "$@" || rc=$?
        [ "$rc" -eq 0 ] || echo "$what rc=$rc (deadline $deadline s)"
    fi
    spare=$((deadline - (SECONDS - began)))
    spare=$((spare > 0 ? spare : 0))
}
# budget LIMIT: the part's planned seconds against its limit (the dry run's check)
budget() {
    echo "budget: $planned s of deadlines planned, limit $1 s"
}
newest=$(find bench/results -maxdepth 1 -name '*.json' | sort | tail -n 1)
# a bench_gpu.py step's row settings for the session parts: warm-up and timed steps per contender
steps=(--no-generate --warmup 2 --steps 6 --compiled-warmup 1 --compiled-steps 4)

case $part in
tests)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py tests/test_flex.py
    ;;
bench)
    families=${2:?usage: gpu_session.sh bench FAMILIES (comma list of gpt2, llama, bert, t5)}
    shift 2
    python3 bench/bench_gpu.py --family "$families" --json "$out/bench-${families//,/-}.json" "$@"
    ;;
calibrate)
    timeout 150 python3 -m tformer plan --calibrate "$out/gpu-profile.json"
    python3 bench/bench_plan_gpu.py --gpu "$out/gpu-profile.json" "$newest" || echo "bench_plan_gpu rc=$?"
    ;;
all)
    parts=()
    for family_s in gpt2:120 llama:150 bert:110 t5:125; do
        family=${family_s%%:*}
        rm -f "$work/gpu-$family.json" # an earlier session's file must not pass for this one's
        step "${family_s##*:}" "$family" python3 bench/bench_gpu.py "${tiny[@]}" --family "$family" --compile off,on \
            --contenders tformer,HF "${steps[@]}" ${newest:+--start-from "$newest"} --json "$work/gpu-$family.json"
        parts+=("$work/gpu-$family.json")
    done
    step 10 merge python3 scripts/gpu_merge.py "$out/session.json" "${parts[@]}"
    budget 540
    ;;
zoo | zoo-enc)
    # as `all`, for the zoo: the MoE rows build tens of GB on the CPU first (the cut model), so
    # their deadlines are longer than a family's of the same step time
    parts=()
    zoo_rows=(qwen3:100 qwen3_moe:120 deepseek_v3:120 gpt_oss:120)
    limit=540
    if [ "$part" = zoo-enc ]; then
        zoo_rows=(modernbert:110 t5gemma:130)
        limit=270
    fi
    for family_s in "${zoo_rows[@]}"; do
        family=${family_s%%:*}
        rm -f "$work/gpu-$family.json"
        step "${family_s##*:}" "$family" python3 bench/bench_gpu.py "${tiny[@]}" --family "$family" --compile off,on \
            --contenders tformer,HF "${steps[@]}" --json "$work/gpu-$family.json"
        parts+=("$work/gpu-$family.json")
    done
    step 10 merge python3 scripts/gpu_merge.py "$out/$part.json" "${parts[@]}"
    budget "$limit"
    ;;
more)
    session="$out/session.json" # `all`'s, when it ran on this machine: where tformer settled
    prior=$newest
    if [ -f "$session" ]; then
        prior=$session
    fi
    rm -f "$work/gpu-fp8.json"
    step 100 fp8 python3 bench/bench_gpu.py "${tiny[@]}" --precision fp8 "${fp8_tiny[@]}" --compiled-warmup 1 \
        --compiled-steps 4 --json "$work/gpu-fp8.json"
    parts=("$work/gpu-fp8.json")
    # llama last: its two CPU model builds (~15 s each) make it the one a short budget cuts
    for family_s in gpt2:25 bert:25 t5:25 llama:45; do
        family=${family_s%%:*}
        rm -f "$work/gpu-trainer-$family.json"
        step "${family_s##*:}" "trainer $family" python3 bench/bench_gpu.py "${tiny[@]}" --family "$family" --compile off,on \
            --contenders trainer "${steps[@]}" ${prior:+--start-from "$prior"} --json "$work/gpu-trainer-$family.json"
        parts+=("$work/gpu-trainer-$family.json")
    done
    # the fast subset: no compiled recipe (~20 s each), no DDP/FSDP2 world of one (27 s), no NCCL
    # flight recorder (a process of its own); `tests` runs them all. -v: a cut run still names what passed
    step 30 tests python3 -m pytest -v -m gpu -p no:cacheprovider tests/test_gpu.py \
        -k "not compiled_blocks and not world_of_one and not watchdog and not llama_compiled"
    step 10 "merge and planner" python3 scripts/gpu_merge.py "$out/more.json" "${parts[@]}" "$log" --price "$session"
    budget 270
    ;;
profile)
    # Where a row's step goes, by the trainer's own profiler (profile.steps) and `tformer
    # profile-report` (device time split into GEMMs / attention / other / optimizer / idle, the top
    # ops, the plan beside it): the bench row's shape (seq 2048, micro-batch 8, bf16, synthetic
    # data), eager then compiled. Budget: ~15 s to build llama-1b, the steps, a final checkpoint of
    # ~15 GB (deleted after), ~20 s of compile: under 3 minutes for both.
    config=${2:-llama-1b}
    for compiled in false true; do
        run=$work/gpu-profile-$config-$compiled
        rm -rf "$run"
        step 120 "train compile=$compiled" python3 -m tformer train "configs/$config.yaml" data.source=synthetic \
            micro_batch_size=8 grad_accum=1 max_steps=6 profile.steps=5-6 eval_every=0 eval_batches=1 save_every=0 \
            log_every=1 precision=bf16 compile=$compiled progress=false output_dir="$run"
        rm -rf "$run/checkpoints"
        step 20 "profile-report compile=$compiled" python3 -m tformer profile-report "$run" --no-png
    done
    budget 300
    ;;
esac
