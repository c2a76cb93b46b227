"""What a run prints: a short start summary (the resolved config goes to the run directory), no
progress bar in a log file, warnings once and from rank 0, the layout a run really has, and an
`evaluate` line that names its unit and says how it relates to training's val_loss."""

import json
import subprocess
import sys

import pytest
import yaml

from tformer.parallel.mesh import ParallelDims
from tformer.train.observe.console import layout

from train_helpers import CONFIGS, env, run_cli, small_overrides


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tformer-cache-console")


@pytest.fixture(scope="module")
def run(cache, tmp_path_factory):
    """A 2-step gpt2-tiny run through the CLI, its output going to a file (as under SLURM)."""
    out = tmp_path_factory.mktemp("console") / "run"
    overrides = small_overrides("gpt2-tiny", out, "max_steps=2", "eval_every=2", "eval_batches=2", "precision=fp32")
    done = run_cli(["train", str(CONFIGS / "gpt2-tiny.yaml"), *overrides, "progress=true"], cache, timeout=600)
    assert done.returncode == 0, done.stderr
    return out, done


def test_start_prints_a_summary_and_writes_the_whole_config_to_the_run(run):
    out, done = run
    lines = done.stdout.splitlines()
    head = lines[: next(i for i, line in enumerate(lines) if line.startswith("step "))]
    assert len(head) <= 6, head
    text = "\n".join(head)
    assert "--- resolved config ---" not in text and "optim:" not in text
    for said in (
        "tformer: decoder model (gpt2",
        "parameters",
        "1 rank(s) on cpu",
        "layout: 1 process",
        "data: default; causal; seq 64",
    ):
        assert said in text, said
    assert "steps: 2" in text and f"output: {out} (resolved config: {out / 'config.yaml'})" in text
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["max_steps"] == 2 and saved["precision"] == "fp32" and "optim" in saved and "parallel" in saved


def test_no_progress_bar_when_the_output_is_not_a_terminal(run):
    _, done = run
    both = done.stdout + done.stderr
    for bar in ("\r", "step/s]", "s/step]", "%|"):  # tqdm's redraws and its rate
        assert bar not in both, both[max(0, both.find(bar) - 300) : both.find(bar) + 100]


@pytest.mark.parametrize(
    "strategy,world,kw,said",
    [
        ("ddp", 1, {}, "1 process"),
        ("ddp", 2, {}, "ddp: 2 replicas"),
        ("fsdp", 2, {}, "fsdp: dp_shard=2"),
        ("fsdp", 8, dict(dp_replicate=2, tp=2), "fsdp: dp_replicate=2 x dp_shard=2 x tp=2 (sp)"),
        ("ddp", 4, dict(tp=2), "ddp: 2 replicas x tp=2 (sp)"),
        ("ddp", 2, dict(tp=2), "ddp: tp=2 (sp)"),
        ("fsdp", 4, dict(pp=2), "fsdp: pp=2 x dp_shard=2"),
    ],
)
def test_the_layout_line_says_what_the_run_is(strategy, world, kw, said):
    """A DDP run replicates: it has no dp_shard to speak of (the mesh's name for its data ranks)."""
    text = layout(strategy, ParallelDims.resolve(world, **kw), True, world)
    assert text == said
    assert strategy != "ddp" or "dp_shard" not in text


QUIET = """
import logging, os, sys
os.environ["RANK"] = sys.argv[1]
from tformer.logs import setup_logging, quiet_repeats
setup_logging()
import torch.distributed.tensor._redistribute as r  # torch's own handler, not the root's
quiet_repeats()
for _ in range(3):
    r.logger.warning("While redistributing from (_NormPartial(reduce_op='sum', norm_type=2.0),) to R")
    logging.getLogger("tformer.train").warning("a tformer warning")
ds = logging.getLogger("DeepSpeed")
ds.addHandler(logging.StreamHandler(sys.stderr))
ds.setLevel(logging.WARNING)  # what importing deepspeed does
ds.warning("Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it.")
logging.getLogger("tformer.train").error("an error")
"""


@pytest.mark.parametrize("rank", [0, 1])
def test_warnings_print_once_and_from_rank_zero(rank, tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", QUIET, str(rank)], env=env(tmp_path), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    err = done.stderr
    assert err.count("_NormPartial") == (1 if rank == 0 else 0), err
    assert err.count("a tformer warning") == (1 if rank == 0 else 0), err
    assert "Setting accelerator" not in err and err.count("an error") == 1, err


def test_evaluate_names_its_unit_and_matches_trainings_val_loss(run, cache):
    out, _ = run
    done = run_cli(["evaluate", str(out)], cache, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert "validation sequences" in lines[-2] and "pairs" not in done.stdout
    logged = [json.loads(x)["val_loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if "val_loss" in x]
    result = json.loads((out / "evaluate.json").read_text())
    # training's val_loss is over its first eval_batches x micro_batch_size = 2 x 8 sequences
    assert "the first 16 sequences (eval_batches=2 x micro_batch_size=8)" in lines[-1]
    assert f"training logged val_loss {logged[-1]:.4f} at step 2" in lines[-1]
    # the same fp32 computation as training's evaluation: the checkpoint's exact weights, the same
    # samples in the same batches, summed in the same order (float64 sums): no rounding between them
    assert result["val_loss_training_subset"] == logged[-1], (result["val_loss_training_subset"], logged)
    assert result["samples"] > 16  # the whole split: another number, and the line says why
