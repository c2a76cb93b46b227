"""Activation checkpointing, switched on from outside the model.

``full`` recomputes every block in backward; ``selective`` every k-th block (``every=k``). The
model keeps its parameter names (checkpoints and exporters are unaffected): each
``TransformerStack`` only learns which of its blocks to run under ``torch.utils.checkpoint``
(non-reentrant), so the gradients are the same and only memory and time change.
"""
from __future__ import annotations

from torch import nn

from ..nn import TransformerStack

AC_MODES = ("none", "full", "selective")


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", every: int = 1) -> int:
    """Mark blocks for recomputation; returns how many blocks were marked."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not allowed; use one of: "
                         f"{', '.join(AC_MODES)}")
    if every < 1:
        raise ValueError(f"activation checkpointing every={every} must be >= 1")
    step = 1 if mode == "full" else every
    marked = 0
    for stack in model.modules():
        if isinstance(stack, TransformerStack):
            chosen = frozenset(range(step - 1, len(stack.layers), step)) if mode != "none" else frozenset()
            stack.checkpointed = chosen
            marked += len(chosen)
    return marked
