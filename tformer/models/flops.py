"""Training FLOPs (forward + backward) of each family, attention included, for MFU.

Counts matrix multiplications only (2 FLOPs per multiply-add), the convention of
``torch.utils.flop_counter.FlopCounterMode`` and of MFU as usually reported. The backward pass costs
twice the forward (gradients for inputs and for weights). Causal attention is counted as full
S x S scores, as the dense kernels compute it; a windowed block (local attention) counts each query
against the keys of its window (``block_flops.keys_per_query``), so its attention FLOPs grow with
the window, not the sequence. Latent attention (MLA) counts its low-rank projections and its scores
at qk_nope + qk_rope width; each multi-token prediction depth its projection, block and the shared
head; sinks and soft-capping are elementwise (not counted). Each family counts itself (its model class's
``forward_flops``, from the parts in ``block_flops.py``), reached through its spec.
"""

from __future__ import annotations

from ..config import ModelConfig
from .spec import spec_of


def forward_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward FLOPs for a batch; ``target_len`` is the decoder length of an encoder-decoder. Each
    family counts itself (``forward_flops`` of its model class, reached through its spec)."""
    return spec_of(cfg).forward_flops(cfg, batch, seq_len, target_len)


def training_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward + backward FLOPs of one training micro-batch (backward = 2x forward)."""
    return 3 * forward_flops(cfg, batch, seq_len, target_len)


def training_flops_per_token(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> float:
    """Training FLOPs per token (per input token; encoder-decoder: per input + target token)."""
    tokens = seq_len + ((target_len or 0) if spec_of(cfg).seq2seq else 0)
    return training_flops(cfg, 1, seq_len, target_len) / tokens
