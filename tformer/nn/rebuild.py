"""Saved tensors kept as the recipe that rebuilds them.

Autograd keeps every tensor an op needs for its backward. In a feed-forward network two of them are
cheap elementwise results of tensors that are kept anyway: the down projection keeps its input
``act(h)`` (or ``act(gate) * up``) for its weight gradient, while the activation already keeps
``h`` (``gate``), and the gated product keeps ``act(gate)`` next to ``gate``. ``Rebuild`` keeps the
recipe instead: when an op saves a registered tensor, its inputs are saved in its place and
backward recomputes it (elementwise and deterministic: bitwise the same gradients). That is a
quarter of what a GPT-2 block keeps and a third of a Llama block's, for one elementwise op per
backward.

A recipe's input may itself be a registered tensor (the gated product ``act * up`` from ``act``):
it is kept as its own recipe, one per tensor however many ops save it, and rebuilt once per
backward (the first op that needs it rebuilds it, the next reuses it while any op still holds it),
so a gated FFN's backward runs its activation once, not once per tensor rebuilt from it.

It composes with whatever saved-tensor hooks are already active (activation checkpointing, CPU
offload, memory probes): those see the recipe's inputs instead of the tensor. Tensor subclasses
(a tensor-parallel DTensor) are saved as they are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Recipe:
    __slots__ = ("fn", "inputs", "shape", "dtype", "value")

    def __init__(self, fn, inputs, shape, dtype):
        self.fn, self.inputs, self.shape, self.dtype = fn, inputs, shape, dtype
        self.value: torch.Tensor | None = None  # rebuilt once, while the recipe lives


class Rebuild:
    """Context manager for one forward: ``keep(t, fn, *inputs)`` registers ``t == fn(*inputs)``."""

    def __init__(self):
        self._recipes: dict[int, tuple[torch.Tensor, Callable, tuple]] = {}
        self._made: dict[int, _Recipe] = {}  # one recipe per registered tensor, however many ops save it
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self._outer_pack, self._outer_unpack = outer if outer is not None else (None, None)

    def keep(self, t: torch.Tensor, fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.is_contiguous():
            self._recipes[t.untyped_storage().data_ptr()] = (t, fn, inputs)
        return t

    def _save(self, t):
        return self._outer_pack(t) if self._outer_pack is not None else t

    def _load(self, packed):
        return self._outer_unpack(packed) if self._outer_unpack is not None else packed

    def _pack(self, t: torch.Tensor):
        if type(t) is torch.Tensor and t.is_contiguous() and t.storage_offset() == 0:
            ptr = t.untyped_storage().data_ptr()
            entry = self._recipes.get(ptr)
            if entry is not None and entry[0].numel() == t.numel() and entry[0].dtype == t.dtype:
                if ptr not in self._made:
                    _, fn, inputs = entry
                    self._made[ptr] = _Recipe(fn, tuple(self._pack(i) for i in inputs), t.shape, t.dtype)
                return self._made[ptr]
        return self._save(t)

    def _unpack(self, packed):
        if isinstance(packed, _Recipe):
            if packed.value is None:
                with torch.no_grad():
                    out = packed.fn(*(self._unpack(i) for i in packed.inputs))
                packed.value = out.to(packed.dtype).view(packed.shape)
            return packed.value
        return self._load(packed)

    def __enter__(self) -> Rebuild:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._recipes.clear()
        self._made.clear()
