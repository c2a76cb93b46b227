"""Weights & Biases on rank 0 (online or offline), imported only when enabled."""

from __future__ import annotations

import os
from pathlib import Path

from .config import WandbConfig


class WandbTracker:
    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict, run_id: str | None):
        self.run = None
        self.run_id = run_id
        if not cfg.enabled:
            return
        try:
            import wandb
        except ImportError:
            from ..config import ConfigError

            raise ConfigError(
                "wandb.enabled=true but the wandb package is not installed; pip install wandb, or set wandb.enabled=false"
            ) from None
        # Keep every W&B file inside the run directory unless the user chose otherwise.
        base = run_dir / "wandb"
        for var, sub in (
            ("WANDB_DIR", ""),
            ("WANDB_CACHE_DIR", "cache"),
            ("WANDB_DATA_DIR", "data"),
            ("WANDB_CONFIG_DIR", "config"),
        ):
            os.environ.setdefault(var, str(base / sub))
            Path(os.environ[var]).mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name,
            tags=cfg.tags or None,
            id=run_id,
            resume="allow",
            config=config,
            dir=os.environ["WANDB_DIR"],
            mode=cfg.mode,
        )
        self.run_id = self.run.id

    def log(self, record: dict) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if k != "step" and not isinstance(v, str)}, step=record["step"])
            for k, v in record.items():  # text (sacrebleu's signature) goes to the run summary
                if isinstance(v, str):
                    self.run.summary[k] = v

    def finish(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
