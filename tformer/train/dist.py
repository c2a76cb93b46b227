"""Moved to :mod:`tformer.parallel.dist` (below ``checkpoint/``, whose manager synchronises the
ranks around a save); the names stay importable from here."""

from ..parallel.dist import DistInfo, _free_port, all_reduce, barrier, device_type, init_distributed, shutdown

__all__ = ["DistInfo", "_free_port", "all_reduce", "barrier", "device_type", "init_distributed", "shutdown"]
