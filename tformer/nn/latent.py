"""Multi-head latent attention (MLA; DeepSeek-V2 section 2.1, DeepSeek-V3).

Keys and values are not projected per head from the input: one shared latent ``c`` of width
``kv_lora_rank`` is (RMS-normed, then) expanded to every head's key part ``k_nope`` and value, and
one rotary key ``k_rope`` of width ``qk_rope_head_dim``, shared by all heads, carries the
positions. A query head is ``[q_nope, rotary(q_rope)]``, a key head ``[k_nope, rotary(k_rope)]``:

    c, k_rope   = split(kv_down(x))            c: kv_lora_rank, k_rope: qk_rope_head_dim
    k_nope, v   = split(kv_up(norm(c)))        per head: qk_nope_head_dim, v_head_dim
    q           = q_up(norm(q_down(x)))        (or q_proj(x) without a query bottleneck)

Generation caches ``c`` and ``k_rope`` (``kv_lora_rank + qk_rope_head_dim`` values per token and
layer) and expands them again at each step; MHA / GQA caches ``2 * kv_heads * head_dim``. For
DeepSeek-V3 (512 + 64 against 2 x 128 x 128 for its 128 full heads) that is 576 against 32,768
values, 1.1 KiB against 64 KiB per token and layer in bf16 (docs/models.md).

Parameter names, for the exporter and the TP plan (tformer/parallel/tp.py): ``q_down`` /
``kv_down`` (replicated under TP: every rank needs the whole latent), ``q_up`` / ``q_proj`` /
``kv_up`` (column-wise: whole heads per rank) and ``o_proj`` (row-wise), as MHA's.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from .attention import AttentionCore, KVCache, local_attention, track_max_logit
from .cast import autocast_input
from .norm import RMSNorm
from .position import apply_rotary, apply_rotary_interleaved, yarn_softmax_scale

# HF's DeepSeek-V3 builds its two latent norms with RMSNorm's default epsilon, whatever rms_norm_eps says
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """MLA over ``(B, S, d_model)`` inputs; ``cfg`` a ``ModelConfig`` with ``attention: mla``.

    Self-attention only (MLA's latent is of the query's own stream); the forward takes MHA's
    keywords so a block calls either the same way. Masks, the attention core (SDPA or the math
    reference) and ``core`` replacement from outside are ``MultiHeadAttention``'s."""

    def __init__(self, cfg) -> None:
        super().__init__()
        m = cfg.mla
        self.num_heads, self.nope, self.rope, self.d_v = cfg.num_heads, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_rank = m.kv_lora_rank
        self.interleave = m.rope_interleave
        d, h, qk = cfg.d_model, cfg.num_heads, m.qk_head_dim
        self.q_proj: nn.Linear | None = None
        self.q_down: nn.Linear | None = None
        self.q_norm: nn.Module | None = None
        self.q_up: nn.Linear | None = None
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * qk, bias=False)
        else:
            self.q_down = nn.Linear(d, m.q_lora_rank, bias=cfg.bias)
            self.q_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_up = nn.Linear(m.q_lora_rank, h * qk, bias=False)
        self.kv_down = nn.Linear(d, m.kv_lora_rank + m.qk_rope_head_dim, bias=cfg.bias)
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_up = nn.Linear(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim), bias=False)
        self.o_proj = nn.Linear(h * m.v_head_dim, d, bias=cfg.bias)
        # 1/sqrt(q/k head width), times YaRN's mscale_all_dim correction squared when it extends
        self.scale = yarn_softmax_scale(cfg.yarn) / math.sqrt(qk) if cfg.attn_scale else 1.0
        self.attn_dropout = cfg.attn_dropout
        self.impl = cfg.attn_impl
        self.out_dropout = nn.Dropout(cfg.dropout)
        self.core: AttentionCore = local_attention
        # Set from outside by tensor parallelism (tformer/parallel/tp.py): identity forward, its
        # backward sums the rotary key's gradient over the TP ranks (each uses it for its own heads;
        # the latent's gradient is summed by the column-wise kv_up itself)
        self.shared_key_grad: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Muon's QK-clip (tformer/parallel/qk_clip.py), as MultiHeadAttention.max_logit: each head's
        # largest logit of the step over its full query and key heads, tracked while training
        self.max_logit: torch.Tensor | None = None

    def _rotate(self, x: torch.Tensor, rotary) -> torch.Tensor:
        if rotary is None:
            return x
        return (apply_rotary_interleaved if self.interleave else apply_rotary)(x, *rotary)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, d_model) -> (B, h, S, qk_nope + qk_rope), positions not yet applied."""
        b, s, _ = x.shape
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_up is not None and self.q_norm is not None and self.q_down is not None
            q = self.q_up(self.q_norm(self.q_down(x)))
        return q.view(b, s, -1, self.nope + self.rope).transpose(1, 2)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, d_model) -> the normed latent (B, 1, S, kv_lora_rank) and the rotary key (B, 1,
        S, qk_rope), positions not yet applied: what the cache holds (as a one-head K and V)."""
        c, k_rope = self.kv_down(x).split((self.kv_rank, self.rope), dim=-1)
        return self.kv_norm(c).unsqueeze(1), k_rope.unsqueeze(1)

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent (B, 1, S, r) and rotated key (B, 1, S, rope) -> keys (B, h, S, nope + rope) and
        values (B, h, S, v) of this rank's heads."""
        b, _, s, _ = c.shape
        kv = self.kv_up(c.squeeze(1)).view(b, s, -1, self.nope + self.d_v).transpose(1, 2)
        k_nope, v = kv.split((self.nope, self.d_v), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return k, v

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        causal: bool = False,
        *,
        attn_bias: torch.Tensor | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        doc_mask=None,
    ) -> torch.Tensor:
        """As ``MultiHeadAttention.forward`` for self-attention (``key`` / ``value`` must be None
        or ``query``). With ``cache`` the new latent and rotary key are appended to it."""
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("latent attention is self-attention only; use attention=mha for cross-attention")
        x = autocast_input(query)
        b, q_len, _ = x.shape
        q = self.queries(x)
        q_nope, q_rope = q.split((self.nope, self.rope), dim=-1)
        q = torch.cat((q_nope, self._rotate(q_rope, rotary)), dim=-1)
        c, k_rope = self.latent(x)
        if self.shared_key_grad is not None:
            k_rope = self.shared_key_grad(k_rope)
        k_rope = self._rotate(k_rope, rotary)
        if cache is not None:
            c, k_rope = cache.update(c, k_rope)
        k, v = self.expand(c, k_rope)
        track_max_logit(self, q, k, causal, padding_mask, doc_mask, None)
        dropout_p = self.attn_dropout if self.training else 0.0
        out = self.core(
            q,
            k,
            v,
            padding_mask=padding_mask,
            causal=causal,
            attn_bias=attn_bias,
            doc_mask=doc_mask,
            scale=self.scale,
            dropout_p=dropout_p,
            impl=self.impl,
            training=self.training,
        )
        out = out.transpose(1, 2).reshape(b, q_len, -1)
        return self.out_dropout(self.o_proj(out))


def cache_values_per_token(cfg) -> int:
    """Values one layer's KV cache holds per token: MLA's latent and rotary key, or MHA / GQA's
    keys and values."""
    if cfg.latent_attention:
        return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return 2 * cfg.kv_heads * cfg.head_dim
