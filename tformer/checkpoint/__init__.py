"""Checkpoints: atomic directories, newest-complete discovery, safe loading (no untrusted pickles).

A checkpoint is ``<run>/checkpoints/step_00000100/`` holding

    dcp/                     model + optimizer, DCP shards of every rank (ddp, fsdp)
    deepspeed/state/         or DeepSpeed's own files (parallel.strategy=deepspeed), and beside
    deepspeed/param_groups.pt  them each param group's hyperparameters (for a universal load)
    model.safetensors        ddp (no tensor parallelism) and imports: the weights, tied tensors once
    scheduler.pt             LR schedule and loss-scaler state (loaded with weights_only=True)
    rng_rank{R}.pt           RNG state of every rank (weights_only=True)
    trainer.json             step, tokens, data position, W&B id, mesh, ... (``state.TrainerState``)
    config.yaml              the resolved run config
    COMPLETE                 written last: the list of files with their sizes and CRC-32

It is assembled in ``.partial-step_...`` and renamed into place only when complete, so a crash
during a save never leaves a directory that ``resume: auto`` would pick. ``manager.py`` owns the
protocol (also for saves written in the background, ``checkpoint.async``) and loads; ``parts.py``
holds the ``Stateful`` parts it saves and loads (``deepspeed.py`` DeepSpeed's engine), ``state.py``
the record in ``trainer.json``; ``io.py`` the files and every file name; ``consolidate.py`` one full
state dict (and the model for inference) from any checkpoint.
"""

from .consolidate import load_checkpoint
from .io import (
    CheckpointError,
    find_latest,
    list_checkpoints,
    load_model_weights,
    read_trainer_state,
    verify,
)
from .manager import CheckpointManager
from .state import TrainerState

__all__ = [
    "CheckpointError",
    "find_latest",
    "list_checkpoints",
    "load_checkpoint",
    "load_model_weights",
    "read_trainer_state",
    "verify",
    "CheckpointManager",
    "TrainerState",
]
