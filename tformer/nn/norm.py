"""Normalisation layers and the residual wiring that places them (pre-norm or post-norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import NORMS, Norm


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (Llama-era models drop it; GPT-2 and BERT keep it)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (T5, Llama): no mean subtraction, no bias, statistics in fp32.
    ``unit_offset`` (Gemma): the gain is ``1 + weight``, the weight stored (and starting) at 0."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the activation dtype, as T5 and Llama do; the result returns
        # to the input dtype before the gain so bf16 activations stay bf16.
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.unit_offset:  # Gemma applies 1 + weight in fp32 and casts after
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        return normed.to(x.dtype) * self.weight.to(x.dtype)


def make_norm(kind: Norm, dim: int, eps: float, bias: bool = True, unit_offset: bool = False) -> nn.Module:
    if kind == "layernorm":
        return LayerNorm(dim, eps, bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, unit_offset)
    raise ValueError(f"unknown norm {kind!r}; use {' or '.join(repr(n) for n in NORMS)}")


def residual(x: torch.Tensor, norm: nn.Module, sublayer, pre_norm: bool, post: nn.Module | None = None) -> torch.Tensor:
    """One residual sub-layer.

    pre-norm (GPT-2, Llama, T5): ``x + f(norm(x))``; with a ``post`` norm too (a sandwich, Gemma
    2/3): ``x + post(f(norm(x)))``; post-norm (the original paper, BERT): ``norm(x + f(x))``.
    """
    if pre_norm:
        out = sublayer(norm(x))
        return x + (out if post is None else post(out))
    return norm(x + sublayer(x))
