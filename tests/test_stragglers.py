"""The rank slow in its forward named (tformer/train/observe/stragglers.py): 2 ranks under DDP, FSDP2 and
TP, rank 1's forward 0.15 s slower each step (a sleep in its first block, inside the collectives'
reach: the other rank waits for it in the backward's gradient all-reduce, in FSDP2's all-gathers,
in TP's redistributions). Counting only the closing all-reduce's wait, as before, named rank 1 at
17 of 37 logging steps and rank 0 at the others (the issue's measurement); with the waits inside
the forward and backward timed, rank 1 is named at every step after the first here. A run without
a slow rank names nobody."""

from __future__ import annotations

import time

import pytest

from tformer.nn import TransformerBlock
from tformer.train.config import load_config
from tformer.train.trainer import Trainer
from train_helpers import CONFIGS, become_rank, free_port, metrics, small_overrides, spawn_ranks

LATE_S = 0.15
STEPS = 10


# Two ranks: the median is their mean, so a rank sleeping LATE_S in a ~25 ms step reads ~1.75x it;
# an even run on a loaded 2-core machine was measured up to 1.21x (preemption alone, in the full
# suite), over the default 1.2: the test names at 1.4, between the two
FACTOR = 1.4


def _overrides(out, *extra):
    base = [f"max_steps={STEPS}", "eval_every=0", "save_every=0", "micro_batch_size=4", "data.tokenizer_max_rows=4000"]
    base.append(f"slow_rank_factor={FACTOR}")
    return small_overrides("gpt2-tiny", out, *base, *extra)


def _worker(rank, world, port, jobs, cache):
    become_rank(rank, world, port, cache, 120)
    import torch.distributed as dist

    try:
        for overrides, slow in jobs:
            trainer = Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", overrides))
            if slow is not None and rank == slow:
                block = next(m for m in trainer.model.modules() if isinstance(m, TransformerBlock))
                block.register_forward_pre_hook(lambda *_: time.sleep(LATE_S))
            trainer.fit()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


LAYOUTS = {
    "ddp": [],
    "fsdp": ["parallel.strategy=fsdp"],
    "tp": ["parallel.strategy=fsdp", "parallel.tp=2"],
}


@pytest.mark.timeout(400)
def test_the_rank_slow_in_its_forward_is_named_under_ddp_fsdp2_and_tp_and_nobody_without_one(cache, tmp_path):
    jobs = [(_overrides(tmp_path / name, *extra), 1) for name, extra in LAYOUTS.items()]
    jobs.append((_overrides(tmp_path / "even"), None))
    spawn_ranks(_worker, (2, free_port(), jobs, cache), 2, 360)
    for name in LAYOUTS:
        later = metrics(tmp_path / name)[1:]  # the first step's start-up can hide the slowdown
        assert not [r for r in later if r.get("slow_rank") == 0], (name, later)  # the fast rank never
        named = [r for r in later if r.get("slow_rank") == 1]
        assert len(named) >= 0.8 * len(later), (
            name,
            [(r["step"], r["slowest_rank"], r["slowest_rank_ratio"]) for r in later],
        )
    even = metrics(tmp_path / "even")[1:]
    assert not [r for r in even if "slow_rank" in r], [(r["step"], r["slowest_rank_ratio"]) for r in even]
