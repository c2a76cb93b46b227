"""The trainer's features as components: small objects the loop calls at fixed points, in the order
of a list. A feature that is off is not in the list: it costs nothing and the loop has no branch
for it. CONTRIBUTING.md, "Adding a trainer feature", shows how to add one.

The points, in the order the loop reaches them (every hook is optional; :class:`Component` has
them all as no-ops, and :class:`Components` calls only the ones a component defines):

- ``before_step(step)``: step ``step`` is about to run (fault tolerance's quorum; the profiler);
- ``phase(step, name)``: the run enters a phase of its work ("data", "optimizer step", "save":
  the watchdog's beats);
- ``after_step(step, record, seconds)``: the step is taken; ``record`` holds its figures where the
  step read them (``loop/figures.py``), ``seconds`` its own time;
- ``at_log(record)``: a step due to be logged, on every rank (collectives allowed): add fields;
- ``log(record)``: write the record (the writers live on rank 0 only);
- ``end_step(step, record)``: the step's saving, evaluating and logging are done;
- ``moved(step)``: the run's position changed under the loop (healed from a peer, rolled back);
- ``on_error(step, error)``: the run fails in step ``step``;
- ``close()``: the run ends, either way.

``before_step`` and ``after_step`` answer :data:`MOVED` when the run's data position changed
(the loop reads its batches again from there) and ``after_step`` :data:`REWOUND` when the run went
back to a checkpoint (the step's record is logged as it is and the loop takes the next step).
The list runs from the component closest to the step to the outermost; ``close`` follows it, so
each feature is closed before those it runs inside (the profiler before the watchdog, the console
before the signal handlers).
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ...logs import interactive
from ...parallel.dist import DistInfo
from ..config import TrainConfig
from ..observe.console import METRICS, log_step
from ..observe.stragglers import StepTimes
from ..observe.tracking import Trackers
from ..observe.watchdog import Watchdog
from ..resilience import rollback
from ..resilience.ft import FaultTolerance, QuorumLost
from ..resilience.signals import install_stop_signals, restore_signals
from .figures import StepFigures

log = logging.getLogger("tformer.train")

MOVED = 1  # the run's data position changed: read the batches again from there
REWOUND = 2  # the run went back to a checkpoint: log the step's record as it is, take the next step

HOOKS = ("before_step", "phase", "after_step", "at_log", "log", "end_step", "moved", "on_error", "close")


class Component:
    """A feature of the training loop. Override the hooks it needs; the others are never called."""

    def before_step(self, step: int) -> int:
        return 0

    def phase(self, step: int, name: str) -> None:
        pass

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        return 0

    def at_log(self, record: dict) -> None:
        pass

    def log(self, record: dict) -> None:
        pass

    def end_step(self, step: int, record: dict) -> None:
        pass

    def moved(self, step: int) -> None:
        pass

    def on_error(self, step: int, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


class Components:
    """The run's components, in calling order. Each hook calls, in that order, only the components
    that define it (so a hook nobody defines costs nothing)."""

    def __init__(self, items: Iterable[Component] = ()):
        self.items = list(items)
        self._hooks: dict[str, list[Callable]] = {
            name: [getattr(c, name) for c in self.items if getattr(type(c), name) is not getattr(Component, name)]
            for name in HOOKS
        }

    def names(self) -> list[str]:
        return [type(c).__name__ for c in self.items]

    def before_step(self, step: int) -> int:
        return max([hook(step) for hook in self._hooks["before_step"]], default=0)

    def phase(self, step: int, name: str) -> None:
        for hook in self._hooks["phase"]:
            hook(step, name)

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        return max([hook(step, record, seconds) for hook in self._hooks["after_step"]], default=0)

    def at_log(self, record: dict) -> None:
        for hook in self._hooks["at_log"]:
            hook(record)

    def log(self, record: dict) -> None:
        for hook in self._hooks["log"]:
            hook(record)

    def end_step(self, step: int, record: dict) -> None:
        for hook in self._hooks["end_step"]:
            hook(step, record)

    def moved(self, step: int) -> None:
        for hook in self._hooks["moved"]:
            hook(step)

    def on_error(self, step: int, error: BaseException) -> None:
        for hook in self._hooks["on_error"]:
            hook(step, error)

    def close(self) -> None:
        for hook in self._hooks["close"]:
            hook()


class SingleGroup:
    """The replica group's side of the step when fault tolerance is off: one group, every step
    committed, no time spent on a quorum (``resilience/ft.py``'s ``FaultTolerance`` otherwise)."""

    quorum_s = 0.0

    def sync(
        self, model: torch.nn.Module, stats: torch.Tensor, counts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, bool]:
        return stats, True

    def note_committed_time(self, seconds: float) -> None:
        pass

    def record(self) -> dict:
        return {}


class FaultToleranceSteps(Component):
    """torchft's quorum before each step (healed from a peer: a new data position), a heal at a
    semi-synchronous sync after it; on a lost quorum the last committed step is saved by its writer
    group (``save_last``) before the error ends the run. Its vote sits inside the step (``sync``)."""

    def __init__(self, ft: FaultTolerance, save_last: Callable[[], None]):
        self.ft, self.save_last = ft, save_last

    def before_step(self, step: int) -> int:
        try:
            return MOVED if self.ft.start_step() else 0
        except QuorumLost:  # nothing lost: the last committed step is saved by its writer group
            self.save_last()
            raise

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        return MOVED if self.ft.take_healed() else 0  # local_sgd / diloco: healed at a sync

    def close(self) -> None:
        self.ft.shutdown()


class Profiling(Component):
    """The profiler of ``profile`` (``observe/profiling.py``): traces the steps it names, and on an
    out-of-memory error in a step, the memory snapshot with that step's number."""

    def __init__(self, profiler: Any):
        self.profiler = profiler

    def before_step(self, step: int) -> int:
        self.profiler.before_step(step)
        return 0

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        self.profiler.after_step(step, record["step_time"])
        return 0

    def on_error(self, step: int, error: BaseException) -> None:
        if isinstance(error, torch.OutOfMemoryError):
            self.profiler.on_oom(step)

    def close(self) -> None:
        self.profiler.close()


class WatchdogBeats(Component):
    """The watchdog (``watchdog_timeout``): a beat at each phase, armed after the first step; one
    warning when a step takes more than half the timeout."""

    def __init__(self, watchdog: Watchdog, timeout: float, is_main: bool):
        self.watchdog, self.timeout, self.is_main = watchdog, timeout, is_main
        self.warned = False

    def phase(self, step: int, name: str) -> None:
        self.watchdog.beat(step, name)

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        if not self.warned:
            self.warned = warn_short_timeout(self.timeout, step, seconds, self.is_main)
        return 0

    def end_step(self, step: int, record: dict) -> None:
        self.watchdog.beat(step, "train")
        if not self.watchdog._armed:
            self.watchdog.arm()

    def close(self) -> None:
        self.watchdog.close()


def warn_short_timeout(timeout: float, step: int, seconds: float, is_main: bool) -> bool:
    """One warning (rank 0) when step ``step`` (after the first) took more than half the watchdog's
    timeout: a slow step would be taken for a hang. True if it warned."""
    if step > 1 and seconds > timeout / 2 and is_main:
        log.warning(
            "watchdog_timeout=%g s is short: a step took %.1f s here; raise it to at least %d s, or "
            "a slow step will be taken for a hang",
            timeout,
            seconds,
            math.ceil(4 * seconds),
        )
        return True
    return False


class SpikeCheck(Component):
    """Loss spikes (``on_spike`` warn or rollback, ``resilience/rollback.py``): every loss read at
    this step is judged in step order (the earlier steps' too, read with it); a rollback rewinds
    the run to the checkpoint before the spike, whose record is then logged."""

    def __init__(self, run: rollback.RollbackState, figures: StepFigures):
        self.run, self.figures = run, figures

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        read = [*self.figures.replayed, record]
        spike = next((r for r in read if "loss" in r and rollback.handle_spike(self.run, r)), None)
        if spike is None:
            return 0
        record.update(spike)  # the interval's rates and memory are the read's (this step's)
        return REWOUND


class SlowRanks(Component):
    """Each rank's own step time and data wait; at a logging step, gathered from every rank: the
    slowest rank, named when it is ``slow_rank_factor`` x the median (``observe/stragglers.py``)."""

    def __init__(self, times: StepTimes, dist: DistInfo, factor: float):
        self.times, self.dist, self.factor = times, dist, factor

    def after_step(self, step: int, record: dict, seconds: float) -> int:
        self.times.step_done(seconds)
        return 0

    def at_log(self, record: dict) -> None:
        record.update(self.times.gather(self.dist, self.factor))  # every rank takes part


class Console(Component):
    """Rank 0's writers: ``metrics.jsonl``, the trackers (W&B, TensorBoard), the console line and
    the progress bar."""

    def __init__(self, cfg: TrainConfig, log_dir: Any, resolved: dict, wandb_id: str | None, step: int):
        self.tracker = Trackers(cfg, log_dir, resolved, wandb_id, step)
        self.run_id = self.tracker.run_id
        self.metrics = open(log_dir / METRICS, "a")
        self.bar = None
        if cfg.progress and interactive():
            from tqdm import tqdm

            self.bar = tqdm(
                total=cfg.max_steps, initial=step, unit="step", dynamic_ncols=True, file=sys.stderr, mininterval=1.0
            )

    def log(self, record: dict) -> None:
        log_step(record, self.metrics, self.tracker, self.bar)

    def end_step(self, step: int, record: dict) -> None:
        if self.bar is not None:
            self.bar.update(1)
            if "loss" in record:
                self.bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)

    def moved(self, step: int) -> None:
        if self.bar is not None:
            self.bar.n = step

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.metrics.close()
        self.tracker.finish()


class StopSignals(Component):
    """SIGTERM, SIGUSR1 and Ctrl-C end the run cleanly (``resilience/signals.py``): ``stop(name)``
    asks the loop to stop; the previous handlers come back at the end."""

    def __init__(self, stop: Callable[[str], None], announce: bool):
        self.previous = install_stop_signals(stop, announce)

    def close(self) -> None:
        restore_signals(self.previous)
