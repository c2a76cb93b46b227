"""Where rank 0's metrics go besides metrics.jsonl: Weights & Biases (online or offline) and
TensorBoard, each imported only when enabled, under the same names."""

from __future__ import annotations

import os
from pathlib import Path

from ..config import TensorboardConfig, TrainConfig, WandbConfig


class WandbTracker:
    def __init__(self, cfg: WandbConfig, run_dir: Path, config: dict, run_id: str | None):
        self.run = None
        self.run_id = run_id
        if not cfg.enabled:
            return
        try:
            import wandb
        except ImportError:
            from ...config import ConfigError

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


TENSORBOARD_DIR = "tensorboard"  # under the run directory; the profiler's traces are linked in below it


class TensorboardTracker:
    """Scalars under W&B's names, the run config as text; ``OUTPUT/tensorboard`` holds the event
    files, and ``plugins/profile/`` beneath it the profiler's traces (where the profile plugin looks)."""

    def __init__(self, cfg: TensorboardConfig, run_dir: Path, config: dict, start_step: int = 0):
        self.writer = None
        if not cfg.enabled:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            from ...config import ConfigError

            raise ConfigError(
                "tensorboard.enabled=true but the tensorboard package is not installed; "
                "pip install 'tformer[tensorboard]' (or pip install tensorboard), or set tensorboard.enabled=false"
            ) from None
        import yaml

        # a resumed run drops what an earlier attempt logged after its checkpoint (it logs those steps again)
        purge = start_step + 1 if start_step else None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge)
        # markdown: indented by four spaces, the YAML shows as a code block
        text = "\n".join("    " + line for line in yaml.safe_dump(config, sort_keys=False).splitlines())
        self.writer.add_text("config", text, 0)

    def log(self, record: dict) -> None:
        if self.writer is None:
            return
        for k, v in record.items():
            if k == "step":
                continue
            if isinstance(v, str):
                self.writer.add_text(k, v, record["step"])
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(k, v, record["step"])
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class Trackers:
    """W&B and TensorBoard together: either, both or neither."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, config: dict, run_id: str | None, start_step: int = 0):
        self.tensorboard = TensorboardTracker(cfg.tensorboard, run_dir, config, start_step)  # before W&B: none to end
        self.wandb = WandbTracker(cfg.wandb, run_dir, config, run_id)
        self.run_id = self.wandb.run_id

    def log(self, record: dict) -> None:
        self.wandb.log(record)
        self.tensorboard.log(record)

    def finish(self) -> None:
        self.wandb.finish()
        self.tensorboard.finish()
