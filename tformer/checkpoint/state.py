"""``trainer.json``: where a run stands (:class:`TrainerState`), the record every part of a
checkpoint reads on load. Below ``manager.py``, ``parts.py`` and ``consolidate.py``, which all use it."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..files import write_bytes_durable
from .io import TRAINER_STATE, CheckpointError, read_trainer_state

# keys written only when set: a weights-only import's, absent from a trainer's file
_ONLY_WHEN_SET = ("weights_only", "imported_from")


@dataclass
class TrainerState:
    """``trainer.json``: where a run stands, written by the trainer at every save and by
    ``tformer import`` (a weights-only step-0 checkpoint)."""

    step: int = 0
    consumed_samples: int = 0  # global samples (token-budget batches: batches) consumed
    tokens: int = 0  # global tokens consumed
    skipped: int = 0  # consecutive non-finite steps at the save
    world_size: int | None = None  # ranks that wrote it (None: an import)
    mesh: str | None = None  # the parallel layout, e.g. "dp_replicate=1 dp_shard=2 tp=1"
    rollbacks: int = 0  # loss-spike rollbacks done
    spike_detector: dict = field(default_factory=dict)
    wandb_id: str | None = None
    model_config: dict | None = None
    strategy: str | None = None
    family: str | None = None
    objective: str | None = None
    seq_len: int | None = None
    target_len: int | None = None
    data_mixture: list | None = None  # a mixture run: its sources' schedule, lengths and seed
    # sequences per optimizer step (micro_batch_size x grad_accum x data-parallel ranks; with
    # token-budget batches, batches), and the input tokens they hold (token budget: at most)
    global_batch: int | None = None
    global_batch_tokens: int | None = None
    schedule_steps: int | None = None  # the horizon the LR schedule was planned with (max_steps at the start)
    # the record of this step when it is due to be logged ({"record": ..., "evaluate": bool}): the
    # checkpoint is saved before the step is evaluated and logged, so a kill in between is made
    # good at resume from here (train/trainer.py, ``_finish_pending``)
    pending: dict | None = None
    weights_only: bool = False  # an import: weights, no optimizer state
    imported_from: str | None = None
    time: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for key in _ONLY_WHEN_SET:
            if not data[key]:
                del data[key]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str | Path = TRAINER_STATE) -> TrainerState:
        """Tolerant of older files (missing keys take their defaults) and of newer ones (unknown
        keys are ignored); a missing step is an error."""
        if not isinstance(data, dict) or "step" not in data:
            raise CheckpointError(f"{where} records no step; it is not a tformer checkpoint")
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        if values.get("spike_detector") is None:
            values.pop("spike_detector", None)
        return cls(**values)

    def write(self, directory: Path) -> None:
        write_bytes_durable(directory / TRAINER_STATE, json.dumps(self.to_dict(), indent=1).encode())

    @classmethod
    def read(cls, ckpt: str | Path) -> TrainerState:
        return cls.from_dict(read_trainer_state(ckpt), Path(ckpt) / TRAINER_STATE)
