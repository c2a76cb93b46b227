"""Encoder-only family (BERT-like): bidirectional stack + masked-LM head tied to the embeddings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..nn import DocumentMask, TransformerStack, make_norm, positions_from_doc_ids
from ..nn.ffn import FFN_KINDS
from .base import Embeddings, ModelOutput, TformerModel, default_positions, vocab_rows


class EncoderModel(TformerModel):
    FAMILY = "encoder"
    STACKS = ("encoder",)
    HEAD = ("head_dense", "head_norm", "lm_head")
    LM_HEAD_BIAS = True
    MASKED_LM = True

    @classmethod
    def forward_flops(cls, cfg: ModelConfig, batch: int, seq: int, target: int | None) -> int:
        """The stack, the MLM head's dense layer and its vocabulary projection (at every position)."""
        tokens = batch * seq
        return super().forward_flops(cfg, batch, seq, target) + 2 * tokens * cfg.d_model * cfg.d_model

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.encoder = TransformerStack(cfg, cfg.num_layers, causal=False)
        # BERT's MLM head: dense -> activation -> norm -> vocabulary projection (+ its own bias).
        self.head_dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.head_bias)
        act, gated = FFN_KINDS[cfg.activation]
        self.head_act = F.gelu if gated else act  # a gated kind is no one function: its head uses GELU
        self.head_norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.norm_bias, cfg.norm_unit_offset)
        self.lm_head = vocab_rows(nn.Linear(cfg.d_model, cfg.vocab_size, bias=self.LM_HEAD_BIAS), cfg)
        self.init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        doc_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self._check_length(input_ids.shape[1])
        if position_ids is None and doc_ids is not None:
            position_ids = positions_from_doc_ids(doc_ids)
        positions = position_ids if position_ids is not None else default_positions(input_ids)
        x = self._embed_or_hidden(input_ids, positions, token_type_ids)
        doc_mask = DocumentMask(doc_ids) if doc_ids is not None else None
        return self.encoder(x, attention_mask, positions=positions, doc_mask=doc_mask)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        return_logits: bool = True,
        label_smoothing: float = 0.0,
        doc_ids: torch.Tensor | None = None,
        loss_tokens: torch.Tensor | None = None,
        labelled_count: int | None = None,
    ) -> ModelOutput | torch.Tensor:
        """``return_logits=False`` (with labels) runs the MLM head at the masked positions only and
        returns the loss without logits: the same loss and gradients for a fraction of the head.
        ``labelled_count``: how many labels are set, counted on the host (the trainer's batch before
        it moves to the device), so that finding them needs no wait for the device.
        ``doc_ids`` (B, S) packs documents that do not attend to each other (see the decoder).
        A pipeline stage before the last (no ``lm_head``) returns its hidden states."""
        h = self.hidden_states(input_ids, attention_mask, token_type_ids, position_ids, doc_ids)
        if self.lm_head is None:
            return h
        logits, loss = self._head_and_loss(
            h,
            labels,
            return_logits,
            labelled_only=True,
            label_smoothing=label_smoothing,
            loss_tokens=loss_tokens,
            labelled_count=labelled_count,
        )
        return ModelOutput(logits, loss)

    def _head_input(self, h: torch.Tensor) -> torch.Tensor:
        return self.head_norm(self.head_act(self.head_dense(h)))
