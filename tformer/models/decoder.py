"""Decoder-only family (GPT-like): causal stack + LM head. GPT-2 and Llama flavours differ only in
config switches (positions, norm, FFN, KV heads, biases)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..nn import DocumentMask, StackCache, TransformerStack, positions_from_doc_ids
from .base import Embeddings, ModelOutput, TformerModel, default_positions, vocab_rows
from .block_flops import ffn_flops, head_flops, self_attention_flops
from .mtp import MultiTokenPrediction


class DecoderModel(TformerModel):
    FAMILY = "decoder"
    STACKS = ("decoder",)
    CAUSAL_LM = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.decoder = TransformerStack(cfg, cfg.num_layers, causal=True)
        self.lm_head = vocab_rows(nn.Linear(cfg.d_model, cfg.vocab_size, bias=False), cfg)
        # multi-token prediction (models/mtp.py): training only, kept in checkpoints, never exported
        self.mtp = MultiTokenPrediction(cfg) if cfg.mtp_depth else None
        self.init_weights()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tok.weight

    @classmethod
    def forward_flops(cls, cfg: ModelConfig, batch: int, seq: int, target: int | None) -> int:
        """The trunk and head, plus in training each multi-token prediction depth: its input
        projection, one block (of the index after the trunk's last) and the shared head."""
        flops = super().forward_flops(cfg, batch, seq, target)
        tokens = batch * seq
        for k in range(cfg.mtp_depth):
            index = range(cfg.num_layers + k, cfg.num_layers + k + 1)
            block = self_attention_flops(cfg, tokens, seq, index, causal=True) + ffn_flops(cfg, tokens, index)
            flops += 2 * tokens * 2 * cfg.d_model * cfg.d_model + block + head_flops(cfg, tokens)
        return flops

    def new_cache(self) -> StackCache:
        return StackCache(self.config.num_layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: StackCache | None = None,
        return_logits: bool = True,
        label_smoothing: float = 0.0,
        doc_ids: torch.Tensor | None = None,
        loss_tokens: torch.Tensor | None = None,
    ) -> ModelOutput | torch.Tensor:
        """``labels`` are aligned with ``input_ids`` positions (already shifted), -100 = ignore.
        With ``cache``, ``input_ids`` are the new tokens and ``attention_mask`` covers past + new.
        ``doc_ids`` (B, S) packs documents: attention stays inside each, and positions (unless given)
        restart at every document. ``loss_tokens``: the loss's divisor (``models/base.lm_loss``).
        A pipeline stage (``cut_stage``) takes hidden states for ids after the first stage and
        returns its hidden states before the last."""
        offset = cache.length if cache is not None else 0
        self._check_length(input_ids.shape[1], offset)
        doc_mask = DocumentMask(doc_ids) if doc_ids is not None else None
        if position_ids is None and doc_ids is not None:
            position_ids = positions_from_doc_ids(doc_ids)
        positions = position_ids if position_ids is not None else default_positions(input_ids, offset)
        x = self._embed_or_hidden(input_ids, positions)
        h = self.decoder(x, attention_mask, positions=positions, cache=cache, doc_mask=doc_mask)
        if self.lm_head is None:
            return h
        mtp = None
        if self.mtp is not None and labels is not None and self.training:
            # before the head's loss, which adds every MoE layer's auxiliary loss: the MTP block's too
            mtp = self.mtp(
                h,
                input_ids,
                labels,
                self.embed.tok,
                lambda x, y: self._head_and_lm_loss(x, y, False, label_smoothing=label_smoothing)[1],
                padding_mask=attention_mask,
                positions=positions,
                doc_ids=doc_ids,
                doc_mask=doc_mask,
            )
        logits, loss = self._head_and_loss(
            h, labels, return_logits, label_smoothing=label_smoothing, loss_tokens=loss_tokens
        )
        if mtp is not None and loss is not None:
            loss = loss + self.config.mtp_loss_coef * mtp.to(loss.dtype)
        return ModelOutput(logits, loss, cache)
