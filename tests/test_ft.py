"""Fault tolerance across replica groups (tformer/train/resilience/ft.py, torchft): real processes on gloo, a
lighthouse started by the test and always killed, every wait under a deadline.

- two one-rank replica groups without failure commit every step together and stay identical
  (equality with a plain run of the same global batch: tests/test_ft_groups.py);
- kill -9 of one two-rank FSDP2 group mid-run, restarted from the fork server: the other keeps
  committing (its step never goes back), the restarted group heals rank by rank from it and ends
  with every shard of weights and optimizer state bitwise equal to it, and the run's end loss is
  within 2% of the failure-free run's (40 steps here; 120 in the long lane, against the spread of
  failure-free runs);
- bad input: one line each.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from train_helpers import (
    CONFIGS,
    ROOT,
    env,
    free_port,
    kill_group,
    kill_python,
    reap,
    run_cli,
    small_overrides,
    start,
    start_python,
)

pytest.importorskip("torchft")

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
WORKER = ROOT / "tests" / "ft_worker.py"
STEPS = 40
# A run whose replica groups are killed ends within 2% of the failure-free run of the same length
# (the bound; the end loss is the mean of the last steps: one batch's loss swings by ~4%
# between steps, and this tiny model at lr 3e-3 has loss spikes whose timing moves with the smallest
# change of the weights). Measured on the 2-core AVX2 AMD EPYC, a group killed and restarted (back
# within 1-2 steps):
# - 40 steps, killed at step 8 / 20 / 28: -0.85% / -0.83 to -0.92% (3 runs) / -0.53% (last 10);
# - 120 steps, killed at step 60: +0.11% and +0.59% (two runs; mean of the last 20).
# The yardstick, failure-free runs of 120 steps against each other: another summation order
# (model.attn_impl=math) 4e-9; another seed (initialisation and data order) +0.75% and +3.0%. The
# bound is the width of the seed spread: a killed run must end no further away than a failure-free
# run with another seed may. A defect fails it: a restarted group that does not heal its weights
# from its peer (it keeps its initial ones, healing the rest) ends +5.2% (40 steps, killed at 20),
# +10.1% (killed at 28), +6.6% (120 steps, killed at 60); killed at step 8, inside the warm-up, it
# ends -0.42% (the bitwise comparison of the groups is what catches a defect there).
KILL_BOUND = 0.02


def overrides(out: Path, *extra: str) -> list[str]:
    return small_overrides(
        "gpt2-tiny",
        out,
        "model.dropout=0",
        "model.attn_dropout=0",
        "micro_batch_size=4",
        f"max_steps={STEPS}",
        "eval_every=0",
        "save_every=0",
        *extra,
    )


def ft_overrides(out: Path, port: int, replica: int, *extra: str) -> list[str]:
    return overrides(
        out,
        "fault_tolerance.enabled=true",
        f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
        f"fault_tolerance.replica_id={replica}",
        "fault_tolerance.replicas=2",
        "fault_tolerance.timeout_s=10",
        "fault_tolerance.quorum_timeout_s=60",
        *extra,
    )


def worker(tag: str, args: list[str], cache: Path, log: Path, **environ: str) -> subprocess.Popen:
    e = {**env(cache), **environ}
    return start(
        [sys.executable, WORKER, tag, CONFIGS / "gpt2-tiny.yaml", *args],
        env=e,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def lighthouse(port: int, min_replicas: int) -> subprocess.Popen:
    # a dead group leaves the quorum after a second without heartbeats; a joining one is waited for
    # (up to 5 s) by the live ones, so that a restarted group is never given a quorum of its own
    cmd = [LIGHTHOUSE, "--min_replicas", min_replicas, "--bind", f"[::]:{port}"]
    cmd += ["--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "1000"]
    return start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_all(procs, timeout: float, logs) -> None:
    reap(procs, timeout)
    for p, log in zip(procs, logs):
        assert p.returncode == 0, Path(log).read_text()[-3000:]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def ft_run(cache, tmp_path_factory):
    """Two one-rank replica groups, no failure (the session's data cache: the tokenizer is usually
    built already; else both groups build it, each writing it atomically)."""
    out = tmp_path_factory.mktemp("ft")
    port = free_port()
    lh = lighthouse(port, 2)
    try:
        logs = [out / f"group{r}.log" for r in range(2)]
        procs = [worker(f"g{r}", ft_overrides(out, port, r), cache, logs[r]) for r in range(2)]
        wait_all(procs, 300, logs)
    finally:
        kill_group(lh)
    return out


def test_two_one_rank_replica_groups_commit_every_step_together(ft_run):
    """Two one-rank groups (no process group inside a group) commit every step in a quorum of both
    and end with the same weights and optimizer state, bit for bit. That replica groups train as a
    plain run of the same global batch is tests/test_ft_groups.py's (groups of two ranks, DDP or
    FSDP2 inside, gpt2 / bert / t5)."""
    for group in (0, 1):
        got = rows(ft_run / "replicas" / str(group) / "metrics.jsonl")
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        assert all(r["quorum"] == "2/2" and r["ft_skipped_steps"] == 0 for r in got), group
        assert got[-1]["ft_commits"] == STEPS and got[-1]["ft_samples_skipped"] == 0
    a, b = (torch.load(ft_run / f"final_g{r}.pt", weights_only=True) for r in (0, 1))
    assert a["step"] == b["step"] == STEPS and a["model"]
    assert all(torch.equal(w, b["model"][k]) for k, w in a["model"].items())
    pairs = zip(sorted(a["optimizer"]["state"].items()), sorted(b["optimizer"]["state"].items()))
    assert all(ka == kb and all(torch.equal(sa[k], sb[k]) for k in sa) for (ka, sa), (kb, sb) in pairs)
    # the run's checkpoint was written once, by the quorum's first group
    assert (ft_run / "checkpoints" / f"step_{STEPS:08d}").is_dir()


def forked_group(tag: str, args: list[str], cache: Path, log: Path, ranks: int, **environ: str) -> list:
    """One replica group of ``ranks`` processes (a torchrun-like world of its own) forked from the
    fork server (tests/train_helpers.py: a restarted group starts in ~0.1 s, not the 8-30 s of a
    fresh interpreter on the 2-core CPU): rank r logs to ``log`` with ``.r`` appended (stderr with
    ``.r.err``)."""
    world = {"WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    world["TFORMER_DIST_TIMEOUT"] = "120"
    return [
        start_python(
            [WORKER, tag, CONFIGS / "gpt2-tiny.yaml", *args],
            log.with_suffix(f".{r}"),
            {**env(cache), **environ, **world, "RANK": str(r), "LOCAL_RANK": str(r)},
        )
        for r in range(ranks)
    ]


def run_with_a_kill(cache: Path, out: Path, steps: int, kill_at: int, ranks: int = 2, *extra: str) -> dict:
    """Two replica groups of ``ranks`` ranks each (FSDP2 inside a group when ``ranks`` > 1) train
    ``steps`` steps; once both have logged step ``kill_at``, ``kill -9`` of the group that joined
    later (the live one then holds the whole history) and, as a launcher would, its restart (after
    the lighthouse's 1 s heartbeat timeout, so the peers see the failure). While the killed group is
    away the live one takes a second more a step (ft_worker.py's FT_TEST_SLOW): the restarted group
    is back within a step or two. Returns the metrics of both groups, the victim, and the step it
    was killed at."""
    port = free_port()
    lh = lighthouse(port, 1)
    logs = [out / "g0.log", out / "g1.log", out / "g-restarted.log"]
    out.mkdir(parents=True, exist_ok=True)
    # the global batch of ft_run (2 groups x 1 rank x 4): FSDP2 over 2 ranks x 2
    layout = ("parallel.strategy=fsdp", f"micro_batch_size={4 // ranks}") if ranks > 1 else ()
    extra = (f"max_steps={steps}", *layout, *extra)
    slow = out / "slow"  # while it exists, the groups take a second a step (ft_worker.py)
    pace = {"FT_TEST_PACE": "0.1", "FT_TEST_SLOW": str(slow)}
    procs: list = []
    metrics = [out / "replicas" / str(r) / "metrics.jsonl" for r in (0, 1)]

    def tails() -> str:
        errs = [Path(f"{log.with_suffix(f'.{r}')}.err") for log in logs for r in range(ranks)]
        return "\n".join(f"{e}:\n{e.read_text()[-1500:]}" for e in errs if e.exists())

    def alive(group) -> None:
        assert all(p.is_alive() or p.exitcode == 0 for p in group), tails()

    try:
        groups = [forked_group(f"g{r}", ft_overrides(out, port, r, *extra), cache, logs[r], ranks, **pace) for r in (0, 1)]
        procs += groups[0] + groups[1]
        deadline = time.monotonic() + 240
        while not all(any(r["step"] >= kill_at for r in rows(m)) for m in metrics):
            assert time.monotonic() < deadline, tails()
            alive(procs)
            time.sleep(0.1)
        firsts = [rows(m)[0]["step"] for m in metrics]
        victim = 0 if firsts[0] > firsts[1] else 1
        slow.touch()  # the live group slows down until the restarted one is back
        for p in groups[victim]:
            kill_python(p)  # kill -9 of the whole group
        killed_at = max(r["step"] for r in rows(metrics[victim]))
        time.sleep(1.5)  # past the lighthouse's heartbeat timeout: the old group has left the quorum
        again = forked_group(f"g{victim}", ft_overrides(out, port, victim, *extra), cache, logs[2], ranks, **pace)
        procs += again
        while not any(r["step"] > killed_at for r in rows(metrics[victim])):
            assert time.monotonic() < deadline, tails()
            alive(again)
            time.sleep(0.1)
        slow.unlink()
        waiting = [*groups[1 - victim], *again]
        for p in waiting:
            p.join(max(1.0, deadline + 300 - time.monotonic()))
            assert p.exitcode == 0, f"exit {p.exitcode}: {tails()}"
    finally:
        for p in procs:
            kill_python(p)
        kill_group(lh)
    return {"metrics": [rows(m) for m in metrics], "victim": victim, "killed_at": killed_at}


def tail_loss(got: list[dict], n: int) -> float:
    """The mean loss of the last ``n`` steps (one batch's loss swings by ~4% between steps)."""
    return sum(r["loss"] for r in got[-n:]) / n


def test_two_rank_fsdp2_groups_one_killed_rejoin_bitwise_equal_and_the_other_never_stops(cache, ft_run, tmp_path):
    """Two replica groups of two ranks each, FSDP2 inside each group: ``kill -9`` of one whole group
    mid-run and its restart. The other commits every step; the restarted group heals rank by rank
    from the live one (each rank the shards it holds) and ends with every shard of weights and
    optimizer state bitwise equal to the live group's; the run's end loss is within 2% of the
    failure-free run's."""
    steps, ranks = STEPS, 2
    out = tmp_path / "run"
    got = run_with_a_kill(cache, out, steps, 20, ranks)
    victim, killed_at = got["victim"], got["killed_at"]
    live = got["metrics"][1 - victim]
    live_steps = [r["step"] for r in live]
    assert live_steps == list(range(1, steps + 1)), live_steps  # committed every step, never went back
    alone = [r["step"] for r in live[killed_at:] if r["quorum"] == "1/2"]
    assert alone, "the live group never ran alone: the kill was not seen"
    assert live[-1]["ft_failures"] >= 1
    restarted = [r for r in got["metrics"][victim] if r["step"] > killed_at]
    assert restarted, "the restarted group logged no step"
    # the new processes healed once, from the live group (a restarted group carries its counters on
    # from its last record: the victim, which joined late, had healed once at its start already)
    before = [r for r in got["metrics"][victim] if r["step"] <= killed_at][-1]["ft_recoveries"]
    assert restarted[-1]["ft_recoveries"] - before == 1, (before, restarted[-1]["ft_recoveries"])
    # it joined at the live group's step, not from step 0, and within a few steps of the kill (it is
    # forked, not a new interpreter)
    assert restarted[0]["step"] == restarted[-1]["step"] - len(restarted) + 1 > killed_at
    print(f"killed after step {killed_at}; the live group alone at steps {alone}; back at step {restarted[0]['step']}")
    assert len(alone) <= 10, alone  # 1-2 measured; 10 on a loaded CPU leaves the run 10 more steps
    for rank in range(ranks):
        a, b = (torch.load(out / f"final_{t}_rank{rank}.pt", weights_only=True) for t in ("g0", "g1"))
        assert a["step"] == b["step"] == steps
        assert a["model"].keys() == b["model"].keys() and a["model"]
        for name, w in a["model"].items():
            assert torch.equal(w, b["model"][name]), (rank, name)
        pairs = zip(sorted(a["optimizer"]["state"].items()), sorted(b["optimizer"]["state"].items()))
        for (ka, sa), (kb, sb) in pairs:
            assert ka == kb and all(torch.equal(sa[k], sb[k]) for k in sa), (rank, ka)
    shards = [torch.load(out / f"final_g0_rank{r}.pt", weights_only=True)["model"] for r in range(ranks)]
    assert not all(torch.equal(shards[0][k], shards[1][k]) for k in shards[0]), "the ranks hold no shards of their own"
    # The end loss (mean of the last 10 steps) within 2% of the failure-free run of the same length
    # and global batch (ft_run: 2 groups x 1 rank x 4 = 2 x 2 x 2). Figures: see KILL_BOUND.
    free = rows(ft_run / "replicas" / "0" / "metrics.jsonl")
    assert free[-1]["step"] == steps
    assert all(math.isfinite(r["loss"]) for r in live)
    tail, free_tail = tail_loss(live, 10), tail_loss(free, 10)
    print(f"end loss (mean of the last 10 of {steps} steps): killed run {tail:.4f}, failure-free {free_tail:.4f}")
    assert abs(tail - free_tail) <= KILL_BOUND * free_tail, (tail, free_tail)


def plain_run(cache: Path, out: Path, steps: int, *extra: str) -> list[dict]:
    """A one-process run of the replica groups' global batch (8), no fault tolerance: the same run as
    two failure-free groups, to rounding (tests/test_ft_groups.py)."""
    p = run_cli(
        ["train", str(CONFIGS / "gpt2-tiny.yaml"), *overrides(out, f"max_steps={steps}", "micro_batch_size=8", *extra)],
        cache,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return rows(out / "metrics.jsonl")


@pytest.mark.long  # about 2 minutes on the 2-core CPU: a 120-step run with a kill, four plain ones
def test_killed_run_ends_within_two_percent_of_a_failure_free_one(cache, tmp_path):
    """The issue's bound at a length where the loss has settled (120 steps, the cosine schedule run
    down; the mean of the last 20): a run whose replica group is killed at step 60 and restarted ends
    within KILL_BOUND of the failure-free run, against the spread of failure-free runs that differ
    only in their seed (initialisation and data order) or in their summation order."""
    steps, n = 120, 20
    got = run_with_a_kill(cache, tmp_path / "killed", steps, steps // 2)
    live = got["metrics"][1 - got["victim"]]
    assert [r["step"] for r in live] == list(range(1, steps + 1))
    alone = [r["step"] for r in live if r["quorum"] == "1/2" and r["step"] > got["killed_at"]]
    free = {
        name: tail_loss(plain_run(cache, tmp_path / name, steps, *extra), n)
        for name, extra in {
            "seed0": ("seed=0",),
            "math": ("seed=0", "model.attn_impl=math"),
            "seed1": ("seed=1",),
            "seed2": ("seed=2",),
        }.items()
    }
    killed = tail_loss(live, n)
    off = {k: (v - free["seed0"]) / free["seed0"] for k, v in free.items()}
    print(f"killed after step {got['killed_at']}, alone at steps {alone}")
    print(f"end loss (mean of the last {n} of {steps} steps): killed {killed:.4f}, failure-free {free}")
    print(f"from the failure-free run: killed {(killed - free['seed0']) / free['seed0']:+.2%}, others {off}")
    assert abs(killed - free["seed0"]) <= KILL_BOUND * free["seed0"], (killed, free)
    # the summation order moves the end loss by rounding only; a seed moves it by about the bound
    assert abs(off["math"]) < 1e-4, off
    assert max(abs(off["seed1"]), abs(off["seed2"])) >= KILL_BOUND, f"the bound is wider than the seed spread: {off}"


@pytest.mark.slow
def test_diloco_every_20_steps_sends_a_twentieth_of_ddp_bytes(cache, ft_run, tmp_path):
    """semi_sync=diloco, sync_every=20 on two groups: the bytes that cross between the groups (counted
    at Manager.allreduce) are at most 1/20 of the per-step gradient average's, and the loss stays
    near it at the same tokens. About 35 s on the 2-core CPU (two more processes)."""
    out, port = tmp_path / "run", free_port()
    lh = lighthouse(port, 2)
    try:
        logs = [tmp_path / f"group{r}.log" for r in range(2)]
        extra = ("fault_tolerance.semi_sync=diloco", "fault_tolerance.sync_every=20")
        procs = [worker(f"g{r}", ft_overrides(out, port, r, *extra), cache, logs[r]) for r in range(2)]
        wait_all(procs, 300, logs)
    finally:
        kill_group(lh)
    ddp = rows(ft_run / "replicas" / "0" / "metrics.jsonl")
    tails = []
    for group in (0, 1):
        got = rows(out / "replicas" / str(group) / "metrics.jsonl")
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        assert got[-1]["ft_bytes"] > 0, "no synchronisation happened"
        print(f"bytes across groups: diloco {got[-1]['ft_bytes']:,}, every-step average {ddp[-1]['ft_bytes']:,}")
        assert got[-1]["ft_bytes"] <= ddp[-1]["ft_bytes"] / 20
        tails.append(sum(r["loss"] for r in got[-10:]) / 10)
    # Between synchronisations each group logs the loss of its own half of the global batch; their
    # mean is the loss of the same tokens the every-step average trained on. Mean of the last 10
    # steps (one batch's loss swings by 4% here): measured 6.316 against 6.155 (+2.6%), deterministic.
    tail, ddp_tail = sum(tails) / 2, sum(r["loss"] for r in ddp[-10:]) / 10
    print(f"loss, mean of the last 10 steps: diloco {tail:.4f}, every-step average {ddp_tail:.4f}")
    assert abs(tail - ddp_tail) <= 0.03 * ddp_tail
    # both groups hold the same weights after the last synchronisation (step 40 = 2 x 20)
    a, b = (torch.load(out / f"final_g{r}.pt", weights_only=True) for r in (0, 1))
    assert all(torch.equal(w, b["model"][k]) for k, w in a["model"].items())


# -- bad input: one line each, before any work ------------------------------------------------------


def _refused(tmp_path, capsys, *extra: str) -> str:
    from tformer.cli import main

    argv = ["train", str(CONFIGS / "gpt2-tiny.yaml"), f"output_dir={tmp_path / 'run'}", "fault_tolerance.enabled=true"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert not (tmp_path / "run").exists()
    return err[0]


@pytest.mark.parametrize(
    "extra,match",
    [
        (
            ["fault_tolerance.replica_id=2", "fault_tolerance.replicas=2"],
            "replica_id=2 is outside fault_tolerance.replicas=2",
        ),
        (["fault_tolerance.min_replicas=3", "fault_tolerance.replicas=2"], "min_replicas=3 exceeds"),
        (
            ["fault_tolerance.semi_sync=diloco", "fault_tolerance.sync_every=10", "fault_tolerance.fragments=3"],
            "sync_every=10 is not a multiple of",
        ),
        (["parallel.strategy=deepspeed", "fault_tolerance.lighthouse=http://x:1"], "parallel.strategy=deepspeed"),
        (["on_spike=rollback", "fault_tolerance.lighthouse=http://x:1"], "on_spike=rollback"),
        (["fault_tolerance.backend=nccl", "device=cpu", "fault_tolerance.lighthouse=http://x:1"], "backend=nccl needs CUDA"),
    ],
)
def test_bad_fault_tolerance_input_is_one_line(extra, match, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    assert match in _refused(tmp_path, capsys, *extra)


def test_pipeline_parallelism_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    line = _refused(tmp_path, capsys, "parallel.pp=2", "fault_tolerance.lighthouse=http://x:1")
    assert "parallel.pp=2" in line


def test_torchft_missing_names_the_install_command(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchft", None)  # import torchft raises ImportError
    line = _refused(tmp_path, capsys, "fault_tolerance.lighthouse=http://x:1")
    assert "pip install 'tformer[ft]'" in line


def test_unreachable_lighthouse_is_one_line_after_the_timeout(tmp_path, capsys):
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    line = _refused(tmp_path, capsys, f"fault_tolerance.lighthouse=http://127.0.0.1:{port}", "fault_tolerance.timeout_s=1.5")
    waited = time.monotonic() - t0
    assert f"http://127.0.0.1:{port} is unreachable after fault_tolerance.timeout_s=1.5 s" in line
    assert 1.5 <= waited < 30, waited


# -- the launcher -----------------------------------------------------------------------------------


def test_ft_launcher_refuses_missing_arguments_with_one_line():
    p = subprocess.run([str(ROOT / "launch" / "ft.sh")], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.strip() == "usage: launch/ft.sh CONFIG.yaml [key=value ...]"
    e = {**os.environ, "TORCHFT_LIGHTHOUSE_BIN": "/no/such/lighthouse"}
    p = subprocess.run([str(ROOT / "launch" / "ft.sh"), "x.yaml"], capture_output=True, text=True, timeout=60, env=e)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and "pip install 'tformer[ft]'" in p.stderr


@pytest.mark.slow
@pytest.mark.cluster
def test_ft_launcher_runs_the_lighthouse_and_two_groups(cache, ft_run, tmp_path):
    """launch/ft.sh end to end (about 60 s on the 2-core CPU: two torchrun jobs): the lighthouse it
    starts, two groups that train together, and nothing left running afterwards."""
    out, port = tmp_path / "run", free_port()
    e = {**env(cache), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    e.update(REPLICAS="2", MIN_REPLICAS="2", LIGHTHOUSE_PORT=str(port), JOIN_TIMEOUT_MS="1000", HEARTBEAT_TIMEOUT_MS="1000")
    args = overrides(out, "max_steps=4", "log_every=1")
    proc = start(
        [ROOT / "launch" / "ft.sh", CONFIGS / "gpt2-tiny.yaml", *args],
        env=e,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    log = reap([proc], 240)[0][0]
    assert proc.returncode == 0, log[-3000:]
    for group in (0, 1):
        got = rows(out / "replicas" / str(group) / "metrics.jsonl")
        assert [r["step"] for r in got] == [1, 2, 3, 4] and got[-1]["quorum"] == "2/2", log[-3000:]
    with pytest.raises(OSError):  # the lighthouse was stopped with the groups
        import socket

        socket.create_connection(("127.0.0.1", port), timeout=2).close()


# -- the loss-free MoE bias across replica groups -------------------------------------------------


class _TwoGroups:
    """torchft's ``Manager`` as one of two groups sees it: ``allreduce`` averages this group's flat
    buffer with the other group's (``other``), ``should_commit`` says yes."""

    def __init__(self, other: torch.Tensor):
        self.other = other

    def allreduce(self, flat: torch.Tensor):
        flat.add_(self.other).div_(2)
        return type("Done", (), {"wait": lambda self: None})()

    def should_commit(self) -> bool:
        return True


def test_expert_loads_ride_the_groups_all_reduce_and_come_back_summed():
    """Each group's expert loads join the step's one all-reduce and come back as the sum over the
    groups, whole (so every group moves its loss-free bias alike); the gradients stay averaged."""
    from types import SimpleNamespace

    from tformer.train.resilience.ft import FaultTolerance

    model = torch.nn.Linear(3, 2)
    model.weight.grad, model.bias.grad = torch.ones(2, 3), torch.ones(2)
    stats = torch.tensor([2.0, 10.0, 0.0, 0.0, 0.0])
    mine = torch.tensor([[3.0, 1.0, 0.0], [7.0, 2.0, 5.0]])
    theirs = torch.tensor([[1.0, 4.0, 9.0], [0.0, 6.0, 1.0]])
    ft = object.__new__(FaultTolerance)
    other = torch.cat([torch.full((8,), 3.0), torch.tensor([4.0, 30.0, 0.0, 0.0, 0.0]), theirs.flatten()])
    trainer = SimpleNamespace(cfg=SimpleNamespace(micro_batch_size=1, grad_accum=1), dist=SimpleNamespace(group_dp_size=1))
    ft.semi, ft.manager, ft.participants, ft.replicas, ft.trainer = None, _TwoGroups(other), 2, 2, trainer
    ft.commits = ft.samples_skipped = 0
    loads = mine.clone()
    summed, committed = ft.sync(model, stats, loads)
    assert committed and torch.equal(loads, mine + theirs)  # planted: left averaged, they differ
    assert torch.equal(model.weight.grad, torch.full((2, 3), 2.0)) and summed[1].item() == 40.0


def test_semi_synchronous_groups_refuse_the_loss_free_bias(tmp_path, capsys, monkeypatch):
    from tformer.cli import main

    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    argv = ["train", str(CONFIGS / "deepseek-v3-tiny.yaml"), f"output_dir={tmp_path / 'run'}"]
    argv += ["fault_tolerance.enabled=true", "fault_tolerance.lighthouse=http://x:1", "fault_tolerance.semi_sync=diloco"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "biases (a buffer) would drift apart" in err[0], err


@pytest.mark.long
def test_two_groups_move_the_loss_free_bias_alike(cache, tmp_path):
    """DeepSeek-V3-tiny in two one-rank replica groups: after 6 steps both groups hold the same
    routing biases, bit for bit, moved from the loads of both (each group's own loads alone, as
    before, gave each its own biases)."""
    port = free_port()
    lh = lighthouse(port, 2)
    steps = 6
    try:
        logs = [tmp_path / f"group{r}.log" for r in range(2)]
        procs = []
        for r in range(2):
            args = small_overrides("deepseek-v3-tiny", tmp_path, "micro_batch_size=2", f"max_steps={steps}")
            args += ["eval_every=0", "save_every=0", "fault_tolerance.enabled=true"]
            args += [f"fault_tolerance.lighthouse=http://127.0.0.1:{port}", f"fault_tolerance.replica_id={r}"]
            args += ["fault_tolerance.replicas=2", "fault_tolerance.timeout_s=10", "fault_tolerance.quorum_timeout_s=60"]
            procs.append(
                start(
                    [sys.executable, WORKER, f"g{r}", CONFIGS / "deepseek-v3-tiny.yaml", *args],
                    env=env(cache),
                    stdout=open(logs[r], "w"),
                    stderr=subprocess.STDOUT,
                )
            )
        wait_all(procs, 300, logs)
    finally:
        kill_group(lh)
    a, b = (torch.load(tmp_path / f"final_g{r}.pt", weights_only=True)["model"] for r in (0, 1))
    biases = [k for k in a if k.endswith("score_bias")]
    assert biases and all(a[k].abs().sum() > 0 for k in biases)
    assert all(torch.equal(a[k], b[k]) for k in biases)
