"""Multi-token prediction (DeepSeek-V3 section 2.2): ``mtp_depth`` extra modules, depth k
predicting the token k + 1 places ahead of each position.

Depth k reads the previous depth's hidden states (the trunk's output for k = 1) and the embedding
of the token k places ahead, each RMS-normed, concatenated and projected back to ``d_model``, then
one transformer block of the trunk's kind (its own rotary table and final norm); the token
embedding and the output head are the trunk's. Its labels are the trunk's shifted k places left
(the target of position t is the token at t + k + 1), none past the sequence's end or across a
packed document's boundary. The training loss adds ``mtp_loss_coef`` times the mean of the depths'
losses; ``stats["mtp_loss"]`` keeps that mean for the log. The trunk's next-token prediction is
unchanged, and an exported model (HF has no MTP module) leaves these modules out.

Here the trunk's hidden states are read after its final norm (depth k's own norm follows).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..nn import TransformerBlock, TransformerStack, make_norm


def shift_left(x: torch.Tensor, k: int, fill: int) -> torch.Tensor:
    """``x`` (B, S) moved ``k`` places left, the last ``k`` places ``fill``: position t holds x[t + k]."""
    if k == 0:
        return x
    return torch.cat((x[:, k:], x.new_full((x.shape[0], min(k, x.shape[1])), fill)), dim=1)[:, : x.shape[1]]


def mtp_labels(labels: torch.Tensor, k: int, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Depth ``k``'s targets from the trunk's aligned labels (``labels[t]`` = token t + 1): the token
    t + k + 1, i.e. ``labels[t + k]``; -100 past the end and where position t + k lies in another
    packed document than t."""
    out = shift_left(labels, k, -100)
    if doc_ids is not None:
        out = out.masked_fill(shift_left(doc_ids, k, -1) != doc_ids, -100)
    return out


class MTPDepth(nn.Module):
    """One depth: ``proj([norm(h), norm(embedding of the token k ahead)])`` through one block."""

    def __init__(self, cfg, index: int) -> None:
        super().__init__()
        self.h_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.e_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias)
        self.proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.stack = TransformerStack(cfg, 1, causal=True)
        # a block of the trunk's deepest kind (MoE where the trunk's last blocks are)
        self.stack.layers[0] = TransformerBlock(cfg, causal=True, cross=False, index=cfg.num_layers + index)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, padding_mask, positions, doc_mask) -> torch.Tensor:
        x = self.proj(torch.cat((self.h_norm(h), self.e_norm(emb)), dim=-1))
        return self.stack(x, padding_mask, positions=positions, doc_mask=doc_mask)


class MultiTokenPrediction(nn.Module):
    """The ``mtp_depth`` depths; ``forward`` returns the mean of their losses."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.depths = nn.ModuleList(MTPDepth(cfg, k) for k in range(cfg.mtp_depth))
        self.stats: dict[str, torch.Tensor] = {}

    def forward(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        *,
        padding_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
        doc_mask=None,
    ) -> torch.Tensor:
        """``hidden`` (B, S, d) the trunk's output; ``embed`` the shared token embedding; ``loss(h,
        labels)`` the shared head's loss."""
        losses = []
        h = hidden
        for k, depth in enumerate(self.depths, start=1):
            ahead = shift_left(input_ids, k, 0)  # the token k places ahead (0 past the end: unlabelled)
            h = depth(h, embed(ahead), padding_mask, positions, doc_mask)
            losses.append(loss(h, mtp_labels(labels, k, doc_ids)))
        mean = torch.stack(losses).mean()
        self.stats = {"mtp_loss": mean.detach()}
        return mean
