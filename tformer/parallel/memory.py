"""Measured memory by tensor bytes (not process RSS, which on CPU is allocator behaviour):
model states held by a rank, and the activations autograd saves during a forward pass."""
from __future__ import annotations

import torch


def _storages(obj, seen: dict, depth: int = 0) -> None:
    """Collect the storages of every tensor reachable from ``obj`` (dicts, lists, attributes)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, "to_local"):  # DTensor: this rank's shard
            obj = obj.to_local()
        for t in (obj, getattr(obj, "grad", None), getattr(obj, "ds_tensor", None)):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                if s.nbytes():
                    seen[s.data_ptr()] = s.nbytes()
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _storages(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _storages(v, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.nn.Module, type)):
        for v in vars(obj).values():
            _storages(v, seen, depth + 1)


def model_state_bytes(model: torch.nn.Module, optimizer) -> int:
    """Bytes of parameters, gradients and optimizer states this rank holds (shared storage once).
    Walks the optimizer object too, so DeepSpeed's fp32 master partitions and flat buffers count."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        _storages(p, seen)
    _storages(optimizer, seen)
    inner = getattr(optimizer, "optimizer", None)
    if inner is not None:
        _storages(inner.state, seen)
    return sum(seen.values())


class SavedActivations:
    """Context manager counting the bytes autograd saves for backward (unique storages)."""

    def __init__(self):
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter) and t.device.type != "meta":
            s = t.untyped_storage()
            self.storages[s.data_ptr()] = s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())
