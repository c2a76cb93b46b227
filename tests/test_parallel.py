"""Scale features on CPU: activation checkpointing, FSDP2 over 2 gloo processes, DCP resume
(same and different world size)."""
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tformer import build_model
from tformer.parallel.ac import apply_activation_checkpointing
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, losses, small_overrides

from conftest import TINY


# -- activation checkpointing ---------------------------------------------------------------

def _grads(model, batch):
    model.zero_grad()
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("mode,every", [("full", 1), ("selective", 2)])
def test_activation_checkpointing_changes_no_gradient_and_recomputes_blocks(name, mode, every):
    model = build_model(name, num_layers=4, **({"num_decoder_layers": 4} if "t5" in name else {}),
                        dropout=0.0).train()
    ids = torch.randint(3, 1000, (2, 16))
    batch = {"input_ids": ids, "labels": ids if model.config.family != "encdec" else ids[:, :8]}
    reference = _grads(model, batch)
    marked = apply_activation_checkpointing(model, mode, every)
    stacks = [m for m in model.modules() if m.__class__.__name__ == "TransformerStack"]
    assert marked == sum(len(s.layers) // (1 if mode == "full" else every) for s in stacks)
    calls = {}
    for s_i, stack in enumerate(stacks):
        for b_i, block in enumerate(stack.layers):
            # pre-hooks: recomputation may stop early (before a post-hook would fire)
            block.register_forward_pre_hook(lambda *a, key=(s_i, b_i): calls.__setitem__(key, calls.get(key, 0) + 1))
    checkpointed = _grads(model, batch)
    for n in reference:
        torch.testing.assert_close(checkpointed[n], reference[n], atol=1e-6, rtol=0)
    for (s_i, b_i), count in calls.items():
        expected = 2 if b_i in stacks[s_i].checkpointed else 1  # forward + recomputation in backward
        assert count == expected, (s_i, b_i, count)
    with torch.no_grad():  # no recomputation outside training
        calls.clear()
        model.eval()
        model(**batch)
        assert set(calls.values()) == {1}


# -- 2-process runs ------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, jobs, cache):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TFORMER_CACHE=str(cache))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from tformer.parallel.strategy import local_numel
    try:
        for recipe, overrides, stop_at, report in jobs:
            cfg = load_config(CONFIGS / f"{recipe}.yaml", overrides)
            stop = [] if stop_at is None else [
                lambda t, rec: setattr(t, "_stop_reason", "test stop") if rec["step"] == stop_at else None]
            trainer = Trainer(cfg, callbacks=stop)
            if report is not None:
                total = sum(p.numel() for p in trainer.model.parameters())  # DTensor: global size
                Path(report + f".rank{rank}").write_text(f"{local_numel(trainer.model)} {total}")
            trainer.fit()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def run_two_ranks(jobs, cache):
    mp.start_processes(_worker, args=(2, _free_port(), jobs, cache), nprocs=2, join=True, start_method="spawn")


def reference(recipe, out, *extra):
    cfg = load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, out, *extra, "grad_accum=2"))
    Trainer(cfg).fit()
    return losses(out)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("tformer-cache-parallel")
    os.environ["TFORMER_CACHE"] = str(path)
    return path


COMMON = ["max_steps=5", "eval_every=0", "save_every=0", "micro_batch_size=4"]  # first: max_steps
CASES = [  # (recipe, precision, fsdp reshard_after_forward)
    ("gpt2-tiny", "fp32", True), ("gpt2-tiny", "fp32", False), ("gpt2-tiny", "bf16", True),
    ("t5-tiny", "fp32", True), ("t5-tiny", "bf16", False), ("bert-tiny", "fp32", True),
]


def test_fsdp_matches_single_process_and_really_shards(cache, tmp_path):
    jobs = []
    for i, (recipe, precision, reshard) in enumerate(CASES):
        jobs.append((recipe, small_overrides(recipe, tmp_path / f"fsdp{i}", *COMMON, f"precision={precision}",
                                             "parallel.strategy=fsdp",
                                             f"parallel.reshard_after_forward={str(reshard).lower()}"),
                     None, str(tmp_path / f"numel{i}")))
    run_two_ranks(jobs, cache)
    for i, (recipe, precision, reshard) in enumerate(CASES):
        ref = reference(recipe, tmp_path / f"ref{i}", *COMMON, f"precision={precision}")
        got = losses(tmp_path / f"fsdp{i}")
        assert list(got) == list(ref) == [1, 2, 3, 4, 5]
        tol = 1e-5 if precision == "fp32" else 2e-2
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=tol), (recipe, precision, step)
        # each rank holds about half of the parameter elements
        for rank in (0, 1):
            local, total = map(int, (tmp_path / f"numel{i}.rank{rank}").read_text().split())
            assert abs(local / total - 0.5) < 0.02, (local, total)


def test_fsdp_resume_same_world_size_and_on_one_rank(cache, tmp_path):
    common = small_overrides("gpt2-tiny", tmp_path / "x", *COMMON, "precision=fp32", "save_every=2",
                             "parallel.strategy=fsdp", "model.dropout=0.0")[1:]
    straight = [f"output_dir={tmp_path / 'straight'}", *common]
    stopped = [f"output_dir={tmp_path / 'resumed'}", *common]
    run_two_ranks([("gpt2-tiny", straight, None, None), ("gpt2-tiny", stopped, 2, None),
                   ("gpt2-tiny", stopped, None, None)], cache)
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")  # last record per step
    assert list(a) == [1, 2, 3, 4, 5] and a == b  # 2 ranks -> stop at 2 -> 2 ranks: bitwise
    # a 2-rank FSDP checkpoint resumed by one process (DCP reshards on load)
    ckpt = tmp_path / "resumed" / "checkpoints" / "step_00000002"
    one = tmp_path / "one"
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", small_overrides(
        "gpt2-tiny", one, *COMMON, "precision=fp32", "model.dropout=0.0", "grad_accum=2", f"resume={ckpt}"))
    t = Trainer(cfg)
    assert t.step == 2
    t.fit()
    c = losses(one)
    assert list(c) == [3, 4, 5]
    for step in c:
        assert c[step] == pytest.approx(a[step], rel=1e-5)


# -- DeepSpeed ------------------------------------------------------------------------------

DS_CASES = [  # (recipe, precision, ZeRO stage)
    ("gpt2-tiny", "fp32", 1), ("gpt2-tiny", "fp32", 2), ("gpt2-tiny", "fp32", 3), ("gpt2-tiny", "bf16", 3),
    ("t5-tiny", "fp32", 2), ("t5-tiny", "bf16", 1), ("t5-tiny", "fp32", 3),
]


def _ds(stage):
    return [f"parallel.strategy=deepspeed", f"parallel.deepspeed_config={CONFIGS / 'deepspeed' / f'zero{stage}.json'}"]


def test_deepspeed_zero_stages_match_single_process(cache, tmp_path):
    pytest.importorskip("deepspeed")
    jobs = [(recipe, small_overrides(recipe, tmp_path / f"ds{i}", *COMMON, f"precision={precision}", *_ds(stage)),
             None, str(tmp_path / f"numel{i}"))
            for i, (recipe, precision, stage) in enumerate(DS_CASES)]
    run_two_ranks(jobs, cache)
    for i, (recipe, precision, stage) in enumerate(DS_CASES):
        ref = reference(recipe, tmp_path / f"ref{i}", *COMMON, f"precision={precision}")
        got = losses(tmp_path / f"ds{i}")
        assert list(got) == list(ref) == [1, 2, 3, 4, 5]
        tol = 1e-5 if precision == "fp32" else 2e-2
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=tol), (recipe, precision, stage, step)
        if stage == 3:  # ZeRO-3 partitions the parameters themselves
            for rank in (0, 1):
                local, total = map(int, (tmp_path / f"numel{i}.rank{rank}").read_text().split())
                assert abs(local / total - 0.5) < 0.02, (local, total)


def run_one_rank(jobs, cache):
    mp.start_processes(_worker, args=(1, _free_port(), jobs, cache), nprocs=1, join=True, start_method="spawn")


def test_deepspeed_resume_same_world_size_and_on_one_rank(cache, tmp_path):
    pytest.importorskip("deepspeed")
    common = [*COMMON[1:], "max_steps=5", "save_every=2", "precision=fp32", "model.dropout=0.0", *_ds(3)]
    straight = small_overrides("gpt2-tiny", tmp_path / "straight", *common)
    stopped = small_overrides("gpt2-tiny", tmp_path / "resumed", *common)
    run_two_ranks([("gpt2-tiny", straight, None, None), ("gpt2-tiny", stopped, 2, None),
                   ("gpt2-tiny", stopped, None, None)], cache)
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert list(a) == [1, 2, 3, 4, 5]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-6)
    # the 2-rank ZeRO-3 checkpoint of step 2, resumed by one rank through a universal checkpoint
    ckpt = tmp_path / "resumed" / "checkpoints" / "step_00000002"
    one = small_overrides("gpt2-tiny", tmp_path / "one", *common, "grad_accum=2", f"resume={ckpt}")
    run_one_rank([("gpt2-tiny", one, None, None)], cache)
    assert (ckpt / "deepspeed" / "state_universal").is_dir()
    c = losses(tmp_path / "one")
    assert list(c) == [3, 4, 5]
    assert c[3] == pytest.approx(a[3], rel=1e-6)  # the weights come back exactly
    for step in (4, 5):  # the Adam state through DeepSpeed's universal conversion drifts ~1e-5
        assert c[step] == pytest.approx(a[step], rel=2e-4)
