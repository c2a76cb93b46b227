"""torch.profiler traces of chosen steps (the ``profile`` section), and CUDA memory snapshots.

The trainer calls ``before_step`` / ``after_step`` around each optimizer step and wraps its phases
in ``range("forward")`` etc. With ``profile.steps`` unset the trainer holds ``OFF``: no profiler
object exists and every range is one shared ``nullcontext`` (no ``record_function`` either).

Each contiguous run of traced steps gets a profiler of its own, started one step early: that step
is the schedule's warm-up (the profiler's own start-up cost and first allocations land there, not
in a traced step). Every traced step is saved on its own, as
``OUTPUT/profile/rank{R}/step{N}.trace.json.gz`` (a gzip'd Chrome trace: Perfetto, TensorBoard,
chrome://tracing), with tformer's ranges ``tformer/step``, ``tformer/data``, ``tformer/forward``,
``tformer/backward`` and ``tformer/optimizer`` in it; ``tformer profile-report`` reads them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ...config import ConfigError
from ..config import ProfileConfig

log = logging.getLogger("tformer.train")

STEPS_FILE = "steps.json"  # beside the traces: the rank, world size, device, and each traced step's time
PREFIX = "tformer/"  # the trainer's record_function ranges: tformer/step, tformer/data, ...
_NULL = contextlib.nullcontext()
MEMORY_EVENTS = 200_000  # the allocator history's ring: the newest events a snapshot holds


_KINETO_LINE = re.compile(r"^(USDT|STAGE):\S+ \S+ \S+ \w+\.cpp:\d+\] ")


@contextlib.contextmanager
def quiet_kineto():
    """torch's profiler (kineto) prints ``USDT:... profiler_start`` / ``profiler_stop`` (and at
    some levels ``STAGE:`` lines) straight to the process's stderr at every start and stop, between
    the step lines. Those lines are dropped here, everything else written meanwhile is passed on;
    with ``KINETO_LOG_LEVEL`` set (the user asked for kineto's own logs) nothing is touched."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            rest = [
                line
                for line in caught.read().splitlines(keepends=True)
                if not _KINETO_LINE.match(line.decode(errors="replace"))
            ]
            if rest:
                os.write(2, b"".join(rest))


def check_ranks(cfg: ProfileConfig, world_size: int) -> None:
    """A traced rank the run does not have: one line, before any work."""
    if cfg.steps is None:
        return
    missing = [r for r in cfg.ranks if r >= world_size]
    if missing:
        raise ConfigError(
            f"profile.ranks={cfg.ranks} names rank(s) {missing} but the run has {world_size} rank(s) "
            f"(0 to {world_size - 1}); use profile.ranks=[0]"
        )


class _Off:
    """Profiling off: nothing to do, at the cost of a method call."""

    active = False

    def range(self, name: str):
        return _NULL

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int, step_time: float) -> None:
        pass

    def on_oom(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


OFF = _Off()


def build_profiler(cfg: ProfileConfig, max_steps: int, dist, out: Path, precision: str, tensorboard: bool = False):
    """``OFF`` unless this rank traces some step of this run. With ``tensorboard``, each trace is
    also linked where TensorBoard's profile plugin looks: ``OUTPUT/tensorboard/plugins/profile/step{N}/``."""
    steps = cfg.traced(max_steps)
    snapshots = cfg.memory and dist.device.type == "cuda"  # the allocator's history, for an OOM at any step
    if dist.rank not in cfg.ranks or not (steps or snapshots):
        if cfg.memory and not steps and dist.rank == min(cfg.ranks):
            log.warning(
                "profile.memory=true without profile.steps records nothing on %s: allocator snapshots need "
                "CUDA; set profile.steps (e.g. profile.steps=3-4) for the profiler's memory events",
                dist.device.type,
            )
        return OFF
    about = {"rank": dist.rank, "world_size": dist.world_size, "device": dist.device.type, "precision": precision}
    prof = StepProfiler(cfg, steps, dist.rank, Path(out) / "profile" / f"rank{dist.rank}", dist.device, about)
    if tensorboard:
        prof.plugin_dir = Path(out) / "tensorboard" / "plugins" / "profile"
    return prof


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, steps: list[int], rank: int, directory: Path, device: torch.device, about: dict):
        self.cfg, self.steps, self.rank, self.dir, self.device = cfg, set(steps), rank, directory, device
        self.about = {**about, "step_time": {}}  # steps.json: what profile-report needs beside the traces
        self.cuda = device.type == "cuda"
        self.prof: torch.profiler.profile | None = None
        self.active = False  # the current step is traced: the ranges record
        self._step_range: torch.profiler.record_function | None = None
        self._recording_memory = False
        self.plugin_dir: Path | None = None
        self.dir.mkdir(parents=True, exist_ok=True)
        if cfg.memory and not self.cuda and rank == min(cfg.ranks):
            log.warning(
                "profile.memory: allocator snapshots need CUDA; on %s the traces hold the profiler's memory "
                "events instead (open them in Perfetto or TensorBoard)",
                device.type,
            )

    # -- the ranges --------------------------------------------------------------------------
    def range(self, name: str):
        return torch.profiler.record_function(PREFIX + name) if self.active else _NULL

    # -- the window ---------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        """``step``: the number the coming step will have (1 = the first)."""
        if self.prof is None and (step in self.steps or (step + 1) in self.steps):
            warmup = step not in self.steps
            first = step + warmup
            traced = next(n for n in range(first, first + len(self.steps) + 1) if n not in self.steps) - first
            self._start(warmup, traced)
        if self.cuda and self.cfg.memory and not self._recording_memory:
            # from the run's first step to its end (a ring of the newest events), so that the
            # snapshot an OOM writes at any step holds the allocations that led to it; Python stacks
            # only: C++ ones cost far more per allocation
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS, stacks="python")
            self._recording_memory = True
        self.active = step in self.steps
        if self.active:
            self._current = step
            self._step_range = torch.profiler.record_function(PREFIX + "step")
            self._step_range.__enter__()

    def after_step(self, step: int, step_time: float) -> None:
        if self.prof is None:
            return
        if self.active:
            self.about["step_time"][str(step)] = step_time
            (self.dir / STEPS_FILE).write_text(json.dumps(self.about, indent=1))
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self.active and self._recording_memory:
            self._dump_memory(self.dir / f"memory_step{step}.pickle")
        self.active = False
        with quiet_kineto():
            self.prof.step()  # saves a traced step (on_trace_ready)
        if (step + 1) not in self.steps:  # the run of traced steps is over
            self._stop()

    def _start(self, warmup: bool, traced: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity

        def schedule(k: int) -> ProfilerAction:
            # k counts this profiler's steps: the warm-up step (when there is one), then the traced
            # ones, each saved on its own (RECORD_AND_SAVE twice in a row saves the first)
            k -= warmup
            if k < 0:
                return ProfilerAction.WARMUP
            return ProfilerAction.RECORD_AND_SAVE if k < traced else ProfilerAction.NONE

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=schedule,
            on_trace_ready=self._save,
            record_shapes=True,
            profile_memory=self.cfg.memory,
            with_stack=self.cfg.with_stack,
        )
        with quiet_kineto():
            self.prof.start()

    def _save(self, prof) -> None:
        path = self.dir / f"step{self._current}.trace.json.gz"
        prof.export_chrome_trace(str(path))
        if self.plugin_dir is not None:  # one run per step, one host per rank (its *.pt.trace.json.gz)
            link = self.plugin_dir / f"step{self._current}" / f"rank{self.rank}.pt.trace.json.gz"
            link.parent.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            try:
                os.link(path, link)
            except OSError:  # another file system, or no hard links: a copy
                shutil.copyfile(path, link)

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        if prof is not None:
            with quiet_kineto():
                prof.stop()

    # -- memory ---------------------------------------------------------------------------------
    def _dump_memory(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))

    def on_oom(self, step: int) -> None:
        """The snapshot a user needs is the one at the OOM: written before the run stops."""
        if not (self.cuda and self.cfg.memory):
            return
        path = self.dir / f"memory_step{step}_oom.pickle"
        try:
            self._dump_memory(path)
            log.error(
                "rank %d: out of memory at step %d; allocator snapshot %s (pytorch.org/memory_viz)", self.rank, step, path
            )
        except Exception as e:  # noqa: BLE001 - the OOM that ends the run matters more
            log.error("rank %d: out of memory; the snapshot failed: %s", self.rank, e)

    def close(self) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        self.active = False
        self._stop()
        if self._recording_memory:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording_memory = False
