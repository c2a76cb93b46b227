"""Training FLOPs (forward + backward) of each family, attention included, for MFU.

Counts matrix multiplications only (2 FLOPs per multiply-add), the convention of
``torch.utils.flop_counter.FlopCounterMode`` and of MFU as usually reported. The backward pass costs
twice the forward (gradients for inputs and for weights). Causal attention is counted as full
S x S scores, as the dense kernels compute it.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..nn.ffn import FFN_KINDS


def _attention_flops(cfg: ModelConfig, q_tokens: int, kv_tokens: int, keys_per_query: int) -> int:
    """Forward FLOPs of one attention layer: projections of queries and keys/values, the two
    score matmuls (QK^T and PV) and the output projection."""
    d, h, hkv, dk = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    q_and_out = 2 * q_tokens * d * h * dk * 2
    kv = 2 * kv_tokens * d * hkv * dk * 2
    scores = 2 * q_tokens * keys_per_query * h * dk * 2
    return q_and_out + kv + scores


def _dense_ffn_flops(d_model: int, d_ff: int, activation, tokens: int) -> int:
    mats = 3 if FFN_KINDS[activation][1] else 2
    return 2 * tokens * d_model * d_ff * mats


def _ffn_flops(cfg: ModelConfig, tokens: int, layers: int) -> int:
    """Forward FLOPs of the FFNs of a stack of ``layers`` blocks. An MoE block counts what a token
    really computes (active FLOPs): the router, its top-k experts and the shared experts (under
    capacity routing a dropped assignment computes nothing; counted as computed, an upper bound)."""
    moe = cfg.moe
    dense = _dense_ffn_flops(cfg.d_model, cfg.d_ff, cfg.activation, tokens)
    n_moe = sum(moe.is_moe_layer(i) for i in range(layers))
    if not n_moe:
        return layers * dense
    kind, d_expert = moe.activation or cfg.activation, moe.d_expert or cfg.d_ff
    sparse = 2 * tokens * cfg.d_model * moe.num_experts + moe.top_k * _dense_ffn_flops(cfg.d_model, d_expert, kind, tokens)
    if moe.num_shared_experts:
        width = moe.num_shared_experts * (moe.d_shared or d_expert)
        sparse += _dense_ffn_flops(cfg.d_model, width, kind, tokens) + (2 * tokens * cfg.d_model if moe.shared_gate else 0)
    return (layers - n_moe) * dense + n_moe * sparse


def stack_flops(cfg: ModelConfig, tokens: int, seq_len: int, layers: int) -> int:
    """Forward FLOPs of a self-attention stack of ``layers`` blocks over ``tokens`` (``seq_len`` keys each)."""
    return layers * _attention_flops(cfg, tokens, tokens, seq_len) + _ffn_flops(cfg, tokens, layers)


def head_flops(cfg: ModelConfig, tokens: int) -> int:
    """Forward FLOPs of the vocabulary projection over ``tokens`` positions."""
    return 2 * tokens * cfg.d_model * cfg.padded_vocab_size


def forward_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward FLOPs for a batch; ``target_len`` is the decoder length of an encoder-decoder. Each
    family counts itself (``forward_flops`` of its model class, reached through its spec)."""
    from .spec import spec_of

    return spec_of(cfg).forward_flops(cfg, batch, seq_len, target_len)


def training_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward + backward FLOPs of one training micro-batch (backward = 2x forward)."""
    return 3 * forward_flops(cfg, batch, seq_len, target_len)


def training_flops_per_token(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> float:
    """Training FLOPs per token (per input token; encoder-decoder: per input + target token)."""
    from .spec import spec_of

    tokens = seq_len + ((target_len or 0) if spec_of(cfg).seq2seq else 0)
    return training_flops(cfg, 1, seq_len, target_len) / tokens
