"""Kimi K2's QK-clip (``optim.muon.qk_clip: TAU``): after each optimizer step, every attention head
whose largest pre-softmax logit of the step exceeded ``TAU`` has its query and key projections scaled
by ``gamma = TAU / max_logit``, so the same inputs would now peak at ``TAU``; other heads are left
exactly as they are (their factor is 1.0, and ``x * 1.0 == x``).

The model tracks each head's largest logit on the device (``MultiHeadAttention.max_logit``; model
code imports no ``torch.distributed``); here the maxima of all layers are max-reduced over the ranks
in one collective (each data-parallel rank saw other sequences) and the factors applied, all on the
device: no host read, whether a head was clipped or not. ``last_max`` keeps the step's largest
logit, on the device, for a logging step to read.

With as many key heads as query heads each projection takes ``sqrt(gamma)`` (Kimi's split); under
grouped-query attention a key head serves several query heads, so the query rows take all of
``gamma`` and the key rows none (the head's logits scale by ``gamma`` either way; its neighbours'
do not move). Biases of the projections are scaled with their rows (the logit is bilinear in the
projected ``q`` and ``k``; RoPE is linear).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..nn.attention import MultiHeadAttention


def _local_rows(factor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-row ``factor`` (out,) broadcast to parameter ``p`` (out, ...) as this rank holds it."""
    full = factor.view(-1, *([1] * (p.dim() - 1))).expand(p.shape)
    if isinstance(p, DTensor):
        return distribute_tensor(full.contiguous(), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


def _scale_rows(linear: nn.Linear, per_head: torch.Tensor, width: int) -> None:
    rows = per_head.repeat_interleave(width)
    for p in (linear.weight, linear.bias):
        if p is not None:
            w = p.to_local() if isinstance(p, DTensor) else p
            w.mul_(_local_rows(rows.to(w.dtype), p))


class QKClip:
    """The clip of every attention module of ``model`` at threshold ``tau``; call after each step."""

    def __init__(self, model: nn.Module, tau: float):
        self.tau = tau
        self.layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
        self.last_max: torch.Tensor | None = None
        for m in self.layers:
            m.max_logit = self._fresh(m)

    @staticmethod
    def _fresh(m: MultiHeadAttention) -> torch.Tensor:
        device = m.q_proj.weight.device
        return torch.full((m.num_heads,), float("-inf"), device=device)

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.layers:
            return
        maxima = torch.stack([m.max_logit for m in self.layers])  # type: ignore[misc]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        self.last_max = maxima.amax()
        gamma = torch.where(maxima > self.tau, self.tau / maxima, torch.ones_like(maxima))
        for m, g in zip(self.layers, gamma):
            if m.num_kv_heads == m.num_heads:
                _scale_rows(m.q_proj, g.sqrt(), m.d_k)
                _scale_rows(m.k_proj, g.sqrt(), m.d_k)
            else:
                _scale_rows(m.q_proj, g, m.d_k)
            m.max_logit = self._fresh(m)
