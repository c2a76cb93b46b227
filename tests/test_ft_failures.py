"""Fault tolerance under repeated failures (tformer/train/resilience/ft.py, torchft): real processes on gloo,
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
import json
import random
import time
from pathlib import Path

import pytest

from test_ft import WORKER, ft_overrides, lighthouse
from train_helpers import CONFIGS, env, free_port, kill_group, kill_python, run_cli, small_overrides, start_python

pytest.importorskip("torchft")

CONFIG = CONFIGS / "gpt2-tiny.yaml"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache with the run's tokenizer built, so that no two groups build it at once."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("tokenizer")
    p = run_cli(["data", "prepare", CONFIG, *small_overrides("gpt2-tiny", out), "--no-progress"], cache, timeout=300)
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


def records(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl being written (a line not yet whole is left for the next read)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def steps(path: Path) -> int:
    got = records(path)
    return got[-1]["step"] if got else 0


def wait_until(cond, timeout: float, what, alive=()) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what()}"
        for p in alive:
            assert p.is_alive(), f"a group died: {what()}"
        time.sleep(0.1)


@pytest.mark.long  # 25-40 s: a quorum outage and a 15 s quorum timeout, waited for in real time
def test_lighthouse_killed_groups_wait_say_why_and_go_on_when_back_then_stop_in_one_line(cache, tmp_path):
    """Two one-rank groups through the CLI. The lighthouse killed: no step commits while it is gone
    and each group says in one line why; restarted on its port, both go on together (no step lost
    or repeated, the same averaged loss at every step). Killed for good: each group stops with one
    ``error:`` line after ``quorum_timeout_s``, and the last committed step is in a checkpoint."""
    out, port, quorum_timeout = tmp_path / "run", free_port(), 15
    # a group that took its quorum just before the kill waits for its peer in the all-reduce (up to
    # timeout_s) and retries the step: quorum_timeout_s must cover that and the outage
    extra = ("max_steps=100000", "fault_tolerance.timeout_s=5", f"fault_tolerance.quorum_timeout_s={quorum_timeout}")
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
            # a group that waited for the lighthouse says so; one that was inside a step when it died
            # waited for its peer instead, and its step was not committed (then tried again)
            said = [Path(f"{log}.err").read_text() for log in logs]
            for err, m in zip(said, metrics):
                if f"the torchft lighthouse at {addr} is unreachable" in err:
                    assert f"quorum_timeout_s={quorum_timeout} s)" in err and "the lighthouse is back" in err, err[-3000:]
                else:
                    assert records(m)[-1]["ft_skipped_steps"] >= 1, err[-3000:]
            assert any(f"the torchft lighthouse at {addr} is unreachable" in err for err in said), said[0][-3000:]
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
    got = [records(m) for m in metrics]
    last = got[0][-1]["step"]
    for g in got:  # both groups committed every step together: none lost, none repeated
        assert [r["step"] for r in g] == list(range(1, last + 1))
    assert [r["loss"] for r in got[0]] == [r["loss"] for r in got[1]]
    assert all(r["quorum"] == "2/2" for g in got for r in g)
    # nothing lost: the last committed step was checkpointed (by the group that writes them)
    assert (out / "checkpoints" / f"step_{last:08d}").is_dir(), sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.long
def test_failure_loop_random_kills_the_job_never_stops_and_the_counts_equal_the_kills(cache, tmp_path):
    """Two one-rank groups; a killer ends a random group (kill -9, seeded) every few seconds, three
    times, and a supervisor restarts each killed group on its own, as launch/ft.sh's loop does. A
    group is killed only when both groups commit together (its peer is then alive to go on and to
    see it leave: killing the only group that has the run's state is a total outage, which this
    test does not make). 22-29 s on the 2-core CPU (plus 11-13 s for the tokenizer): the long lane."""
    seed, kills_wanted, every_s, max_steps = 44, 3, 4.0, 300
    # a launcher's restart takes longer than the lighthouse's heartbeat timeout (1 s here): the old
    # process has left the quorum when the new one asks to join, so the peers see the failure
    restart_after_s = 1.5
    # no commit anywhere for longer than this is a stopped job: a dead peer is missed after the
    # heartbeat timeout (1 s), a step in flight with it fails within timeout_s (10 s)
    stall_limit_s = 20.0
    out, port = tmp_path / "run", free_port()
    paced = tmp_path / "paced"  # the groups step every 0.05 s while the killer works, then run free
    paced.touch()
    environ = {**env(cache), "FT_TEST_PACE": "0.05", "FT_TEST_PACE_WHILE": str(paced)}
    metrics = [out / "replicas" / str(r) / "metrics.jsonl" for r in (0, 1)]
    rng = random.Random(seed)
    lives: list[list] = [[], []]  # per group: (process, log, rows before it started)
    kills: list[dict] = []
    killed_at: dict[int, float] = {}
    before: list[dict] = []

    def launch(r: int) -> None:
        log = tmp_path / f"g{r}.{len(lives[r])}.log"
        args = [WORKER, f"g{r}", CONFIG, *ft_overrides(out, port, r, f"max_steps={max_steps}")]
        lives[r].append((start_python(args, log, environ), log, len(records(metrics[r]))))

    def tails() -> str:
        return "\n".join(f"{log}:\n{Path(f'{log}.err').read_text()[-1200:]}" for g in lives for _, log, _ in g[-2:])

    lh = lighthouse(port, 1)
    try:
        for r in (0, 1):
            launch(r)
        t0 = time.monotonic()
        deadline = t0 + 300
        top, top_t, stall = 0, t0, 0.0
        advanced = [t0, t0]
        last_step = [0, 0]
        victim = rng.randrange(2)
        next_kill = t0 + every_s
        done = [False, False]
        while not all(done):
            now = time.monotonic()
            assert now < deadline, f"the run did not end within {deadline - t0:.0f} s: {tails()}"
            got = [records(m) for m in metrics]
            for r in (0, 1):
                if got[r] and got[r][-1]["step"] != last_step[r]:
                    last_step[r], advanced[r] = got[r][-1]["step"], now
            if max(last_step) > top:
                top, top_t = max(last_step), now
            stall = max(stall, now - top_t)
            assert now - top_t < stall_limit_s, f"no group committed for {now - top_t:.1f} s (at step {top}): {tails()}"
            for r in (0, 1):  # the supervisor: each group restarted on its own
                proc = lives[r][-1][0]
                if done[r] or proc.is_alive():
                    continue
                if r in killed_at:
                    if now - killed_at[r] >= restart_after_s:
                        del killed_at[r]
                        launch(r)
                    continue
                assert proc.exitcode == 0, f"group {r} failed (exit {proc.exitcode}): {tails()}"
                done[r] = True
            if len(kills) < kills_wanted and now >= next_kill and not killed_at:
                # both groups committing together, each in its current life: the peer goes on
                fresh = [got[r][lives[r][-1][2] :] for r in (0, 1)]
                together = all(f and f[-1]["quorum"] == "2/2" for f in fresh)
                other = 1 - victim
                if together and now - advanced[other] < 1.0 and all(g[-1][0].is_alive() for g in lives):
                    if not kills:  # what was counted before the first kill: a group that started
                        # after its peer healed from it, a recovery no kill caused
                        before = [{k: got[r][-1][k] for k in ("ft_failures", "ft_recoveries")} for r in (0, 1)]
                    kill_python(lives[victim][-1][0])
                    killed_at[victim] = time.monotonic()
                    kills.append(
                        {"t": round(now - t0, 2), "group": victim, "step": last_step[victim], "peer": last_step[other]}
                    )
                    print(f"kill -9 of group {victim}: {kills[-1]}")
                    victim, next_kill = rng.randrange(2), now + every_s
            if len(kills) == kills_wanted and paced.exists() and not killed_at:
                fresh = [got[r][lives[r][-1][2] :] for r in (0, 1)]
                if all(f and f[-1]["quorum"] == "2/2" for f in fresh):
                    paced.unlink()  # every group back: the run goes on to its end unpaced
            time.sleep(0.1)
    finally:
        for g in lives:
            for p, _, _ in g:
                kill_python(p)
        kill_group(lh)
    print(f"kills: {kills}; longest time without a commit anywhere: {stall:.1f} s")
    assert len(kills) == kills_wanted, f"only {len(kills)} kills before the run ended at step {max_steps}: {kills}"
    got = [records(m) for m in metrics]
    for r in (0, 1):
        s = [row["step"] for row in got[r]]
        assert s[-1] == max_steps, (r, s[-20:])
        assert all(a < b for a, b in zip(s, s[1:])), f"group {r}'s step went back: {s}"
        jumps = sum(b != a + 1 for a, b in zip(s, s[1:]))  # a restarted group joins at its peer's step
        assert jumps <= sum(k["group"] == r for k in kills), (r, s)
    # at every step at least one group committed: the job never stopped
    assert {row["step"] for g in got for row in g} == set(range(1, max_steps + 1))
    # each kill was seen by the other group (a failure) and healed by the restarted one (a recovery);
    # a group's counts go on over its restarts
    made = [{k: g[-1][k] - b[k] for k in b} for g, b in zip(got, before)]
    print(f"counted before the first kill: {before}; since: {made}")
    assert sum(m["ft_failures"] for m in made) == len(kills), made
    assert sum(m["ft_recoveries"] for m in made) == len(kills), made
    for r in (0, 1):
        assert made[r]["ft_recoveries"] == sum(k["group"] == r for k in kills), (r, made, kills)
        assert made[r]["ft_failures"] == sum(k["group"] != r for k in kills), (r, made, kills)
