"""Forward FLOPs of the parts every family is built from: an attention layer, the FFNs of a stack
(an MoE block's active FLOPs), a self-attention stack, the vocabulary projection. Each family's
``forward_flops`` (``TformerModel`` and its subclasses) sums them; ``flops.py`` states the
conventions and gives the training FLOPs of any model."""

from __future__ import annotations

from ..config import ModelConfig
from ..nn.ffn import FFN_KINDS


def keys_per_query(cfg: ModelConfig, index: int | None, seq_len: int, causal: bool) -> int:
    """Keys each query of block ``index`` is counted against (None: a cross-attention, every key):
    the whole sequence on a global block; on a windowed one (``cfg.layer_window``) the keys its
    window holds, the band a block-sparse kernel computes: ``window`` causal (the keys up to and
    including the query), ``2 * (window // 2) + 1`` bidirectional, at most the sequence. A window's
    FLOPs grow with the window, not the sequence (the explicit-mask SDPA path executes the whole
    S x S nonetheless: more work done than counted)."""
    # a bidirectional stack's window is the encoder's own where set (T5Gemma's encoder_window)
    window = cfg.stack_config(causal).layer_window(index) if index is not None else None
    if window is None:
        return seq_len
    return min(seq_len, window if causal else 2 * (window // 2) + 1)


def attention_flops(cfg: ModelConfig, q_tokens: int, kv_tokens: int, keys_per_query: int, cross: bool = False) -> int:
    """Forward FLOPs of one attention layer: projections of queries and keys/values, the two
    score matmuls (QK^T and PV) and the output projection. Sinks (one logit per head) and
    soft-capping (a tanh per score) are elementwise: no matmul, not counted. ``cross``: a
    cross-attention, multi-head whatever the self-attention is (nn/block.py)."""
    if cfg.latent_attention and not cross:
        return latent_attention_flops(cfg, q_tokens, kv_tokens, keys_per_query)
    d, h, hkv, dk = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    q_and_out = 2 * q_tokens * d * h * dk * 2
    kv = 2 * kv_tokens * d * hkv * dk * 2
    scores = 2 * q_tokens * keys_per_query * h * dk * 2
    return q_and_out + kv + scores


def latent_attention_flops(cfg: ModelConfig, q_tokens: int, kv_tokens: int, keys_per_query: int) -> int:
    """Forward FLOPs of one multi-head latent attention layer (nn/latent.py): the query's down and
    up projections (or its one projection), the latent's down projection and its expansion to
    every head's key part and value, the scores over q/k heads of qk_nope + qk_rope and the
    values of v_head_dim, the output projection."""
    m, d, h = cfg.mla, cfg.d_model, cfg.num_heads
    qk = m.qk_head_dim
    q = 2 * q_tokens * (d * m.q_lora_rank + m.q_lora_rank * h * qk if m.q_lora_rank else d * h * qk)
    kv = (
        2
        * kv_tokens
        * (d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim))
    )
    scores = 2 * q_tokens * keys_per_query * h * (qk + m.v_head_dim)
    return q + kv + scores + 2 * q_tokens * h * m.v_head_dim * d


def denseffn_flops(d_model: int, d_ff: int, activation, tokens: int) -> int:
    mats = 3 if FFN_KINDS[activation][1] else 2
    return 2 * tokens * d_model * d_ff * mats


def ffn_flops(cfg: ModelConfig, tokens: int, layers: int | range) -> int:
    """Forward FLOPs of the FFNs of a stack of ``layers`` blocks (or of the blocks at these
    indices). An MoE block counts what a token really computes (active FLOPs): the router, its
    top-k experts and the shared experts (under capacity routing a dropped assignment computes
    nothing; counted as computed, an upper bound)."""
    moe = cfg.moe
    indices = layers if isinstance(layers, range) else range(layers)
    layers = len(indices)
    dense = denseffn_flops(cfg.d_model, cfg.d_ff, cfg.activation, tokens)
    n_moe = sum(moe.is_moe_layer(i) for i in indices)
    if not n_moe:
        return layers * dense
    kind, d_expert = moe.activation or cfg.activation, moe.d_expert or cfg.d_ff
    sparse = 2 * tokens * cfg.d_model * moe.num_experts + moe.top_k * denseffn_flops(cfg.d_model, d_expert, kind, tokens)
    if moe.num_shared_experts:
        width = moe.num_shared_experts * (moe.d_shared or d_expert)
        sparse += denseffn_flops(cfg.d_model, width, kind, tokens) + (2 * tokens * cfg.d_model if moe.shared_gate else 0)
    return (layers - n_moe) * dense + n_moe * sparse


def self_attention_flops(cfg: ModelConfig, tokens: int, seq_len: int, layers: int | range, causal: bool) -> int:
    """Forward FLOPs of the self-attention of ``layers`` blocks (or of the blocks at these indices)
    over ``tokens`` in sequences of ``seq_len``, each block against the keys its window holds."""
    indices = layers if isinstance(layers, range) else range(layers)
    return sum(attention_flops(cfg, tokens, tokens, keys_per_query(cfg, i, seq_len, causal)) for i in indices)


def stack_flops(cfg: ModelConfig, tokens: int, seq_len: int, layers: int, causal: bool = True) -> int:
    """Forward FLOPs of a self-attention stack of ``layers`` blocks over ``tokens`` (sequences of
    ``seq_len``; ``causal``: the stack's windows look back only)."""
    return self_attention_flops(cfg, tokens, seq_len, layers, causal) + ffn_flops(cfg, tokens, layers)


def head_flops(cfg: ModelConfig, tokens: int) -> int:
    """Forward FLOPs of the vocabulary projection over ``tokens`` positions."""
    return 2 * tokens * cfg.d_model * cfg.padded_vocab_size
