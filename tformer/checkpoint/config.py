"""The run config's ``checkpoint`` section. Its owner is this package; ``tformer/train/config.py``
composes it into the run config (and re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CheckpointConfig:
    # true: load this run's checkpoints' pickles (DCP metadata, DeepSpeed states) without the
    # allow-list. DANGEROUS: a pickle can run any code; only for checkpoints of trusted origin.
    trust: bool = False
    # true: ddp/fsdp write with DCP's async_save; the loop waits only for the copy of the state
    # to host memory, the write and the commit happen in the background (DeepSpeed: synchronous)
    async_: bool = field(default=False, metadata={"key": "async"})
