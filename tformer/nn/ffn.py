"""Position-wise feed-forward networks: plain (ReLU / GELU) and gated (SwiGLU / GEGLU)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ACTIVATIONS, Activation, check_table
from .cast import autocast_input
from .rebuild import Rebuild


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")  # GPT-2 "gelu_new"


# Every activation of ModelConfig: (the function, whether the FFN is gated). A gated kind applies the
# function to the gate projection and multiplies by the up projection.
FFN_KINDS: dict[Activation, tuple[Callable[[torch.Tensor], torch.Tensor], bool]] = {
    "relu": (F.relu, False),
    "gelu": (F.gelu, False),  # exact erf form (BERT, HF "gelu")
    "gelu_tanh": (gelu_tanh, False),
    "silu": (F.silu, False),
    "swiglu": (F.silu, True),
    "geglu": (gelu_tanh, True),
    "geglu_exact": (F.gelu, True),  # ModernBERT
}
check_table(FFN_KINDS, Activation, "FFN_KINDS")


class FeedForward(nn.Module):
    """``down(act(up(x)))``, or for gated kinds ``down(act(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, d_ff: int, activation: Activation = "gelu", bias: bool = True, dropout: float = 0.0):
        super().__init__()
        if activation not in FFN_KINDS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {', '.join(ACTIVATIONS)}")
        self.act, self.gated = FFN_KINDS[activation]
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)
        # backward rebuilds the activation's output (and the gated product) from the tensors the
        # activation keeps anyway, instead of keeping them (nn/rebuild.py); False keeps them
        self.rebuild = activation != "relu"  # ReLU's backward needs its output: nothing to gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            x = autocast_input(x)  # gate and up keep one low-precision copy (nn/cast.py)
        if not (self.rebuild and torch.is_grad_enabled()) or torch.compiler.is_compiling():
            # (compiled: the partitioner already recomputes elementwise ops rather than keep them)
            h = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
            return self.dropout(self.down(h))
        with Rebuild() as rb:
            if self.gated:
                gate, up = self.gate(x), self.up(x)
                act = rb.keep(self.act(gate), self.act, gate)
                h = rb.keep(act * up, torch.mul, act, up)  # act: its own recipe, rebuilt once
            else:
                up = self.up(x)
                h = rb.keep(self.act(up), self.act, up)
            out = self.down(h)
        return self.dropout(out)

    def _gated(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up
