"""FlexAttention: every local-attention variant through one kernel, and which kernel a call takes.

``torch.nn.attention.flex_attention`` computes ``softmax(score_mod(Q K^T * scale) | mask) V`` with
the mask given as a rule, ``mask_mod(b, h, q_idx, kv_idx) -> may attend``, from which a
``BlockMask`` lists the tiles holding any allowed pair, so masked tiles are skipped rather than
computed. Compiled on CUDA it is one fused kernel; on this CPU build it runs eagerly (the scores
materialised), forward only: torch 2.13 has no FlexAttention backward on CPU, eager or compiled,
and its compiled CPU kernel is inference-only and returns no log-sum-exp.

Here every switch of ``local_attention`` becomes part of one call:

- the mask: causal, the window (``in_window``, the rule ``window_allowed`` applies too), packed
  documents (``DocumentMask``) and padded keys, each a ``mask_mod`` and their conjunction the mask;
- ``score_mod``: the soft-cap ``cap * tanh(s / cap)`` (``soft_cap``), then an additive bias (T5's
  relative positions), the order the math path adds them in;
- sinks: FlexAttention returns each row's log-sum-exp ``lse`` of its scores; a sink logit ``s`` in
  the denominator scales the row's output by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``,
  differentiable in ``lse`` (and so in Q and K) and in ``s``;
- grouped K/V heads: ``enable_gqa``.

Block masks are cached by what shapes them (lengths, causal, window, device) and by the identity
of the per-batch tensors they read (document ids, padding), so the layers of a stack share one
and a new batch rebuilds it once. ``attention_kernel`` is the selection, a function of the call's
switches alone, so the trainer's start-up line (``models/kernels.py``) names the kernel that runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Literal

import torch

Kernel = Literal["flex", "sdpa-causal", "sdpa", "math"]


def in_window(distance, window: int, causal: bool):
    """The window rule, written once (``window_allowed`` and the FlexAttention mask both apply it)
    over ``distance = query position - key position``. Causal: the ``window`` keys up to and
    including the query (``distance < window``; the causal rule drops the later keys), HF's sliding
    window; bidirectional: ``|distance| <= window // 2`` (ModernBERT's)."""
    return distance < window if causal else distance.abs() <= window // 2


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``: logits squashed smoothly into (-cap, cap) (Gemma 2); None: as they are."""
    return x if cap is None else cap * torch.tanh(x / cap)


def attention_kernel(
    device_type: str,
    impl: str,
    *,
    causal: bool,
    same_length: bool = True,
    window: int | None = None,
    sinks: bool = False,
    softcap: float | None = None,
    documents: bool = False,
    padded: bool = False,
    bias: bool = False,
    dropout: bool = False,
    head_dims: tuple[int, int] = (64, 64),
    flex: bool = True,
) -> Kernel:
    """The kernel an attention call takes, from its switches alone:

    - ``math``: asked for (``impl``), or a soft-cap no other kernel here can apply;
    - ``flex``: windows, sinks, soft-caps and document masks on CUDA, where FlexAttention compiles
      to a fused kernel: no attention dropout (Flex has none), head widths of at least 16 (its
      Triton tiles), and for causal attention queries and keys of one sequence (a KV-cached decoding
      step changes the key count every token, and each new shape would compile anew); ``flex=False``
      keeps it off (a ``DocumentMask`` built with ``flex=False`` asks for its boolean form);
    - ``sdpa-causal``: plain causal attention, SDPA's ``is_causal`` kernel (no mask tensor);
    - ``sdpa``: the rest, SDPA with an explicit mask (sinks as one more key column).
    """
    if impl == "math":
        return "math"
    local = window is not None or sinks or softcap is not None or documents
    flex_runs = flex and device_type == "cuda" and not dropout and min(head_dims) >= 16 and (same_length or not causal)
    if local and flex_runs:
        return "flex"
    if softcap is not None:
        return "math"
    if causal and same_length and not (local or padded or bias):
        return "sdpa-causal"
    return "sdpa"


def mask_mod(
    *,
    causal: bool,
    window: int | None = None,
    offset: int = 0,
    doc_mask=None,
    padding_mask: torch.Tensor | None = None,
) -> Callable:
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``: the conjunction of the rules that apply.
    The queries are the last of the keys' positions: query ``q_idx`` sits at ``q_idx + offset``
    (``offset = S_k - S_q``). ``doc_mask`` a ``DocumentMask``; ``padding_mask`` (B, S_k), 1 = real."""
    from torch.nn.attention.flex_attention import and_masks, noop_mask

    rules = []
    if causal:
        rules.append(lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx)
    if window is not None:
        rules.append(lambda b, h, q_idx, kv_idx: in_window(q_idx + offset - kv_idx, window, causal))
    if doc_mask is not None:
        rules.append(doc_mask.mask_mod(False))
    if padding_mask is not None:
        real = padding_mask.bool()
        rules.append(lambda b, h, q_idx, kv_idx: real[b, kv_idx])
    return and_masks(*rules) if rules else noop_mask


class BlockMasks:
    """Block masks by shape and rule, each kept with the per-batch tensors it read: a layer asking
    for the same rule over the same tensors (every layer of a stack, a recomputation under
    activation checkpointing) gets the one built before; a new batch replaces it."""

    def __init__(self, size: int = 16):
        self.size = size
        self._masks: OrderedDict[tuple, tuple[tuple, object]] = OrderedDict()

    def get(self, key: tuple, data: tuple, build: Callable[[], object]):
        hit = self._masks.get(key)
        if hit is not None and len(hit[0]) == len(data) and all(a is b for a, b in zip(hit[0], data)):
            return hit[1]
        mask = build()
        self._masks[key] = (data, mask)
        while len(self._masks) > self.size:
            self._masks.popitem(last=False)
        return mask

    def clear(self) -> None:
        self._masks.clear()


BLOCK_MASKS = BlockMasks()


def block_mask(q_len: int, k_len: int, device: torch.device, *, causal: bool, window=None, doc_mask=None, padding_mask=None):
    """The ``BlockMask`` of these rules (cached in ``BLOCK_MASKS``): per batch row where documents
    or padding shape it, one for all rows otherwise."""
    from torch.nn.attention.flex_attention import create_block_mask

    per_row = doc_mask is not None or padding_mask is not None
    rows = (doc_mask.q_ids if doc_mask is not None else padding_mask).shape[0] if per_row else None
    data = (doc_mask.q_ids, doc_mask.k_ids) if doc_mask is not None else ()
    data += (padding_mask,) if padding_mask is not None else ()
    key = (q_len, k_len, str(device), causal, window, rows, doc_mask is not None, padding_mask is not None)

    def build():
        rule = mask_mod(causal=causal, window=window, offset=k_len - q_len, doc_mask=doc_mask, padding_mask=padding_mask)
        return create_block_mask(rule, rows, None, q_len, k_len, device=device, _compile=device.type == "cuda")

    return BLOCK_MASKS.get(key, data, build)


def score_mod(softcap: float | None, bias: torch.Tensor | None) -> Callable | None:
    """FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)`` on the scaled scores: the cap,
    then the bias (``(1|B, 1|h, S_q, S_k)``), as the math path applies them; None when neither."""
    if softcap is None and bias is None:
        return None
    every_row = bias is not None and bias.shape[0] > 1
    every_head = bias is not None and bias.shape[1] > 1

    def mod(score, b, h, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if bias is not None:
            score = score + bias[b if every_row else 0, h if every_head else 0, q_idx, kv_idx]
        return score

    return mod


_COMPILED = None


def flex_function(compiled: bool):
    """The compiled FlexAttention (its fused kernel: CUDA); eager where ``compiled`` is False (the
    CPU's reference, forward only)."""
    global _COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if not compiled:
        return flex_attention
    if _COMPILED is None:
        _COMPILED = torch.compile(flex_attention, dynamic=False)
    return _COMPILED


def flex_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool = False,
    window: int | None = None,
    doc_mask=None,
    padding_mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    compiled: bool | None = None,
) -> torch.Tensor:
    """Attention of ``(B, h, S_q, d)`` queries over ``(B, h_kv, S_k, d)`` keys in one FlexAttention
    call, equal to ``math_attention`` with the same switches (``tests/test_flex.py``) except on a
    query whose every key is masked: the math path averages all values there (its mask is the
    dtype's minimum, not -inf), FlexAttention returns zeros; such rows are padding.
    ``compiled`` (default: on CUDA) picks the fused kernel or the eager reference."""
    rules = block_mask(
        q.shape[2], k.shape[2], q.device, causal=causal, window=window, doc_mask=doc_mask, padding_mask=padding_mask
    )
    attend = flex_function(q.is_cuda if compiled is None else compiled)
    kwargs = dict(
        score_mod=score_mod(softcap, None if bias is None else bias.to(q.dtype)),
        block_mask=rules,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    if sinks is None:
        return attend(q, k, v, **kwargs)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = attend(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
    kept = torch.sigmoid(aux.lse.float() - sinks.float()[None, :, None])  # exp(lse) / (exp(lse) + exp(sink))
    return out * kept.unsqueeze(-1).to(out.dtype)
