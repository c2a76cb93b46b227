"""The trainer: learning on the bundled corpus, exact resume, DDP parity, signals, atomic
checkpoints, W&B offline, and one-line errors for bad input."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from tformer.checkpoint import find_latest, list_checkpoints, verify
from tformer.train.config import load_config
from tformer.train.trainer import NonFiniteLoss, Trainer

from pathlib import Path

from train_helpers import CONFIGS, ROOT, env, losses, metrics, owned, reap, run_cli, run_cmd, small_overrides, start


def trainer(recipe, out, *extra, callbacks=()):
    cfg = load_config(CONFIGS / f"{recipe}.yaml", small_overrides(recipe, out, *extra))
    return Trainer(cfg, callbacks)


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "llama-tiny", "bert-tiny", "t5-tiny"])
def test_tiny_recipe_lowers_validation_loss_and_writes_the_run_contract(recipe, cache, tmp_path):
    t = trainer(recipe, tmp_path, "max_steps=40", "eval_every=0", "save_every=0", "optim.warmup_steps=5", "log_every=10")
    before = t.evaluate()["val_loss"]
    last = t.fit()
    assert last["val_loss"] < before - 0.5, (before, last["val_loss"])
    assert (tmp_path / "config.yaml").is_file() and (tmp_path / "tokenizer.json").is_file()
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for r in rows:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(r)
    ckpt = find_latest(tmp_path / "checkpoints")
    assert ckpt.name == "step_00000040"
    verify(ckpt)
    # load_checkpoint gives the trained model, ready for inference
    import tformer

    model = tformer.load_checkpoint(tmp_path)
    assert not model.training
    for (name, p), q in zip(t.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(p, q), name
    resolved = load_config(tmp_path / "config.yaml")
    assert resolved.max_steps == 40 and resolved.model_config() == t.model_cfg


def _run(cache, out, *extra, kill_after=None, kill_in_save=None, recipe="gpt2-tiny", kill=()):
    args = [
        sys.executable,
        str(ROOT / "tests" / "kill_during_training.py"),
        str(CONFIGS / f"{recipe}.yaml"),
        *small_overrides(recipe, out, *extra),
    ]
    if kill_after is not None:
        args += ["--kill-after", str(kill_after)]
    if kill_in_save is not None:
        args += ["--kill-in-save", str(kill_in_save)]
    return run_cmd(args + list(kill), 600, env=env(cache))


@pytest.mark.parametrize("accum", [1, 2])
def test_resume_after_kill_is_bitwise_identical(cache, tmp_path, accum):
    common = [
        "max_steps=8",
        "save_every=4",
        "eval_every=0",
        "precision=fp32",
        "model.dropout=0.1",
        f"grad_accum={accum}",
        "micro_batch_size=4",
        "optim.warmup_steps=2",
    ]
    straight = _run(cache, tmp_path / "straight", *common)
    assert straight.returncode == 0, straight.stderr[-2000:]
    killed = _run(cache, tmp_path / "resumed", *common, kill_after=6)
    assert killed.returncode == -signal.SIGKILL
    assert find_latest(tmp_path / "resumed" / "checkpoints").name == "step_00000004"
    resumed = _run(cache, tmp_path / "resumed", *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr
    # a resumed run re-logs the steps after its checkpoint: losses() keeps the last record per step
    a, b = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert list(a) == list(range(1, 9)) and a == b  # bitwise-equal floats, every step
    wa = load_file(tmp_path / "straight" / "checkpoints" / "step_00000008" / "model.safetensors")
    wb = load_file(tmp_path / "resumed" / "checkpoints" / "step_00000008" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_a_kill_between_the_save_and_the_log_line_loses_no_record(cache, tmp_path):
    """A step's checkpoint is saved before the step is evaluated and logged. Killed in between,
    mid-run (before step 4's evaluation) and at the final step (after its evaluation, before its
    line), the run's records end equal to an uninterrupted run's: every logged step once, every
    due evaluation done, and the run is complete only then."""
    common = ["max_steps=8", "save_every=4", "eval_every=4", "log_every=2", "micro_batch_size=4"]
    straight = _run(cache, tmp_path / "straight", *common)
    assert straight.returncode == 0, straight.stderr[-2000:]
    run = tmp_path / "killed"
    for kill in (["--kill-before-eval", "4"], ["--kill-before-log", "8"]):
        killed = _run(cache, run, *common, kill=kill)
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert [r["step"] for r in metrics(run)] == [2, 4, 6]  # step 8 was saved and evaluated, never logged
    resumed = _run(cache, run, *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "logged its record after the resume" in resumed.stderr
    again = run_cli(["train", str(CONFIGS / "gpt2-tiny.yaml"), *small_overrides("gpt2-tiny", run, *common)], cache)
    assert again.returncode == 0 and "is complete" in again.stdout + again.stderr, again.stderr[-2000:]

    def kept(rows):  # what the run computed (timings differ between runs)
        return [{k: r.get(k) for k in ("step", "loss", "lr", "grad_norm", "val_loss")} for r in rows]

    a, b = kept(metrics(tmp_path / "straight")), kept(metrics(run))
    assert [r["step"] for r in b] == [2, 4, 6, 8] and a == b, (a, b)  # fp32: a resume is bitwise exact
    assert b[1]["val_loss"] is not None and b[3]["val_loss"] is not None


def test_ddp_two_processes_match_one_process_with_the_same_global_batch(cache, tmp_path, tmp_path_factory):
    """torchrun with 2 DDP ranks against 1 process accumulating the same global batch (test_mesh's
    gpt2 reference, shared with test_mesh): losses and parameters within test_mesh.LAYOUT_FACTOR
    times the reference's rounding yardstick."""
    from test_mesh import _overrides, assert_same_state, reference

    recipe, overrides = _overrides("gpt2", tmp_path / "two", "grad_accum=1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "tformer", "train"]
    two = run_cmd([*cmd, str(CONFIGS / f"{recipe}.yaml"), *overrides], 600, env=env(cache))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 rank(s)" in two.stdout
    # tformer's INFO lines once (from the main rank), not once per rank
    data_lines = [line for line in two.stderr.splitlines() if "INFO tformer.data" in line]
    assert data_lines and len(data_lines) == len(set(data_lines)), data_lines
    state = load_file(tmp_path / "two" / "checkpoints" / "step_00000004" / "model.safetensors")
    assert_same_state("gpt2 ddp", losses(tmp_path / "two"), state, reference("gpt2", tmp_path_factory, 2))


def test_sigterm_finishes_the_step_saves_and_exits_zero(cache, tmp_path):
    args = [
        sys.executable,
        "-m",
        "tformer",
        "train",
        str(CONFIGS / "gpt2-tiny.yaml"),
        *small_overrides("gpt2-tiny", tmp_path, "max_steps=100000", "save_every=0", "eval_every=0"),
    ]
    proc = start(args, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with owned(proc):
        deadline = time.time() + 300
        while time.time() < deadline:
            if (tmp_path / "metrics.jsonl").is_file() and len(metrics(tmp_path)) >= 3:
                break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
    out, err = reap([proc], 120)[0]
    assert proc.returncode == 0, err[-2000:]
    ckpt = find_latest(tmp_path / "checkpoints")
    verify(ckpt)
    state = json.loads((ckpt / "trainer.json").read_text())
    assert state["step"] == metrics(tmp_path)[-1]["step"] >= 3
    assert "signal SIGTERM" in out


def test_a_stop_flag_is_read_lag_steps_late_and_the_stopping_step_is_logged_and_saved(cache, tmp_path):
    """On CUDA a step's stop flags (a signal on any rank, max_time) are read two steps after they
    were all-reduced, so that no step waits for the device (tformer/train/resilience/lagged.py); forced here on
    the CPU: a signal noted after step 3 rides in step 4's figures, is read at step 6, and the run
    stops there with step 6 logged (log_every=4 would not log it) and checkpointed."""
    from tformer.train.resilience.lagged import LaggedFlags

    flags = LaggedFlags(torch.device("cpu"), 2, lag=2)
    got = [flags.push(torch.tensor([float(i), -float(i)])) for i in range(5)]
    assert got == [None, None, (0.0, -0.0), (1.0, -1.0), (2.0, -2.0)]

    def signal_after(t, record):
        if record["step"] == 3:
            t._signal = "SIGTERM"

    common = ["max_steps=20", "save_every=0", "eval_every=0", "log_every=4"]
    t = trainer("gpt2-tiny", tmp_path, *common, callbacks=[signal_after])
    t._flags = LaggedFlags(torch.device("cpu"), 2, lag=2)
    t.fit()
    assert t.step == 6 and t._stop_reason == "signal SIGTERM"
    assert [r["step"] for r in metrics(tmp_path)] == [4, 6]
    assert find_latest(tmp_path / "checkpoints").name == "step_00000006"


def test_ctrl_c_saves_like_sigterm_even_when_it_arrives_twice(cache, tmp_path):
    """Ctrl-C (SIGINT) finishes the step, saves and exits 0. The terminal sends it to the whole
    process group (the DataLoader worker, data.num_workers=1, ignores it), and a torchrun agent
    forwards it once more at once: still one clean save. The run's files all get the umask's mode
    (model.safetensors was 0600)."""
    args = [sys.executable, "-m", "tformer", "train", str(CONFIGS / "gpt2-tiny.yaml")]
    args += small_overrides("gpt2-tiny", tmp_path, "max_steps=100000", "save_every=0", "eval_every=0", "data.num_workers=1")
    umask = os.umask(0o022)
    try:
        proc = subprocess.Popen(
            args, env=env(cache), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
    finally:
        os.umask(umask)
    try:
        deadline = time.time() + 300
        while not ((tmp_path / "metrics.jsonl").is_file() and len(metrics(tmp_path)) >= 3):
            assert time.time() < deadline and proc.poll() is None, "the run did not log 3 steps in 300 s"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # the terminal's Ctrl-C
        proc.send_signal(signal.SIGINT)  # torchrun's forwarded copy
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    assert "(signal SIGINT)" in out and "Ctrl-C: finishing the step" in err
    ckpt = find_latest(tmp_path / "checkpoints")
    verify(ckpt)
    assert json.loads((ckpt / "trainer.json").read_text())["step"] == metrics(tmp_path)[-1]["step"] >= 3
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "config.yaml", ckpt / "model.safetensors")}
    assert set(modes.values()) == {oct(0o644)}, modes


def test_checkpoint_killed_mid_save_is_never_chosen(cache, tmp_path):
    common = ["max_steps=9", "save_every=3", "eval_every=0"]
    killed = _run(cache, tmp_path, *common, kill_in_save=6)
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / "checkpoints" / ".partial-step_00000006").is_dir()  # files were being written
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000003"]
    resumed = _run(cache, tmp_path, *common)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stderr and "step_00000003" in resumed.stderr
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [
        "step_00000003",
        "step_00000006",
        "step_00000009",
    ]


def test_keep_last_n_checkpoints(cache, tmp_path):
    trainer("gpt2-tiny", tmp_path, "max_steps=5", "save_every=1", "keep_checkpoints=2", "eval_every=0").fit()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004", "step_00000005"]


def test_nonfinite_loss_is_skipped_or_stops_the_run(cache, tmp_path):
    def poison(t, at):
        forward = t.model.forward

        def patched(*a, **kw):
            out = forward(*a, **kw)
            if t.step + 1 == at:
                out.loss = out.loss * float("nan")
            return out

        t.model.forward = patched

    t = trainer("gpt2-tiny", tmp_path / "skip", "max_steps=4", "eval_every=0", "save_every=0")
    poison(t, 2)
    before = {k: v.clone() for k, v in t.model.state_dict().items()}
    t.fit()
    rows = metrics(tmp_path / "skip")
    assert math.isnan(rows[1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[2:])
    assert any(not torch.equal(before[k], v) for k, v in t.model.state_dict().items())

    t = trainer("gpt2-tiny", tmp_path / "stop", "max_steps=4", "eval_every=0", "save_every=1", "on_nonfinite=stop")
    poison(t, 3)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss=nan at step 3; stopping .*step_00000002"):
        t.fit()


def test_a_nonfinite_step_is_skipped_on_the_device_and_judged_when_the_step_logs(cache, tmp_path):
    """At log_every=4 the NaN of step 2 is never read at step 2: the fused AdamW's ``found_inf``
    skips it on the device (weights, moments and step count as after step 1, bitwise), and the run
    is the same, bitwise, as one that reads and decides at every step (log_every=1). With
    on_nonfinite=stop the run stops at step 4's read, naming step 2, before step 4's checkpoint."""

    def poison(t, at):
        forward = t.model.forward

        def patched(*a, **kw):
            out = forward(*a, **kw)
            if t.step + 1 == at:
                out.loss = out.loss * float("nan")
            return out

        t.model.forward = patched

    common = ["max_steps=6", "eval_every=0", "save_every=0", "model.dropout=0.0"]
    seen: dict[int, dict] = {}

    def keep(t, record):
        seen[record["step"]] = {
            "weights": {k: v.clone() for k, v in t.model.state_dict().items()},
            "adam_steps": [float(s["step"]) for s in t.optimizer.state.values()],
        }

    late = trainer("gpt2-tiny", tmp_path / "late", *common, "log_every=4", callbacks=[keep])
    poison(late, 2)
    late.fit()
    assert late._read_reason is None and late.skipped == 0
    one, two = seen[1], seen[2]
    assert all(torch.equal(one["weights"][k], v) for k, v in two["weights"].items())
    assert one["adam_steps"] == two["adam_steps"] == [1.0] * len(one["adam_steps"])
    assert any(not torch.equal(two["weights"][k], v) for k, v in seen[3]["weights"].items())
    eager = trainer("gpt2-tiny", tmp_path / "eager", *common, "log_every=1")
    poison(eager, 2)
    eager.fit()
    rows = metrics(tmp_path / "eager")
    assert math.isnan(rows[1]["loss"]) and all(math.isfinite(r["loss"]) for r in rows[2:])
    assert all(torch.equal(seen[6]["weights"][k], v) for k, v in eager.model.state_dict().items())
    assert [r["step"] for r in metrics(tmp_path / "late")] == [4, 6]
    assert metrics(tmp_path / "late")[-1]["loss"] == rows[-1]["loss"]

    t = trainer("gpt2-tiny", tmp_path / "stop", *common[:2], "save_every=4", "log_every=4", "on_nonfinite=stop")
    poison(t, 2)
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss=nan at step 2; stopping .*the last good checkpoint is none"):
        t.fit()
    assert t.step == 4 and list_checkpoints(tmp_path / "stop" / "checkpoints") == []


def test_max_tokens_and_max_time_stop_the_run(cache, tmp_path):
    t = trainer("gpt2-tiny", tmp_path / "tok", "max_steps=1000", "eval_every=0", "save_every=0", "max_tokens=1500")
    t.fit()
    assert t.step == 3 and t._stop_reason == "max_tokens"  # 512 tokens per step
    t = trainer("gpt2-tiny", tmp_path / "time", "max_steps=100000", "eval_every=0", "save_every=0", "max_time=2")
    t0 = time.time()
    t.fit()
    assert t._stop_reason == "max_time" and time.time() - t0 < 30
    assert find_latest(tmp_path / "time" / "checkpoints").name == f"step_{t.step:08d}"


def test_wandb_offline_run_holds_metrics_and_config(cache, tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # optional at run time (tracking imports it only when enabled)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        monkeypatch.delenv(var, raising=False)
    t = trainer(
        "gpt2-tiny", tmp_path, "max_steps=3", "eval_every=0", "save_every=0", "wandb.enabled=true", "wandb.mode=offline"
    )
    t.fit()
    run_dirs = list((tmp_path / "wandb").glob("**/offline-run-*"))
    assert len(run_dirs) == 1
    from wandb_reader import read_offline_run

    history, config = read_offline_run(run_dirs[0])
    assert [h["loss"] for h in history] == pytest.approx([r["loss"] for r in metrics(tmp_path)])
    assert config["max_steps"] == 3 and config["model"]["d_model"] == 64
    state = json.loads((find_latest(tmp_path / "checkpoints") / "trainer.json").read_text())
    assert state["wandb_id"] == t.wandb_id and run_dirs[0].name.endswith(t.wandb_id)


def test_plot_writes_a_png(cache, tmp_path):
    trainer("gpt2-tiny", tmp_path, "max_steps=4", "eval_every=2", "save_every=0").fit()
    from tformer.cli import main

    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_shipped_recipe_validates():
    for path in CONFIGS.glob("*.yaml"):
        cfg = load_config(path)
        assert cfg.model_config().family in ("encoder", "decoder", "encdec"), path


# -- bad input: one line, non-zero exit, good checkpoints untouched ----------------------------


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ")
    return err[-1]


@pytest.mark.parametrize(
    "content,overrides,match",
    [
        ("model: {preset: gpt2-tiny\n", [], "line 2"),
        ("model: {preset: gpt2-tiny}\nmax_steps: ten\n", [], "max_steps='ten' has the wrong type"),
        ("model: {preset: gpt2-tiny}\nmax_step: 10\n", [], "unknown config key max_step; did you mean max_steps"),
        ("model: {preset: gpt2-tiny}\n", ["optim.lrr=1"], "unknown config key optim.lrr; did you mean optim.lr"),
        ("model: {preset: gpt2-tiny}\ndata: {source: /no/such/corpus.txt}\n", [], "/no/such/corpus.txt"),
        ("model: {preset: gpt2-tiny}\nprecision: fp16\ndevice: cpu\n", [], "precision=fp16 needs a CUDA GPU"),
        ("model: {preset: gpt2-tiny}\n", ["device=gpu"], "device='gpu' is not allowed; use one of: auto, cpu, cuda"),
        ("model: {preset: gpt2-tiny}\n", ["loss.chunk_size=0"], "loss.chunk_size=0 must be >= 1"),
        ("model: {preset: gpt2-tiny}\n", ["loss.chunk_size=-5"], "loss.chunk_size=-5 must be >= 1"),
        ("model: {preset: gpt2-tiny}\n", ["loss.chunk_size=big"], "loss.chunk_size='big' is not allowed; use a positive"),
        (
            "model: {preset: gpt2-tiny}\n",
            [
                "parallel.activation_checkpointing=op",
                "parallel.strategy=deepspeed",
                f"parallel.deepspeed_config={CONFIGS / 'deepspeed' / 'zero3.json'}",
            ],
            "parallel.activation_checkpointing=op does not compose with DeepSpeed ZeRO-3",
        ),
        (
            "model: {preset: gpt2-tiny}\n",
            ["optim.schedule=inverse_sqrt"],
            "optim.schedule=inverse_sqrt needs optim.warmup_steps >= 1",
        ),
        ("model: {preset: gpt2-tiny}\n", ["optim.label_smoothing=1.2"], "optim.label_smoothing=1.2 must be in [0, 1)"),
        (
            "model: {preset: gpt2-tiny}\n",
            ["parallel.pp_layers=3"],
            "parallel.pp_layers=3 has the wrong type; expected a list",
        ),
        (
            "model: {preset: gpt2-tiny}\n",
            ["parallel.backend=smoke"],
            "use one of: gloo, nccl, mpi, ucc (or null: nccl on CUDA",
        ),
    ],
)
def test_bad_config_gives_one_clear_error_line(cache, tmp_path, capsys, content, overrides, match):
    from tformer.cli import main

    cfg = tmp_path / "bad.yaml"
    cfg.write_text(content)
    assert main(["train", str(cfg), f"output_dir={tmp_path / 'run'}", *overrides]) == 2
    assert match in _error_line(capsys)


@pytest.mark.parametrize(
    "recipe,data,match",
    [
        ("source: missing.txt", None, r"file not found: .*missing\.txt"),
        ("source: blank.txt", " \n\n\t\n", r"data source .*blank\.txt is blank \(5 bytes, all whitespace\)"),
        ("source: blank.txt", "", r"data source .*blank\.txt is empty \(0 bytes\)"),
        ("sources: [{source: default}, {source: blank.txt}]", "\n", r"data source .*blank\.txt is blank"),
    ],
    ids=["missing", "blank", "empty", "mixture"],
)
def test_a_missing_or_blank_source_is_refused_before_a_tokenizer_or_a_run_directory(
    tmp_path, capsys, monkeypatch, recipe, data, match
):
    from tformer.cli import main

    monkeypatch.setenv("TFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    if data is not None:
        (tmp_path / "blank.txt").write_text(data)
    (tmp_path / "run.yaml").write_text(f"model: {{preset: gpt2-tiny}}\ndata: {{{recipe}}}\n")
    assert main(["train", "run.yaml", "output_dir=runs/x"]) == 2
    assert re.search(match, _error_line(capsys))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()  # no run directory, no tokenizer


def test_inverse_sqrt_schedule_is_the_papers():
    """lr(t) = peak * min(t / warmup, sqrt(warmup / t)) at 1-based step t; with peak
    (d_model * warmup)**-0.5 it is the paper's d_model**-0.5 * min(t**-0.5, t * warmup**-1.5)."""
    from tformer.train.config import OptimConfig
    from tformer.train.loop.optim import lr_factor

    cfg = OptimConfig(schedule="inverse_sqrt", warmup_steps=4000, lr=(512 * 4000) ** -0.5)
    for t, want in [(1, 1 / 4000), (2000, 0.5), (4000, 1.0), (16000, 0.5), (64000, 0.25)]:
        assert lr_factor(t - 1, 100_000, cfg) == pytest.approx(want, rel=1e-12)
    for t in (1, 100, 4000, 4001, 25000):
        paper = 512**-0.5 * min(t**-0.5, t * 4000**-1.5)
        assert cfg.lr * lr_factor(t - 1, 100_000, cfg) == pytest.approx(paper, rel=1e-12)


def test_missing_config_file(capsys, tmp_path):
    from tformer.cli import main

    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in _error_line(capsys)


def test_bad_checkpoints_are_refused_and_good_ones_survive(cache, tmp_path, capsys, caplog):
    from tformer.cli import main

    trainer("gpt2-tiny", tmp_path, "max_steps=2", "save_every=1", "eval_every=0").fit()
    recipe = str(CONFIGS / "gpt2-tiny.yaml")
    args = small_overrides("gpt2-tiny", tmp_path, "max_steps=4", "eval_every=0")
    # a different model config
    assert main(["train", recipe, *args, "model.d_model=96"]) == 2
    assert "would change what the run trains: model.d_model 64 -> 96" in _error_line(capsys)
    newest = tmp_path / "checkpoints" / "step_00000002"
    weights = newest / "model.safetensors"
    good = weights.read_bytes()
    # a checkpoint named explicitly must itself be intact: same size but garbage fails its checksum
    weights.write_bytes(b"\x00" * len(good))
    assert main(["train", recipe, *args, f"resume={newest}"]) == 2
    line = _error_line(capsys)
    assert "corrupt (CRC-32 mismatch)" in line and "step_00000002" in line
    # every checkpoint damaged: refused in one line, nothing removed
    older = tmp_path / "checkpoints" / "step_00000001" / "scheduler.pt"
    older_bytes = older.read_bytes()
    older.write_bytes(older_bytes[:-1] + bytes([older_bytes[-1] ^ 0xFF]))
    assert main(["train", recipe, *args]) == 2
    assert "every checkpoint under" in _error_line(capsys)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000001", "step_00000002"]
    older.write_bytes(older_bytes)
    # a damaged optimizer shard in the DCP directory of the newest: resume=auto falls back to the one
    # before, sets the damaged one aside (kept, never pruned) and trains on
    weights.write_bytes(good)
    shard = next((newest / "dcp").glob("*.distcp"))
    shard_bytes = shard.read_bytes()
    shard.write_bytes(shard_bytes[:-1] + bytes([shard_bytes[-1] ^ 0xFF]))
    assert main(["train", recipe, *args, "keep_checkpoints=1"]) == 0
    assert "step_00000002 is damaged" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_00000004"]
    aside = tmp_path / "checkpoints" / "damaged-step_00000002"
    assert next((aside / "dcp").glob("*.distcp")).read_bytes()[-1] == shard_bytes[-1] ^ 0xFF


@pytest.mark.parametrize("damage", ["truncated weights", "flipped scheduler byte", "garbage marker"])
def test_a_finished_run_with_a_damaged_final_checkpoint_recovers_bitwise(cache, tmp_path, capsys, caplog, damage):
    """A finished run whose final checkpoint was damaged is not complete: re-running its command
    falls back to the newest intact checkpoint and trains the last steps again, bitwise as the
    uninterrupted run; the damaged copy is kept aside."""
    from tformer.cli import main

    recipe = str(CONFIGS / "gpt2-tiny.yaml")
    args = small_overrides("gpt2-tiny", tmp_path, "max_steps=3", "save_every=2", "eval_every=0")
    assert main(["train", recipe, *args]) == 0
    final = tmp_path / "checkpoints" / "step_00000003"
    clean = {k: v.clone() for k, v in load_file(final / "model.safetensors").items()}  # not a map of a file cut below
    if damage == "truncated weights":
        (final / "model.safetensors").write_bytes((final / "model.safetensors").read_bytes()[:1000])
    elif damage == "flipped scheduler byte":
        data = bytearray((final / "scheduler.pt").read_bytes())
        data[len(data) // 2] ^= 0x01
        (final / "scheduler.pt").write_bytes(bytes(data))
    else:
        (final / "COMPLETE").write_text("garbage")
    capsys.readouterr()
    caplog.clear()
    assert main(["train", recipe, *args]) == 0
    said = capsys.readouterr()
    err = said.out + said.err + caplog.text
    assert "nothing to train" not in err and "step_00000003 is damaged" in err and "resuming from step_00000002" in err
    verify(final, deep=True)
    again = load_file(final / "model.safetensors")
    assert clean.keys() == again.keys() and all(torch.equal(clean[k], again[k]) for k in clean)
    assert (tmp_path / "checkpoints" / "damaged-step_00000003").is_dir()
    # now complete for real
    assert main(["train", recipe, *args]) == 0
    assert "nothing to train" in capsys.readouterr().out


def test_cli_exit_code_in_a_real_process(cache, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {preset: gpt2-tiny}\nmicro_batch_size: 0\n")
    proc = run_cli(["train", str(bad)], cache)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: micro_batch_size=0 must be >= 1"


@pytest.mark.parametrize("native", [False, True])
def test_bf16_on_a_cpu_without_bf16_matmuls_warns(monkeypatch, caplog, native):
    import tformer.train.loop.run as run_module
    import tformer.train.trainer as tr

    monkeypatch.setattr(run_module, "cpu_has_native_bf16", lambda: native)
    from tformer.train.dist import DistInfo

    from tformer.logs import Quiet

    trainer = tr.Trainer.__new__(tr.Trainer)  # only the start-up warning, no run
    trainer.dist, trainer.device, trainer.precision = DistInfo(), torch.device("cpu"), "bf16"
    # a trainer started earlier in this process put its show-a-warning-once filter on pytest's capture
    # handler (logs.quiet_repeats), which would hide this line if another test had logged it first
    monkeypatch.setattr(caplog.handler, "filters", [f for f in caplog.handler.filters if not isinstance(f, Quiet)])
    with caplog.at_level("WARNING", logger="tformer.train"):
        trainer._warn_slow_precision()
    assert ("emulates bf16 matmuls" in caplog.text) is not native


def test_precision_auto_follows_the_cpu_bf16_override(cpu_bf16, monkeypatch, tmp_path):
    """TFORMER_CPU_BF16=1|0 stands for a CPU with or without AVX512-BF16/AMX: precision=auto is bf16 or
    fp32 accordingly, in this process and in a real run it starts; unset, the CPU's flags decide."""
    import tformer.train.trainer as tr

    cpu = torch.device("cpu")
    assert tr.cpu_has_native_bf16() is cpu_bf16
    assert tr.resolve_precision("auto", cpu) == ("bf16" if cpu_bf16 else "fp32")
    assert tr.resolve_precision("fp32", cpu) == "fp32" and tr.resolve_precision("bf16", cpu) == "bf16"
    args = small_overrides("gpt2-tiny", tmp_path / "run", "precision=auto", "max_steps=1", "eval_every=0", "save_every=0")
    proc = run_cli(["train", str(CONFIGS / "gpt2-tiny.yaml"), *args], tmp_path / "cache", timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(rf"precision {'bf16' if cpu_bf16 else 'fp32'}\b", proc.stdout + proc.stderr), proc.stdout[:400]
    monkeypatch.delenv("TFORMER_CPU_BF16")
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    assert tr.cpu_has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)
    monkeypatch.setenv("TFORMER_CPU_BF16", "yes")
    with pytest.raises(tr.ConfigError, match="TFORMER_CPU_BF16=yes must be 1 or 0"):
        tr.resolve_precision("auto", cpu)


def test_strategy_step_contract_applies_skips_and_clears():
    """Strategy.step, the one update path of the trainer: a finite step clips, updates and clears
    the gradients (StepResult.applied, the pre-clip norm); a non-finite gradient or loss leaves the
    parameters as they were and still clears the gradients."""
    from tformer.parallel.dist import DistInfo
    from tformer.parallel.strategy import MeshStrategy, StepResult
    from tformer.train.config import TrainConfig

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    strategy = MeshStrategy(model, TrainConfig(), DistInfo(), torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run(scale, loss_finite=True):
        before = [p.detach().clone() for p in model.parameters()]
        (model(torch.ones(3, 4)).sum() * scale).backward()
        norm = torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()
        result = strategy.step(opt, None, 1.0, loss_finite)
        assert isinstance(result, StepResult) and all(p.grad is None for p in model.parameters())
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        return result, norm, changed

    result, norm, changed = run(1.0)
    assert result.applied and changed and not result.must_stop and result.grad_norm == pytest.approx(norm)
    result, _, changed = run(float("nan"))
    assert not result.applied and not changed and math.isnan(result.grad_norm)
    result, _, changed = run(1.0, loss_finite=False)
    assert not result.applied and not changed and math.isnan(result.grad_norm)


# what is read on the host on every machine, or must be (named): models/loss.py's CPU-only
# shortcut; a device mesh's rank table; AdamW's step count where it is a host tensor; the MoE
# layer's split of its tokens by expert (``expert_matmul``) and expert parallelism's send/receive
# split (ep.py): grouped matmuls and all-to-alls of data-dependent sizes, one a layer and micro-batch;
# a masked LM's labels counted in the loader's batch (``_host_count``: host memory on every machine)
NAMED_CALLERS = ("_is_one", "_get_value", "expert_matmul", "_host_count")
NAMED_FILES = ("device_mesh.py", "ep.py")
# once, in the first step: torch's pipeline schedule exchanges the stages' shapes (its warm-up p2p)
FIRST_STEP_FILES = ("schedules.py", "stage.py", "distributed_c10d.py")


def count_step_reads(t: Trainer) -> dict[int, list[str]]:
    """Run ``t.fit()`` counting, per step, every read of a device value on the host inside
    ``_train_step`` (``.item()``, ``float()``, ``bool()``, ``int()``, ``.tolist()``, ``.cpu()``,
    ``.numpy()``, ``.to("cpu")`` of a tensor, and through them fp16's scaler's): each waits for the
    device to finish all it was given, and on a GPU the host then stops running ahead (what
    ``torch.cuda.set_sync_debug_mode`` reports there). The named reads are left out."""
    import traceback

    reads: dict[int, list[str]] = {}
    inside, current = [False], [0]

    def note(what: str) -> None:
        caller = traceback.extract_stack(limit=4)[-3]
        where = f"{os.path.basename(caller.filename)}:{caller.lineno} {caller.name}"
        file = os.path.basename(caller.filename)
        if caller.name in NAMED_CALLERS or file in NAMED_FILES or (current[0] == 1 and file in FIRST_STEP_FILES):
            return
        reads.setdefault(current[0], []).append(f"{what} in {where}")

    with pytest.MonkeyPatch.context() as patch:
        names = ("item", "__float__", "__bool__", "__int__", "tolist", "cpu", "numpy", "to")
        for name in (*names, "__getitem__", "nonzero", "masked_select"):
            original = getattr(torch.Tensor, name)

            def counted(self, *a, _original=original, _name=name, **kw):
                if inside[0]:
                    inside[0] = False  # a read inside a read (e.g. .numpy() calling .cpu()) counts once
                    try:
                        if _waits(_name, a, kw):
                            note(_name)
                        return _original(self, *a, **kw)
                    finally:
                        inside[0] = True
                return _original(self, *a, **kw)

            patch.setattr(torch.Tensor, name, counted)
        step = t._train_step

        def one_step(*a, **kw):
            inside[0], current[0] = True, t.step + 1
            try:
                return step(*a, **kw)
            finally:
                inside[0] = False

        patch.setattr(t, "_train_step", one_step)
        t.fit()
    return reads


def _waits(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a counted tensor method waits for the device: ``.to`` only to the host (spelt
    "cpu": on this CPU every ``.to(device)`` moves to a "cpu" device), indexing only with a boolean
    mask (its result's size is a count the device knows, as for ``nonzero``, ``masked_select``)."""
    if name == "to":
        return (args[:1] or [kwargs.get("device")])[0] == "cpu"
    if name == "__getitem__":
        parts = args[0] if isinstance(args[0], tuple) else (args[0],)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    return True


def assert_reads_only_to_log(reads: dict[int, list[str]], steps: int, log_every: int, what=()) -> None:
    """No read at a step that does not log; one at a logging step (every figure in it)."""
    for s in range(1, steps + 1):
        allowed = 1 if s % log_every == 0 or s == steps else 0
        assert len(reads.get(s, [])) == allowed, (*what, s, reads)


# 5 steps, logging every 2nd (and the last): steps 1 and 3 must not read
READ_STEPS = ["max_steps=5", "eval_every=0", "save_every=0", "log_every=2"]


@pytest.mark.parametrize(
    "recipe,layout",
    [
        ("gpt2-tiny", "parallel.strategy=ddp"),
        ("gpt2-tiny", "parallel.strategy=fsdp"),
        ("mixtral-tiny", "parallel.strategy=ddp"),
        ("bert-tiny", "parallel.strategy=ddp"),
        ("deepseek-v3-tiny", "parallel.strategy=ddp"),  # + the loss-free bias update and mtp_loss
    ],
)
def test_a_step_reads_the_device_only_when_it_logs(recipe, layout, cache, tmp_path):
    """A step that does not log reads nothing: the all-reduced loss / tokens / FLOPs, the gradient
    norm and the skip decision stay on the device (clipped there; a non-finite step skipped by the
    fused AdamW's ``found_inf``), the stop flags are read a few steps late (lagged.py), and a
    logging step reads every step's figures since the last one, and a logging step's MoE routing
    table, in one read."""
    t = trainer(recipe, tmp_path, *READ_STEPS, layout)
    reads = count_step_reads(t)
    assert t.step == 5 and t._read_reason is None
    assert_reads_only_to_log(reads, 5, 2)
    rows = metrics(tmp_path)
    assert [r["step"] for r in rows] == [2, 4, 5]
    assert all(math.isfinite(r["loss"]) and r["grad_norm"] > 0 for r in rows)
    if recipe.startswith(("mixtral", "deepseek")):  # the routing figures of a logging step are in its record
        assert all("moe/tokens_max_over_mean_worst" in r for r in rows), rows[0]
    if recipe.startswith("deepseek"):
        assert all("mtp_loss" in r for r in rows), rows[0]


@pytest.mark.parametrize(
    "extra,reason",
    [(["optim.fused=false"], "optim.fused=false"), (["max_tokens=100000"], "max_tokens stops at the step's")],
)
def test_a_run_that_must_decide_on_the_host_reads_once_a_step_and_says_why(extra, reason, cache, tmp_path):
    """Where the host must decide at every step (a foreach AdamW cannot skip on the device; a
    max_tokens stop needs the global count), each step reads once, its figures all together, and
    the run says why in its start-up log."""
    t = trainer("gpt2-tiny", tmp_path, *READ_STEPS, *extra)
    reads = count_step_reads(t)
    assert reason in (t._read_reason or "")
    assert [len(reads.get(s, [])) for s in range(1, 6)] == [1] * 5, reads
    assert [r["step"] for r in metrics(tmp_path)] == [2, 4, 5]


def _reads_worker(rank, world, port, jobs, cache, out):
    from train_helpers import become_rank

    become_rank(rank, world, port, cache, 120)
    import torch.distributed as dist

    try:
        found = {}
        for name, recipe, overrides in jobs:
            t = Trainer(load_config(CONFIGS / f"{recipe}.yaml", overrides))
            found[name] = count_step_reads(t)
            found[name + ":reason"] = t._read_reason
        Path(out, f"reads{rank}.json").write_text(json.dumps(found))
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


MULTI_RANK_READS = [
    ("ddp", "gpt2-tiny", ["parallel.strategy=ddp"]),
    ("fsdp2", "gpt2-tiny", ["parallel.strategy=fsdp"]),
    ("tp", "gpt2-tiny", ["parallel.strategy=fsdp", "parallel.tp=2", "parallel.dp_shard=1"]),
    ("pp", "gpt2-tiny", ["parallel.strategy=fsdp", "parallel.pp=2", "parallel.dp_shard=1", "grad_accum=2"]),
    ("cp", "llama-tiny", ["parallel.strategy=fsdp", "parallel.cp=2", "parallel.dp_shard=1"]),
    ("ep", "mixtral-tiny", ["parallel.strategy=fsdp", "parallel.ep=2"]),
]


def test_every_layout_reads_the_device_only_when_it_logs(cache, tmp_path):
    """The same on 2 ranks for every layout a CPU runs (DDP, FSDP2, TP, PP, CP, EP with an MoE
    model): the clip's norm all-reduced over the mesh, the pipeline's loss on its last stage and
    the expert exchange all stay on the device between logging steps."""
    from train_helpers import free_port, spawn_ranks

    jobs = [
        (name, recipe, small_overrides(recipe, tmp_path / name, *READ_STEPS, *extra))
        for name, recipe, extra in MULTI_RANK_READS
    ]
    spawn_ranks(_reads_worker, (2, free_port(), jobs, str(cache), str(tmp_path)), 2, 300)
    for rank in (0, 1):
        found = json.loads((tmp_path / f"reads{rank}.json").read_text())
        for name, _, _ in MULTI_RANK_READS:
            assert found[name + ":reason"] is None, (name, found[name + ":reason"])
            assert_reads_only_to_log({int(k): v for k, v in found[name].items()}, 5, 2, (name, rank))
    for name, _, _ in MULTI_RANK_READS:
        assert [r["step"] for r in metrics(tmp_path / name)] == [2, 4, 5], name


@pytest.mark.parametrize("recipe,masked", [("bert-tiny", False), ("t5-tiny", True)])
def test_an_unpadded_training_batch_reaches_sdpa_as_the_family_runs_it_fastest(recipe, masked, cache, tmp_path):
    """The data pipeline's all-ones ``attention_mask`` of an unpadded MLM batch is left out, so that
    BERT's attention reaches SDPA with no mask tensor (the flash kernel on a GPU) and the loss is the
    masked one's to fp32 rounding; T5's batch keeps it (its relative bias is a mask tensor anyway,
    and broadcast over the batch it ran slower on an H100: tformer/train/loop/data.make_collator)."""
    import torch.nn.functional as F

    t = trainer(recipe, tmp_path, "max_steps=1", "eval_every=0", "save_every=0", "precision=fp32")
    batch = next(t._batches())
    assert ("attention_mask" in batch) == masked
    seen, real = [], F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("attn_mask"))
        return real(*args, **kwargs)

    inputs = {k: batch[k] for k in t.data.model_inputs if k in batch}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(F, "scaled_dot_product_attention", spy)
        loss = t.model(**inputs, return_logits=False).loss
    if masked:
        return
    assert seen and all(mask is None for mask in seen)
    ones = torch.ones_like(inputs["input_ids"])
    with_mask = t.model(**inputs, attention_mask=ones, return_logits=False).loss
    # adding a zero mask is exact (0.0 apart here); a few ulps for a kernel that blocks otherwise
    assert abs(loss.item() - with_mask.item()) <= 8 * torch.finfo(torch.float32).eps * loss.item()
