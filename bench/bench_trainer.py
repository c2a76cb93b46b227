"""Trainer overhead and start-up time.

1. Tokens/s of ``Trainer.fit`` (everything in its loop: accumulation, clipping, scheduler, metrics,
   JSONL, progress bar) against a bare forward + backward + AdamW loop over the same model and the
   same batches, interleaved in rounds in one process. Target: >= 0.95x.
2. Time from ``tformer train configs/gpt2-tiny.yaml`` starting to its first logged step, with the
   tokenizer and token caches warm (a second start). Target: <= 15 s.

    .venv/bin/python bench/bench_trainer.py [--steps 30] [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tformer.models import build_model  # noqa: E402
from tformer.train.config import load_config  # noqa: E402
from tformer.train.optim import build_optimizer  # noqa: E402
from tformer.train.trainer import Trainer  # noqa: E402

RECIPE = ROOT / "configs" / "gpt2-tiny.yaml"


def trainer_rate(cfg_args: list[str], steps: int, out: Path) -> float:
    stamps = []
    cfg = load_config(RECIPE, cfg_args + [f"output_dir={out}", f"max_steps={steps}", "resume=none"])
    t = Trainer(cfg, callbacks=[lambda tr, rec: stamps.append(time.perf_counter())])
    t.fit()
    per_step = cfg.micro_batch_size * cfg.data.seq_len
    # the first step warms up allocators; time the rest, everything in the loop included
    return per_step * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def bare_rate(cfg_args: list[str], steps: int, out: Path) -> float:
    cfg = load_config(RECIPE, cfg_args + [f"output_dir={out}", f"max_steps={steps}", "resume=none"])
    t = Trainer(cfg)  # for its data and model config only
    torch.manual_seed(cfg.seed)
    model = build_model(t.model_cfg)
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    ds, collate = t.data.train, t.data.collator
    b = cfg.micro_batch_size
    batches = [collate([ds[i * b + j] for j in range(b)]) for i in range(steps)]
    stamps = []
    for batch in batches:
        loss = model(batch["input_ids"], labels=batch["labels"]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return b * cfg.data.seq_len * (len(stamps) - 1) / (stamps[-1] - stamps[0])


def first_step_seconds(out: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [sys.executable, "-m", "tformer", "train", str(RECIPE), f"output_dir={out}", "max_steps=3",
            "log_every=1", "eval_every=0", "save_every=0", "progress=false", "resume=none"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    while proc.poll() is None and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.05)
    elapsed = time.perf_counter() - t0
    proc.wait()
    return elapsed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    common = ["precision=fp32", "eval_every=0", "save_every=0", "log_every=10", "progress=true"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        first_step_seconds(tmp / "warm")  # fills the tokenizer and token caches
        starts = [first_step_seconds(tmp / f"start{i}") for i in range(3)]
        bare, trainer = [], []
        for r in range(args.rounds):  # interleaved rounds: noise hits both contenders alike
            bare.append(bare_rate(common, args.steps, tmp / f"bare{r}"))
            trainer.append(trainer_rate(common, args.steps, tmp / f"trainer{r}"))
    print("\n=== trainer benchmark (gpt2-tiny recipe, fp32, CPU) ===")
    print(f"bare loop tokens/s   : median {statistics.median(bare):,.0f}  (rounds: "
          f"{', '.join(f'{x:,.0f}' for x in bare)})")
    print(f"trainer tokens/s     : median {statistics.median(trainer):,.0f}  (rounds: "
          f"{', '.join(f'{x:,.0f}' for x in trainer)})")
    ratio = statistics.median(trainer) / statistics.median(bare)
    print(f"trainer / bare       : {ratio:.3f}x   target >= 0.95x  {'PASS' if ratio >= 0.95 else 'MISS'}")
    best = min(starts)
    print(f"start -> first step  : {', '.join(f'{s:.1f}s' for s in starts)} (warm caches)  "
          f"target <= 15 s  {'PASS' if best <= 15 else 'MISS'}")


if __name__ == "__main__":
    main()
