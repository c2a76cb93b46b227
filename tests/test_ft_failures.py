"""Fault tolerance under repeated failures (tformer/train/ft.py, torchft): real processes on gloo,
forked from the fork server (a restarted group starts in ~0.1 s, not the 8-16 s of a fresh
interpreter), a lighthouse started by the test and always killed, every wait under a deadline.

- the lighthouse killed and restarted on its port: no step commits while it is gone, each group
  says why in one line, both go on together when it is back; killed for good, each group stops
  in one line after fault_tolerance.quorum_timeout_s and the last committed step is checkpointed;
- a failure loop: a killer ends a random group (kill -9) every few seconds, a supervisor restarts
  it on its own, and the job never stops; the failures and recoveries in the metrics equal the
  kills made.
"""

from __future__ import annotations

import contextlib
import random
import time
from pathlib import Path

import pytest

from test_ft import WORKER, ft_overrides, lighthouse, rows
from train_helpers import CONFIGS, env, free_port, kill_group, kill_python, run_cli, small_overrides, start_python

pytest.importorskip("torchft")

CONFIG = CONFIGS / "gpt2-tiny.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache with the run's tokenizer built, so that no two groups build it at once."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("tokenizer")
    p = run_cli(["train", CONFIG, *small_overrides("gpt2-tiny", out, "max_steps=1", "eval_every=0")], cache, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return cache


@contextlib.contextmanager
def ended(*procs):
    """Every fork-server process in ``procs`` (a list that may grow) killed when the block ends."""
    try:
        yield
    finally:
        for p in procs:
            for q in p if isinstance(p, list) else [p]:
                kill_python(q)


def steps(path: Path) -> int:
    got = rows(path)
    return got[-1]["step"] if got else 0


def wait_until(cond, timeout: float, what, alive=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what()}"
        for p in alive:
            assert p.is_alive(), f"a group died: {what()}"
        time.sleep(0.1)


def test_lighthouse_killed_groups_wait_say_why_and_go_on_when_back_then_stop_in_one_line(cache, tmp_path):
    """Two one-rank groups through the CLI. The lighthouse killed: no step commits while it is gone
    and each group says in one line why; restarted on its port, both go on together (no step lost
    or repeated, the same averaged loss at every step). Killed for good: each group stops with one
    ``error:`` line after ``quorum_timeout_s``, and the last committed step is in a checkpoint."""
    out, port, quorum_timeout = tmp_path / "run", free_port(), 15
    extra = ("max_steps=100000", f"fault_tolerance.quorum_timeout_s={quorum_timeout}")
    addr = f"http://127.0.0.1:{port}"
    logs = [tmp_path / f"g{r}.log" for r in (0, 1)]
    metrics = [out / "replicas" / str(r) / "metrics.jsonl" for r in (0, 1)]
    lh = lighthouse(port, 2)
    groups = [
        start_python(["-m", "tformer", "train", CONFIG, *ft_overrides(out, port, r, *extra)], logs[r], env(cache))
        for r in (0, 1)
    ]

    def tails() -> str:
        return "\n".join(Path(f"{log}.err").read_text()[-1500:] for log in logs)

    try:
        with ended(groups):
            wait_until(lambda: min(map(steps, metrics)) >= 5, 120, tails, groups)
            kill_group(lh)
            time.sleep(1.5)  # a step whose quorum came before the kill may still commit
            frozen = [steps(m) for m in metrics]
            time.sleep(3.5)
            assert [steps(m) for m in metrics] == frozen, "a step committed without the lighthouse"
            assert all(p.is_alive() for p in groups), tails()
            lh = lighthouse(port, 2)  # back on the same port
            wait_until(lambda: min(map(steps, metrics)) >= max(frozen) + 5, 60, tails, groups)
            for log in logs:
                err = Path(f"{log}.err").read_text()
                assert f"the torchft lighthouse at {addr} is unreachable" in err, err[-3000:]
                assert f"quorum_timeout_s={quorum_timeout} s)" in err and "the lighthouse is back" in err, err[-3000:]
            kill_group(lh)  # for good
            t0 = time.monotonic()
            for p in groups:
                p.join(quorum_timeout + 60)
                assert p.exitcode is not None, f"still running {quorum_timeout + 60} s after the lighthouse died"
            waited = time.monotonic() - t0
    finally:
        kill_group(lh)
    assert quorum_timeout - 1 <= waited, waited
    for p, log in zip(groups, logs):
        err = Path(f"{log}.err").read_text()
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert p.exitcode == 3 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
        assert f"no torchft quorum at {addr} (the lighthouse is unreachable)" in lines[0], lines
        assert f"quorum_timeout_s={quorum_timeout} s, stopped after step" in lines[0], lines
    got = [rows(m) for m in metrics]
    last = got[0][-1]["step"]
    for g in got:  # both groups committed every step together: none lost, none repeated
        assert [r["step"] for r in g] == list(range(1, last + 1))
    assert [r["loss"] for r in got[0]] == [r["loss"] for r in got[1]]
    assert all(r["quorum"] == "2/2" for g in got for r in g)
    # nothing lost: the last committed step was checkpointed (by the group that writes them)
    assert (out / "checkpoints" / f"step_{last:08d}").is_dir(), sorted(p.name for p in (out / "checkpoints").iterdir())
