"""Checkpoints: atomic directories, newest-complete discovery, safe loading (no untrusted pickles).

A checkpoint is ``<run>/checkpoints/step_00000100/`` holding

    model.safetensors        the model weights (tied tensors stored once)
    optimizer.pt             optimizer + LR scheduler state (loaded with weights_only=True)
    rng_rank{R}.pt           RNG state of every rank (weights_only=True)
    trainer.json             step, tokens, data position, W&B id, ...
    config.yaml              the resolved run config
    COMPLETE                 written last: the list of files and their sizes

It is assembled in ``.partial-step_...`` and renamed into place only when complete, so a crash
during a save never leaves a directory that ``resume: auto`` would pick.
"""
from .io import (CheckpointError, find_latest, list_checkpoints, load_checkpoint, load_model_weights,
                 read_trainer_state, verify)

__all__ = ["CheckpointError", "find_latest", "list_checkpoints", "load_checkpoint",
           "load_model_weights", "read_trainer_state", "verify"]
