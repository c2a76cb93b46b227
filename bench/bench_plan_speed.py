"""The time model (tformer/plan/time.py) against step times measured on this machine.

With the calibrated CPU profile (``tformer plan --calibrate``, run first unless ``--profile`` names
one), the trainer runs tiny GPT-2 and T5 (configs/gpt2-tiny.yaml, configs/t5-tiny.yaml; fp32, one
thread per process) as 1 process, DDP 2, FSDP 2, tp=2 and pp=2 (1f1b, 2 micro-batches), each for a
few steps; its median step time after two warm-up steps is held against the predicted one.
Targets (issue 30): every layout within 25% of the measured median, and the predicted order of the
layouts equal to the measured order, per model. Two layouts whose medians are apart by less than
the larger of their spreads over the rounds are a tie the machine did not settle (pp=2 and FSDP 2
measure within 1-3% of each other here, and one layout's median moves by up to 15% between
sessions): the order is checked for every other pair, and the number of pairs checked is printed.
A run that leaves fewer than half of the pairs outside a tie (``MIN_CHECKED``) fails: on a noisy
machine every spread is wide, every pair a tie, and a reversed prediction would pass unseen.

Each layout runs once per round (``--rounds``, default 3), the layouts interleaved, so that a slow
period of the shared machine falls on all of them. Each round calibrates first (unless
``--profile`` names a profile) and predicts its own runs: back-to-back calibrations of this machine
moved the predictions by 20-54%, its speed drifting over minutes, so a profile measured in the
minutes of the runs it predicts compares like with like. A layout's error is the median over
rounds of its round's prediction over its round's measurement; the spreads (max - min over the
median) of both are printed beside it, and the order is that of the medians.

Last results (AVX2 CPU, 2026-11-25, docs/planning.md "How close it is today"): PASS, gpt2-tiny 1
process -4%, DDP 2 -9%, FSDP 2 -4%, tp=2 -14%, pp=2 -5%; t5-tiny -15%, -13%, -20%, -19%, -3%; order
exact for gpt2, for t5 kept outside the ties (FSDP, tp and pp within their spreads). Two of three
runs that day passed. Before the CPU terms of 2026-11-25 (1-rank FSDP2 groups, DTensor costs
measured on a TP-split model, shared cores, pipeline stages alone in the bubble, per-round
calibration): 7 of 10 within 25%, tp=2 37-41% too fast and out of order; before the host term
every layout was 29-82% too fast.

Timings only mean something on a quiet machine: calibration and the runs share the cores with
whatever else runs. Run it alone:

    PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python bench/bench_plan_speed.py [--steps 12] [--profile P]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
from pathlib import Path

from bench_scale import ROOT, _become_rank, _port

from tformer.plan import Layout, load_profile, step_time
from tformer.plan.calibrate import calibrate, spawn_with_deadline
from tformer.train.trainer import cpu_has_native_bf16

MODELS = {"gpt2": "gpt2-tiny.yaml", "t5": "t5-tiny.yaml"}
# name: (processes, trainer overrides, the same layout for the time model)
LAYOUTS = {
    "1 process": (1, ["parallel.strategy=ddp"], Layout("ddp", precision="fp32")),
    "ddp 2": (2, ["parallel.strategy=ddp"], Layout("ddp", dp_shard=2, precision="fp32")),
    "fsdp 2": (2, ["parallel.strategy=fsdp"], Layout("fsdp", dp_shard=2, precision="fp32")),
    "tp=2": (
        2,
        ["parallel.strategy=fsdp", "parallel.tp=2", "loss.chunk_size=null"],
        Layout(tp=2, sp=False, precision="fp32"),
    ),
    "pp=2": (
        2,
        ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.pp_schedule=1f1b", "grad_accum=2"],
        Layout(pp=2, n_micro=2, precision="fp32"),
    ),
}
DEADLINE_S = 900
MIN_CHECKED = 0.5  # of the pairs of layouts, the share whose order must be checked (not tied)


def common(steps: int, out: str) -> list[str]:
    return [
        "precision=fp32",
        f"max_steps={steps}",
        "eval_every=0",
        "save_every=0",
        "progress=false",
        "log_every=1000",
        "resume=none",
        f"output_dir={out}",
    ]


def _worker(rank, world, port, config, overrides, result, cache):
    _become_rank(rank, world, port, cache)
    import torch.distributed as dist

    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    cfg = load_config(ROOT / "configs" / config, overrides)
    times: list[float] = []
    Trainer(cfg, callbacks=[lambda tr, rec: times.append(rec["step_time"])]).fit()
    if rank == 0:
        Path(result).write_text(json.dumps({"median": statistics.median(times[2:] or times)}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def measure(world: int, config: str, overrides: list[str], tmp: Path, cache: str) -> float:
    result = tmp / "result.json"
    result.unlink(missing_ok=True)
    args = (world, _port(), config, overrides, str(result), cache)
    spawn_with_deadline(_worker, args, world, DEADLINE_S, f"FAIL: {config} {overrides}")
    return json.loads(result.read_text())["median"]


def predict(config: str, overrides: list[str], layout: Layout, hw, steps: int, out: str) -> float:
    """The time model's step for ``layout`` of the run ``config`` + ``overrides`` would be."""
    from tformer.train.config import load_config

    run = load_config(ROOT / "configs" / config, common(steps, out) + overrides)
    layout = Layout(**{**layout.__dict__, "micro_batch": run.micro_batch_size, "loss_chunk": run.loss.chunk_size})
    target = run.data.target_len
    if run.model.family == "encdec" and target is None:
        from tformer.data import t5_lengths

        target = t5_lengths(run.data.seq_len)[1]
    return step_time(run.model, layout, hw, run.data.seq_len, target, memory=False).step


def tied(a: str, b: str, measured: dict[str, float], spreads: dict[str, float]) -> bool:
    """Two layouts whose medians are apart by less than the larger of their spreads over the rounds
    (max - min over the median): the machine did not tell which is faster, so neither order is
    wrong."""
    gap = abs(measured[a] - measured[b]) / min(measured[a], measured[b])
    return gap < max(spreads[a], spreads[b])


def misordered(measured: dict[str, float], guess: dict[str, float], spreads: dict[str, float]) -> list[tuple[str, str]]:
    """The pairs (faster, slower as measured) the prediction puts the other way round, ties aside."""
    wrong = []
    for a, b in itertools.combinations(measured, 2):
        if tied(a, b, measured, spreads):
            continue
        fast, slow = (a, b) if measured[a] < measured[b] else (b, a)
        if guess[fast] >= guess[slow]:
            wrong.append((fast, slow))
    return wrong


def order_verdict(measured: dict[str, float], guess: dict[str, float], spreads: dict[str, float]) -> tuple[bool, list[str]]:
    """(the order holds, the lines that say so): no pair the machine told apart is predicted the
    other way round, and at least ``MIN_CHECKED`` of the pairs were told apart at all."""
    pairs = list(itertools.combinations(measured, 2))
    ties = [(a, b) for a, b in pairs if tied(a, b, measured, spreads)]
    wrong = misordered(measured, guess, spreads)
    checked = len(pairs) - len(ties)
    enough = checked >= MIN_CHECKED * len(pairs)
    return not wrong and enough, [
        f"measured order:  {' < '.join(sorted(measured, key=measured.__getitem__))}",
        f"predicted order: {' < '.join(sorted(guess, key=guess.__getitem__))}",
        f"tied (apart by less than their spread): {', '.join(f'{a} ~ {b}' for a, b in ties) or 'none'}",
        f"order checked on {checked} of {len(pairs)} pairs"
        + ("" if enough else f": fewer than {MIN_CHECKED:.0%}, the machine was too noisy to check the order"),
        f"out of order: {', '.join(f'{a} < {b} measured' for a, b in wrong) or 'none'}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3, help="every layout once per round, interleaved")
    parser.add_argument("--profile", default=None, help="a profile from tformer plan --calibrate (default: calibrate now)")
    args = parser.parse_args()

    ok = True
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        out = str(tmp / "run")
        keys = [(model, name) for model in MODELS for name in LAYOUTS]
        runs: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
        guesses: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
        for r in range(args.rounds):
            # the profile measured in the same minutes as the round it predicts: this shared machine's
            # speed drifts by 20-50% between calibrations a few minutes apart
            hw = load_profile(args.profile) if args.profile else calibrate(tmp / f"cpu{r}.json", tmp)
            fp32, gloo = hw.peak["fp32"] / 1e9, hw.intra_bandwidth / 1e9
            print(f"round {r + 1}: {hw.source}; fp32 {fp32:.1f} GFLOP/s, gloo {gloo:.2f} GB/s")
            # every layout once per round, so that a slow period of the machine falls on all of them
            for model, config in MODELS.items():
                for name, (world, overrides, layout) in LAYOUTS.items():
                    guesses[model, name].append(predict(config, overrides, layout, hw, args.steps, out))
                    step = measure(world, config, common(args.steps, out) + overrides, tmp, str(tmp / "cache"))
                    runs[model, name].append(step)
        for model, config in MODELS.items():
            print(f"\n{model} ({config}), fp32, median step after 2 warm-up of {args.steps}, of {args.rounds} rounds:")
            print(f"{'layout':<12}{'measured s':>11}{'spread':>8}{'predicted s':>12}{'spread':>8}{'error':>8}")
            measured = {name: statistics.median(runs[model, name]) for name in LAYOUTS}
            guess = {name: statistics.median(guesses[model, name]) for name in LAYOUTS}
            spreads = {name: (max(runs[model, name]) - min(runs[model, name])) / measured[name] for name in LAYOUTS}
            for name in LAYOUTS:
                # each round's prediction against its own measurement, the median over rounds
                error = statistics.median(g / m for g, m in zip(guesses[model, name], runs[model, name])) - 1
                ok &= abs(error) <= 0.25
                g = guesses[model, name]
                print(
                    f"{name:<12}{measured[name]:>11.4f}{spreads[name]:>8.0%}{guess[name]:>12.4f}"
                    f"{(max(g) - min(g)) / guess[name]:>8.0%}{error:>+8.0%}"
                )
            in_order, lines = order_verdict(measured, guess, spreads)
            ok &= in_order
            print("\n".join(lines))
    kind = "AVX512-BF16" if cpu_has_native_bf16() else "AVX2"
    print(
        f"\n{'PASS' if ok else 'FAIL'}: every layout within 25% of its measured median and the order kept "
        f"on at least {MIN_CHECKED:.0%} of the pairs ({kind} CPU)"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
