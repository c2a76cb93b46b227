"""The training head's chunk for this run (``loss.chunk_size``; ``auto``: sized for the device by
the rule the planner applies too, ``plan/head.py``)."""

from __future__ import annotations

import torch

from ...config import ModelConfig
from ...parallel.mesh import ParallelDims
from ...plan.head import run_chunk
from ..config import TrainConfig


def loss_chunk_size(
    cfg: TrainConfig,
    model_cfg: ModelConfig,
    device: torch.device,
    precision: str,
    num_parameters: int,
    dims: ParallelDims,
    seq_len: int,
    target_len: int | None,
) -> int | None:
    """``loss.chunk_size`` as this run uses it; ``auto`` on a CUDA device of its measured capacity."""
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    where = (dims.tp, dims.pp, dims.dp_shard, dims.cp)
    return run_chunk(cfg, model_cfg, precision, num_parameters, capacity, where, seq_len, target_len)
