"""The trainer and its parts, by concern.

- ``config.py``, ``dist.py``: the run config and the process group every part reads;
- ``observe/``: what a run reports (metrics, console, trackers, profiler, slow ranks, watchdog);
- ``resilience/``: what keeps it going through faults (fault tolerance, rollback, spikes, signals,
  resume checks);
- ``loop/``: the steps (data, optimizer, the step and its figures, evaluation, the components);
- ``trainer.py``: the ``Trainer`` that puts them together.

``from tformer.train import Trainer`` works; the names are loaded on first use, so that importing
``tformer.train.config`` (the CLI's ``--help``) does not import the trainer and torch's models.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Trainer", "NonFiniteLoss", "LossSpikeError", "TrainConfig", "load_config"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "NonFiniteLoss", "LossSpikeError"):
        from . import trainer

        return getattr(trainer, name)
    if name in ("TrainConfig", "load_config"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module 'tformer.train' has no attribute {name!r}")
