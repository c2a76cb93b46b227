"""Muon against AdamW: the optimizer-inclusive step time on 2 ranks (FSDP2, fp32, gpt2-tiny) and, with
``--converge``, the final validation loss of 400-step runs over a small learning-rate sweep.

    .venv/bin/python bench/bench_muon.py [--steps 30] [--converge] [--config llama-tiny]
        [--adamw-lrs 1e-3,3e-3] [--muon-lrs 1e-2,3e-2] [--no-step-time] [--results FILE]

``--config`` names a recipe of configs/ (gpt2-tiny, llama-tiny, mixtral-tiny...); ``--results``
appends one JSON line per finished run (resumable by hand: run the missing lrs and merge). An MoE
recipe's verdict is "no worse" (Muon's best at most AdamW's), a dense one's "below".

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


def run(out: Path, steps: int, ranks: int, *flags: str, config: str = "gpt2-tiny") -> list[dict]:
    cmd = [sys.executable, "-m", "tformer", "train", str(ROOT / f"configs/{config}.yaml"), f"output_dir={out}"]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "-m", "tformer", *cmd[3:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    subprocess.run([*cmd, f"max_steps={steps}", *SMALL, *flags], check=True, env=env, capture_output=True, timeout=1800)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


TARGET = 1.3  # issue 55: Muon's optimizer-inclusive step at most 1.3x AdamW's (2-rank FSDP2, fp32)


def ratio_line(adamw: list[float], muon: list[float], target: float = TARGET) -> str:
    """The verdict on the step times (seconds per step of each run): PASS within ``target``, MISS
    above it, FAIL when either side timed no step (a run that did not train is not fast)."""
    if not adamw or not muon or min(adamw + muon) <= 0:
        return f"FAIL: Muon / AdamW step time not measured (steps timed: AdamW {len(adamw)}, Muon {len(muon)})"
    a, m = statistics.median(adamw), statistics.median(muon)
    verdict = "PASS" if m / a <= target else "MISS"
    times = f"AdamW {a * 1e3:.1f} ms, Muon {m * 1e3:.1f} ms"
    return f"{verdict}: Muon / AdamW step time {m / a:.2f}x ({times}; target <= {target}x)"


def best_line(finals: dict[tuple[str, float], float], no_worse: bool = False) -> str:
    """The convergence verdict: each optimizer's best final validation loss over its sweep; PASS
    when Muon's is below AdamW's (``no_worse``: at most AdamW's), MISS otherwise, FAIL when a side
    has no finite result."""
    best = {}
    for name in ("adamw", "muon"):
        got = {lr: v for (n, lr), v in finals.items() if n == name and v == v}
        if not got:
            return f"FAIL: no finished {name} run"
        lr = min(got, key=got.get)
        best[name] = (got[lr], lr)
    (a, alr), (m, mlr) = best["adamw"], best["muon"]
    verdict = "PASS" if (m <= a if no_worse else m < a) else "MISS"
    return f"{verdict}: best val_loss Muon {m:.4f} (lr {mlr:g}) vs AdamW {a:.4f} (lr {alr:g})"


def step_ratio(steps: int, tmp: Path) -> None:
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    for rep in range(2):
        for name in times:
            flags = ["parallel.strategy=fsdp", f"optim.name={name}"]
            rows = run(tmp / f"{name}{rep}", steps, 2, *flags)
            times[name] += [r["step_time"] for r in rows[5:] if "step_time" in r]  # past the first steps
    print("2-rank FSDP2 fp32 gpt2-tiny, interleaved runs:")
    print(ratio_line(times["adamw"], times["muon"]))


SWEEP = (1e-3, 3e-3, 1e-2)


def converge(tmp: Path, config: str, sweep: dict[str, tuple[float, ...]], results: Path | None) -> None:
    """400 steps per (optimizer, lr) on one process, warmup 40, cosine, fp32; the final val_loss."""
    finals: dict[tuple[str, float], float] = {}
    for name, lrs in sweep.items():
        for lr in lrs:
            flags = [f"optim.name={name}", f"optim.lr={lr}", "optim.warmup_steps=40", "eval_every=400"]
            rows = run(tmp / f"c-{name}-{lr}", 400, 1, *flags, config=config)
            val = [r["val_loss"] for r in rows if "val_loss" in r]
            finals[(name, lr)] = val[-1] if val else float("nan")
            print(f"{config} {name:<6} lr {lr:<7g} final val_loss {finals[(name, lr)]:.4f}", flush=True)
            if results is not None:
                line = {"config": config, "optim": name, "lr": lr, "val_loss": finals[(name, lr)]}
                with results.open("a") as f:
                    f.write(json.dumps(line) + "\n")
    if all(sweep.values()):
        print(best_line(finals, no_worse="mixtral" in config or "moe" in config))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--converge", action="store_true")
    p.add_argument("--config", default="gpt2-tiny", help="the recipe of the convergence runs (configs/NAME.yaml)")
    p.add_argument("--adamw-lrs", default=",".join(map(str, SWEEP)), help="comma-separated; empty: none")
    p.add_argument("--muon-lrs", default=",".join(map(str, SWEEP)), help="comma-separated; empty: none")
    p.add_argument("--no-step-time", action="store_true", help="skip the 2-rank step-time comparison")
    p.add_argument("--results", type=Path, help="append each convergence run's final val_loss here (JSON lines)")
    args = p.parse_args()
    lrs = {n: tuple(float(x) for x in getattr(args, f"{n}_lrs").split(",") if x) for n in ("adamw", "muon")}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_step_time:
            step_ratio(args.steps, Path(tmp))
        if args.converge:
            converge(Path(tmp), args.config, lrs, args.results)


if __name__ == "__main__":
    main()
