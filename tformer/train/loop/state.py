"""The trainer's own parts of a checkpoint, as ``Stateful``s over its fields: where the data
stands (with the mixture's fingerprint, which a resume must match) and where the run stands.
Both are fields of ``trainer.json`` (``checkpoint.parts.TrainerStatePart`` merges them).

They read and set the trainer's fields through :class:`RunState`, the part of the trainer they
see: the trainer answers it without this module importing ``trainer.py`` (which imports this)."""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.checkpoint.stateful import Stateful

from ...config import ModelConfig
from ...data import DataError, MixtureDataset
from ...parallel.dist import DistInfo
from ...parallel.mesh import ParallelDims
from ..config import TrainConfig
from .data import RunData
from .figures import Streak
from ..resilience.spike import SpikeDetector


class RunState(Protocol):
    """The fields of a run that its checkpoint records (``train.trainer.Trainer`` has them)."""

    cfg: TrainConfig
    dist: DistInfo
    dims: ParallelDims
    data: RunData
    model_cfg: ModelConfig
    step: int
    consumed: int  # global samples consumed
    tokens: int  # global tokens consumed
    streak: Streak  # the non-finite steps in a row
    rollbacks: int
    spikes: SpikeDetector
    wandb_id: str | None
    schedule_steps: int
    pending: dict | None  # this step's record while it waits to be evaluated and logged

    def _global_batch_size(self) -> tuple[int, int]: ...


def mixture_fingerprint(trainer: RunState) -> list | None:
    train = trainer.data.train
    if not isinstance(train, MixtureDataset):
        return None
    return train.schedule.fingerprint() + [train.lengths, train.seed]


class DataPosition(Stateful):
    """The samples and tokens consumed (the sampler resumes from them at any world size), and the
    data mixture they were drawn from: a checkpoint of another mixture is refused."""

    def __init__(self, trainer: RunState):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"consumed_samples": t.consumed, "tokens": t.tokens, "data_mixture": mixture_fingerprint(t)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t, mixture, own = self.trainer, state_dict.get("data_mixture"), mixture_fingerprint(self.trainer)
        # the manager names the checkpoint: "checkpoint PATH: it was trained on ..."
        if mixture is not None and mixture != own:
            raise DataError(
                f"it was trained on the data mixture {mixture} but this run's is "
                f"{own}: resume with the same sources, weights, stages and global batch size, or start a new run"
            )
        t.consumed, t.tokens = state_dict["consumed_samples"], state_dict["tokens"]


class Progress(Stateful):
    """Where the run stands (step, the non-finite streak, rollbacks, the spike detector's window,
    the W&B run) and what it trains (model, strategy, layout, batch), for resume checks and tools."""

    def __init__(self, trainer: RunState):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        sequences, tokens = t._global_batch_size()
        return {
            "step": t.step,
            "skipped": t.streak.skipped,
            "world_size": t.dist.world_size,
            "mesh": t.dims.describe(),
            "rollbacks": t.rollbacks,
            "spike_detector": t.spikes.state_dict(),
            "wandb_id": t.wandb_id,
            "model_config": t.model_cfg.to_dict(),
            "strategy": t.cfg.parallel.strategy,
            "family": t.model_cfg.family,
            "objective": t.data.objective,
            "seq_len": t.data.seq_len,
            "target_len": t.data.target_len,
            "global_batch": sequences,
            "global_batch_tokens": tokens,
            "schedule_steps": t.schedule_steps,
            "pending": t.pending,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        t = self.trainer
        t.step, t.streak.skipped, t.rollbacks = state_dict["step"], state_dict["skipped"], state_dict["rollbacks"]
        t.wandb_id = state_dict["wandb_id"]
        t.spikes.load_state_dict(state_dict["spike_detector"])
        t.streak.start = None
