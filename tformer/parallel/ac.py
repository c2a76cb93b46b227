"""Activation checkpointing, switched on from outside the model.

``full`` recomputes every block in backward; ``selective`` every k-th block (``every=k``); ``op``
checkpoints every block op by op (torchtitan's "op-level selective" AC): backward keeps the outputs
of the expensive ops (matmuls, attention) and recomputes the cheap ones (norms, activations,
residual adds, dropout with the same masks: checkpointing restores the random state first). The
model keeps its parameter names (checkpoints and exporters are unaffected): each
``TransformerStack`` only learns which of its blocks to run under ``torch.utils.checkpoint``
(non-reentrant), each block (``op``) which ``context_fn`` to run under, so the gradients are the
same and only memory and time change.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from ..config import AC_MODES, ACMode
from ..nn import TransformerBlock, TransformerStack

_aten = torch.ops.aten
ATTENTION_OPS = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    if hasattr(_aten, name)
}
MATMUL_OPS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
SAVED_OPS = frozenset(MATMUL_OPS | ATTENTION_OPS)


def _dropout_p(func, args, kwargs) -> float:
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == "dropout_p":
            return kwargs.get("dropout_p", args[i] if i < len(args) else 0.0)
    return 0.0


def op_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Save matmul and attention outputs, recompute everything else. Attention with dropout is
    recomputed too: a saved op that draws random numbers would not draw them again in the
    recomputation, and every dropout after it would get another mask."""
    if func in ATTENTION_OPS and _dropout_p(func, args, kwargs) > 0:
        return CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def op_context(policy=op_policy):
    return functools.partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(model: nn.Module, mode: ACMode = "full", every: int = 1) -> int:
    """Mark blocks for recomputation; returns how many blocks were marked."""
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not allowed; use one of: {', '.join(AC_MODES)}")
    if every < 1:
        raise ValueError(f"activation checkpointing every={every} must be >= 1")
    step = 1 if mode == "full" else every
    marked = 0
    for stack in model.modules():
        if isinstance(stack, TransformerStack):
            chosen = (
                frozenset(
                    i
                    for i in range(step - 1, len(stack.layers), step)  # (a pipeline stage's
                    if isinstance(stack.layers[i], TransformerBlock)  # blocks only)
                )
                if mode in ("full", "selective")
                else frozenset()
            )
            stack.checkpointed = chosen
            marked += len(chosen)
    for block in model.modules():
        if isinstance(block, TransformerBlock):
            block.checkpoint_context = op_context() if mode == "op" else None
            marked += mode == "op"
    return marked
