"""bench_ft.py's lighthouse-outage part (``--part outage``): what a lighthouse that dies and comes
back costs a run of two one-rank replica groups (tformer/train/ft.py ``QuorumEpochs``).

The lighthouse holds no training state; while it is down no quorum forms and no step commits
anywhere. Here it is killed (``kill -9``) at a random step, ``OUTAGE_S`` later started again on its
port (as launch/ft.sh's loop does), three times in one run, each once both groups have committed
again after the previous one; a failure-free run of the same side is the reference:

- lost per outage = (wall time with the outages - failure-free wall time) / outages;
- the stall: the longest time without a commit anywhere (either group's ``metrics.jsonl`` rows,
  by their ``time``) from the last commit before an outage to the next outage (or the end).

Target: lost per outage <= heartbeat timeout + join timeout + 2 step times (the failure-free run's
median ``step_time``). The lighthouse's timeouts are launch/ft.sh's defaults unless
``JOIN_TIMEOUT_MS`` / ``HEARTBEAT_TIMEOUT_MS`` are set, as for ft.sh.
"""

from __future__ import annotations

import datetime
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench_ft import (
    HEARTBEAT_TIMEOUT_MS,
    JOIN_TIMEOUT_MS,
    POLL_S,
    Rows,
    ended,
    free_port,
    kill,
    launch_group,
    launch_lighthouse,
    overrides,
)

OUTAGE_S = 1.0  # the lighthouse down, from its kill to the start of the next one
STEPS = 2  # step times allowed on top of heartbeat + join per outage


def timeouts() -> tuple[int, int]:
    """(join, heartbeat) timeouts in ms, as launch/ft.sh takes them."""
    return (
        int(os.environ.get("JOIN_TIMEOUT_MS", JOIN_TIMEOUT_MS)),
        int(os.environ.get("HEARTBEAT_TIMEOUT_MS", HEARTBEAT_TIMEOUT_MS)),
    )


def when(row: dict) -> float:
    """A metrics row's UTC ``time`` as seconds since the epoch."""
    return datetime.datetime.fromisoformat(row["time"].replace("Z", "+00:00")).timestamp()


def outage_steps(steps: int, outages: int, seed: int) -> list[int]:
    """One random step in each of ``outages`` equal windows between 10% and 70% of the run (the
    rest leaves the groups time to commit again before the next one and the end)."""
    lo, hi = max(steps // 10, 3), steps * 7 // 10
    width = (hi - lo) // max(outages, 1)
    if outages <= 0 or width < 2:
        return []
    rng = random.Random(seed)
    return [lo + i * width + rng.randrange(width) for i in range(outages)]


def stalls(commits: list[float], kills: list[float]) -> list[float]:
    """Per kill (epoch seconds, ascending), the longest time between consecutive ``commits`` (any
    group, epoch seconds) from the last commit before it up to the last before the next kill (the
    run's last commit for the last kill)."""
    c = sorted(commits)
    out = []
    for i, k in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        window = [t for t in c if t < until]
        before = [t for t in window if t <= k]
        after = [t for t in window if t > k]
        if not after:
            out.append(float("inf"))  # nothing committed after it
            continue
        ts = ([before[-1]] if before else []) + after
        out.append(max(b - a for a, b in zip(ts, ts[1:])) if len(ts) > 1 else 0.0)
    return out


@dataclass
class OutageRun:
    wall: float = 0.0
    error: str = ""
    kills: list[int] = field(default_factory=list)  # the step each outage came at
    kill_times: list[float] = field(default_factory=list)  # epoch seconds
    commits: list[float] = field(default_factory=list)  # every committed step's row time, both groups
    step_s: float = 0.0  # median step_time of group 0


def outage_run(cache: Path, out: Path, steps: int, at: list[int], timeout: float = 600.0) -> OutageRun:
    """Two one-rank groups and a lighthouse (min 1 replica, as launch/ft.sh); at each step of ``at``
    the lighthouse killed and started again ``OUTAGE_S`` later on its port."""
    join_ms, heartbeat_ms = timeouts()
    run, todo = OutageRun(), list(at)
    port = free_port()
    lh = launch_lighthouse(port, 1, join_ms, heartbeat_ms)
    rows = [Rows(out / "replicas" / str(g) / "metrics.jsonl") for g in range(2)]
    t0 = time.perf_counter()
    procs = [launch_group(cache, out, overrides(out, steps), g, port) for g in range(2)]
    top, back_at, since = 0, 0.0, [False, False]  # both groups committed since the last restart
    try:
        while True:
            for g, r in enumerate(rows):
                for row in r.poll():
                    top = max(top, row["step"])
                    since[g] = since[g] or when(row) > back_at
            if todo and top >= todo[0] and all(since):
                run.kills.append(top)
                todo.pop(0)
                run.kill_times.append(time.time())
                kill(lh)
                time.sleep(OUTAGE_S)
                lh = launch_lighthouse(port, 1, join_ms, heartbeat_ms)
                back_at, since = time.time(), [False, False]
                continue
            if ended(run, procs, "group", out, time.perf_counter() - t0 > timeout, top, timeout):  # type: ignore[arg-type]
                break
            time.sleep(POLL_S)
    finally:
        for p in procs:
            if p.poll() is None:
                kill(p)
        kill(lh)
    run.wall = time.perf_counter() - t0
    for r in rows:
        r.poll()
    last = max((row["step"] for row in rows[0].rows), default=0)
    if not run.error and last != steps:
        run.error = f"group 0 ended at step {last} of {steps}"
    if not run.error and len(run.kills) < len(at):
        run.error = f"{len(run.kills)} of {len(at)} outages made: the groups did not commit again in time"
    run.commits = [when(row) for r in rows for row in r.rows]
    run.step_s = statistics.median(row["step_time"] for row in rows[0].rows) if rows[0].rows else 0.0
    return run


def outage_line(clean: OutageRun, failed: OutageRun, join_s: float, heartbeat_s: float) -> str:
    """The outage verdict: lost wall time per outage against heartbeat + join + 2 steps."""
    broken = [f"{n}: {r.error}" for n, r in (("failure-free", clean), ("with outages", failed)) if r.error]
    if broken or not failed.kills:
        return f"FAIL fault tolerance, lighthouse outage: a run did not finish: {'; '.join(broken) or 'no outage made'}"
    n = len(failed.kills)
    lost = (failed.wall - clean.wall) / n
    bound = heartbeat_s + join_s + STEPS * clean.step_s
    stall = stalls(failed.commits, failed.kill_times)
    return (
        f"{'PASS' if lost <= bound else 'MISS'} fault tolerance, lighthouse outage ({OUTAGE_S:.0f} s, kill -9, started "
        f"again on its port), {n} outages at steps {failed.kills}: wall time lost per outage {lost:.1f} s "
        f"({failed.wall:.1f} s vs {clean.wall:.1f} s failure-free); longest time without a commit anywhere "
        f"{', '.join(f'{s:.1f}' for s in stall)} s (target: lost <= heartbeat {heartbeat_s:g} s + join {join_s:g} s "
        f"+ {STEPS} steps of {clean.step_s:.3f} s = {bound:.1f} s)"
    )


def bench_outage(cache: Path, tmp: Path, steps: int, outages: int, seed: int) -> list[str]:
    at = outage_steps(steps, outages, seed)
    if len(at) != outages:
        return [f"FAIL fault tolerance, lighthouse outage: {outages} outages do not fit {steps} steps; raise --outage-steps"]
    join_ms, heartbeat_ms = timeouts()
    print(f"  lighthouse outages at steps {at} of {steps} (join {join_ms} ms, heartbeat {heartbeat_ms} ms)", flush=True)
    runs = []
    for name, schedule in (("outage-clean", []), ("outage-kills", at)):
        runs.append(outage_run(cache, tmp / name, steps, schedule))
        r = runs[-1]
        print(f"  {name}: {r.wall:.1f} s, outages at {r.kills}" + (f", {r.error}" if r.error else ""), flush=True)
    return [outage_line(runs[0], runs[1], join_ms / 1000, heartbeat_ms / 1000)]
