"""The shared blocks, written once and used by every family."""

from .attention import KVCache, MultiHeadAttention, build_mask, math_attention
from .docmask import DocumentMask, positions_from_doc_ids
from .block import StackCache, TransformerBlock, TransformerStack
from .ffn import FeedForward
from .norm import LayerNorm, RMSNorm, make_norm, residual
from .position import (
    LearnedPositions,
    RelativePositionBias,
    Rotary,
    SinusoidalPositions,
    apply_rotary,
    relative_bucket,
    sinusoidal_table,
)

__all__ = [
    "KVCache",
    "MultiHeadAttention",
    "build_mask",
    "math_attention",
    "StackCache",
    "DocumentMask",
    "positions_from_doc_ids",
    "TransformerBlock",
    "TransformerStack",
    "FeedForward",
    "LayerNorm",
    "RMSNorm",
    "make_norm",
    "residual",
    "LearnedPositions",
    "RelativePositionBias",
    "Rotary",
    "SinusoidalPositions",
    "apply_rotary",
    "relative_bucket",
    "sinusoidal_table",
]
