"""Resuming honestly: a complete run says so and changes nothing; the layout may change at resume
when the global batch stays; max_steps may change with the LR schedule's horizon kept (no jump);
any change of what the run trains is refused in one line naming each key, unless
resume_changes=allow (then one warning per key); an evaluation that fails at the end of a run does
not cost its final checkpoint."""

import json
import logging

import pytest

from tformer.checkpoint import list_checkpoints, verify
from tformer.checkpoint.state import TrainerState
from tformer.train.config import load_config
from tformer.train.loop.optim import lr_factor
from tformer.train.resilience.resume import saved_global_batch
from tformer.train.trainer import Trainer

from test_mesh import FP32_ROUNDING, LAYOUT_FACTOR
from train_helpers import CONFIGS, metrics, small_overrides

RECIPE = "gpt2-tiny"
# 512 tokens per step (8 x 64): max_tokens=1024 stops a 4-step run after step 2, as a preemption would
COMMON = ["eval_every=0", "save_every=2", "precision=fp32", "optim.warmup_steps=1", "model.dropout=0.0"]


def args(out, *extra):
    return [str(CONFIGS / f"{RECIPE}.yaml"), *small_overrides(RECIPE, out, *COMMON, *extra)]


def train(out, *extra):
    return Trainer(load_config(CONFIGS / f"{RECIPE}.yaml", small_overrides(RECIPE, out, *COMMON, *extra))).fit()


def by_step(out):
    return {r["step"]: r for r in metrics(out)}  # a resumed run's records replace earlier ones


def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("error: "), err
    return err[-1]


@pytest.fixture(scope="module")
def stopped(cache, tmp_path_factory):
    """A 4-step run stopped after step 2 (its checkpoint: step 2, global batch 8, horizon 4)."""
    out = tmp_path_factory.mktemp("stopped")
    train(out, "max_steps=4", "max_tokens=1024")
    assert list_checkpoints(out / "checkpoints")[-1].name == "step_00000002"
    return out


def copy_of(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_rerunning_a_complete_run_says_so_in_one_line_and_changes_nothing(cache, tmp_path, capsys):
    from tformer.cli import main

    train(tmp_path, "max_steps=2")
    before = {p: p.read_bytes() for p in (tmp_path / "config.yaml", tmp_path / "metrics.jsonl")}
    capsys.readouterr()
    assert main(["train", *args(tmp_path, "max_steps=2", "optim.lr=1e-3")]) == 0  # the README's example
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "is complete (step_00000002: step 2, max_steps=2)" in out[0], out
    assert "larger max_steps" in out[0] and "another output_dir" in out[0] and "resume=none" in out[0]
    assert {p: p.read_bytes() for p in before} == before  # config.yaml keeps the lr that was used
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000002"]


def test_a_larger_max_steps_extends_the_run_with_the_schedule_horizon_kept(stopped, tmp_path, caplog):
    """Resumed at step 2 of 4 with max_steps=6: steps 3-4 get the LR of the uninterrupted 4-step
    schedule (a horizon stretched to 6 would jump), steps 5-6 its final value."""
    run = copy_of(stopped, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tformer.train"):
        train(run, "max_steps=6")
    assert "max_steps 4 -> 6 at step 2: the LR schedule (cosine) keeps its 4-step horizon" in caplog.text
    cfg = load_config(run / "config.yaml")
    lrs = {s: r["lr"] for s, r in by_step(run).items()}
    expected = {s: cfg.optim.lr * lr_factor(min(s - 1, 4), 4, cfg.optim) for s in range(1, 7)}
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[5] == lrs[6] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio)
    state = TrainerState.read(list_checkpoints(run / "checkpoints")[-1])
    assert (state.step, state.schedule_steps, state.global_batch, state.global_batch_tokens) == (6, 4, 8, 512)


def test_the_same_global_batch_on_another_layout_resumes_silently_and_exactly(stopped, tmp_path, caplog):
    """micro_batch_size 8 -> 4 with grad_accum 1 -> 2: the same 8 sequences per step; the losses
    are the uninterrupted run's."""
    run = copy_of(stopped, tmp_path)
    with caplog.at_level(logging.WARNING):
        train(run, "max_steps=4", "micro_batch_size=4", "grad_accum=2")
    assert "resume_changes" not in caplog.text and "global batch" not in caplog.text
    train(tmp_path / "straight", "max_steps=4")
    # the yardstick (test_mesh's): the same run with the attention written out, another valid
    # summation order; accumulating 2 micro-batches is one more, so the losses after the resume may
    # lie LAYOUT_FACTOR times as far from the uninterrupted run's
    train(tmp_path / "math", "max_steps=4", "model.attn_impl=math")
    ours, theirs, twin = by_step(run), by_step(tmp_path / "straight"), by_step(tmp_path / "math")
    assert sorted(ours) == sorted(theirs) == sorted(twin) == [1, 2, 3, 4]

    def distance(a):
        return max(abs(a[s]["loss"] - theirs[s]["loss"]) / abs(theirs[s]["loss"]) for s in theirs)

    yard = max(FP32_ROUNDING, distance(twin))
    print(f"layout change: {distance(ours):.1e} ({distance(ours) / yard:.2f} of the yardstick {yard:.1e})")
    assert distance(ours) <= LAYOUT_FACTOR * yard, (distance(ours), yard, ours, theirs)


def test_a_change_of_what_the_run_trains_is_refused_in_one_line(stopped, capsys):
    """The global batch (8 -> 4 sequences), the LR and the seed at once: one line naming each,
    before any work; nothing in the run directory changes."""
    from tformer.cli import main

    config = (stopped / "config.yaml").read_bytes()
    assert main(["train", *args(stopped, "max_steps=4", "micro_batch_size=4", "optim.lr=1e-3", "seed=7")]) == 2
    line = error_line(capsys)
    assert "step_00000002 would change what the run trains" in line, line
    assert "optim.lr 0.003 -> 0.001" in line and "seed 0 -> 7" in line, line
    assert "global batch 8 sequences (512 tokens) -> 4 (256 tokens)" in line and "grad_accum" in line, line
    assert "resume_changes=allow" in line
    assert (stopped / "config.yaml").read_bytes() == config
    assert main(["train", *args(stopped, "max_steps=4", "model.d_model=96")]) == 2  # the model too
    assert "model.d_model 64 -> 96" in error_line(capsys)


def test_resume_changes_allow_continues_with_one_warning_per_change(stopped, tmp_path, caplog):
    run = copy_of(stopped, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tformer.train"):
        train(run, "max_steps=4", "micro_batch_size=4", "optim.lr=1e-3", "resume_changes=allow")
    warned = [r.getMessage() for r in caplog.records if "resume_changes=allow" in r.getMessage()]
    assert len(warned) == 2, warned
    assert "optim.lr 0.003 -> 0.001 from step 2 on" in warned[0] + warned[1]
    assert "global batch 8 sequences (512 tokens) -> 4 (256 tokens)" in warned[0] + warned[1]
    rows = by_step(run)
    assert sorted(rows) == [1, 2, 3, 4]
    cfg = load_config(run / "config.yaml")  # the run's config is now the changed one
    assert cfg.optim.lr == 1e-3 and rows[3]["lr"] == pytest.approx(1e-3 * lr_factor(2, 4, cfg.optim))
    assert TrainerState.read(list_checkpoints(run / "checkpoints")[-1]).global_batch == 4


def test_checkpoints_without_a_recorded_global_batch_get_it_from_their_config():
    state = TrainerState(step=2, world_size=4)
    saved = {"micro_batch_size": 8, "grad_accum": 4, "parallel": {"tp": 1, "pp": 2}}
    assert saved_global_batch(state, saved) == (64, None)  # pp=2 x dp 2: 8 x 4 x 2
    state.global_batch, state.global_batch_tokens = 32, 4096
    assert saved_global_batch(state, saved) == (32, 4096)


def test_a_failing_final_evaluation_keeps_the_final_checkpoint(cache, tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(Trainer, "evaluate", broken)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(tmp_path, "max_steps=3", "save_every=0")
    newest = list_checkpoints(tmp_path / "checkpoints")[-1]
    assert newest.name == "step_00000003"
    verify(newest, deep=True)
    assert json.loads((newest / "trainer.json").read_text())["step"] == 3
