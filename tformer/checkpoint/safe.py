"""Moved to :mod:`tformer.safeload` (below ``parallel/``, whose strategies load their own states
through it); the names stay importable from here."""

from .io import check_checkpoint
from ..safeload import (
    TRUST_HINT,
    CheckpointError,
    UnsafeCheckpointError,
    check_dcp_dir,
    check_deepspeed_dir,
    dcp_load,
    read_dcp_metadata,
    safe_dcp_reader_and_planner,
    torch_load,
    torch_load_safe,
)

__all__ = [
    "TRUST_HINT",
    "CheckpointError",
    "UnsafeCheckpointError",
    "check_checkpoint",
    "check_dcp_dir",
    "check_deepspeed_dir",
    "dcp_load",
    "read_dcp_metadata",
    "safe_dcp_reader_and_planner",
    "torch_load",
    "torch_load_safe",
]
