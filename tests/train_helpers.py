"""Helpers for trainer tests: small configs on the bundled corpus, subprocess runs, metric reading,
and deadlines for what a test starts (commands and spawned rank groups), which kill it on expiry."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def small_overrides(recipe: str, out: Path, *extra: str) -> list[str]:
    base = [
        f"output_dir={out}",
        # the same arithmetic on every CPU: the recipes' precision=auto is bf16 on an AVX512-BF16 one
        # (a later precision=... in extra wins)
        "precision=fp32",
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
    # a started process picks its own rendezvous unless the test names one
    e = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    e["TFORMER_CACHE"] = str(cache)
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


def run_cli(args: list[str], cache: Path, timeout: float = 600, **kw) -> subprocess.CompletedProcess:
    return run_cmd([sys.executable, "-m", "tformer", *args], timeout, env=env(cache), **kw)


# -- deadlines: a test that starts processes ends them, whatever ends the test ----------------------


def start(cmd: list, **kw) -> subprocess.Popen:
    """Popen in a session of its own, so that kill_group reaches the command and all it started
    (a launcher's workers, a tokenizer's pool), not only the process itself."""
    kw.setdefault("text", True)
    return subprocess.Popen([str(c) for c in cmd], start_new_session=True, **kw)


def kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    proc.wait()


@contextlib.contextmanager
def owned(*procs: subprocess.Popen):
    """Kills every process group in procs when the block fails: an assertion, an expired deadline,
    or pytest-timeout's per-test one (it raises in the test's thread)."""
    try:
        yield procs
    except BaseException:
        for p in procs:
            kill_group(p)
        raise


def reap(procs, timeout: float) -> list:
    """Every process's (stdout, stderr), all within one deadline; on expiry all are killed and the
    test fails naming the command still running."""
    import pytest

    deadline = time.monotonic() + timeout
    with owned(*procs):
        try:
            return [p.communicate(timeout=max(0.1, deadline - time.monotonic())) for p in procs]
        except subprocess.TimeoutExpired as e:
            pytest.fail(f"still running after {timeout:.0f} s, killed: {' '.join(map(str, e.cmd))[:300]}")


def run_cmd(cmd: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True) whose deadline also kills what the command started."""
    proc = start(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
    out, err = reap([proc], timeout)[0]
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# Ranks start from a fork server that imported torch and the trainer once per test session: a spawned
# rank imports them itself (~5 s of CPU each; a 2-rank group on 2 cores ~8-16 s before its first
# step, measured on a 2-core EPYC), a forked one starts in ~0.05 s. A forked rank would see the fork
# server's environment, not this process's: the environment of the moment travels with each start.
PRELOAD = ["torch", "torch.distributed", "tformer.train.trainer"]


def _rank_main(rank: int, environ: dict, worker, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)


def start_ranks(worker, args: tuple, nprocs: int):
    """torch.multiprocessing's context of ``nprocs`` ranks running worker(rank, *args), not joined."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)
    return mp.start_processes(
        _rank_main, args=(dict(os.environ), worker, args), nprocs=nprocs, join=False, start_method="forkserver"
    )


def stop_fork_server() -> None:
    """End the fork server (at the end of the session: tests leave no process behind)."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)
    if stop is not None:
        stop()


def spawn_ranks(worker, args: tuple, nprocs: int, timeout: float) -> None:
    """A group of ``nprocs`` ranks (worker(rank, *args)), joined within a deadline; on expiry or any
    failure every worker is killed and the test fails."""
    import pytest

    ctx = start_ranks(worker, args, nprocs)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"{nprocs}-process group did not finish in {timeout:.0f} s; killed")
    except BaseException:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        raise


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
