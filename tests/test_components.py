"""The step's figures (tformer/train/loop/figures.py) and the trainer's components
(tformer/train/loop/components.py), on their own: the replay of unread steps, the non-finite
accounting, the reason a run reads every step, the component list's calling order and what is
absent from it when a feature is off.

Figures are fp32 on the CPU; the sums compared here are of a few small integers and halves, exact
in fp32, so the comparisons are exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tformer.parallel.dist import DistInfo
from tformer.parallel.mesh import ParallelDims
from tformer.train.config import TrainConfig, load_config
from tformer.train.loop.components import MOVED, REWOUND, Component, Components
from tformer.train.loop.figures import (
    NonFiniteLoss,
    StepFigures,
    Streak,
    Unread,
    why_read_every_step,
)

from train_helpers import CONFIGS


def _cfg(*overrides: str) -> TrainConfig:
    return load_config(
        CONFIGS / "gpt2-tiny.yaml", ["max_steps=10", "log_every=4", "save_every=0", "eval_every=0", *overrides]
    )


def _figures(cfg: TrainConfig, world: int = 1, tp: int = 1, last_good=lambda: None) -> StepFigures:
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, tp=tp)
    return StepFigures(cfg, dims, world, 100.0, Streak(cfg, True, last_good))


def _row(loss_sum, tokens, flops, norm, ok) -> torch.Tensor:
    return torch.tensor([loss_sum, tokens, flops, norm, ok], dtype=torch.float32)


# -- the replay -------------------------------------------------------------------------------


def test_unread_steps_come_back_in_order_from_one_read_with_the_run_s_token_count():
    """Rows left on the device (tensors) and rows read at once (lists) replay in step order; each
    record's tokens are the run's running count, the loss the sum over the ranks that hold it."""
    f = _figures(_cfg(), world=2, tp=2)  # one tp group of 2: both ranks count the group's batch
    f.unread = [
        Unread(1, 0.1, _row(6.0, 40, 400.0, 1.5, 1), None, False),
        Unread(2, 0.2, [8.0, 60, 600.0, 2.5, 1.0], None, False),
        Unread(3, 0.3, _row(4.0, 20, 200.0, 0.5, 1), None, False),
    ]
    records, tokens = f.read(tokens=100)
    assert [r["step"] for r in records] == [1, 2, 3] and [r["lr"] for r in records] == [0.1, 0.2, 0.3]
    # loss: the sum over world // pp = 2 ranks; tokens: each tp rank counted the group's 20, 30, 10
    assert [r["loss"] for r in records] == [3.0, 4.0, 2.0]
    assert [r["tokens"] for r in records] == [120, 150, 160] and tokens == 160
    assert [r["grad_norm"] for r in records] == [1.5, 2.5, 0.5]
    assert f.window[1:3] == [60, 600.0] and f.unread == []


def test_a_logging_step_reports_the_rates_of_its_interval_and_starts_a_new_one():
    """A step that reads carries its own loss and the tokens/s, MFU and mean step time over the
    interval since the last logged step; only a logging step starts a new interval."""
    f = _figures(_cfg())
    tokens = 0
    for step, seconds in [(1, 1.0), (2, 3.0)]:
        tokens = f.add(Unread(step, 0.5, _row(2.0, 10, 50.0, 1.0, 1), None, False), tokens, read=False)
        unread = f.record(step, 0.5, seconds, {"memory": step})
        assert unread == {"step": step, "lr": 0.5, "step_time": seconds, "memory": step}  # no figures yet
    tokens = f.add(Unread(3, 0.5, _row(3.0, 10, 50.0, 1.0, 1), None, False), tokens, read=True)
    record = f.record(3, 0.5, 2.0, {})
    assert [r["step"] for r in f.replayed] == [1, 2] and record["loss"] == 3.0 and tokens == 30
    assert record["tokens_per_s"] == 30 / 6.0 and record["step_time"] == 2.0  # 6 s over 3 steps
    assert record["mfu"] == 150.0 / 1 / 6.0 / 100.0
    assert f.window == [6.0, 30, 150.0, 3]  # step 3 reads (a stop, say) but does not log: same interval
    f.add(Unread(4, 0.5, _row(3.0, 10, 50.0, 1.0, 1), None, False), tokens, read=True)
    f.record(4, 0.5, 2.0, {})
    assert f.window == [0.0, 0, 0.0, 0]  # step 4 logs (log_every=4): a new interval


def test_an_moe_table_joins_the_same_read():
    """A logging step's model table (MoE routing, mtp_loss) is read with the rows (one transfer) and
    its figures land in that step's record."""
    f = _figures(_cfg())
    from tformer.models.figures import TableKeys

    keys = TableKeys(("balance", "z_loss", "tokens_max_over_mean", "dropped"), 2, ("mtp_loss",))
    table = torch.tensor([0.5, 0.25, 2.0, 0.0, 1.5, 0.75, 4.0, 0.5, 3.25])  # 2 MoE layers, then mtp_loss
    f.unread = [
        Unread(1, 0.1, _row(1.0, 1, 1.0, 1.0, 1), None, False),
        Unread(2, 0.1, _row(1.0, 1, 1.0, 1.0, 1), (keys, table), False),
    ]
    calls = []
    real = torch.Tensor.tolist

    def counted(self):
        calls.append(1)
        return real(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "tolist", counted)
        records, _ = f.read(0)
    assert len(calls) == 1
    assert not any(k.startswith("moe/") for k in records[0])
    assert records[1]["moe/tokens_max_over_mean_worst"] == 4.0 and records[1]["mtp_loss"] == 3.25, records[1]


# -- the non-finite accounting ----------------------------------------------------------------


def test_the_replay_counts_a_streak_and_a_good_step_ends_it():
    f = _figures(_cfg("max_skipped_steps=5"))
    nan = float("nan")
    f.unread = [
        Unread(s, 0.1, _row(nan if s in (2, 3) else 1.0, 1, 1.0, 1.0, 0 if s in (2, 3) else 1), None, False)
        for s in (1, 2, 3)
    ]
    f.read(0)
    assert (f.streak.skipped, f.streak.start) == (2, 2)  # from step 2, not from the step that read
    assert not f.streak.allows_checkpoint(3)
    f.unread = [Unread(4, 0.1, _row(1.0, 1, 1.0, 1.0, 1), None, False)]
    f.read(0)
    assert (f.streak.skipped, f.streak.start) == (0, None) and f.streak.allows_checkpoint(4)


@pytest.mark.parametrize(
    "overrides, must_stop, why",
    [
        (["on_nonfinite=stop"], False, "on_nonfinite=stop, 1 bad step"),
        (["max_skipped_steps=0"], False, "on_nonfinite=skip, 1 bad step"),
        ([], True, "the engine could not skip it"),
    ],
)
def test_a_stop_names_the_step_it_happened_at_and_the_last_good_checkpoint(overrides, must_stop, why):
    """Read at step 4, a NaN of step 2 stops the run naming step 2 and the checkpoint to go back to."""
    f = _figures(_cfg(*overrides), last_good=lambda: Path("ckpt/step_00000001"))
    f.unread = [
        Unread(1, 0.1, _row(1.0, 1, 1.0, 1.0, 1), None, False),
        Unread(2, 0.1, [1.0, 1, 1.0, float("inf"), 0.0], None, must_stop),
        Unread(3, 0.1, _row(1.0, 1, 1.0, 1.0, 1), None, False),
    ]
    with pytest.raises(NonFiniteLoss, match=r"non-finite grad_norm=inf at step 2; stopping \(" + why) as e:
        f.read(0)
    assert "the last good checkpoint is ckpt/step_00000001" in str(e.value)


# -- the read reason and the steps that read --------------------------------------------------


class _Fused:
    defaults = {"fused": True}


class _Foreach:
    defaults = {"fused": False}


class _Clips:
    def clip_for_step(self, *a):
        pass


@pytest.mark.parametrize(
    "strategy, optimizer, scaler, overrides, replicas, reason",
    [
        (object(), _Fused(), None, [], False, "DeepSpeed's engine"),
        (_Clips(), _Fused(), None, [], True, "torchft's commit vote"),
        (_Clips(), _Fused(), object(), [], False, "fp16's GradScaler"),
        (_Clips(), _Foreach(), None, ["optim.fused=false"], False, "optim.fused=false"),
        (_Clips(), _Foreach(), None, [], False, "plain and DTensor parameters side by side"),
        (_Clips(), _Fused(), None, ["max_tokens=1000"], False, "max_tokens stops"),
        (_Clips(), _Fused(), None, [], False, None),
    ],
)
def test_the_reason_a_run_reads_every_step(strategy, optimizer, scaler, overrides, replicas, reason):
    found = why_read_every_step(strategy, optimizer, scaler, _cfg(*overrides), replicas)
    assert (found is None) if reason is None else (reason in (found or "")), found


def test_the_steps_that_read_without_a_reason():
    f = _figures(_cfg("save_every=3", "eval_every=5"))
    assert [s for s in range(1, 11) if f.reads_at(s)] == [3, 4, 5, 6, 8, 9, 10]
    assert f.reads_at(1, traced=True) and f.reads_at(1, stopping=True)
    f.reason = "because"
    assert all(f.reads_at(s) for s in range(1, 11))


# -- the component list -----------------------------------------------------------------------


class _Recorder(Component):
    def __init__(self, name: str, calls: list, answer: int = 0):
        self.name, self.calls, self.answer = name, calls, answer

    def before_step(self, step):
        self.calls.append((self.name, "before_step", step))
        return self.answer

    def after_step(self, step, record, seconds):
        self.calls.append((self.name, "after_step", step))
        return self.answer

    def close(self):
        self.calls.append((self.name, "close"))


class _OnlyLogs(Component):
    def __init__(self, calls):
        self.calls = calls

    def log(self, record):
        self.calls.append(("logs", "log", record["step"]))


def test_components_are_called_in_list_order_and_only_where_they_have_a_hook():
    calls: list = []
    parts = Components([_Recorder("a", calls), _OnlyLogs(calls), _Recorder("b", calls, MOVED)])
    assert parts.before_step(3) == MOVED  # one component moved the run: the loop hears it
    parts.log({"step": 3})
    parts.after_step(3, {}, 1.0)
    parts.phase(3, "data")  # nobody beats: nothing is called
    parts.close()
    assert calls == [
        ("a", "before_step", 3),
        ("b", "before_step", 3),
        ("logs", "log", 3),
        ("a", "after_step", 3),
        ("b", "after_step", 3),
        ("a", "close"),
        ("b", "close"),
    ]
    assert parts._hooks["phase"] == [] and len(parts._hooks["log"]) == 1
    assert Components([_Recorder("a", [], REWOUND), _Recorder("b", [], MOVED)]).after_step(1, {}, 0.0) == REWOUND


def _bare_trainer(tmp_path, *overrides):
    """A Trainer with only what ``_components`` reads (no model, no data): the list it builds."""
    from tformer.train.loop.figures import StepFigures
    from tformer.train.observe.profiling import OFF
    from tformer.train.observe.stragglers import StepTimes
    from tformer.train.trainer import Trainer

    cfg = _cfg(f"output_dir={tmp_path}", "progress=false", *overrides)
    t = Trainer.__new__(Trainer)
    t.cfg, t.dist, t.step, t.ft, t.wandb_id, t.precision = cfg, DistInfo(), 0, None, None, "fp32"
    t.out = t.log_dir = tmp_path
    t.resolved, t.times, t.prof = {}, StepTimes(), OFF
    t.figures = StepFigures(cfg, ParallelDims(1, 1, 1), 1, 1.0, Streak(cfg, True, lambda: None))
    return t


@pytest.mark.parametrize(
    "overrides, names",
    [
        ([], ["SlowRanks", "Console", "StopSignals"]),
        (["on_spike=warn"], ["SpikeCheck", "SlowRanks", "Console", "StopSignals"]),
        (
            ["watchdog_timeout=30", "on_spike=rollback", "profile.steps=2"],
            ["Profiling", "WatchdogBeats", "SpikeCheck", "SlowRanks", "Console", "StopSignals"],
        ),
    ],
)
def test_a_feature_that_is_off_is_not_in_the_list(tmp_path, overrides, names):
    t = _bare_trainer(tmp_path, *overrides)
    parts = t._components()
    try:
        assert parts.names() == names
        # the hooks the loop calls at every phase: only the watchdog's, where it is on
        assert len(parts._hooks["phase"]) == ("WatchdogBeats" in names)
    finally:
        parts.close()


def test_a_run_calls_its_components_at_fixed_points(cache, tmp_path, monkeypatch):
    """A real run of 3 steps, logging every 2nd, with a recording component at the head of the
    list: quorum-like calls before each step, then after it, the logged steps' fields and lines,
    the end of each step, and close, in that order."""
    from tformer.train.trainer import Trainer
    from train_helpers import small_overrides

    calls: list = []

    class Everything(Component):
        def before_step(self, step):
            calls.append(("before_step", step))
            return 0

        def phase(self, step, name):
            if name in ("optimizer step", "save"):
                calls.append(("phase", step, name))

        def after_step(self, step, record, seconds):
            calls.append(("after_step", step, "loss" in record, seconds > 0))
            return 0

        def at_log(self, record):
            calls.append(("at_log", record["step"]))

        def log(self, record):
            calls.append(("log", record["step"], "slowest_rank" in record))

        def end_step(self, step, record):
            calls.append(("end_step", step))

        def close(self):
            calls.append(("close",))

    real = Trainer._components
    monkeypatch.setattr(Trainer, "_components", lambda self: Components([Everything(), *real(self).items]))
    overrides = small_overrides("gpt2-tiny", tmp_path, "max_steps=3", "log_every=2", "eval_every=0", "save_every=0")
    Trainer(load_config(CONFIGS / "gpt2-tiny.yaml", overrides)).fit()
    assert calls == [
        ("before_step", 1),
        ("phase", 0, "optimizer step"),
        ("after_step", 1, False, True),  # not a logging step: its figures stay on the device
        ("end_step", 1),
        ("before_step", 2),
        ("phase", 1, "optimizer step"),
        ("after_step", 2, True, True),
        ("at_log", 2),
        ("log", 2, True),  # the slow-rank fields, added at_log by the component after this one
        ("end_step", 2),
        ("before_step", 3),
        ("phase", 2, "optimizer step"),
        ("after_step", 3, True, True),
        ("phase", 3, "save"),  # the last step is saved before it is logged
        ("at_log", 3),
        ("log", 3, True),
        ("end_step", 3),
        ("close",),
    ], calls


# -- the suite's lanes ------------------------------------------------------------------------


def test_each_lane_and_isa_compiles_into_its_own_inductor_cache():
    """The default lane, the long lane and an ISA forced with ATEN_CPU_CAPABILITY never share
    inductor's cache (a kernel of one aborted the other); this session's is set before any test."""
    import os

    from train_helpers import inductor_cache_dir

    default = inductor_cache_dir("not cluster and not long", {})
    dirs = {
        default,
        inductor_cache_dir("long", {}),
        inductor_cache_dir("not cluster and not long", {"ATEN_CPU_CAPABILITY": "avx2"}),
        inductor_cache_dir("not cluster and not long", {"ATEN_CPU_CAPABILITY": "default"}),
        inductor_cache_dir("not cluster and not long", {"OMP_NUM_THREADS": "1"}),
    }
    assert len(dirs) == 5, dirs
    assert default == inductor_cache_dir("not cluster and not long", {})  # and a lane keeps its own across runs
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR")
