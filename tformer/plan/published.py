"""Published measurements as rows the time model can be held against (bench/published_speed.json).

A row gives its layout in ``Layout``'s fields, its model, its hardware (a profile plus the figures
its source states) and the published numbers; ``predict`` prices it with nothing else, so no
constant can be fitted to one row (tests/test_plan_published.py checks the data for that).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..models.presets import LLAMA
from .hardware import Hardware, profile
from .time import Layout, NotPriced, step_time

# what a row may say: nothing the time model could read as a per-row constant
ROW_KEYS = {"source", "table", "name", "model", "seq_len", "layout", "published"}
HARDWARE_FIGURES = {"memory", "hbm_bandwidth", "inter_bandwidth", "intra_bandwidth", "gpus_per_node"}


@dataclass
class Outcome:
    row: dict
    tokens_per_s: float | None = None  # predicted, per GPU
    memory_gib: float | None = None
    why_not: str | None = None  # the reason it cannot be expressed

    @property
    def speed_error(self) -> float | None:
        return None if self.tokens_per_s is None else self.tokens_per_s / self.row["published"]["tokens_per_s_per_gpu"] - 1

    @property
    def memory_error(self) -> float | None:
        return None if self.memory_gib is None else self.memory_gib / self.row["published"]["memory_gib"] - 1


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def model_of(data: dict, name: str) -> ModelConfig:
    shapes = data["models"][name]
    return ModelConfig(**{**LLAMA, "tie_embeddings": False, "max_seq_len": 262144, **shapes})


def hardware_of(data: dict, source: str) -> Hardware:
    hw = data["hardware"][source]
    return profile(hw["gpu"], **hw["figures"])


def predict(data: dict, row: dict) -> Outcome:
    cfg, hw = model_of(data, row["model"]), hardware_of(data, row["source"])
    try:
        result = step_time(cfg, Layout(**row["layout"]), hw, row["seq_len"])
    except NotPriced as e:
        return Outcome(row, why_not=str(e).removeprefix("not priced: "))
    return Outcome(row, result.tokens_per_s_per_device, result.memory / 2**30)
