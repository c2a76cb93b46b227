"""The optimizer step's two ways, and the helpers of the step's micro-batches.

Where the run need not decide on the host (``loop/figures.py``'s ``why_read_every_step`` is
None), the gradients are clipped and the update applied where the loss and the norm are finite,
all on the device: the step ends in a row of figures nobody waits for. Otherwise the figures,
the norm and a logging step's MoE table are read in one read, and the host decides.
"""

from __future__ import annotations

import math
from typing import Any, cast

import torch

from ...config import ConfigError
from ...parallel.strategy import StepResult, Strategy


def step_on_device(
    strategy: Strategy, optimizer: Any, scaler: Any, prof: Any, stats: torch.Tensor, clip: float
) -> torch.Tensor:
    """Clip, then update where the loss and the norm are finite, without the host: the step's row
    (loss sum, tokens, FLOPs, norm, ok) stays on the device."""
    with prof.range("optimizer"):
        norm = cast(Any, strategy).clip_for_step(optimizer, scaler, clip)
        ok = torch.isfinite(stats[0]) & torch.isfinite(norm)
        cast(Any, strategy).finish_step_on_device(optimizer, ok)
    return torch.cat([stats[:3], norm.detach().reshape(1).to(stats.dtype), ok.reshape(1).to(stats.dtype)])


def step_reading(
    strategy: Strategy,
    optimizer: Any,
    scaler: Any,
    prof: Any,
    stats: torch.Tensor,
    clip: float,
    table: Any,
    mean_loss: Any,
) -> tuple[list[float], bool, Any]:
    """The optimizer step where the host decides: the step's figures, the norm and a logging
    step's MoE figures read now, in one read. Returns the row (as a list), whether the engine must
    stop the run, and the table with its figures read."""
    clip_first = getattr(strategy, "clip_for_step", None)  # DeepSpeed's engine steps in one call
    stats = stats[:3]
    if clip_first is not None:
        # clipped on the device first, so that the norm joins the one read below
        with prof.range("optimizer"):
            norm = clip_first(optimizer, scaler, clip)
        stats = torch.cat([stats, norm.detach().reshape(1).to(stats.dtype)])
    fixed = len(stats)
    if table is not None:
        stats = torch.cat([stats, table[1].flatten().to(stats)])
    read = stats.tolist()
    loss_sum_all, tokens_all, flops_all, *norm_read = read[:fixed]
    if table is not None:
        table = (table[0], read[fixed:])
    loss = mean_loss(loss_sum_all)
    with prof.range("optimizer"):
        if clip_first is not None:
            ok = math.isfinite(loss) and math.isfinite(norm_read[0])
            applied = cast(Any, strategy).finish_step(optimizer, scaler, ok).applied
            result = StepResult(norm_read[0] if math.isfinite(loss) else float("nan"), applied)
        else:
            result = strategy.step(optimizer, scaler, clip, math.isfinite(loss))
    ok = result.applied and math.isfinite(loss) and not result.must_stop
    return [loss_sum_all, tokens_all, flops_all, result.grad_norm, float(ok)], result.must_stop, table


def _host_count(labels: torch.Tensor) -> int:
    """The labels set in a batch still in host memory (the loader's copy): no device involved."""
    return int(torch.count_nonzero(labels != -100))


def _concat(batches: list[dict]) -> dict:
    """One batch of the step's micro-batches, in order (the pipeline schedule splits it again)."""
    if len(batches) == 1:
        return batches[0]
    out = {}
    for k in batches[0]:
        parts = [b[k] for b in batches]
        width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
        if width is not None and any(p.shape[1] != width for p in parts):
            raise ConfigError(
                f"pipeline parallelism needs micro-batches of one sequence length ({k} has "
                f"lengths {[p.shape[1] for p in parts]}); use fixed-length batches"
            )
        out[k] = torch.cat(parts)
    return out
