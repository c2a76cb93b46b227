"""What profiling costs: a traced step at most 1.3x an untraced one, and the untraced steps of a
profiled run as fast as a run without profiling (within the noise measured in the same process).

Two gpt2-tiny runs (the recipe's size, fp32, one thread), interleaved in one process so the
machine's load falls on both alike: ``off`` (no profile section) and ``on`` (``profile.steps``
traced every ``--every`` steps). Per step, from metrics.jsonl: the median of the traced steps
over the median of the ``on`` run's other steps (target <= 1.3), and the median of those other
steps over the ``off`` run's median (target: within the noise, the spread of the ``off`` run's
own medians over its halves, or 2% where that is smaller). The warm-up step before each traced
one (the profiler starts there) is reported, not judged. ``PASS``/``MISS`` lines; a MISS sets the exit code.

    python bench/bench_profile.py [--steps 60 --every 10 --rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACED_TARGET = 1.3
NOISE_FLOOR = 0.02  # two medians of one run's halves can agree by chance: the noise is at least this


def run(out: Path, steps: int, profile: list[str]) -> list[dict]:
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    overrides = [
        f"output_dir={out}",
        "precision=fp32",
        "progress=false",
        "log_every=1",
        f"max_steps={steps}",
        "eval_every=0",
        "save_every=0",
        "eval_batches=1",
        *profile,
    ]
    with contextlib.redirect_stdout(io.StringIO()):  # the step lines: metrics.jsonl has them
        Trainer(load_config(ROOT / "configs" / "gpt2-tiny.yaml", overrides)).fit()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "loss" in line]


def traced_line(traced: float, other: float) -> str:
    ratio = traced / other
    verdict = "PASS" if ratio <= TRACED_TARGET else "MISS"
    return (
        f"{verdict} traced step {traced * 1e3:.1f} ms = {ratio:.2f}x an untraced one "
        f"({other * 1e3:.1f} ms; target <= {TRACED_TARGET})"
    )


def other_line(other: float, off: float, noise: float) -> str:
    ratio = other / off
    verdict = "PASS" if ratio <= 1 + max(noise, NOISE_FLOOR) else "MISS"
    return (
        f"{verdict} untraced steps of a profiled run {other * 1e3:.1f} ms = {ratio:.3f}x a run without "
        f"profiling ({off * 1e3:.1f} ms; target within the noise: {noise:.1%} measured, {NOISE_FLOOR:.0%} at least)"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2, help="off/on pairs, interleaved")
    args = p.parse_args()
    torch.set_num_threads(1)
    import logging

    logging.getLogger("tformer").setLevel(logging.ERROR)
    traced_steps = set(range(args.every, args.steps + 1, args.every))
    skip = 3  # the first steps: allocation and warm-up, in both runs
    off, on_traced, on_other, on_warm = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            rows = run(Path(tmp) / f"off{r}", args.steps, [])
            off += [x["step_time"] for x in rows if x["step"] > skip]
            rows = run(Path(tmp) / f"on{r}", args.steps, [f"profile.steps={args.every}", f"profile.every={args.every}"])
            warm = {s - 1 for s in traced_steps}  # the schedule's warm-up steps: profiler start-up
            on_traced += [x["step_time"] for x in rows if x["step"] in traced_steps]
            on_warm += [x["step_time"] for x in rows if x["step"] in warm]
            on_other += [x["step_time"] for x in rows if x["step"] > skip and x["step"] not in traced_steps | warm]
    half = len(off) // 2
    noise = abs(statistics.median(off[:half]) / statistics.median(off[half:]) - 1)
    other = statistics.median(on_other)
    lines = [
        f"bench_profile: gpt2-tiny recipe, fp32, 1 thread, {args.rounds} x {args.steps} steps per run, "
        f"{len(on_traced)} traced steps; torch {torch.__version__}",
        traced_line(statistics.median(on_traced), other),
        other_line(other, statistics.median(off), noise),
        f"(warm-up steps, the profiler starting: {statistics.median(on_warm) / other:.2f}x an untraced step)",
    ]
    print("\n".join(lines))
    return 0 if all(not line.startswith("MISS") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
