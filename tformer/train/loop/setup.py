"""A run's start: its processes and mesh, and its data (the trainer calls these in order)."""

from __future__ import annotations

from collections.abc import Sized
from typing import cast

import torch

from ...config import ConfigError, ModelConfig
from ...data import MixtureDataset
from ...parallel.dist import DistInfo
from ...parallel.mesh import ParallelDims
from ...parallel.tp import pad_vocab_for_tp
from ..config import TrainConfig
from ..dist import init_distributed
from ..observe.watchdog import enable_flight_recorder
from ..resilience.ft import lighthouse_address, wait_for_lighthouse
from .data import RunData, build_data


def start_processes(cfg: TrainConfig, dims: ParallelDims) -> DistInfo:
    """The process group and the run's one mesh (tformer/parallel/mesh.py)."""
    # collectives outlive the watchdog by a minute, so a hang is reported before gloo/NCCL fail
    timeout = 600 if cfg.watchdog_timeout is None else cfg.watchdog_timeout + 60
    if cfg.watchdog_timeout is not None:
        enable_flight_recorder()  # before the process group: its collectives are recorded
    dist = init_distributed(
        cfg.device,
        cfg.parallel.backend,
        timeout_s=timeout,
        always=cfg.parallel.strategy != "ddp" or dims.tp > 1 or dims.pp > 1,
    )
    dist.dims = dims
    ft = cfg.fault_tolerance
    if ft.enabled:  # the data is split over every replica group; the lighthouse must answer
        dist.replica, dist.replicas = ft.replica_id, ft.replicas
        wait_for_lighthouse(lighthouse_address(ft), ft.timeout_s)
    if torch.distributed.is_initialized():
        dist.mesh = dims.build_mesh(dist.device.type)
    return dist


def run_data(cfg: TrainConfig, dist: DistInfo, dims: ParallelDims, global_batch: int) -> tuple[RunData, ModelConfig]:
    """This rank's data, and the model config it implies (vocabulary padded for tp)."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before any sharding
    data = build_data(cfg, dist.rank, dist.dp_size)
    if isinstance(data.train, MixtureDataset):  # refuse (on_exhausted=stop) or log re-epochs now
        data.train.check_exhaustion(cfg.max_steps * global_batch)
    per_step = cfg.micro_batch_size * dist.dp_size
    train_size = len(cast(Sized, data.train))
    if per_step > train_size:
        raise ConfigError(
            f"micro_batch_size={cfg.micro_batch_size} x {dist.dp_size} rank(s) needs "
            f"{per_step} samples per micro-step but the training set has {train_size}; "
            "lower micro_batch_size or use more data"
        )
    return data, pad_vocab_for_tp(data.model_config, dims.tp)  # recorded in config.yaml and checkpoints
