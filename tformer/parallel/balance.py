"""Auxiliary-loss-free expert balancing (DeepSeek-V3): after every optimizer step, each MoE layer's
``score_bias`` moves by ``+-model.moe.bias_update_rate`` towards even loads.

The model counts its own expert assignments (``MoEFeedForward.load``, per rank); the sum over every
rank that routes tokens for the same layers is taken here, outside the model files, so that every
rank (and every layout of the same global batch) applies the same update. The sum runs over all
ranks of this rank's pipeline stage: data-parallel, expert- and context-parallel ranks hold
different tokens and must add up; tensor-parallel ranks may hold the same ones, which multiplies
every load by the same factor and leaves the update (a sign) unchanged. Loads are integer counts
in fp32: their sum is exact in any order, so the bias is bitwise the same on every rank and layout.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ..nn.moe import moe_layers, update_score_bias


class LoadBalancer:
    """Call ``after_step()`` once after each optimizer step; or, where the loads must join another
    reduction first (the trainer's, across fault-tolerant replica groups), ``loads()`` before it
    and ``apply(loads)`` after the step (not at all for a step that was not taken)."""

    def __init__(self, model: nn.Module | list, rate: float, group: Any = None, reduce: bool = False) -> None:
        modules = model if isinstance(model, (list, tuple)) else [model]
        self.layers = [m for mod in modules for m in moe_layers(mod) if m.score_bias is not None]
        self.rate, self.group, self.reduce = rate, group, reduce

    @classmethod
    def of(cls, model: nn.Module | list, moe_cfg: Any, dist_info: Any) -> LoadBalancer | None:
        """The balancer of a run, or None where nothing is balanced (no sigmoid routing, or rate 0)."""
        if not moe_cfg.score_bias or moe_cfg.bias_update_rate <= 0:
            return None
        reduce = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        group = stage_group(dist_info.dims) if reduce else None
        return cls(model, moe_cfg.bias_update_rate, group, reduce)

    def biases(self) -> list[torch.Tensor]:
        """The layers' bias buffers, read now (a load or a move may have replaced them)."""
        return [cast(torch.Tensor, m.score_bias) for m in self.layers]

    def loads(self) -> torch.Tensor:
        """(layers, experts) assignments since the last update, summed over this stage's ranks."""
        rows = []
        for m, bias in zip(self.layers, self.biases()):
            rows.append(m.load if m.load is not None else bias.new_zeros(bias.shape))
            m.load = None
        loads = torch.stack(rows)
        if self.reduce:
            dist.all_reduce(loads, group=self.group)
        return loads

    def apply(self, loads: torch.Tensor) -> None:
        """Move each layer's bias by ``+-rate`` from its row of ``loads`` (``loads()``'s shape)."""
        for bias, load in zip(self.biases(), loads):
            update_score_bias(bias, load, self.rate)

    def after_step(self) -> None:
        if self.layers:
            self.apply(self.loads())


def stage_group(dims: Any) -> Any:
    """The process group of the ranks of this rank's pipeline stage (None: the whole world). The
    pipeline dimension is the mesh's outermost, so a stage's ranks are one contiguous block."""
    pp = getattr(dims, "pp", 1) if dims is not None else 1
    if pp == 1:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    per_stage = world // pp
    mine = None
    for s in range(pp):  # every rank creates every group, in the same order
        group = dist.new_group(list(range(s * per_stage, (s + 1) * per_stage)))
        if rank // per_stage == s:
            mine = group
    return mine
