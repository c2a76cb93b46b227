"""``torch.compile`` from outside the model, in place (parameter names stay as they are).

- ``compile=true``: every transformer block on its own (small graphs; composes with per-block
  sharding wrappers: FSDP2, TP, activation checkpointing), and the output head with its loss
  (``_head_and_lm_loss``) as one more graph where the head is whole (tp = 1, no pipeline): on a GPU
  the chunked loss's loop would otherwise launch a handful of small kernels per chunk from Python.
- ``compile=model``: the whole model as one graph (HF's way); one device or DDP only, since whole-
  model compile graph-breaks in FSDP2's hooks (the trainer refuses the other layouts in one line).

Either way the forward of every dense family has no graph break under bf16 autocast
(tests/test_compile.py): BERT's labelled positions (boolean indexing) have a data-dependent count,
which dynamo traces once ``capture_dynamic_output_shape_ops`` is on; the chunked loss skips its
host-side shortcut while compiling (``models/loss.py``). So does a mixture-of-experts model under
bf16 autocast (tests/test_compile.py, the four routed presets): its counts have a fixed shape
(``nn.moe.expert_counts``) and its experts run one ``torch._grouped_mm`` in the autocast dtype,
which inductor lowers. In fp32 (torch 2.13's meta kernel of ``_grouped_mm`` takes bf16 only) the
experts loop over data-dependent slices instead, which inductor cannot lower: a graph break there.
"""

from __future__ import annotations

from typing import Any

import torch

from ..nn import TransformerBlock, TransformerStack
from ..nn.moe import moe_layers


def allow_dynamic_shapes(model: torch.nn.Module | None = None) -> None:
    """Let dynamo trace ops whose output shape depends on the data (BERT's labelled rows), except in
    a mixture-of-experts model: where its experts loop over data-dependent slices (fp32, see the
    module doc) inductor (torch 2.13) cannot lower them, so there they stay a graph break. A
    process-wide setting, set for the model being compiled."""
    dense = model is None or not moe_layers(model)
    torch._dynamo.config.capture_dynamic_output_shape_ops = dense
    torch._dynamo.config.capture_scalar_outputs = dense


def compile_blocks(model: torch.nn.Module, **options) -> torch.nn.Module:
    allow_dynamic_shapes(model)
    for module in model.modules():
        if isinstance(module, TransformerStack):
            for block in module.layers:
                if isinstance(block, TransformerBlock):  # not another pipeline stage's placeholder
                    block.compile(**options)  # in place: parameter names stay as they are
    return model


def compile_head(model: torch.nn.Module, **options) -> torch.nn.Module:
    """The head and loss of the training step (``_head_and_lm_loss``, a method of every family) as
    a compiled function, set on this model only."""
    allow_dynamic_shapes(model)
    head: Any = model._head_and_lm_loss
    model._head_and_lm_loss = torch.compile(head, **options)  # type: ignore[assignment]
    return model


def compile_model(model: torch.nn.Module, **options) -> torch.nn.Module:
    allow_dynamic_shapes(model)
    model.compile(**options)  # in place: nn.Module.compile keeps the parameter names
    return model
