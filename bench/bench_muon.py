"""Muon against AdamW: the optimizer-inclusive step time on 2 ranks (FSDP2, fp32, gpt2-tiny) and, with
``--converge``, the final validation loss of 400-step runs over a small learning-rate sweep.

    .venv/bin/python bench/bench_muon.py [--steps 30] [--converge]

Runs go through torchrun (2 gloo ranks, one thread each) and the trainer's own metrics; the step-time
ratio is the median logged ``step_time`` of Muon's run over AdamW's, contenders interleaved (A B A B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["precision=fp32", "progress=false", "log_every=1", "eval_every=0", "save_every=0", "model.dropout=0.0"]


def run(out: Path, steps: int, ranks: int, *flags: str) -> list[dict]:
    cmd = [sys.executable, "-m", "tformer", "train", str(ROOT / "configs/gpt2-tiny.yaml"), f"output_dir={out}"]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "-m", "tformer", *cmd[3:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([*cmd, f"max_steps={steps}", *SMALL, *flags], check=True, env=env, capture_output=True, timeout=1800)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def step_ratio(steps: int, tmp: Path) -> None:
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    for rep in range(2):
        for name in times:
            flags = ["parallel.strategy=fsdp", f"optim.name={name}"]
            rows = run(tmp / f"{name}{rep}", steps, 2, *flags)
            times[name] += [r["step_time"] for r in rows[5:] if "step_time" in r]  # past the first steps
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"2-rank FSDP2 fp32 gpt2-tiny: AdamW {med['adamw'] * 1e3:.1f} ms, Muon {med['muon'] * 1e3:.1f} ms per step")
    print(f"Muon / AdamW step time: {med['muon'] / med['adamw']:.2f}x (target <= 1.3x)")


def converge(tmp: Path) -> None:
    for name, lrs in (("adamw", (1e-3, 3e-3, 1e-2)), ("muon", (1e-3, 3e-3, 1e-2))):
        for lr in lrs:
            flags = [f"optim.name={name}", f"optim.lr={lr}", "optim.warmup_steps=40", "eval_every=400"]
            rows = run(tmp / f"c-{name}-{lr}", 400, 1, *flags)
            val = [r["val_loss"] for r in rows if "val_loss" in r]
            print(f"{name:<6} lr {lr:<7g} final val_loss {val[-1]:.4f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--converge", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        step_ratio(args.steps, Path(tmp))
        if args.converge:
            converge(Path(tmp))


if __name__ == "__main__":
    main()
