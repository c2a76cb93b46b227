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


def _ffn_flops(cfg: ModelConfig, tokens: int) -> int:
    mats = 3 if FFN_KINDS[cfg.activation][1] else 2
    return 2 * tokens * cfg.d_model * cfg.d_ff * mats


def forward_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward FLOPs for a batch; ``target_len`` is the decoder length of an encoder-decoder."""
    vocab = cfg.padded_vocab_size
    tokens = batch * seq_len
    layer = _attention_flops(cfg, tokens, tokens, seq_len) + _ffn_flops(cfg, tokens)
    if cfg.family == "encoder":
        head = 2 * tokens * cfg.d_model * cfg.d_model + 2 * tokens * cfg.d_model * vocab
        return cfg.num_layers * layer + head
    if cfg.family == "decoder":
        return cfg.num_layers * layer + 2 * tokens * cfg.d_model * vocab
    if target_len is None:
        raise ValueError("encoder-decoder FLOPs need target_len (the decoder sequence length)")
    t_tokens = batch * target_len
    dec_layer = (
        _attention_flops(cfg, t_tokens, t_tokens, target_len)
        + _attention_flops(cfg, t_tokens, tokens, seq_len)
        + _ffn_flops(cfg, t_tokens)
    )
    return cfg.num_layers * layer + cfg.decoder_layers * dec_layer + 2 * t_tokens * cfg.d_model * vocab


def training_flops(cfg: ModelConfig, batch: int, seq_len: int, target_len: int | None = None) -> int:
    """Forward + backward FLOPs of one training micro-batch (backward = 2x forward)."""
    return 3 * forward_flops(cfg, batch, seq_len, target_len)


def training_flops_per_token(cfg: ModelConfig, seq_len: int, target_len: int | None = None) -> float:
    """Training FLOPs per token (per input token; encoder-decoder: per input + target token)."""
    tokens = seq_len + ((target_len or 0) if cfg.family == "encdec" else 0)
    return training_flops(cfg, 1, seq_len, target_len) / tokens
