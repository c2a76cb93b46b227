"""The transformer block and the stack of blocks, shared by all three families.

Encoder, decoder and encoder-decoder differ only in two switches: ``causal`` self-attention,
and whether a ``cross`` attention to an encoder's output sits between self-attention and the FFN.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import KVCache, MultiHeadAttention
from .ffn import FeedForward
from .latent import LatentAttention
from .moe import MoEFeedForward
from .norm import make_norm, residual
from .position import RelativePositionBias, Rotary


class StackCache:
    """KV caches of every layer of a stack, for incremental decoding."""

    def __init__(self, num_layers: int, cross: bool = False):
        self.self_kv = [KVCache() for _ in range(num_layers)]
        self.cross_kv = [KVCache(static=True) for _ in range(num_layers)] if cross else None

    @property
    def length(self) -> int:
        """Number of positions already cached (the offset of the next token)."""
        return self.self_kv[0].length

    def layer(self, i: int) -> tuple[KVCache, KVCache | None]:
        return self.self_kv[i], (self.cross_kv[i] if self.cross_kv is not None else None)

    def reorder(self, index: torch.Tensor) -> None:
        for c in self.self_kv + (self.cross_kv or []):
            c.reorder(index)


def _attention(cfg, index: int | None = None, **extra) -> nn.Module:
    """Block ``index``'s self-attention (its window and sinks; latent attention under
    ``attention: mla``), or with None a cross-attention (always MHA)."""
    if cfg.latent_attention and index is not None:
        return LatentAttention(cfg)
    return MultiHeadAttention(
        cfg.d_model,
        cfg.num_heads,
        num_kv_heads=cfg.kv_heads,
        d_k=cfg.head_dim,
        bias=cfg.bias,
        qkv_bias=cfg.attn_qkv_bias,
        scale=cfg.attn_scale,
        dropout=cfg.dropout,
        attn_dropout=cfg.attn_dropout,
        impl=cfg.attn_impl,
        qk_norm=cfg.qk_norm == "head",
        norm_eps=cfg.norm_eps,
        window=cfg.layer_window(index) if index is not None else None,
        sinks=cfg.attn_sinks and index is not None,
        softcap=cfg.attn_softcap,
        query_pre_attn_scalar=cfg.query_pre_attn_scalar,
        norm_unit_offset=cfg.norm_unit_offset,
        **extra,
    )


def _ffn(cfg, index: int) -> nn.Module:
    """Block ``index``'s FFN: mixture of experts on every ``moe.moe_every``-th block, else dense."""
    if cfg.moe.is_moe_layer(index):
        return MoEFeedForward(cfg.moe, cfg.d_model, cfg.d_ff, cfg.activation, cfg.dropout)
    return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias, cfg.dropout)


class TransformerBlock(nn.Module):
    """Self-attention (+ optional cross-attention) + FFN, each a residual sub-layer."""

    def __init__(self, cfg, *, causal: bool, cross: bool, index: int = 0):
        super().__init__()
        self.causal = causal
        self.pre_norm = cfg.pre_norm

        def norm():
            return make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_unit_offset)

        def post_norm(present: bool = True):  # sandwich norms (Gemma 2/3): each sub-layer's output normalised too
            return norm() if present and cfg.sandwich_norm else None

        self.attn = _attention(cfg, index)
        # ModernBERT's block 0 takes the normed embeddings as they are (first_attn_norm=false)
        self.attn_norm = norm() if index or cfg.first_attn_norm else nn.Identity()
        self.attn_post_norm = post_norm()
        self.cross_attn = _attention(cfg.replace(attention="mha")) if cross else None
        self.cross_norm = norm() if cross else None
        self.cross_post_norm = post_norm(cross)
        self.ffn = _ffn(cfg, index)
        self.ffn_norm = norm()
        self.ffn_post_norm = post_norm()
        # Op-level checkpointing, set from outside (tformer.parallel.apply_activation_checkpointing):
        # a torch.utils.checkpoint ``context_fn`` that decides op by op what backward keeps. It
        # runs inside the block's forward, so a compiled block traces the policy into its graph.
        self.checkpoint_context = None

    def forward(self, x: torch.Tensor, padding_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        if self.checkpoint_context is not None and self.training and torch.is_grad_enabled():
            return checkpoint(
                self._forward, x, padding_mask, use_reentrant=False, context_fn=self.checkpoint_context, **kwargs
            )
        return self._forward(x, padding_mask, **kwargs)

    def _forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        *,
        attn_bias: torch.Tensor | None = None,
        rotary=None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: tuple[KVCache, KVCache | None] | None = None,
        doc_mask=None,
        memory_doc_mask=None,
    ) -> torch.Tensor:
        self_cache, cross_cache = cache if cache is not None else (None, None)
        # One positional input per stream (the query; cross-attention's memory): a parallel layout
        # that gathers a sequence-sharded input does it once per call (tformer/parallel/tp.py).
        x = residual(
            x,
            self.attn_norm,
            lambda h: self.attn(
                h,
                padding_mask=padding_mask,
                causal=self.causal,
                attn_bias=attn_bias,
                rotary=rotary,
                cache=self_cache,
                doc_mask=doc_mask,
            ),
            self.pre_norm,
            self.attn_post_norm,
        )
        if self.cross_attn is not None:
            x = residual(
                x,
                self.cross_norm,
                lambda h: self.cross_attn(h, memory, padding_mask=memory_mask, cache=cross_cache, doc_mask=memory_doc_mask),
                self.pre_norm,
                self.cross_post_norm,
            )
        return residual(x, self.ffn_norm, self.ffn, self.pre_norm, self.ffn_post_norm)


class TransformerStack(nn.Module):
    """``num_layers`` blocks plus what they share: relative bias or rotary tables, final norm."""

    def __init__(self, cfg, num_layers: int, *, causal: bool, cross: bool = False):
        super().__init__()
        cfg = cfg.stack_config(causal)  # an encoder's own window (T5Gemma)
        self.causal = causal
        self.layers = nn.ModuleList(TransformerBlock(cfg, causal=causal, cross=cross, index=i) for i in range(num_layers))
        # T5 keeps one bias table per stack (HF stores it in block 0 and reuses it).
        self.rel_bias = (
            RelativePositionBias(cfg.num_heads, not causal, cfg.rel_num_buckets, cfg.rel_max_distance)
            if cfg.position == "relative"
            else None
        )
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.yarn, cfg.rope_linear) if cfg.position == "rotary" else None
        # Windowed blocks with a RoPE base of their own (Gemma 3, ModernBERT: 10k) take a second
        # table (unscaled, as HF's local rotary is); ``local_rotary[i]`` says which block takes it.
        self.rotary_local = None
        self.local_rotary = [False] * num_layers
        if cfg.position == "rotary" and cfg.rope_local_theta is not None:
            self.rotary_local = Rotary(cfg.head_dim, cfg.rope_local_theta)
            self.local_rotary = [cfg.layer_window(i) is not None for i in range(num_layers)]
        # Pre-norm stacks end with a norm; post-norm blocks already end normalised.
        self.final_norm = (
            make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_unit_offset) if cfg.pre_norm else None
        )
        self.dropout = nn.Dropout(cfg.dropout)
        # Indices of blocks whose activations are recomputed in backward instead of stored. Set
        # from outside (tformer.parallel.apply_activation_checkpointing); names stay unchanged.
        self.checkpointed: frozenset[int] = frozenset()
        # Set from outside by context parallelism: the attention layers then get the relative-bias
        # module itself and build the bias of each block of (query, key) positions they compute,
        # never one (S_q, S_k) tensor (a rank's queries against the whole sequence's keys).
        self.bias_per_block = False

    def forward(
        self,
        x: torch.Tensor,
        padding_mask: torch.Tensor | None = None,
        *,
        positions: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: StackCache | None = None,
        doc_mask=None,
        memory_doc_mask=None,
    ) -> torch.Tensor:
        """``x`` (B, S, d); ``positions`` (S,) or (B, S) absolute positions of ``x`` (for rotary);
        ``padding_mask`` covers cached + new keys. ``doc_mask`` / ``memory_doc_mask``
        (``DocumentMask``) confine self- / cross-attention to each packed document."""
        offset = cache.length if cache is not None else 0
        seq = x.shape[1]
        bias = None
        if self.rel_bias is not None:
            bias = self.rel_bias if self.bias_per_block else self.rel_bias(seq, offset + seq, offset)
        rotary = None
        if self.rotary is not None:
            if positions is None:
                positions = torch.arange(offset, offset + seq, device=x.device)
            rotary = self.rotary(positions)
        rotary_local = self.rotary_local(positions) if self.rotary_local is not None else None
        for i, layer in enumerate(self.layers):
            kwargs = dict(
                attn_bias=bias,
                rotary=rotary_local if self.local_rotary[i] else rotary,
                memory=memory,
                memory_mask=memory_mask,
                cache=cache.layer(i) if cache is not None else None,
                doc_mask=doc_mask,
                memory_doc_mask=memory_doc_mask,
            )
            if i in self.checkpointed and self.training and torch.is_grad_enabled():
                x = checkpoint(layer, x, padding_mask, use_reentrant=False, **kwargs)
            else:
                x = layer(x, padding_mask, **kwargs)
        if self.final_norm is not None:
            x = self.dropout(self.final_norm(x))
        return x
