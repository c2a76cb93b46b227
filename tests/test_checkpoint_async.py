"""Async checkpointing (``checkpoint.async=true``): the loop goes on while a save is written, the
commit waits for the write, a kill mid-write leaves the previous checkpoint intact, and a resume
is bitwise -- in one process and on 2 gloo ranks (ddp, fsdp)."""

import json
import signal
import sys
import threading
import time

import pytest
import torch

from tformer.checkpoint import CheckpointManager, TrainerState, list_checkpoints, verify
from tformer.train.config import load_config
from tformer.train.trainer import Trainer

from train_helpers import CONFIGS, ROOT, env, losses, run_cmd, small_overrides

ASYNC = "checkpoint.async=true"


def trainer(out, *extra, callbacks=()):
    cfg = load_config(CONFIGS / "gpt2-tiny.yaml", small_overrides("gpt2-tiny", out, "eval_every=0", *extra))
    return Trainer(cfg, callbacks)


def stop_at(step):
    return lambda t, rec: setattr(t, "_stop_reason", "test stop") if rec["step"] == step else None


def test_the_loop_goes_on_while_a_save_is_written_and_the_commit_waits_for_it(cache, tmp_path, monkeypatch):
    """A slow disk: the DCP write of step 4 is held until the loop has finished step 7 (or 60 s
    pass, as they would if the loop waited for the write). Steps 5-7 run while it is written, no
    COMPLETE marker exists before the write ends, and the save of step 8 waits for it."""
    from torch.distributed.checkpoint import filesystem

    real_write = filesystem._FileSystemWriter.write_data
    events, step7 = {}, threading.Event()

    def slow_write(self, plan, planner):
        if "step_00000004" in str(self.path):
            events["write_start"] = time.perf_counter()
            events["held"] = step7.wait(60)
            # the commit has not happened: nothing is sealed, nothing renamed
            events["sealed_early"] = (self.path.parent / "COMPLETE").exists() or (
                tmp_path / "checkpoints" / "step_00000004"
            ).exists()
            result = real_write(self, plan, planner)
            events["write_end"] = time.perf_counter()
            return result
        return real_write(self, plan, planner)

    monkeypatch.setattr(filesystem._FileSystemWriter, "write_data", slow_write)
    stamps = {}

    def stamp(tr, rec):
        stamps[rec["step"]] = time.perf_counter()
        if rec["step"] == 7:
            step7.set()

    t = trainer(tmp_path, "max_steps=8", "save_every=4", ASYNC, callbacks=[stamp])
    assert t.ckpt.background
    real_save = t.save
    saves = {}

    def timed_save():
        t0 = time.perf_counter()
        path = real_save()
        saves[t.step] = (t0, time.perf_counter())
        return path

    t.save = timed_save
    t.fit()
    assert events["held"] and events["sealed_early"] is False
    # the save of step 4 returned before its write ended; steps 5-7 ran while it was written
    assert saves[4][1] < events["write_end"]
    for step in (5, 6, 7):
        assert events["write_start"] < stamps[step] < events["write_end"], step
    # the save of step 8 began only once step 4's was committed (one save at a time)
    assert saves[8][1] > events["write_end"]
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000004", "step_00000008"]
    for p in list_checkpoints(tmp_path / "checkpoints"):
        verify(p, deep=True)
    assert not list((tmp_path / "checkpoints").glob(".partial-*"))


def test_async_checkpoints_equal_sync_ones_and_resume_bitwise(cache, tmp_path):
    common = ["max_steps=6", "save_every=2", "keep_checkpoints=2"]
    trainer(tmp_path / "sync", *common).fit()
    trainer(tmp_path / "async", *common, ASYNC).fit()
    # stopped at 3 (its final save is async too), resumed to 6
    trainer(tmp_path / "resumed", *common, ASYNC, callbacks=[stop_at(3)]).fit()
    t = trainer(tmp_path / "resumed", *common, ASYNC)
    assert t.step == 3
    t.fit()
    a, b, c = losses(tmp_path / "sync"), losses(tmp_path / "async"), losses(tmp_path / "resumed")
    assert list(a) == [1, 2, 3, 4, 5, 6] and a == b == c
    # keep_checkpoints counts committed checkpoints only
    assert [p.name for p in list_checkpoints(tmp_path / "async" / "checkpoints")] == ["step_00000004", "step_00000006"]
    from safetensors.torch import load_file

    for name in ("step_00000004", "step_00000006"):
        x = load_file(tmp_path / "sync" / "checkpoints" / name / "model.safetensors")
        y = load_file(tmp_path / "async" / "checkpoints" / name / "model.safetensors")
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
        sync_state = json.loads((tmp_path / "sync" / "checkpoints" / name / "trainer.json").read_text())
        async_state = json.loads((tmp_path / "async" / "checkpoints" / name / "trainer.json").read_text())
        for key in ("step", "consumed_samples", "tokens", "world_size", "mesh", "model_config"):
            assert sync_state[key] == async_state[key], key


def test_sigkill_during_an_async_write_leaves_the_previous_checkpoint(cache, tmp_path):
    common = ["max_steps=6", "save_every=2", ASYNC]
    script = str(ROOT / "tests" / "kill_during_training.py")

    def run(out, *extra):
        args = [
            sys.executable,
            script,
            str(CONFIGS / "gpt2-tiny.yaml"),
            *small_overrides("gpt2-tiny", out, "eval_every=0", *common),
            *extra,
        ]
        return run_cmd(args, 300, env=env(cache))

    straight = run(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = run(tmp_path / "resumed", "--kill-in-async-write", "4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = tmp_path / "resumed" / "checkpoints"
    partial = root / ".partial-step_00000004"
    assert partial.is_dir() and not (partial / "COMPLETE").exists()
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    verify(root / "step_00000002", deep=True)
    resumed = run(tmp_path / "resumed")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step_00000002" in resumed.stderr
    assert losses(tmp_path / "resumed") == losses(tmp_path / "straight")
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002", "step_00000004", "step_00000006"]


def test_a_failed_background_write_is_one_error_and_never_committed(tmp_path):
    """The manager alone: a write that fails raises when it is waited for, naming the step."""
    from tformer.checkpoint import CheckpointError

    class Failing:
        def result(self):
            raise OSError("disk full")

    class Writes:  # a part whose files are written in the background: ``write()`` stands for them
        can_write_in_background = True
        write = Failing

        def save(self, tmp, background):
            return self.write()

        def load(self, ckpt, saved):
            pass

    part = Writes()
    m = CheckpointManager(tmp_path, background=True, parts={"model": part})
    m.save(3)
    with pytest.raises(CheckpointError, match="background save of step 3 failed.*disk full"):
        m.wait()
    assert list_checkpoints(tmp_path) == [] and (tmp_path / ".partial-step_00000003").is_dir()
    gate = threading.Event()

    class Slow:
        def result(self):
            gate.wait(30)

    part.write = Slow
    m.save(4)
    assert m.poll() is None and m.in_flight == 4 and list_checkpoints(tmp_path) == []
    gate.set()
    assert m.wait() == tmp_path / "step_00000004" and m.in_flight is None
    verify(tmp_path / "step_00000004", deep=True)


def test_trainer_state_round_trips_and_reads_older_files(tmp_path):
    state = TrainerState(step=7, tokens=11, world_size=2, mesh="dp_replicate=1 dp_shard=2 tp=1")
    state.write(tmp_path)
    data = json.loads((tmp_path / "trainer.json").read_text())
    assert "weights_only" not in data and data["mesh"] == state.mesh
    assert TrainerState.from_dict(data) == state
    old = TrainerState.from_dict({"step": 1, "consumed_samples": 8, "tokens": 64, "unknown_later_key": 1})
    assert old.rollbacks == 0 and old.spike_detector == {} and not old.weights_only


# -- 2 gloo ranks --------------------------------------------------------------------------


def run_two_ranks(jobs, cache, timeout=400):
    """test_parallel's workers, with a deadline that fails the test instead of hanging it."""
    from test_parallel import run_two_ranks as run

    run(jobs, cache, timeout)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_async_saves_on_two_ranks_resume_bitwise(cache, tmp_path, strategy):
    common = small_overrides(
        "gpt2-tiny",
        tmp_path / "x",
        "max_steps=5",
        "eval_every=0",
        "save_every=2",
        "micro_batch_size=4",
        "precision=fp32",
        f"parallel.strategy={strategy}",
        ASYNC,
    )[1:]
    straight = [f"output_dir={tmp_path / 'straight'}", *common]
    stopped = [f"output_dir={tmp_path / 'resumed'}", *common]
    run_two_ranks(
        [("gpt2-tiny", straight, None, None), ("gpt2-tiny", stopped, 3, None), ("gpt2-tiny", stopped, None, None)], cache
    )
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert list(a) == [1, 2, 3, 4, 5] and a == b
    for run in ("straight", "resumed"):
        for p in list_checkpoints(tmp_path / run / "checkpoints"):
            verify(p, deep=True)
            assert (p / "rng_rank0.pt").is_file() and (p / "rng_rank1.pt").is_file()
        assert not list((tmp_path / run / "checkpoints").glob(".partial-*"))
    names = [p.name for p in list_checkpoints(tmp_path / "resumed" / "checkpoints")]
    assert names[-3:] == ["step_00000003", "step_00000004", "step_00000005"]
