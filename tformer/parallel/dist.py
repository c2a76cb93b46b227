"""Process-group setup for torchrun (and plain single-process runs), and the clean shutdown that
gloo needs on CPU."""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    dims: Any = None  # tformer.parallel.mesh.ParallelDims (None: one process, no mesh)
    mesh: Any = None  # its DeviceMesh, once a process group exists
    # fault tolerance (tformer/train/resilience/ft.py): this process group is replica group ``replica`` of
    # ``replicas``, each a job of its own; the training data is split over all of them
    replica: int = 0
    replicas: int = 1

    @property
    def group_dp_rank(self) -> int:
        """This rank's data-parallel index inside its process group: the ``tp`` ranks of one
        group see the same batches."""
        return self.rank if self.dims is None else self.dims.dp_rank(self.rank)

    @property
    def group_dp_size(self) -> int:
        return self.world_size if self.dims is None else self.dims.dp_size

    @property
    def dp_rank(self) -> int:
        """Which training data this rank sees, counted over every replica group."""
        return self.replica * self.group_dp_size + self.group_dp_rank

    @property
    def dp_size(self) -> int:
        return self.replicas * self.group_dp_size

    @property
    def tp_size(self) -> int:
        return 1 if self.dims is None else self.dims.tp

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_type(device: str) -> str:
    """``cuda`` for device=cuda, or for auto when a GPU is visible; else ``cpu``."""
    return "cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu"


def init_distributed(
    device: str = "auto", backend: str | None = None, timeout_s: float = 600, always: bool = False
) -> DistInfo:
    """Read torchrun's environment; start the process group when there is more than one rank, or
    (``always``) also for one rank, which FSDP2 and DeepSpeed need even then."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_type(device)
    if device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if (world > 1 or always) and not dist.is_initialized():
        if world == 1:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.setdefault("RANK", "0")
            os.environ.setdefault("WORLD_SIZE", "1")
            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed asserts it is set
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        # TFORMER_DIST_TIMEOUT bounds every collective: a lost peer ends the job instead of hanging.
        timeout_s = float(os.environ.get("TFORMER_DIST_TIMEOUT", timeout_s))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local, dev)


# Every collective of tformer's own code goes through these helpers: one process without a
# process group runs them as no-ops, and the timeout of ``init_distributed`` bounds them all.


def multi_process() -> bool:
    """A process group with more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(t: torch.Tensor, op=None, group=None) -> torch.Tensor:
    """Sum (or ``op``) ``t`` in place over ``group`` (default: every rank); returns ``t``."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=group)
    return t


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_gather_object(obj, group=None) -> tuple[list, int]:
    """Every rank's ``obj`` (picklable, small) in the order of the ranks of ``group``, and this
    rank's index in it; ``[obj], 0`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [obj], 0
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, obj, group=group)
    return everyone, dist.get_rank(group)


def shutdown(exit_code: int | None = None) -> None:
    """Tear down the process group. With ``exit_code`` in a multi-rank run, leave through
    ``os._exit``: gloo threads freeing tensors during interpreter shutdown otherwise crash the
    process after all work is done (measured: 2 failures in 25 runs without it, 0 with it)."""
    multi = dist.is_available() and dist.is_initialized()
    if multi:
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a peer already gone; nothing left to synchronise
            pass
    if exit_code is not None and multi:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
