"""Trainer overhead and start-up time.

1. Tokens/s of ``Trainer.fit`` (everything in its loop: accumulation, clipping, scheduler, metrics,
   JSONL, progress bar) against a bare forward + backward + AdamW loop over the same weights, the
   trainer's own batches and the same loss computation (the chunked, loss-only head), interleaved
   in rounds in one process. Target: >= 0.95x. Like with like is checked: both first losses must be
   equal (the same weights, batch and head), and both runs finish every step with a finite loss;
   otherwise the line reads FAIL.
2. Time from ``tformer train configs/gpt2-tiny.yaml`` starting to its first logged step, with the
   tokenizer and token caches warm (a second start). Target: <= 15 s, and every start must log a
   step and exit 0 (FAIL otherwise, with the run's last error line).
3. Time the loop is blocked by a checkpoint save, ``checkpoint.async=true`` against a synchronous
   save, for the ``gpt2-small`` preset (124M parameters, fp32 + AdamW: ~2 GB per checkpoint) on
   CPU: one trainer after one step, its manager switched between the two modes, saves
   interleaved. Target: async / sync <= 0.25x. Measured on a 2-core AVX2 EPYC (shared), median
   of 3: sync 6.28 s, async 0.75 s blocked (0.12x; the staging copy of ~1.5 GB is ~0.5 s of it),
   its write and commit done 6.5 s later in the background. 0.20x with the suite running beside it.

4. Lines of code of ``train/``, ``checkpoint/``, ``parallel/`` and ``export/`` (non-blank, non-comment
   Python lines) at a base commit (default d6f024f, where the "house a newcomer can carry on" review
   was written) and now, read from git (``--only loc``: no timing).

    .venv/bin/python bench/bench_trainer.py [--steps 30] [--rounds 3] [--only trainer|start|save|loc]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tformer.models import build_model  # noqa: E402
from tformer.train.config import load_config  # noqa: E402
from tformer.train.loop.optim import build_optimizer  # noqa: E402
from tformer.train.trainer import Trainer  # noqa: E402

RECIPE = ROOT / "configs" / "gpt2-tiny.yaml"


class Rate(NamedTuple):
    tokens_per_s: float
    losses: list[float]  # one per step: what was timed, for the checks


def _rate(cfg, stamps: list[float], losses: list[float]) -> Rate:
    # the first step warms up allocators; time the rest, everything in the loop included
    per_step = cfg.micro_batch_size * cfg.data.seq_len
    return Rate(per_step * (len(stamps) - 1) / (stamps[-1] - stamps[0]), losses)


def trainer_rate(cfg_args: list[str], steps: int, out: Path) -> Rate:
    stamps, losses = [], []

    def record(tr, rec):
        stamps.append(time.perf_counter())
        losses.append(rec["loss"])

    cfg = load_config(RECIPE, cfg_args + [f"output_dir={out}", f"max_steps={steps}", "resume=none"])
    Trainer(cfg, callbacks=[record]).fit()
    return _rate(cfg, stamps, losses)


def bare_rate(cfg_args: list[str], steps: int, out: Path) -> Rate:
    """The same step without the trainer: its initial weights, its batches (sampler and collator),
    its head (chunked, loss only) and its optimizer settings; no clipping, schedule or logging."""
    cfg = load_config(RECIPE, cfg_args + [f"output_dir={out}", f"max_steps={steps}", "resume=none"])
    t = Trainer(cfg)  # for its data, initial weights and batches only
    model = build_model(t.model_cfg)
    model.load_state_dict(t.model.state_dict())
    model.loss_chunk_size = t.model.loss_chunk_size  # the trainer's, loss.chunk_size=auto resolved
    opt = build_optimizer(model, cfg.optim, torch.device("cpu"))
    it = t._batches()
    keys = t.data.model_inputs
    batches = [{k: v for k, v in next(it).items() if k in keys} for _ in range(steps)]
    stamps, losses = [], []
    for batch in batches:
        loss = model(**batch, return_logits=False, label_smoothing=cfg.optim.label_smoothing).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
        losses.append(loss.item())
    return _rate(cfg, stamps, losses)


def verdict(succeeded: bool, met: bool) -> str:
    """PASS only when what was timed did what it should and met the target."""
    return "FAIL" if not succeeded else "PASS" if met else "MISS"


def overhead_line(bare: list[Rate], trainer: list[Rate], steps: int, target: float = 0.95) -> str:
    """trainer / bare: FAIL unless every run finished its steps with finite losses and both sides
    started from the same loss (the same weights, batch and head: like with like)."""
    runs = bare + trainer
    finished = all(len(r.losses) == steps and all(map(math.isfinite, r.losses)) for r in runs)
    same = finished and all(math.isclose(r.losses[0], runs[0].losses[0], rel_tol=1e-5) for r in runs)
    ratio = statistics.median(r.tokens_per_s for r in trainer) / statistics.median(r.tokens_per_s for r in bare)
    why = "" if same else "  (a run did not finish, or the two sides did not start from the same loss)"
    return f"trainer / bare       : {ratio:.3f}x   target >= {target}x  {verdict(same, ratio >= target)}{why}"


class Start(NamedTuple):
    seconds: float
    returncode: int | None  # None: killed at the deadline
    logged: bool  # a step reached metrics.jsonl
    error: str  # the run's last stderr line


def start_line(starts: list[Start], target: float = 15.0) -> str:
    ok = all(s.returncode == 0 and s.logged for s in starts)
    line = (
        f"start -> first step  : {', '.join(f'{s.seconds:.1f}s' for s in starts)} (warm caches)  "
        f"target <= {target:g} s  {verdict(ok, min(s.seconds for s in starts) <= target)}"
    )
    bad = next((s for s in starts if s.returncode != 0 or not s.logged), None)
    if bad is not None:
        line += f"  (exit {bad.returncode}, step logged: {bad.logged}: {bad.error})"
    return line


def first_step_seconds(out: Path, timeout: float = 600, env: dict | None = None) -> Start:
    env = dict(env or os.environ, PYTHONPATH=str(ROOT))
    args = [
        sys.executable,
        "-m",
        "tformer",
        "train",
        str(RECIPE),
        f"output_dir={out}",
        "max_steps=3",
        "log_every=1",
        "eval_every=0",
        "save_every=0",
        "progress=false",
        "resume=none",
    ]
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        metrics = out / "metrics.jsonl"
        while proc.poll() is None and not (metrics.is_file() and metrics.read_text().strip()):
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        err.seek(0)
        lines = err.read().strip().splitlines()
    logged = metrics.is_file() and bool(metrics.read_text().strip())
    return Start(elapsed, code, logged, lines[-1] if lines else "")


def save_blocking(out: Path, rounds: int) -> tuple[list[float], list[float], list[float]]:
    """(sync save seconds, async save seconds the loop is blocked, async background write seconds)
    of one gpt2-small trainer, interleaved: the same run, the same state, the same disk."""
    base = {
        "model": {"preset": "gpt2-small"},
        "data": {"tokenizer_vocab_size": 4096, "seq_len": 64},
        "micro_batch_size": 1,
        "precision": "fp32",
        "eval_every": 0,
        "save_every": 0,
        "progress": False,
        "keep_checkpoints": 1,
        "output_dir": str(out),
        "resume": "none",
        "max_steps": 10**6,
        "checkpoint": {"async": True},
    }
    t = Trainer(load_config(None, base=base))
    t._train_step(t._batches())  # the optimizer state exists: a full-size checkpoint
    sync, blocked, written = [], [], []
    for _ in range(rounds):
        for background in (False, True):
            t.ckpt.background = background
            t.step += 1
            t0 = time.perf_counter()
            t.save()
            t1 = time.perf_counter()
            t.ckpt.wait()
            t2 = time.perf_counter()
            if background:
                blocked.append(t1 - t0)
                written.append(t2 - t1)
            else:
                sync.append(t1 - t0)
    return sync, blocked, written


LOC_DIRS = ("train", "checkpoint", "parallel", "export")


def _code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def lines_of_code(base: str) -> dict[str, tuple[int, int]]:
    """Per package: (lines at ``base``, lines in the working tree)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout

    out = {}
    for d in LOC_DIRS:
        files = [f for f in git("ls-tree", "-r", "--name-only", base, f"tformer/{d}").split() if f.endswith(".py")]
        before = sum(_code_lines(git("show", f"{base}:{f}")) for f in files)
        after = sum(_code_lines(f.read_text()) for f in (ROOT / "tformer" / d).glob("*.py"))
        out[d] = (before, after)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=["trainer", "start", "save", "loc"])
    p.add_argument("--base", default="d6f024f", help="loc: the commit to compare with")
    args = p.parse_args()
    if args.only in (None, "loc"):
        print(f"\n=== lines of code (non-blank, non-comment; {args.base} -> now) ===")
        for d, (before, after) in lines_of_code(args.base).items():
            print(f"tformer/{d + '/':<12} {before:>6} -> {after:>6}")
        if args.only == "loc":
            return
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    # dropout off: both sides must start from the same loss, the check that they compute the same thing
    common = ["precision=fp32", "eval_every=0", "save_every=0", "log_every=10", "progress=true", "model.dropout=0.0"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        warm = first_step_seconds(tmp / "warm")  # fills the tokenizer and token caches
        if warm.returncode != 0:
            sys.exit(f"bench_trainer: tformer train failed (exit {warm.returncode}): {warm.error}")
        starts = [first_step_seconds(tmp / f"start{i}") for i in range(3)] if args.only in (None, "start") else []
        bare, trainer = [], []
        for r in range(args.rounds if args.only in (None, "trainer") else 0):  # interleaved rounds
            bare.append(bare_rate(common, args.steps, tmp / f"bare{r}"))
            trainer.append(trainer_rate(common, args.steps, tmp / f"trainer{r}"))
        saves = save_blocking(tmp / "save", args.rounds) if args.only in (None, "save") else None
    if saves is not None:
        sync, blocked, written = saves
        ratio = statistics.median(blocked) / statistics.median(sync)
        print("\n=== checkpoint save: time the loop is blocked (gpt2-small preset, fp32, CPU) ===")
        print(
            f"synchronous save     : median {statistics.median(sync):.2f} s  (rounds: {', '.join(f'{x:.2f}' for x in sync)})"
        )
        print(
            f"async save (blocked) : median {statistics.median(blocked):.2f} s  (rounds: "
            f"{', '.join(f'{x:.2f}' for x in blocked)}); its background write + commit: median "
            f"{statistics.median(written):.2f} s more"
        )
        print(f"async / sync blocked : {ratio:.3f}x   target <= 0.25x  {'PASS' if ratio <= 0.25 else 'MISS'}")
    if not trainer and not starts:
        return
    print("\n=== trainer benchmark (gpt2-tiny recipe, fp32, CPU) ===")
    if trainer:
        for name, rates in (("bare loop", bare), ("trainer", trainer)):
            rounds = ", ".join(f"{r.tokens_per_s:,.0f}" for r in rates)
            median = statistics.median(r.tokens_per_s for r in rates)
            print(f"{name + ' tokens/s':<21}: median {median:,.0f}  (rounds: {rounds})")
        print(overhead_line(bare, trainer, args.steps))
    if starts:
        print(start_line(starts))


if __name__ == "__main__":
    main()
