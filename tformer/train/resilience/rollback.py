"""Loss-spike rollback and the last good checkpoint.

On a spike (``on_spike: rollback``) the run reloads the newest checkpoint before it and skips
``spike_skip_batches`` steps' worth of data; each rollback is appended to ``OUTPUT/rollbacks.json``
so that a run killed before its next checkpoint resumes the skip. The last good checkpoint is the
one a stopped run names: saved before the non-finite streak (or the spike) began.

Plain functions of the trainer, which calls them from its loop, its resume and its non-finite
handling. They see the trainer through :class:`RollbackState`, the fields of it they read and set,
so this module imports nothing above it (``trainer.py`` and the loop's ``state.py`` import this
folder)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Protocol

from ...checkpoint.manager import CheckpointManager
from ...files import atomic_write
from ...parallel.dist import DistInfo
from ..config import TrainConfig
from .spike import SpikeDetector
from ..dist import barrier

log = logging.getLogger("tformer.train")


class LossSpikeError(RuntimeError):
    """The run stopped on a loss spike it could not roll back (``on_spike: rollback``)."""


class NonFiniteStreak(Protocol):
    """The non-finite steps in a row (loop/figures.py's ``Streak``)."""

    skipped: int
    start: int | None  # the streak's first step


class RollbackState(Protocol):
    """What a rollback reads and sets of a run (``train.trainer.Trainer`` has it)."""

    cfg: TrainConfig
    dist: DistInfo
    step: int
    consumed: int  # global samples consumed
    spikes: SpikeDetector
    rollbacks: int
    wandb_id: str | None
    out: Path  # the run directory
    ckpt: CheckpointManager

    @property
    def streak(self) -> NonFiniteStreak: ...

    def wait_for_checkpoint(self) -> Path | None: ...
    def _load(self, target: str | Path, verified: bool = False) -> bool: ...
    def _global_batch(self) -> int: ...


def handle_spike(trainer: RollbackState, record: dict) -> bool:
    """Judge a step's loss (``record["step"]``'s, in step order); on a spike with ``on_spike:
    rollback`` reload the newest checkpoint before it and skip ``spike_skip_batches`` steps' worth
    of data. True if it rolled back."""
    t, cfg = trainer, trainer.cfg
    if cfg.on_spike == "none":
        return False
    step = record["step"]  # read at a later step where the figures stay on the device until then
    median = t.spikes.check(step, record["loss"])
    if median is None:
        return False
    what = f"loss spike at step {step}: {record['loss']:.4f} > {cfg.spike_factor:g} x running median {median:.4f}"
    record["spike"] = True
    if cfg.on_spike == "warn":
        if t.dist.is_main:
            log.warning("%s (on_spike=warn)", what)
        return False
    t.wait_for_checkpoint()  # every rank then lists the same checkpoints
    target = [p for p in t.ckpt.committed() if int(p.name.split("_")[1]) < step]
    if t.rollbacks >= cfg.max_rollbacks:
        raise LossSpikeError(
            f"{what}; max_rollbacks={cfg.max_rollbacks} reached; the last good checkpoint is "
            f"{target[-1] if target else 'none'}; lower optim.lr or check the data"
        )
    if not target:
        if t.dist.is_main:
            log.warning("%s; no checkpoint before it to roll back to: continuing (save more often with save_every)", what)
        return False
    spike_step, wandb_id = step, t.wandb_id
    t._load(target[-1])  # verified and checked like any resume
    t.wandb_id = wandb_id
    t.rollbacks += 1
    event = {
        "spike_step": spike_step,
        "loss": record["loss"],
        "median": median,
        "to_step": t.step,
        "rollback": t.rollbacks,
        "skip_from_sample": t.consumed,
        "skip_samples": cfg.spike_skip_batches * t._global_batch(),
    }
    record_rollback(t, event)
    t.consumed += event["skip_samples"]
    record["rollback_to"] = t.step
    if t.dist.is_main:
        log.warning(
            "%s; rolled back to %s and skipping %d batches (samples %d-%d), rollback %d of %d",
            what,
            target[-1],
            cfg.spike_skip_batches,
            event["skip_from_sample"],
            t.consumed - 1,
            t.rollbacks,
            cfg.max_rollbacks,
        )
    return True


def record_rollback(trainer: RollbackState, event: dict) -> None:
    """Append to ``OUTPUT/rollbacks.json``: a run killed before its next checkpoint resumes the
    skip from there (the checkpoint it rolled back to does not know about it)."""
    if trainer.dist.is_main:
        path = trainer.out / "rollbacks.json"
        events = json.loads(path.read_text()) if path.is_file() else []
        events.append(event)
        with atomic_write(path, durable=True) as tmp:
            tmp.write_bytes(json.dumps(events, indent=1).encode())
    barrier()


def apply_pending_rollback(trainer: RollbackState) -> None:
    """After a resume: a rollback to exactly this checkpoint that the checkpoint predates."""
    t = trainer
    path = t.out / "rollbacks.json"
    if t.cfg.on_spike != "rollback" or not path.is_file():
        return
    for event in json.loads(path.read_text()):
        if event["to_step"] == t.step and event["rollback"] == t.rollbacks + 1 and event["skip_from_sample"] == t.consumed:
            t.rollbacks += 1
            t.consumed += event["skip_samples"]
            if t.dist.is_main:
                log.info(
                    "resuming rollback %d: skipping samples %d-%d",
                    t.rollbacks,
                    event["skip_from_sample"],
                    t.consumed - 1,
                )


def last_good(ckpt: CheckpointManager, streak: NonFiniteStreak) -> Path | None:
    """The newest checkpoint saved before the non-finite streak. When the streak is longer than
    one step, the checkpoint just before it is excluded too: its weights gave a non-finite loss
    on several different batches (and skipped steps leave them unchanged), so resuming it would
    fail again at once."""
    found = ckpt.committed()
    if ckpt.in_flight is not None:  # a good state, being written: committed before the run ends
        found.append(ckpt.path(ckpt.in_flight))
    if streak.start is not None:
        limit = streak.start - (2 if streak.skipped > 1 else 1)
        found = [p for p in found if int(p.name.split("_")[1]) <= limit]
    return found[-1] if found else None
