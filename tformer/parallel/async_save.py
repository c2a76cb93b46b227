"""DCP's ``async_save`` for the ddp and fsdp strategies (``checkpoint.async=true``).

The caller waits only while the state is copied to host memory (the staging copy); the files are
written by a background thread. On CUDA the staging buffers are pinned and kept between saves
(pinning gigabytes on every save would cost more than the copy); on CPU a fresh copy is made per
save and freed when its write ends. The write's collectives (DCP's plan and metadata exchange) run
on a process group of their own, so they never interleave with the training loop's collectives on
the default group; with no process group (one process) DCP writes without collectives.

``gpt2-small`` on CPU (2 cores, AVX2 EPYC): the loop is blocked 0.75 s against 6.3 s for a
synchronous save (0.12x, ``bench/bench_trainer.py``); keeping the CPU buffers between saves saved
little there (0.6-0.9 s either way), so on CPU they are freed after each write.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..files import save_weights


class BackgroundWrite:
    """The files of one save being written; ``result()`` waits for the last of them and raises
    the first error."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def result(self) -> None:
        for f in self.futures:
            f.result()


def _stager_class():
    from torch.distributed.checkpoint.staging import DefaultStager

    class RecordingStager(DefaultStager):
        """DCP's stager, keeping the staged copy so the weights file is written from it too."""

        staged: Any = None

        def stage(self, state_dict, **kwargs):
            self.staged = super().stage(state_dict, **kwargs)
            return self.staged

    return RecordingStager


class AsyncSaver:
    """One per strategy: the staging buffers (pinned and reused on CUDA) and the process group
    of the background writes (made at the first save, which every rank takes part in)."""

    def __init__(self, device: torch.device, pinned: bool | None = None, keep_buffers: bool | None = None):
        self.pinned = device.type == "cuda" if pinned is None else pinned
        self.keep_buffers = self.pinned if keep_buffers is None else keep_buffers
        self._stager: Any = None
        self._group: Any = None

    def _new_stager(self):
        from torch.distributed.checkpoint.staging import StagingOptions

        # a synchronous copy: once async_save returns, training may change the live tensors
        return _stager_class()(
            StagingOptions(
                use_pinned_memory=self.pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )

    def save(self, state: dict, dcp_dir: Path, weights_path: Path | None = None) -> BackgroundWrite:
        """Stage ``state`` ({"model": ..., "optimizer": ...}) and write it to ``dcp_dir`` in the
        background; ``weights_path``: also ``model.safetensors`` from the staged model state."""
        import torch.distributed.checkpoint as dcp

        if dist.is_available() and dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")
        stager = self._stager if self._stager is not None else self._new_stager()
        if self.keep_buffers:
            self._stager = stager
        future = dcp.async_save(state, checkpoint_id=str(dcp_dir), process_group=self._group, async_stager=stager)
        assert isinstance(future, Future)  # a synchronous stager: a plain future, not a staging response
        futures = [future]
        staged, stager.staged = stager.staged, None
        if weights_path is not None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tformer-weights")
            futures.append(pool.submit(save_weights, dict(staged["model"]), weights_path))
            pool.shutdown(wait=False)
        if not self.keep_buffers:  # the staged copy lives until its write ends
            future.add_done_callback(lambda _f: stager.close())
        return BackgroundWrite(futures)
