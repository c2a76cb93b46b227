"""The step's figures: what a step leaves on the device, when the host reads it, and what the host
does with it once read.

A step ends with one row on the device (``ROW``: its loss summed over the ranks, tokens, model
FLOPs, gradient norm, and whether its update was applied), and a logging step of an MoE model with
its routing table. Nothing is read while the run need not decide anything: the rows wait in
:class:`StepFigures` until a step that logs, saves, evaluates, is traced or stops reads them all in
one transfer. The read replays them in step order through the non-finite accounting
(:class:`Streak`, which may stop the run naming the step it happened at) and gives back one record
a step; the trainer's components (the spike check among them) then see those records in order.

Some runs must decide on the host at every step (the reason, :func:`why_read_every_step`): their
rows are read at once, in the step, and arrive here as lists.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ...models.figures import model_figures
from ...parallel.mesh import ParallelDims
from ...parallel.strategy import skips_on_device
from ..config import TrainConfig

log = logging.getLogger("tformer.train")

ROW = ("loss_sum", "tokens", "flops", "grad_norm", "ok")  # a step's figures on the device, in order


class NonFiniteLoss(RuntimeError):
    """The run stopped on a non-finite loss (``on_nonfinite: stop``)."""


@dataclasses.dataclass
class Unread:
    """A step whose figures are still on the device (``row``: loss sum, tokens, FLOPs, norm, ok),
    or were read at once (a list)."""

    step: int
    lr: float
    row: torch.Tensor | list[float]
    table: Any  # a logging step's model figures (MoE routing, mtp_loss): (keys, tensor or list)
    must_stop: bool


def why_read_every_step(strategy: Any, optimizer: Any, scaler: Any, cfg: TrainConfig, replicas: bool) -> str | None:
    """Why this run reads its figures from the device at every step; None where a step that does
    not log or save reads nothing (the skip of a non-finite step decided on the device).
    ``replicas``: fault tolerance's commit vote is on."""
    if not hasattr(strategy, "clip_for_step"):
        return "DeepSpeed's engine decides a non-finite step's skip in its own step"
    if replicas:
        return "torchft's commit vote is taken on the host"
    if scaler is not None:
        return "fp16's GradScaler reads its overflow flag"
    if not skips_on_device(optimizer, scaler):
        if cfg.optim.fused is False:
            return "optim.fused=false: a non-finite step's skip is decided on the host"
        return (
            "this layout holds plain and DTensor parameters side by side: they take the foreach AdamW, "
            "which cannot skip a non-finite step on the device"
        )
    if cfg.max_tokens is not None:
        return "max_tokens stops at the step's global token count"
    return None


class Streak:
    """The non-finite accounting: the streak of skipped steps, or the stop.

    ``last_good`` names the checkpoint a stopped run points at (rollback.py's ``last_good``)."""

    def __init__(self, cfg: TrainConfig, is_main: bool, last_good: Callable[[], Path | None]):
        self.cfg, self.is_main, self.last_good = cfg, is_main, last_good
        self.skipped = 0  # consecutive non-finite steps
        self.start: int | None = None  # first step of the current streak

    def good(self) -> None:
        self.skipped, self.start = 0, None

    def bad(self, step: int, loss: float, grad_norm: float, must_stop: bool = False) -> None:
        """Step ``step``'s update was skipped (a non-finite loss or gradient norm): count the
        streak, or stop the run (``on_nonfinite: stop``, the streak too long, or an engine that
        could not skip). Where the skip is decided on the device this runs when the step's figures
        are read (at the next logging or saving step), so a stop comes up to ``log_every`` steps
        late; the skipped steps changed nothing and no checkpoint is written in a streak."""
        what = f"loss={loss}" if not math.isfinite(loss) else f"grad_norm={grad_norm}"
        self.skipped += 1
        if self.start is None:
            self.start = step
        cfg = self.cfg
        if must_stop or cfg.on_nonfinite == "stop" or self.skipped > cfg.max_skipped_steps:
            last = self.last_good()
            why = (
                "the engine could not skip it"
                if must_stop
                else f"on_nonfinite={cfg.on_nonfinite}, {self.skipped} bad step(s) in a row"
            )
            raise NonFiniteLoss(
                f"non-finite {what} at step {step}; stopping ({why}); the last good "
                f"checkpoint is {last or 'none'}; lower optim.lr or check the data"
            )
        if self.is_main:
            log.warning("step %d: non-finite %s; update skipped (%d in a row)", step, what, self.skipped)

    def allows_checkpoint(self, step: int) -> bool:
        """No checkpoint while the run is in a non-finite streak: it would be offered to resume
        from although its weights may be what makes the loss non-finite."""
        if self.skipped == 0:
            return True
        if self.is_main:
            log.warning(
                "step %d: checkpoint not written: the loss is non-finite since step %d; the newest good checkpoint is %s",
                step,
                self.start,
                self.last_good() or "none",
            )
        return False


class StepFigures:
    """The steps not read yet, the one read that brings them to the host, and the logging
    interval's rates (only an interval that ends in a read has a true wall time)."""

    def __init__(
        self,
        cfg: TrainConfig,
        dims: ParallelDims,
        world_size: int,
        peak: float,
        streak: Streak,
        raise_peak: Callable[[float], float] | None = None,
    ):
        """``peak``: the device's FLOP/s that MFU is over; ``raise_peak(achieved)``, where given, the
        peak after an interval that ran faster than it (a CPU's measured peak: MFU stays <= 100%)."""
        self.cfg, self.world_size, self.peak, self.streak = cfg, world_size, peak, streak
        self.raise_peak = raise_peak
        self.group = dims.tp * dims.pp * dims.cp  # each rank of a tp / pp / cp group counted its group's batch
        self.loss_ranks = world_size // dims.pp  # the tp ranks of a group agree; only a pipeline's last stage holds the loss
        self.reason: str | None = None  # why every step reads (why_read_every_step); None: only the steps below
        self.unread: list[Unread] = []
        self.replayed: list[dict] = []  # the records read with the last step's, before it
        # since the last logged step: seconds inside steps, global tokens, model FLOPs, steps
        self.window: list[float] = [0.0, 0, 0.0, 0]

    def mean_loss(self, loss_sum: float) -> float:
        """The step's loss from its sum over the ranks."""
        return loss_sum / self.loss_ranks

    def logs_at(self, step: int) -> bool:
        """Whether ``step`` is a logging step: every ``log_every``-th and the last."""
        return step % self.cfg.log_every == 0 or step >= self.cfg.max_steps

    def reads_at(self, step: int, traced: bool = False, stopping: bool = False) -> bool:
        """Whether ``step`` reads the figures: it logs, saves, evaluates, is traced (its time in
        ``steps.json`` is then the device's too) or stops; or the run reads every step."""
        cfg = self.cfg
        return (
            self.reason is not None
            or self.logs_at(step)
            or traced
            or stopping
            or bool(cfg.save_every and step % cfg.save_every == 0)
            or bool(cfg.eval_every and step % cfg.eval_every == 0)
        )

    def read(self, tokens: int) -> tuple[list[dict], int]:
        """The records of the steps not read yet, in order, from one read of the device, and the
        run's token count after them; their losses and norms replayed through the non-finite
        accounting (which may stop the run here, naming the step it happened at)."""
        unread, self.unread = self.unread, []
        on_device = [u.row for u in unread if isinstance(u.row, torch.Tensor)]
        values: list[float] = []
        if on_device:
            rows = torch.stack(on_device).flatten()
            tables = [u.table[1].flatten().to(rows) for u in unread if u.table is not None and torch.is_tensor(u.table[1])]
            values = torch.cat([rows, *tables]).tolist()
        width, at = len(ROW), 0
        tables_at = width * len(on_device)
        records = []
        for u in unread:
            if isinstance(u.row, torch.Tensor):
                row, at = values[at : at + width], at + width
            else:
                row = u.row
            loss_sum_all, tokens_all, flops_all, norm, ok = row
            loss = self.mean_loss(loss_sum_all)
            global_tokens = int(tokens_all) // self.group
            tokens += global_tokens
            # the model FLOPs of the step are sum / (tp pp cp), shared by all world_size devices
            self.window[1] += global_tokens
            self.window[2] += flops_all / self.group
            if ok > 0:
                self.streak.good()
            else:
                self.streak.bad(u.step, loss, norm, u.must_stop)
            record = {"step": u.step, "loss": loss, "lr": u.lr, "grad_norm": norm, "tokens": tokens}
            if u.table is not None:
                keys, figures = u.table
                if isinstance(figures, torch.Tensor):
                    n = figures.numel()
                    figures, tables_at = values[tables_at : tables_at + n], tables_at + n
                # of this rank's last micro-batch: routing (balance / z-loss, max/mean tokens per
                # expert, dropped share), mtp_loss (read at a logging step only)
                record.update(model_figures(keys, figures))
            records.append(record)
        return records, tokens

    def add(self, unread: Unread, tokens: int, read: bool) -> int:
        """The step just taken, and the run's token count; with ``read``, the figures of every
        step since the last read come to the host now (into ``replayed``, this step's last)."""
        self.unread.append(unread)
        self.replayed = []
        if read:
            self.replayed, tokens = self.read(tokens)
        return tokens

    def record(self, step: int, lr: float, seconds: float, fields: dict) -> dict:
        """Step ``step``'s record (``seconds`` inside it, ``fields`` of its own: memory, fault
        tolerance); where it read, its loss, norm and count, and the rates over the interval since
        the last logged step. The earlier steps' records read with it stay in ``replayed``."""
        window = self.window
        window[0] += seconds
        window[3] += 1
        record = {"step": step, "lr": lr, "step_time": seconds, **fields}
        if self.replayed:
            seconds_in, window_tokens, window_flops, steps_in = window
            record.update(self.replayed.pop())
            achieved = window_flops / self.world_size / seconds_in
            if achieved > self.peak and self.raise_peak is not None:
                self.peak = self.raise_peak(achieved)
            record.update(
                tokens_per_s=window_tokens / seconds_in,
                mfu=achieved / self.peak,
                step_time=seconds_in / steps_in,
            )
            if self.logs_at(step):
                self.window = [0.0, 0, 0.0, 0]
        return record


def on_device(values: list[float], device: torch.device) -> torch.Tensor:
    """Host figures on the device without waiting for it: a blocking copy to a CUDA device
    synchronises its stream (the host would wait for the step queued so far); from pinned memory
    the copy is queued like a kernel."""
    host = torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda")
    return host if device.type == "cpu" else host.to(device, non_blocking=True)
