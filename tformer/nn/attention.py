"""Multi-head attention: self, causal and cross; padding + causal masks; GQA; KV cache.

``softmax(Q K^T / sqrt(d_k) + M) V`` per head, heads concatenated and projected by ``W^O``.
Three interchangeable kernels: ``F.scaled_dot_product_attention`` (the fast path), FlexAttention
(``nn/flex.py``: windows, sinks, soft-caps and document masks on CUDA) and the explicit math path
(the reference the tests hold the others to); ``flex.attention_kernel`` chooses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ATTN_IMPLS, AttnImpl
from .cast import autocast_input
from .flex import attention_kernel, flex_attend, in_window
from .flex import soft_cap as soft_cap  # the cap's one definition, used by models/ for the output logits
from .norm import RMSNorm
from .position import apply_rotary


class KVCache:
    """Keys and values of past positions for one attention layer.

    Self-attention appends the newest token's K/V each step; cross-attention stores the encoder's
    K/V once (``static``) and reuses them for every decoding step.
    """

    def __init__(self, static: bool = False):
        self.static = static
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k, self.v = k, v
        else:
            self.k = torch.cat((self.k, k), dim=2)
            self.v = torch.cat((self.v, v), dim=2)
        return self.k, self.v

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is not None:
            self.k, self.v = self.k[index], self.v[index]


def build_mask(
    padding_mask: torch.Tensor | None, causal: bool, q_len: int, k_len: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean "may attend" mask broadcastable to (B, h, S_q, S_k), or None if nothing is masked.

    ``padding_mask`` is (B, S_k) with 1 = real token. For causal attention the queries are the
    last ``q_len`` positions of the ``k_len`` keys (so a KV-cached query sees the whole past).
    """
    allowed = None
    if padding_mask is not None:
        if padding_mask.dim() != 2 or padding_mask.shape[1] != k_len:
            raise ValueError(
                f"padding_mask must be (batch, {k_len}) with 1 = real token, got shape {tuple(padding_mask.shape)}"
            )
        allowed = padding_mask.bool()[:, None, None, :]
    if causal:
        q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
        tri = torch.arange(k_len, device=device)[None, :] <= q_pos
        allowed = tri if allowed is None else allowed & tri
    return allowed


def additive_mask(allowed: torch.Tensor | None, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """Merge a boolean mask and an additive bias into one additive ``M``.

    Masked scores get the dtype's most negative finite value, not -inf, so a query whose keys are
    all masked (e.g. a padding query) gets a uniform, finite softmax instead of NaN.
    """
    if bias is None and allowed is None:
        return None
    if bias is None:
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
    bias = bias.to(dtype)
    return bias if allowed is None else bias.masked_fill(~allowed, torch.finfo(dtype).min)


def window_allowed(q_len: int, k_len: int, window: int, causal: bool, device: torch.device) -> torch.Tensor:
    """(q_len, k_len) "may attend" within a local window; the queries are the last ``q_len`` of the
    ``k_len`` positions. Causal: the ``window`` keys up to and including the query's position (HF's
    sliding window); bidirectional: the keys within ``window // 2`` either side (ModernBERT's)."""
    q_pos = torch.arange(k_len - q_len, k_len, device=device)[:, None]
    return in_window(q_pos - torch.arange(k_len, device=device)[None, :], window, causal)


def math_attention(q, k, v, mask, scale: float, dropout_p: float = 0.0, training: bool = False, sinks=None, softcap=None):
    """The textbook formula, written out: the reference implementation. ``sinks`` (h,): a logit per
    head that joins each softmax's denominator and attends to nothing (gpt-oss). ``softcap``: the
    scores capped (``soft_cap``) before the mask is added, so masked keys stay at the dtype's minimum."""
    if k.shape[1] != q.shape[1]:  # grouped KV heads serve several query heads each
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = soft_cap(torch.matmul(q, k.transpose(-2, -1)) * scale, softcap)
    if mask is not None:
        scores = scores + mask
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat((scores, column), -1).float(), dim=-1)[..., :-1].to(q.dtype)
    else:
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    probs = F.dropout(probs, dropout_p, training)
    return torch.matmul(probs, v)


def sink_column(q, k, v, mask, sinks):
    """SDPA takes no sinks; one more key does: a zero key (score 0) with a zero value, its mask
    entry the head's sink logit, so it joins the denominator and adds nothing to the output."""
    b, h, q_len = q.shape[0], q.shape[1], q.shape[2]
    k = torch.cat((k, k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])), 2)
    v = torch.cat((v, v.new_zeros(v.shape[0], v.shape[1], 1, v.shape[3])), 2)
    if mask is None:
        mask = q.new_zeros(1, 1, 1, k.shape[2] - 1)
    mask = mask.expand(b, h, q_len, k.shape[2] - 1)
    column = sinks.to(mask.dtype)[None, :, None, None].expand(b, h, q_len, 1)
    return k, v, torch.cat((mask, column), -1)


def _cast_once(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    q = autocast_input(query)
    k = q if key is query else autocast_input(key)
    v = k if value is key else q if value is query else autocast_input(value)
    return q, k, v


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    padding_mask: torch.Tensor | None,
    causal: bool,
    attn_bias,
    doc_mask,
    scale: float,
    dropout_p: float,
    impl: AttnImpl,
    training: bool = False,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``(B, h, S_q, d)`` queries over all ``(B, h_kv, S_k, d)`` keys of this device.

    ``attn_bias`` is a tensor broadcastable to the scores, or a module that builds it from the
    query and key counts (``RelativePositionBias`` of a stack whose ``bias_per_block`` is set).
    ``window``: local attention (``window_allowed``); ``sinks`` (h,): a logit per head in each
    softmax's denominator. ``softcap``: the scores capped before the mask (``soft_cap``).
    The kernel is ``flex.attention_kernel``'s choice: on CUDA, windows, sinks, soft-caps and
    document masks run FlexAttention (``flex_attend``); elsewhere windows, sinks and documents take
    SDPA with an explicit mask (sinks as one more key column, ``sink_column``) and a soft-cap, which
    no SDPA kernel applies, the math path; plain causal attention keeps SDPA's causal kernel.
    """
    q_len, k_len = q.shape[2], k.shape[2]
    if attn_bias is not None and not isinstance(attn_bias, torch.Tensor):
        attn_bias = attn_bias(q_len, k_len, k_len - q_len)
    gqa = k.shape[1] != q.shape[1]
    kernel = attention_kernel(
        q.device.type,
        impl,
        causal=causal,
        same_length=q_len == k_len,
        window=window,
        sinks=sinks is not None,
        softcap=softcap,
        documents=doc_mask is not None,
        padded=padding_mask is not None,
        bias=attn_bias is not None,
        dropout=dropout_p > 0,
        head_dims=(q.shape[-1], v.shape[-1]),
        flex=doc_mask is None or doc_mask.flex,
    )
    if kernel == "flex":
        return flex_attend(
            q, k, v, scale=scale, causal=causal, window=window, doc_mask=doc_mask, padding_mask=padding_mask,
            bias=attn_bias, sinks=sinks, softcap=softcap,
        )  # fmt: skip
    if kernel == "sdpa-causal":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale, enable_gqa=gqa)
    if doc_mask is not None:
        mask = doc_mask.additive(padding_mask, causal, attn_bias, q.dtype, additive_mask)
    else:
        allowed = build_mask(padding_mask, causal and q_len > 1, q_len, k_len, q.device)
        mask = additive_mask(allowed, attn_bias, q.dtype)
    if window is not None:
        inside = window_allowed(q_len, k_len, window, causal, q.device)
        if mask is None:
            mask = additive_mask(inside, None, q.dtype)
        else:  # broadcast both ways: a padding mask is (B, 1, 1, S_k)
            mask = torch.where(inside, mask, torch.finfo(mask.dtype).min)
    if kernel == "sdpa":
        if sinks is not None:
            k, v, mask = sink_column(q, k, v, mask, sinks)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, enable_gqa=gqa)
    return math_attention(q, k, v, mask, scale, dropout_p, dropout_p > 0, sinks, softcap)


# A function called as ``local_attention`` is: (q, k, v heads, masks as keywords) -> attended values
AttentionCore = Callable[..., torch.Tensor]


def allowed_pairs(
    q_len: int, k_len: int, *, padding_mask, causal: bool, doc_mask, window: int | None, device: torch.device
) -> torch.Tensor | None:
    """The (query, key) pairs attention may see, as a boolean broadcastable to (B, h, S_q, S_k)
    (None: all): padding, the causal rule, packed documents and the window, as ``local_attention``
    masks them."""
    if doc_mask is not None:
        allowed = doc_mask.allowed(causal)
        if padding_mask is not None:
            allowed = allowed & padding_mask.bool()[:, None, None, :]
    else:
        allowed = build_mask(padding_mask, causal and q_len > 1, q_len, k_len, device)
    if window is not None:
        inside = window_allowed(q_len, k_len, window, causal, device)
        allowed = inside if allowed is None else allowed & inside
    return allowed


@torch.no_grad()
def head_max_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    padding_mask: torch.Tensor | None,
    doc_mask=None,
    window: int | None = None,
) -> torch.Tensor:
    """Each query head's largest logit ``q . k x scale`` over the (B, H, S_q, S_k) pairs attention
    may see (``allowed_pairs``: padding, causal, documents, the window; a position bias, which no
    projection scales, and a soft-cap, applied after, left out): (H,), in fp32."""
    allowed = allowed_pairs(
        q.shape[2], k.shape[2], padding_mask=padding_mask, causal=causal, doc_mask=doc_mask, window=window, device=q.device
    )
    return masked_head_max(q, k, scale, allowed)


@torch.no_grad()
def masked_head_max(q: torch.Tensor, k: torch.Tensor, scale: float, allowed: torch.Tensor | None) -> torch.Tensor:
    """Each query head's largest ``q . k x scale`` over the pairs ``allowed`` keeps (None: all): (H,)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def track_max_logit(module: nn.Module, q, k, causal: bool, padding_mask, doc_mask, window: int | None) -> None:
    """Raise ``module.max_logit`` (set from outside by Muon's QK-clip; None: not tracked) to each
    head's largest logit of this forward, while training: the core's own count where it has one
    (context parallelism's, whose keys are spread over the ranks), else ``head_max_logits``."""
    if module.max_logit is None or not module.training:
        return
    count = getattr(module.core, "max_logits", head_max_logits)
    seen = count(q, k, module.scale, causal, padding_mask, doc_mask, window)
    module.max_logit = torch.maximum(module.max_logit, seen)


class HeadLogits(nn.Module):
    """One learned logit per head, the attention sinks: a module of its own so that a parallel
    layout splits it with its heads from outside (``parallel/tp.py``) and hands back its part."""

    def __init__(self, num_heads: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(num_heads))

    def forward(self) -> torch.Tensor:
        return self.logits


class MultiHeadAttention(nn.Module):
    """Multi-head attention over ``(B, S, d_model)`` inputs.

    ``num_heads`` query heads of width ``d_k`` (default ``d_model // num_heads``); ``num_kv_heads``
    key/value heads (fewer = grouped-query / multi-query attention); values of width ``d_v``.
    ``scale=False`` drops the ``1/sqrt(d_k)`` factor (T5 folds it into the initialisation).
    ``kv_dim`` is the width of the key/value inputs for cross-attention from a different stream.
    ``qk_norm``: an RMSNorm (``norm_eps``) over each head's query and key, one gain of width ``d_k``
    shared by the heads, before RoPE (Qwen3, Gemma 3): it bounds the logits' growth. ``window``:
    local attention (``window_allowed``); ``sinks``: a learned logit per head joining each softmax's
    denominator (gpt-oss), so a query may give its keys less than all of its attention.
    ``softcap``: ``cap * tanh(s / cap)`` on the scores before the mask (Gemma 2); ``query_pre_attn_scalar``:
    the scale is its -1/2 power rather than d_k's (Gemma).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        num_kv_heads: int | None = None,
        d_k: int | None = None,
        d_v: int | None = None,
        kv_dim: int | None = None,
        bias: bool = True,
        qkv_bias: bool | None = None,
        scale: bool = True,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        impl: AttnImpl = "sdpa",
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        window: int | None = None,
        sinks: bool = False,
        softcap: float | None = None,
        query_pre_attn_scalar: float | None = None,
        norm_unit_offset: bool = False,
    ):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if d_k is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by num_heads={num_heads}; change one of them or set d_k explicitly"
                )
            d_k = d_model // num_heads
        d_v = d_v or d_k
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if impl not in ATTN_IMPLS:
            raise ValueError(f"unknown attention impl {impl!r}; allowed: {', '.join(ATTN_IMPLS)}")
        kv_dim = kv_dim or d_model
        self.num_heads, self.num_kv_heads, self.d_k, self.d_v = num_heads, num_kv_heads, d_k, d_v
        self.scale = 1.0 / math.sqrt(query_pre_attn_scalar or d_k) if scale else 1.0
        self.attn_dropout = attn_dropout
        self.impl = impl
        qkv_bias = bias if qkv_bias is None else qkv_bias
        self.q_proj = nn.Linear(d_model, num_heads * d_k, bias=qkv_bias)
        self.k_proj = nn.Linear(kv_dim, num_kv_heads * d_k, bias=qkv_bias)
        self.v_proj = nn.Linear(kv_dim, num_kv_heads * d_v, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * d_v, d_model, bias=bias)
        self.q_norm = RMSNorm(d_k, norm_eps, norm_unit_offset) if qk_norm else None
        self.k_norm = RMSNorm(d_k, norm_eps, norm_unit_offset) if qk_norm else None
        self.window = window
        self.sinks = HeadLogits(num_heads) if sinks else None
        self.softcap = softcap
        self.out_dropout = nn.Dropout(dropout)
        # What turns (q, k, v) heads and the masks into the attended values: ``local_attention``
        # here; a parallel layout replaces it from outside (context parallelism's attention across
        # sequence shards, tformer/parallel/context.py), so this module stays single-device code.
        self.core: AttentionCore = local_attention
        # Set from outside (Muon's QK-clip, tformer/parallel/qk_clip.py) to a (num_heads,) tensor:
        # while training, each forward raises it to every head's largest pre-softmax logit q.k x
        # scale (no gradient; one more Q K^T product); the clip reads and resets it after each step.
        # None: not tracked.
        self.max_logit: torch.Tensor | None = None

    def _heads(self, x: torch.Tensor, n: int, d: int) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, n, d).transpose(1, 2)  # (B, n, S, d)

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
        """``query`` (B, S_q, d_model); ``key``/``value`` (B, S_k, kv_dim), default = ``query``.

        ``padding_mask`` (B, S_k_total), 1 = real token, where S_k_total includes cached keys.
        ``attn_bias`` is added to the scores (T5 relative positions). ``rotary`` = (cos, sin) for
        the new positions, applied to queries and the new keys. With ``cache`` the new keys/values
        are appended (self-attention) or, for a static cache already filled, reused as they are.
        ``doc_mask`` (a ``tformer.nn.docmask.DocumentMask``) keeps packed documents apart: on CUDA
        through FlexAttention, elsewhere as a boolean mask for SDPA / math (``local_attention``).
        """
        key = query if key is None else key
        value = key if value is None else value
        # one low-precision copy of each distinct input, kept once for q, k and v (nn/cast.py)
        query, key, value = _cast_once(query, key, value)
        b, q_len, _ = query.shape
        q = self._heads(self.q_proj(query), self.num_heads, self.d_k)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if cache is not None and cache.static and cache.k is not None:
            k, v = cache.k, cache.v
        else:
            k = self._heads(self.k_proj(key), self.num_kv_heads, self.d_k)
            v = self._heads(self.v_proj(value), self.num_kv_heads, self.d_v)
            if self.k_norm is not None:
                k = self.k_norm(k)
            if rotary is not None:
                k = apply_rotary(k, *rotary)
            if cache is not None:
                k, v = cache.update(k, v)
        if rotary is not None:
            q = apply_rotary(q, *rotary)
        track_max_logit(self, q, k, causal, padding_mask, doc_mask, self.window)
        dropout_p = self.attn_dropout if self.training else 0.0
        # only where set, so a core that cannot take them (context parallelism's) is never handed them
        sinks = self.sinks() if self.sinks is not None else None
        local = {k: v for k, v in (("window", self.window), ("sinks", sinks), ("softcap", self.softcap)) if v is not None}
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
            **local,
        )
        out = out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.d_v)
        return self.out_dropout(self.o_proj(out))
