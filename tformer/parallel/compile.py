"""Per-block ``torch.compile``: each transformer block is compiled on its own, which keeps graphs
small and (unlike whole-model compile) composes with per-block sharding wrappers."""

from __future__ import annotations

import torch

from ..nn import TransformerBlock, TransformerStack


def compile_blocks(model: torch.nn.Module, **options) -> torch.nn.Module:
    for module in model.modules():
        if isinstance(module, TransformerStack):
            for block in module.layers:
                if isinstance(block, TransformerBlock):  # not another pipeline stage's placeholder
                    block.compile(**options)  # in place: parameter names stay as they are
    return model
