"""Document masks: several documents packed in one row, each attending only to itself.

A ``DocumentMask`` holds the document id of every query and every key position (``-1`` =
padding). Position ``q`` may attend to key ``k`` when both belong to the same document (and
``k <= q`` for causal attention); a padding query may attend anywhere, so no softmax row is empty.
One object serves self-attention (query ids = key ids) and cross-attention (decoder ids against
encoder ids), and every layer of a stack shares it.

The rule is written once, as a FlexAttention ``mask_mod``. Two ways to apply it:

- on CUDA, FlexAttention (compiled, ``nn/flex.py``) with a ``BlockMask`` built from it and the
  layer's other rules (causal, window, padding), so fully masked tiles are skipped, not computed;
- elsewhere, the same ``mask_mod`` evaluated over broadcast index grids gives a boolean
  ``(B, 1, S_q, S_k)`` mask for SDPA or the math path (FlexAttention has no CPU backward).

``flex.attention_kernel`` chooses (the first on CUDA); ``flex=False`` keeps a mask to the second.
"""

from __future__ import annotations

import torch


def positions_from_doc_ids(doc_ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document run, restarting at 0 where the id changes."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return idx - first


def same_document(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """The rule itself, over broadcastable id tensors: same document (keys of padding, id -1, are
    never attended), and a padding query may attend anywhere."""
    return ((q_ids == k_ids) & (k_ids >= 0)) | (q_ids < 0)


class DocumentMask:
    def __init__(self, q_ids: torch.Tensor, k_ids: torch.Tensor | None = None, *, flex: bool = True):
        if q_ids.dim() != 2:
            raise ValueError(f"document ids must be (batch, seq), got shape {tuple(q_ids.shape)}")
        self.q_ids = q_ids
        self.k_ids = q_ids if k_ids is None else k_ids
        self.flex = flex  # False: never through FlexAttention
        self._dense: dict[bool, torch.Tensor] = {}
        self._additive: tuple | None = None

    def mask_mod(self, causal: bool):
        """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx) -> may attend``."""
        q_ids, k_ids = self.q_ids, self.k_ids

        def mod(b, h, q_idx, kv_idx):
            ok = same_document(q_ids[b, q_idx], k_ids[b, kv_idx])
            return ok & (q_idx >= kv_idx) if causal else ok

        return mod

    def allowed(self, causal: bool) -> torch.Tensor:
        """The boolean ``(B, 1, S_q, S_k)`` mask: ``mask_mod`` over every (b, q, k)."""
        if causal not in self._dense:
            (b, sq), sk, dev = self.q_ids.shape, self.k_ids.shape[1], self.q_ids.device
            self._dense[causal] = self.mask_mod(causal)(
                torch.arange(b, device=dev)[:, None, None, None],
                0,
                torch.arange(sq, device=dev)[None, None, :, None],
                torch.arange(sk, device=dev)[None, None, None, :],
            )
        return self._dense[causal]

    def additive(self, padding_mask, causal: bool, bias, dtype, build) -> torch.Tensor:
        """The additive mask for SDPA / math: ``build(allowed, bias, dtype)`` of this mask narrowed by
        ``padding_mask``. Every layer of a stack passes the same padding mask and bias, so the
        ``(B, h, S_q, S_k)`` tensor is built once per forward and shared (autograd sums the bias's
        gradient over the layers as before)."""
        key = (causal, padding_mask, bias, dtype)
        if self._additive is None or any(a is not b for a, b in zip(self._additive[0], key)):
            allowed = self.allowed(causal)
            if padding_mask is not None:
                allowed = allowed & padding_mask.bool()[:, None, None, :]
            self._additive = (key, build(allowed, bias, dtype))
        return self._additive[1]
