"""The one owner of a run's checkpoints: what they hold (its :mod:`parts <tformer.checkpoint.parts>`,
each a ``Stateful`` with its place in the directory), how a save becomes complete, which one a
resume picks and the safety checks before anything is read. What ``trainer.json`` holds is
:class:`~tformer.checkpoint.state.TrainerState` (``state.py``).

A save (``save(step)``, every rank takes part) is

1. finish the save still in flight, if any; rank 0 makes a fresh
   ``checkpoints/.partial-step_XXXXXXXX/``; barrier;
2. every part writes its files into it, in order: model and optimizer (DCP shards or DeepSpeed's
   files -- in the background with ``checkpoint.async=true``, after a copy to host memory), the
   LR schedule and scaler, ``trainer.json`` and ``config.yaml`` (rank 0), the RNG file of every
   rank; barrier;
3. the commit (rank 0): the ``COMPLETE`` marker with every file's size and CRC-32, the rename to
   ``step_XXXXXXXX``, pruning to ``keep_checkpoints`` complete ones. A synchronous save commits at
   once; a background one in its own thread, when the write has ended -- never earlier.

A load (``load("auto" | path)``) resolves the checkpoint, verifies it (sizes and CRC-32), reads
every pickle through the allow-lists (``io.check_checkpoint``) and then hands it to each part
in the same order; DCP reshards model and optimizer to this run's layout, DeepSpeed converts a
checkpoint of another world size.

Rank 0's commit needs no other rank: DCP ends a save with a collective that returns only after
every rank's files are written, and the RNG files are in place before step 2's barrier. A save in
flight is finished before the next one starts, before a rollback reads the list (``wait``), and
before the trainer returns or leaves on an error; its thread is not a daemon, so even a caller
that forgets ``wait`` does not exit before the commit.

This module sits below ``train/``: the trainer hands it its parts; it imports nothing above
``parallel/``.
"""

from __future__ import annotations

import logging
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from ..data.errors import DataError
from ..parallel.async_save import BackgroundWrite
from ..parallel.dist import barrier
from .io import check_checkpoint
from . import io
from .io import CheckpointError
from .parts import Part
from .state import TrainerState

log = logging.getLogger("tformer.checkpoint")


class CheckpointManager:
    """Saves, commits, finds, verifies and loads the checkpoints under ``root`` for one rank.

    ``parts`` (name -> :class:`~tformer.checkpoint.parts.Part`, in save and load order) are what a
    checkpoint holds; ``background`` (``checkpoint.async``) writes in the background when every
    part can (``can_write_in_background``), else synchronously with one warning."""

    def __init__(
        self,
        root: str | Path,
        rank: int = 0,
        world_size: int = 1,
        keep: int = 0,
        background: bool = False,
        trust: bool = False,
        parts: dict[str, Part] | None = None,
    ):
        self.root = Path(root)
        self.rank, self.world_size, self.keep, self.trust = rank, world_size, keep, trust
        self.parts: dict[str, Part] = dict(parts or {})
        self.background = background and all(p.can_write_in_background for p in self.parts.values())
        if background and not self.background and self.is_main:
            slow = [name for name, p in self.parts.items() if not p.can_write_in_background]
            log.warning(
                "checkpoint.async=true: the %s part writes its own files synchronously (DeepSpeed's engine); "
                "the loop waits for each save",
                ", ".join(slow),
            )
        self._pending: tuple[int, Future] | None = None  # (step, its commit) while in flight
        self._pool: ThreadPoolExecutor | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def path(self, step: int) -> Path:
        return self.root / io.step_dir_name(step)

    # -- discovery -------------------------------------------------------------------------
    def committed(self) -> list[Path]:
        """Complete checkpoints, oldest first (a save in flight is not one yet)."""
        return io.list_checkpoints(self.root)

    @property
    def in_flight(self) -> int | None:
        """The step of the save being written in the background, if any."""
        return self._pending[0] if self._pending is not None else None

    def resolve(self, target: str) -> Path | None:
        """The checkpoint a ``resume`` value names, verified (sizes and CRC-32): ``auto`` the newest
        complete one here (None if there is none), ``none`` None, a run directory its newest, or a
        checkpoint directory."""
        if target == "none":
            return None
        if target == "auto":
            return io.find_latest(self.root)
        path = Path(target)
        if (path / "checkpoints").is_dir():
            found = io.find_latest(path / "checkpoints")
            if found is None:
                raise CheckpointError(f"no complete checkpoint under {target}")
            return found
        io.verify(path, deep=True)
        return path

    def locate(self, target: str) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The checkpoint a ``resume`` value names, verified (sizes and CRC-32) before any expensive
        work, and the damaged checkpoints it falls back past. ``auto`` and a run directory fall back
        from damaged newest checkpoints to the newest intact one (each with what is wrong); a
        checkpoint named explicitly must itself be intact. A finished run's damaged final
        checkpoint is thus never taken for its end."""
        if target == "none":
            return None, []
        path = Path(target)
        if target != "auto" and not (path / "checkpoints").is_dir():
            if path.is_dir():
                io.verify(path, deep=True)
            return path, []
        found, damaged = io.newest_intact(self.root if target == "auto" else path / "checkpoints")
        if found is None and target != "auto":
            raise CheckpointError(f"no complete checkpoint under {target}")
        return found, damaged

    def set_aside(self, damaged: list[Path]) -> list[Path]:
        """Rename damaged checkpoints of this run out of the complete ones (rank 0; every rank
        then waits), so that pruning keeps ``keep_checkpoints`` intact ones. Returns the new names."""
        moved = [io.set_aside(p) if self.is_main else p.with_name(io.DAMAGED + p.name) for p in damaged]
        barrier()
        return moved

    def read(self, ckpt: Path) -> TrainerState:
        return TrainerState.read(ckpt)

    # -- loading ---------------------------------------------------------------------------
    def load(self, target: str | Path, verified: bool = False) -> tuple[Path, TrainerState] | None:
        """Restore every part from the checkpoint ``target`` names (``auto``, ``none``, a run or a
        checkpoint directory, as ``resolve``): verified (unless ``verified``: a checkpoint path
        ``locate`` has just verified), its pickles checked against the allow-lists (unless
        ``trust``) before any is loaded. Returns (its path, its ``trainer.json``), or None when
        there is nothing to resume."""
        path = Path(target) if verified else self.resolve(str(target))
        if path is None:
            return None
        check_checkpoint(path, self.trust)
        saved = self.read(path)
        for part in self.parts.values():
            try:
                part.load(path, saved)
            except DataError as e:  # a part that refuses this checkpoint (another data mixture)
                raise DataError(f"checkpoint {path}: {e}") from None
        return path, saved

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """One checkpoint of ``step`` (all ranks call it): every part into the partial directory,
        then the commit. Returns where the checkpoint is (or will be, once a background write
        ends and it is committed)."""
        self.wait(sync=False)  # one save at a time; this save's barrier follows
        tmp = io.partial_dir(self.root, step)
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
        barrier()
        writes = [part.save(tmp, self.background) for part in self.parts.values()]
        pending = [w for w in writes if w is not None]
        barrier()
        if not pending:
            final = self._commit(step)
            barrier()
            return final
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tformer-commit")
        self._pending = (step, self._pool.submit(self._finish, step, pending))
        return self.path(step)

    def _commit(self, step: int) -> Path:
        # through the module: tests stop a save here (tests/kill_during_training.py)
        return io.commit(self.root, step, self.keep) if self.is_main else self.path(step)

    def _finish(self, step: int, pending: list[BackgroundWrite]) -> Path:
        for write in pending:
            write.result()  # every file of this rank written (rank 0: of every rank, see above)
        return self._commit(step)

    def poll(self) -> Path | None:
        """Non-blocking: take note of a background save that has ended (its error, if any, is
        raised here). Returns the committed path, else None. No collective."""
        if self._pending is None or not self._pending[1].done():
            return None
        return self.wait(sync=False)

    def wait(self, sync: bool = True) -> Path | None:
        """Block until the save in flight (if any) is written and committed; with ``sync``, all
        ranks then leave together (so every rank lists the same checkpoints afterwards)."""
        done = None
        if self._pending is not None:
            step, future = self._pending
            self._pending = None
            try:
                done = future.result()
            except Exception as e:
                newest = self.committed()[-1] if self.committed() else "none"
                raise CheckpointError(
                    f"the background save of step {step} failed ({type(e).__name__}: {e}); "
                    f"its partial directory {io.partial_dir(self.root, step)} is never "
                    "resumed from; the newest complete checkpoint is "
                    f"{newest}"
                ) from e
        if sync:
            barrier()
        return done

    def close(self) -> None:
        """Finish what is in flight without waiting for the other ranks (for error paths)."""
        try:
            self.wait(sync=False)
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
