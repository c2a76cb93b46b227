"""Which engine runs ``parallel.strategy``: the mesh's ``apply_*`` steps (:class:`MeshStrategy`,
``strategy.py``: ddp, fsdp) or DeepSpeed's (:class:`DeepSpeedStrategy`, ``deepspeed.py``, which
reuses the mesh's model steps). It sits above both, so each of them imports only what is below it."""

from __future__ import annotations

from typing import Any

import torch

from ..config import StrategyName
from .deepspeed import DeepSpeedStrategy
from .strategy import MeshStrategy, Strategy


def strategy_class(name: StrategyName) -> Any:
    """The class that runs ``parallel.strategy``: its ``check`` refuses, before any process group,
    what this install cannot run."""
    return DeepSpeedStrategy if name == "deepspeed" else MeshStrategy


def build_strategy(model: torch.nn.Module, cfg: Any, dist_info: Any, dtype: torch.dtype) -> Strategy:
    return strategy_class(cfg.parallel.strategy)(model, cfg, dist_info, dtype)
