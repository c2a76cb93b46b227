"""Model and optimizer under DeepSpeed: the engine's own checkpoint in ``DEEPSPEED_DIR`` (the
engine is the Stateful here: it saves and loads its ZeRO partitions itself).

At a different world size the checkpoint is converted once to DeepSpeed's universal format and
loaded from there. Always synchronous: ``save_checkpoint`` has no background mode that hands back a
completion to commit on (``checkpoint.async`` is ignored for it, with a warning).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ..files import torch_save_durable
from ..parallel.dist import barrier
from ..safeload import CheckpointError, check_deepspeed_dir, torch_load_safe
from .io import DEEPSPEED_DIR, DEEPSPEED_TAG, load_model_weights
from .state import TrainerState

log = logging.getLogger("tformer.checkpoint")
# each param group's hyperparameters at the save (lr, weight_decay, betas, ...), beside the engine's files
PARAM_GROUPS = "param_groups.pt"


def _hyperparameters(optimizer: Any) -> list[dict]:
    """Each param group's settings without its tensors (lr, weight_decay, betas, eps, ...)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class DeepSpeedPart:
    can_write_in_background = False

    def __init__(self, engine: Any, optimizer: Any, base_optimizer: Any, rank: int, world_size: int, trust: bool):
        self.engine, self.optimizer, self.base_optimizer = engine, optimizer, base_optimizer
        self.is_main, self.world_size, self.trust = rank == 0, world_size, trust

    def save(self, tmp: Path, background: bool) -> None:
        self.engine.save_checkpoint(str(tmp / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        if self.is_main:
            torch_save_durable(_hyperparameters(self.optimizer), tmp / DEEPSPEED_DIR / PARAM_GROUPS)

    def load(self, ckpt: Path, saved: TrainerState) -> None:
        if saved.weights_only:
            load_model_weights(self.engine.module, ckpt)
            log.warning("%s holds weights only: the optimizer and LR schedule start fresh", ckpt)
            return
        ds_dir = ckpt / DEEPSPEED_DIR
        if not (ds_dir / DEEPSPEED_TAG).is_dir():
            raise CheckpointError(
                f"checkpoint {ckpt} has no {DEEPSPEED_DIR}/{DEEPSPEED_TAG}; it was written by another "
                "strategy: resume it with parallel.strategy=ddp or fsdp"
            )
        check_deepspeed_dir(ds_dir, self.trust)  # DeepSpeed (and its converter) unpickle these freely
        universal = saved.world_size is not None and saved.world_size != self.world_size
        if universal:
            load_dir, tag = self._universal(ds_dir, saved.world_size or 0), f"{DEEPSPEED_TAG}_universal"
            self.engine._config.load_universal_checkpoint = True
        else:
            load_dir, tag = ds_dir, DEEPSPEED_TAG
        own_groups = _hyperparameters(self.optimizer)
        try:
            loaded, _ = self.engine.load_checkpoint(
                str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except Exception as e:  # noqa: BLE001 - any failure inside DeepSpeed is a checkpoint that does not load
            raise CheckpointError(
                f"DeepSpeed checkpoint {load_dir / tag} cannot be loaded ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); use an earlier checkpoint"
            ) from None
        if loaded is None:
            raise CheckpointError(f"DeepSpeed found no checkpoint in {load_dir / tag}")
        if universal:
            self._mend_universal(ds_dir, ckpt, own_groups)

    def _mend_universal(self, ds_dir: Path, ckpt: Path, own_groups: list[dict]) -> None:
        # ZeRO-3's universal load gives *every* param group the hyperparameters of group 0
        # (deepspeed 0.19 stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3), so the
        # no-decay group would suddenly decay. Put back each group's own values: the saved
        # ones (lr, weight_decay, betas, ...), else this run's.
        path = ds_dir / PARAM_GROUPS
        saved = torch_load_safe(path, self.trust) if path.is_file() else own_groups
        groups = self.optimizer.param_groups
        if len(saved) != len(groups):
            raise CheckpointError(
                f"checkpoint {ckpt} has {len(saved)} optimizer param groups but this "
                f"run has {len(groups)}; resume with the same optimizer settings"
            )
        for group, values in zip(groups, saved):
            group.update(values)
        # ...and it hands every param group the *same* ``step`` tensor object: torch's AdamW
        # increments it in place once per group, so Adam's step count (and with it the bias
        # correction) would advance twice per step. Give each state its own copy.
        for state in self.base_optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def _universal(self, ds_dir: Path, saved_world_size: int) -> Path:
        """Convert a ZeRO checkpoint of another world size to DeepSpeed's universal format (once)."""
        out = ds_dir / f"{DEEPSPEED_TAG}_universal"
        if self.is_main and not (out / "zero").is_dir():
            log.info(
                "converting the %d-rank DeepSpeed checkpoint for %d rank(s): %s -> %s",
                saved_world_size,
                self.world_size,
                ds_dir / DEEPSPEED_TAG,
                out,
            )
            cmd = [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(ds_dir / DEEPSPEED_TAG),
                "--output_folder",
                str(out),
                "--inject_missing_state",
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise CheckpointError(
                    f"converting {ds_dir / DEEPSPEED_TAG} to a universal checkpoint failed ({tail}); "
                    f"run `{' '.join(cmd[1:])}` by hand, or resume on {saved_world_size} ranks"
                )
        barrier()
        return ds_dir
