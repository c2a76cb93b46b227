"""Fault tolerance across replica groups of several ranks, and switching it at a resume
(tformer/train/resilience/ft.py, torchft): real processes on gloo, forked from the fork server, a lighthouse
started by the test and always killed, every wait under a deadline.

- two replica groups of two ranks each, no failure, equal a plain four-rank run of the same global
  batch (the loss of every step and the final weights, fp32, dropout off): DDP inside each group for
  gpt2, bert and t5 tiny, and FSDP2 inside each group;
- a checkpoint of a fault-tolerant run resumes in a plain run and a plain run's in a fault-tolerant
  one, the continued run's losses unchanged, and the trainer says the switch in one line.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from train_helpers import (
    CONFIGS,
    become_rank,
    free_port,
    kill_group,
    small_overrides,
    spawn_ranks,
    start,
)

pytest.importorskip("torchft")

LIGHTHOUSE = Path(sys.executable).parent / "torchft_lighthouse"
STEPS = 8
RANKS = 4  # two groups of two, or one plain job of four
# The yardstick of fp32 rounding: two plain layouts of the same global batch that differ only in
# their summation order (4-rank DDP, and 2 ranks x grad_accum 2), measured against each other over
# these 8 steps (2-core AVX2 AMD EPYC, gpt2 / bert / t5 tiny): weights apart by at most 1.2e-7 (one
# ulp of a norm weight near 1), losses by one ulp of the loss (4.8e-7 near 7.6; two ulps for bert
# with Adam's default eps: a step's loss is the mean of the ranks' losses, in the layout's order).
# Two groups of two against the 4-rank run gave the same figures. The bounds: 1e-6 for every
# weight (8 ulps near 1), 4 ulps for a loss (1.9e-6 near 7.6).
WEIGHT_TOLERANCE = 1e-6
LOSS_ULPS = 4


def lighthouse(port: int, min_replicas: int) -> subprocess.Popen:
    # min_replicas = every group: no group may start a quorum of its own
    cmd = [LIGHTHOUSE, "--min_replicas", min_replicas, "--bind", f"[::]:{port}"]
    cmd += ["--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "5000"]
    return start(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def overrides(recipe: str, out: Path, *extra: str) -> list[str]:
    return small_overrides(
        recipe,
        out,
        "model.dropout=0",
        "model.attn_dropout=0",
        "data.seq_len=32",
        "micro_batch_size=2",  # x 4 data-parallel ranks: a global batch of 8
        f"max_steps={STEPS}",
        "eval_every=0",
        "save_every=0",
        # Adam divides each gradient by its running magnitude: an element whose true gradient is zero
        # (a key bias: softmax ignores a per-query constant) or cancels almost exactly moves on the
        # round-off of its summation order alone, by up to lr a step. With the default eps (1e-8)
        # that put gpt2's key biases 2.6e-6 apart between two plain layouts (4-rank DDP and 2 ranks
        # x grad_accum 2) and one t5 weight 8.9e-7 apart; eps=1e-4 keeps round-off from being
        # amplified (as in test_mesh.py), so that the layouts can be compared at 1e-6 at all.
        "optim.eps=1e-4",
        *extra,
    )


def _rank(
    rank: int, recipe: str, args: list[str], per_group: int, ports: list[int], cache: str, tag: str, stop_at: int = 0
) -> None:
    """Rank ``rank`` of the launch: local rank ``rank % per_group`` of replica group ``rank //
    per_group`` (a torchrun-like world of its own). Trains (stopping after step ``stop_at`` if set),
    then saves the full weights gathered inside its group (the groups' ranks 0:
    ``OUT/full_<tag>_g<group>.pt``); the trainer's warnings go to ``OUT/log_<tag>_g<group>.txt``."""
    group, local = divmod(rank, per_group)
    become_rank(local, per_group, ports[group], cache, 120)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tformer.parallel.dist import shutdown
    from tformer.train.config import load_config
    from tformer.train.trainer import Trainer

    ft = [f"fault_tolerance.replica_id={group}"] if "fault_tolerance.enabled=true" in args else []
    cfg = load_config(CONFIGS / f"{recipe}.yaml", [*args, *ft])
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if local == 0:
        logging.getLogger("tformer.train").addHandler(logging.FileHandler(out / f"log_{tag}_g{group}.txt"))

    def stop(trainer, record):
        if record.get("step") == stop_at:
            trainer._stop_reason = "test stop"

    trainer = Trainer(cfg, callbacks=[stop] if stop_at else [])
    trainer.fit()
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if local == 0:
        torch.save({k: v.clone() for k, v in full.items()}, out / f"full_{tag}_g{group}.pt")
    shutdown(None)


def launch(recipe: str, out: Path, cache: Path, groups: int, *extra: str) -> None:
    """RANKS ranks in ``groups`` torchft replica groups (1: a plain job), within a deadline."""
    ports = [free_port() for _ in range(groups)]
    args = overrides(recipe, out, *extra)
    lh = None
    if groups > 1:
        port = free_port()
        lh = lighthouse(port, groups)
        args += [
            "fault_tolerance.enabled=true",
            f"fault_tolerance.lighthouse=http://127.0.0.1:{port}",
            f"fault_tolerance.replicas={groups}",
            f"fault_tolerance.min_replicas={groups}",
            "fault_tolerance.timeout_s=60",
            "fault_tolerance.quorum_timeout_s=60",
        ]
    try:
        spawn_ranks(_rank, (recipe, args, RANKS // groups, ports, str(cache), out.name), RANKS, 240)
    finally:
        if lh is not None:
            kill_group(lh)


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def plain(cache, tmp_path_factory):
    """The references, one per family: a plain four-rank DDP run (run once, on first use)."""
    runs: dict[str, Path] = {}

    def get(recipe: str) -> Path:
        if recipe not in runs:
            out = tmp_path_factory.mktemp(f"plain-{recipe}")
            launch(recipe, out, cache, 1, "parallel.strategy=ddp")
            runs[recipe] = out
        return runs[recipe]

    return get


def check_equal(reference: Path, ft: Path) -> tuple[float, float]:
    """Every step's loss and the final weights of both groups against the plain run's; returns the
    largest differences seen (losses, weights)."""
    expected = {r["step"]: r["loss"] for r in rows(reference / "metrics.jsonl")}
    assert sorted(expected) == list(range(1, STEPS + 1))
    worst = [0.0, 0.0]
    for group in (0, 1):
        got = rows(ft / "replicas" / str(group) / "metrics.jsonl")
        assert [r["step"] for r in got] == list(range(1, STEPS + 1))
        for r in got:
            assert r["quorum"] == "2/2" and r["ft_skipped_steps"] == 0, r
            diff = abs(r["loss"] - expected[r["step"]])
            worst[0] = max(worst[0], diff)
            ulp = float(np.spacing(np.float32(expected[r["step"]])))
            assert diff <= LOSS_ULPS * ulp, (group, r["step"], diff)
        assert got[-1]["ft_commits"] == STEPS
    want = torch.load(reference / f"full_{reference.name}_g0.pt", weights_only=True)
    moved = 0
    for group in (0, 1):
        weights = torch.load(ft / f"full_{ft.name}_g{group}.pt", weights_only=True)
        assert weights.keys() == want.keys()
        for name, w in want.items():
            diff = (weights[name].float() - w.float()).abs().max().item() if w.numel() else 0.0
            worst[1] = max(worst[1], diff)
            assert diff <= WEIGHT_TOLERANCE, (group, name, diff)
            moved += w.is_floating_point()
    assert moved, "the reference has no weights to compare"
    return worst[0], worst[1]


# gpt2 in CI's run, bert and t5 (13 and 11 s) in the long lane
@pytest.mark.parametrize(
    "recipe",
    ["gpt2-tiny", pytest.param("bert-tiny", marks=pytest.mark.long), pytest.param("t5-tiny", marks=pytest.mark.long)],
)
def test_two_groups_of_two_ddp_ranks_equal_a_plain_four_rank_run(recipe, plain, cache, tmp_path_factory):
    reference = plain(recipe)
    out = tmp_path_factory.mktemp(f"ft-{recipe}")
    launch(recipe, out, cache, 2, "parallel.strategy=ddp")
    loss, weight = check_equal(reference, out)
    print(f"{recipe}: 2 groups x 2 DDP ranks vs 4-rank DDP: losses {loss:.3g}, weights {weight:.3g} apart")


def test_two_groups_of_two_fsdp2_ranks_equal_a_plain_four_rank_run(plain, cache, tmp_path_factory):
    """FSDP2 inside each group: each rank holds half the model and the cross-group average runs on
    those shards; the weights gathered in each group equal the plain run's."""
    reference = plain("gpt2-tiny")
    out = tmp_path_factory.mktemp("ft-fsdp")
    launch("gpt2-tiny", out, cache, 2, "parallel.strategy=fsdp")
    loss, weight = check_equal(reference, out)
    print(f"gpt2-tiny: 2 groups x 2 FSDP2 ranks vs 4-rank DDP: losses {loss:.3g}, weights {weight:.3g} apart")


# -- switching fault tolerance at a resume ----------------------------------------------------------


def one_rank(out: Path, cache: Path, tag: str, *extra: str, stop_at: int = 0, lighthouse_port: int = 0) -> None:
    """One process: a plain run, or with ``lighthouse_port`` a one-rank torchft replica group (the
    only one: replicas=1)."""
    args = overrides("gpt2-tiny", out, "max_steps=9", "save_every=3", *extra)
    if lighthouse_port:
        args += [
            "fault_tolerance.enabled=true",
            f"fault_tolerance.lighthouse=http://127.0.0.1:{lighthouse_port}",
            "fault_tolerance.replicas=1",
            "fault_tolerance.timeout_s=30",
            "fault_tolerance.quorum_timeout_s=30",
        ]
    spawn_ranks(_rank, ("gpt2-tiny", args, 1, [free_port()], str(cache), tag, stop_at), 1, 120)


def switched(out: Path, tag: str) -> list[str]:
    return [line for line in (out / f"log_{tag}_g0.txt").read_text().splitlines() if "fault tolerance switched" in line]


def test_a_run_switches_fault_tolerance_on_and_off_at_resume_and_trains_the_same(cache, tmp_path):
    """One run directory: steps 1-3 plain, 4-6 as a torchft replica group (resumed from the plain
    run's checkpoint), 7-9 plain again (resumed from the group's). Each switch is said in one line,
    and every step's loss and the final weights are those of a plain run that never stopped."""
    reference, run = tmp_path / "reference", tmp_path / "run"
    one_rank(reference, cache, "reference")
    one_rank(run, cache, "plain", stop_at=3)
    port = free_port()
    lh = lighthouse(port, 1)
    try:
        one_rank(run, cache, "ft", stop_at=6, lighthouse_port=port)
    finally:
        kill_group(lh)
    one_rank(run, cache, "plain_again")
    assert switched(run, "plain") == []
    (on,) = switched(run, "ft")
    assert on.startswith("fault tolerance switched on at this resume (step 3)"), on
    (off,) = switched(run, "plain_again")
    assert off.startswith("fault tolerance switched off at this resume (step 6)"), off
    expected = {r["step"]: r["loss"] for r in rows(reference / "metrics.jsonl")}
    assert sorted(expected) == list(range(1, 10))
    plain = {r["step"]: r["loss"] for r in rows(run / "metrics.jsonl")}
    # every step logged once: the group's steps in replicas/0/, not again by the plain run
    assert sorted(plain) == [1, 2, 3, 7, 8, 9]
    ft = rows(run / "replicas" / "0" / "metrics.jsonl")
    assert [r["step"] for r in ft] == [4, 5, 6] and all(r["quorum"] == "1/1" for r in ft)
    got = {**plain, **{r["step"]: r["loss"] for r in ft}}
    # one replica group alone: torchft's average over one participant is the gradient itself, and
    # the same ranks see the same samples: the continued run is the reference bit for bit
    assert got == expected
    want = torch.load(reference / "full_reference_g0.pt", weights_only=True)
    final = torch.load(run / "full_plain_again_g0.pt", weights_only=True)
    assert final.keys() == want.keys() and all(torch.equal(final[k], w) for k, w in want.items())
