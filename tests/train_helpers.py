"""Helpers for trainer tests: small configs on the bundled corpus, subprocess runs, metric reading."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def small_overrides(recipe: str, out: Path, *extra: str) -> list[str]:
    base = [
        f"output_dir={out}",
        "progress=false",
        "log_every=1",
        "eval_batches=4",
        "model.vocab_size=2048",
        "model.d_model=64",
        "model.d_ff=128",
        "model.num_layers=2",
        "data.seq_len=64",
        "micro_batch_size=8",
    ]
    if recipe.startswith(("t5", "switch")):
        base += ["model.d_head=16", "data.tokenizer_max_rows=4000"]
    if recipe.startswith("transformer"):
        base += [
            "data.tokenizer_max_rows=3000",
            "data.target_len=64",
            "data.tokens_per_batch=256",
            "model.max_seq_len=64",
            "max_time=null",
            "bleu_samples=4",
            "decode.max_new_tokens=8",
            "decode.num_beams=2",
        ]
    if recipe.startswith("llama"):
        base += ["model.d_ff=96"]
    return base + list(extra)


def env(cache: Path) -> dict:
    e = dict(os.environ)
    e["TFORMER_CACHE"] = str(cache)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run_cli(args: list[str], cache: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tformer", *args], env=env(cache), capture_output=True, text=True, timeout=timeout, **kw
    )


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir)}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_rank(rank: int, world: int, port: int, cache, collective_timeout: int = 300) -> None:
    """A spawned test worker's torchrun-like environment (one thread each: 4 ranks share 2 cores)."""
    import torch

    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TFORMER_CACHE=str(cache),
        TFORMER_DIST_TIMEOUT=str(collective_timeout),
    )
    torch.set_num_threads(1)
