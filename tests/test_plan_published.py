"""The published rows (bench/published_speed.json) and the rule that no constant is fitted to one.

The accuracy targets themselves are checked by bench/bench_plan_published.py (a benchmark, not a
test): what is asserted here is what must never change, whatever the accuracy."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest

from tformer.plan import Layout, step_time
from tformer.plan.published import HARDWARE_FIGURES, ROW_KEYS, load, predict

DATA = load(Path(__file__).resolve().parents[1] / "bench" / "published_speed.json")


def test_the_time_model_takes_no_per_row_input():
    """step_time reads a model, a layout, a hardware profile and the sequence lengths, nothing else;
    a layout holds only layout choices (no efficiency, no fudge factor)."""
    assert list(inspect.signature(step_time).parameters) == ["cfg", "layout", "hw", "seq_len", "target_len", "memory"]
    knobs = {f.name for f in fields(Layout)}
    assert knobs == {
        "strategy", "micro_batch", "dp_replicate", "dp_shard", "tp", "sp", "pp", "schedule", "stages_per_rank",
        "n_micro", "grad_accum", "ac", "precision", "loss_parallel", "compile", "cp", "ep", "float8", "async_tp",
    }  # fmt: skip


def test_rows_carry_no_row_specific_constant():
    """A row says its source, layout, model, length and published numbers; hardware figures come
    per source (the ones it states), never per row."""
    for row in DATA["rows"]:
        assert set(row) == ROW_KEYS, row["name"]
        assert set(row["layout"]) <= {f.name for f in fields(Layout)}, row["name"]
        assert row["source"] in DATA["hardware"] and row["model"] in DATA["models"]
    for hw in DATA["hardware"].values():
        assert set(hw["figures"]) <= HARDWARE_FIGURES


@pytest.mark.parametrize("row", DATA["rows"], ids=lambda r: r["name"])
def test_every_row_is_priced_or_says_why_not(row):
    outcome = predict(DATA, row)
    if outcome.why_not:
        layout = row["layout"]
        assert layout.get("float8") or layout.get("async_tp") or layout.get("cp", 1) > 1
        assert outcome.tokens_per_s is None
    else:
        assert outcome.tokens_per_s > 0 and outcome.memory_gib > 0
        # memory is the planner's own model (checked on CPU runs within 15%): on these rows within 10%
        assert abs(outcome.memory_error) <= 0.10
