"""What moves between replica groups (resilience/ft.py): the gradients this rank averages with
the other groups (local shards), a peer's state made this rank's when a group heals (local shards
back into DTensors), and streaming DiLoCo's fragments of the model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ...config import ConfigError


def grads_of(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradients this rank holds, as plain tensors: an FSDP2 / TP parameter's local shard."""
    out = []
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad
        out.append(g.to_local() if hasattr(g, "to_local") else g)
    return out


def _local_tensors(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by its local shard."""
    if isinstance(tree, dict):
        return {k: _local_tensors(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_local_tensors(v) for v in tree)
    return tree.to_local() if hasattr(tree, "to_local") else tree


def _shard_like(local: torch.Tensor, own: Any) -> Any:
    """``local`` (a shard sent by the peer) made a DTensor on the mesh and placements of ``own``,
    this rank's tensor in that place, when ``own`` is one; else ``local`` itself."""
    if not hasattr(own, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(own.device), own.device_mesh, own.placements, shape=own.shape, stride=own.stride())


def _optimizer_like(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """An optimizer state dict of local shards with each per-element state (Adam's moments) made a
    DTensor like its parameter: this rank's own optimizer may hold no state yet to copy from."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    out = dict(state)
    out["state"] = {
        i: {k: _shard_like(v, params[i]) if isinstance(v, torch.Tensor) and v.dim() > 0 else v for k, v in st.items()}
        for i, st in state["state"].items()
    }
    return out


class _Fragment(torch.nn.Module):
    """A slice of the model for streaming DiLoCo: some blocks, and (the first) the parameters
    outside every block. It holds the model's own modules and parameters, not copies."""

    def __init__(self, blocks: Sequence[torch.nn.Module], rest: Sequence[torch.nn.Parameter]):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.rest = torch.nn.ParameterList(rest)


def model_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """``n`` fragments of contiguous transformer blocks (the whole model when ``n`` is 1)."""
    if n == 1:
        return [model]
    from ...nn import TransformerBlock

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    if len(blocks) < n:
        raise ConfigError(
            f"fault_tolerance.fragments={n} exceeds the model's {len(blocks)} blocks; use at most {len(blocks)}"
        )
    inside = {id(p) for b in blocks for p in b.parameters()}
    rest = [p for p in model.parameters() if id(p) not in inside]
    cuts = [round(i * len(blocks) / n) for i in range(n + 1)]
    return [_Fragment(blocks[cuts[i] : cuts[i + 1]], rest if i == 0 else []) for i in range(n)]
