"""The planner's prediction for a row ``bench/bench_gpu.py`` measured (``bench/results/*.json``):
the row's exact run (preset, micro-batch, sequence and target lengths, eager or compiled, the
head's chunk, one device, bf16 autocast over fp32 weights) priced on a hardware profile, and the
memory ``tformer plan`` prints for it. ``tests/test_plan_gpu_rows.py`` holds the datasheet
profiles to the committed rows; ``bench/bench_plan_gpu.py`` prints the comparison for any
profile, a calibrated one included.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.config import DataConfig
from ..models import spec_of
from ..models.presets import preset
from .hardware import Hardware
from .layout import Layout
from .memory import rank_memory
from .time import step_time

# bench_gpu's T5 row is 512 -> 114 (its ``ROWS``); a row read back from a log lost its target
TARGET = {"t5-base": 114}
# the loss.chunk_size default of the code that ran a file without a ``loss_chunk`` field (main at
# bed9876, the first H200 session: 128 tokens, shared/gpu/README.md)
OLD_CHUNK = 128


def tformer_rows(path: str | Path) -> list[tuple[dict, int | None]]:
    """(row, its head's chunk) of every tformer row of a results file."""
    out = []
    for row in json.loads(Path(path).read_text())["training"]:
        if row["contender"] == "tformer":
            out.append((row, row["loss_chunk"] if "loss_chunk" in row else OLD_CHUNK))
    return out


def card_of(device: str) -> str:
    """The datasheet profile of a results file's ``device`` (torch.cuda.get_device_name)."""
    from .calibrate_gpu import datasheet_of

    return datasheet_of(device).name


def planned(row: dict, chunk: int | None, hw: Hardware) -> tuple[float, float]:
    """(step seconds, peak bytes) the planner gives the row's run on ``hw``."""
    cfg = preset(row["preset"])
    if row.get("num_layers"):  # bench_gpu's 8B-shaped float8 row: the preset's width, fewer layers
        cfg = cfg.replace(num_layers=row["num_layers"])
    target = row["target"] or TARGET.get(row["preset"])
    layout = Layout(
        strategy="ddp",
        micro_batch=row["micro_batch"],
        compile=row["compiled"],
        loss_chunk=chunk,
        loss_parallel=False,
        float8=row.get("float8"),
    )
    step = step_time(cfg, layout, hw, row["seq"], target, memory=False).step
    # the trainer's head settings (memory.training_memory of the row's run config, its chunk given)
    labelled = DataConfig().mlm_probability if spec_of(cfg).masked_lm else 1.0
    memory = rank_memory(
        cfg,
        seq_len=row["seq"],
        micro_batch=row["micro_batch"],
        target_len=target,
        precision="bf16",
        strategy="ddp",
        return_logits=False,
        chunk=chunk,
        offload=False,
        labelled=labelled,
    )
    return step, memory.total


# the contenders whose run the planner prices: tformer's raw loop and the Trainer's own step (HF's
# model is not tformer's run)
PRICED = ("tformer", "trainer")


def price_rows(results: dict, source: str) -> list[dict]:
    """Predicted vs measured step time and peak memory of every finished tformer and trainer row of
    a results dict (a bench_gpu JSON, or a GPU session's merged one), on the datasheet profile of
    its device: one entry per row, ``time`` and ``memory`` the planned / measured ratios; a row the
    planner cannot price (another device, a layout it has no terms for) says why in ``error``."""
    from ..config import ConfigError
    from .report import hardware

    from .calibrate_gpu import datasheet_name

    out: list[dict] = []
    device = results.get("device", "")
    card = datasheet_name(device)
    hw = hardware(card, []) if card else None
    why = f"no datasheet profile for {device!r}"
    for row in results.get("training", []):
        if row.get("contender") not in PRICED or row.get("error"):
            continue
        entry = {k: row.get(k) for k in ("family", "preset", "contender", "compiled", "micro_batch", "num_layers", "float8")}
        entry.update(source=source, step_s=row["step_s"], peak_mb=row["peak_mb"])
        if hw is None:
            entry["error"] = why
        else:
            try:
                step, memory = planned(row, row.get("loss_chunk", OLD_CHUNK), hw)
            except ConfigError as e:
                entry["error"] = str(e).splitlines()[0]
            else:
                entry.update(plan_step_s=step, plan_peak_mb=memory / 2**20, time=step / row["step_s"])
                entry["memory"] = memory / (row["peak_mb"] * 2**20) if row["peak_mb"] == row["peak_mb"] else None
        out.append(entry)
    return out
