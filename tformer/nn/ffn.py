"""Position-wise feed-forward networks: plain (ReLU / GELU) and gated (SwiGLU / GEGLU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact erf form (BERT, HF "gelu")
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2 "gelu_new"
    "silu": F.silu,
}
GATED = {"swiglu": "silu", "geglu": "gelu_tanh"}
FFN_KINDS = tuple(ACTIVATIONS) + tuple(GATED)


class FeedForward(nn.Module):
    """``down(act(up(x)))``, or for gated kinds ``down(act(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "gelu", bias: bool = True,
                 dropout: float = 0.0):
        super().__init__()
        if activation not in FFN_KINDS:
            raise ValueError(f"unknown activation {activation!r}; allowed: {', '.join(FFN_KINDS)}")
        self.gated = activation in GATED
        self.act = ACTIVATIONS[GATED.get(activation, activation)]
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if self.gated else None
        self.up = nn.Linear(d_model, d_ff, bias=bias)
        self.down = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.gate(x)) * self.up(x) if self.gated else self.act(self.up(x))
        return self.dropout(self.down(h))
