"""The run's checkpoint: everything a resume restores, as the checkpoint's parts, in load order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...checkpoint import parts
from ...checkpoint.manager import CheckpointManager
from ...parallel.dist import DistInfo
from ...parallel.mesh import ParallelDims
from ...parallel.strategy import Strategy
from ..config import TrainConfig


def model_part(
    cfg: TrainConfig, dist: DistInfo, dims: ParallelDims, device: torch.device, strategy: Strategy, model, optimizer
) -> parts.Part:
    """The model and optimizer: DCP's shards, or DeepSpeed's engine's own ZeRO partitions."""
    trust = cfg.checkpoint.trust
    if strategy.engine is not None:  # DeepSpeed's engine saves and loads its own ZeRO partitions
        from ...checkpoint.deepspeed import DeepSpeedPart

        return DeepSpeedPart(strategy.engine, optimizer, strategy.base_optimizer, dist.rank, dist.world_size, trust)
    split = dims.tp > 1 or dims.pp > 1
    # ddp without tp/pp holds the full model on rank 0 anyway: it also writes the weights file
    weights = dist.is_main and cfg.parallel.strategy == "ddp" and not split
    return parts.DCPPart(parts.ModelOptimizer(model, optimizer), device, trust, weights, split)


def run_checkpoints(
    root: Path,
    cfg: TrainConfig,
    dist: DistInfo,
    model: parts.Part,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    record: parts.TrainerStatePart,
    config_text: str,
) -> CheckpointManager:
    """Model and optimizer (``model_part``), the LR schedule and loss scaler, this rank's RNG
    streams, the data position and the run's own state (``trainer.json``: ``record``), the run
    config (``config_text``)."""
    d, trust = dist, cfg.checkpoint.trust
    return CheckpointManager(
        root,
        d.rank,
        d.world_size,
        cfg.keep_checkpoints,
        background=cfg.checkpoint.async_,
        trust=trust,
        parts={
            "model": model,
            "schedule": parts.SharedPart(
                {"scheduler": parts.Schedule(scheduler, optimizer), "scaler": scaler}, d.is_main, trust
            ),
            "rng": parts.PerRankPart(parts.RNGState(), d.rank, d.world_size, trust),
            "trainer": record,
            "config": parts.TextPart(config_text, d.is_main),
        },
    )
