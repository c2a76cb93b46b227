"""Context parallelism: a sequence cut over ``cp`` ranks, and attention across the cuts.

**Layout.** A sequence is padded to a multiple of ``2 cp`` and cut into ``2 cp`` equal chunks; rank
``i`` holds chunks ``i`` and ``2cp-1-i``. Under a causal mask a query chunk attends to the key chunks
before it, so the early chunk of one rank and the late chunk of its mirror balance: every rank
computes the same number of (query chunk, key chunk) pairs. The pad is inert: its labels are -100,
its keys are masked (``attention_mask`` 0, document id -1), its positions are 0.

**Attention.** Each rank's queries attend to the keys of the whole sequence. Keys and values are
all-gathered in forward (the Llama 3 paper's choice: one collective of the K/V heads, smaller than
the queries under GQA) and attention runs per (query chunk, key chunk) pair with a memory-efficient
kernel that also returns each row's log-sum-exp; the pairs' outputs are merged by it. Backward keeps
only the rank's own K/V (gathering again), so the saved state per token does not grow with ``cp``;
the gradients of the gathered K/V go back to their owners with one reduce-scatter. Pairs above a
causal diagonal are skipped, and no tensor wider than a chunk pair is built: masks (padding,
documents, causal) and T5's relative bias are made per pair from global positions.

**Windows and sinks** (gpt-oss). A block's local window is applied per chunk pair from the global
positions of its queries and keys (``window_allowed``'s rule: causal, the ``window`` keys up to the
query; bidirectional, ``window // 2`` either side), so a window that crosses a shard boundary sees
exactly the keys one process sees, and pairs the window leaves empty are skipped. Attention sinks
join the merged softmax: the pairs' log-sum-exp ``l`` becomes ``L = logaddexp(l, sink)`` and the
output is scaled by ``exp(l - L)``; backward then runs with ``L`` and the scaled output (the sink
is a key of score ``sink`` and value 0), and the sink's gradient is ``-sum exp(sink - L) * delta``
over this rank's queries (``delta`` = rowsum(dout * out)), summed over the ranks with the other
gradients. Latent attention (MLA) runs the same core over its expanded keys and values (heads of
``qk_nope + qk_rope`` and ``v_head_dim``): the gathered K/V are the expanded heads, not the latent.

A row with no key to attend to (a sequence of padding only) comes out as zeros here, where the
single-device path spreads it evenly over the masked keys; such rows carry no label and are attended
by no one, so losses and gradients are the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..nn.attention import local_attention, masked_head_max
from ..models import spec_of
from ..nn.docmask import same_document
from ..nn.flex import in_window, soft_cap

# ----------------------------------------------------------------------------------------------
# The layout of a sequence over cp ranks


def padded_length(seq_len: int, cp: int, tp: int = 1) -> int:
    """``seq_len`` padded to ``2 cp`` chunks; with ``tp`` ranks of sequence parallelism under each
    cp rank, a rank's two chunks (its shard) must also split into ``tp`` equal parts."""
    multiple = cp * math.lcm(2, tp)
    return -(-seq_len // multiple) * multiple


def held_chunks(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def held_positions(seq_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the tokens ``rank`` holds of a ``seq_len`` sequence (already padded)."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in held_chunks(rank, cp)])


def pad_seq(x: torch.Tensor, length: int, value, dim: int = 1) -> torch.Tensor:
    if x.shape[dim] == length:
        return x
    shape = list(x.shape)
    shape[dim] = length - x.shape[dim]
    return torch.cat((x, x.new_full(shape, value)), dim)


def shard_seq(x: torch.Tensor, rank: int, cp: int, dim: int = 1, pad_value=0, tp: int = 1) -> torch.Tensor:
    """The part of ``x`` (padded with ``pad_value`` along ``dim``, see ``padded_length``) that ``rank`` holds."""
    chunks = pad_seq(x, padded_length(x.shape[dim], cp, tp), pad_value, dim).chunk(2 * cp, dim)
    return torch.cat([chunks[i] for i in held_chunks(rank, cp)], dim)


def unshard_seq(shards: list[torch.Tensor] | torch.Tensor, dim: int = 1) -> torch.Tensor:
    """The padded sequence back from every rank's shard, in rank order."""
    cp = len(shards)
    chunks: list[Any] = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp - 1 - rank] = shard.chunk(2, dim)
    return torch.cat(chunks, dim)


# ----------------------------------------------------------------------------------------------
# Attention across the shards


@dataclass
class _Keys:
    """What every (query chunk, key chunk) pair needs besides q/k/v, built once per call."""

    group: Any
    cp: int
    rank: int
    causal: bool
    scale: float
    q_pos: tuple[torch.Tensor, torch.Tensor]  # global positions of the two held query chunks
    k_chunk: int  # key chunk length
    q_doc: torch.Tensor | None  # (B, S_q local) document ids of the queries
    k_doc: torch.Tensor | None  # (B, S_k) of all keys, in sequence order
    k_pad: torch.Tensor | None  # (B, S_k) bool, True = real key
    bias: Any = None  # RelativePositionBias (its table is the Function's ``table`` input)
    window: int | None = None  # a local window (``nn.attention.window_allowed``), by global position
    softcap: float | None = None  # scores capped (``cap * tanh(s / cap)``) before the masks are added

    def _outside_window(self, i: int, j: int) -> bool:
        """True where no query of chunk ``i`` has a key of chunk ``j`` inside the window."""
        if self.window is None or i == j:
            return False
        nearest = (abs(i - j) - 1) * self.k_chunk + 1  # the closest (query, key) distance of the pair
        return nearest >= self.window if self.causal else nearest > self.window // 2

    def pairs(self):
        """(query half, key chunk) pairs that a causal mask leaves non-empty."""
        for a, i in enumerate(held_chunks(self.rank, self.cp)):
            for j in range(2 * self.cp):
                if not (self.causal and j > i) and not self._outside_window(i, j):
                    yield a, i, j

    def mask(self, a: int, i: int, j: int, table: torch.Tensor | None, dtype):
        """(additive mask or None, is_causal, rows that have a key or None, buckets or None)."""
        ks = slice(j * self.k_chunk, (j + 1) * self.k_chunk)
        diag = self.causal and i == j
        allowed = None
        if self.k_pad is not None:
            allowed = self.k_pad[:, None, None, ks]
        if self.q_doc is not None and self.k_doc is not None:
            half = self.q_doc.shape[1] // 2
            qd = self.q_doc[:, a * half : (a + 1) * half]
            ok = same_document(qd[:, None, :, None], self.k_doc[:, None, None, ks])
            allowed = ok if allowed is None else allowed & ok
        buckets = bias = None
        if table is not None:
            k_pos = torch.arange(j * self.k_chunk, (j + 1) * self.k_chunk, device=table.device)
            buckets = self.bias.buckets(self.q_pos[a], k_pos)
            bias = table[buckets].permute(2, 0, 1).unsqueeze(0).to(dtype)
        if self.window is not None:
            k_pos = torch.arange(j * self.k_chunk, (j + 1) * self.k_chunk, device=self.q_pos[a].device)
            distance = self.q_pos[a][:, None] - k_pos[None, :]
            inside = distance < self.window if self.causal else distance.abs() <= self.window // 2
            allowed = inside if allowed is None else allowed & inside
        if diag and (allowed is not None or bias is not None):
            tri = torch.ones(self.k_chunk, self.k_chunk, dtype=torch.bool, device=self.q_pos[a].device).tril()
            allowed = tri if allowed is None else allowed & tri
            diag = False
        if allowed is None:
            return bias, diag, None, buckets
        base = bias if bias is not None else torch.zeros((), dtype=dtype, device=allowed.device)
        return torch.where(allowed, base, float("-inf")).to(dtype), diag, allowed.any(-1), buckets


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _pair_forward(q, k, v, mask, is_causal: bool, scale: float, softcap: float | None = None):
    """(out, log-sum-exp) of one chunk pair with the device's memory-efficient kernel."""
    if q.device.type == "cpu" and softcap is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale
        )
    # elsewhere (and under a cap, which no kernel takes) the chunk pair's scores written out (a
    # chunk-pair-sized tensor, as the mask is)
    s = _scores(q, k, mask, is_causal, scale, softcap)
    lse = torch.logsumexp(s, -1)
    return torch.matmul(torch.exp(s - lse[..., None]).to(v.dtype), _expand_heads(v, q.shape[1])), lse


def _raw_scores(q, k, scale: float) -> torch.Tensor:
    return torch.matmul(q.float(), _expand_heads(k, q.shape[1]).float().transpose(-2, -1)) * scale


def _scores(q, k, mask, is_causal: bool, scale: float, softcap: float | None = None) -> torch.Tensor:
    """The pair's scores as the softmax takes them: capped (``nn.attention.soft_cap``), then
    masked, as the math path orders them."""
    return _masked(soft_cap(_raw_scores(q, k, scale), softcap), mask, is_causal)


def _masked(s: torch.Tensor, mask, is_causal: bool) -> torch.Tensor:
    if mask is not None:
        s = s + mask
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    return s


def _fold_heads(g: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Sum a per-query-head gradient over the query heads that share each KV head."""
    b, h, s, d = g.shape
    return g if h == kv_heads else g.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def _pair_backward(
    dout, q, k, v, out, lse, mask, is_causal: bool, scale: float, delta, need_ds: bool, softcap: float | None = None
):
    """dq, dk, dv (and the score gradient when a bias needs it) of one pair, from the merged output
    and the merged log-sum-exp (+inf on rows with no key: their probabilities are 0). Under a cap
    the gradient reaches the raw scores through ``tanh``'s derivative, ``1 - (capped / cap)^2``."""
    if q.device.type == "cpu" and not need_ds and softcap is None:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, is_causal, attn_mask=mask, scale=scale
        )
        return dq, dk, dv, None
    capped = soft_cap(_raw_scores(q, k, scale), softcap)
    p = torch.exp(_masked(capped, mask, is_causal) - lse[..., None])
    dv = _fold_heads(torch.matmul(p.transpose(-2, -1), dout.float()), k.shape[1])
    dp = torch.matmul(dout.float(), _expand_heads(v, q.shape[1]).float().transpose(-2, -1))
    ds = p * (dp - delta[..., None])
    d_raw = ds if softcap is None else ds * (1 - (capped / softcap).square())
    dq = torch.matmul(d_raw, _expand_heads(k, q.shape[1]).float()) * scale
    dk = _fold_heads(torch.matmul(d_raw.transpose(-2, -1), q.float()) * scale, k.shape[1])
    return dq, dk, dv, ds if need_ds else None


def _merge(acc, out: torch.Tensor, lse: torch.Tensor):
    """Fold one pair's (out, lse) into the running (out, lse) of the same queries (fp32)."""
    out = out.float()
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    finite = torch.isfinite(new)
    w_old = torch.where(finite, torch.exp(acc_lse - new), 0.0)[..., None]
    w_new = torch.where(finite, torch.exp(lse - new), 0.0)[..., None]
    return acc_out * w_old + out * w_new, new


def _gather(x: torch.Tensor, group, cp: int) -> torch.Tensor:
    """(cp, *x.shape): every rank's ``x``, in rank order (no autograd: the Function owns backward)."""
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out.view(cp, *x.shape)


def _key_chunks(gathered: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """The 2cp key chunks in sequence order from the (cp, B, h, 2c, d) gathered shards."""
    cp = gathered.shape[0]
    return [
        gathered[j if j < cp else 2 * cp - 1 - j, :, :, (j >= cp) * chunk : (j >= cp) * chunk + chunk] for j in range(2 * cp)
    ]


class _ShardedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, table, sinks, keys: _Keys):
        c = q.shape[2] // 2
        ks = _key_chunks(_gather(k, keys.group, keys.cp), keys.k_chunk)
        vs = _key_chunks(_gather(v, keys.group, keys.cp), keys.k_chunk)
        acc: list[Any] = [None, None]
        for a, i, j in keys.pairs():
            mask, is_causal, rows, _ = keys.mask(a, i, j, table, q.dtype)
            if rows is not None and not rows.any():
                continue  # a pair the masks empty entirely (documents that do not meet)
            out, lse = _pair_forward(q[:, :, a * c : (a + 1) * c], ks[j], vs[j], mask, is_causal, keys.scale, keys.softcap)
            if rows is not None:
                out, lse = out.masked_fill(~rows[..., None], 0.0), lse.masked_fill(~rows, float("-inf"))
            acc[a] = _merge(acc[a], out, lse)
        for a in (0, 1):
            if acc[a] is None:  # every key masked for these queries
                b, h = q.shape[:2]
                acc[a] = (q.new_zeros((b, h, c, v.shape[-1]), dtype=torch.float32), q.new_full((b, h, c), float("-inf")))
        out = torch.cat([o for o, _ in acc], 2)
        lse = torch.cat([s for _, s in acc], 2)
        if sinks is not None:  # one more key of score ``sink`` and value 0 in every row's softmax
            total = torch.logaddexp(lse, sinks.float()[None, :, None])
            out, lse = out * torch.exp(lse - total)[..., None], total
        out = out.to(q.dtype)
        ctx.keys = keys
        ctx.save_for_backward(q, k, v, out, lse, table, sinks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, table, sinks = ctx.saved_tensors
        keys: _Keys = ctx.keys
        c, cp = q.shape[2] // 2, keys.cp
        ks = _key_chunks(_gather(k, keys.group, cp), keys.k_chunk)
        vs = _key_chunks(_gather(v, keys.group, cp), keys.k_chunk)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
        delta = (dout.float() * out.float()).sum(-1)
        dsinks = None
        if sinks is not None:  # the sink's probability times its score gradient (0 - delta), per row
            dsinks = -(torch.exp(sinks.float()[None, :, None] - lse) * delta).sum((0, 2)).to(sinks.dtype)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        # the gathered keys' gradients, laid out as the reduce-scatter sends them (no staging copy)
        dk_all, dv_all = (torch.zeros((cp, *x.shape), dtype=torch.float32, device=x.device) for x in (k, v))
        dks, dvs = _key_chunks(dk_all, keys.k_chunk), _key_chunks(dv_all, keys.k_chunk)
        dtable = torch.zeros_like(table, dtype=torch.float32) if table is not None else None
        for a, i, j in keys.pairs():
            mask, is_causal, rows, buckets = keys.mask(a, i, j, table, q.dtype)
            if rows is not None and not rows.any():
                continue
            qs = slice(a * c, (a + 1) * c)
            dqa, dk, dv, ds = _pair_backward(
                dout[:, :, qs], q[:, :, qs], ks[j], vs[j], out[:, :, qs], lse[:, :, qs], mask, is_causal,
                keys.scale, delta[:, :, qs], dtable is not None, keys.softcap,
            )  # fmt: skip
            dq[:, :, qs] += dqa
            dks[j] += dk
            dvs[j] += dv
            if ds is not None:
                dtable.index_add_(0, buckets.flatten(), ds.sum(0).flatten(1).T)
        del ks, vs  # the gathered keys: freed before the reduce-scatters
        dk, dv = _scatter_back(dk_all, keys, k), _scatter_back(dv_all, keys, v)
        return dq.to(q.dtype), dk, dv, dtable, dsinks, None


def _scatter_back(grads: torch.Tensor, keys: _Keys, like: torch.Tensor) -> torch.Tensor:
    """Sum every rank's gradient of the gathered keys, (cp, *shard) in rank order, into the
    owners' shards (one reduce-scatter)."""
    out = torch.empty(like.shape, dtype=torch.float32, device=like.device)
    dist.reduce_scatter_tensor(out, grads.view(-1, *like.shape[1:]), group=keys.group)
    return out.to(like.dtype)


class ContextParallelAttention:
    """An attention core (``MultiHeadAttention.core``) over sequence shards: queries, keys and
    values are this rank's held tokens (see the layout above), masks are given for them.

    ``kernel="torch"`` runs torch's own ring attention (``context_parallel``'s SDPA dispatch) where
    it supports the call (``torch_cp_refusal``), and refuses otherwise.
    """

    def __init__(self, group, kernel: str = "tformer", mesh=None):
        self.group = group
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.kernel = kernel
        self.mesh = mesh
        self._gathered: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(
        self, q, k, v, *, padding_mask, causal, attn_bias, doc_mask, scale, dropout_p, impl, training=True,
        window=None, sinks=None, softcap=None,
    ):  # fmt: skip
        if not training:  # evaluation and generation see whole sequences (see apply_context_parallel)
            local = {n: x for n, x in (("window", window), ("sinks", sinks), ("softcap", softcap)) if x is not None}
            return local_attention(
                q, k, v, padding_mask=padding_mask, causal=causal, attn_bias=attn_bias, doc_mask=doc_mask,
                scale=scale, dropout_p=dropout_p, impl=impl, **local,
            )  # fmt: skip
        if dropout_p:
            raise ConfigError("context parallelism has no attention dropout; set model.attn_dropout=0")
        if self.kernel == "torch":
            if window is not None or sinks is not None or softcap is not None:
                raise ConfigError(
                    "parallel.cp_kernel=torch takes no attention windows, sinks or soft-caps; use parallel.cp_kernel=tformer"
                )
            return self._torch(q, k, v, padding_mask, causal, attn_bias, doc_mask, scale)
        if causal and q.shape[2] != k.shape[2]:
            raise ValueError("causal attention under context parallelism needs queries and keys of one sequence")
        if q.shape[2] % 2 or k.shape[2] % 2:
            raise ValueError(f"a context-parallel shard holds two equal chunks; got {q.shape[2]} queries, {k.shape[2]} keys")
        if isinstance(attn_bias, torch.Tensor):
            raise ValueError("context parallelism builds the relative bias per chunk pair: set the stack's bias_per_block")
        s_q = q.shape[2] * self.cp
        keys = _Keys(
            group=self.group,
            cp=self.cp,
            rank=self.rank,
            causal=causal,
            scale=scale,
            q_pos=held_positions(s_q, self.rank, self.cp, q.device).chunk(2),
            k_chunk=k.shape[2] // 2,
            q_doc=doc_mask.q_ids if doc_mask is not None else None,
            k_doc=self._all_keys(doc_mask.k_ids) if doc_mask is not None else None,
            k_pad=self._all_keys(padding_mask).bool() if padding_mask is not None else None,
            bias=attn_bias,
            window=window,
            softcap=softcap,
        )
        table = attn_bias.embedding.weight if attn_bias is not None else None
        if hasattr(table, "to_local"):  # tensor parallel: this rank's heads' columns (a DTensor)
            table = table.to_local()
        d_v = v.shape[-1]
        if q.device.type == "cpu" and d_v != q.shape[-1]:  # latent attention's narrower values: the CPU
            # kernel wants one head width; zero value columns attend to zeros and are cut off again
            v = torch.nn.functional.pad(v, (0, q.shape[-1] - d_v))
        out = _ShardedAttention.apply(q, k, v, table, sinks, keys)
        return out[..., :d_v] if out.shape[-1] != d_v else out

    @torch.no_grad()
    def max_logits(self, q, k, scale: float, causal: bool, padding_mask, doc_mask, window) -> torch.Tensor:
        """Each query head's largest logit over the pairs attention sees (``nn.attention.
        head_max_logits`` for QK-clip), this rank's queries against every key of the sequence: the
        keys gathered (no gradient), the pairs masked by global position, padding and document."""
        keys = unshard_seq(_gather(k, self.group, self.cp), dim=2)
        q_pos = held_positions(q.shape[2] * self.cp, self.rank, self.cp, q.device)
        distance = q_pos[:, None] - torch.arange(keys.shape[2], device=q.device)[None, :]
        allowed = distance >= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
        if window is not None:
            allowed = allowed & in_window(distance, window, causal)
        allowed = allowed[None, None]
        if padding_mask is not None:
            allowed = allowed & self._all_keys(padding_mask).bool()[:, None, None, :]
        if doc_mask is not None:
            allowed = allowed & same_document(
                doc_mask.q_ids[:, None, :, None], self._all_keys(doc_mask.k_ids)[:, None, None, :]
            )
        return masked_head_max(q, keys, scale, allowed)

    def _all_keys(self, local: torch.Tensor) -> torch.Tensor:
        """A (B, S_k/cp) per-key tensor of this rank -> (B, S_k) of the whole sequence. Every layer
        passes the same mask object, so it is gathered once per forward."""
        for src, full in self._gathered:
            if src is local:
                return full
        full = unshard_seq(_gather(local.long(), self.group, self.cp))
        self._gathered = [*self._gathered[-3:], (local, full)]
        return full

    def _torch(self, q, k, v, padding_mask, causal, attn_bias, doc_mask, scale):
        why = torch_cp_refusal(
            q.device.type,
            causal=causal,
            padding_mask=padding_mask is not None,
            doc_mask=doc_mask is not None,
            bias=attn_bias is not None,
            gqa=k.shape[1] != q.shape[1],
            same_length=q.shape[2] == k.shape[2],
        )
        if why:
            raise ConfigError(f"parallel.cp_kernel=torch cannot run this attention: {why}; use parallel.cp_kernel=tformer")
        return _torch_ring(q, k, v, causal, scale, self.mesh)


def torch_cp_refusal(
    device_type: str, *, causal: bool, padding_mask: bool, doc_mask: bool, bias: bool, gqa: bool, same_length: bool
) -> str | None:
    """Why torch's ``context_parallel`` (torch 2.13) cannot run an attention call, or None.

    Its ring attention is registered for the CUDA SDPA kernels only (flash, efficient, cuDNN; on CPU
    ``_scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), takes no attention
    mask or bias (only ``is_causal``), needs equal query and key lengths for causal attention, and
    its flash kernel wants as many KV heads as query heads.
    """
    if device_type != "cuda":
        return f"it has CUDA kernels only (device {device_type})"
    for present, what in (
        (padding_mask, "a key padding mask"),
        (doc_mask, "document masks"),
        (bias, "an additive bias (T5's relative positions)"),
    ):
        if present:
            return f"it takes no attention mask, and this call has {what}"
    if gqa:
        return "its kernels need as many key/value heads as query heads (GQA)"
    if causal and not same_length:
        return "causal attention needs queries and keys of one sequence"
    return None


def _torch_ring(q, k, v, causal: bool, scale: float, mesh):
    """torch's ring attention over this rank's shards (its head-tail load balance is our layout)."""
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    cp_attention._cp_options.enable_load_balance = causal
    cp_attention._enable_cp_dtensor_dispatcher()
    try:
        dq, dk, dv = (DTensor.from_local(x.contiguous(), mesh, [Shard(2)]) for x in (q, k, v))
        out = F.scaled_dot_product_attention(dq, dk, dv, is_causal=causal, scale=scale)
        return out.to_local()  # type: ignore[attr-defined]  # a DTensor: its inputs are
    finally:
        cp_attention._disable_cp_dtensor_dispatcher()


# ----------------------------------------------------------------------------------------------
# A model and its batches over the layout

# What the pad of each batch field holds (token ids: any valid id, the pad is never scored)
_PAD = {"labels": -100, "attention_mask": 0, "decoder_attention_mask": 0, "doc_ids": -1, "decoder_doc_ids": -1}


def apply_context_parallel(model, group, kernel: str = "tformer", mesh=None) -> None:
    """Give every attention layer of ``model`` the attention across shards, and every stack's
    relative bias per chunk pair; the model's parameters and code stay as they are.

    Only training forwards (``model.training``) take sequence shards; in eval mode the layers attend
    locally, so evaluation and generation run whole sequences on every rank as before."""
    from ..nn.attention import MultiHeadAttention
    from ..nn.block import TransformerStack
    from ..nn.latent import LatentAttention

    if model.config.attn_dropout:
        raise ConfigError("context parallelism has no attention dropout; set model.attn_dropout=0")
    core = ContextParallelAttention(group, kernel, mesh)
    for module in model.modules():
        if isinstance(module, (MultiHeadAttention, LatentAttention)):
            module.core = core
        elif isinstance(module, TransformerStack):
            module.bias_per_block = True


def shard_batch(batch: dict[str, torch.Tensor], rank: int, cp: int, cfg, tp: int = 1) -> dict[str, torch.Tensor]:
    """This rank's part of a batch of (B, S) fields. What needs the whole sequence is settled first:
    positions (restarting per document where there are documents), an encoder-decoder's shifted
    decoder input, and a key mask where a bidirectional stream gets a pad."""
    from ..models.encdec import shift_right
    from ..nn.docmask import positions_from_doc_ids

    batch = dict(batch)
    streams = [("input_ids", "doc_ids", "position_ids")]
    spec = spec_of(cfg)
    if spec.seq2seq:
        if "decoder_input_ids" not in batch:
            batch["decoder_input_ids"] = shift_right(batch["labels"], cfg.decoder_start_token_id, cfg.pad_token_id)
        streams.append(("decoder_input_ids", "decoder_doc_ids", "decoder_position_ids"))
    for ids, docs, pos in streams:
        if pos not in batch:
            b, s = batch[ids].shape
            batch[pos] = positions_from_doc_ids(batch[docs]) if docs in batch else torch.arange(s).expand(b, s)
    b, s = batch["input_ids"].shape
    if not spec.causal_lm and "attention_mask" not in batch and padded_length(s, cp, tp) != s:
        batch["attention_mask"] = torch.ones(b, s, dtype=torch.long, device=batch["input_ids"].device)
    return {k: shard_seq(v, rank, cp, pad_value=_PAD.get(k, 0), tp=tp) for k, v in batch.items()}


def loss_tokens(labels: torch.Tensor, group) -> torch.Tensor:
    """(B,) labelled positions of each whole sequence, from every rank's shard of ``labels``: their
    sum is the divisor that makes the ranks' losses add up to the mean (``models/base.lm_loss``).
    Per sample, not one count, so that a pipeline schedule splits it with the micro-batches."""
    count = (labels != -100).sum(-1)
    dist.all_reduce(count, group=group)
    return count


def check_context_parallel(cfg, dims) -> None:
    """What context parallelism does not run yet, refused in one line before any process group.
    ``cfg`` is the run config (``tformer.train.config.TrainConfig``), ``dims`` its ParallelDims."""
    if dims.cp == 1:
        return
    pcfg, cp = cfg.parallel, dims.cp
    if cfg.model.attn_dropout:  # a rule between keys (cp and dropout), not a range
        raise ConfigError(
            f"parallel.cp={cp} does not run with attention dropout yet; set model.attn_dropout=0, or parallel.cp=1"
        )
    m = cfg.model
    ring_lacks = [
        field
        for field, on in (
            ("model.attn_sinks=true", m.attn_sinks),
            (f"model.attn_window={m.attn_window}", m.attn_window is not None),
            (f"model.attn_softcap={m.attn_softcap}", m.attn_softcap is not None),
        )
        if on
    ]
    if pcfg.cp_kernel == "torch" and ring_lacks:
        raise ConfigError(
            f"parallel.cp_kernel=torch does not run with {ring_lacks[0]}: torch's ring attention takes no sinks, "
            "windows or soft-caps; set parallel.cp_kernel=tformer"
        )
    if pcfg.strategy == "ddp" and (dims.tp > 1 or dims.pp > 1):
        raise ConfigError(
            f"parallel.cp={cp} with parallel.{'tp' if dims.tp > 1 else 'pp'}>1 needs parallel.strategy=fsdp (DDP does "
            "not wrap tensor-parallel or pipelined models, so the cp ranks' gradients would not be summed); set it"
        )
    if pcfg.cp_kernel == "torch" and cfg.device != "cuda" and not torch.cuda.is_available():
        raise ConfigError("parallel.cp_kernel=torch runs torch's CUDA ring attention only; set parallel.cp_kernel=tformer")


def context_shard(inputs: dict[str, torch.Tensor], mesh, model_cfg) -> dict[str, torch.Tensor]:
    """A training micro-batch for this rank of its context-parallel group: its part of every field
    (``shard_batch``), and ``loss_tokens`` (per sample) so that the group's losses add up to ``cp``
    times the micro-batch's mean: the data-parallel gradient average (FSDP2 over ``dp_shard x cp``,
    DDP over all ranks) divides by the ``cp`` ranks too. Under pipeline parallelism every field,
    ``loss_tokens`` included, reaches every stage (``pipeline.stage_kwargs``), split along the batch
    dimension with the micro-batches."""
    cp_mesh = mesh["cp"]
    # under tensor parallelism each shard is a multiple of tp too (sequence parallel splits it again)
    shard = shard_batch(inputs, cp_mesh.get_local_rank(), cp_mesh.size(), model_cfg, mesh["tp"].size())
    shard["loss_tokens"] = loss_tokens(shard["labels"], cp_mesh.get_group()) / cp_mesh.size()
    return shard
