"""Resilience: non-finite streaks never leave a bad "last good" checkpoint, loss spikes roll back
and skip data exactly, and every bad key value or CLI flag is one error line."""

import json
import math
import re
import signal
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tformer.checkpoint import list_checkpoints
from tformer.train.config import load_config
from tformer.train.trainer import NonFiniteLoss, Trainer

from train_helpers import CONFIGS, ROOT, env, losses, metrics, run_cli, run_cmd, small_overrides


def trainer(out, *extra, recipe="gpt2-tiny"):
    return Trainer(load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, out, *extra)))


# -- non-finite streaks ----------------------------------------------------------------------


def test_nan_streak_names_a_last_good_checkpoint_that_resumes_finite(cache, tmp_path):
    """The update of step 3 poisons the weights (checkpoint 3 holds them, saved at a finite loss);
    steps 4.. are NaN and skipped. No checkpoint is written during the streak, and the error
    names step 2, whose weights give a finite loss again."""
    t = trainer(
        tmp_path / "run", "max_steps=10", "save_every=1", "eval_every=0", "max_skipped_steps=2", "keep_checkpoints=10"
    )
    step = t.optimizer.step

    def poisoned(*a, **kw):
        out = step(*a, **kw)
        if t.step == 2:  # inside optimizer step 3
            with torch.no_grad():
                t.model.embed.tok.weight.fill_(float("nan"))
        return out

    t.optimizer.step = poisoned
    with pytest.raises(NonFiniteLoss, match=r"at step 6; stopping .*last good checkpoint is \S+step_00000002;") as e:
        t.fit()
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [
        "step_00000001",
        "step_00000002",
        "step_00000003",
    ]  # none written during the streak
    named = Path(re.search(r"last good checkpoint is (\S+);", str(e.value)).group(1))
    resumed = trainer(tmp_path / "resumed", "max_steps=4", "save_every=0", "eval_every=0", f"resume={named}")
    resumed.fit()
    rows = metrics(tmp_path / "resumed")
    assert [r["step"] for r in rows] == [3, 4] and all(math.isfinite(r["loss"]) for r in rows)


# -- loss spikes -------------------------------------------------------------------------------

SPIKE = [
    "max_steps=12",
    "save_every=2",
    "eval_every=0",
    "precision=fp32",
    "model.dropout=0.1",
    "micro_batch_size=4",
    "on_spike=rollback",
    "spike_window=3",
    "spike_warmup=3",
    "spike_factor=3",
    "spike_skip_batches=2",
    "max_rollbacks=2",
]
PLANTED = 6 * 4  # the batch of step 7 (6 steps x 4 samples consumed before it)


def _run(cache, out, *extra, kill_after=None, spike_at=None):
    args = [
        sys.executable,
        str(ROOT / "tests" / "kill_during_training.py"),
        str(CONFIGS / "gpt2-tiny.yaml"),
        *small_overrides("gpt2-tiny", out, *extra),
    ]
    if kill_after is not None:
        args += ["--kill-after", str(kill_after)]
    if spike_at is not None:
        args += ["--spike-at-sample", str(spike_at)]
    return run_cmd(args, 600, env=env(cache))


def test_spike_rolls_back_skips_data_and_resumes_exactly_after_a_kill_in_the_skip_window(cache, tmp_path):
    straight = _run(cache, tmp_path / "straight", *SPIKE, spike_at=PLANTED)
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "loss spike at step 7" in straight.stderr and "rolled back to" in straight.stderr
    rows = metrics(tmp_path / "straight")
    spike = [r for r in rows if r.get("spike")]
    assert len(spike) == 1 and spike[0]["step"] == 7 and spike[0]["rollback_to"] == 6
    assert rows[-1]["step"] == 12 and math.isfinite(rows[-1]["loss"])
    events = json.loads((tmp_path / "straight" / "rollbacks.json").read_text())
    assert [(e["spike_step"], e["to_step"], e["skip_from_sample"], e["skip_samples"]) for e in events] == [
        (7, 6, PLANTED, 8)
    ]
    final = json.loads((tmp_path / "straight" / "checkpoints" / "step_00000012" / "trainer.json").read_text())
    assert final["rollbacks"] == 1 and final["consumed_samples"] == 12 * 4 + 8  # the skipped batches
    # killed after step 7 of the replay: the newest checkpoint (6) predates the rollback
    killed = _run(cache, tmp_path / "resumed", *SPIKE, spike_at=PLANTED, kill_after=7)
    assert killed.returncode == -signal.SIGKILL
    resumed = _run(cache, tmp_path / "resumed", *SPIKE, spike_at=PLANTED)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming rollback 1: skipping samples 24-31" in resumed.stderr
    assert "loss spike" not in resumed.stderr  # the skip was resumed, not rediscovered
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert list(a) == list(range(1, 13)) and a == b
    wa = load_file(tmp_path / "straight" / "checkpoints" / "step_00000012" / "model.safetensors")
    wb = load_file(tmp_path / "resumed" / "checkpoints" / "step_00000012" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_spike_read_a_step_late_rolls_back_as_a_spike_read_at_once(cache, tmp_path):
    """At log_every=4 step 7's loss stays on the device until step 8's read (a saving step): the
    spike is judged then, in step order, and the run rolls back to checkpoint 6 before step 8's
    checkpoint is written; from there it is the run that read step 7 at once, bitwise."""

    def spike_once(t):
        forward, fired = t.model.forward, []

        def at_7(*a, **kw):
            out = forward(*a, **kw)
            if t.model.training and t.step == 6 and not fired:
                fired.append(True)
                out.loss = out.loss * 100.0
            return out

        t.model.forward = at_7

    runs = {}
    for log_every in (1, 4):
        t = trainer(tmp_path / str(log_every), *SPIKE, f"log_every={log_every}")
        spike_once(t)
        t.fit()
        events = json.loads((tmp_path / str(log_every) / "rollbacks.json").read_text())
        assert [(e["spike_step"], e["to_step"]) for e in events] == [(7, 6)], log_every
        runs[log_every] = t
    spike = [r for r in metrics(tmp_path / "4") if r.get("spike")]
    assert len(spike) == 1 and spike[0]["step"] == 7 and spike[0]["rollback_to"] == 6
    a, b = (runs[k].model.state_dict() for k in (1, 4))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert runs[1].consumed == runs[4].consumed == 12 * 4 + 8


def test_spike_options_change_nothing_without_a_spike(cache, tmp_path):
    common = [s for s in SPIKE if not s.startswith("on_spike")]
    trainer(tmp_path / "off", *common, "on_spike=none").fit()
    trainer(tmp_path / "on", *common, "on_spike=rollback").fit()
    assert losses(tmp_path / "off") == losses(tmp_path / "on")
    wa = load_file(tmp_path / "off" / "checkpoints" / "step_00000012" / "model.safetensors")
    wb = load_file(tmp_path / "on" / "checkpoints" / "step_00000012" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not (tmp_path / "on" / "rollbacks.json").exists()


def test_spike_detector_judges_against_the_running_median():
    from tformer.train.resilience.spike import SpikeDetector

    d = SpikeDetector(factor=2.0, window=3, warmup=2)
    assert [d.check(s, x) for s, x in enumerate([5.0, 4.0, 9.0], 1)] == [None, None, None]  # window filling
    assert d.check(4, 11.0) == 5.0  # median of 5, 4, 9
    assert d.check(5, float("nan")) is None and list(d.losses) == [5.0, 4.0, 9.0]  # spikes/NaN stay out
    assert d.check(6, 8.0) is None and list(d.losses) == [4.0, 9.0, 8.0]
    d2 = SpikeDetector(2.0, 3, 2)
    d2.load_state_dict(d.state_dict())
    assert d2.check(7, 100.0) == d.check(7, 100.0) == 8.0


def test_spike_stop_after_max_rollbacks(cache, tmp_path):
    t = trainer(
        tmp_path, *[s for s in SPIKE if not s.startswith("max_rollbacks")], "max_rollbacks=1", "spike_skip_batches=0"
    )
    forward = t.model.forward

    def always_at_7(*a, **kw):  # the spike comes back after every rollback (no data skipped)
        out = forward(*a, **kw)
        if t.model.training and t.step == 6:
            out.loss = out.loss * 100.0
        return out

    t.model.forward = always_at_7
    from tformer.train.trainer import LossSpikeError

    with pytest.raises(
        LossSpikeError,
        match=r"loss spike at step 7.*max_rollbacks=1 reached; the last good "
        r"checkpoint is \S+step_00000006",
    ):
        t.fit()


# -- watchdog (the 2-process SIGSTOP test is in test_launch.py) ---------------------------------


def test_watchdog_names_the_rank_that_stopped_responding(tmp_path):
    import time
    from tformer.train.observe.watchdog import Watchdog

    live = Watchdog(tmp_path, rank=0, world_size=2, timeout=5.0)
    stuck = Watchdog(tmp_path, rank=1, world_size=2, timeout=5.0)
    live.beat(7, "forward-backward")
    stuck.beat(7, "data")
    live._write_heartbeat()
    stuck._write_heartbeat()
    hb = json.loads((tmp_path / "heartbeat_rank1.json").read_text())
    (tmp_path / "heartbeat_rank1.json").write_text(json.dumps(dict(hb, written=time.time() - 40)))
    live._progress -= 12
    report = live.report()
    assert "rank 1 not responding for 40 s, last at step 7 (data)" in report
    assert "rank 0 waiting 12 s at step 7 (forward-backward)" in report


def test_watchdog_warns_when_a_step_takes_most_of_the_timeout(caplog):
    from tformer.train.dist import DistInfo

    t = Trainer.__new__(Trainer)
    t.cfg = load_config(CONFIGS / "gpt2-tiny.yaml", ["watchdog_timeout=10"])
    t.dist, t.step, t._watchdog_warned = DistInfo(), 5, False
    with caplog.at_level("WARNING", logger="tformer.train"):
        t._check_watchdog_margin(2.0)
        assert "watchdog_timeout" not in caplog.text
        t._check_watchdog_margin(6.0)
    assert "watchdog_timeout=10 s is short: a step took 6.0 s here; raise it to at least 24 s" in caplog.text


# -- bad input: every numeric key's range, every CLI flag ---------------------------------------


def _ranges(moe: bool = False):
    from tformer.config import MLA_RANGES, MODEL_RANGES, MOE_RANGES, YARN_RANGES
    from tformer.train.config import RANGES

    sections = {"moe": MOE_RANGES, "mla": MLA_RANGES, "yarn": YARN_RANGES} if moe else {}
    nested = {f"model.{s}.{k}": v for s, table in sections.items() for k, v in table.items()}
    return {**RANGES, **{f"model.{k}": v for k, v in MODEL_RANGES.items()}, **nested}


def _numeric_fields(cls, prefix=""):
    import dataclasses
    from typing import get_type_hints

    hints = get_type_hints(cls)
    for f in fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            yield from _numeric_fields(hint, f"{prefix}{f.name}.")
        # a step spec that may be a number or a list (profile.steps: "3-4", 5, [3, 9]) has no range
        elif any(t in str(hint) for t in ("int", "float")) and not any(t in str(hint) for t in ("bool", "list")):
            yield f"{prefix}{f.name}"


def test_every_numeric_key_has_a_documented_range():
    from tformer.config import ModelConfig
    from tformer.train.config import TrainConfig

    keys = set(_numeric_fields(TrainConfig)) | {f"model.{k}" for k in _numeric_fields(ModelConfig)}
    assert keys == set(_ranges(moe=True)), keys ^ set(_ranges(moe=True))
    reference = (ROOT / "docs" / "reference" / "config.md").read_text()
    for key, spec in _ranges(moe=True).items():  # the configuration reference lists the same
        assert re.search(rf"^\| `{re.escape(key)}` \|.*\| `{re.escape(spec)}` \|", reference, re.MULTILINE), key


def _outside(spec: str, integer: bool) -> list:
    from tformer.config import parse_range

    lo, lo_in, hi, hi_in = parse_range(spec)
    step = 1 if integer else 0.5
    out = []
    if lo != -math.inf:
        out.append(lo - step if lo_in else lo)
    if hi != math.inf:
        out.append(hi + step if hi_in else hi)
    return [int(v) if integer else v for v in out]


INT_KEYS = None


def _cases():
    from tformer.config import ModelConfig
    from tformer.train.config import TrainConfig
    from typing import get_type_hints

    def is_int(key):
        cls, parts = (ModelConfig, [key[6:]]) if key.startswith("model.") else (TrainConfig, key.split("."))
        for part in parts[:-1]:
            cls = get_type_hints(cls)[part]
        return "float" not in str(get_type_hints(cls)[parts[-1]])

    return [(key, v) for key, spec in _ranges().items() for v in _outside(spec, is_int(key))]


@pytest.mark.parametrize("key,value", _cases())
def test_out_of_range_value_is_one_error_line(key, value, tmp_path, capsys):
    from tformer.cli import main

    assert main(["train", str(CONFIGS / "gpt2-tiny.yaml"), f"output_dir={tmp_path / 'run'}", f"{key}={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert f"{key.removeprefix('model.')}=" in err[0], err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["plan", "CFG", "--devices", "0"], "--devices: 0 is out of range"),
        (["plan", "CFG", "--devices", "two"], "--devices: 'two' is not an integer"),
        (["plan", "CFG", "--device-memory", "lots"], "--device-memory: 'lots' is not a size"),
        (["plan", "CFG", "--device-memory", "0GB"], "--device-memory: '0GB' is not a size"),
        (["plan", "CFG", "--bogus"], "unrecognized arguments: --bogus"),
        (["generate", "RUN", "--max-new-tokens", "0"], "--max-new-tokens: 0 is out of range"),
        (["generate", "RUN", "--temperature", "-1"], "--temperature: -1 is out of range"),
        (["generate", "RUN", "--top-k", "0"], "--top-k: 0 is out of range"),
        (["generate", "RUN", "--top-p", "1.5"], "--top-p: 1.5 is out of range"),
        (["generate", "RUN", "--top-p", "nan"], "--top-p: nan is out of range"),
        (["generate", "RUN", "--seed", "-1"], "--seed: -1 is out of range"),
        (["export", "RUN", "OUT", "--max-shard-size", "huge"], "--max-shard-size: 'huge' is not a shard size"),
        (["export", "RUN", "OUT", "--to", "onnx"], "argument --to: invalid choice"),
        (["export"], "the following arguments are required"),
        (["import"], "the following arguments are required"),
        (["consolidate"], "the following arguments are required"),
        (["plot"], "the following arguments are required"),
        (["train"], "the following arguments are required: config"),
        (["tokenizer", "train", "--kind", "bpe", "--vocab-size", "0", "--out", "OUT"], "--vocab-size: 0 is out of range"),
        (
            ["tokenizer", "train", "--kind", "bpe", "--vocab-size", "100", "--out", "OUT", "--min-frequency", "0"],
            "--min-frequency: 0 is out of range",
        ),
        (
            ["tokenizer", "train", "--kind", "bpe", "--vocab-size", "100", "--out", "OUT", "--max-rows", "0"],
            "--max-rows: 0 is out of range",
        ),
        (
            ["tokenizer", "train", "--kind", "sentencepiece", "--vocab-size", "100", "--out", "OUT"],
            "argument --kind: invalid choice",
        ),
        (["tokenizer"], "the following arguments are required"),
        (["train", "CFG", "output_dir=FILE"], "is a file; pass a directory path"),
        (["train", "CFG", "output_dir=OUT", "resume=MISSING"], "missing does not exist; pass a run directory"),
        (["train", "CFG", "output_dir=OUT", "parallel.backend=smoke"], "parallel.backend='smoke' is not allowed"),
        (
            ["train", "CFG", "output_dir=OUT", "parallel.backend=nccl", "device=cpu"],
            "parallel.backend=nccl is not available",
        ),
        (
            ["train", "CFG", "output_dir=OUT", "device=cuda"]
            if not torch.cuda.is_available()
            else ["train", "CFG", "device=tpu"],
            "device=cuda but no CUDA GPU" if not torch.cuda.is_available() else "device='tpu' is not allowed",
        ),
        (["train", "CFG", "output_dir=FILE/sub"], "is a file; pass a directory path"),
        (["generate", "MISSING"], "does not exist"),
        (["plot", "MISSING"], "MISSING"),
    ],
)
def test_bad_cli_flags_are_one_error_line(argv, match, tmp_path, capsys):
    from tformer.cli import main

    (tmp_path / "file").write_text("x")
    subst = {
        "CFG": str(CONFIGS / "gpt2-tiny.yaml"),
        "RUN": str(tmp_path / "run"),
        "OUT": str(tmp_path / "out"),
        "MISSING": str(tmp_path / "missing"),
    }
    argv = [
        subst.get(a, a)
        .replace("FILE", str(tmp_path / "file"))
        .replace("MISSING", subst["MISSING"])
        .replace("OUT", subst["OUT"])
        for a in argv
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and match.replace("MISSING", "missing") in err[0], err


def test_a_micro_batch_larger_than_the_data_is_one_error_line(cache, tmp_path, capsys):
    from tformer.cli import main

    args = small_overrides("gpt2-tiny", tmp_path / "run", "micro_batch_size=100000")
    assert main(["train", str(CONFIGS / "gpt2-tiny.yaml"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: micro_batch_size=100000 x 1 rank(s) needs 100000 samples"), err[-3:]


def test_console_shows_tformer_lines_only(cache, tmp_path):
    """No library chatter on the console: DCP's single-process UserWarning, datasets' progress
    bars and DeepSpeed's accelerator notice are kept at DEBUG."""
    proc = run_cli(
        [
            "train",
            str(CONFIGS / "gpt2-tiny.yaml"),
            *small_overrides("gpt2-tiny", tmp_path / "run", "max_steps=2", "eval_every=0", "data.tokenizer_vocab_size=2000"),
        ],
        cache,
    )  # a fresh tokenizer + cache
    assert proc.returncode == 0, proc.stderr[-2000:]
    for line in proc.stderr.splitlines():
        assert line.startswith(("INFO tformer", "WARNING tformer")), line
