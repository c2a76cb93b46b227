"""The KV cache of generation, for ``tformer plan``: what each decoder layer keeps per token.

Multi-head and grouped-query attention cache every layer's keys and values, ``2 x kv_heads x
head_dim`` values per token; latent attention (MLA) caches its normed latent and its rotary key,
``kv_lora_rank + qk_rope_head_dim`` (``nn.latent.cache_values_per_token``), and expands them at
each step. A windowed layer's cache is counted whole (generation keeps every position); an
encoder-decoder's decoder also caches each layer's cross-attention keys and values of the source
once. An encoder does not generate: no line.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..models import spec_of
from ..nn.latent import cache_values_per_token


def cache_bytes_per_token(cfg: ModelConfig, elt: int) -> int:
    """Bytes the decoder's self-attention caches per generated or prompt token, all layers."""
    layers = spec_of(cfg).stack_shapes(cfg, 1, 1)[-1][0]
    return layers * cache_values_per_token(cfg) * elt


def kv_cache_line(cfg: ModelConfig, seq_len: int, mixed: bool) -> str | None:
    """``tformer plan``'s line: the cache per token and for one sequence of ``seq_len`` tokens."""
    spec = spec_of(cfg)
    if spec.encoder_only:
        return None
    elt = 2 if mixed else 4
    per_layer = cache_values_per_token(cfg)
    what = (
        f"latent {cfg.mla.kv_lora_rank} + rotary key {cfg.mla.qk_rope_head_dim}"
        if cfg.latent_attention
        else f"keys and values 2 x {cfg.kv_heads} heads x {cfg.head_dim}"
    )
    per_token = cache_bytes_per_token(cfg, elt)
    line = (
        f"generation KV cache: {per_layer} values per token and layer ({what}), "
        f"{per_token / 2**10:.1f} KiB per token in {'bf16' if mixed else 'fp32'}, "
        f"{per_token * seq_len / 2**30:.3f} GiB per sequence of {seq_len} tokens"
    )
    if spec.seq2seq:
        cross = spec.stack_shapes(cfg, 1, 1)[-1][0] * 2 * cfg.kv_heads * cfg.head_dim * elt
        line += f" (+ {cross * seq_len / 2**30:.3f} GiB of cross-attention keys and values of the source)"
    return line
