"""A lighthouse outage under ``launch/ft.sh``, as a user meets it (tformer/train/resilience/ft.py,
``QuorumEpochs``): real processes, the lighthouse killed with SIGKILL and started again by the
launcher's own loop, every wait under a deadline and everything killed at the end.

torchft 0.2.0 reconfigures a group's cross-group process group only when the quorum id changes, and
a restarted lighthouse numbers its quorums from 1 again: before the fix a one-second outage stopped
every commit for minutes (a group kept a process group its peer had left, its heal timed out on the
checkpoint server's lock, the launcher restarted it three times). Measured after it, on the 2-core
Xeon (AVX512-BF16), gpt2-tiny with 4 layers at seq 64, the lighthouse killed at step 20: the longest
time without a commit anywhere 3.5 s with join 3 s / heartbeat 2 s and 4.6 s with the launcher's
defaults (join 10 s / heartbeat 5 s), most of it the lighthouse's own restart (~2 s to import torch
and bind); the whole 80-step run 32-45 s, no group restarted, no heal failed.
The bound asserted: heartbeat + join + the lighthouse's restart (5 s allowed) + 4 step times.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from train_helpers import CONFIGS, ROOT, env, free_port, kill_group, small_overrides, start

pytest.importorskip("torchft")

STEP_LINE = re.compile(
    r"^\[group (?P<group>[01])\] step +(?P<step>\d+) \| loss \d+\.\d{4} \| lr \S+ \| grad \S+ \| [\d,]+ tok/s \| "
    r"MFU \d+\.\d% \| quorum [12]/2( \| val \d+\.\d{4} \(ppl [\d.]+\))?$"
)
RESTART_S = 5.0  # the lighthouse's own restart: the launcher's 0.2 s pause, then ~2 s to import torch and bind


def records(out: Path, group: int) -> list[dict]:
    path = out / "replicas" / str(group) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def when(record: dict) -> float:
    return datetime.datetime.fromisoformat(record["time"].replace("Z", "+00:00")).timestamp()


def pids(pattern: str) -> list[int]:
    """The processes whose command line matches ``pattern``."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if re.search(pattern, (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")):
                    found.append(int(proc.name))
    return found


def kill_lighthouse(port: int) -> None:
    found = pids(rf"torchft_lighthouse .*--bind \[::\]:{port} ")
    assert found, "no lighthouse to kill"
    for pid in found:
        os.kill(pid, signal.SIGKILL)


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"launch/ft.sh ended ({proc.returncode}) before {what}: {log.read_text()[:3000]}"
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}: {log.read_text()[-3000:]}"
        time.sleep(0.05)


def outage(cache: Path, tmp: Path, join_ms: int, heartbeat_ms: int, mid_heal: bool = False) -> None:
    out, port, log = tmp / "run", free_port(), tmp / "ft.log"
    steps = 400 if mid_heal else 60  # a restarted group is back in ~5-10 s: the live one must still be training
    e = {**env(cache), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    e.update(
        REPLICAS="2",
        MIN_REPLICAS="1",
        LIGHTHOUSE_PORT=str(port),
        JOIN_TIMEOUT_MS=str(join_ms),
        HEARTBEAT_TIMEOUT_MS=str(heartbeat_ms),
        OMP_NUM_THREADS="1",
    )
    # the timeouts: a heal that waited on the checkpoint server's lock waited timeout_s
    args = small_overrides(
        "gpt2-tiny", out, f"max_steps={steps}", "eval_every=0", "save_every=0", "fault_tolerance.quorum_timeout_s=60"
    )
    with open(log, "w") as sink:
        proc = start(
            [ROOT / "launch" / "ft.sh", CONFIGS / "gpt2-tiny.yaml", *args], env=e, stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        started = lambda: min(len(records(out, g)) for g in (0, 1))  # noqa: E731
        wait_for(lambda: started() >= 10, 180, "both groups at step 10", proc, log)
        if mid_heal:
            # group 1's worker killed; the launcher restarts it and it heals from group 0 at its first
            # quorum: the lighthouse is killed as that quorum is asked for
            victims = [p for p in pids(r"-m tformer train .*fault_tolerance\.replica_id=1 ") if p not in pids("torchrun")]
            assert victims, log.read_text()[-3000:]
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            asked = lambda: log.read_text().count("reading the step's figures from the device") >= 3  # noqa: E731
            wait_for(asked, 120, "group 1 restarted", proc, log)
        kill_lighthouse(port)
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"launch/ft.sh still running 300 s after the lighthouse was killed: {log.read_text()[-3000:]}")
    finally:
        kill_group(proc)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "Timed out waiting for wlock" not in text and "error:" not in text, text[-3000:]
    # the one traceback allowed is torchrun's for the worker the test killed
    assert text.count("Traceback") == text.count("ChildFailedError: \n") == int(mid_heal), text[-3000:]
    # one readable log: no access line of torchft's checkpoint server, no NCCL warning on gloo
    assert "GET /checkpoint/" not in text and "NCCL flight recorder" not in text, text[-3000:]
    restarts = text.count("restarting it (")
    assert restarts == int(mid_heal), text[-3000:]  # no group gave up on a quorum and was restarted
    assert "the lighthouse ended; starting it again" in text, text[-3000:]
    got = [records(out, g) for g in (0, 1)]
    assert all(g[-1]["step"] == steps for g in got), [g[-1] for g in got]
    # every step line whole, said once by each group that committed it (a healed group skips the
    # steps it took from its peer), with the group's prefix
    lines = [line for line in text.splitlines() if "| loss " in line]
    said = [STEP_LINE.match(line) for line in lines]
    assert all(said), [line for line, m in zip(lines, said) if not m][:5]
    for g in (0, 1):
        mine = [int(m["step"]) for m in said if m and int(m["group"]) == g]
        assert mine == [r["step"] for r in got[g]], (g, mine)
    # the longest time without a commit anywhere
    commits = sorted(when(r) for g in got for r in g)
    gaps = [b - a for a, b in zip(commits, commits[1:])]
    step_time = sorted(r["step_time"] for g in got for r in g)[len(commits) // 2]
    bound = (join_ms + heartbeat_ms) / 1000 + RESTART_S + 4 * step_time
    assert max(gaps) <= bound, f"{max(gaps):.1f} s without a commit (bound {bound:.1f} s)"


@pytest.mark.timeout(420)
def test_a_lighthouse_killed_mid_run_costs_seconds_with_short_timeouts(cache, tmp_path):
    """join 3 s, heartbeat 2 s (the issue's): the longest stall within heartbeat + join + the
    lighthouse's restart + 4 steps, no group restarted, no heal failed, every line whole."""
    outage(cache, tmp_path, 3000, 2000)


@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_lighthouse_killed_mid_run_costs_seconds_with_the_launchers_default_timeouts(cache, tmp_path):
    outage(cache, tmp_path, 10000, 5000)


@pytest.mark.long
@pytest.mark.timeout(420)
def test_a_lighthouse_killed_while_a_restarted_group_asks_to_heal(cache, tmp_path):
    """group 1 killed, restarted by the launcher, and the lighthouse killed as its first quorum (its
    heal) is asked for: it heals when the lighthouse is back; no other restart, no failed heal."""
    outage(cache, tmp_path, 3000, 2000, mid_heal=True)
