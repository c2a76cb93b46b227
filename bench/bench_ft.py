"""Failure-free overhead of fault tolerance (tformer/train/ft.py, torchft) against plain DDP.

gpt2-tiny (the shipped recipe's model, fp32, micro-batch 8) on the bundled corpus, two ways in
rounds, one after the other on the same machine:

- plain DDP: two ranks of one process group (gloo);
- fault tolerance: two one-rank replica groups and a lighthouse (gloo across the groups): the
  per-step quorum, the cross-group gradient average through ``Manager.allreduce``, the commit vote.

Each run's step time is the median of its logged ``step_time`` after ``--warmup`` steps (the FT
one includes the step's quorum). Target: FT / DDP <= 1.10x. The line reads PASS or MISS, and MISS
sets the exit code. Startup, tokenizer and heal are not counted (the caches are warmed first).

    .venv/bin/python bench/bench_ft.py [--steps 60] [--warmup 10] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 1.10
LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(cache: Path) -> dict:
    e = dict(os.environ)
    e.update(TFORMER_CACHE=str(cache), PYTHONPATH=str(ROOT) + os.pathsep + e.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return e


def overrides(out: Path, steps: int) -> list[str]:
    return [
        str(ROOT / "configs" / "gpt2-tiny.yaml"),
        f"output_dir={out}",
        "precision=fp32",
        "progress=false",
        "log_every=1",
        f"max_steps={steps}",
        "eval_every=0",
        "save_every=0",
        "model.dropout=0",
        "model.attn_dropout=0",
    ]


def run(procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise SystemExit(f"bench_ft: a run failed (exit {p.returncode}): {p.args}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def step_time(metrics: Path, warmup: int) -> tuple[float, list[float]]:
    """The median step time after ``warmup``, and every step's loss (to check like with like)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return statistics.median(r["step_time"] for r in rows if r["step"] > warmup), [r["loss"] for r in rows]


def ddp(cache: Path, out: Path, steps: int, warmup: int) -> tuple[float, list[float]]:
    port = free_port()
    procs = []
    for rank in range(2):
        e = base_env(cache)
        e.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [sys.executable, "-m", "tformer", "train", *overrides(out, steps)]
        procs.append(subprocess.Popen(cmd, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    run(procs, 600)
    return step_time(out / "metrics.jsonl", warmup)


def ft(cache: Path, out: Path, steps: int, warmup: int) -> tuple[float, list[float]]:
    port = free_port()
    lh = subprocess.Popen(
        [LIGHTHOUSE, "--min_replicas", "2", "--bind", f"[::]:{port}", "--join_timeout_ms", "5000"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        procs = []
        for replica in range(2):
            cmd = [sys.executable, "-m", "tformer", "train", *overrides(out, steps)]
            cmd += ["fault_tolerance.enabled=true", f"fault_tolerance.replica_id={replica}", "fault_tolerance.replicas=2"]
            cmd += [f"fault_tolerance.lighthouse=http://127.0.0.1:{port}"]
            procs.append(subprocess.Popen(cmd, env=base_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        run(procs, 600)
    finally:
        lh.kill()
        lh.wait()
    return step_time(out / "replicas" / "0" / "metrics.jsonl", warmup)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        ddp(cache, Path(tmp) / "warm", 2, 0)  # tokenizer and token caches, not timed
        plain, tolerant, same = [], [], True
        for r in range(args.rounds):
            (t_ddp, l_ddp), (t_ft, l_ft) = (
                ddp(cache, Path(tmp) / f"ddp{r}", args.steps, args.warmup),
                ft(cache, Path(tmp) / f"ft{r}", args.steps, args.warmup),
            )
            plain.append(t_ddp)
            tolerant.append(t_ft)
            # like with like: the two train the same steps to the same losses (tests/test_ft.py: 1e-6)
            same = same and len(l_ddp) == len(l_ft) == args.steps and max(abs(a - b) for a, b in zip(l_ddp, l_ft)) < 1e-5
            print(f"round {r + 1}: DDP {1000 * t_ddp:.1f} ms/step, FT {1000 * t_ft:.1f} ms/step", flush=True)
    ratio = statistics.median(tolerant) / statistics.median(plain)
    verdict = ("PASS" if ratio <= TARGET else "MISS") if same else "FAIL"
    print(
        f"{verdict} fault tolerance, failure-free, gpt2-tiny, 2 groups x 1 rank: step time {ratio:.3f}x plain DDP "
        f"over 2 ranks (target <= {TARGET:.2f}x)" + ("" if same else "; the two runs' losses differ: not like with like")
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
