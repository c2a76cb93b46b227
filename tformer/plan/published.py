"""Published measurements as rows the time model can be held against (bench/published_speed.json).

A row gives its layout in ``Layout``'s fields, its model, its hardware (a profile plus the figures
its source states) and the published numbers; ``predict`` prices it with nothing else, so no
constant can be fitted to one row (tests/test_plan_published.py checks the data for that).

A source publishes its speed as tokens/s per GPU (torchtitan) or as achieved teraFLOP/s per GPU
counted its own way (Megatron-LM: ``megatron_flops``); the prediction is converted with the same
count, so the two are compared like with like.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..models.presets import GPT2, LLAMA
from .hardware import Hardware, profile
from .layout import Layout, NotPriced
from .time import step_time

# what a row may say: nothing the time model could read as a per-row constant
ROW_KEYS = {"source", "table", "name", "model", "seq_len", "layout", "published"}
HARDWARE_FIGURES = {"memory", "hbm_bandwidth", "inter_bandwidth", "intra_bandwidth", "gpus_per_node"}
SPEEDS = ("tokens_per_s_per_gpu", "megatron_teraflops_per_gpu")  # what a row may publish as its speed
FLAVOURS = {"llama": {**LLAMA, "tie_embeddings": False, "max_seq_len": 262144}, "gpt2": GPT2}


def megatron_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
    """FLOPs of one iteration as Narayanan et al. (2021) count them for their achieved teraFLOP/s
    (eq. 3): the GEMMs of the transformer and the logit layer, forward, backward and the forward
    that full activation recomputation runs again, the whole S x S of attention:
    96 B s l h^2 (1 + s / 6h + V / 16lh)."""
    layers, h, vocab = cfg.num_layers, cfg.d_model, cfg.vocab_size
    return 96 * batch * seq * layers * h**2 * (1 + seq / (6 * h) + vocab / (16 * layers * h))


@dataclass
class Outcome:
    row: dict
    speed: float | None = None  # predicted, in the unit the row publishes (``metric``)
    memory_gib: float | None = None
    why_not: str | None = None  # the reason it cannot be expressed

    @property
    def metric(self) -> str:
        return next(m for m in SPEEDS if m in self.row["published"])

    @property
    def speed_error(self) -> float | None:
        return None if self.speed is None else self.speed / self.row["published"][self.metric] - 1

    @property
    def memory_error(self) -> float | None:
        """None when the row cannot be priced or its source publishes no memory."""
        published = self.row["published"].get("memory_gib")
        return None if self.memory_gib is None or published is None else self.memory_gib / published - 1


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def model_of(data: dict, name: str) -> ModelConfig:
    shapes = dict(data["models"][name])
    return ModelConfig(**{**FLAVOURS[shapes.pop("flavour", "llama")], **shapes})


def hardware_of(data: dict, source: str) -> Hardware:
    hw = data["hardware"][source]
    return profile(hw["gpu"], **hw["figures"])


def predict(data: dict, row: dict) -> Outcome:
    cfg, hw = model_of(data, row["model"]), hardware_of(data, row["source"])
    try:
        result = step_time(cfg, Layout(**row["layout"]), hw, row["seq_len"])
    except NotPriced as e:
        return Outcome(row, why_not=str(e).removeprefix("not priced: "))
    outcome = Outcome(row, result.tokens_per_s_per_device, result.memory / 2**30)
    if outcome.metric == "megatron_teraflops_per_gpu":
        batch = result.tokens_per_step // row["seq_len"]
        outcome.speed = megatron_flops(cfg, batch, row["seq_len"]) / result.step / result.devices / 1e12
    return outcome
