"""MoE routing statistics over a layout: the balancing and z-losses of whole sequences.

A MoE layer's balance loss ``E sum_e f_e P_e`` (``f_e`` the share of assignments to expert e, no
gradient; ``P_e`` its mean router probability) and its z-loss are computed over a group of
tokens, and the balance loss is not linear in them: the group is part of what is trained. It is
the micro-batch, its whole sequences, as one process sees it in one micro-step
(``nn/moe.py``). Two layouts change what a rank's layer sees of it:

- **context parallelism** cuts every sequence over the ``cp`` ranks (``context.py``): each holds
  two chunks of each sequence, so the group is split over the cp group;
- **padding**: context parallelism pads a sequence to ``2 cp`` chunks (times ``tp`` under sequence
  parallelism), and sequence parallelism pads it to a multiple of ``tp``. Both pads sit at the end
  of the sequence and are routed like any token.

``RoutingPool`` (one per MoE layer, set as ``pool_routing``) leaves the pad out of the sums the
losses are made of (``nn/moe.routing_sums``) and adds the sums of the cp ranks with an all-reduce
that autograd differentiates: its backward adds the ranks' gradients, so every cp rank's router
gets ``cp`` times its tokens' share of the one-process gradient, the same factor as its language
loss (``context.context_shard``: the cp ranks' losses add up to ``cp`` times the mean), and the
data-parallel average over ``dp x cp`` makes both the one-process gradient. Tensor parallelism
needs no sum: its MoE layers run on whole sequences on every TP rank (``tp.py``). Expert
parallelism routes each rank's own tokens and changes nothing here.

The real length of each stream of the micro-batch in flight (before any padding of the layout)
is set by the trainer through ``note_lengths``; with none set every token counts. Only training
forwards pool: evaluation runs whole sequences on every rank.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..nn.block import TransformerStack
from ..nn.moe import MoEFeedForward
from .context import held_chunks

__all__ = ["RoutingPool", "apply_routing_pools", "note_lengths"]


class RoutingPool:
    """``MoEFeedForward.pool_routing`` of one layer: the layer's tokens are this rank's part (two
    chunks of ``2 cp``; with ``cp`` 1 the whole) of each sequence of a stream whose real length is
    ``length``: the first of the batch fields ``streams`` that a micro-batch has sets it (the
    encoder's or a decoder-only model's ``input_ids``, an encoder-decoder's target sequence)."""

    def __init__(self, streams: tuple[str, ...], cp: int = 1, rank: int = 0, group=None) -> None:
        self.streams, self.cp, self.rank, self.group = streams, cp, rank, group
        self.length: int | None = None

    def real_tokens(self, length: int, device: torch.device) -> torch.Tensor | None:
        """(length,) 1.0 where this rank's part of a sequence holds a real token, 0.0 on the pad."""
        if self.length is None or self.length >= length * self.cp:
            return None
        real = torch.zeros(length, device=device)
        if self.cp == 1:
            real[: self.length] = 1.0
            return real
        chunk = length // 2
        for half, index in enumerate(held_chunks(self.rank, self.cp)):
            real[half * chunk : half * chunk + min(chunk, max(0, self.length - index * chunk))] = 1.0
        return real

    def __call__(self, sums: torch.Tensor) -> torch.Tensor:
        if self.cp == 1:
            return sums
        from torch.distributed._functional_collectives import all_reduce, wait_tensor

        # torch 2.13 registers autograd for the functional all-reduce: backward all-reduces the gradient
        return wait_tensor(all_reduce(sums, "sum", self.group))


def apply_routing_pools(model: nn.Module, cp_mesh=None) -> None:
    """Give every MoE layer of ``model`` a ``RoutingPool`` over ``cp_mesh`` (the run mesh's ``cp``;
    None: only a pad to leave out, under sequence parallelism)."""
    cp, rank, group = 1, 0, None
    if cp_mesh is not None:
        cp, rank, group = cp_mesh.size(), cp_mesh.get_local_rank(), cp_mesh.get_group()
    for stack in model.modules():
        if isinstance(stack, TransformerStack):
            # an encoder-decoder's decoder (the stack with cross-attention) runs on the target sequence
            cross = any(getattr(block, "cross_attn", None) is not None for block in stack.layers)
            for layer in stack.modules():
                if isinstance(layer, MoEFeedForward):
                    streams = ("decoder_input_ids", "labels") if cross else ("input_ids",)
                    layer.pool_routing = RoutingPool(streams, cp, rank, group)


def note_lengths(model: nn.Module, inputs: dict[str, torch.Tensor]) -> None:
    """Before the layout pads a training micro-batch: the real length of each stream, for the pools
    of ``model`` (found once per model)."""
    if model not in _POOLS:
        layers = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        _POOLS[model] = [m.pool_routing for m in layers if isinstance(m.pool_routing, RoutingPool)]
    for pool in _POOLS[model]:
        stream = next((inputs[k] for k in pool.streams if k in inputs), None)
        pool.length = stream.shape[1] if stream is not None else None


_POOLS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()
