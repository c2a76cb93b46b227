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
projected ``q`` and ``k``; RoPE is linear). Latent attention (MLA; Kimi K2's own case) splits a
head's logit into ``q_nope . k_nope + q_rope . k_rope``: the head's ``q_nope`` rows (of ``q_up`` or
``q_proj``) and ``k_nope`` rows (of ``kv_up``) take ``sqrt(gamma)``, its ``q_rope`` rows ``gamma``, and
the rotary key every head shares, none.

Every layout clips what one process clips. The maxima go into one (layers, heads) table of the whole
model, -inf where a rank holds nothing, and one MAX all-reduce over every rank fills it: under TP a
rank writes its heads' columns (its column-wise share of ``q_proj``), under a pipeline its stage's
rows (each layer by its name in the unsplit model, learned once at start), under context parallelism
each rank's queries count against every key of the sequence (the core's ``max_logits``). The factors
then reach each rank's rows of the projections through the parameters' own placements.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ..nn.attention import MultiHeadAttention
from ..nn.latent import LatentAttention
from .pipeline import Parts


def _local_rows(factor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Per-row ``factor`` (out,) broadcast to parameter ``p`` (out, ...) as this rank holds it."""
    full = factor.view(-1, *([1] * (p.dim() - 1))).expand(p.shape)
    if isinstance(p, DTensor):
        return distribute_tensor(full.contiguous(), p.device_mesh, p.placements, src_data_rank=None).to_local()
    return full


def _scale_rows(linear: nn.Linear, per_head: torch.Tensor, width: int) -> None:
    _scale_by_row(linear, per_head.repeat_interleave(width))


def _scale_by_row(linear: nn.Linear, factors: torch.Tensor) -> None:
    """Every output row of ``linear`` (weight and bias) times its factor (``factors`` flattened, one
    per row of the whole layer)."""
    rows = factors.reshape(-1)
    for p in (linear.weight, linear.bias):
        if p is not None:
            w = p.to_local() if isinstance(p, DTensor) else p
            w.mul_(_local_rows(rows.to(w.dtype), p))


def _unsplit_name(name: str) -> str:
    """A module's name in the unsplit model: without a pipeline's ``parts.N.`` prefix
    (``Parts.strip``) and the wrappers' own segments (activation checkpointing, compile)."""
    return ".".join(s for s in Parts.strip(name).split(".") if s not in ("_checkpoint_wrapped_module", "_orig_mod"))


def _query_rows(m: MultiHeadAttention | LatentAttention) -> nn.Linear:
    """The projection whose rows are ``m``'s query heads."""
    linear = m.q_proj if m.q_proj is not None else getattr(m, "q_up", None)
    assert linear is not None
    return linear


def _tp_share(m: MultiHeadAttention | LatentAttention) -> tuple[int, int]:
    """(this rank's place in the TP group, the group's size) of ``m``'s heads (0, 1 without TP)."""
    w = _query_rows(m).weight
    if isinstance(w, DTensor) and w.device_mesh.mesh_dim_names and "tp" in w.device_mesh.mesh_dim_names:
        return w.device_mesh.get_local_rank("tp"), w.device_mesh.size(w.device_mesh.mesh_dim_names.index("tp"))
    return 0, 1


class QKClip:
    """The clip of every attention module of ``model`` at threshold ``tau``; call after each step."""

    def __init__(self, model: nn.Module, tau: float):
        self.tau = tau
        kinds = (MultiHeadAttention, LatentAttention)
        named = [(_unsplit_name(n), m) for n, m in model.named_modules() if isinstance(m, kinds)]
        self.layers = [m for _, m in named]
        self.last_max: torch.Tensor | None = None
        self.shares = [_tp_share(m) for m in self.layers]
        # each layer's name and every head of it (a TP rank holds 1/size of them)
        heads = {n: m.num_heads * size for (n, m), (_, size) in zip(named, self.shares)}
        self.world = dist.is_initialized() and dist.get_world_size() > 1
        if self.world:  # a pipeline rank holds its stage's layers: the table names every rank's
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, heads)
            heads = {n: h for rank in every for n, h in rank.items()}
        row = {n: i for i, n in enumerate(sorted(heads))}
        self.rows = [row[n] for n, _ in named]
        self.shape = (len(heads), max(heads.values(), default=0))
        for m in self.layers:
            m.max_logit = self._fresh(m)

    @staticmethod
    def _fresh(m: MultiHeadAttention | LatentAttention) -> torch.Tensor:
        device = _query_rows(m).weight.device
        return torch.full((m.num_heads,), float("-inf"), device=device)

    @torch.no_grad()
    def __call__(self) -> None:
        if not self.shape[0]:
            return
        device = _query_rows(self.layers[0]).weight.device if self.layers else torch.device("cpu")
        table = torch.full(self.shape, float("-inf"), device=device)
        for m, row, (place, _) in zip(self.layers, self.rows, self.shares):
            n = m.num_heads  # this rank's heads: columns place * n onwards
            table[row, place * n : (place + 1) * n] = m.max_logit  # type: ignore[assignment]
        if self.world:
            dist.all_reduce(table, op=dist.ReduceOp.MAX)
        self.last_max = table.amax()
        gamma = torch.where(table > self.tau, self.tau / table, torch.ones_like(table))
        for m, row, (_, size) in zip(self.layers, self.rows, self.shares):
            g = gamma[row, : m.num_heads * size]  # every head of the layer: the rows' placements pick this rank's
            if isinstance(m, LatentAttention):
                root, heads = g.sqrt()[:, None], g.shape[0]
                _scale_by_row(_query_rows(m), torch.cat((root.expand(heads, m.nope), g[:, None].expand(heads, m.rope)), 1))
                _scale_by_row(m.kv_up, torch.cat((root.expand(heads, m.nope), g.new_ones(heads, m.d_v)), 1))
            elif m.num_kv_heads == m.num_heads:
                _scale_rows(m.q_proj, g.sqrt(), m.d_k)
                _scale_rows(m.k_proj, g.sqrt(), m.d_k)
            else:
                _scale_rows(m.q_proj, g, m.d_k)
            m.max_logit = self._fresh(m)
